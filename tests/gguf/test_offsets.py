"""Group offsets read from the blocks' bytes (gguf/quants/offsets.py), derived independently:
gguf-py dequantizes the same blocks with every quant zeroed (IQ1_S: grid index 0, all -1), and
what is left of each group is its offset alone, ``w = u * 0 + o``."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest

from ggufcheck.gguf.quants.offsets import LAYOUT, group_offsets

# where each type keeps its quants (byte ranges zeroed) and its f16 scales (kept sane)
QUANT_BYTES = {"Q4_0": [(2, 18)], "Q5_0": [(2, 22)], "Q4_1": [(4, 20)], "Q5_1": [(4, 24)],
               "Q2_K": [(16, 80)], "Q4_K": [(16, 144)], "Q5_K": [(16, 176)], "IQ1_S": [(2, 34)]}
F16_AT = {"Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q2_K": [80, 82], "Q4_K": [0, 2],
          "Q5_K": [0, 2], "IQ1_S": [0]}


def _random_blocks(qtype: str, rows: int, blocks_per_row: int, rng) -> np.ndarray:
    block_bytes = LAYOUT[qtype][0]
    raw = rng.integers(0, 256, (rows, blocks_per_row, block_bytes), dtype=np.uint8)
    for at in F16_AT[qtype]:  # scales of either sign, within f16's range
        raw[..., at:at + 2] = rng.normal(0, 0.01, (rows, blocks_per_row)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, blocks_per_row * block_bytes)


@pytest.mark.parametrize("qtype", sorted(LAYOUT))
def test_offsets_are_what_is_left_of_each_group_with_its_quants_zeroed(qtype):
    rng = np.random.default_rng(1)
    _, values, group = LAYOUT[qtype]
    raw = _random_blocks(qtype, 6, 3, rng)
    zeroed = raw.reshape(6, 3, -1).copy()
    for lo, hi in QUANT_BYTES[qtype]:
        zeroed[..., lo:hi] = 0
    if qtype == "IQ1_S":  # keep qh's scale and delta bits, zero its grid index bits
        qh = zeroed[..., 34:50].copy().view(np.uint16) & 0xF000
        zeroed[..., 34:50] = qh.view(np.uint8)
    elif qtype == "Q5_0":  # qh lives inside the zeroed range already (bytes 2..6)
        pass
    ggml_type = gguf.GGMLQuantizationType[qtype]
    left = gguf.quants.dequantize(zeroed.reshape(6, -1), ggml_type).astype(np.float64)  # [6, 3 * values]
    want = left.reshape(6, -1, group)
    assert np.all(want == want[..., :1]), "a zeroed group must hold one value"
    got = group_offsets(qtype, raw)
    assert got.shape == (6, 3 * values // group)
    np.testing.assert_allclose(got, want[..., 0], rtol=1e-6, atol=1e-12)
    # and the offsets are not the trivial zeros: the types carry real ones
    assert np.abs(got).max() > 0


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_the_rest_of_each_weight_is_an_unsigned_multiple_of_the_groups_unit(qtype):
    """On blocks gguf-py's own quantizer wrote: ``w - o`` is ``u * q`` with q in 0..2^bits - 1."""
    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.05, (8, 256)).astype(np.float32)
    ggml_type = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, ggml_type)
    deq = gguf.quants.dequantize(raw, ggml_type).astype(np.float64).reshape(8, -1, 32)
    offsets = group_offsets(qtype, raw)[..., None]
    bits = 4 if qtype.startswith("Q4") else 5
    unit = (offsets / -(2 ** (bits - 1)) if qtype.endswith("_0")
            else raw.reshape(8, -1, LAYOUT[qtype][0])[..., 0:2].copy().view(np.float16).astype(np.float64))
    q = (deq - offsets) / unit
    assert np.allclose(q, np.round(q), atol=1e-3) and q.min() > -1e-3 and q.max() < 2 ** bits - 1 + 1e-3
