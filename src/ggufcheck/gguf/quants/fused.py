"""Fused dequantize-and-statistics pass for the health scan: one read of the quantized bytes.

Why: dequantizing a tensor into a buffer and then scanning that buffer moves every value
through memory twice, and a branchy statistics loop does not vectorize; together they ran the
whole-file scan at ~0.1x the disk read rate. Here each row is decoded into a small scratch row
that stays in L1 (by a *serial* compile of the type's plain kernel, ``registry.KERNELS``) and its
statistics are taken at once with integer tests on the float32 bits (non-finite count, max |x| and the all-zero test
vectorize without fastmath), plus float64 sums in which only reassociation is allowed.

Per row the pass returns: non-finite count, max |x| (as float32 bits), OR of |x| bits (0 means
an all-zero row), sum and sum of squares, and the number and first index of blocks whose f16
scale fields are NaN/Inf. Rows that hold a NaN/Inf are rare (a broken file) and are redone
exactly by the caller through the plain path, which splits NaN from Inf and finds the element.

Why the function copies (``_renamed``): numba caches a function by its qualified name and
source line, and it caches neither closures over dispatchers nor functions that take one as an
argument. A serial compile of ``kernels.kquants.q4_k`` under its own name, and one copy of
``_scan_rows`` per type that calls it through the global ``BLOCKS``, are both ordinary cached
functions. A scan driver's cache name carries a hash of the kernel sources
(``registry.source_digest``) because numba does not notice when a callee in another file changes.
"""

from __future__ import annotations

import types

import gguf
import numba
import numpy as np
from numba import njit, prange

from ggufcheck.gguf.quants import registry

Q = gguf.GGMLQuantizationType

# columns of the per-row result
NONFINITE, ABSMAX_BITS, OR_BITS, SUM, SUM_SQ, BAD_SCALES, FIRST_BAD_SCALE = range(7)
COLUMNS = 7

_SERIAL = dict(cache=True, nogil=True, boundscheck=False)

# Placeholders for ``_scan_rows``: each compiled copy gets its own values (see ``driver``).
BLOCKS = None  # the serial block kernel of one type
OUT_BITS = False  # True where that kernel writes uint32 bits (bf16), not float32
_ABS = np.uint32(0x7FFFFFFF)
_EXP_ALL_ONES = np.uint32(0x7F800000)


@njit(fastmath={"reassoc", "nsz", "contract"}, **_SERIAL)
def _row_stats(values, bits, out):
    """Statistics of one decoded row; NaN/Inf are counted by their bits, not compared."""
    total = 0.0
    total_sq = 0.0
    nonfinite = 0
    absmax = np.uint32(0)
    any_bits = np.uint32(0)
    for i in range(values.size):
        a = bits[i] & _ABS
        nonfinite += a >= _EXP_ALL_ONES
        absmax = max(absmax, a)
        any_bits |= a
        x = np.float64(values[i])
        total += x
        total_sq += x * x
    out[NONFINITE] = nonfinite
    out[ABSMAX_BITS] = absmax
    out[OR_BITS] = any_bits
    out[SUM] = total
    out[SUM_SQ] = total_sq


@njit(**_SERIAL)
def _row_scales(row, block_bytes, scale_offsets, out):
    """Count blocks of one raw row whose f16 scale fields have an all-ones exponent (NaN/Inf)."""
    bad = 0
    first = -1
    for b in range(row.size // block_bytes):
        base = b * block_bytes
        for off in scale_offsets:
            if (row[base + off + 1] & 0x7C) == 0x7C:  # f16 exponent bits, little-endian high byte
                bad += 1
                if first < 0:
                    first = b
                break
    out[BAD_SCALES] = bad
    out[FIRST_BAD_SCALE] = first


@njit(**_SERIAL)
def _copy_f32(src, out):
    """F32 "dequantization": the raw bytes are the values."""
    out[:] = src.view(np.float32)


def _scan_rows(src2d, row_elements, tables, block_bytes, scale_offsets, n_tasks, out):
    """Template, compiled once per type (see ``scan_rows``): BLOCKS / OUT_BITS are per-copy globals."""
    n = src2d.shape[0]
    for t in prange(n_tasks):
        scratch = np.empty(row_elements, np.float32)  # one row, reused: stays in L1/L2
        bits = scratch.view(np.uint32)
        for r in range(t * n // n_tasks, (t + 1) * n // n_tasks):
            row = src2d[r]
            if OUT_BITS:
                BLOCKS(row, bits, *tables)
            else:
                BLOCKS(row, scratch, *tables)
            _row_stats(scratch, bits, out[r])
            if scale_offsets.size:
                _row_scales(row, block_bytes, scale_offsets, out[r])
            else:
                out[r, BAD_SCALES] = 0
                out[r, FIRST_BAD_SCALE] = -1


_SOURCE_HASH = registry.source_digest()
_drivers: dict[Q, object] = {}


def _renamed(func: types.FunctionType, name: str, **extra_globals) -> types.FunctionType:
    """A copy of ``func`` under another (cache) name, optionally with extra globals."""
    globs = func.__globals__ if not extra_globals else {**func.__globals__, **extra_globals}
    copy = types.FunctionType(func.__code__, globs, name, func.__defaults__, func.__closure__)
    copy.__qualname__ = name
    copy.__doc__ = func.__doc__
    return copy


def driver(qtype: Q):
    """The cached parallel scan for one type (F32 or a ``registry.KERNELS`` type)."""
    if qtype not in _drivers:
        if qtype == Q.F32:
            name, blocks, out_bits = "f32", _copy_f32, False
        else:
            kernel = registry.KERNELS[qtype]
            name, out_bits = kernel.name, kernel.out_bits
            blocks = njit(**_SERIAL)(_renamed(kernel.plain().py_func, f"{name}_serial"))
        scan = _renamed(_scan_rows, f"scan_{name}_{_SOURCE_HASH}", BLOCKS=blocks, OUT_BITS=out_bits)
        _drivers[qtype] = njit(parallel=True, **_SERIAL)(scan)
    return _drivers[qtype]


def scan_rows(qtype: Q, src2d: np.ndarray, row_elements: int, tables: tuple, block_bytes: int,
              scale_offsets: tuple[int, ...]) -> np.ndarray:
    """Per-row statistics ``(n_rows, COLUMNS)`` float64 of raw rows ``src2d`` (uint8, 2-D).

    The caller holds the parallel-kernel lock and has chosen the threading layer.
    """
    out = np.empty((src2d.shape[0], COLUMNS), dtype=np.float64)
    if src2d.shape[0]:
        # numba.get_num_threads() inside the driver would make it uncacheable (a runtime pointer)
        n_tasks = min(src2d.shape[0], 16 * numba.get_num_threads())
        offsets = np.asarray(scale_offsets, dtype=np.int64)
        driver(qtype)(src2d, row_elements, tables, block_bytes, offsets, n_tasks, out)
    return out
