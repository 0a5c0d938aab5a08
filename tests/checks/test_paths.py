"""Path checks: llama.cpp passes; decode drift, nondeterminism and chunk corruption fail their check."""

from __future__ import annotations

import numpy as np

from ggufcheck.checks.logits import ALLOWANCES
from ggufcheck.checks.paths import (
    PathOptions,
    check_chunked_prefill,
    check_determinism,
    check_prefill_vs_decode,
    run_paths,
)
from ggufcheck.engines.base import TokenLogprobs, log_softmax
from ggufcheck.engines.faults import DecodeDrift, WrappedEngine
from ggufcheck.results import Status

OPTIONS = PathOptions(max_new_tokens=5, decode_prompts=1, chunk_sizes=(4,))
Q8 = ALLOWANCES["q8"]  # llama.cpp's numerical class


def _by_check(results):
    return {r.check: r for r in results}


class Nondeterministic(WrappedEngine):
    """Every call adds fresh noise (a race in a reduction, catalog #17)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.rng = np.random.default_rng(1)

    def corrupt(self, table):
        noisy = table.logprobs + self.rng.normal(0, 2.0, table.logprobs.shape)
        return TokenLogprobs(table.tokens, table.vocab_size, log_softmax(noisy).astype(np.float32))


class BrokenChunks(WrappedEngine):
    """Chunked prefill loses the earlier chunks' context (catalog #7-#9)."""

    def score_chunked(self, tokens, chunk_size, *, top_k=20):
        tokens = list(tokens)
        rows = [self.inner.score(tokens[i:i + chunk_size]).logprobs for i in range(0, len(tokens), chunk_size)]
        return TokenLogprobs(tokens, self.vocab_size, np.concatenate(rows))


def test_healthy_llama_cpp_passes_every_path(llama, sequences, llama_tables):
    results, gens = run_paths(llama, sequences[:2], llama_tables[:2], OPTIONS)
    by = _by_check(results)
    assert by["paths.prefill_vs_decode"].status == Status.PASS, by["paths.prefill_vs_decode"].message
    assert by["paths.determinism"].status == Status.PASS and by["paths.determinism"].stats["bitwise"]
    assert by["paths.chunked_prefill[4]"].status == Status.PASS
    assert by["paths.batch_invariance"].status == Status.SKIP  # with the adapter's reason
    assert "one sequence" in by["paths.batch_invariance"].message
    assert len(gens) == 1 and len(gens[0].generated) == 5


def test_decode_drifting_from_prefill_fails_prefill_vs_decode(llama, sequences, llama_tables):
    result, _ = check_prefill_vs_decode(DecodeDrift(llama, scale=0.5), sequences, Q8, OPTIONS)
    assert result.status == Status.FAIL and result.component == "decode"


def test_nondeterministic_engine_fails_determinism(llama, sequences):
    bad = Nondeterministic(llama)
    singles = [bad.score(sequences[0])]
    result = check_determinism(bad, sequences[0], singles[0], None, Q8, OPTIONS)
    assert result.status == Status.FAIL and not result.stats["bitwise"]


def test_broken_chunked_prefill_fails(llama, sequences, llama_tables):
    (result,) = check_chunked_prefill(BrokenChunks(llama), sequences[:1], llama_tables[:1], Q8, OPTIONS)
    assert result.status == Status.FAIL and result.component == "prefill"
