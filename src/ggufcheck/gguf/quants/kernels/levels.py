"""4-bit indices into a table of levels: IQ4_NL, IQ4_XS (non-linear int8 levels), MXFP4, NVFP4 (FP4 E2M1).

The table is an argument (``levels``), the scale a f16 (IQ4), an E8M0 exponent (MXFP4) or
UE4M3 per 16 values (NVFP4), each widened through a 256- or 65536-entry table.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ggufcheck.gguf.quants.kernels.common import F32, JIT, u16


@njit(**JIT)
def iq4_nl(src, out, h, levels):
    # [d f16][qs 16]; e = hi*16 + k: levels[(qs[k] >> 4*hi) & 15]; d * level
    s2, o2 = src.reshape(-1, 18), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        for k in range(16):
            x = row[2 + k]
            orow[k] = d * levels[x & 15]
            orow[16 + k] = d * levels[x >> 4]


@njit(**JIT)
def iq4_xs(src, out, h, levels):
    # [d f16][scales_h u16][scales_l 4][qs 128]; sub-block i of 32: e = i*32 + hi*16 + k
    # sc = ((scales_l[i//2] >> 4*(i%2)) & 15 | ((scales_h >> 2i) & 3) << 4) - 32; (d*sc) * level
    s2, o2 = src.reshape(-1, 136), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        sh = u16(row, 2)
        for i in range(8):
            lo = (np.int32(row[4 + (i >> 1)]) >> (4 * (i & 1))) & 15
            hi = np.int32((sh >> (2 * i)) & 3)
            dl = d * F32((lo | (hi << 4)) - 32)
            p = 8 + i * 16
            for k in range(16):
                x = row[p + k]
                orow[i * 32 + k] = dl * levels[x & 15]
                orow[i * 32 + 16 + k] = dl * levels[x >> 4]


@njit(**JIT)
def mxfp4(src, out, e8m0, levels):
    # [e u8][qs 16]; d = 2**(e-128); e = hi*16 + k; d * level
    s2, o2 = src.reshape(-1, 17), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = e8m0[row[0]]
        for k in range(16):
            x = row[1 + k]
            orow[k] = d * levels[x & 15]
            orow[16 + k] = d * levels[x >> 4]


@njit(**JIT)
def nvfp4(src, out, ue4m3, levels):
    # [d ue4m3 x4][qs 32]; sub-block g of 16: e = g*16 + hi*8 + k: level of (qs[g*8+k] >> 4*hi)
    s2, o2 = src.reshape(-1, 36), out.reshape(-1, 64)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        for g in range(4):
            d = ue4m3[row[g]]
            for k in range(8):
                x = row[4 + g * 8 + k]
                orow[g * 16 + k] = d * levels[x & 15]
                orow[g * 16 + 8 + k] = d * levels[x >> 4]
