"""The engine's per-layer trace of a prompt, shortened where the engine declines the whole.

Both ways the layers stage compares (against ggufcheck's reference, stage.py, and against
another engine, versus.py) start here.
"""

from __future__ import annotations

from ggufcheck.engines.base import Unsupported


def layer_outputs_that_fit(engine, tokens: list[int], kinds: list[str]):
    """(tokens used, the engine's LayerTrace): the whole sequence, or, where the engine declines
    it (e.g. longer than its context), the longest halved prefix it takes (>= 2 tokens)."""
    while True:
        try:
            return tokens, engine.layer_outputs(tokens, kinds)
        except Unsupported:
            if len(tokens) < 4:
                raise
            tokens = tokens[: len(tokens) // 2]
