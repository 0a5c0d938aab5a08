"""CPU kernels for large outputs: the same values as ``cpu.py``, written with streaming stores.

Why: an ordinary store to memory that is not in cache first reads the line it lands in ("read
for ownership"), so filling a float32 buffer larger than the last-level cache moves every line
twice. On the 2-core CI machine a numba fill of a 172 MB buffer ran at 28 GB/s, the same fill
with non-temporal stores at 61 GB/s, and a dequantizer writes 3.6-7 float32 bytes per byte it
reads: past the cache the write is what bounds it (``benchmarks/dequant.py`` prints both fills
and both kernels side by side). Here each 4-lane group of outputs is computed in vector
registers and stored with one 16-byte non-temporal store (``movntps`` on x86, ``stnp`` on
AArch64; LLVM emits a plain store where a target has none), and a fence ends each thread's
share so that the weakly ordered stores are visible when the kernel returns.

Why not the ``cpu.py`` kernels with a flag: LLVM's loop vectorizer declines a loop whose
non-temporal stores it cannot prove 16-byte aligned, and decoding into an L1 scratch row and
streaming that out measured slower than the plain kernel (the extra pass costs more than the
write saves). So each lane group is one call of ``_lanes``/``_lanes_bits``, which spells out
the decode every integer block type shares:

    q = ((((a[ja + l] >> sa) & ma) | (((b[jb + l] >> sb) & mb) << lb)) ^ flip) - sub
    out[i + l] = float32(q) * mul + add            for lanes l = 0..3

(``_lanes_bits`` takes the second field from bits ``sb + l`` of one integer: Q5_0/Q5_1's
``qh``). Bit-exact with gguf-py as the ``cpu.py`` kernels are: ``q`` is exact in int32 and in
float32, and each lane is one float32 multiply and one add (``d * q`` alone adds -0.0, which
changes no value; ``x - m`` is ``x + (-m)``). Each kernel's comment gives its element order,
the same as its ``cpu.py`` twin; tests hold every kernel to gguf-py and to that twin.

Small outputs do not come here (``MIN_BYTES``): a streaming store bypasses the cache, and a
caller that reads a cache-sized result right back would lose more than the write saves.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ggufcheck.gguf.quants.cpu import _k4_scale_min  # the Q4_K/Q5_K 6-bit (scale, min) unpacking

Q = gguf.GGMLQuantizationType
F32 = np.float32
NEG_ZERO = np.float32(-0.0)  # the add of a multiply-only type: x + (-0.0) == x for every x



def _last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """Size of CPU 0's largest cache, from sysfs (Linux); ``default`` where it cannot be read."""
    best = 0
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        try:
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best or default


# Outputs this large and larger stream: twice the last-level cache (32 MiB on the CI machine),
# where an ordinary-store kernel no longer gains from lines that stay cached. Measured there
# (streaming / plain kernel, same buffer): 0.5-0.9x at 4 MB of input (14-28 MB out, cached),
# 0.7-1.3x at 16 MB; at 24-48 MB (84-228 MB out) 1.13-1.53x in 24 of the 27 measurements of the
# types below, 0.84-0.89x in 3 (a shared, noisy machine). Q3_K is not here: its streaming twin
# measured 0.6-0.8x in all three, so it keeps its plain kernel.
MIN_BYTES = 2 * _last_level_cache_bytes()
ALIGN = 16  # the output must start on a 16-byte boundary (every later lane group then does)

_JIT = dict(parallel=True, cache=True, nogil=True, boundscheck=False)
_LANES = 4
_I32 = ir.IntType(32)


def _splat(builder, value, vector_type):
    vec = ir.Constant(vector_type, ir.Undefined)
    for lane in range(_LANES):
        vec = builder.insert_element(vec, value, ir.Constant(_I32, lane))
    return vec


def _as_i32(builder, value):
    width = value.type.width
    return builder.trunc(value, _I32) if width > 32 else builder.zext(value, _I32) if width < 32 else value


def _byte_lanes(context, builder, array_type, array, index):
    """Four consecutive bytes of a uint8 array as <4 x i32> (zero-extended)."""
    data = context.make_array(array_type)(context, builder, array).data
    v4i8 = ir.VectorType(ir.IntType(8), _LANES)
    pointer = builder.bitcast(builder.gep(data, [index]), v4i8.as_pointer())
    load = builder.load(pointer, align=1)
    # the source is never written while a kernel runs: saying so lets LLVM reuse one load for the
    # several lane groups a byte feeds, across the output stores it cannot otherwise prove apart
    load.set_metadata("invariant.load", builder.module.add_metadata([]))
    return builder.zext(load, ir.VectorType(_I32, _LANES))


