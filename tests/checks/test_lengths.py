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


def test_transformers_bf16_on_a_tiny_dsa_model_is_healthy(tiny_gguf):
    """Regression (a false alarm, 2026-12): a 4-layer glm-dsa model through transformers' own
    glm_moe_dsa in bf16 was called ``prefill`` ("32, 33 disagree, 9, 17, 65... agree: no
    single length threshold"): near-ties left 8 of 513 rows to judge, and one row within
    the per-row limit (KL 0.06 < 0.091) lifted their mean over the mean's limit (0.0098 >
    0.0091). The same engine passes every other check, and the longer lengths, over the same
    rows, passed."""
    pytest.importorskip("transformers")
    from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose

    path = tiny_gguf("glm-dsa", qtypes="Q8_0", n_layer=4).path
    d = diagnose(DiagnoseOptions(model=path, engine="hf:bf16", sanity=False))
    sweep = next(r for s in d.stages for r in s.results if r.check == "logits.prefill_lengths")
    assert sweep.status is Status.PASS, sweep.message
    assert d.verdict.healthy, d.verdict.message


def test_one_row_may_lift_the_mean_of_a_few_but_not_a_run_of_rows(engines):
    """The judging rule itself, on a healthy fp32 engine's sweep with rows made worse: one row
    (within the per-row limit) over a short length passes; the same rows all a little worse
    (the mean over the limit without any single row responsible) fail."""
    from ggufcheck.checks.lengths import Landmark, check_prefill_lengths
    from ggufcheck.checks.logits import Baseline

    fp32, fp64 = engines("llama")
    seq = _prompts(7, (40,))[0]
    ref = fp64.score(seq)
    tol = LogitTolerance(multiple=3.0, kl_floor=1e-4, kl_p99_floor=1e-3)
    base = Baseline(source="test", kl_mean=1e-5, kl_p99=1e-2, argmax_agreement=1.0, nmse_mean=0.0, delta_p_rms=0.0)
    marks = [Landmark(16, "a test landmark", "kv-cache")]
    limit = tol.multiple * base.kl_mean + tol.kl_floor
    max_limit = tol.multiple * base.kl_p99 + tol.kl_p99_floor

    def with_kl(rows_kl):
        """The reference's table with each row's distribution moved to KL rows_kl[i] from it."""
        lp = ref.logprobs.copy()
        for i, target in enumerate(rows_kl):
            if target:  # mix toward uniform until KL(ref || mixed) reaches the target
                p = np.exp(lp[i])
                lo, hi = 0.0, 1.0
                for _ in range(60):
                    a = (lo + hi) / 2
                    q = (1 - a) * p + a / p.size
                    kl = float(np.sum(p * (np.log(p) - np.log(q))))
                    lo, hi = (a, hi) if kl < target else (lo, a)
                lp[i] = np.log((1 - a) * p + a / p.size)
        return TokenLogprobs(ref.tokens, ref.vocab_size, lp)

    class Fixed:
        def __init__(self, table):
            self.table = table

        def score(self, tokens, top_k=20):
            n = len(tokens)
            return TokenLogprobs(self.table.tokens[:n], self.table.vocab_size, self.table.logprobs[:n])

    one = [0.0] * 40
    one[5] = 0.6 * max_limit  # one row within the per-row limit, mean of 17 rows over the limit
    assert one[5] / 17 > limit
    r = check_prefill_lengths(Fixed(with_kl(one)), seq, ref, base, tol, marks)
    assert r.status is Status.PASS, r.message
    spread = [2 * limit] * 40  # every row a little off: no single row to blame
    r = check_prefill_lengths(Fixed(with_kl(spread)), seq, ref, base, tol, marks)
    assert r.status is Status.FAIL, r.message
