"""Fixtures of the sharding tests: tiny models whose heads divide up to TP 8.

The converted tiny models (llama.cpp's converter) have 4 heads, so TP 8 is a plan FAIL for
them (a test of its own). For numeric runs at TP 8 we write 8-head models with
ggufcheck.synthetic.tiny (n_vocab 500: padded to 512 = 8 x 64, so rank 7 holds 12 padding
rows), in Q8_0 so the weights go through real dequantization.
"""

from __future__ import annotations

import pytest



@pytest.fixture(scope="session")
def tiny8(tiny_gguf):
    """tiny8(arch) -> path of an 8-head Q8_0 tiny model with a 500-token vocabulary."""
    built = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = tiny_gguf(arch, qtypes={"default": "Q8_0"}, n_head=8, n_vocab=500).path
        return built[arch]

    return get
