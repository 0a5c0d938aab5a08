"""The weights-stage audit: per-rank loaded parameters vs their expected GGUF slices.

The "engine" here is written out by hand from vLLM's loaders (torch.chunk along the output
or input dim, whole heads, vocab rows padded to 64 per rank), independently of
ggufcheck.sharding.rules.shard, then broken in the ways real loaders broke.
"""

from __future__ import annotations

import pytest
import torch

from ggufcheck.arch.rebuild import hf_state_dict
from ggufcheck.arch.spec import spec_for_model
from ggufcheck.arch.tables import table_for
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.results import Status
from ggufcheck.sharding import faults
from ggufcheck.checks.weights import check_loaded_weights

COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def _by_hand(name: str, w: torch.Tensor, rank: int, tp: int, n_kv: int) -> torch.Tensor:
    """What a vLLM rank holds for HF parameter ``name``."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        per = -(-w.shape[0] // 64) * 64 // tp
        rows = w[rank * per:(rank + 1) * per]
        return torch.cat((rows, w.new_zeros(per - rows.shape[0], *w.shape[1:])))
    leaf = name.split(".")[-2]
    if leaf in ("k_proj", "v_proj") and tp > n_kv:  # QKVParallelLinear: kv head r // (tp / Hkv)
        return w.chunk(n_kv, dim=0)[rank // (tp // n_kv)]
    if w.dim() == 2 and leaf in COLUMN:
        return w.chunk(tp, dim=0)[rank]
    if w.dim() == 2 and leaf in ROW:
        return w.chunk(tp, dim=1)[rank]
    if name.endswith("bias") and leaf in COLUMN:
        return w.chunk(tp)[rank]
    return w  # norms, router, kv_a, q_a: replicated


@pytest.fixture(scope="module", params=["llama", "deepseek2"])
def model(request, tiny_converted):
    m = open_gguf(tiny_converted(request.param).gguf_path)
    spec, _ = spec_for_model(m)
    table = table_for(spec)
    yield m, spec, table, hf_state_dict(m, spec, table)
    m.close()


def _loaded(spec, sd, tp, rank_of=lambda r: r):
    return {r: {n: _by_hand(n, w, rank_of(r), tp, spec.n_head_kv) for n, w in sd.items()} for r in range(tp)}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_correct_loads_pass(model, tp):
    m, spec, table, sd = model
    results = check_loaded_weights(m, spec, table, _loaded(spec, sd, tp), tp)
    assert not [r.message for r in results if r.failed]
    passes = [r for r in results if r.status is Status.PASS]
    assert len(passes) == tp and all(r.stats["parameters"] == len(sd) for r in passes)


def test_bf16_parameters_pass(model):
    m, spec, table, sd = model
    loaded = {r: {n: w.to(torch.bfloat16) for n, w in d.items()} for r, d in _loaded(spec, sd, 2).items()}
    assert not [r for r in check_loaded_weights(m, spec, table, loaded, 2) if r.failed]


def test_every_rank_with_shard0_is_named(model):
    m, spec, table, sd = model
    results = check_loaded_weights(m, spec, table, _loaded(spec, sd, 2, rank_of=lambda r: 0), 2)
    bad = [r for r in results if r.failed]
    assert bad and all(r.stats.get("rank") == 1 for r in bad)
    assert {r.component for r in bad} <= {"sharding", "mla-kv-b", "weights"}
    assert any("holds rank 0's slice" in r.message for r in bad)


def test_unsharded_tensor_and_wrong_values(model):
    m, spec, table, sd = model
    loaded = _loaded(spec, sd, 2)
    name = "model.layers.0.self_attn.o_proj.weight"
    loaded[1][name] = sd[name]  # sharding not applied
    loaded[0]["model.norm.weight"] = sd["model.norm.weight"] + 1e-2
    bad = {(r.tensor, r.stats["rank"]): r for r in check_loaded_weights(m, spec, table, loaded, 2) if r.failed}
    assert "whole unsharded" in bad[(name, 1)].message and bad[(name, 1)].component == "sharding"
    assert bad[("model.norm.weight", 0)].component == "weights"


def test_kv_b_rebuilt_all_k_then_v_is_caught(tiny_converted):
    with open_gguf(tiny_converted("deepseek2").gguf_path) as m:
        spec, _ = spec_for_model(m)
        table = table_for(spec)
        sd = hf_state_dict(m, spec, table)
        from ggufcheck.gguf.dequant import dequantize_tensor

        wrong = faults.rebuild_all_k_then_v(dequantize_tensor(m, "blk.0.attn_k_b.weight"),
                                            dequantize_tensor(m, "blk.0.attn_v_b.weight"))
        loaded = _loaded(spec, sd, 2)
        for r in range(2):
            loaded[r]["model.layers.0.self_attn.kv_b_proj.weight"] = wrong.chunk(2)[r]
        bad = [r for r in check_loaded_weights(m, spec, table, loaded, 2) if r.failed]
    assert {r.stats["rank"] for r in bad} == {0, 1}
    assert all(r.component == "mla-kv-b" and r.tensor.endswith("kv_b_proj.weight") for r in bad)


def test_through_the_engine_interface(tiny_converted):
    """The transformers engine (rank 0 only) exposes its parameters: all equal the GGUF's."""
    pytest.importorskip("transformers")
    from ggufcheck.engines.hf import HFEngine
    from ggufcheck.checks.weights import check_engine_weights

    path = tiny_converted("llama").gguf_path
    engine = HFEngine.from_gguf(path)
    with open_gguf(path) as m:
        spec, _ = spec_for_model(m)
        results = check_engine_weights(m, spec, table_for(spec), engine)  # in the engine's declared layout
    assert not [r.message for r in results if r.failed]
    assert [r for r in results if r.status is Status.PASS][0].stats["parameters"] > 10


