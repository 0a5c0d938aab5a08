"""The ternary types TQ1_0 (base-3 digits, 1.6875 bits) and TQ2_0 (2-bit fields): values -1, 0, 1 times d."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ggufcheck.gguf.quants.kernels.common import F32, JIT, u16


@njit(**JIT)
def tq1_0(src, out, h, pow3):
    # [qs 48][qh 4][d f16]; base-3 digits: v = (byte * 3**p) mod 256, q = ((v * 3) >> 8) - 1
    # e < 160: p = e//32 of qs[e%32]; e < 240: p = (e-160)//16 of qs[32+(e-160)%16];
    # else p = (e-240)//4 of qh[(e-240)%4]
    s2, o2 = src.reshape(-1, 54), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 52)]
        for p in range(5):
            m = pow3[p]
            for k in range(32):
                v = (np.int32(row[k]) * m) & 255
                orow[p * 32 + k] = d * F32(((v * 3) >> 8) - 1)
            for k in range(16):
                v = (np.int32(row[32 + k]) * m) & 255
                orow[160 + p * 16 + k] = d * F32(((v * 3) >> 8) - 1)
        for p in range(4):
            m = pow3[p]
            for k in range(4):
                v = (np.int32(row[48 + k]) * m) & 255
                orow[240 + p * 4 + k] = d * F32(((v * 3) >> 8) - 1)


@njit(**JIT)
def tq2_0(src, out, h):
    # [qs 64][d f16]; e = j*32 + k (j = half*4 + shift): ((qs[half*32+k] >> 2*shift) & 3) - 1
    s2, o2 = src.reshape(-1, 66), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 64)]
        for j in range(8):
            p, shift = (j >> 2) * 32, 2 * (j & 3)
            for k in range(32):
                orow[j * 32 + k] = d * F32(((np.int32(row[p + k]) >> shift) & 3) - 1)
