"""ggufcheck.testing.faults: the fault engines are what they claim, and nothing more.

The diagnosis tests (tests/checks/test_layers.py) show each fault is NAMED; these show each
fault engine differs from the healthy one exactly where it should (and only there), so a
passing diagnosis test is not an artefact of a fault that corrupts everything.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ggufcheck.diagnose.vocabulary import ORDER
from ggufcheck.errors import UsageError
from ggufcheck.testing import faults
from ggufcheck.testing.faults import FAULTS, effective_k_b_v_b, fault_layer, make_faulty_engine

TOKENS = [5, 17, 300, 4242, 77, 9000, 12, 31, 640, 2048, 8, 1000, 3]  # 13 > glm-dsa's top_k 8


@pytest.fixture(scope="module")
def llama(tiny_converted):
    return tiny_converted("llama").gguf_path


@pytest.fixture(scope="module")
def deepseek2(tiny_converted):
    return tiny_converted("deepseek2").gguf_path


def test_registry_is_consistent():
    assert len(FAULTS) == 23
    for name, fault in FAULTS.items():
        assert fault.name == name
        assert fault.component in ORDER, name
        assert fault.layers_component is None or fault.layers_component in ORDER, name
        assert fault.archs <= faults.ALL_ARCHS and fault.archs, name
        assert fault.stage in ("weights", "layers", "paths", "logits"), name


def test_unknown_and_inapplicable_faults_are_usage_errors(llama):
    with pytest.raises(UsageError, match="unknown fault"):
        make_faulty_engine("no-such-fault", llama)
    with pytest.raises(UsageError, match="does not apply"):
        make_faulty_engine("kv-b-all-k-then-v", llama)


def test_kv_b_layouts_against_the_sharding_checks():
    """The effective per-head k_b / v_b are exact at TP 1 and for the correct layout at any TP;
    the [all K; all V] layout is wrong at TP 2, and the sharding helper's own per-rank check
    fails on exactly the ranks whose heads changed."""
    from ggufcheck.checks.sharding import check_kv_b_ranks
    from ggufcheck.sharding.mla import VLLM_LAYOUT

    g = torch.Generator().manual_seed(0)
    k_b = torch.randn(4, 32, 16, generator=g, dtype=torch.float64)  # [H, L, P]
    v_b = torch.randn(4, 48, 32, generator=g, dtype=torch.float64)  # [H, V, L]
    for tp in (1, 2, 4):
        k, v = effective_k_b_v_b(k_b, v_b, tp, VLLM_LAYOUT)
        assert torch.equal(k, k_b) and torch.equal(v, v_b)
    k, v = effective_k_b_v_b(k_b, v_b, 1, faults.KV_B_ALL_K_THEN_V)
    assert torch.equal(k, k_b) and torch.equal(v, v_b)  # silent at TP 1, as the real bug
    k, v = effective_k_b_v_b(k_b, v_b, 2, faults.KV_B_ALL_K_THEN_V)
    assert not torch.equal(k, k_b) and not torch.equal(v, v_b)
    assert all(not r for r in check_kv_b_ranks(k_b, v_b, 2, layout=faults.KV_B_ALL_K_THEN_V))
    k, v = effective_k_b_v_b(k_b, v_b, 1, faults.KV_B_V_THEN_K)
    assert not torch.equal(k, k_b)  # wrong at every TP


def _logits(engine, tokens=TOKENS):
    return engine.score(tokens).logprobs


def test_per_layer_faults_change_only_their_layer(deepseek2):
    healthy = make_faulty_engine("kv-b-all-k-then-v", deepseek2, tp=1)  # exact at TP 1
    base = healthy.layer_outputs(TOKENS)
    for name in ("experts-permuted", "norm-eps-wrong", "block-scale-corrupted"):
        engine = make_faulty_engine(name, deepseek2, layer=2)
        trace = engine.layer_outputs(TOKENS)
        for i in range(3):
            same = np.array_equal(trace.tensors[("residual", i)], base.tensors[("residual", i)])
            assert same == (i < 2), (name, i)
        engine.close()
    healthy.close()


def test_kv_cache_fault_breaks_decode_only(llama):
    from ggufcheck.engines.reference import ReferenceEngine

    ref = ReferenceEngine(llama, dtype="fp32")
    bad = make_faulty_engine("kv-cache-corrupt-decode", llama, after=2)
    assert np.array_equal(_logits(ref), _logits(bad))  # prefill untouched
    g_ok, g_bad = ref.generate(TOKENS[:5], 5), bad.generate(TOKENS[:5], 5)
    rows = np.flatnonzero(g_ok.steps.present)
    for step, row in enumerate(rows):
        same = np.allclose(g_ok.steps.logprobs[row], g_bad.steps.logprobs[row], atol=1e-6)
        if step < 2:
            assert same, step  # decode steps before `after` are right
    assert not np.allclose(g_ok.steps.logprobs[rows[2]], g_bad.steps.logprobs[rows[2]], atol=1e-6)
    ref.close()
    bad.close()


def test_weight_exposes_the_faulty_parameters_per_rank(deepseek2):
    """kv_b under TP 2: each rank's kv_b_proj rows are the rank's effective rows (wrong), other
    parameters are their correct shards; at TP 1 everything equals the file."""
    from ggufcheck.arch.transforms import kv_b_from_split
    from ggufcheck.gguf.dequant import dequantize_tensor
    from ggufcheck.gguf.reader import open_gguf

    name = "model.layers.0.self_attn.kv_b_proj.weight"
    with open_gguf(deepseek2) as g:
        want = kv_b_from_split(dequantize_tensor(g, "blk.0.attn_k_b.weight"),
                               dequantize_tensor(g, "blk.0.attn_v_b.weight")).numpy()  # [H*(P+V), L]
        o_proj = dequantize_tensor(g, "blk.0.attn_output.weight").numpy()
    eng2 = make_faulty_engine("kv-b-all-k-then-v", deepseek2, tp=2)
    assert eng2.capabilities.tp_size == 2 and eng2.capabilities.weights
    half = want.shape[0] // 2
    for rank in range(2):
        got = eng2.weight(name, rank=rank)
        assert got.shape == (half, want.shape[1])
        assert not np.array_equal(got, want[rank * half:(rank + 1) * half])
    # attn_output is row-parallel: columns split
    cols = o_proj.shape[1] // 2
    assert np.array_equal(eng2.weight("model.layers.0.self_attn.o_proj.weight", rank=1), o_proj[:, cols:])
    eng1 = make_faulty_engine("kv-b-all-k-then-v", deepseek2, tp=1)
    assert np.array_equal(eng1.weight(name), want)
    hidden = make_faulty_engine("kv-b-all-k-then-v", deepseek2, tp=2, expose_weights=False)
    assert not hidden.capabilities.weights
    for e in (eng2, eng1, hidden):
        e.close()


def test_capabilities_match_the_reference_engine(deepseek2):
    from ggufcheck.engines.reference import ReferenceEngine

    ref = ReferenceEngine(deepseek2, dtype="fp32")
    eng = make_faulty_engine("router-bias-ignored", deepseek2)
    for cap in ("score", "full_vocab", "generate", "chunked_prefill", "layer_outputs", "activation_dtype"):
        assert getattr(eng.capabilities, cap) == getattr(ref.capabilities, cap), cap
    assert fault_layer("router-bias-ignored", deepseek2) == 1  # the first MoE layer
    assert fault_layer("experts-permuted", deepseek2) == 2  # default: the last layer
    flat = make_faulty_engine("flat-output", deepseek2)
    assert flat.capabilities.layer_outputs == ref.capabilities.layer_outputs
    assert np.array_equal(flat.layer_outputs(TOKENS).tensors[("residual", 2)],
                          ref.layer_outputs(TOKENS).tensors[("residual", 2)])
    lp = flat.score(TOKENS).logprobs
    assert float(np.exp(lp).max()) < 2.0 / lp.shape[1] * 10  # near uniform
    for e in (ref, eng, flat):
        e.close()
