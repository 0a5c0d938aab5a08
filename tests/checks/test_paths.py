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
    assert "paths.cold_prefill" not in by  # its score prefills in one batch already
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


# ------------------------------------------------- long decode: faults past a few tokens
def _diagnose_kv_fault(after):
    """Diagnose (defaults) a tiny llama whose KV cache goes wrong from decode step ``after``."""
    from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
    from ggufcheck.testing.faults import make_faulty_engine
    from ggufcheck.synthetic.tiny import build_tiny_gguf
    import tempfile
    from pathlib import Path

    path = build_tiny_gguf("llama", Path(tempfile.mkdtemp()) / "kv.gguf", qtypes="F32", seed=1).path
    engine = make_faulty_engine("kv-cache-corrupt-decode", path, after=after) if after else None
    if engine is None:
        from ggufcheck.engines.reference import ReferenceEngine

        engine = ReferenceEngine(path, dtype="fp32")
    return diagnose(DiagnoseOptions(model=path, sanity=False, kernels=False, health=False), engine=engine)


def test_a_kv_cache_that_breaks_at_decode_step_17_is_found_by_default():
    """Decoding 6 tokens (the old default) called this engine healthy; the first prompt is now
    decoded to position 272, and the report says where the divergence starts."""
    d = _diagnose_kv_fault(17)
    assert (d.verdict.component, d.verdict.stage) == ("decode", "logits")
    first = d.verdict.evidence["stats"]["first_divergence"]
    prompt_len = first["first_compared"] + 1  # the first decode row is the prompt's last position
    assert first["position"] == prompt_len + 17 - 1 and first["boundary"] is None
    assert "not at a usual block boundary" in d.verdict.message
    assert first["reference_margin"] >= 0 and "the reference's top-1 leads its top-2 by" in d.verdict.message
    paths = next(s for s in d.stages if s.stage == "paths")
    decode = next(r for r in paths.results if r.check == "paths.prefill_vs_decode")
    assert decode.failed and decode.stats["first_divergence"]["position"] == first["position"]


def test_a_divergence_starting_at_position_64_is_named_as_a_block_boundary():
    d = _diagnose_kv_fault(17)
    prompt_len = d.verdict.evidence["stats"]["first_divergence"]["first_compared"] + 1
    d = _diagnose_kv_fault(64 - prompt_len + 1)  # the entry at position 64 is the first wrong one
    assert d.verdict.component == "decode"
    assert d.verdict.evidence["stats"]["first_divergence"]["position"] == 64
    assert "cache block / page boundary (64 tokens)" in d.verdict.message


def test_the_long_decode_keeps_a_healthy_engine_healthy():
    d = _diagnose_kv_fault(None)
    assert d.verdict.healthy
    paths = next(s for s in d.stages if s.stage == "paths")
    decode = next(r for r in paths.results if r.check == "paths.prefill_vs_decode")
    assert decode.status is Status.PASS and decode.stats["kl"]["n"] >= 272 - 96


def test_an_isolated_spike_is_not_an_onset_and_the_indexer_top_k_is_a_landmark():
    from ggufcheck.checks.logits import PositionMetrics
    from ggufcheck.checks.paths import first_divergence

    kl = np.zeros(40)
    kl[5] = 1.0  # a near-tie flip
    kl[30:] = 1.0
    m = PositionMetrics(kl=kl, agree=kl == 0, delta_p=kl, nmse=kl, sequence=np.zeros(40, int),
                        position=np.arange(10, 50), ref_argmax=np.zeros(40), eng_argmax=np.zeros(40))
    first = first_divergence(m, 0.1, {"the DSA indexer's top_k": 40})
    assert first["position"] == 40 and first["boundary"] == "the DSA indexer's top_k 40"
    assert first_divergence(m, 2.0) is None


def test_an_onset_at_the_first_compared_row_cites_no_boundary():
    """Wrong from the first compared row on (decode compared from position 16, prefill wrong
    too): 16 is where the comparison starts, not evidence of a cache block at 16."""
    from ggufcheck.checks.logits import PositionMetrics
    from ggufcheck.checks.paths import first_divergence

    kl = np.ones(40)
    m = PositionMetrics(kl=kl, agree=kl == 0, delta_p=kl, nmse=kl, sequence=np.zeros(40, int),
                        position=np.arange(16, 56), ref_argmax=np.zeros(40), eng_argmax=np.zeros(40))
    first = first_divergence(m, 0.1, {"the DSA indexer's top_k": 16})
    assert first["position"] == 16 and first["boundary"] is None
    assert "first compared position 16" in first["text"] and "boundary" not in first["text"]
    kl[:8] = 0.0  # agreeing rows up to 23, then wrong from 24: no landmark at 24
    first = first_divergence(m, 0.1)
    assert first["position"] == 24 and "not at a usual block boundary" in first["text"]
    gap = PositionMetrics(kl=kl[[0, 1, 2, 16, 17]], agree=kl[[0, 1, 2, 16, 17]] == 0, delta_p=kl[:5], nmse=kl[:5],
                          sequence=np.zeros(5, int), position=np.array([10, 11, 12, 32, 33]),
                          ref_argmax=np.zeros(5), eng_argmax=np.zeros(5))
    assert first_divergence(gap, 0.1)["boundary"] is None  # rows 13..31 not compared: 32 is not shown


