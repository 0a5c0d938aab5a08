"""The K-quants Q2_K .. Q6_K (256-element super-blocks): plain and streaming-store kernels.

Q3_K has no streaming variant: it measured 0.6-0.8x its plain kernel (``registry.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ggufcheck.gguf.quants.kernels.common import F32, JIT, NEG_ZERO, share, u16
from ggufcheck.gguf.quants.kernels.lanes import fence, lanes


@njit(**JIT)
def q2_k(src, out, h):
    # [scales 16][qs 64][d f16][dmin f16]; e = j*32 + k (j = half*4 + shift):
    # q = (qs[half*32+k] >> 2*shift) & 3; group g = e // 16 = 2j + k//16: (d*sc[g]) * q - (dmin*mn[g])
    s2, o2 = src.reshape(-1, 84), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 80)]
        dmin = h[u16(row, 82)]
        for half in range(2):
            for g2 in range(2):
                sc0, sc1 = row[half * 8 + g2], row[half * 8 + 2 + g2]  # j = half*4 + 0, 1
                sc2, sc3 = row[half * 8 + 4 + g2], row[half * 8 + 6 + g2]  # j = half*4 + 2, 3
                dl0, ml0 = d * F32(sc0 & 15), dmin * F32(sc0 >> 4)
                dl1, ml1 = d * F32(sc1 & 15), dmin * F32(sc1 >> 4)
                dl2, ml2 = d * F32(sc2 & 15), dmin * F32(sc2 >> 4)
                dl3, ml3 = d * F32(sc3 & 15), dmin * F32(sc3 >> 4)
                o = half * 128 + g2 * 16
                for kk in range(16):
                    x = np.int32(row[16 + half * 32 + g2 * 16 + kk])
                    orow[o + kk] = dl0 * F32(x & 3) - ml0
                    orow[o + 32 + kk] = dl1 * F32((x >> 2) & 3) - ml1
                    orow[o + 64 + kk] = dl2 * F32((x >> 4) & 3) - ml2
                    orow[o + 96 + kk] = dl3 * F32(x >> 6) - ml3


@njit(**JIT)
def q2_k_streaming(src, out, h, n_tasks):
    # [scales 16][qs 64][d f16][dmin f16]; e = half*128 + j*32 + k: q = (qs[half*32+k] >> 2j) & 3;
    # scale byte sc = scales[half*8 + 2j + k//16]: (d * (sc & 15)) * q - (dmin * (sc >> 4))
    n = src.size // 84
    for t in prange(n_tasks):
        lo, hi = share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 84, b * 256
            d, dmin = h[u16(src, s + 80)], h[u16(src, s + 82)]
            for half in range(2):
                for g2 in range(2):
                    g = s + half * 8 + g2
                    sc0, sc1 = np.int32(src[g]), np.int32(src[g + 2])
                    sc2, sc3 = np.int32(src[g + 4]), np.int32(src[g + 6])
                    dl0, ml0 = d * F32(sc0 & 15), dmin * F32(sc0 >> 4)
                    dl1, ml1 = d * F32(sc1 & 15), dmin * F32(sc1 >> 4)
                    dl2, ml2 = d * F32(sc2 & 15), dmin * F32(sc2 >> 4)
                    dl3, ml3 = d * F32(sc3 & 15), dmin * F32(sc3 >> 4)
                    for k in range(g2 * 16, g2 * 16 + 16, 4):  # one qs byte feeds all four shifts j
                        e, q = o + half * 128 + k, s + 16 + half * 32 + k
                        lanes(out, e, src, q, 0, 3, src, s, 0, 0, 0, 0, 0, dl0, -ml0)
                        lanes(out, e + 32, src, q, 2, 3, src, s, 0, 0, 0, 0, 0, dl1, -ml1)
                        lanes(out, e + 64, src, q, 4, 3, src, s, 0, 0, 0, 0, 0, dl2, -ml2)
                        lanes(out, e + 96, src, q, 6, 3, src, s, 0, 0, 0, 0, 0, dl3, -ml3)
        fence()


@njit(inline="always")
def _q3_scale(row, i):
    """Q3_K signed 6-bit scale i (0..15): low nibble from bytes 96..103, top 2 bits from 104..107."""
    if i < 8:
        low4 = np.int32(row[96 + i]) & 15
    else:
        low4 = np.int32(row[96 + i - 8]) >> 4
    high2 = (np.int32(row[104 + (i & 3)]) >> (2 * (i >> 2))) & 3
    return F32((low4 | (high2 << 4)) - 32)


@njit(**JIT)
def q3_k(src, out, h):
    # [hmask 32][qs 64][scales 12][d f16]; e = j*32 + k (j = half*4 + shift):
    # low = (qs[half*32+k] >> 2*shift) & 3; high = (hmask[k] >> j) & 1; q = low - 4*(1-high)
    # scale group i = e // 16 = 2j + k//16; (d * sc[i]) * q
    s2, o2 = src.reshape(-1, 110), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 108)]
        for half in range(2):
            for g2 in range(2):
                i0 = half * 8 + g2  # scale index of j = half*4, then +2 per shift step
                dl0, dl1 = d * _q3_scale(row, i0), d * _q3_scale(row, i0 + 2)
                dl2, dl3 = d * _q3_scale(row, i0 + 4), d * _q3_scale(row, i0 + 6)
                o = half * 128 + g2 * 16
                for kk in range(16):
                    k = g2 * 16 + kk
                    x = np.int32(row[32 + half * 32 + k])
                    m = (np.int32(row[k]) >> (4 * half)) ^ 15  # inverted high bits of j = half*4 + 0..3
                    orow[o + kk] = dl0 * F32((x & 3) - ((m & 1) << 2))
                    orow[o + 32 + kk] = dl1 * F32(((x >> 2) & 3) - (((m >> 1) & 1) << 2))
                    orow[o + 64 + kk] = dl2 * F32(((x >> 4) & 3) - (((m >> 2) & 1) << 2))
                    orow[o + 96 + kk] = dl3 * F32((x >> 6) - (((m >> 3) & 1) << 2))


@njit(inline="always")
def _k4_scale_min(row, p, j):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-block j from the 12 bytes at p (get_scale_min_k4)."""
    if j < 4:
        sc = np.int32(row[p + j]) & 63
        mn = np.int32(row[p + 4 + j]) & 63
    else:
        sc = (np.int32(row[p + 4 + j]) & 15) | ((np.int32(row[p + j - 4]) >> 2) & 48)
        mn = (np.int32(row[p + 4 + j]) >> 4) | ((np.int32(row[p + j]) >> 2) & 48)
    return sc, mn


