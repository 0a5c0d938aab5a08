"""Synthetic quantized blocks: a cheap fuzzer for tests and realistic data for benchmarks.

Why: random bytes are valid blocks of every GGUF type (there are no invalid bit patterns),
so comparing two dequantizers on them exercises every field. Two flavours:
- :func:`fuzz_blocks`: uniform random bytes, then the float16 scale fields of some blocks
  forced to NaN, +-Inf, subnormals, zero and the extremes (random bytes alone rarely hit
  every special pattern);
- :func:`realistic_blocks`: random quants with *sane* scales (what real weights look like),
  so throughput is not skewed by NaN/subnormal arithmetic.
"""

from __future__ import annotations

import gguf
import numpy as np

from ggufcheck.gguf.quants import tables

Q = gguf.GGMLQuantizationType

F16_FIELDS = tables.F16_SCALE_FIELDS

# float16 bit patterns every fuzz run must contain: +-0, +-subnormal min/max, +-1, max,
# +-Inf, quiet and signalling NaN, negative NaN
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x83FF, 0x03FF, 0x3C00, 0xBC00, 0x7BFF,
                        0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00], dtype=np.uint16)


def _put_f16(blocks: np.ndarray, qtype: Q, values: np.ndarray) -> None:
    """Write float16 bit patterns ``values`` (n_blocks,) into every scale field of ``blocks``."""
    lo, hi = (values & 0xFF).astype(np.uint8), (values >> 8).astype(np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        blocks[:, off], blocks[:, off + 1] = lo, hi
    if qtype == Q.IQ1_M:  # its f16 scale is spread over the top nibbles of 4 words (bytes 49..55)
        for i, shift in enumerate((0, 4, 8, 12)):
            nib = ((values >> shift) & 0xF).astype(np.uint8)
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (nib << 4)


def fuzz_blocks(qtype: Q, n_blocks: int, seed: int = 0) -> np.ndarray:
    """(n_blocks, type_size) uint8: random blocks, the first ones with special scales."""
    _, size = tables.block_geometry(qtype)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    n_special = min(n_blocks, 4 * len(SPECIAL_F16))
    special = np.resize(SPECIAL_F16, n_special)
    head = blocks[:n_special]
    _put_f16(head, qtype, special)
    if qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q2_K):  # d and min/dmin differ: Inf - Inf, NaN + x
        off = F16_FIELDS[qtype][1]
        head[:, off:off + 2] = np.resize(SPECIAL_F16[::-1], n_special).view(np.uint8).reshape(-1, 2)
    if qtype in (Q.F16, Q.BF16):
        blocks.reshape(-1).view(np.uint16)[:n_special] = special
    return blocks


def realistic_blocks(qtype: Q, n_blocks: int, seed: int = 0) -> np.ndarray:
    """(n_blocks, type_size) uint8: random quants with scales in a weight-like range."""
    _, size = tables.block_geometry(qtype)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-2, n_blocks).astype(np.float16).view(np.uint16)
    _put_f16(blocks, qtype, scales)
    if qtype == Q.F16:
        blocks = rng.standard_normal(n_blocks * size // 2).astype(np.float16).view(np.uint8).reshape(n_blocks, size)
    elif qtype == Q.BF16:
        bits = rng.standard_normal(n_blocks * size // 2).astype(np.float32).view(np.uint32) >> 16
        blocks = bits.astype(np.uint16).view(np.uint8).reshape(n_blocks, size)
    elif qtype == Q.F32:
        blocks = rng.standard_normal(n_blocks * size // 4).astype(np.float32).view(np.uint8).reshape(n_blocks, size)
    elif qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(118, 130, n_blocks)
    elif qtype == Q.NVFP4:
        blocks[:, :4] = rng.integers(0x20, 0x50, (n_blocks, 4))
    return blocks
