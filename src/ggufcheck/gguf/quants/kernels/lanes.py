"""The streaming-store lane operation of the ``*_streaming`` kernels: LLVM intrinsics for numba.

Why streaming stores: an ordinary store to memory that is not in cache first reads the line it
lands in ("read for ownership"), so filling a float32 buffer larger than the last-level cache
moves every line twice. On the 2-core CI machine a numba fill of a 172 MB buffer ran at 28 GB/s,
the same fill with non-temporal stores at 61 GB/s, and a dequantizer writes 3.6-7 float32 bytes
per byte it reads: past the cache the write is what bounds it (``benchmarks/dequant.py`` prints
both fills and both kernels side by side). Each 4-lane group of outputs is computed in vector
registers and stored with one 16-byte non-temporal store (``movntps`` on x86, ``stnp`` on
AArch64; LLVM emits a plain store where a target has none), and a fence ends each thread's share
so that the weakly ordered stores are visible when the kernel returns.

Why not the plain kernels with a flag: LLVM's loop vectorizer declines a loop whose
non-temporal stores it cannot prove 16-byte aligned, and decoding into an L1 scratch row and
streaming that out measured slower than the plain kernel (the extra pass costs more than the
write saves). So each lane group is one call of ``lanes``/``lanes_bits``, which spell out the
decode every integer block type shares:

    q = ((((a[ja + l] >> sa) & ma) | (((b[jb + l] >> sb) & mb) << lb)) ^ flip) - sub
    out[i + l] = float32(q) * mul + add            for lanes l = 0..3

(``lanes_bits`` takes the second field from bits ``sb + l`` of one integer: Q5_0/Q5_1's ``qh``).
Bit-exact with gguf-py as the plain kernels are: ``q`` is exact in int32 and in float32, and each
lane is one float32 multiply and one add (``d * q`` alone adds -0.0, which changes no value;
``x - m`` is ``x + (-m)``).

Small outputs never stream (``registry.STREAM_MIN_BYTES``): a streaming store bypasses the
cache, and a caller that reads a cache-sized result right back would lose more than the write
saves.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ggufcheck.gguf.quants.registry import STREAM_ALIGN as ALIGN

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


def _field(builder, vec, shift, mask):
    v4i32 = ir.VectorType(_I32, _LANES)
    return builder.and_(builder.lshr(vec, _splat(builder, _as_i32(builder, shift), v4i32)),
                        _splat(builder, _as_i32(builder, mask), v4i32))


def _check_floats(mul, add):
    if mul != types.float32 or add != types.float32:
        raise TypingError(f"streaming lanes take float32 mul/add, got {mul}, {add}")


@intrinsic
def lanes(typingctx, out, i, a, ja, sa, ma, b, jb, sb, mb, lb, flip, sub, mul, add):
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
def lanes_bits(typingctx, out, i, a, ja, sa, ma, bits, sb, lb, sub, mul, add):
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
def fence(typingctx):
    """A sequentially consistent fence: the weakly ordered streaming stores before it land first."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen
