"""One-pass statistics of dequantized values, for the health scan.

The scan of a 400 GB model must run near the disk's read rate, so the per-chunk statistics
(NaN and Inf counts, all-zero rows, max |x|, sum and sum of squares) are computed in one
parallel pass by a numba kernel when numba is importable, and by numpy otherwise (several
passes, same results up to float64 summation order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ChunkStats:
    nan: int
    inf: int
    zero_rows: int
    absmax: float
    total: float  # sum of finite values, float64
    total_sq: float  # sum of squares of finite values, float64
    first_bad: int  # flat index of the first NaN/Inf in the chunk, or -1


def _stats_numpy(values: np.ndarray) -> ChunkStats:
    nan = np.isnan(values)
    inf = np.isinf(values)
    bad = nan | inf
    n_bad = int(bad.sum())
    finite = np.where(bad, 0.0, values) if n_bad else values
    zero_rows = int((~finite.any(axis=1) & ~bad.any(axis=1)).sum())
    f64 = finite.astype(np.float64)
    return ChunkStats(
        nan=int(nan.sum()), inf=int(inf.sum()), zero_rows=zero_rows,
        absmax=float(np.abs(finite).max()) if finite.size else 0.0,
        total=float(f64.sum()), total_sq=float(np.square(f64).sum()),
        first_bad=int(np.flatnonzero(bad)[0]) if n_bad else -1,
    )


_kernel = None


def _numba_kernel():
    global _kernel
    if _kernel is None:
        import numba

        @numba.njit(parallel=True, cache=True, fastmath=False)
        def row_stats(values, out):  # values (rows, cols) f32; out (rows, 6) f64
            rows, cols = values.shape
            for r in numba.prange(rows):
                n_nan = 0
                n_inf = 0
                nonzero = 0
                amax = 0.0
                s = 0.0
                sq = 0.0
                first = -1
                for c in range(cols):
                    v = values[r, c]
                    if v != v:
                        n_nan += 1
                        if first < 0:
                            first = c
                    elif v == np.inf or v == -np.inf:
                        n_inf += 1
                        if first < 0:
                            first = c
                    else:
                        if v != 0.0:
                            nonzero = 1
                        a = abs(v)
                        if a > amax:
                            amax = a
                        d = np.float64(v)
                        s += d
                        sq += d * d
                out[r, 0] = n_nan
                out[r, 1] = n_inf
                out[r, 2] = 1.0 if (nonzero == 0 and n_nan == 0 and n_inf == 0) else 0.0
                out[r, 3] = amax
                out[r, 4] = s
                out[r, 5] = sq
                out[r, 6] = first

        _kernel = row_stats
    return _kernel


def chunk_stats(values: np.ndarray) -> ChunkStats:
    """Statistics of a 2-D float32 chunk ``(rows, row_elements)``."""
    try:
        kernel = _numba_kernel()
    except ImportError:
        return _stats_numpy(values)
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty((values.shape[0], 7), dtype=np.float64)
    kernel(values, out)
    bad_rows = np.flatnonzero(out[:, 6] >= 0)
    first_bad = int(bad_rows[0] * values.shape[1] + out[bad_rows[0], 6]) if bad_rows.size else -1
    return ChunkStats(
        nan=int(out[:, 0].sum()), inf=int(out[:, 1].sum()), zero_rows=int(out[:, 2].sum()),
        absmax=float(out[:, 3].max()) if out.shape[0] else 0.0,
        total=float(out[:, 4].sum()), total_sq=float(out[:, 5].sum()), first_bad=first_bad,
    )
