"""Are the served prompt log-probs where they claim to be? (before any distribution is judged)

Servers report teacher-forced prompt log-probs in dialects: llama-cpp-python's OpenAI server
(``echo`` + ``logprobs``) pairs entry i with the distribution one position away from the one
ggufcheck's table puts there. Judged as they come, such tables make a healthy model look
random ("perplexity 17,266"). So before sanity, logits or paths judge anything, the
engine's tables are compared with the reference's at row offsets -1, 0 and +1; an offset
that agrees far better than the as-reported alignment is named ("the served prompt
log-probs are shifted by one position"), and every later check judges the realigned rows
(the engine is wrapped, so its later answers are realigned the same way).

Offset ``d``: the realigned row t is the engine's row t - d (d = +1: the engine reports each
distribution one row early).

Also here: an engine whose distribution is the same at every position of a prompt while
the reference's changes has not read its input (:func:`input_ignored`), which no
distribution metric says in those words.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ggufcheck.checks.logits import collect
from ggufcheck.engines.base import TokenLogprobs
from ggufcheck.engines.wrapped import WrappedEngine
from ggufcheck.results import Result, failed

OFFSETS = (1, -1)
# a shift is named only when it agrees this many times better (mean KL) than the rows as
# reported AND agrees on the argmax at most positions: a broken engine is not "shifted"
GAIN = 20.0
MIN_ARGMAX = 0.8


def shift_rows(table: TokenLogprobs, d: int) -> TokenLogprobs:
    """Row t of the result is row t - d of ``table`` (rows shifted in from outside: absent)."""
    n = len(table.tokens)

    def roll(a):
        return None if a is None else np.roll(a, d, axis=0)

    present = np.roll(table.present, d)
    if d > 0:
        present[:d] = False
    elif d < 0:
        present[n + d:] = False
    return TokenLogprobs(table.tokens, table.vocab_size, roll(table.logprobs), roll(table.topk_ids),
                         roll(table.topk_logprobs), None, present)


class Realigned(WrappedEngine):
    """The engine with its teacher-forced tables realigned by ``offset`` (decode untouched:
    a generation's per-step rows are the engine's own sampling distributions)."""

    def __init__(self, inner, offset: int):
        super().__init__(inner)
        self.offset = offset

    def corrupt(self, table: TokenLogprobs) -> TokenLogprobs:
        return shift_rows(table, self.offset)

    def generate(self, prompt, max_new_tokens, *, top_k: int = 20):
        return self.inner.generate(prompt, max_new_tokens, top_k=top_k)


def detect_offset(references: Sequence[TokenLogprobs], tables: Sequence[TokenLogprobs]) -> tuple[Result, int] | None:
    """A FAIL naming the offset and the realigned agreement, with the offset; None when the
    rows are where they claim to be (or no offset explains the difference)."""
    as_is = collect(list(zip(references, tables)))
    if as_is.n == 0:
        return None
    kl0 = float(np.nanmean(as_is.kl))
    best = None
    for d in OFFSETS:
        m = collect([(r, shift_rows(t, d)) for r, t in zip(references, tables)])
        if m.n < max(4, as_is.n // 2):
            continue
        kl, agree = float(np.nanmean(m.kl)), float(m.agree.mean())
        if kl * GAIN < kl0 and agree >= MIN_ARGMAX and (best is None or kl < best[1]):
            best = (d, kl, agree, m.n)
    if best is None:
        return None
    d, kl, agree, n = best
    way = "early" if d > 0 else "late"
    msg = (f"the served prompt log-probs are shifted by {abs(d)} position (each distribution is reported one row "
           f"{way}): as reported, mean KL {kl0:.3g} against the reference; realigned, mean KL {kl:.3g} and argmax "
           f"{agree:.0%} over {n} positions. The checks after this one judge the realigned rows")
    return failed("logits.alignment", "api", msg,
                  stats={"offset": d, "kl_as_reported": kl0, "kl_realigned": kl, "argmax_realigned": agree,
                         "positions": n}), d


def _tv_between_rows(table: TokenLogprobs) -> float | None:
    """Largest total variation between consecutive present rows of one table (full vocab)."""
    if not table.full:
        return None
    rows = np.flatnonzero(table.present)
    if len(rows) < 2:
        return None
    p = np.exp(table.logprobs[rows].astype(np.float64))
    return float(0.5 * np.abs(p[1:] - p[:-1]).sum(axis=1).max())


def input_ignored(references: Sequence[TokenLogprobs], tables: Sequence[TokenLogprobs],
                  same: float = 1e-4, differ: float = 0.05) -> Result | None:
    """A FAIL when every prompt's rows are the same distribution (TV < ``same``) on the engine
    while the reference's rows differ (TV > ``differ``); None otherwise."""
    eng = [_tv_between_rows(t) for t in tables]
    ref = [_tv_between_rows(r) for r in references]
    pairs = [(e, r) for e, r in zip(eng, ref) if e is not None and r is not None]
    if not pairs or not all(e < same for e, _ in pairs) or not all(r > differ for _, r in pairs):
        return None
    # the same FLAT distribution everywhere is a flat output (an lm-head / logits fault), not
    # an ignored input: the rows must still say something (KL to uniform, in nats)
    informative = [float(np.log(t.vocab_size) + (np.exp(t.logprobs[t.present]) * t.logprobs[t.present]).sum(1).mean())
                   for t in tables if t.full]
    if not informative or min(informative) < 1e-2:
        return None
    worst_e = max(e for e, _ in pairs)
    least_r = min(r for _, r in pairs)
    return failed("logits.input_ignored", "embedding",
                  f"the engine gives the same distribution at every position of every prompt (largest total "
                  f"variation between neighbouring positions {worst_e:.2g}) while the reference's change (at least "
                  f"{least_r:.2g}): the input is ignored (token ids not reaching the model, or an embedding lookup "
                  f"returning one row)", stats={"engine_tv_max": worst_e, "reference_tv_min": least_r,
                                                "prompts": len(pairs)})
