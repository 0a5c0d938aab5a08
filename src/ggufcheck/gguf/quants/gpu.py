"""Triton CUDA kernels for every GGUF type gguf-py dequantizes but F32, bit-exact with gguf-py in float32.

Covered (``KERNELS``): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; Q2_K..Q6_K, IQ4_XS; the grid
types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M; MXFP4, NVFP4; TQ1_0, TQ2_0;
F16, BF16 (one "block" per value). F32 is left to torch (a view). Launch shapes of the
types after IQ4_XS are by analogy with the tuned ones, not tuned.

Why: transformers' torch dequantization reaches 3-10% of an H200's copy bandwidth; one
Triton program per group of blocks, reading each byte once from L1/L2 and writing the
output in contiguous vectors, gets close to the copy rate.

Layout: each kernel views its program's ``BLK`` blocks as a small tensor whose axes follow
the block's structure (e.g. Q4_K: ``[BLK, 8 sub-blocks, 32]``), so per-sub-block scales are
loaded once (shape ``[BLK, 8, 1]``) and broadcast. Offsets are int64 (tensors over 2**31
values exist in 400 GB models).

Exactness: float16 scales are widened exactly; products and sums are single float32
operations in gguf-py's order, and kernels are launched with ``enable_fp_fusion=False`` so
that ``d * q - m`` is never contracted into an FMA. float16/bfloat16 outputs are the float32
value rounded once (round to nearest even), the same as ``.to(dtype)`` on the float32 result.
Lookup tables (IQ4/FP4 levels, NVFP4's UE4M3 scales, the IQ grids as int8, ksigns) are
small device tensors built from ``tables.py``, copied once per device (``_device_tables``);
grid points are small integers, so int8 -> float32 is exact. Sign factors are ``* (+-1.0)``
as in gguf-py; MXFP4's e8m0 scale is built by bit-casting (bytes 0 and 1 give float32
subnormals, so the device must not flush denormals).

Imported lazily (Triton is optional); ``device.py`` falls back to CPU + copy without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import triton
import triton.language as tl

from ggufcheck.gguf.quants import tables

Q = gguf.GGMLQuantizationType


@triton.jit
def _f16(h_ptr, byte_index, mask):
    """float16 field at an even byte offset, widened to float32."""
    return tl.load(h_ptr + byte_index // 2, mask=mask, other=0).to(tl.float32)


@triton.jit
def _u8(q_ptr, byte_index, mask):
    return tl.load(q_ptr + byte_index, mask=mask, other=0).to(tl.int32)


@triton.jit
def _blocks(BLK: tl.constexpr, n_blocks):
    blk = tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)  # (BLK,)
    return blk, blk < n_blocks


# ---- 32-element blocks: axes [BLK, 2 (low/high nibble), 16] ------------------------------

@triton.jit
def _q4_0(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    hi = tl.arange(0, 2)[None, :, None]
    k = tl.arange(0, 16)[None, None, :]
    d = _f16(h_ptr, b * 18, m)  # (BLK, 1, 1)
    x = _u8(q_ptr, b * 18 + 2 + k, m)  # (BLK, 1, 16)
    q = ((x >> (4 * hi)) & 15) - 8  # (BLK, 2, 16)
    v = d * q.to(tl.float32)
    tl.store(out_ptr + b * 32 + hi * 16 + k, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _q4_1(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    hi = tl.arange(0, 2)[None, :, None]
    k = tl.arange(0, 16)[None, None, :]
    d = _f16(h_ptr, b * 20, m)
    mn = _f16(h_ptr, b * 20 + 2, m)
    x = _u8(q_ptr, b * 20 + 4 + k, m)
    q = (x >> (4 * hi)) & 15
    v = d * q.to(tl.float32) + mn
    tl.store(out_ptr + b * 32 + hi * 16 + k, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _q5_0(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    hi = tl.arange(0, 2)[None, :, None]
    k = tl.arange(0, 16)[None, None, :]
    d = _f16(h_ptr, b * 22, m)
    x = _u8(q_ptr, b * 22 + 6 + k, m)
    e = hi * 16 + k  # element index = bit index in qh
    h5 = (_u8(q_ptr, b * 22 + 2 + e // 8, m) >> (e % 8)) & 1
    q = (((x >> (4 * hi)) & 15) | (h5 << 4)) - 16
    v = d * q.to(tl.float32)
    tl.store(out_ptr + b * 32 + e, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _q5_1(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    hi = tl.arange(0, 2)[None, :, None]
    k = tl.arange(0, 16)[None, None, :]
    d = _f16(h_ptr, b * 24, m)
    mn = _f16(h_ptr, b * 24 + 2, m)
    x = _u8(q_ptr, b * 24 + 8 + k, m)
    e = hi * 16 + k
    h5 = (_u8(q_ptr, b * 24 + 4 + e // 8, m) >> (e % 8)) & 1
    q = ((x >> (4 * hi)) & 15) | (h5 << 4)
    v = d * q.to(tl.float32) + mn
    tl.store(out_ptr + b * 32 + e, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _q8_0(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None], ok[:, None]
    k = tl.arange(0, 32)[None, :]
    d = _f16(h_ptr, b * 34, m)  # (BLK, 1)
    x = tl.load(q_ptr + b * 34 + 2 + k, mask=m, other=0).to(tl.int8, bitcast=True)  # (BLK, 32)
    v = x.to(tl.float32) * d
    tl.store(out_ptr + b * 32 + k, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _iq4_nl(q_ptr, h_ptr, out_ptr, n_blocks, lv_ptr, BLK: tl.constexpr):
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    hi = tl.arange(0, 2)[None, :, None]
    k = tl.arange(0, 16)[None, None, :]
    d = _f16(h_ptr, b * 18, m)
    x = _u8(q_ptr, b * 18 + 2 + k, m)
    level = tl.load(lv_ptr + ((x >> (4 * hi)) & 15))  # (BLK, 2, 16)
    v = d * level
    tl.store(out_ptr + b * 32 + hi * 16 + k, v.to(out_ptr.dtype.element_ty), mask=m)


# ---- K-quants: 256-element super-blocks --------------------------------------------------

@triton.jit
def _q2_k(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    # axes [BLK, 16 groups g, 16]; e = g*16 + kk; j = g // 2 (shift plane), k = (g%2)*16 + kk
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    g = tl.arange(0, 16)[None, :, None]
    kk = tl.arange(0, 16)[None, None, :]
    d = _f16(h_ptr, b * 84 + 80, m)
    dmin = _f16(h_ptr, b * 84 + 82, m)
    sc = _u8(q_ptr, b * 84 + g, m)  # (BLK, 16, 1)
    dl = d * (sc & 15).to(tl.float32)
    ml = dmin * (sc >> 4).to(tl.float32)
    j = g // 2
    k = (g % 2) * 16 + kk
    q = (_u8(q_ptr, b * 84 + 16 + (j // 4) * 32 + k, m) >> (2 * (j % 4))) & 3
    v = dl * q.to(tl.float32) - ml
    tl.store(out_ptr + b * 256 + g * 16 + kk, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _q3_k(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    # axes [BLK, 16 groups i, 16]; j = i // 2 (bit plane), k = (i%2)*16 + kk
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    i = tl.arange(0, 16)[None, :, None]
    kk = tl.arange(0, 16)[None, None, :]
    d = _f16(h_ptr, b * 110 + 108, m)
    low4 = (_u8(q_ptr, b * 110 + 96 + (i % 8), m) >> (4 * (i // 8))) & 15
    high2 = (_u8(q_ptr, b * 110 + 104 + (i % 4), m) >> (2 * (i // 4))) & 3
    dl = d * ((low4 | (high2 << 4)) - 32).to(tl.float32)  # (BLK, 16, 1)
    j = i // 2
    k = (i % 2) * 16 + kk
    low = (_u8(q_ptr, b * 110 + 32 + (j // 4) * 32 + k, m) >> (2 * (j % 4))) & 3
    high = (_u8(q_ptr, b * 110 + k, m) >> j) & 1
    q = low - ((high ^ 1) << 2)
    v = dl * q.to(tl.float32)
    tl.store(out_ptr + b * 256 + i * 16 + kk, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _k4_scale_min(q_ptr, base, j, m):
    """Q4_K/Q5_K 6-bit scale and min of sub-block j (get_scale_min_k4); base = block start."""
    lo_sc = _u8(q_ptr, base + 4 + j, m)  # j < 4: scale; j >= 4: min's high-bit source
    lo_mn = _u8(q_ptr, base + 8 + j, m)  # j < 4: min; j >= 4: packed low nibbles (sc | mn << 4)
    hi_src = _u8(q_ptr, base + 4 + (j % 4), m)  # j >= 4: bytes 4..7 -> top bits of scale
    sc = tl.where(j < 4, lo_sc & 63, (lo_mn & 15) | ((hi_src >> 2) & 48))
    mn = tl.where(j < 4, lo_mn & 63, (lo_mn >> 4) | ((lo_sc >> 2) & 48))
    return sc, mn


@triton.jit
def _q4_k(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    # axes [BLK, 8 sub-blocks j, 32]; q = (qs[(j//2)*32 + k] >> 4*(j%2)) & 15
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    j = tl.arange(0, 8)[None, :, None]
    k = tl.arange(0, 32)[None, None, :]
    d = _f16(h_ptr, b * 144, m)
    dmin = _f16(h_ptr, b * 144 + 2, m)
    sc, mn = _k4_scale_min(q_ptr, b * 144, j, m)  # (BLK, 8, 1)
    dl = d * sc.to(tl.float32)
    ml = dmin * mn.to(tl.float32)
    q = (_u8(q_ptr, b * 144 + 16 + (j // 2) * 32 + k, m) >> (4 * (j % 2))) & 15
    v = dl * q.to(tl.float32) - ml
    tl.store(out_ptr + b * 256 + j * 32 + k, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _q5_k(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    j = tl.arange(0, 8)[None, :, None]
    k = tl.arange(0, 32)[None, None, :]
    d = _f16(h_ptr, b * 176, m)
    dmin = _f16(h_ptr, b * 176 + 2, m)
    sc, mn = _k4_scale_min(q_ptr, b * 176, j, m)
    dl = d * sc.to(tl.float32)
    ml = dmin * mn.to(tl.float32)
    low = (_u8(q_ptr, b * 176 + 48 + (j // 2) * 32 + k, m) >> (4 * (j % 2))) & 15
    high = (_u8(q_ptr, b * 176 + 16 + k, m) >> j) & 1
    v = dl * (low | (high << 4)).to(tl.float32) - ml
    tl.store(out_ptr + b * 256 + j * 32 + k, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _q6_k(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    # axes [BLK, 16 groups g, 16]; g = a*8 + mm*2 + hl, l = hl*16 + kk (a: half, mm: quarter)
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    g = tl.arange(0, 16)[None, :, None]
    kk = tl.arange(0, 16)[None, None, :]
    d = _f16(h_ptr, b * 210 + 208, m)
    sc = tl.load(q_ptr + b * 210 + 192 + g, mask=m, other=0).to(tl.int8, bitcast=True)
    dl = d * sc.to(tl.float32)  # (BLK, 16, 1)
    a, mm = g // 8, (g // 2) % 4
    l = (g % 2) * 16 + kk
    low = (_u8(q_ptr, b * 210 + a * 64 + (mm % 2) * 32 + l, m) >> (4 * (mm // 2))) & 15
    high = (_u8(q_ptr, b * 210 + 128 + a * 32 + l, m) >> (2 * mm)) & 3
    v = dl * ((low | (high << 4)) - 32).to(tl.float32)
    tl.store(out_ptr + b * 256 + g * 16 + kk, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _iq4_xs(q_ptr, h_ptr, out_ptr, n_blocks, lv_ptr, BLK: tl.constexpr):
    # axes [BLK, 8 sub-blocks i, 32]; e = i*32 + hi*16 + kk; nibble hi of qs[i*16 + kk]
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    i = tl.arange(0, 8)[None, :, None]
    e = tl.arange(0, 32)[None, None, :]
    hi, kk = e // 16, e % 16
    d = _f16(h_ptr, b * 136, m)
    scales_h = tl.load(h_ptr + b * 68 + 1, mask=m, other=0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo = (_u8(q_ptr, b * 136 + 4 + i // 2, m) >> (4 * (i % 2))) & 15
    sc = (lo | (((scales_h >> (2 * i)) & 3) << 4)) - 32  # (BLK, 8, 1)
    dl = d * sc.to(tl.float32)
    x = _u8(q_ptr, b * 136 + 8 + i * 16 + kk, m)
    level = tl.load(lv_ptr + ((x >> (4 * hi)) & 15))
    v = dl * level
    tl.store(out_ptr + b * 256 + i * 32 + e, v.to(out_ptr.dtype.element_ty), mask=m)


# ---- plain float types: one "block" per value --------------------------------------------

@triton.jit
def _f16_values(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    blk, ok = _blocks(BLK, n_blocks)  # (BLK,) value indices
    v = tl.load(h_ptr + blk, mask=ok, other=0).to(tl.float32)
    tl.store(out_ptr + blk, v.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bf16_values(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    blk, ok = _blocks(BLK, n_blocks)
    bits = tl.load(h_ptr + blk, mask=ok, other=0).to(tl.int16, bitcast=True).to(tl.int32) << 16
    v = bits.to(tl.float32, bitcast=True)
    tl.store(out_ptr + blk, v.to(out_ptr.dtype.element_ty), mask=ok)


# ---- FP4 types (no float16 fields; MXFP4's 17-byte block is odd) --------------------------

@triton.jit
def _mxfp4(q_ptr, h_ptr, out_ptr, n_blocks, fp4_ptr, BLK: tl.constexpr):
    # [e u8][qs 16]; e = hi*16 + k: fp4[(qs[k] >> 4*hi) & 15]; d = 2**(e-128) (e8m0 half)
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    hi = tl.arange(0, 2)[None, :, None]
    k = tl.arange(0, 16)[None, None, :]
    e = _u8(q_ptr, b * 17, m)  # (BLK, 1, 1)
    d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)  # e < 2: subnormal
    x = _u8(q_ptr, b * 17 + 1 + k, m)
    level = tl.load(fp4_ptr + ((x >> (4 * hi)) & 15))  # (BLK, 2, 16)
    v = d * level
    tl.store(out_ptr + b * 32 + hi * 16 + k, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _nvfp4(q_ptr, h_ptr, out_ptr, n_blocks, fp4_ptr, ue4m3_ptr, BLK: tl.constexpr):
    # [d ue4m3 x4][qs 32]; axes [BLK, 4 sub-blocks g, 16 r]; r = hi*8 + k: nibble hi of qs[g*8 + k]
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    g = tl.arange(0, 4)[None, :, None]
    r = tl.arange(0, 16)[None, None, :]
    hi, k = r // 8, r % 8
    d = tl.load(ue4m3_ptr + _u8(q_ptr, b * 36 + g, m))  # (BLK, 4, 1)
    x = _u8(q_ptr, b * 36 + 4 + g * 8 + k, m)
    level = tl.load(fp4_ptr + ((x >> (4 * hi)) & 15))  # (BLK, 4, 16)
    v = d * level
    tl.store(out_ptr + b * 64 + g * 16 + r, v.to(out_ptr.dtype.element_ty), mask=m)


# ---- ternary types -----------------------------------------------------------------------

@triton.jit
def _tq1_0(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    # [qs 48][qh 4][d f16]; axes [BLK, 256 e]; base-3 digit p of a byte: v = (x * 3**p) & 255,
    # q = ((v * 3) >> 8) - 1. e < 160: qs[e%32], p = e//32; e < 240: qs[32 + (e-160)%16],
    # p = (e-160)//16; else qh[(e-240)%4], p = (e-240)//4
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None], ok[:, None]
    e = tl.arange(0, 256)[None, :]
    e1, e2 = e - 160, e - 240
    byte = tl.where(e < 160, e % 32, tl.where(e < 240, 32 + e1 % 16, 48 + e2 % 4))
    p = tl.where(e < 160, e // 32, tl.where(e < 240, e1 // 16, e2 // 4))
    pw = tl.where(p == 0, 1, tl.where(p == 1, 3, tl.where(p == 2, 9, tl.where(p == 3, 27, 81))))
    d = _f16(h_ptr, b * 54 + 52, m)  # (BLK, 1)
    v = (_u8(q_ptr, b * 54 + byte, m) * pw) & 255
    q = ((v * 3) >> 8) - 1
    out = d * q.to(tl.float32)
    tl.store(out_ptr + b * 256 + e, out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _tq2_0(q_ptr, h_ptr, out_ptr, n_blocks, BLK: tl.constexpr):
    # [qs 64][d f16]; axes [BLK, 8 j, 32 k] (j = half*4 + shift): ((qs[half*32+k] >> 2*shift) & 3) - 1
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    j = tl.arange(0, 8)[None, :, None]
    k = tl.arange(0, 32)[None, None, :]
    d = _f16(h_ptr, b * 66 + 64, m)
    q = ((_u8(q_ptr, b * 66 + (j // 4) * 32 + k, m) >> (2 * (j % 4))) & 3) - 1
    v = d * q.to(tl.float32)
    tl.store(out_ptr + b * 256 + j * 32 + k, v.to(out_ptr.dtype.element_ty), mask=m)


# ---- IQ types: codebook (grid) lookups; grids are int8 device tables, exact in float32 ---

@triton.jit
def _u16(q_ptr, byte_index, mask):
    return _u8(q_ptr, byte_index, mask) | (_u8(q_ptr, byte_index + 1, mask) << 8)


@triton.jit
def _u32(q_ptr, byte_index, mask):
    """Little-endian u32 as int32 bits (bit 31 lands in the sign: mask after shifting)."""
    return _u16(q_ptr, byte_index, mask) | (_u16(q_ptr, byte_index + 2, mask) << 16)


@triton.jit
def _sign(bits, c):
    """gguf-py's sign factor: +1.0 where bit c of ``bits`` is clear, -1.0 where set."""
    return tl.where(((bits >> c) & 1) != 0, -1.0, 1.0)


