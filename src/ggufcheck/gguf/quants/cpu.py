"""Numba CPU kernels: one per GGUF block type, bit-exact with gguf-py's numpy code.

Why: gguf-py's vectorized numpy dequantization runs at tens of MB/s on a 2-core machine; a
400 GB model needs GB/s. Each kernel walks the blocks in parallel (``prange``) and writes
float32 straight into the caller's buffer, with no temporaries. Per block, each source
byte is read once and its fields are split with constant shifts (``x & 3``, ``(x >> 2) & 3``,
...) into the outputs it feeds: that shape is what LLVM vectorizes (2-4x over a loop with
a per-element variable shift, measured on the K-quants).

Vectorizing: a per-block loop with a constant trip count (``range(32)``) is fully unrolled by
LLVM and then left to the SLP vectorizer, which must keep every load of ``row`` after the
previous store to ``orow`` (it cannot prove the two arrays apart), so it emits scalar code.
Where that mattered (Q8_0, Q4_0, Q4_1, Q6_K) the trip count is read from the output's shape
(``w = o2.shape[1]``, i.e. 32, unknown at compile time): the loop vectorizer then takes the
loop, with a runtime overlap check, and emits 8-wide int->float converts and multiplies
(1.5-2x measured into a reused buffer, reaching the machine's fill rate). Types whose inner
loop is a table lookup (IQ4_NL) or which SLP already vectorizes (Q2_K) measured no faster
that way and keep constant trip counts.

Bit-exactness rules followed everywhere (gguf-py is the oracle):
- every value is float32 and every product/sum is one float32 IEEE operation, in gguf-py's
  order (e.g. Q4_1 is ``(d * q) + m``, two roundings; no fused multiply-add: numba emits no
  FMA without ``fastmath``);
- float16 scales are widened through a 65536-entry table built by numpy's own conversion;
- integer field unpacking mirrors gguf-py's reshapes; the comment above each kernel gives
  the element order as ``e = ...``.

Every kernel has the signature ``kernel(src, out, *tables)``: ``src`` is the flat uint8
bytes of whole blocks, ``out`` the flat float32 output (``n_blocks * block_elements``);
inside, ``row``/``orow`` are one block's bytes and values.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F32 = np.float32
HALF = np.float32(0.5)
QUARTER = np.float32(0.25)
ONE = np.float32(1.0)
DELTA = np.float32(0.125)  # IQ1S_DELTA

_JIT = dict(parallel=True, cache=True, nogil=True, boundscheck=False)


@njit(inline="always")
def _u16(src, i):
    return np.int64(src[i]) | (np.int64(src[i + 1]) << 8)


@njit(inline="always")
def _u32(src, i):
    return (np.int64(src[i]) | (np.int64(src[i + 1]) << 8) | (np.int64(src[i + 2]) << 16)
            | (np.int64(src[i + 3]) << 24))


# ---- plain float types -------------------------------------------------------------------

@njit(**_JIT)
def f16(src, out, h):
    for i in prange(src.size // 2):
        out[i] = h[_u16(src, 2 * i)]


@njit(**_JIT)
def bf16(src, out_bits):  # out_bits: the float32 output viewed as uint32
    for i in prange(src.size // 2):
        out_bits[i] = np.uint32(_u16(src, 2 * i)) << np.uint32(16)


# ---- 32-element blocks -------------------------------------------------------------------

@njit(**_JIT)
def q4_0(src, out, h):
    # [d f16][qs 16]; e = hi*16 + k: (qs[k] >> 4*hi) & 15, minus 8; d * q
    s2, o2 = src.reshape(-1, 18), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    w = o2.shape[1] >> 1  # 16, opaque to LLVM: see "vectorizing" above
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        for k in range(w):
            x = np.int32(row[2 + k])
            orow[k] = d * F32((x & 15) - 8)
            orow[16 + k] = d * F32((x >> 4) - 8)


@njit(**_JIT)
def q4_1(src, out, h):
    # [d f16][m f16][qs 16]; (d * q) + m
    s2, o2 = src.reshape(-1, 20), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    w = o2.shape[1] >> 1  # 16, opaque to LLVM
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        m = h[_u16(row, 2)]
        for k in range(w):
            x = np.int32(row[4 + k])
            orow[k] = d * F32(x & 15) + m
            orow[16 + k] = d * F32(x >> 4) + m


@njit(**_JIT)
def q5_0(src, out, h):
    # [d f16][qh u32][qs 16]; e = hi*16 + k; fifth bit = (qh >> e) & 1; q - 16
    s2, o2 = src.reshape(-1, 22), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        qh = _u32(row, 2)
        for k in range(16):
            x = np.int32(row[6 + k])
            lo = (x & 15) | np.int32(((qh >> k) & 1) << 4)
            hi = (x >> 4) | np.int32(((qh >> (k + 16)) & 1) << 4)
            orow[k] = d * F32(lo - 16)
            orow[16 + k] = d * F32(hi - 16)


@njit(**_JIT)
def q5_1(src, out, h):
    # [d f16][m f16][qh u32][qs 16]; (d * q) + m
    s2, o2 = src.reshape(-1, 24), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        m = h[_u16(row, 2)]
        qh = _u32(row, 4)
        for k in range(16):
            x = np.int32(row[8 + k])
            lo = (x & 15) | np.int32(((qh >> k) & 1) << 4)
            hi = (x >> 4) | np.int32(((qh >> (k + 16)) & 1) << 4)
            orow[k] = d * F32(lo) + m
            orow[16 + k] = d * F32(hi) + m


@njit(**_JIT)
def q8_0(src, out, h):
    # [d f16][qs int8 32]; x * d
    s2, o2 = src.reshape(-1, 34), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    w = o2.shape[1]  # 32, opaque to LLVM
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        for k in range(w):
            orow[k] = F32(np.int8(row[2 + k])) * d


@njit(**_JIT)
def iq4_nl(src, out, h, levels):
    # [d f16][qs 16]; e = hi*16 + k: levels[(qs[k] >> 4*hi) & 15]; d * level
    s2, o2 = src.reshape(-1, 18), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        for k in range(16):
            x = row[2 + k]
            orow[k] = d * levels[x & 15]
            orow[16 + k] = d * levels[x >> 4]


@njit(**_JIT)
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


@njit(**_JIT)
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


# ---- K-quants (256-element super-blocks) -------------------------------------------------

@njit(**_JIT)
def q2_k(src, out, h):
    # [scales 16][qs 64][d f16][dmin f16]; e = j*32 + k (j = half*4 + shift):
    # q = (qs[half*32+k] >> 2*shift) & 3; group g = e // 16 = 2j + k//16: (d*sc[g]) * q - (dmin*mn[g])
    s2, o2 = src.reshape(-1, 84), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 80)]
        dmin = h[_u16(row, 82)]
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


@njit(inline="always")
def _q3_scale(row, i):
    """Q3_K signed 6-bit scale i (0..15): low nibble from bytes 96..103, top 2 bits from 104..107."""
    if i < 8:
        low4 = np.int32(row[96 + i]) & 15
    else:
        low4 = np.int32(row[96 + i - 8]) >> 4
    high2 = (np.int32(row[104 + (i & 3)]) >> (2 * (i >> 2))) & 3
    return F32((low4 | (high2 << 4)) - 32)


@njit(**_JIT)
def q3_k(src, out, h):
    # [hmask 32][qs 64][scales 12][d f16]; e = j*32 + k (j = half*4 + shift):
    # low = (qs[half*32+k] >> 2*shift) & 3; high = (hmask[k] >> j) & 1; q = low - 4*(1-high)
    # scale group i = e // 16 = 2j + k//16; (d * sc[i]) * q
    s2, o2 = src.reshape(-1, 110), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 108)]
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


@njit(**_JIT)
def q4_k(src, out, h):
    # [d f16][dmin f16][scales 12][qs 128]; e = j*32 + k: (qs[(j//2)*32+k] >> 4*(j%2)) & 15
    # (d*sc[j]) * q - (dmin*mn[j]); one qs byte feeds sub-blocks 2c (low) and 2c+1 (high)
    s2, o2 = src.reshape(-1, 144), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        dmin = h[_u16(row, 2)]
        for c in range(4):
            sc0, mn0 = _k4_scale_min(row, 4, 2 * c)
            sc1, mn1 = _k4_scale_min(row, 4, 2 * c + 1)
            dl0, ml0 = d * F32(sc0), dmin * F32(mn0)
            dl1, ml1 = d * F32(sc1), dmin * F32(mn1)
            for k in range(32):
                x = np.int32(row[16 + c * 32 + k])
                orow[c * 64 + k] = dl0 * F32(x & 15) - ml0
                orow[c * 64 + 32 + k] = dl1 * F32(x >> 4) - ml1


@njit(**_JIT)
def q5_k(src, out, h):
    # [d f16][dmin f16][scales 12][qh 32][qs 128]; like Q4_K plus fifth bit (qh[k] >> j) & 1
    s2, o2 = src.reshape(-1, 176), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        dmin = h[_u16(row, 2)]
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


@njit(**_JIT)
def q6_k(src, out, h):
    # [ql 128][qh 64][scales int8 16][d f16]; e = a*128 + mm*32 + l (a = 0,1; mm < 4; l < 32):
    # low = (ql[a*64 + (mm%2)*32 + l] >> 4*(mm//2)) & 15; high = (qh[a*32 + l] >> 2*mm) & 3
    # q = (low | high<<4) - 32; (d * sc[e//16]) * q
    s2, o2 = src.reshape(-1, 210), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    w = o2.shape[1] >> 4  # 16, opaque to LLVM (+15% measured)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 208)]
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


@njit(**_JIT)
def iq4_xs(src, out, h, levels):
    # [d f16][scales_h u16][scales_l 4][qs 128]; sub-block i of 32: e = i*32 + hi*16 + k
    # sc = ((scales_l[i//2] >> 4*(i%2)) & 15 | ((scales_h >> 2i) & 3) << 4) - 32; (d*sc) * level
    s2, o2 = src.reshape(-1, 136), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        sh = _u16(row, 2)
        for i in range(8):
            lo = (np.int32(row[4 + (i >> 1)]) >> (4 * (i & 1))) & 15
            hi = np.int32((sh >> (2 * i)) & 3)
            dl = d * F32((lo | (hi << 4)) - 32)
            p = 8 + i * 16
            for k in range(16):
                x = row[p + k]
                orow[i * 32 + k] = dl * levels[x & 15]
                orow[i * 32 + 16 + k] = dl * levels[x >> 4]


@njit(**_JIT)
def tq1_0(src, out, h, pow3):
    # [qs 48][qh 4][d f16]; base-3 digits: v = (byte * 3**p) mod 256, q = ((v * 3) >> 8) - 1
    # e < 160: p = e//32 of qs[e%32]; e < 240: p = (e-160)//16 of qs[32+(e-160)%16];
    # else p = (e-240)//4 of qh[(e-240)%4]
    s2, o2 = src.reshape(-1, 54), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 52)]
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


@njit(**_JIT)
def tq2_0(src, out, h):
    # [qs 64][d f16]; e = j*32 + k (j = half*4 + shift): ((qs[half*32+k] >> 2*shift) & 3) - 1
    s2, o2 = src.reshape(-1, 66), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 64)]
        for j in range(8):
            p, shift = (j >> 2) * 32, 2 * (j & 3)
            for k in range(32):
                orow[j * 32 + k] = d * F32(((np.int32(row[p + k]) >> shift) & 3) - 1)


# ---- IQ types: codebook lookups ----------------------------------------------------------

@njit(**_JIT)
def iq2_xxs(src, out, h, grid, ksigns):
    # [d f16][8 x (aux0 u32, aux1 u32)]; sub-block i: db = (d * (0.5 + aux1>>28)) * 0.25
    # l < 4: point grid[byte l of aux0], signs ksigns[(aux1 >> 7l) & 127]; (db * point) * sign
    s2, o2 = src.reshape(-1, 66), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        for i in range(8):
            p = 2 + i * 8
            aux1 = _u32(row, p + 4)
            db = d * (HALF + F32(aux1 >> 28)) * QUARTER
            for l in range(4):
                pt = row[p + l]
                sg = ksigns[(aux1 >> (7 * l)) & 127]
                for c in range(8):
                    v = db * grid[pt, c]
                    orow[i * 32 + l * 8 + c] = v * (ONE - F32(2 * ((sg >> c) & 1)))


@njit(**_JIT)
def iq2_xs(src, out, h, grid, ksigns):
    # [d f16][qs u16 x32][scales 8]; entry j of 8: point grid[qs & 511], signs ksigns[qs >> 9]
    # scale of j: (scales[j//4] >> 4*((j//2)%2)) & 15; db = (d * (0.5 + sc)) * 0.25
    s2, o2 = src.reshape(-1, 74), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        for j2 in range(16):
            sc = (np.int32(row[66 + (j2 >> 1)]) >> (4 * (j2 & 1))) & 15
            db = d * (HALF + F32(sc)) * QUARTER
            for j in range(2 * j2, 2 * j2 + 2):
                q = _u16(row, 2 + 2 * j)
                sg = ksigns[q >> 9]
                pt = q & 511
                for c in range(8):
                    v = db * grid[pt, c]
                    orow[j * 8 + c] = v * (ONE - F32(2 * ((sg >> c) & 1)))


@njit(**_JIT)
def iq2_s(src, out, h, grid):
    # [d f16][qs 32][signs 32][qh 8][scales 8]; entry j: grid[qs[j] | ((qh[j//4] >> 2*(j%4)) & 3) << 8]
    # sign bits signs[j]; db of j//2 as IQ2_XS
    s2, o2 = src.reshape(-1, 82), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        for j2 in range(16):
            sc = (np.int32(row[74 + (j2 >> 1)]) >> (4 * (j2 & 1))) & 15
            db = d * (HALF + F32(sc)) * QUARTER
            for j in range(2 * j2, 2 * j2 + 2):
                pt = np.int32(row[2 + j]) | (((np.int32(row[66 + (j >> 2)]) >> (2 * (j & 3))) & 3) << 8)
                sg = row[34 + j]
                for c in range(8):
                    v = db * grid[pt, c]
                    orow[j * 8 + c] = v * (ONE - F32(2 * ((sg >> c) & 1)))


@njit(**_JIT)
def iq3_xxs(src, out, h, grid, ksigns):
    # [d f16][qs 64][scales u32 x8]; sub-block i: db = (d * (0.5 + sc>>28)) * 0.5;
    # e = i*32 + l*8 + c: point grid[qs[i*8 + l*2 + c//4]][c%4], sign ksigns[(sc >> 7l) & 127] bit c
    s2, o2 = src.reshape(-1, 98), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        for i in range(8):
            aux = _u32(row, 66 + 4 * i)
            db = d * (HALF + F32(aux >> 28)) * HALF
            for l in range(4):
                sg = ksigns[(aux >> (7 * l)) & 127]
                for c in range(8):
                    pt = row[2 + i * 8 + l * 2 + (c >> 2)]
                    v = db * grid[pt, c & 3]
                    orow[i * 32 + l * 8 + c] = v * (ONE - F32(2 * ((sg >> c) & 1)))


@njit(**_JIT)
def iq3_s(src, out, h, grid):
    # [d f16][qs 64][qh 8][signs 32][scales 4]; sub-block i: db = d * (1 + 2*sc_i)
    # e = i*32 + l*8 + c: g = e//4: grid[qs[g] | ((qh[g//8] >> g%8) & 1) << 8][c%4]; sign signs[i*4+l] bit c
    s2, o2 = src.reshape(-1, 110), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
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


@njit(**_JIT)
def iq1_s(src, out, h, grid):
    # [d f16][qs 32][qh u16 x8]; sub-block i: dl = d * (2*((qh>>12)&7) + 1), delta = -+0.125 by bit 15
    # entry j = i*4 + l: grid[qs[j] | ((qh >> 3l) & 7) << 8]; dl * (point + delta)
    s2, o2 = src.reshape(-1, 50), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[_u16(row, 0)]
        for i in range(8):
            qh = _u16(row, 34 + 2 * i)
            dl = d * F32(2 * ((qh >> 12) & 7) + 1)
            delta = -DELTA if qh & 0x8000 else DELTA
            for l in range(4):
                pt = np.int64(row[2 + i * 4 + l]) | (((qh >> (3 * l)) & 7) << 8)
                for c in range(8):
                    orow[i * 32 + l * 8 + c] = dl * (grid[pt, c] + delta)


@njit(**_JIT)
def iq1_m(src, out, h, grid):
    # [qs 32][qh 16][scales u16 x4]; d = f16 from the top nibbles of the 4 scale words
    # entry j (0..31): grid[qs[j] | ((qh[j//2] >> 4*(j%2)) & 7) << 8], delta by bit 3 of that nibble
    # scale of j//2 = t: (sc[t//4] >> 3*(t%4)) & 7; dl = d * (2*1); dl * (point + delta)
    s2, o2 = src.reshape(-1, 56), out.reshape(-1, 256)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        w0, w1, w2, w3 = _u16(row, 48), _u16(row, 50), _u16(row, 52), _u16(row, 54)
        d = h[((w0 & 0xF000) >> 12) | ((w1 & 0xF000) >> 8) | ((w2 & 0xF000) >> 4) | (w3 & 0xF000)]
        for t in range(16):
            w = _u16(row, 48 + 2 * (t >> 2))
            dl = d * F32(2 * ((w >> (3 * (t & 3))) & 7) + 1)
            for j in range(2 * t, 2 * t + 2):
                nib = (np.int64(row[32 + (j >> 1)]) >> (4 * (j & 1))) & 15
                pt = np.int64(row[j]) | ((nib & 7) << 8)
                delta = -DELTA if nib & 8 else DELTA
                for c in range(8):
                    orow[j * 8 + c] = dl * (grid[pt, c] + delta)
