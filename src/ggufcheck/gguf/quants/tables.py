"""Constant tables the dequantizers index, built once from gguf-py's own definitions.

Why a module: every backend (numba CPU kernels, Triton GPU kernels) needs the same block
geometry and lookup tables, and they must be *exactly* gguf-py's, since gguf-py is the
oracle our output is compared with bit for bit. The IQ codebooks (grids) and sign table
are taken from ``gguf.quants`` (data, not code); the small value tables are written out
here and checked against gguf-py in tests.
"""

from __future__ import annotations

from functools import cache

import gguf
import gguf.quants as gq
import numpy as np
from gguf.constants import GGML_QUANT_SIZES

Q = gguf.GGMLQuantizationType

# ggml's kvalues_iq4nl: the 16 non-linear levels of an IQ4 nibble
IQ4_LEVELS = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.int8)
# E2M1 values doubled (ggml's kvalues_mxfp4), shared by MXFP4 and NVFP4
FP4_LEVELS = np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), np.int8)

# byte offsets of the float16 scale fields inside one block (gguf-py's block layouts); IQ1_M
# spreads its scale over four nibbles and has no entry
F16_SCALE_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.TQ1_0: (52,), Q.TQ2_0: (64,),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
    Q.IQ1_S: (0,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}


def block_geometry(qtype: Q) -> tuple[int, int]:
    """(elements per block, bytes per block) of ``qtype``."""
    return GGML_QUANT_SIZES[qtype]


@cache
def f16_to_f32() -> np.ndarray:
    """All 65536 float16 bit patterns widened to float32 (numpy's conversion: NaN payloads kept)."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


@cache
def e8m0_half_to_f32() -> np.ndarray:
    """MXFP4's shared exponent byte -> 2**(e-128) as float32 (ggml_e8m0_to_fp32_half)."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


@cache
def ue4m3_half_to_f32() -> np.ndarray:
    """NVFP4's unsigned E4M3 scale byte (bias 7, sign bit ignored) -> value * 0.5 as float32.

    0x00 and 0x7F decode to 0 (ggml treats 0x7F, E4M3's NaN, as zero); every value is a small
    power-of-two multiple, so the float32 result is exact.
    """
    x = np.arange(256)
    exp, man = (x >> 3) & 0xF, x & 7
    value = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0)) * 0.5
    value[(x == 0) | (x == 0x7F)] = 0.0
    return value.astype(np.float32)


@cache
def ksigns() -> np.ndarray:
    """ksigns_iq2xs: a 7-bit index -> the byte of 8 sign bits it stands for (uint8, 128)."""
    return np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()


@cache
def grid(qtype: Q) -> np.ndarray:
    """The IQ codebook of ``qtype`` as float32 (points, width), decoded by gguf-py itself."""
    cls = gq._type_traits[qtype]
    cls.init_grid()
    assert cls.grid is not None, qtype.name
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


def gguf_py_types() -> tuple[Q, ...]:
    """Every type ``gguf.quants.dequantize`` handles (F32 and F16 are special-cased there)."""
    return (Q.F32, Q.F16, *gq._type_traits)