def _finish(context, builder, out_type, out, i, first, second, flip, sub, mul, add):
    """q = (first | second) ^ flip - sub; store float32(q) * mul + add at out[i], non-temporal."""
    v4i32 = ir.VectorType(_I32, _LANES)
    v4f32 = ir.VectorType(ir.FloatType(), _LANES)
    q = builder.or_(first, second)
    q = builder.sub(builder.xor(q, _splat(builder, _as_i32(builder, flip), v4i32)),
                    _splat(builder, _as_i32(builder, sub), v4i32))
    value = builder.fadd(builder.fmul(builder.sitofp(q, v4f32), _splat(builder, mul, v4f32)),
                         _splat(builder, add, v4f32))
    data = context.make_array(out_type)(context, builder, out).data
    store = builder.store(value, builder.bitcast(builder.gep(data, [i]), v4f32.as_pointer()), align=ALIGN)
    store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))


def _field(builder, lanes, shift, mask):
    v4i32 = ir.VectorType(_I32, _LANES)
    return builder.and_(builder.lshr(lanes, _splat(builder, _as_i32(builder, shift), v4i32)),
                        _splat(builder, _as_i32(builder, mask), v4i32))


def _check_floats(mul, add):
    if mul != types.float32 or add != types.float32:
        raise TypingError(f"streaming lanes take float32 mul/add, got {mul}, {add}")


@intrinsic
def _lanes(typingctx, out, i, a, ja, sa, ma, b, jb, sb, mb, lb, flip, sub, mul, add):
    """out[i:i+4] = float32(((((a[ja+l] >> sa) & ma) | (((b[jb+l] >> sb) & mb) << lb)) ^ flip) - sub) * mul + add."""
    _check_floats(mul, add)

    def codegen(context, builder, sig, args):
        o, i_, a_, ja_, sa_, ma_, b_, jb_, sb_, mb_, lb_, flip_, sub_, mul_, add_ = args
        first = _field(builder, _byte_lanes(context, builder, sig.args[2], a_, ja_), sa_, ma_)
        second = _field(builder, _byte_lanes(context, builder, sig.args[6], b_, jb_), sb_, mb_)
        second = builder.shl(second, _splat(builder, _as_i32(builder, lb_), ir.VectorType(_I32, _LANES)))
        _finish(context, builder, sig.args[0], o, i_, first, second, flip_, sub_, mul_, add_)
        return context.get_dummy_value()

    return types.void(out, i, a, ja, sa, ma, b, jb, sb, mb, lb, flip, sub, mul, add), codegen


@intrinsic
def _lanes_bits(typingctx, out, i, a, ja, sa, ma, bits, sb, lb, sub, mul, add):
    """out[i:i+4] = float32(((((a[ja+l] >> sa) & ma) | (((bits >> (sb+l)) & 1) << lb)) - sub) * mul + add."""
    _check_floats(mul, add)

    def codegen(context, builder, sig, args):
        o, i_, a_, ja_, sa_, ma_, bits_, sb_, lb_, sub_, mul_, add_ = args
        v4i32 = ir.VectorType(_I32, _LANES)
        first = _field(builder, _byte_lanes(context, builder, sig.args[2], a_, ja_), sa_, ma_)
        shifts = builder.add(_splat(builder, _as_i32(builder, sb_), v4i32),
                             ir.Constant(v4i32, [ir.Constant(_I32, lane) for lane in range(_LANES)]))
        second = builder.and_(builder.lshr(_splat(builder, _as_i32(builder, bits_), v4i32), shifts),
                              _splat(builder, ir.Constant(_I32, 1), v4i32))
        second = builder.shl(second, _splat(builder, _as_i32(builder, lb_), v4i32))
        _finish(context, builder, sig.args[0], o, i_, first, second, ir.Constant(_I32, 0), sub_, mul_, add_)
        return context.get_dummy_value()

    return types.void(out, i, a, ja, sa, ma, bits, sb, lb, sub, mul, add), codegen


@intrinsic
def _fence(typingctx):
    """A sequentially consistent fence: the weakly ordered streaming stores before it land first."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@njit(inline="always")
def _u16(src, i):
    return np.int64(src[i]) | (np.int64(src[i + 1]) << 8)


@njit(inline="always")
def _u32(src, i):
    return _u16(src, i) | (_u16(src, i + 2) << 16)


@njit(inline="always")
def _share(n_blocks, t, n_tasks):
    """Task t's contiguous range of blocks."""
    return t * n_blocks // n_tasks, (t + 1) * n_blocks // n_tasks


# Every kernel: kernel(src, out, h, n_tasks): flat uint8 whole blocks, flat float32 output that
# starts 16-byte aligned, the f16 -> f32 table, and how many contiguous shares to split into.

