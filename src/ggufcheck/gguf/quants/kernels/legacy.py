"""The 32-element block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: plain and streaming-store kernels.

Block layouts are in each kernel's first comment (``[d f16][qs 16]``: fields in byte order) and
the element order as ``e = ...``; a type's streaming variant follows its plain kernel.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ggufcheck.gguf.quants.kernels.common import F32, JIT, NEG_ZERO, share, u16, u32
from ggufcheck.gguf.quants.kernels.lanes import fence, lanes, lanes_bits


@njit(**JIT)
def q4_0(src, out, h):
    # [d f16][qs 16]; e = hi*16 + k: (qs[k] >> 4*hi) & 15, minus 8; d * q
    s2, o2 = src.reshape(-1, 18), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    w = o2.shape[1] >> 1  # 16, opaque to LLVM: see "vectorizing" in kernels/__init__.py
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        for k in range(w):
            x = np.int32(row[2 + k])
            orow[k] = d * F32((x & 15) - 8)
            orow[16 + k] = d * F32((x >> 4) - 8)


@njit(**JIT)
def q4_0_streaming(src, out, h, n_tasks):
    # [d f16][qs 16]; e = hi*16 + k: (qs[k] >> 4*hi) & 15, minus 8; d * q
    n = src.size // 18
    for t in prange(n_tasks):
        lo, hi = share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 18, b * 32
            d = h[u16(src, s)]
            for k in range(0, 16, 4):
                lanes(out, o + k, src, s + 2 + k, 0, 15, src, s, 0, 0, 0, 0, 8, d, NEG_ZERO)
                lanes(out, o + 16 + k, src, s + 2 + k, 4, 15, src, s, 0, 0, 0, 0, 8, d, NEG_ZERO)
        fence()


@njit(**JIT)
def q4_1(src, out, h):
    # [d f16][m f16][qs 16]; (d * q) + m
    s2, o2 = src.reshape(-1, 20), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    w = o2.shape[1] >> 1  # 16, opaque to LLVM
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        m = h[u16(row, 2)]
        for k in range(w):
            x = np.int32(row[4 + k])
            orow[k] = d * F32(x & 15) + m
            orow[16 + k] = d * F32(x >> 4) + m


@njit(**JIT)
def q4_1_streaming(src, out, h, n_tasks):
    # [d f16][m f16][qs 16]; (d * q) + m
    n = src.size // 20
    for t in prange(n_tasks):
        lo, hi = share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 20, b * 32
            d, m = h[u16(src, s)], h[u16(src, s + 2)]
            for k in range(0, 16, 4):
                lanes(out, o + k, src, s + 4 + k, 0, 15, src, s, 0, 0, 0, 0, 0, d, m)
                lanes(out, o + 16 + k, src, s + 4 + k, 4, 15, src, s, 0, 0, 0, 0, 0, d, m)
        fence()


@njit(**JIT)
def q5_0(src, out, h):
    # [d f16][qh u32][qs 16]; e = hi*16 + k; fifth bit = (qh >> e) & 1; q - 16
    s2, o2 = src.reshape(-1, 22), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        qh = u32(row, 2)
        for k in range(16):
            x = np.int32(row[6 + k])
            lo = (x & 15) | np.int32(((qh >> k) & 1) << 4)
            hi = (x >> 4) | np.int32(((qh >> (k + 16)) & 1) << 4)
            orow[k] = d * F32(lo - 16)
            orow[16 + k] = d * F32(hi - 16)


@njit(**JIT)
def q5_0_streaming(src, out, h, n_tasks):
    # [d f16][qh u32][qs 16]; e = hi*16 + k; fifth bit = (qh >> e) & 1; q - 16
    n = src.size // 22
    for t in prange(n_tasks):
        lo, hi = share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 22, b * 32
            d, qh = h[u16(src, s)], u32(src, s + 2)
            for k in range(0, 16, 4):
                lanes_bits(out, o + k, src, s + 6 + k, 0, 15, qh, k, 4, 16, d, NEG_ZERO)
                lanes_bits(out, o + 16 + k, src, s + 6 + k, 4, 15, qh, k + 16, 4, 16, d, NEG_ZERO)
        fence()


@njit(**JIT)
def q5_1(src, out, h):
    # [d f16][m f16][qh u32][qs 16]; (d * q) + m
    s2, o2 = src.reshape(-1, 24), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        m = h[u16(row, 2)]
        qh = u32(row, 4)
        for k in range(16):
            x = np.int32(row[8 + k])
            lo = (x & 15) | np.int32(((qh >> k) & 1) << 4)
            hi = (x >> 4) | np.int32(((qh >> (k + 16)) & 1) << 4)
            orow[k] = d * F32(lo) + m
            orow[16 + k] = d * F32(hi) + m


@njit(**JIT)
def q5_1_streaming(src, out, h, n_tasks):
    # [d f16][m f16][qh u32][qs 16]; (d * q) + m
    n = src.size // 24
    for t in prange(n_tasks):
        lo, hi = share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 24, b * 32
            d, m, qh = h[u16(src, s)], h[u16(src, s + 2)], u32(src, s + 4)
            for k in range(0, 16, 4):
                lanes_bits(out, o + k, src, s + 8 + k, 0, 15, qh, k, 4, 0, d, m)
                lanes_bits(out, o + 16 + k, src, s + 8 + k, 4, 15, qh, k + 16, 4, 0, d, m)
        fence()


@njit(**JIT)
def q8_0(src, out, h):
    # [d f16][qs int8 32]; x * d
    s2, o2 = src.reshape(-1, 34), out.reshape(-1, 32)  # (n_blocks, bytes), (n_blocks, elements)
    w = o2.shape[1]  # 32, opaque to LLVM
    for b in prange(s2.shape[0]):
        row, orow = s2[b], o2[b]
        d = h[u16(row, 0)]
        for k in range(w):
            orow[k] = F32(np.int8(row[2 + k])) * d


@njit(**JIT)
def q8_0_streaming(src, out, h, n_tasks):
    # [d f16][qs int8 32]; x * d (the int8 as (u8 ^ 128) - 128)
    n = src.size // 34
    for t in prange(n_tasks):
        lo, hi = share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 34, b * 32
            d = h[u16(src, s)]
            for k in range(0, 32, 4):
                lanes(out, o + k, src, s + 2 + k, 0, 255, src, s, 0, 0, 0, 128, 128, d, NEG_ZERO)
        fence()
