"""Numeric TP invariance on real tiny models: sharded over N gloo ranks == the reference.

One process group per layer kind (its weights read, run, judged and released before the next
kind is read), then one for the collectives. TP 1, 2, 4 on the
llama.cpp-converted models (4 heads); TP 8 on our own 8-head Q8_0 models (the converted
ones cannot run attention 8 ways: that is a plan FAIL, tested in test_plan.py, and here the
attention kind is SKIPped with the reason while the other kinds run).
"""

from __future__ import annotations

import pytest
import torch

from ggufcheck.checks.sharding import ShardOptions, run_sharding_stage
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.results import Status
from ggufcheck.sharding import faults

ARCHS = ("llama", "phi3", "gemma3", "gpt-oss", "glm4moe", "deepseek2", "glm-dsa")
KINDS = {
    "phi3": {"attention", "dense_ffn", "embedding", "lm_head"},  # fused qkv / gate_up, each section split
    "gemma3": {"attention", "dense_ffn", "embedding", "lm_head"},
    "gpt-oss": {"attention", "moe", "embedding", "lm_head"},  # biased experts, clamped SwiGLU, sinks
    "llama": {"attention", "dense_ffn", "embedding", "lm_head"},
    "glm4moe": {"attention", "dense_ffn", "moe", "embedding", "lm_head"},
    "deepseek2": {"mla", "dense_ffn", "moe", "embedding", "lm_head"},
    "glm-dsa": {"mla", "dense_ffn", "moe", "indexer", "embedding", "lm_head"},
}


def _tp_results(report):
    return {r.check.removeprefix("sharding.tp."): r for r in report.results if r.check.startswith("sharding.tp.")}


def _run(path, tp, numeric_collectives=False, kinds=None, **overrides):
    with open_gguf(path) as m:
        return run_sharding_stage(m, ShardOptions(tp=tp, backend="gloo", timeout_s=120, kinds=kinds),
                                  collectives=numeric_collectives, **overrides)


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_models_tp_1_2_4(tiny_converted, arch):
    path = tiny_converted(arch).gguf_path
    for tp in (1, 2, 4):
        report = _run(path, tp)
        assert not report.failures, (tp, [r.message for r in report.failures])
        ran = _tp_results(report)
        assert KINDS[arch] <= set(ran), (tp, set(ran))
        for kind in KINDS[arch]:
            assert ran[kind].status is Status.PASS
            assert ran[kind].stats["tp"] == tp and ran[kind].stats["max_abs_diff"] <= ran[kind].stats["tolerance"]
        if arch == "glm-dsa":
            assert ran["indexer_topk"].status is Status.PASS


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in ("phi3", "gemma3", "gpt-oss")])
def test_tp8_on_8_head_models(tiny8, arch):
    report = _run(tiny8(arch), 8, numeric_collectives=arch == "llama")
    ran = _tp_results(report)
    for kind in KINDS[arch]:
        assert ran[kind].status is Status.PASS, (kind, ran[kind].message)
    pads = [r for r in report.results if r.check.startswith("sharding.vocab.padding_zero")]
    assert pads and all(r.status is Status.PASS and r.stats["padding_rows"] == 12 for r in pads)
    if arch == "llama":  # the collectives self-test at TP 8 (test_dist.py covers 1, 2, 4)
        coll = [r for r in report.results if r.check.startswith("sharding.collectives")]
        assert len(coll) == 2 and all(r.status is Status.PASS for r in coll)
    if arch in ("llama", "glm4moe"):  # 8 q heads over 2 kv heads: each kv head on 4 ranks
        kv = [r for r in report.results if r.check == "sharding.plan.kv_heads"][0]
        assert kv.status is Status.PASS and kv.stats["replicas"] == 4


def test_converted_model_at_tp8_skips_attention_with_the_reason(tiny_converted):
    report = _run(tiny_converted("llama").gguf_path, 8)
    ran = _tp_results(report)
    assert ran["attention"].status is Status.SKIP and "not divisible" in ran["attention"].message
    assert ran["dense_ffn"].status is Status.PASS and ran["lm_head"].status is Status.PASS
    assert [r for r in report.results if r.check == "sharding.plan.heads"][0].status is Status.FAIL


def test_kv_b_all_k_then_v_exact_at_tp1_wrong_above(tiny_converted, tiny8):
    """The classic silent failure: exact on one GPU, wrong on more (fault catalog #21)."""
    path = tiny_converted("deepseek2").gguf_path
    one = _tp_results(_run(path, 1, kinds=("mla",), kv_layout=faults.KV_B_ALL_K_THEN_V))
    assert one["mla"].status is Status.PASS
    for tp, p in ((2, path), (4, path), (8, tiny8("deepseek2"))):
        mla = _tp_results(_run(p, tp, kinds=("mla",), kv_layout=faults.KV_B_ALL_K_THEN_V))["mla"]
        assert mla.status is Status.FAIL, tp
        assert mla.stats["max_abs_diff"] > 1e3 * mla.stats["tolerance"]
        assert 0 in mla.worst["ranks_with_wrong_partials"]  # rank 0 holds only key rows