def test_a_prefill_fault_past_the_prompts_is_found_on_the_long_sequence_and_its_boundary_named():
    """Prefill rows wrong from position 128 on (a KV page boundary in the prompt path): the
    built-in prompts (<= 96 tokens) never reach it; the long decode's sequence, teacher-forced,
    does, and the onset is named as the 128-token boundary."""
    import tempfile
    from pathlib import Path

    from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
    from ggufcheck.engines.reference import ReferenceEngine
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    class PrefillWrongFrom(WrappedEngine):
        def corrupt(self, table):
            lp = table.logprobs.copy()
            lp[128:] = log_softmax(lp[128:] + np.random.default_rng(0).normal(0, 1.0, lp[128:].shape))
            return TokenLogprobs(table.tokens, table.vocab_size, lp, present=table.present)

    path = build_tiny_gguf("llama", Path(tempfile.mkdtemp()) / "p.gguf", qtypes="F32", seed=1).path
    d = diagnose(DiagnoseOptions(model=path, sanity=False, kernels=False, health=False),
                 engine=PrefillWrongFrom(ReferenceEngine(path, dtype="fp32")))
    logits = next(s for s in d.stages if s.stage == "logits")
    kl = next(r for r in logits.results if r.check == "logits.kl_mean")
    assert kl.failed and kl.stats["first_divergence"]["position"] == 128, kl.message
    assert "cache block / page boundary (128 tokens)" in kl.message


def test_one_position_just_past_the_max_limit_passes_a_gross_one_or_an_onset_fails():
    """The rule behind a false alarm measured on the H200 (Q2_K, chunks of 5 vs one prefill:
    max KL 0.154 against 0.151 at one position, mean 0.0007): an isolated position slightly over
    a percentile-derived limit passes, while a grossly wrong position or a divergence that
    starts and stays fails."""
    from ggufcheck.checks.logits import Baseline
    from ggufcheck.checks.paths import GROSS_FACTOR, _judge_pairs
    from ggufcheck.checks.logits import LogitTolerance

    rng = np.random.default_rng(0)
    base = log_softmax(rng.normal(0, 3, (200, 64))).astype(np.float64)
    tol = LogitTolerance()
    baseline = Baseline(source="test", kl_mean=0.005, kl_p99=0.05, argmax_agreement=0.97, nmse_mean=0.01,
                        delta_p_rms=0.03)
    max_limit = tol.multiple * baseline.kl_p99 + tol.kl_p99_floor

    def pair(bumps: dict[int, float]):
        other = base.copy()
        for row, target in bumps.items():  # flatten a row (argmax kept) until its KL reaches ``target``
            for t in np.linspace(0.001, 0.999, 2000):
                flat = log_softmax(base[row] * (1 - t))
                if float(np.sum(np.exp(base[row]) * (base[row] - flat))) >= target:
                    break
            other[row] = flat
        tokens = [i % 64 for i in range(200)]
        a = TokenLogprobs(tokens, 64, base.astype(np.float32))
        b = TokenLogprobs(tokens, 64, other.astype(np.float32))
        return _judge_pairs("paths.x", "prefill", "x", [(a, b)], baseline, tol, None)

    slight = pair({120: max_limit * 1.05})
    assert slight.status is Status.PASS and "starts no divergence" in slight.message
    gross = pair({120: max_limit * GROSS_FACTOR * 1.5})
    assert gross.status is Status.FAIL
    onset = pair({r: max_limit * 1.05 for r in range(186, 200)})  # the mean stays under its limit
    assert onset.status is Status.FAIL and "first_divergence" in onset.stats