@njit(**JIT)
def q4_k(src, out, h):
    # [d f16][dmin f16][scales 12][qs 128]; e = j*32 + k: (qs[(j//2)*32+k] >> 4*(j%2)) & 15
    # (d*sc[j]) * q - (dmin*mn[j]); one qs byte feeds sub-blocks 2c (low) and 2c+1 (high)
    s2, o2 = src.reshape(-1, 144), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        dmin = h[u16(row, 2)]
        for c in range(4):
            sc0, mn0 = _k4_scale_min(row, 4, 2 * c)
            sc1, mn1 = _k4_scale_min(row, 4, 2 * c + 1)
            dl0, ml0 = d * F32(sc0), dmin * F32(mn0)
            dl1, ml1 = d * F32(sc1), dmin * F32(mn1)
            for k in range(32):
                x = np.int32(row[16 + c * 32 + k])
                orow[c * 64 + k] = dl0 * F32(x & 15) - ml0
                orow[c * 64 + 32 + k] = dl1 * F32(x >> 4) - ml1


@njit(**JIT)
def q4_k_streaming(src, out, h, n_tasks):
    # [d f16][dmin f16][scales 12][qs 128]; e = j*32 + k: (qs[(j//2)*32+k] >> 4*(j%2)) & 15
    # (d*sc[j]) * q - (dmin*mn[j]); one qs byte feeds sub-blocks 2c (low) and 2c+1 (high)
    n = src.size // 144
    for t in prange(n_tasks):
        lo, hi = share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 144, b * 256
            d, dmin = h[u16(src, s)], h[u16(src, s + 2)]
            for c in range(4):
                sc0, mn0 = _k4_scale_min(src, s + 4, 2 * c)
                sc1, mn1 = _k4_scale_min(src, s + 4, 2 * c + 1)
                dl0, ml0 = d * F32(sc0), dmin * F32(mn0)
                dl1, ml1 = d * F32(sc1), dmin * F32(mn1)
                for k in range(0, 32, 4):
                    e, q = o + c * 64 + k, s + 16 + c * 32 + k
                    lanes(out, e, src, q, 0, 15, src, s, 0, 0, 0, 0, 0, dl0, -ml0)
                    lanes(out, e + 32, src, q, 4, 15, src, s, 0, 0, 0, 0, 0, dl1, -ml1)
        fence()


@njit(**JIT)
def q5_k(src, out, h):
    # [d f16][dmin f16][scales 12][qh 32][qs 128]; like Q4_K plus fifth bit (qh[k] >> j) & 1
    s2, o2 = src.reshape(-1, 176), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        dmin = h[u16(row, 2)]
        for c in range(4):
            sc0, mn0 = _k4_scale_min(row, 4, 2 * c)
            sc1, mn1 = _k4_scale_min(row, 4, 2 * c + 1)
            dl0, ml0 = d * F32(sc0), dmin * F32(mn0)
            dl1, ml1 = d * F32(sc1), dmin * F32(mn1)
            for k in range(32):
                x = np.int32(row[48 + c * 32 + k])
                hb = np.int32(row[16 + k]) >> (2 * c)
                orow[c * 64 + k] = dl0 * F32((x & 15) | ((hb & 1) << 4)) - ml0
                orow[c * 64 + 32 + k] = dl1 * F32((x >> 4) | ((hb & 2) << 3)) - ml1


