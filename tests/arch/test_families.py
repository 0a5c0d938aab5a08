"""Walk the architecture registry (arch/families.py): a family cannot be half-added.

Each declared family needs its tensor table, its reference module, the transformers
model_type that rebuilds it, tiny-builder dimensions and a converter config, and a tiny file
of it must read back with the declared flags and run through the reference; the metadata
rules and the fault catalogue take their lists from the registry."""

from __future__ import annotations

import importlib

import pytest
import torch

from ggufcheck.arch.families import FAMILIES, archs
from ggufcheck.arch.spec import DEFAULT_GATING, MLA_ARCHS, MOE_ARCHS, PAIRING, SUPPORTED, spec_for_model
from ggufcheck.arch.tables import table_for


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_family_is_complete(arch, tiny_gguf):
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.reference.model import ReferenceModel
    from ggufcheck.synthetic import tiny
    from ggufcheck.testing import convert

    fam = FAMILIES[arch]
    assert table_for(arch) is not None and table_for(arch).arch == arch
    assert callable(importlib.import_module(f"ggufcheck.reference.{fam.reference}").forward_layer)
    assert arch in tiny.DEFAULT_DIMS and arch in convert.HF_CONFIGS
    if fam.moe:
        assert fam.gating in ("softmax", "sigmoid"), "a MoE family says its gating when the key is absent"
    path = tiny_gguf(arch, seed=1).path
    with open_gguf(path) as model:
        spec, findings = spec_for_model(model)
    assert not findings
    assert (spec.mla is not None, spec.moe is not None, spec.indexer is not None) == (fam.mla, fam.moe, fam.indexer)
    assert spec.rope.pairing.value == fam.rope
    with ReferenceModel(path, dtype="fp32") as ref:
        logits = ref.forward([1, 2, 3, 4])[0]
    assert logits.shape[0] == 4 and bool(torch.isfinite(logits).all())


def test_the_family_lists_come_from_the_registry():
    from ggufcheck.arch.hf_config import MODEL_TYPES
    from ggufcheck.reference.config import FAMILIES as REFERENCE_MODULES
    from ggufcheck.testing.faults import ALL_ARCHS, FAULTS

    assert SUPPORTED == archs() and set(MLA_ARCHS) == set(archs(mla=True)) and set(MOE_ARCHS) == set(archs(moe=True))
    assert set(PAIRING) == set(FAMILIES) and set(DEFAULT_GATING) == set(archs(moe=True))
    assert set(REFERENCE_MODULES) == set(FAMILIES) and set(MODEL_TYPES) == set(FAMILIES)
    assert ALL_ARCHS == set(FAMILIES)
    for arch in FAMILIES:  # every family is covered by the catalogue's general faults
        assert sum(f.applies_to(arch) for f in FAULTS.values()) >= 5, arch


def test_model_types_are_transformers_own():
    transformers = pytest.importorskip("transformers")
    for arch, fam in FAMILIES.items():
        transformers.AutoConfig.for_model(fam.hf_model_type)  # raises on an unknown model_type