@triton.jit
def _iq2_xxs(q_ptr, h_ptr, out_ptr, n_blocks, grid_ptr, ks_ptr, BLK: tl.constexpr):
    # [d f16][8 x (aux0 u32, aux1 u32)]; axes [BLK, 32 entries j = i*4 + l, 8 c]
    # db = (d * (0.5 + aux1>>28)) * 0.25; point grid[byte l of aux0]; signs ksigns[(aux1 >> 7l) & 127]
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    j = tl.arange(0, 32)[None, :, None]
    c = tl.arange(0, 8)[None, None, :]
    i, l = j // 4, j % 4
    d = _f16(h_ptr, b * 66, m)
    aux1 = _u32(q_ptr, b * 66 + 6 + i * 8, m)  # (BLK, 32, 1)
    db = (d * (0.5 + ((aux1 >> 28) & 15).to(tl.float32))) * 0.25
    pt = _u8(q_ptr, b * 66 + 2 + i * 8 + l, m)
    sg = tl.load(ks_ptr + ((aux1 >> (7 * l)) & 127)).to(tl.int32)
    point = tl.load(grid_ptr + pt * 8 + c).to(tl.float32)  # (BLK, 32, 8)
    v = (db * point) * _sign(sg, c)
    tl.store(out_ptr + b * 256 + j * 8 + c, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _iq2_xs(q_ptr, h_ptr, out_ptr, n_blocks, grid_ptr, ks_ptr, BLK: tl.constexpr):
    # [d f16][qs u16 x32][scales 8]; axes [BLK, 32 j, 8 c]; point grid[qs & 511], signs ksigns[qs >> 9]
    # scale of j: (scales[j//4] >> 4*((j//2)%2)) & 15; db = (d * (0.5 + sc)) * 0.25
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    j = tl.arange(0, 32)[None, :, None]
    c = tl.arange(0, 8)[None, None, :]
    d = _f16(h_ptr, b * 74, m)
    sc = (_u8(q_ptr, b * 74 + 66 + j // 4, m) >> (4 * ((j // 2) % 2))) & 15
    db = (d * (0.5 + sc.to(tl.float32))) * 0.25
    q = _u16(q_ptr, b * 74 + 2 + 2 * j, m)  # (BLK, 32, 1)
    sg = tl.load(ks_ptr + (q >> 9)).to(tl.int32)
    point = tl.load(grid_ptr + (q & 511) * 8 + c).to(tl.float32)
    v = (db * point) * _sign(sg, c)
    tl.store(out_ptr + b * 256 + j * 8 + c, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _iq2_s(q_ptr, h_ptr, out_ptr, n_blocks, grid_ptr, BLK: tl.constexpr):
    # [d f16][qs 32][signs 32][qh 8][scales 8]; axes [BLK, 32 j, 8 c]
    # point grid[qs[j] | ((qh[j//4] >> 2*(j%4)) & 3) << 8]; sign bits signs[j]; db as IQ2_XS
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    j = tl.arange(0, 32)[None, :, None]
    c = tl.arange(0, 8)[None, None, :]
    d = _f16(h_ptr, b * 82, m)
    sc = (_u8(q_ptr, b * 82 + 74 + j // 4, m) >> (4 * ((j // 2) % 2))) & 15
    db = (d * (0.5 + sc.to(tl.float32))) * 0.25
    pt = _u8(q_ptr, b * 82 + 2 + j, m) | (((_u8(q_ptr, b * 82 + 66 + j // 4, m) >> (2 * (j % 4))) & 3) << 8)
    sg = _u8(q_ptr, b * 82 + 34 + j, m)
    point = tl.load(grid_ptr + pt * 8 + c).to(tl.float32)
    v = (db * point) * _sign(sg, c)
    tl.store(out_ptr + b * 256 + j * 8 + c, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _iq3_xxs(q_ptr, h_ptr, out_ptr, n_blocks, grid_ptr, ks_ptr, BLK: tl.constexpr):
    # [d f16][qs 64][scales u32 x8]; axes [BLK, 64 points g, 4 c4]; e = g*4 + c4
    # sub-block i = g//8, l = (g%8)//2: db = (d * (0.5 + aux_i>>28)) * 0.5;
    # sign: bit (g%2)*4 + c4 of ksigns[(aux_i >> 7l) & 127]
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    g = tl.arange(0, 64)[None, :, None]
    c4 = tl.arange(0, 4)[None, None, :]
    i, l = g // 8, (g % 8) // 2
    d = _f16(h_ptr, b * 98, m)
    aux = _u32(q_ptr, b * 98 + 66 + 4 * i, m)  # (BLK, 64, 1)
    db = (d * (0.5 + ((aux >> 28) & 15).to(tl.float32))) * 0.5
    sg = tl.load(ks_ptr + ((aux >> (7 * l)) & 127)).to(tl.int32)
    point = tl.load(grid_ptr + _u8(q_ptr, b * 98 + 2 + g, m) * 4 + c4).to(tl.float32)  # (BLK, 64, 4)
    v = (db * point) * _sign(sg, (g % 2) * 4 + c4)
    tl.store(out_ptr + b * 256 + g * 4 + c4, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _iq3_s(q_ptr, h_ptr, out_ptr, n_blocks, grid_ptr, BLK: tl.constexpr):
    # [d f16][qs 64][qh 8][signs 32][scales 4]; axes [BLK, 64 points g, 4 c4]; e = g*4 + c4
    # db = d * (1 + 2*sc_i), i = g//8; point grid[qs[g] | ((qh[g//8] >> g%8) & 1) << 8];
    # sign: bit e%8 of signs[e//8]
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    g = tl.arange(0, 64)[None, :, None]
    c4 = tl.arange(0, 4)[None, None, :]
    i = g // 8
    d = _f16(h_ptr, b * 110, m)
    sc = (_u8(q_ptr, b * 110 + 106 + i // 2, m) >> (4 * (i % 2))) & 15
    db = d * (1 + 2 * sc).to(tl.float32)
    pt = _u8(q_ptr, b * 110 + 2 + g, m) | (((_u8(q_ptr, b * 110 + 66 + g // 8, m) >> (g % 8)) & 1) << 8)
    sg = _u8(q_ptr, b * 110 + 74 + g // 2, m)
    point = tl.load(grid_ptr + pt * 4 + c4).to(tl.float32)
    v = (db * point) * _sign(sg, (g % 2) * 4 + c4)
    tl.store(out_ptr + b * 256 + g * 4 + c4, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _iq1_s(q_ptr, h_ptr, out_ptr, n_blocks, grid_ptr, BLK: tl.constexpr):
    # [d f16][qs 32][qh u16 x8]; axes [BLK, 32 j = i*4 + l, 8 c]
    # dl = d * (2*((qh_i >> 12) & 7) + 1); delta = -0.125 if bit 15 else 0.125
    # point grid[qs[j] | ((qh_i >> 3l) & 7) << 8]; dl * (point + delta)
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    j = tl.arange(0, 32)[None, :, None]
    c = tl.arange(0, 8)[None, None, :]
    i, l = j // 4, j % 4
    d = _f16(h_ptr, b * 50, m)
    qh = _u16(q_ptr, b * 50 + 34 + 2 * i, m)  # (BLK, 32, 1)
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    delta = tl.where((qh & 0x8000) != 0, -0.125, 0.125)
    pt = _u8(q_ptr, b * 50 + 2 + j, m) | (((qh >> (3 * l)) & 7) << 8)
    point = tl.load(grid_ptr + pt * 8 + c).to(tl.float32)
    v = dl * (point + delta)
    tl.store(out_ptr + b * 256 + j * 8 + c, v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _iq1_m(q_ptr, h_ptr, out_ptr, n_blocks, grid_ptr, BLK: tl.constexpr):
    # [qs 32][qh 16][scales u16 x4]; d = the f16 whose nibbles are the top nibbles of the 4 words
    # axes [BLK, 32 j, 8 c]; nib = (qh[j//2] >> 4*(j%2)) & 15; point grid[qs[j] | (nib & 7) << 8]
    # delta = -0.125 if nib & 8 else 0.125; t = j//2: dl = d * (2*((w[t//4] >> 3*(t%4)) & 7) + 1)
    blk, ok = _blocks(BLK, n_blocks)
    b, m = blk[:, None, None], ok[:, None, None]
    j = tl.arange(0, 32)[None, :, None]
    c = tl.arange(0, 8)[None, None, :]
    t = j // 2
    d_bits = ((_u8(q_ptr, b * 56 + 49, m) >> 4) | ((_u8(q_ptr, b * 56 + 51, m) >> 4) << 4)
              | ((_u8(q_ptr, b * 56 + 53, m) >> 4) << 8) | ((_u8(q_ptr, b * 56 + 55, m) >> 4) << 12))
    d = d_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)  # (BLK, 1, 1)
    w = _u16(q_ptr, b * 56 + 48 + 2 * (t // 4), m)  # (BLK, 32, 1)
    dl = d * (2 * ((w >> (3 * (t % 4))) & 7) + 1).to(tl.float32)
    nib = (_u8(q_ptr, b * 56 + 32 + j // 2, m) >> (4 * (j % 2))) & 15
    delta = tl.where((nib & 8) != 0, -0.125, 0.125)
    pt = _u8(q_ptr, b * 56 + j, m) | ((nib & 7) << 8)
    point = tl.load(grid_ptr + pt * 8 + c).to(tl.float32)
    v = dl * (point + delta)
    tl.store(out_ptr + b * 256 + j * 8 + c, v.to(out_ptr.dtype.element_ty), mask=m)


@dataclass(frozen=True)
class Launch:
    """A kernel and its launch shape: blocks per program and warps per program."""

    kernel: object
    blk: int
    num_warps: int = 4
    needs_levels: bool = False  # takes the IQ4 level table
    tables: tuple[str, ...] = ()  # further device tables it takes, in this order (see _TABLES)
    f16_view: bool = True  # reads float16 fields through a 2-byte view (False: the type has none)


def _grid(qtype: Q) -> np.ndarray:
    """The IQ codebook of ``qtype`` as a flat int8 array (every point is a small integer)."""
    g = tables.grid(qtype)
    small = g.astype(np.int8)
    assert np.array_equal(small.astype(np.float32), g), qtype.name
    return small.reshape(-1)


# name -> builder of a small host array; each is copied once per device (cached in _device_tables)
_TABLES = {
    "levels": lambda: np.asarray(tables.IQ4_LEVELS, dtype=np.float32),
    "fp4": lambda: np.asarray(tables.FP4_LEVELS, dtype=np.float32),
    "ue4m3": tables.ue4m3_half_to_f32,
    "ksigns": tables.ksigns,
    **{f"grid:{q.name}": (lambda q=q: _grid(q))
       for q in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S)},
}


def _grid_launch(kernel, grid_of: Q, signs: bool = False, blk: int = 8) -> Launch:
    return Launch(kernel, blk, 4, tables=(f"grid:{grid_of.name}", *(("ksigns",) if signs else ())))


# one row per type with a Triton kernel (launch shapes: see benchmarks/results/; the rows
# from F16 on are by analogy with the first ones, not yet tuned on a GPU)
KERNELS: dict[Q, Launch] = {
    Q.Q4_0: Launch(_q4_0, 64), Q.Q4_1: Launch(_q4_1, 64), Q.Q5_0: Launch(_q5_0, 64),
    Q.Q5_1: Launch(_q5_1, 64), Q.Q8_0: Launch(_q8_0, 64), Q.IQ4_NL: Launch(_iq4_nl, 64, 4, True),
    Q.Q2_K: Launch(_q2_k, 8), Q.Q3_K: Launch(_q3_k, 8), Q.Q4_K: Launch(_q4_k, 8),
    Q.Q5_K: Launch(_q5_k, 8), Q.Q6_K: Launch(_q6_k, 8), Q.IQ4_XS: Launch(_iq4_xs, 8, 4, True),
    Q.IQ2_XXS: _grid_launch(_iq2_xxs, Q.IQ2_XXS, signs=True),
    Q.IQ2_XS: _grid_launch(_iq2_xs, Q.IQ2_XS, signs=True),
    Q.IQ2_S: _grid_launch(_iq2_s, Q.IQ2_S),
    Q.IQ3_XXS: _grid_launch(_iq3_xxs, Q.IQ3_XXS, signs=True),
    Q.IQ3_S: _grid_launch(_iq3_s, Q.IQ3_S),
    Q.IQ1_S: _grid_launch(_iq1_s, Q.IQ1_S),
    Q.IQ1_M: _grid_launch(_iq1_m, Q.IQ1_S),  # IQ1_M shares IQ1_S's codebook
    Q.MXFP4: Launch(_mxfp4, 64, 4, tables=("fp4",), f16_view=False),
    Q.NVFP4: Launch(_nvfp4, 32, 4, tables=("fp4", "ue4m3"), f16_view=False),
    Q.TQ1_0: Launch(_tq1_0, 8), Q.TQ2_0: Launch(_tq2_0, 8),
    Q.F16: Launch(_f16_values, 2048), Q.BF16: Launch(_bf16_values, 2048),
}

_device_tables: dict[tuple[str, torch.device], torch.Tensor] = {}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter takes no compile options
_launch_options: dict[str, bool] = {} if _INTERPRETED else {"enable_fp_fusion": False}  # no FMA contraction


def _device_table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    if key not in _device_tables:
        _device_tables[key] = torch.from_numpy(np.ascontiguousarray(_TABLES[name]())).to(device)
    return _device_tables[key]


def dequantize(raw: torch.Tensor, qtype: Q, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None, launch: Launch | None = None) -> torch.Tensor:
    """Contiguous uint8 CUDA tensor of whole blocks -> flat ``dtype`` values (or into ``out``).

    ``launch`` overrides the table's launch shape (the benchmark's sweep uses it).
    """
    launch = launch or KERNELS[qtype]
    block, size = tables.block_geometry(qtype)
    flat = raw.reshape(-1)  # (n_bytes,)
    n_blocks = flat.numel() // size
    if out is None:
        out = torch.empty(n_blocks * block, dtype=dtype, device=raw.device)
    if n_blocks == 0:
        return out
    if launch.f16_view:
        if flat.data_ptr() % 2:
            flat = flat.clone()  # float16 fields are read through a 2-byte view
        args = [flat, flat.view(torch.float16), out, n_blocks]
    else:  # no float16 fields (and possibly an odd byte count): the second pointer is unused
        args = [flat, flat, out, n_blocks]
    names = ("levels",) * launch.needs_levels + launch.tables
    args.extend(_device_table(name, raw.device) for name in names)
    grid = (triton.cdiv(n_blocks, launch.blk),)
    options = _launch_options if _INTERPRETED else {**_launch_options, "num_warps": launch.num_warps}
    launch.kernel[grid](*args, BLK=launch.blk, **options)
    return out
