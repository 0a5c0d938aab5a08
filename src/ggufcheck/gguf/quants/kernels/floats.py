"""F16 and BF16: no blocks, one table lookup or one shift per value."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ggufcheck.gguf.quants.kernels.common import JIT, u16


@njit(**JIT)
def f16(src, out, h):
    for i in prange(src.size // 2):
        out[i] = h[u16(src, 2 * i)]


@njit(**JIT)
def bf16(src, out_bits):  # out_bits: the float32 output viewed as uint32
    for i in prange(src.size // 2):
        out_bits[i] = np.uint32(u16(src, 2 * i)) << np.uint32(16)
