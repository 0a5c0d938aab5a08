"""Which of a GGUF's tensors an engine multiplies activations with, by stored type.

The precision an engine computes in depends on those types (8-bit activation blocks for
quantized weights, tensor-core paths for F32 / F16): both the reference's emulation
(reference/precision.py) and the llama.cpp adapter's statement of its CUDA paths
(engines/llama_cpp.py, whose process must never import torch) read them here, one rule.
"""

from __future__ import annotations

from typing import Mapping


def matmul_weight_types(tensors: Mapping) -> list[str]:
    """The ggml type names of the layers' 2-D+ weights and of the output head (``output.weight``,
    or the token embedding when the head is tied to it), one per tensor; ``tensors``: name ->
    gguf.reader.TensorInfo."""
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return [info.qtype.name for name, info in tensors.items()
            if len(info.ne) >= 2 and (name.startswith("blk.") or name == head)]


def routed_expert_types(tensors: Mapping) -> set[str]:
    """The ggml type names of the routed experts' stacked weights (``*_exps.*``)."""
    return {info.qtype.name for name, info in tensors.items() if "_exps." in name}