@njit(**JIT)
def q5_k_streaming(src, out, h, n_tasks):
    # [d f16][dmin f16][scales 12][qh 32][qs 128]; like Q4_K plus fifth bit (qh[k] >> j) & 1
    n = src.size // 176
    for t in prange(n_tasks):
        lo, hi = share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 176, b * 256
            d, dmin = h[u16(src, s)], h[u16(src, s + 2)]
            for c in range(4):
                sc0, mn0 = _k4_scale_min(src, s + 4, 2 * c)
                sc1, mn1 = _k4_scale_min(src, s + 4, 2 * c + 1)
                dl0, ml0 = d * F32(sc0), dmin * F32(mn0)
                dl1, ml1 = d * F32(sc1), dmin * F32(mn1)
                for k in range(0, 32, 4):
                    e, q = o + c * 64 + k, s + 48 + c * 32 + k
                    lanes(out, e, src, q, 0, 15, src, s + 16 + k, 2 * c, 1, 4, 0, 0, dl0, -ml0)
                    lanes(out, e + 32, src, q, 4, 15, src, s + 16 + k, 2 * c + 1, 1, 4, 0, 0, dl1, -ml1)
        fence()


@njit(**JIT)
def q6_k(src, out, h):
    # [ql 128][qh 64][scales int8 16][d f16]; e = a*128 + mm*32 + l (a = 0,1; mm < 4; l < 32):
    # low = (ql[a*64 + (mm%2)*32 + l] >> 4*(mm//2)) & 15; high = (qh[a*32 + l] >> 2*mm) & 3
    # q = (low | high<<4) - 32; (d * sc[e//16]) * q
    s2, o2 = src.reshape(-1, 210), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    w = o2.shape[1] >> 4  # 16, opaque to LLVM (+15% measured)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 208)]
        for a in range(2):
            for hl in range(2):
                g = 192 + a * 8 + hl  # scale of (mm, l-half hl) is sc[a*8 + mm*2 + hl]
                dl0, dl1 = d * F32(np.int8(row[g])), d * F32(np.int8(row[g + 2]))
                dl2, dl3 = d * F32(np.int8(row[g + 4])), d * F32(np.int8(row[g + 6]))
                o = a * 128 + hl * 16
                for kk in range(w):
                    l = hl * 16 + kk
                    x0 = np.int32(row[a * 64 + l])
                    x1 = np.int32(row[a * 64 + 32 + l])
                    y = np.int32(row[128 + a * 32 + l])
                    orow[o + kk] = dl0 * F32(((x0 & 15) | ((y & 3) << 4)) - 32)
                    orow[o + 32 + kk] = dl1 * F32(((x1 & 15) | (((y >> 2) & 3) << 4)) - 32)
                    orow[o + 64 + kk] = dl2 * F32(((x0 >> 4) | (((y >> 4) & 3) << 4)) - 32)
                    orow[o + 96 + kk] = dl3 * F32(((x1 >> 4) | ((y >> 6) << 4)) - 32)


@njit(**JIT)
def q6_k_streaming(src, out, h, n_tasks):
    # [ql 128][qh 64][scales int8 16][d f16]; e = a*128 + mm*32 + l (a = 0,1; mm < 4; l < 32):
    # low = (ql[a*64 + (mm%2)*32 + l] >> 4*(mm//2)) & 15; high = (qh[a*32 + l] >> 2*mm) & 3
    # q = (low | high<<4) - 32; (d * sc[e//16]) * q
    n = src.size // 210
    for t in prange(n_tasks):
        lo, hi = share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 210, b * 256
            d = h[u16(src, s + 208)]
            for a in range(2):
                for g2 in range(2):
                    g = s + 192 + a * 8 + g2  # scale of (mm, l-half g2) is sc[a*8 + mm*2 + g2]
                    dl0, dl1 = d * F32(np.int8(src[g])), d * F32(np.int8(src[g + 2]))
                    dl2, dl3 = d * F32(np.int8(src[g + 4])), d * F32(np.int8(src[g + 6]))
                    for l in range(g2 * 16, g2 * 16 + 16, 4):  # two ql bytes and one qh byte feed all four mm
                        e, q0, q1, y = o + a * 128 + l, s + a * 64 + l, s + a * 64 + 32 + l, s + 128 + a * 32 + l
                        lanes(out, e, src, q0, 0, 15, src, y, 0, 3, 4, 0, 32, dl0, NEG_ZERO)
                        lanes(out, e + 32, src, q1, 0, 15, src, y, 2, 3, 4, 0, 32, dl1, NEG_ZERO)
                        lanes(out, e + 64, src, q0, 4, 15, src, y, 4, 3, 4, 0, 32, dl2, NEG_ZERO)
                        lanes(out, e + 96, src, q1, 4, 15, src, y, 6, 3, 4, 0, 32, dl3, NEG_ZERO)
        fence()