def test_quantized_bytes_per_rank(tiny_gguf):
    """Engines that keep GGUF bytes: each rank's uint8 slice of the file, block-aligned or reported."""
    import numpy as np

    g = tiny_gguf("llama", qtypes={"default": "Q8_0"})  # D 64, FF 128: Q8_0 blocks of 32
    with open_gguf(g.path) as m:
        spec, _ = spec_for_model(m)
        table = table_for(spec)

        def raw(name):
            return torch.from_numpy(np.array(m.raw(name)))

        q, o, down = (raw(f"blk.0.{n}.weight") for n in ("attn_q", "attn_output", "ffn_down"))
        per_o, per_d = o.shape[-1] // 2, down.shape[-1] // 2  # bytes per rank: 1 and 2 Q8_0 blocks per row
        # q_proj in checkpoint (NEOX) row order: HF row r of head h is stored row (h, r % 8, r // 8)
        hf_rows = torch.from_numpy(np.arange(64).reshape(4, 8, 2).swapaxes(1, 2).reshape(-1).copy())
        loaded = {r: {"model.layers.0.self_attn.q_proj.weight": q[hf_rows].chunk(2)[r],
                      "model.layers.0.self_attn.o_proj.weight": o[:, r * per_o:(r + 1) * per_o],
                      "model.layers.0.mlp.down_proj.weight": down[:, r * per_d:(r + 1) * per_d]}
                  for r in range(2)}
        good = check_loaded_weights(m, spec, table, loaded, 2)
        loaded[1]["model.layers.0.mlp.down_proj.weight"] = loaded[0]["model.layers.0.mlp.down_proj.weight"]
        shard0 = check_loaded_weights(m, spec, table, loaded, 2)
        at8 = check_loaded_weights(m, spec, table, {0: {"model.layers.0.self_attn.o_proj.weight": o[:, :8]}}, 8)
        as_stored = check_loaded_weights(m, spec, table, {r: {"model.layers.0.self_attn.q_proj.weight": q.chunk(2)[r]}
                                                          for r in range(2)}, 2)
    assert not [r.message for r in good if r.failed]
    stored = [r for r in as_stored if r.failed]  # the file's rope-permuted rows, as vLLM's plug-in loads them
    assert len(stored) == 2 and all(r.component == "rope" and "rope-permuted order" in r.message for r in stored)
    (bad,) = [r for r in shard0 if r.failed]
    assert bad.component == "sharding" and "rank 0's bytes" in bad.message and bad.stats["rank"] == 1
    (unaligned,) = [r for r in at8 if r.failed]  # 64 / 8 = 8 elements: a quarter of a Q8_0 block
    assert unaligned.component == "sharding" and "quant blocks" in unaligned.message


def test_the_fast_closeness_test_answers_as_within_rtol():
    """sharding.weights._close (torch, in blocks) against comparison.within_rtol (numpy)."""
    import torch

    from ggufcheck.comparison import within_rtol
    from ggufcheck.sharding.weights import _EPS, close_to

    torch.manual_seed(0)
    w = torch.randn(1000, 37)
    cases = [(w.clone(), w), (w * (1 + 1e-8), w), (w * (1 + 1e-6), w), (w.to(torch.bfloat16), w),
             ((w * 1.01).to(torch.bfloat16), w), (torch.zeros(10, 3), torch.zeros(10, 3)),
             (torch.zeros(10, 3) + 1e-40, torch.zeros(10, 3))]
    for value in (float("nan"), float("inf")):
        g = w.clone()
        g[3, 4] = value
        cases.append((g, w))
    for g, want in cases:
        cmp = within_rtol(g, want, _EPS.get(g.dtype, 1.2e-7))
        assert close_to(g, want) == (cmp.ok, cmp.extra["max_abs_diff"])


# ---- known wrong layouts, named (sharding/layouts.py); each wrong value built here by hand
def _named(m, spec, table, loaded, tp, name, rank=0):
    bad = [r for r in check_loaded_weights(m, spec, table, loaded, tp) if r.failed]
    assert [r.tensor for r in bad] == [name], [r.message for r in bad]
    assert bad[0].stats["rank"] == rank
    return bad[0]


