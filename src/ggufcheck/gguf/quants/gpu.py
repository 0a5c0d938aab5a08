"""Triton CUDA kernels for the common GGUF block types, bit-exact with gguf-py in float32.

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

Imported lazily (Triton is optional); ``device.py`` falls back to CPU + copy without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import gguf
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


@dataclass(frozen=True)
class Launch:
    """A kernel and its launch shape: blocks per program and warps per program."""

    kernel: object
    blk: int
    num_warps: int = 4
    needs_levels: bool = False  # takes the IQ4 level table


# one row per type with a Triton kernel (launch shapes: see benchmarks/results/)
KERNELS: dict[Q, Launch] = {
    Q.Q4_0: Launch(_q4_0, 64), Q.Q4_1: Launch(_q4_1, 64), Q.Q5_0: Launch(_q5_0, 64),
    Q.Q5_1: Launch(_q5_1, 64), Q.Q8_0: Launch(_q8_0, 64), Q.IQ4_NL: Launch(_iq4_nl, 64, 4, True),
    Q.Q2_K: Launch(_q2_k, 8), Q.Q3_K: Launch(_q3_k, 8), Q.Q4_K: Launch(_q4_k, 8),
    Q.Q5_K: Launch(_q5_k, 8), Q.Q6_K: Launch(_q6_k, 8), Q.IQ4_XS: Launch(_iq4_xs, 8, 4, True),
}

_levels: dict[torch.device, torch.Tensor] = {}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter takes no compile options
_launch_options: dict[str, bool] = {} if _INTERPRETED else {"enable_fp_fusion": False}  # no FMA contraction


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
    if flat.data_ptr() % 2:
        flat = flat.clone()  # float16 fields are read through a 2-byte view
    args = [flat, flat.view(torch.float16), out, n_blocks]
    if launch.needs_levels:
        if raw.device not in _levels:
            _levels[raw.device] = torch.tensor(tables.IQ4_LEVELS, dtype=torch.float32, device=raw.device)
        args.append(_levels[raw.device])
    grid = (triton.cdiv(n_blocks, launch.blk),)
    options = _launch_options if _INTERPRETED else {**_launch_options, "num_warps": launch.num_warps}
    launch.kernel[grid](*args, BLK=launch.blk, **options)
    return out
