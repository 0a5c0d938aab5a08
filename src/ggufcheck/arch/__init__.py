"""Architectures: what a GGUF of each supported family must contain, and how it maps to HF.

The data flow, one module each:

- ``spec``        GGUF metadata -> a frozen :class:`~ggufcheck.arch.spec.ArchSpec` (dims, rope /
                  YaRN, MLA, MoE, indexer, NextN), with findings naming every bad key
- ``known``       metadata of real large models (GLM-5, GLM-5.2, DeepSeek-V3) without the files
- ``table``       tensor-table types: rows, shard rules, shape expressions, expansion per layer
- ``tables/``     the rows, as data, one module per family, each fact citing its source
- ``transforms``  GGUF <-> HF layout transforms (llama q/k permutation, kv_b, experts), each
                  with its exact inverse
- ``rebuild``     a GGUF's weights in HF layout (checkpoint or transformers 5.x modules), lazily
"""

from ggufcheck.arch.spec import (ArchSpec, Finding, GenericSpec, SpecError, build_spec,
                                 spec_for_model, spec_from_metadata)
from ggufcheck.arch.tables import table_for

__all__ = ["ArchSpec", "Finding", "GenericSpec", "SpecError", "build_spec", "spec_for_model",
           "spec_from_metadata", "table_for"]