def _kv_b_by_hand(kv_b, spec, order):
    """kv_b [H*(P+V), L] with each head's (K, V) rows rearranged: "v-k" per head, "all-k" globally."""
    p, v = spec.mla.qk_nope, spec.mla.v_head
    heads = kv_b.view(-1, p + v, kv_b.shape[1])
    if order == "v-k":
        return torch.cat((heads[:, p:], heads[:, :p]), dim=1).reshape(kv_b.shape)
    return torch.cat((heads[:, :p].reshape(-1, kv_b.shape[1]), heads[:, p:].reshape(-1, kv_b.shape[1])))


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_b_layouts_are_named(tiny_converted, tp):
    with open_gguf(tiny_converted("deepseek2").gguf_path) as m:
        spec, _ = spec_for_model(m)
        table = table_for(spec)
        sd = hf_state_dict(m, spec, table)
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        for order, layout in (("v-k", "kv-b-v-before-k"), ("all-k", "kv-b-all-k-then-v")):
            loaded = _loaded(spec, sd, tp)
            wrong = _kv_b_by_hand(sd[name], spec, order)
            for r in range(tp):
                loaded[r][name] = wrong.chunk(tp)[r]
            bad = [r for r in check_loaded_weights(m, spec, table, loaded, tp) if r.failed]
            assert bad and all(r.tensor == name and r.component == "mla-kv-b" for r in bad)
            assert {r.stats["layout"] for r in bad} == {layout}, [r.message for r in bad]


def test_gate_up_swapped_is_named_dense_and_expert(model):
    m, spec, table, sd = model
    pairs = [("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")]
    if spec.mla is not None:
        pairs.append(("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"))
    for gate, up in pairs:
        loaded = _loaded(spec, sd, 2)
        loaded[1][gate], loaded[1][up] = loaded[1][up], loaded[1][gate]
        bad = {r.tensor: r for r in check_loaded_weights(m, spec, table, loaded, 2) if r.failed}
        assert set(bad) == {gate, up}
        assert bad[gate].stats["holds"] == up and bad[up].stats["holds"] == gate
        assert "mixed up the two names" in bad[gate].message and bad[gate].stats["layout"] == "swapped"
        assert bad[gate].component == ("moe-experts" if ".experts." in gate else "weights")


def test_values_faults_are_named(model):
    m, spec, table, sd = model
    cases = {  # parameter -> (what a loader put there, layout the audit must name)
        "model.layers.0.input_layernorm.weight": (lambda w: torch.zeros_like(w), "all-zeros"),
        "model.norm.weight": (lambda w: torch.ones_like(w), "all-ones"),
        "model.layers.1.post_attention_layernorm.weight": (lambda w: w + 1, "plus-one"),
        "model.layers.0.mlp.down_proj.weight": (lambda w: w * 2.5, "scaled"),
        "model.layers.1.self_attn.o_proj.weight": (lambda w: w.flip(0), "rows-permuted"),
        "model.layers.0.self_attn.q_a_proj.weight" if spec.mla else "model.layers.0.self_attn.q_proj.weight":
            (lambda w: torch.cat((w[w.shape[0] // 2:], w[:w.shape[0] // 2])), "rows-permuted"),
    }
    for name, (wrong, layout) in cases.items():
        loaded = _loaded(spec, sd, 1)
        loaded[0][name] = wrong(loaded[0][name])
        result = _named(m, spec, table, loaded, 1, name)
        assert result.stats["layout"] == layout, result.message
    assert "times 2.5 " in _named(m, spec, table, {0: {**_loaded(spec, sd, 1)[0], "model.layers.0.mlp.down_proj.weight":
                                                    sd["model.layers.0.mlp.down_proj.weight"] * 2.5}}, 1,
                                  "model.layers.0.mlp.down_proj.weight").message


def test_transposed_matrix_is_named(model):
    m, spec, table, sd = model
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        loaded = _loaded(spec, sd, 1)
        loaded[0][name] = loaded[0][name].T.contiguous()
        assert _named(m, spec, table, loaded, 1, name).stats["layout"] == "transposed"


def test_router_parameters_are_moe_router(tiny_converted):
    with open_gguf(tiny_converted("deepseek2").gguf_path) as m:
        spec, _ = spec_for_model(m)
        table = table_for(spec)
        sd = hf_state_dict(m, spec, table)
        for name in ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"):
            loaded = _loaded(spec, sd, 1)
            loaded[0][name] = torch.zeros_like(loaded[0][name])
            result = _named(m, spec, table, loaded, 1, name)
            assert result.component == "moe-router" and result.stats["layout"] == "all-zeros"


def test_unknown_wrong_values_stay_unnamed(model):
    """A value no known layout explains keeps the plain message (no layout guessed)."""
    m, spec, table, sd = model
    name = "model.layers.0.mlp.down_proj.weight"
    loaded = _loaded(spec, sd, 1)
    loaded[0][name] = loaded[0][name] + torch.randn(loaded[0][name].shape, generator=torch.Generator().manual_seed(1))
    result = _named(m, spec, table, loaded, 1, name)
    assert "layout" not in result.stats and "values differ" in result.message
