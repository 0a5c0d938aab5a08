"""CPU dequantization: route each type to its numba kernel, or to gguf-py when numba is absent.

Why a separate module: the kernels (``kernels/``) need numba; this file works without it. Which
kernel serves a type is ``registry.KERNELS``; outputs past twice the last-level cache take the
type's streaming-store variant where it has one (``registry.streams``).
If numba is missing, a kernel fails to compile, or ``GGUFCHECK_DEQUANT=gguf-py`` is set, the
call falls back to gguf-py's numpy code (bit-exact by definition, just slow) and
:func:`cpu_path` says which path a type takes and why.
"""

from __future__ import annotations

import os
import threading
import gguf
import numpy as np

from ggufcheck.gguf.quants import registry, tables
from ggufcheck.gguf.quants.registry import KERNELS

Q = gguf.GGMLQuantizationType

FORCE_ENV = "GGUFCHECK_DEQUANT"  # "gguf-py" forces the reference path everywhere


_broken: dict[Q, str] = {}  # types whose kernel failed to compile or run -> why
_broken_fused: dict[Q, str] = {}  # same, for the fused health-scan pass
_broken_streaming: dict[Q, str] = {}  # same, for the streaming-store kernels of large outputs
_broken_wide: dict[Q, str] = {}  # same, for the plain kernels writing float64
# numba's 'workqueue' threads sleep when idle; the OpenMP layer it picks when torch brought
# libgomp spin-waits, which measured 4x slower on a shared 2-core machine. workqueue must not be
# entered from two Python threads at once, hence the lock (each call uses every core anyway).
_kernel_lock = threading.Lock()
_table_cache: dict[Q, tuple[np.ndarray, ...]] = {}


def _numba_unavailable() -> str | None:
    if os.environ.get(FORCE_ENV, "").lower() in ("gguf-py", "gguf_py", "reference"):
        return f"{FORCE_ENV}={os.environ[FORCE_ENV]}"
    try:
        import numba  # noqa: F401
    except Exception as err:  # ImportError, or a broken llvmlite
        return f"numba unavailable: {err}"
    return None


def cpu_path(qtype: Q) -> str:
    """Which CPU path ``qtype`` takes now: 'numba', 'copy', or 'gguf-py (<why>)'."""
    if qtype == Q.F32:
        return "copy"
    if qtype not in KERNELS:
        return "gguf-py (no numba kernel for this type)"
    why = _numba_unavailable() or _broken.get(qtype)
    return f"gguf-py ({why})" if why else "numba"


def dequantize_into(raw: np.ndarray, qtype: Q, out: np.ndarray) -> np.ndarray:
    """Dequantize whole blocks ``raw`` (uint8, any shape, C-contiguous) into float32 ``out``.

    ``out`` must be C-contiguous float32 with ``raw.size // type_size * block_size`` elements
    (any shape); it is returned. Use it to fill a preallocated buffer row chunk by chunk.
    """
    block, size = tables.block_geometry(qtype)
    if raw.dtype != np.uint8 or raw.size % size:
        raise ValueError(f"{qtype.name}: raw must be uint8 whole blocks of {size} bytes, got {raw.dtype} x {raw.size}")
    n_out = raw.size // size * block
    if out.dtype != np.float32 or out.size != n_out or not out.flags.c_contiguous:
        raise ValueError(f"{qtype.name}: out must be C-contiguous float32 of {n_out} elements")
    src = np.ascontiguousarray(raw).reshape(-1)  # (n_bytes,)
    flat = out.reshape(-1)  # (n_elements,)
    if qtype == Q.F32:
        flat[:] = src.view(np.float32)
        return out
    if cpu_path(qtype) == "numba" and _run_kernel(qtype, src, flat):
        return out
    with np.errstate(all="ignore"):  # NaN/Inf scales are data here, not errors
        flat[:] = _gguf_py(src, qtype).reshape(-1)
    return out


