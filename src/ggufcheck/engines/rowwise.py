"""Row-wise kernels over [T, V] log-probability tables: log-softmax, KL / NMSE, top-k.

Every served check turns an engine's logits into a log-softmax table and compares it with the
reference's, row by row, over the whole vocabulary (49k to 262k columns). In numpy each of
those is several whole-row passes with [rows, V] float64 temporaries on one thread: on
SmolLM2 through llama.cpp they took 9 of a 43 s diagnosis (2 cores). Here each row is one
fused pass (two where a mean is needed), rows in parallel, no temporaries.

The arithmetic is numpy's, in float64: the same formulas, summed in row order with a
compensated (Kahan) sum where terms of both signs cancel (the KL of two close
distributions), so values agree with the numpy forms to ~1e-12 relatively
(``tests/engines/test_rowwise.py``). A row with a NaN gives NaN, as numpy does.

numba is imported when a kernel is first used (``import ggufcheck.engines.base`` stays light).
"""

from __future__ import annotations

import numpy as np

_KERNELS: dict | None = None
MAX_K = 64  # top_k inserts into a sorted buffer of k: for larger k numpy's partition is faster


def _compiled() -> dict:
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import math

    from numba import njit, prange

    opts = dict(parallel=True, cache=True, nogil=True, boundscheck=False, fastmath=False)

    @njit(**opts)
    def log_softmax_into(x, out):  # x: [T, V] any float; out: [T, V] float32 / float64
        n, v = x.shape
        for i in prange(n):
            m = -np.inf
            nan = False
            for j in range(v):
                a = np.float64(x[i, j])
                if a != a:
                    nan = True
                elif a > m:
                    m = a
            if nan or m == np.inf:
                for j in range(v):
                    out[i, j] = np.nan
                continue
            s = 0.0
            for j in range(v):
                s += math.exp(np.float64(x[i, j]) - m)
            shift = m + math.log(s)
            for j in range(v):
                out[i, j] = np.float64(x[i, j]) - shift

    @njit(**opts)
    def kl_nmse_rows(ref, eng, rows, kl, nmse):  # KL(ref || eng) and NMSE of the log-probs
        v = ref.shape[1]
        for r in prange(len(rows)):
            t = rows[r]
            k_sum, k_c = 0.0, 0.0  # compensated: KL is a small sum of terms of both signs
            sq = 0.0
            mean = 0.0
            for j in range(v):
                lr = np.float64(ref[t, j])
                d = lr - np.float64(eng[t, j])
                term = math.exp(lr) * d - k_c
                tot = k_sum + term
                k_c = (tot - k_sum) - term
                k_sum = tot
                sq += d * d
                mean += lr
            mean /= v
            var = 0.0
            for j in range(v):
                e = np.float64(ref[t, j]) - mean
                var += e * e
            var /= v
            kl[r] = k_sum
            nmse[r] = (sq / v) / max(var, 1e-30)

    @njit(**opts)
    def top_k_rows(x, k, ids, vals):  # the k largest of each row, largest first (ties: lower id first)
        n, v = x.shape
        for i in prange(n):
            filled = 0
            for j in range(v):
                a = np.float64(x[i, j])
                if a != a:
                    continue  # NaN never ranks (numpy's partition puts it last)
                if filled == k and not a > vals[i, k - 1]:
                    continue
                p = filled if filled < k else k - 1
                while p > 0 and a > vals[i, p - 1]:
                    vals[i, p] = vals[i, p - 1]
                    ids[i, p] = ids[i, p - 1]
                    p -= 1
                vals[i, p] = a
                ids[i, p] = j
                if filled < k:
                    filled += 1
            for j in range(v):  # fewer than k comparable values: NaNs next, by id (as numpy ranks them)
                if filled == k:
                    break
                a = np.float64(x[i, j])
                if a != a:
                    vals[i, filled] = a
                    ids[i, filled] = j
                    filled += 1

    _KERNELS = {"log_softmax": log_softmax_into, "kl_nmse": kl_nmse_rows, "top_k": top_k_rows}
    return _KERNELS


# Set in an engine process that must not start numba's LLVM: llama.cpp's CUDA build segfaults
# there (H200, CUDA 13.0, 2026-12-07: every first score died inside numba's target-context
# initialisation, after libggml-cuda had loaded; tools/gpu/probe_child.py). Its tables are
# then computed with numpy, in blocks of rows, the same formula in float64.
NO_NUMBA = "GGUFCHECK_NO_NUMBA"


def log_softmax_rows(x: np.ndarray, dtype: type = np.float64, out: np.ndarray | None = None) -> np.ndarray:
    """[T, V] row-wise log-softmax of ``x``, computed in float64 and stored as ``dtype`` (into
    ``out`` when given, which may be ``x`` itself: each row is read before it is written)."""
    import os

    x = np.ascontiguousarray(x)
    out = np.empty(x.shape, dtype=dtype) if out is None else out
    if x.size and os.environ.get(NO_NUMBA) == "1":
        _log_softmax_numpy(x, out)
    elif x.size:
        _compiled()["log_softmax"](x, out)
    return out


def _log_softmax_numpy(x: np.ndarray, out: np.ndarray) -> None:
    """The kernel's arithmetic in numpy, a block of rows at a time: a row with a NaN, or whose
    largest value is +inf, is NaN."""
    step = max(1, (1 << 22) // max(x.shape[1], 1))
    for start in range(0, len(x), step):
        block = x[start:start + step].astype(np.float64)
        m = block.max(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", over="ignore"):
            shift = m + np.log(np.exp(block - m).sum(axis=1, keepdims=True))
            rows = block - shift
        bad = np.isnan(block).any(axis=1) | (m[:, 0] == np.inf)
        rows[bad] = np.nan
        out[start:start + step] = rows


def kl_nmse(ref: np.ndarray, eng: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(ref || eng) and the NMSE of the log-probs (mean squared difference over the variance
    of ``ref``'s row) at ``rows`` of two [T, V] log-softmax tables."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    kl, nmse = np.empty(len(rows)), np.empty(len(rows))
    if len(rows):
        _compiled()["kl_nmse"](np.ascontiguousarray(ref), np.ascontiguousarray(eng), rows, kl, nmse)
    return kl, nmse


def top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """([T, k] ids, [T, k] float64 values) of each row's k largest, largest first (NaN ranks
    last). For small k (an insertion per row: k <= MAX_K)."""
    if not 0 <= k <= MAX_K or k > x.shape[1]:
        raise ValueError(f"top_k: k={k} outside 0..min({MAX_K}, {x.shape[1]})")
    x = np.ascontiguousarray(x)
    ids = np.empty((x.shape[0], k), dtype=np.int64)
    vals = np.empty((x.shape[0], k), dtype=np.float64)
    if x.shape[0] and k:
        _compiled()["top_k"](x, int(k), ids, vals)
    return ids, vals
