"""The codebook types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: grid points times scales.

Each 8-value (IQ2, IQ1) or 4-value (IQ3) group is a point of a fixed grid (``tables.grid``),
with sign bits from a byte or from the 128-entry ``ksigns`` table (IQ2_XXS, IQ2_XS, IQ3_XXS).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ggufcheck.gguf.quants.kernels.common import F32, HALF, JIT, ONE, QUARTER, u16, u32

DELTA = np.float32(0.125)  # IQ1S_DELTA


@njit(**JIT)
def iq2_xxs(src, out, h, grid, ksigns):
    # [d f16][8 x (aux0 u32, aux1 u32)]; sub-block i: db = (d * (0.5 + aux1>>28)) * 0.25
    # l < 4: point grid[byte l of aux0], signs ksigns[(aux1 >> 7l) & 127]; (db * point) * sign
    s2, o2 = src.reshape(-1, 66), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        for i in range(8):
            p = 2 + i * 8
            aux1 = u32(row, p + 4)
            db = d * (HALF + F32(aux1 >> 28)) * QUARTER
            for l in range(4):
                pt = row[p + l]
                sg = ksigns[(aux1 >> (7 * l)) & 127]
                for c in range(8):
                    v = db * grid[pt, c]
                    orow[i * 32 + l * 8 + c] = v * (ONE - F32(2 * ((sg >> c) & 1)))


@njit(**JIT)
def iq2_xs(src, out, h, grid, ksigns):
    # [d f16][qs u16 x32][scales 8]; entry j of 8: point grid[qs & 511], signs ksigns[qs >> 9]
    # scale of j: (scales[j//4] >> 4*((j//2)%2)) & 15; db = (d * (0.5 + sc)) * 0.25
    s2, o2 = src.reshape(-1, 74), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        for j2 in range(16):
            sc = (np.int32(row[66 + (j2 >> 1)]) >> (4 * (j2 & 1))) & 15
            db = d * (HALF + F32(sc)) * QUARTER
            for j in range(2 * j2, 2 * j2 + 2):
                q = u16(row, 2 + 2 * j)
                sg = ksigns[q >> 9]
                pt = q & 511
                for c in range(8):
                    v = db * grid[pt, c]
                    orow[j * 8 + c] = v * (ONE - F32(2 * ((sg >> c) & 1)))


@njit(**JIT)
def iq2_s(src, out, h, grid):
    # [d f16][qs 32][signs 32][qh 8][scales 8]; entry j: grid[qs[j] | ((qh[j//4] >> 2*(j%4)) & 3) << 8]
    # sign bits signs[j]; db of j//2 as IQ2_XS
    s2, o2 = src.reshape(-1, 82), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        for j2 in range(16):
            sc = (np.int32(row[74 + (j2 >> 1)]) >> (4 * (j2 & 1))) & 15
            db = d * (HALF + F32(sc)) * QUARTER
            for j in range(2 * j2, 2 * j2 + 2):
                pt = np.int32(row[2 + j]) | (((np.int32(row[66 + (j >> 2)]) >> (2 * (j & 3))) & 3) << 8)
                sg = row[34 + j]
                for c in range(8):
                    v = db * grid[pt, c]
                    orow[j * 8 + c] = v * (ONE - F32(2 * ((sg >> c) & 1)))


@njit(**JIT)
def iq3_xxs(src, out, h, grid, ksigns):
    # [d f16][qs 64][scales u32 x8]; sub-block i: db = (d * (0.5 + sc>>28)) * 0.5;
    # e = i*32 + l*8 + c: point grid[qs[i*8 + l*2 + c//4]][c%4], sign ksigns[(sc >> 7l) & 127] bit c
    s2, o2 = src.reshape(-1, 98), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        for i in range(8):
            aux = u32(row, 66 + 4 * i)
            db = d * (HALF + F32(aux >> 28)) * HALF
            for l in range(4):
                sg = ksigns[(aux >> (7 * l)) & 127]
                for c in range(8):
                    pt = row[2 + i * 8 + l * 2 + (c >> 2)]
                    v = db * grid[pt, c & 3]
                    orow[i * 32 + l * 8 + c] = v * (ONE - F32(2 * ((sg >> c) & 1)))


@njit(**JIT)
def iq3_s(src, out, h, grid):
    # [d f16][qs 64][qh 8][signs 32][scales 4]; sub-block i: db = d * (1 + 2*sc_i)
    # e = i*32 + l*8 + c: g = e//4: grid[qs[g] | ((qh[g//8] >> g%8) & 1) << 8][c%4]; sign signs[i*4+l] bit c
    s2, o2 = src.reshape(-1, 110), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        for i in range(8):
            sc = (np.int32(row[106 + (i >> 1)]) >> (4 * (i & 1))) & 15
            db = d * F32(1 + 2 * sc)
            for l in range(4):
                sg = row[74 + i * 4 + l]
                for c in range(8):
                    g = i * 8 + l * 2 + (c >> 2)
                    pt = np.int32(row[2 + g]) | (((np.int32(row[66 + (g >> 3)]) >> (g & 7)) & 1) << 8)
                    v = db * grid[pt, c & 3]
                    orow[i * 32 + l * 8 + c] = v * (ONE - F32(2 * ((sg >> c) & 1)))


@njit(**JIT)
def iq1_s(src, out, h, grid):
    # [d f16][qs 32][qh u16 x8]; sub-block i: dl = d * (2*((qh>>12)&7) + 1), delta = -+0.125 by bit 15
    # entry j = i*4 + l: grid[qs[j] | ((qh >> 3l) & 7) << 8]; dl * (point + delta)
    s2, o2 = src.reshape(-1, 50), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        for i in range(8):
            qh = u16(row, 34 + 2 * i)
            dl = d * F32(2 * ((qh >> 12) & 7) + 1)
            delta = -DELTA if qh & 0x8000 else DELTA
            for l in range(4):
                pt = np.int64(row[2 + i * 4 + l]) | (((qh >> (3 * l)) & 7) << 8)
                for c in range(8):
                    orow[i * 32 + l * 8 + c] = dl * (grid[pt, c] + delta)


@njit(**JIT)
def iq1_m(src, out, h, grid):
    # [qs 32][qh 16][scales u16 x4]; d = f16 from the top nibbles of the 4 scale words
    # entry j (0..31): grid[qs[j] | ((qh[j//2] >> 4*(j%2)) & 7) << 8], delta by bit 3 of that nibble
    # scale of j//2 = t: (sc[t//4] >> 3*(t%4)) & 7; dl = d * (2*1); dl * (point + delta)
    s2, o2 = src.reshape(-1, 56), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        w0, w1, w2, w3 = u16(row, 48), u16(row, 50), u16(row, 52), u16(row, 54)
        d = h[((w0 & 0xF000) >> 12) | ((w1 & 0xF000) >> 8) | ((w2 & 0xF000) >> 4) | (w3 & 0xF000)]
        for t in range(16):
            w = u16(row, 48 + 2 * (t >> 2))
            dl = d * F32(2 * ((w >> (3 * (t & 3))) & 7) + 1)
            for j in range(2 * t, 2 * t + 2):
                nib = (np.int64(row[32 + (j >> 1)]) >> (4 * (j & 1))) & 15
                pt = np.int64(row[j]) | ((nib & 7) << 8)
                delta = -DELTA if nib & 8 else DELTA
                for c in range(8):
                    orow[j * 8 + c] = dl * (grid[pt, c] + delta)
