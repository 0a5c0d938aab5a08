"""Tiny converted models (random weights, llama.cpp's own converter) through reference, hf and llama-cpp.

Three implementations of each architecture on the same GGUF: ggufcheck's fp64 reference,
transformers' modeling code fed by ggufcheck's rebuild (``hf``), and llama.cpp. Healthy
engines pass the logits and path checks; a shuffled-logits wrapper fails. F32 files, so
llama.cpp's activations stay fp32 (its "fp32" class) and the limits are tight.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggufcheck.checks.compare import combined_baseline
from ggufcheck.checks.logits import baseline_from, collect, judge
from ggufcheck.checks.paths import PathOptions, check_past_indexer_top_k, check_prefill_vs_decode
from ggufcheck.engines.faults import ShuffledLogits
from ggufcheck.engines.spec import open_engine
from ggufcheck.results import Status

SEQS = ([1, 504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314, 28, 253],  # 15 > glm-dsa top_k 8
        [2, 100, 7, 4000, 12, 9000, 31, 31, 5])


@pytest.fixture(scope="module", params=["deepseek2", "glm-dsa"])
def tiny(request, tiny_converted):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("transformers")
    model = tiny_converted(request.param, "f32")
    engines = {
        "ref64": open_engine("reference", model.gguf_path),
        "ref32": open_engine("reference:fp32", model.gguf_path),
        "hf": open_engine("hf:fp32", model.gguf_path),  # transformers' MoE kernels have no fp64
        "llama": open_engine("llama-cpp:n_ctx=64,n_threads=2", model.gguf_path),
    }
    tables = {name: [e.score(s) for s in SEQS] for name, e in engines.items()}
    yield request.param, engines, tables
    for e in engines.values():
        e.close()


def _baseline(tables, engine):
    measured = baseline_from(collect(list(zip(tables["ref64"], tables["ref32"]))), "measured reference fp32 vs fp64")
    return combined_baseline(measured, engine.capabilities.activation_dtype)


@pytest.mark.parametrize("name", ["hf", "llama"])
def test_healthy_engines_pass_the_logits_stage(tiny, name):
    arch, engines, tables = tiny
    metrics = collect(list(zip(tables["ref64"], tables[name])))
    results = judge(metrics, _baseline(tables, engines[name]))
    assert all(r.status == Status.PASS for r in results), [r.message for r in results]
    assert metrics.agree.all()
    assert metrics.kl.mean() < 1e-3, (arch, name, metrics.kl.mean())


def test_shuffled_logits_fail(tiny):
    _, engines, tables = tiny
    bad = ShuffledLogits(engines["llama"])
    results = judge(collect([(r, bad.score(s)) for r, s in zip(tables["ref64"], SEQS)]),
                    _baseline(tables, engines["llama"]))
    assert {r.check for r in results if r.status == Status.FAIL} >= {"logits.kl_mean", "logits.argmax"}


@pytest.mark.parametrize("name", ["ref64", "hf", "llama"])
def test_prefill_equals_decode(tiny, name):
    _, engines, tables = tiny
    engine = engines[name]
    result, gens = check_prefill_vs_decode(engine, [SEQS[1]], _baseline(tables, engine),
                                           PathOptions(max_new_tokens=4, decode_prompts=1, long_decode_to=0))
    assert result.status == Status.PASS, result.message
    assert len(gens[0].generated) == 4


def test_glm_dsa_decode_past_the_indexer_top_k(tiny):
    arch, engines, tables = tiny
    if arch != "glm-dsa":
        pytest.skip("only glm-dsa has a sparse-attention indexer")
    top_k = 8  # index_topk of the tiny glm-dsa config (ggufcheck.testing.convert)
    assert len(SEQS[0]) > top_k
    result = check_past_indexer_top_k(engines["llama"], SEQS[0], _baseline(tables, engines["llama"]),
                                      PathOptions(max_new_tokens=3, indexer_top_k=top_k))
    assert result.status == Status.PASS and result.component == "indexer", result.message


def test_reference_layer_outputs_match_hf_hooks(tiny):
    """Per-layer residual streams of two implementations agree (fp64 reference vs fp32 transformers).

    8 tokens: within glm-dsa's indexer top_k, where no top-k tie can make the two legitimately differ."""
    _, engines, _ = tiny
    seq = SEQS[1][:8]
    ref = engines["ref64"].layer_outputs(seq, kinds=("residual",))
    hf = engines["hf"].layer_outputs(seq, kinds=("residual",))
    assert len(ref.tensors) >= 3
    for key, value in ref.tensors.items():
        other = hf.tensors[key]
        scale = np.abs(value).max()
        # measured: deepseek2 < 1e-4 relative; glm-dsa ~2.5e-4 from layer 0's attention output on
        # (cause not isolated: transformers' fp32 glm_moe_dsa path; the final KL is still ~1e-9)
        assert np.abs(value - other).max() < 1e-3 * scale, key


def test_hf_batch_invariance(tiny):
    """transformers scores a right-padded batch; each row equals the sequence scored alone."""
    from ggufcheck.checks.paths import check_batch_invariance

    _, engines, tables = tiny
    result = check_batch_invariance(engines["hf"], list(SEQS), tables["hf"], _baseline(tables, engines["hf"]),
                                    PathOptions())
    assert result.status == Status.PASS, result.message