def test_every_rank_loading_shard0_fails_on_rank1(tiny_converted):
    """A loader that ignores its rank (fault catalog #1): silent at TP 1, wrong at TP 2."""
    path = tiny_converted("glm4moe").gguf_path
    assert not _run(path, 1, loader=faults.every_rank_gets_shard0).failures
    ran = _tp_results(_run(path, 2, loader=faults.every_rank_gets_shard0))
    for kind in KINDS["glm4moe"]:
        assert ran[kind].status is Status.FAIL, kind
        assert ran[kind].worst["ranks_with_wrong_partials"] == [1] and ran[kind].worst["rank"] == 1


@pytest.mark.parametrize("budget", [20_000])
def test_moe_too_big_to_load_runs_on_the_routed_experts_only(tiny_converted, budget):
    """A 256-expert layer does not fit in fp64: only the experts the router picks are read
    (fewer tokens when needed); the check must still pass, and still catch a bad loader."""
    path = tiny_converted("glm4moe").gguf_path
    good = _tp_results(_run(path, 2, kinds=("moe",), max_layer_elements=budget))["moe"]
    assert good.status is Status.PASS
    bad = _tp_results(_run(path, 2, kinds=("moe",), max_layer_elements=budget,
                           loader=faults.every_rank_gets_shard0))["moe"]
    assert bad.status is Status.FAIL and bad.worst["rank"] == 1
    with open_gguf(path) as m:
        from ggufcheck.reference.config import config_from_gguf
        from ggufcheck.sharding.invariance import InvarianceOptions, gguf_layer_weights, make_jobs
        from ggufcheck.sharding.parallel import ExpertSubset

        opts = InvarianceOptions(tp=2, kinds=("moe",), max_layer_elements=budget)
        (job,) = make_jobs(config_from_gguf(m.metadata, m.tensors), gguf_layer_weights(m, max_elements=budget), opts)
    experts = job.weights["ffn_down_exps.weight"]
    assert isinstance(experts, ExpertSubset) and len(experts.experts) < experts.shape[0]
    assert sum(t.numel() for t in job.weights.values()) <= budget


def test_vocab_tensors_too_big_to_load_run_on_their_first_columns(tiny8):
    """GLM-5's embedding and lm_head (154880 x 6144) do not fit the fp64 budget: the vocab
    split is checked on every row's first columns, read in row blocks; the columns are the
    file's own (ggufcheck's whole-tensor dequantization, cut), the report says what part ran,
    and a loader that gives every rank rank 0's rows still fails on rank 1."""
    from ggufcheck.gguf.dequant import dequantize_tensor
    from ggufcheck.reference.config import config_from_gguf
    from ggufcheck.sharding.invariance import InvarianceOptions, gguf_layer_weights, make_jobs

    path = tiny8("llama")
    kinds = ("embedding", "lm_head")
    with open_gguf(path) as m:
        rows, width = m.tensors["token_embd.weight"].shape
        budget = rows * width - 1  # the whole tensor is one weight over
        opts = InvarianceOptions(tp=8, kinds=kinds, max_layer_elements=budget, vocab_columns=24)
        jobs = make_jobs(config_from_gguf(m.metadata, m.tensors), gguf_layer_weights(m, max_elements=budget), opts)
        assert [j.kind for j in jobs] == list(kinds) and not opts.not_run
        for job in jobs:
            (name, got), = job.weights.items()
            assert tuple(got.shape) == (rows, 24) and "first 24 of" in job.scope
            assert torch.equal(got, dequantize_tensor(m, job.tensor, dtype=torch.float64)[:, :24])
        assert jobs[1].inputs["x"].shape[1] == 24
    good = _tp_results(_run(path, 8, kinds=kinds, max_layer_elements=budget, vocab_columns=24))
    for kind in kinds:
        assert good[kind].status is Status.PASS and "first 24 of" in good[kind].message
    bad = _tp_results(_run(path, 8, kinds=kinds, max_layer_elements=budget, vocab_columns=24,
                           loader=faults.every_rank_gets_shard0))
    for kind in kinds:
        assert bad[kind].status is Status.FAIL, kind
    assert bad["lm_head"].worst["rank"] != 0
    # a budget below even the columns: not run, with the reason
    tight = _run(path, 8, kinds=kinds, max_layer_elements=rows * 24 - 1, vocab_columns=24)
    skipped = _tp_results(tight)
    assert all(skipped[k].status is Status.SKIP and "exceed the CPU budget" in skipped[k].message for k in kinds)


def test_one_layer_kind_is_held_at_a_time(tiny8, monkeypatch):
    """The main process reads a kind's weights only after the previous kind's are released
    (before, every kind's fp64 weights were held at once while the ranks ran: 12 GiB for a
    1.3 GB file)."""
    import gc
    import weakref

    from ggufcheck.sharding import invariance

    alive: list[weakref.ref] = []
    held_at_read: list[int] = []
    original = invariance.gguf_layer_weights

    def tracking(model, *a, **k):
        inner = original(model, *a, **k)

        class Tracked:
            def __getattr__(self, name):
                return getattr(inner, name)

            def __call__(self, layer, prefixes):
                gc.collect()
                held_at_read.append(sum(r() is not None for r in alive))
                out = inner(layer, prefixes)
                alive.extend(weakref.ref(t) for t in out.values())
                return out

        return Tracked()

    monkeypatch.setattr(invariance, "gguf_layer_weights", tracking)
    ran = _tp_results(_run(tiny8("deepseek2"), 2))
    for kind in KINDS["deepseek2"]:
        assert ran[kind].status is Status.PASS, (kind, ran[kind].message)
    assert len(held_at_read) >= 5 and held_at_read == [0] * len(held_at_read), held_at_read
