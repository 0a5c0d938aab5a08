"""Where the scale fields sit inside each ggml quant block: for test data and fault injection.

Two uses: (1) writing random but *valid* blocks for quant types that gguf-py cannot quantize
(K-quants, IQ types), by filling a block with random bytes and then setting its scale fields
to small finite values; (2) corrupting one block's scale (NaN, Inf, huge) to test health
scans. Offsets are read from the ``block_*`` structs in llama.cpp's ggml/src/ggml-common.h
(the byte offset of each ``ggml_half`` scale inside the block); tests check every entry
against gguf.quants.dequantize (a NaN written at the offset must make the block NaN).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

# qtype -> byte offsets of the fp16 scale fields in one block (d first; then m / dmin).
F16_SCALE_OFFSETS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,),  # d, qs[16]
    Q.Q4_1: (0, 2),  # d, m, qs[16]
    Q.Q5_0: (0,),  # d, qh[4], qs[16]
    Q.Q5_1: (0, 2),  # d, m, qh[4], qs[16]
    Q.Q8_0: (0,),  # d, qs[32]
    Q.Q2_K: (80, 82),  # scales[16], qs[64], d, dmin
    Q.Q3_K: (108,),  # hmask[32], qs[64], scales[12], d
    Q.Q4_K: (0, 2),  # d, dmin, scales[12], qs[128]
    Q.Q5_K: (0, 2),  # d, dmin, scales[12], qh[32], qs[128]
    Q.Q6_K: (208,),  # ql[128], qh[64], scales[16], d
    Q.IQ2_XXS: (0,),
    Q.IQ2_XS: (0,),
    Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.IQ1_S: (0,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.TQ1_0: (52,),  # qs[48], qh[4], d
    Q.TQ2_0: (64,),  # qs[64], d
}

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
_FP16_SMALL_LO, _FP16_SMALL_HI = 1e-4, 2e-3  # random-block scales: values stay O(0.01-1)


def block_size(qtype: Q) -> int:
    """Elements per block (1 for float types)."""
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: Q) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[qtype][1]


def random_blocks(rng: np.random.Generator, n_rows: int, row_elements: int, qtype: Q) -> np.ndarray:
    """Random valid quantized rows: uint8 array [n_rows, row_bytes] with finite, small scales.

    For quant types gguf-py cannot quantize. Raises ValueError for a type whose scale
    layout is not in the table (IQ1_M and MXFP4 are handled specially) or a row length
    that is not a multiple of the block size.
    """
    bs, ts = GGML_QUANT_SIZES[qtype]
    if row_elements % bs:
        raise ValueError(f"row length {row_elements} is not a multiple of {qtype.name}'s block size {bs}")
    n_blocks = row_elements // bs
    data = rng.integers(0, 256, size=(n_rows, n_blocks, ts), dtype=np.uint8)
    if qtype in F16_SCALE_OFFSETS:
        for off in F16_SCALE_OFFSETS[qtype]:
            scales = rng.uniform(_FP16_SMALL_LO, _FP16_SMALL_HI, size=(n_rows, n_blocks)).astype("<f2")
            data[:, :, off:off + 2] = scales.view(np.uint8).reshape(n_rows, n_blocks, 2)
    elif qtype == Q.MXFP4:  # e8m0 exponent byte first: 2^(e-127); keep it near 2^-3
        data[:, :, 0] = rng.integers(120, 127, size=(n_rows, n_blocks), dtype=np.uint8)
    elif qtype == Q.IQ1_M:  # fp16 scale spread over the top nibbles of scales[4] (uint16 x 4)
        # the last uint16's top nibble holds fp16 bits 15..12 (sign, exponent high bits):
        # 0b0001 keeps the scale a small positive normal number.
        last = ts - 1  # high byte of the last uint16 of scales
        data[:, :, last] = (data[:, :, last] & 0x0F) | 0x10
    else:
        raise ValueError(f"no random-block recipe for {qtype.name}")
    return data.reshape(n_rows, n_blocks * ts)


def scale_blocks(data: np.ndarray, qtype: Q, factor: float) -> np.ndarray:
    """``data`` (rows of ``qtype`` blocks) with every fp16 scale field multiplied by
    ``factor``: each of these types dequantizes linearly in its scales (d, and dmin where it
    has one), so the whole tensor is scaled by ``factor`` (to fp16 rounding)."""
    if qtype not in F16_SCALE_OFFSETS:
        raise ValueError(f"{qtype.name} has no fp16 scale fields to scale")
    ts = GGML_QUANT_SIZES[qtype][1]
    blocks = data.reshape(-1, ts).copy()
    for off in F16_SCALE_OFFSETS[qtype]:
        scale = blocks[:, off:off + 2].copy().view("<f2").astype(np.float32) * np.float32(factor)
        blocks[:, off:off + 2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(data.shape)
