"""What every kernel family shares: the compile options, little-endian byte readers, constants."""

from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32
HALF = np.float32(0.5)
QUARTER = np.float32(0.25)
ONE = np.float32(1.0)
NEG_ZERO = np.float32(-0.0)  # the add of a multiply-only streaming lane: x + (-0.0) == x for every x

JIT = dict(parallel=True, cache=True, nogil=True, boundscheck=False)


@njit(inline="always")
def u16(src, i):
    return np.int64(src[i]) | (np.int64(src[i + 1]) << 8)


@njit(inline="always")
def u32(src, i):
    return (np.int64(src[i]) | (np.int64(src[i + 1]) << 8) | (np.int64(src[i + 2]) << 16)
            | (np.int64(src[i + 3]) << 24))


@njit(inline="always")
def share(n_blocks, t, n_tasks):
    """Task t's contiguous range of blocks (the streaming kernels split into ``n_tasks`` shares)."""
    return t * n_blocks // n_tasks, (t + 1) * n_blocks // n_tasks
