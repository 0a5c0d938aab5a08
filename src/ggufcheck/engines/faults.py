"""Engines with a known corruption, wrapping a healthy one: proof that the checks can fail.

Each wrapper changes one thing the way a real serving bug would (fault-catalog.md), and the
test suite asserts that the stage meant to catch it fails while the healthy engine passes.
Users can run them against their own pipelines the same way (``ggufcheck.engines.faults``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ggufcheck.engines.base import Generation, TokenLogprobs, log_softmax
from ggufcheck.engines.wrapped import WrappedEngine  # noqa: F401 - the base, re-exported for users


def _full(table: TokenLogprobs, logprobs: np.ndarray) -> TokenLogprobs:
    return TokenLogprobs(table.tokens, table.vocab_size, logprobs.astype(np.float32), present=table.present)


class ShuffledLogits(WrappedEngine):
    """A fixed permutation of the vocabulary on every output (a wrong lm_head row order)."""

    def __init__(self, inner: Engine, seed: int = 0):
        super().__init__(inner)
        self.perm = np.random.default_rng(seed).permutation(inner.vocab_size)

    def corrupt(self, table: TokenLogprobs) -> TokenLogprobs:
        return _full(table, table.logprobs[:, self.perm])

    def generate(self, prompt, max_new_tokens, *, top_k: int = 20) -> Generation:
        gen = self.inner.generate(prompt, max_new_tokens, top_k=top_k)
        return replace(gen, steps=self.corrupt(gen.steps))


class FlatDistribution(WrappedEngine):
    """Near-uniform outputs whatever the input (a runner returning garbage, catalog #18)."""

    def __init__(self, inner: Engine, temperature: float = 50.0):
        super().__init__(inner)
        self.temperature = temperature

    def corrupt(self, table: TokenLogprobs) -> TokenLogprobs:
        return _full(table, log_softmax(table.logprobs.astype(np.float64) / self.temperature))

    def generate(self, prompt, max_new_tokens, *, top_k: int = 20) -> Generation:
        gen = self.inner.generate(prompt, max_new_tokens, top_k=top_k)
        return replace(gen, steps=self.corrupt(gen.steps))


class DecodeDrift(WrappedEngine):
    """Decode steps drift from prefill: noise growing with each step (a KV-cache bug, #11/#16)."""

    def __init__(self, inner: Engine, scale: float = 1.0, seed: int = 0):
        super().__init__(inner)
        self.scale = scale
        self.rng = np.random.default_rng(seed)

    def generate(self, prompt, max_new_tokens, *, top_k: int = 20) -> Generation:
        gen = self.inner.generate(prompt, max_new_tokens, top_k=top_k)
        lp = gen.steps.logprobs.astype(np.float64).copy()  # [T, V]
        rows = np.flatnonzero(gen.steps.present)
        for step, row in enumerate(rows):
            noise = self.rng.standard_normal(lp.shape[1]) * self.scale * (step + 1)
            lp[row] = log_softmax(lp[row] + noise)
        return replace(gen, steps=_full(gen.steps, lp))


class ShiftedPrefill(WrappedEngine):
    """Teacher-forced rows shifted by one position (row t reports row t+1), decode untouched:
    the alignment bug of a server pairing echoed prompt entries with the wrong distribution."""

    def corrupt(self, table: TokenLogprobs) -> TokenLogprobs:
        lp = np.roll(table.logprobs, -1, axis=0)
        present = table.present.copy()
        present[-1] = False  # nothing to shift into the last row
        return TokenLogprobs(table.tokens, table.vocab_size, lp, present=present)


class InputIgnored(WrappedEngine):
    """Every prompt scored as its first token repeated (token ids not reaching the model, or an
    embedding lookup returning one row): the same distribution at every position."""

    def score(self, tokens, *, top_k: int = 20) -> TokenLogprobs:
        tokens = [int(t) for t in tokens]
        table = self.inner.score([tokens[0]] * len(tokens), top_k=top_k)
        return TokenLogprobs(np.asarray(tokens), table.vocab_size, table.logprobs, table.topk_ids,
                             table.topk_logprobs, None, table.present)


class LongPromptWrong(WrappedEngine):
    """A prompt longer than ``longer_than`` tokens is processed wrong: every row (a kernel or
    path that the length switches on, ``from_row=None``) or the rows from ``from_row`` on (a
    second micro-batch that does not see the first one's keys). Decode is untouched."""

    def __init__(self, inner: Engine, longer_than: int, from_row: int | None = None, seed: int = 0):
        super().__init__(inner)
        self.longer_than, self.from_row = longer_than, from_row
        self._rng = np.random.default_rng(seed)

    def corrupt(self, table: TokenLogprobs) -> TokenLogprobs:
        if len(table.tokens) <= self.longer_than or table.logprobs is None:
            return table
        logits = table.logprobs.astype(np.float64).copy()
        start = 0 if self.from_row is None else self.from_row
        logits[start:] += self._rng.normal(0.0, 1.0, size=logits[start:].shape)
        return _full(table, log_softmax(logits))


class EarlyRowsNoisy(WrappedEngine):
    """The first ``rows`` positions of every prompt are computed less precisely (noise of
    ``scale`` on their logits), whatever the prompt's length, decode untouched: what llama.cpp's
    CUDA backend did to SmolLM2's first tokens (docs/real-world-cases.md), where the short
    prompts of the length sweep fail only because their rows are mostly those positions."""

    def __init__(self, inner: Engine, rows: int = 8, scale: float = 0.5, seed: int = 0):
        super().__init__(inner)
        self.rows, self.scale, self.seed = rows, scale, seed

    def corrupt(self, table: TokenLogprobs) -> TokenLogprobs:
        if table.logprobs is None:
            return table
        logits = table.logprobs.astype(np.float64).copy()
        n = min(self.rows, len(logits))
        noise = np.random.default_rng(self.seed).normal(0.0, self.scale, size=(self.rows, logits.shape[1]))
        logits[:n] += noise[:n]  # the same noise per position at every length: a position's error, not a length's
        return _full(table, log_softmax(logits))