@njit(**_JIT)
def q4_0(src, out, h, n_tasks):
    # [d f16][qs 16]; e = hi*16 + k: (qs[k] >> 4*hi) & 15, minus 8; d * q
    n = src.size // 18
    for t in prange(n_tasks):
        lo, hi = _share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 18, b * 32
            d = h[_u16(src, s)]
            for k in range(0, 16, 4):
                _lanes(out, o + k, src, s + 2 + k, 0, 15, src, s, 0, 0, 0, 0, 8, d, NEG_ZERO)
                _lanes(out, o + 16 + k, src, s + 2 + k, 4, 15, src, s, 0, 0, 0, 0, 8, d, NEG_ZERO)
        _fence()


@njit(**_JIT)
def q4_1(src, out, h, n_tasks):
    # [d f16][m f16][qs 16]; (d * q) + m
    n = src.size // 20
    for t in prange(n_tasks):
        lo, hi = _share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 20, b * 32
            d, m = h[_u16(src, s)], h[_u16(src, s + 2)]
            for k in range(0, 16, 4):
                _lanes(out, o + k, src, s + 4 + k, 0, 15, src, s, 0, 0, 0, 0, 0, d, m)
                _lanes(out, o + 16 + k, src, s + 4 + k, 4, 15, src, s, 0, 0, 0, 0, 0, d, m)
        _fence()


@njit(**_JIT)
def q5_0(src, out, h, n_tasks):
    # [d f16][qh u32][qs 16]; e = hi*16 + k; fifth bit = (qh >> e) & 1; q - 16
    n = src.size // 22
    for t in prange(n_tasks):
        lo, hi = _share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 22, b * 32
            d, qh = h[_u16(src, s)], _u32(src, s + 2)
            for k in range(0, 16, 4):
                _lanes_bits(out, o + k, src, s + 6 + k, 0, 15, qh, k, 4, 16, d, NEG_ZERO)
                _lanes_bits(out, o + 16 + k, src, s + 6 + k, 4, 15, qh, k + 16, 4, 16, d, NEG_ZERO)
        _fence()


@njit(**_JIT)
def q5_1(src, out, h, n_tasks):
    # [d f16][m f16][qh u32][qs 16]; (d * q) + m
    n = src.size // 24
    for t in prange(n_tasks):
        lo, hi = _share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 24, b * 32
            d, m, qh = h[_u16(src, s)], h[_u16(src, s + 2)], _u32(src, s + 4)
            for k in range(0, 16, 4):
                _lanes_bits(out, o + k, src, s + 8 + k, 0, 15, qh, k, 4, 0, d, m)
                _lanes_bits(out, o + 16 + k, src, s + 8 + k, 4, 15, qh, k + 16, 4, 0, d, m)
        _fence()


@njit(**_JIT)
def q8_0(src, out, h, n_tasks):
    # [d f16][qs int8 32]; x * d (the int8 as (u8 ^ 128) - 128)
    n = src.size // 34
    for t in prange(n_tasks):
        lo, hi = _share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 34, b * 32
            d = h[_u16(src, s)]
            for k in range(0, 32, 4):
                _lanes(out, o + k, src, s + 2 + k, 0, 255, src, s, 0, 0, 0, 128, 128, d, NEG_ZERO)
        _fence()


@njit(**_JIT)
def q2_k(src, out, h, n_tasks):
    # [scales 16][qs 64][d f16][dmin f16]; e = half*128 + j*32 + k: q = (qs[half*32+k] >> 2j) & 3;
    # scale byte sc = scales[half*8 + 2j + k//16]: (d * (sc & 15)) * q - (dmin * (sc >> 4))
    n = src.size // 84
    for t in prange(n_tasks):
        lo, hi = _share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 84, b * 256
            d, dmin = h[_u16(src, s + 80)], h[_u16(src, s + 82)]
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
                        _lanes(out, e, src, q, 0, 3, src, s, 0, 0, 0, 0, 0, dl0, -ml0)
                        _lanes(out, e + 32, src, q, 2, 3, src, s, 0, 0, 0, 0, 0, dl1, -ml1)
                        _lanes(out, e + 64, src, q, 4, 3, src, s, 0, 0, 0, 0, 0, dl2, -ml2)
                        _lanes(out, e + 96, src, q, 6, 3, src, s, 0, 0, 0, 0, 0, dl3, -ml3)
        _fence()


