"""The offset of each group of a quantized row: what integer kernels multiply activation sums with.

Several quant types store a weight as ``w = u * q + o``: an unsigned integer ``q`` times a
group's unit ``u``, plus a group offset ``o`` (Q4_1 / Q5_1: the block's ``m``; the K-quants with
mins: ``-dmin * m``; Q4_0 / Q5_0 read the same way, their ``q - 8`` / ``q - 16`` as ``q`` plus the
offset ``-8d`` / ``-16d``; IQ1_S: ``dl * (delta - 1)`` over CUDA's unsigned grid). An integer
kernel computes ``u * sum(q * x8) + o * S`` per group, and where ``S`` is the sum of the
activations *before* they were rounded to 8 bits (llama.cpp's CUDA q8_1 forms), the rounding
no longer cancels against the offset: the reference must know ``o`` to emulate that arithmetic
(reference.precision.unrounded_sums_error). ``o`` is read from the blocks' own bytes, not guessed
from the dequantized values (a group need not contain the quant 0).

Layouts are ggml's block structs (ggml-common.h); the tests derive every offset independently,
by dequantizing blocks whose quants are zeroed with gguf-py.
"""

from __future__ import annotations

import numpy as np

# type -> (bytes per block, values per block, values per offset group)
LAYOUT = {
    "Q4_0": (18, 32, 32),
    "Q5_0": (22, 32, 32),
    "Q4_1": (20, 32, 32),
    "Q5_1": (24, 32, 32),
    "Q2_K": (84, 256, 16),
    "Q4_K": (144, 256, 32),
    "Q5_K": (176, 256, 32),
    "IQ1_S": (50, 256, 32),
}
IQ1S_DELTA = 0.125


def group_size(qtype: str) -> int | None:
    """Values per offset group of ``qtype`` (None: the type has no offsets here)."""
    layout = LAYOUT.get(qtype)
    return None if layout is None else layout[2]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def group_offsets(qtype: str, raw: np.ndarray) -> np.ndarray:
    """``raw`` [rows, row_bytes] (uint8, whole blocks) -> offsets [rows, groups per row] (float64)."""
    block_bytes, _values, _group = LAYOUT[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)
    if qtype == "Q4_0":
        return -8.0 * _f16(blocks, 0)
    if qtype == "Q5_0":
        return -16.0 * _f16(blocks, 0)
    if qtype in ("Q4_1", "Q5_1"):
        return _f16(blocks, 2)
    if qtype == "Q2_K":  # scales[16] (low nibble: scale, high: min), qs[64], d, dmin
        mins = (blocks[..., 0:16] >> 4).astype(np.float64)
        return (-_f16(blocks, 82)[..., None] * mins).reshape(rows, -1)
    if qtype in ("Q4_K", "Q5_K"):  # d, dmin, scales[12] (6-bit scales and mins, get_scale_min_k4)
        s = blocks[..., 4:16].astype(np.int64)
        low = s[..., 4:8] & 63  # groups 0..3
        high = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)  # groups 4..7
        mins = np.concatenate([low, high], axis=-1).astype(np.float64)
        return (-_f16(blocks, 2)[..., None] * mins).reshape(rows, -1)
    if qtype == "IQ1_S":  # d, qs[32], qh[8] (u16: grid index bits, 3-bit scale, delta sign)
        qh = blocks[..., 34:50].copy().view(np.uint16).astype(np.int64)  # [rows, nb, 8]
        dl = _f16(blocks, 0)[..., None] * (2 * ((qh >> 12) & 7) + 1)
        delta = np.where(qh & 0x8000, -IQ1S_DELTA, IQ1S_DELTA)
        return (dl * (delta - 1.0)).reshape(rows, -1)
    raise KeyError(qtype)
