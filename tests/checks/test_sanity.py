"""Sanity checks: a healthy model passes; flat, shuffled and input-blind engines fail."""

from __future__ import annotations

import pytest

from ggufcheck.checks.sanity import run_sanity
from ggufcheck.engines.faults import FlatDistribution, ShuffledLogits, WrappedEngine
from ggufcheck.results import Status


def _by_check(results):
    return {r.check: r.status for r in results}


class IgnoresInput(WrappedEngine):
    """Returns the first prompt's distributions for every prompt (catalog #18)."""

    def score(self, tokens, *, top_k=20):
        if not hasattr(self, "_first"):
            self._first = self.inner.score(tokens, top_k=top_k)
        from ggufcheck.engines.base import TokenLogprobs

        n = min(len(tokens), len(self._first))
        return TokenLogprobs(list(tokens)[:n], self.vocab_size, self._first.logprobs[:n])


def test_healthy_model_passes(llama, sequences, llama_tables):
    gens = [llama.generate(sequences[0], 8)]
    status = _by_check(run_sanity(llama_tables, gens, llama.vocab_size))
    assert set(status.values()) == {Status.PASS}, status


def test_flat_distribution_is_detected(llama, sequences):
    bad = FlatDistribution(llama)
    status = _by_check(run_sanity([bad.score(s) for s in sequences], [], llama.vocab_size))
    assert status["sanity.entropy"] == Status.FAIL
    assert status["sanity.perplexity"] == Status.FAIL
    assert status["sanity.repetition"] == Status.SKIP


def test_shuffled_logits_make_natural_text_look_random(llama, sequences):
    bad = ShuffledLogits(llama)
    status = _by_check(run_sanity([bad.score(s) for s in sequences], [], llama.vocab_size))
    assert status["sanity.perplexity"] == Status.FAIL
    assert status["sanity.entropy"] == Status.PASS  # a permutation keeps the entropy: only perplexity sees it


def test_engine_ignoring_its_input_is_detected(llama, sequences):
    bad = IgnoresInput(llama)
    status = _by_check(run_sanity([bad.score(s) for s in sequences], [], llama.vocab_size))
    assert status["sanity.input_dependence"] == Status.FAIL


def test_nan_logprobs_fail_first(llama, llama_tables):
    import numpy as np

    from ggufcheck.engines.base import TokenLogprobs

    t = llama_tables[0]
    lp = t.logprobs.copy()
    lp[2, 5] = np.nan
    results = run_sanity([TokenLogprobs(t.tokens, t.vocab_size, lp)], [], llama.vocab_size)
    assert [r.check for r in results] == ["sanity.finite"] and results[0].status == Status.FAIL


@pytest.mark.parametrize("n", [1])
def test_one_prompt_skips_input_dependence(llama_tables, llama, n):
    status = _by_check(run_sanity(llama_tables[:n], [], llama.vocab_size))
    assert status["sanity.input_dependence"] == Status.SKIP