def dequantize_into_f64(raw: np.ndarray, qtype: Q, out: np.ndarray) -> bool:
    """Dequantize into C-contiguous float64 ``out`` straight from the plain kernel, which computes
    each value in float32 and widens it as it stores it (exactly ``dequantize(...).astype(float64)``:
    a test holds every kernel to that); False where no such kernel serves ``qtype`` (BF16 writes
    bits, F32 is a copy, numba missing or broken): the caller widens float32 values itself."""
    spec = KERNELS.get(qtype)
    if spec is None or spec.out_bits or cpu_path(qtype) != "numba" or qtype in _broken_wide:
        return False
    block, size = tables.block_geometry(qtype)
    if raw.dtype != np.uint8 or raw.size % size or out.dtype != np.float64 or out.size != raw.size // size * block:
        raise ValueError(f"{qtype.name}: need whole uint8 blocks and a float64 out of matching size")
    try:
        _prefer_workqueue()
        if qtype not in _table_cache:
            _table_cache[qtype] = spec.tables()
        with _kernel_lock:
            spec.plain()(np.ascontiguousarray(raw).reshape(-1), out.reshape(-1), *_table_cache[qtype])
        return True
    except Exception as err:  # numba TypingError / LoweringError: the float32 path still serves
        _broken_wide[qtype] = f"float64 kernel failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return False


def dequantize(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Raw blocks ``(..., row_bytes)`` -> float32 ``(..., row_elements)``, like gguf-py."""
    block, size = tables.block_geometry(qtype)
    if raw.shape and raw.shape[-1] % size:
        raise ValueError(f"{qtype.name}: row of {raw.shape[-1]} bytes is not whole blocks of {size}")
    shape = (*raw.shape[:-1], raw.shape[-1] // size * block) if raw.shape else (raw.size // size * block,)
    out = np.empty(shape, dtype=np.float32)
    return dequantize_into(raw, qtype, out)


def _run_kernel(qtype: Q, src: np.ndarray, out: np.ndarray) -> bool:
    """Run the numba kernel; on a compile/run failure remember why and return False."""
    spec = KERNELS[qtype]
    try:
        _prefer_workqueue()
        if qtype not in _table_cache:
            _table_cache[qtype] = spec.tables()
        kernel = spec.plain()
        with _kernel_lock:
            if qtype not in _broken_streaming and registry.streams(qtype, out):
                try:
                    spec.streamer()(src, out, *_table_cache[qtype], _stream_tasks())
                    return True
                except Exception as err:  # the plain kernel below still serves the type
                    _broken_streaming[qtype] = f"streaming kernel failed: {type(err).__name__}: {err}"[:240]
            kernel(src, out.view(np.uint32) if spec.out_bits else out, *_table_cache[qtype])
        return True
    except Exception as err:  # numba TypingError / LoweringError, llvmlite failures
        _broken[qtype] = f"numba kernel failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return False


def fused_row_stats(raw2d: np.ndarray, qtype: Q, scale_offsets: tuple[int, ...]) -> np.ndarray | None:
    """Per-row health statistics of raw rows ``(n_rows, row_bytes)`` in one fused pass.

    Returns ``(n_rows, fused.COLUMNS)`` float64 (see ``fused.py``), or None when the fused
    path is unavailable for ``qtype`` (no numba, ``GGUFCHECK_DEQUANT=gguf-py``, no kernel, or
    a compile failure, remembered like the kernels' own); the caller then takes the plain path.
    """
    if cpu_path(qtype) not in ("numba", "copy") or _numba_unavailable() or qtype in _broken_fused:
        return None
    block, size = tables.block_geometry(qtype)
    try:
        from ggufcheck.gguf.quants import fused

        _prefer_workqueue()
        if qtype != Q.F32 and qtype not in _table_cache:
            _table_cache[qtype] = KERNELS[qtype].tables()
        tabs = () if qtype == Q.F32 else _table_cache[qtype]
        src = np.ascontiguousarray(raw2d)
        with _kernel_lock:
            return fused.scan_rows(qtype, src, src.shape[1] // size * block, tabs, size, scale_offsets)
    except Exception as err:  # numba TypingError / LoweringError, llvmlite failures
        _broken_fused[qtype] = f"fused scan failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return None


def _stream_tasks() -> int:
    import numba

    return 4 * numba.get_num_threads()  # passed in: get_num_threads() inside a kernel defeats caching


def _prefer_workqueue() -> None:
    """Use numba's sleeping 'workqueue' threads unless the user chose a layer (NUMBA_THREADING_LAYER)."""
    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ and numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER = "workqueue"


def _gguf_py(src: np.ndarray, qtype: Q) -> np.ndarray:
    import gguf.quants

    if qtype == Q.F16:
        return src.view(np.float16).astype(np.float32)
    return np.asarray(gguf.quants.dequantize(src, qtype), dtype=np.float32)