def test_two_paths_that_each_agree_with_the_reference_pass_and_a_wrong_one_is_named():
    """Two paths with independent roundings, each at ~60% of the mean limit from the reference,
    are ~1.2x the limit from each other: judged against the reference, the pair passes and
    says why. Make one path twice as noisy and that one is named as over the reference."""
    from ggufcheck.checks.logits import LogitTolerance, collect
    from ggufcheck.checks.paths import _each_within_reference, _judge_pairs

    rng = np.random.default_rng(0)
    tol, vocab, rows = LogitTolerance(), 64, 200
    ref = log_softmax(rng.normal(0, 2.0, (rows, vocab)))
    tokens = [i % vocab for i in range(rows)]
    table = lambda lp: TokenLogprobs(tokens, vocab, lp.astype(np.float32))  # noqa: E731
    limit = tol.multiple * Q8.kl_mean + tol.kl_floor

    def noisy(seed: int, target: float) -> np.ndarray:  # logits noise scaled to a mean KL target
        noise = np.random.default_rng(seed).normal(0, 1.0, ref.shape)
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            kl = collect([(table(ref), table(log_softmax(ref + mid * noise)))]).kl.mean()
            lo, hi = (mid, hi) if kl < target else (lo, mid)
        return log_softmax(ref + lo * noise)

    a, b = noisy(1, 0.6 * limit), noisy(2, 0.6 * limit)
    score = lambda toks: table(ref)  # noqa: E731
    pair = [(table(a), table(b))]
    apart = _judge_pairs("paths.x", "prefill", "one prefill vs chunks", pair, Q8, tol, None)
    assert apart.failed and apart.stats["kl"]["mean"] > limit  # their errors add
    both = _each_within_reference(apart, pair, score, Q8, tol, ("one prefill", "the chunks"))
    assert both.status is Status.PASS and "each agrees with the reference" in both.message
    assert both.stats["against_reference"]["the chunks"]["mean_kl"] < limit
    assert _each_within_reference(apart, pair, None, Q8, tol, ("a", "b")) is apart  # no reference: unchanged

    worse = [(table(a), table(noisy(2, 2.0 * limit)))]
    wrong = _each_within_reference(_judge_pairs("paths.x", "prefill", "x", worse, Q8, tol, None), worse, score,
                                   Q8, tol, ("one prefill", "the chunks"))
    assert wrong.failed and "the chunks over it" in wrong.message
    assert wrong.stats["against_reference"]["one prefill"]["ok"] and not wrong.stats["against_reference"]["the chunks"]["ok"]


def test_nan_rows_fail_first_and_both_nan_paths_are_not_told_apart():
    """NaN rows drop out of every mean and percentile: a pair with a few NaN rows on one path
    must fail on them (not pass on the finite rest), and one with NaN on both paths is not
    evidence against either path (sanity and the logits stage name it)."""
    from ggufcheck.checks.logits import Baseline, LogitTolerance, collect, judge
    from ggufcheck.checks.paths import _judge_pairs

    rng = np.random.default_rng(0)
    base = log_softmax(rng.normal(0, 3, (50, 64))).astype(np.float32)
    tokens = [i % 64 for i in range(50)]
    nan = base.copy()
    nan[30:33] = np.nan
    baseline = Baseline(source="test", kl_mean=0.005, kl_p99=0.05, argmax_agreement=0.97, nmse_mean=0.01,
                        delta_p_rms=0.03)
    good, bad = TokenLogprobs(tokens, 64, base), TokenLogprobs(tokens, 64, nan)
    one = _judge_pairs("paths.x", "decode", "x", [(good, bad)], baseline, LogitTolerance(), None)
    assert one.status is Status.FAIL and one.stats["nonfinite_positions"] == 3
    assert one.stats["first"]["position"] == 30
    both = _judge_pairs("paths.x", "decode", "x", [(bad, bad)], baseline, LogitTolerance(), None)
    assert both.status is Status.SKIP and "both paths" in both.message
    all_nan = TokenLogprobs(tokens, 64, np.full_like(base, np.nan))
    results = judge(collect([(good, all_nan)]), baseline)  # no finite row at all: no KeyError
    assert [r.status for r in results] == [Status.FAIL] and "50 of 50" in results[0].message


def test_a_nan_engine_is_diagnosed_without_an_internal_error():
    """One layer's weights NaN (a corrupted quant block, weights hidden): every stage runs to
    the end; the layers stage names the first layer whose output holds NaN, sanity the rows."""
    from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
    from ggufcheck.testing.faults import make_faulty_engine
    from ggufcheck.synthetic.tiny import build_tiny_gguf
    import tempfile
    from pathlib import Path

    path = build_tiny_gguf("llama", Path(tempfile.mkdtemp()) / "nan.gguf", qtypes="Q8_0", seed=1).path
    engine = make_faulty_engine("block-scale-corrupted", path, expose_weights=False, mode="nan", layer=1)
    d = diagnose(DiagnoseOptions(model=path, kernels=False), engine=engine)
    engine.close()
    results = [r for s in d.stages for r in s.results]
    assert not [r.message for r in results if r.status is Status.ERROR]
    assert d.verdict.layer == 1 and d.verdict.component == "attention"
    residual = next(r for r in results if r.check == "layers.residual" and r.failed)
    assert "holds NaN or inf, the first layer that does" in residual.message
    finite = next(r for r in results if r.check == "sanity.finite")
    assert finite.failed and finite.stats["first"]["position"] == 0 and finite.stats["kinds"] == ["NaN"]


