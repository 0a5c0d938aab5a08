"""Torch-facing dequantization: uint8 tensor in, float tensor out, on the tensor's device.

Why: GPU callers (kernel checks, reference layers) hold bytes on a CUDA device and want
float16/bfloat16/float32 there without a round trip. On CUDA, types with a Triton kernel
(``gpu.py``, imported lazily: Triton is optional) run on the device; every other type, and
every CPU tensor, goes through the numba CPU path and is then moved/cast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf
import numpy as np

from ggufcheck.gguf.quants import host, tables

if TYPE_CHECKING:  # pragma: no cover
    import torch

Q = gguf.GGMLQuantizationType

_triton_error: list[str] = []  # why Triton could not be imported (filled on first use)


def _triton_kernels():
    """The gpu module, or None (the reason kept in ``_triton_error``)."""
    if _triton_error:
        return None
    try:
        from ggufcheck.gguf.quants import gpu

        return gpu
    except Exception as err:  # ImportError (no triton), or a broken install
        _triton_error.append(f"triton unavailable: {type(err).__name__}: {err}")
        return None


def gpu_path(qtype: Q) -> str:
    """Which path ``qtype`` takes for a CUDA tensor: 'triton', or 'cpu+copy (<why>)'."""
    if host._numba_unavailable() and host.FORCE_ENV in str(host._numba_unavailable()):
        return f"cpu+copy ({host._numba_unavailable()})"
    gpu = _triton_kernels()
    if gpu is None:
        return f"cpu+copy ({_triton_error[0]})"
    if qtype not in gpu.KERNELS:
        return "cpu+copy (no Triton kernel for this type)"
    return "triton"


def dequantize_torch(raw: "torch.Tensor", qtype: Q, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """uint8 tensor ``(..., row_bytes)`` -> ``dtype`` (default float32) ``(..., row_elements)``.

    Float32 output is bit-exact with gguf-py; float16/bfloat16 output is the float32 value
    rounded once to the narrower type (the same as ``.to(dtype)`` on the float32 result).
    """
    import torch

    dtype = dtype or torch.float32
    block, size = tables.block_geometry(qtype)
    if raw.dtype != torch.uint8 or (raw.dim() and raw.shape[-1] % size):
        raise ValueError(f"{qtype.name}: need uint8 rows of whole {size}-byte blocks, got {raw.dtype} {tuple(raw.shape)}")
    shape = (*raw.shape[:-1], raw.shape[-1] // size * block)
    if raw.device.type == "cuda" and gpu_path(qtype) == "triton":
        return _triton_kernels().dequantize(raw.contiguous(), qtype, dtype).reshape(shape)
    values = host.dequantize(np.ascontiguousarray(raw.cpu().numpy()), qtype)
    out = torch.from_numpy(values).reshape(shape)
    return out.to(device=raw.device, dtype=dtype)
