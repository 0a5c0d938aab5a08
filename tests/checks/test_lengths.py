"""The prefill length sweep: a healthy engine passes every length; a fault that the prompt's
length switches on, or one that starts at a position, is found with its threshold and the
landmark it sits on (cache block, micro-batch, DSA top_k); and the paths stage leaves out
only the rows where two correct paths may differ."""

from __future__ import annotations

import numpy as np
import pytest

from ggufcheck.checks.compare import CompareOptions, run_compare
from ggufcheck.checks.lengths import landmarks, sweep_lengths, sweep_sequence
from ggufcheck.checks.logits import ALLOWANCES, LogitTolerance
from ggufcheck.checks.paths import _pair_verdict
from ggufcheck.engines.base import TokenLogprobs, log_softmax
from ggufcheck.engines.faults import EarlyRowsNoisy, LongPromptWrong
from ggufcheck.results import Status


def _sweep(engine, reference, seqs, top_k=None):
    stages = run_compare(engine, seqs, reference=reference,
                         options=CompareOptions(run_paths=False, run_sanity=False, sweep_to=300,
                                                indexer_top_k=top_k))
    logits = next(s for s in stages if s.stage == "logits")
    return next(r for r in logits.results if r.check == "logits.prefill_lengths")


@pytest.fixture(scope="module")
def engines(tiny_gguf):
    from ggufcheck.engines.reference import ReferenceEngine

    opened = {}

    def get(arch):
        if arch not in opened:
            path = tiny_gguf(arch, seed=1).path
            opened[arch] = (ReferenceEngine(path, dtype="fp32"), ReferenceEngine(path, dtype="fp64"))
        return opened[arch]

    yield get
    for pair in opened.values():
        for e in pair:
            e.close()


def _prompts(seed, lengths=(90, 70, 60, 50)):
    rng = np.random.default_rng(seed)
    return [[1] + [int(t) for t in rng.integers(2, 250, n - 1)] for n in lengths]


def test_landmarks_and_lengths():
    marks = landmarks(indexer_top_k=8, micro_batch=512, longest=600)
    assert [(m.length, m.component) for m in marks][:3] == [(8, "indexer"), (16, "kv-cache"), (32, "kv-cache")]
    assert next(m for m in marks if m.length == 512).component == "prefill"  # the micro-batch wins over the page
    assert sweep_lengths(marks)[:4] == [8, 9, 16, 17]
    seq = sweep_sequence([[1, 5, 6], [1, 7, 8, 9]], 9)
    assert seq == [1, 7, 8, 9, 5, 6, 7, 8, 9]  # the longest first, the others without their BOS


def test_healthy_engine_passes_every_length(engines):
    engine, reference = engines("llama")
    result = _sweep(engine, reference, _prompts(1))
    assert result.status == Status.PASS, result.message
    # one length past each landmark: b + 1, or the 90-token prompt the engine already scored (in (64, 128]);
    # b only where that fails
    assert [r["length"] for r in result.stats["lengths"]] == [17, 33, 90, 129, 257]


def test_length_triggered_fault_names_its_threshold(engines):
    engine, reference = engines("llama")
    result = _sweep(LongPromptWrong(engine, longer_than=64), reference, _prompts(1))
    assert result.status == Status.FAIL
    assert result.stats["threshold"] == 65
    assert "up to 64 tokens agree" in result.message and "the first ones included" in result.message
    assert "(64 tokens)" in result.message and result.component == "kv-cache"


def test_position_triggered_fault_names_its_onset(engines):
    engine, reference = engines("llama")
    result = _sweep(LongPromptWrong(engine, longer_than=100, from_row=128), reference, _prompts(1))
    assert result.status == Status.FAIL
    assert "from position 128 on" in result.message and "(128 tokens)" in result.message, result.message


def test_early_positions_wrong_at_every_length_are_not_called_a_length_threshold(engines):
    """SmolLM2 on llama.cpp's CUDA backend: the first positions of every prompt were far from
    the reference, so the shortest sweep lengths (mostly those rows) failed and the longer ones
    passed. That is an error at the first positions, said as such, not a prefill length switch."""
    engine, reference = engines("llama")
    result = _sweep(EarlyRowsNoisy(engine, rows=12, scale=0.03), reference, _prompts(1))
    assert result.status == Status.FAIL and result.component == "output", result.message
    early = result.stats["early_positions"]
    assert early["mean_kl_first"] > early["limit"] > early["mean_kl_rest"], early
    assert "not because of their length" in result.message and result.stats["threshold"] is None
    # a length-triggered fault whose long prompts fail is still a threshold (the test above)
    assert _sweep(LongPromptWrong(engine, longer_than=64), reference, _prompts(1)).stats["threshold"] == 65


def test_threshold_at_the_indexer_top_k_names_the_indexer(engines):
    engine, reference = engines("glm-dsa")
    top_k = reference.model.cfg.indexer_top_k
    result = _sweep(LongPromptWrong(engine, longer_than=top_k), reference, _prompts(2), top_k=top_k)
    assert result.status == Status.FAIL and result.component == "indexer", result.message
    assert f"top_k ({top_k})" in result.message


def _table(logits, tokens, ambiguous=None):
    return TokenLogprobs(tokens, logits.shape[1], log_softmax(logits).astype(np.float32), ambiguous=ambiguous)


def test_paths_leave_out_rows_after_a_tie_only_when_the_paths_differ():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, 40)
    logits = rng.normal(0, 3, (40, 50))
    tied = np.zeros(40, dtype=bool)
    tied[20:] = True  # the reference marks rows 20.. ambiguous (an exact indexer tie at 20)
    later = logits.copy()
    later[25:] += rng.normal(0, 3, (15, 50))  # the second path differs from row 25 on
    early = logits.copy()
    early[5:] += rng.normal(0, 3, (35, 50))  # ... or from row 5 on
    tol, base = LogitTolerance(), ALLOWANCES["fp32"]

    same = _pair_verdict("p", "decode", "w", [(_table(logits, tokens, tied), _table(logits, tokens))], base, tol)
    assert same.status == Status.PASS and "ambiguous_positions" not in same.stats  # every row judged
    after = _pair_verdict("p", "decode", "w", [(_table(logits, tokens, tied), _table(later, tokens))], base, tol)
    assert after.status == Status.PASS and "differ only where such a tie lets them" in after.message
    before = _pair_verdict("p", "decode", "w", [(_table(logits, tokens, tied), _table(early, tokens))], base, tol)
    assert before.status == Status.FAIL
    assert _pair_verdict("p", "decode", "w", [(_table(logits, tokens), _table(later, tokens))], base, tol).failed
