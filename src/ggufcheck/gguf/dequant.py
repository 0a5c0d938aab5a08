"""The one dequantization entry point every caller uses.

``dequantize(raw, qtype)`` turns a tensor's raw bytes into float32 values; the shape of the
result is the raw shape with its last (byte) dimension replaced by the row length, and
:func:`dequantize_tensor` reshapes to ``reversed(ne)`` in exactly one place. The ground
truth behind it is ``gguf.quants.dequantize``; a faster bit-exact implementation may
replace the internals without touching any caller (gguf-py stays the tests' oracle).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import gguf
import numpy as np

from ggufcheck.errors import Unavailable
from ggufcheck.gguf import quants

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ggufcheck.gguf.reader import GGUFModel

Q = gguf.GGMLQuantizationType

# integer and f64 tensor types gguf-py's dequantize does not handle: a plain view + cast
_PLAIN_TYPES = {Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64, Q.F64: np.float64}


def dequantize(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Raw uint8 blocks ``(..., row_bytes)`` -> float32 values ``(..., row_elements)``.

    Runs ggufcheck's bit-exact numba kernels (``ggufcheck.gguf.quants``); gguf-py when a type
    has none, numba is missing, or ``GGUFCHECK_DEQUANT=gguf-py`` is set (``quants.cpu_path``
    says which path a type takes).
    """
    if _use_fast_path(qtype):
        return quants.dequantize(np.ascontiguousarray(raw), qtype)
    return dequantize_gguf_py(raw, qtype)


def dequantize_into(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, out: np.ndarray) -> np.ndarray:
    """Like :func:`dequantize` but fills ``out`` (C-contiguous float32, matching size); returns it.

    For scanning big tensors in row chunks into one reused buffer.
    """
    if _use_fast_path(qtype):
        return quants.dequantize_into(np.ascontiguousarray(raw), qtype, out)
    out.reshape(-1)[:] = dequantize_gguf_py(raw, qtype).reshape(-1)
    return out


def _use_fast_path(qtype: gguf.GGMLQuantizationType) -> bool:
    return os.environ.get(quants.FORCE_ENV, "") != "gguf-py" and (qtype in quants.KERNELS or qtype == Q.F32)


def dequantize_gguf_py(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The reference path: gguf-py's numpy dequantization (slow, trusted)."""
    raw = np.ascontiguousarray(raw)
    if qtype in _PLAIN_TYPES:
        return raw.view(_PLAIN_TYPES[qtype]).astype(np.float32)
    if qtype == Q.BF16:
        # gguf-py returns bf16 widened to f32 already; keep its exact semantics
        return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
    try:
        with np.errstate(all="ignore"):  # NaN/Inf scales are reported by the health scan
            out = gguf.quants.dequantize(raw, qtype)
    except NotImplementedError as err:
        raise Unavailable(f"dequantization of {qtype.name} is not implemented: {err}") from None
    return np.asarray(out, dtype=np.float32)


def dequantize_tensor(
    model: "GGUFModel",
    name: str,
    rows: slice | None = None,
    dtype: "torch.dtype | None" = None,
    device: "str | torch.device" = "cpu",
) -> "torch.Tensor":
    """A tensor of ``model`` as torch, shape ``reversed(ne)`` (numpy order).

    ``rows`` selects rows of the flattened 2-D view ``[n_rows, ne0]`` (step 1 only) and
    reads only those bytes; the result is then ``[len(rows), ne0]``.
    """
    import torch

    info = model.tensors[name]
    if str(device) != "cpu" and _use_fast_path(info.qtype) and info.qtype != Q.F32:
        # bytes go to the device; Triton kernels dequantize there (CPU + copy for other types)
        raw = model.raw(name) if rows is None else model.raw_rows(name, *_row_range(rows, info.n_rows))
        shape = info.shape if rows is None else raw.shape[:-1] + (info.row_elements,)
        on_device = torch.from_numpy(np.array(raw)).to(device)  # (..., row_bytes) uint8
        return quants.dequantize_torch(on_device, info.qtype, dtype or torch.float32).reshape(shape)
    if rows is None:
        values = dequantize(model.raw(name), info.qtype).reshape(info.shape)
    else:
        values = dequantize(model.raw_rows(name, *_row_range(rows, info.n_rows)), info.qtype)
    if not values.flags.writeable:  # F32 data is a view of the read-only map: copy it
        values = values.copy()
    out = torch.from_numpy(np.ascontiguousarray(values))
    if dtype is not None and dtype != torch.float32:
        out = out.to(dtype)
    return out.to(device) if str(device) != "cpu" else out


SCRATCH_ELEMENTS = 1 << 20  # float32 values dequantized at a time by dequantize_wide (4 MiB: in cache)


def dequantize_wide(model: "GGUFModel", name: str, start: int, stop: int) -> "torch.Tensor":
    """Rows [start, stop) of ``name``'s 2-D view as float64 on the CPU: the float32 values of
    :func:`dequantize`, exactly. The kernels write float64 themselves where they can (each value
    computed in float32, widened as stored: ``quants.dequantize_into_f64``); other types go a
    cache-sized block of rows at a time through one reused float32 buffer. Dequantizing to fresh
    float32 memory and widening it after took 45% of a streaming decode step (2 cores)."""
    import torch

    info = model.tensors[name]
    out = torch.empty((stop - start, info.row_elements), dtype=torch.float64)
    if stop > start and _use_fast_path(info.qtype) and \
            quants.dequantize_into_f64(model.raw_rows(name, start, stop), info.qtype, out.numpy()):
        return out  # the kernel widened each float32 value as it stored it
    per = max(1, SCRATCH_ELEMENTS // info.row_elements)
    scratch = np.empty(min(per, max(stop - start, 1)) * info.row_elements, dtype=np.float32)
    fast = _use_fast_path(info.qtype)
    for a in range(start, stop, per):
        b = min(a + per, stop)
        raw = model.raw_rows(name, a, b)
        if fast:
            values = quants.dequantize_into(np.ascontiguousarray(raw), info.qtype,
                                            scratch[: (b - a) * info.row_elements].reshape(b - a, -1))
        else:
            values = dequantize_gguf_py(raw, info.qtype)
        out[a - start:b - start].copy_(torch.from_numpy(values))
    return out


def _row_range(rows: slice, n_rows: int) -> tuple[int, int]:
    start, stop, step = rows.indices(n_rows)
    if step != 1:
        raise ValueError("row slices must be contiguous (step 1)")
    return start, max(start, stop)