@njit(**_JIT)
def q4_k(src, out, h, n_tasks):
    # [d f16][dmin f16][scales 12][qs 128]; e = j*32 + k: (qs[(j//2)*32+k] >> 4*(j%2)) & 15
    # (d*sc[j]) * q - (dmin*mn[j]); one qs byte feeds sub-blocks 2c (low) and 2c+1 (high)
    n = src.size // 144
    for t in prange(n_tasks):
        lo, hi = _share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 144, b * 256
            d, dmin = h[_u16(src, s)], h[_u16(src, s + 2)]
            for c in range(4):
                sc0, mn0 = _k4_scale_min(src, s + 4, 2 * c)
                sc1, mn1 = _k4_scale_min(src, s + 4, 2 * c + 1)
                dl0, ml0 = d * F32(sc0), dmin * F32(mn0)
                dl1, ml1 = d * F32(sc1), dmin * F32(mn1)
                for k in range(0, 32, 4):
                    e, q = o + c * 64 + k, s + 16 + c * 32 + k
                    _lanes(out, e, src, q, 0, 15, src, s, 0, 0, 0, 0, 0, dl0, -ml0)
                    _lanes(out, e + 32, src, q, 4, 15, src, s, 0, 0, 0, 0, 0, dl1, -ml1)
        _fence()


@njit(**_JIT)
def q5_k(src, out, h, n_tasks):
    # [d f16][dmin f16][scales 12][qh 32][qs 128]; like Q4_K plus fifth bit (qh[k] >> j) & 1
    n = src.size // 176
    for t in prange(n_tasks):
        lo, hi = _share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 176, b * 256
            d, dmin = h[_u16(src, s)], h[_u16(src, s + 2)]
            for c in range(4):
                sc0, mn0 = _k4_scale_min(src, s + 4, 2 * c)
                sc1, mn1 = _k4_scale_min(src, s + 4, 2 * c + 1)
                dl0, ml0 = d * F32(sc0), dmin * F32(mn0)
                dl1, ml1 = d * F32(sc1), dmin * F32(mn1)
                for k in range(0, 32, 4):
                    e, q = o + c * 64 + k, s + 48 + c * 32 + k
                    _lanes(out, e, src, q, 0, 15, src, s + 16 + k, 2 * c, 1, 4, 0, 0, dl0, -ml0)
                    _lanes(out, e + 32, src, q, 4, 15, src, s + 16 + k, 2 * c + 1, 1, 4, 0, 0, dl1, -ml1)
        _fence()


@njit(**_JIT)
def q6_k(src, out, h, n_tasks):
    # [ql 128][qh 64][scales int8 16][d f16]; e = a*128 + mm*32 + l (a = 0,1; mm < 4; l < 32):
    # low = (ql[a*64 + (mm%2)*32 + l] >> 4*(mm//2)) & 15; high = (qh[a*32 + l] >> 2*mm) & 3
    # q = (low | high<<4) - 32; (d * sc[e//16]) * q
    n = src.size // 210
    for t in prange(n_tasks):
        lo, hi = _share(n, t, n_tasks)
        for b in range(lo, hi):
            s, o = b * 210, b * 256
            d = h[_u16(src, s + 208)]
            for a in range(2):
                for g2 in range(2):
                    g = s + 192 + a * 8 + g2  # scale of (mm, l-half g2) is sc[a*8 + mm*2 + g2]
                    dl0, dl1 = d * F32(np.int8(src[g])), d * F32(np.int8(src[g + 2]))
                    dl2, dl3 = d * F32(np.int8(src[g + 4])), d * F32(np.int8(src[g + 6]))
                    for l in range(g2 * 16, g2 * 16 + 16, 4):  # two ql bytes and one qh byte feed all four mm
                        e, q0, q1, y = o + a * 128 + l, s + a * 64 + l, s + a * 64 + 32 + l, s + 128 + a * 32 + l
                        _lanes(out, e, src, q0, 0, 15, src, y, 0, 3, 4, 0, 32, dl0, NEG_ZERO)
                        _lanes(out, e + 32, src, q1, 0, 15, src, y, 2, 3, 4, 0, 32, dl1, NEG_ZERO)
                        _lanes(out, e + 64, src, q0, 4, 15, src, y, 4, 3, 4, 0, 32, dl2, NEG_ZERO)
                        _lanes(out, e + 96, src, q1, 4, 15, src, y, 6, 3, 4, 0, 32, dl3, NEG_ZERO)
        _fence()


KERNELS = {Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q5_0: q5_0, Q.Q5_1: q5_1, Q.Q8_0: q8_0, Q.Q2_K: q2_k,
           Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k}


def applies(qtype: Q, out: np.ndarray) -> bool:
    """Whether ``out`` (flat float32) is large and aligned enough to stream ``qtype`` into."""
    return qtype in KERNELS and out.nbytes >= MIN_BYTES and out.ctypes.data % ALIGN == 0