def test_decode_faults_are_named_at_their_layer_and_block():
    """The decode path traced layer by layer (Engine.decode_layer_outputs): a one-token kernel
    wrong in the last layer's FFN is named there; a KV cache written wrong by the decode steps
    is named at layer 0's attention, with the decode step."""
    from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
    from ggufcheck.testing.faults import fault_layer, make_faulty_engine
    from ggufcheck.synthetic.tiny import build_tiny_gguf
    import tempfile
    from pathlib import Path

    path = build_tiny_gguf("llama", Path(tempfile.mkdtemp()) / "dec.gguf", qtypes="F32", seed=1).path
    for name, layer, block in (("decode-matvec-wrong", fault_layer("decode-matvec-wrong", path), "ffn"),
                               ("kv-cache-corrupt-decode", 0, "attention")):
        engine = make_faulty_engine(name, path)
        d = diagnose(DiagnoseOptions(model=path, sanity=False, kernels=False, max_prompts=2), engine=engine)
        engine.close()
        v = d.verdict
        assert (v.component, v.layer) == ("decode", layer), v.message
        assert v.evidence["stats"]["localized"]["block"] == block and "decode step" in v.message, v.message
        # and the block's matrices with their stored type (issue 36 item 2)
        prefix = "ffn_" if block == "ffn" else "attn_"
        matrices = v.evidence["stats"]["localized"]["matrices"]
        assert set(matrices) == {"F32"} and all(m.startswith(prefix) for m in matrices["F32"]), matrices
        assert "matrix-vector kernels" in v.message and f"{prefix}" in v.message, v.message


# ------------------------------------------- a stepwise engine's batched prefill, asked cold
def test_a_stepwise_engine_has_its_cold_prefill_judged_and_the_wrong_path_named():
    """An engine whose score steps one token at a time through its prompt cache (llama-server)
    has rows requested cold (checks.paths.check_cold_prefill). Which path is over the reference
    names the component: the cold prefill -> prefill, the steps -> decode; both fine -> PASS.
    (The real server with a real prefill-only kernel defect: tests/engines/test_llama_server.py.)"""
    from ggufcheck.checks.logits import LogitTolerance
    from ggufcheck.checks.paths import check_cold_prefill
    from ggufcheck.engines.base import Capabilities, Engine

    rng = np.random.default_rng(3)
    vocab, n = 48, 24
    prompts = [list(rng.integers(0, vocab, n)) for _ in range(3)]
    ref = {tuple(p): log_softmax(rng.normal(0, 2.0, (n, vocab))) for p in prompts}
    table = lambda toks, lp: TokenLogprobs(toks, vocab, lp.astype(np.float32))  # noqa: E731

    class Stepwise(Engine):
        name, vocab_size = "stepwise", vocab
        capabilities = Capabilities(score=True, stepwise_score=True)

        def __init__(self, steps_noise=0.0, cold_noise=0.0):
            self.noise = {"steps": steps_noise, "cold": cold_noise}
            self.asked = []

        def _rows(self, tokens, which):
            lp = ref[tuple(tokens)]
            noise = np.random.default_rng(len(self.asked)).normal(0, self.noise[which], lp.shape)
            return log_softmax(lp + noise)

        def score(self, tokens, *, top_k=20):
            return table(tokens, self._rows(list(tokens), "steps"))

        def score_cold(self, tokens, rows, *, top_k=20):
            self.asked.append(list(rows))
            present = np.zeros(len(tokens), dtype=bool)
            present[list(rows)] = True
            return TokenLogprobs(list(tokens), vocab, self._rows(list(tokens), "cold").astype(np.float32),
                                 present=present)

    def judge(engine):
        singles = [engine.score(p) for p in prompts]
        return check_cold_prefill(engine, prompts, singles, Q8, PathOptions(tolerance=LogitTolerance()),
                                  reference_score=lambda toks: table(list(toks), ref[tuple(int(t) for t in toks)]))

    healthy = Stepwise(0.02, 0.02)
    ok = judge(healthy)
    assert ok.status is Status.PASS and ok.stats["kl"]["n"] == 12, ok.message  # each quarter's last row
    assert healthy.asked == [[5, 11, 17, 23]] * 3
    cold = judge(Stepwise(0.02, 1.5))
    assert cold.failed and cold.component == "prefill" and "the cold prefill over it" in cold.message
    steps = judge(Stepwise(1.5, 0.02))
    assert steps.failed and steps.component == "decode", steps.message
    assert "the one-token steps through the prompt cache over it" in steps.message
