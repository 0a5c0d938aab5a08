"""Transforms invert exactly and mean what they claim (rope semantics, kv_b head layout);
tables are complete data (every row evaluates, cites a source, has a shard rule) and give
the documented GLM-5 / DeepSeek-V3 shapes."""

from __future__ import annotations

import math

import pytest
import torch

from ggufcheck.arch.known import KNOWN, known_spec
from ggufcheck.arch.spec import spec_from_metadata
from ggufcheck.arch.table import ShardKind, eval_dim, expected_tensors, shape_of
from ggufcheck.arch.tables import TABLES, table_for
from ggufcheck.arch.transforms import (TRANSFORMS, kv_b_from_split, llama_permute,
                                       llama_unpermute, split_kv_b)


def _small_mla_spec():
    """GLM-5's keys with small numbers: H 4, P 6, R 4, V 5, L 8, E 3."""
    meta = KNOWN["glm-5"]()
    p = "glm-dsa."
    meta.update({p + "embedding_length": 12, p + "attention.head_count": 4,
                 p + "attention.kv_lora_rank": 8, p + "attention.key_length": 12,
                 p + "attention.value_length": 8, p + "attention.key_length_mla": 10,
                 p + "attention.value_length_mla": 5, p + "rope.dimension_count": 4,
                 p + "attention.q_lora_rank": 7, p + "expert_count": 3, p + "expert_used_count": 2,
                 p + "expert_feed_forward_length": 6, p + "block_count": 3,
                 p + "leading_dense_block_count": 1, p + "attention.indexer.key_length": 8,
                 p + "attention.indexer.head_count": 2})
    return spec_from_metadata(meta)


ROLE_SHAPES = {  # GGUF inputs of each transform, for the small spec (H 4, hd 6 rows per head)
    "identity": {"w": (5, 7)},
    "llama_q": {"w": (4 * 6, 7)},
    "llama_k": {"w": (1 * 6, 7)},  # the spec's Hkv is 1 (MQA view)
    "kv_b": {"k_b": (4, 8, 6), "v_b": (4, 5, 8)},
    "unstack_experts": {"w": (3, 6, 12)},
    "fuse_gate_up": {"gate": (3, 6, 12), "up": (3, 6, 12)},
    "split_fused_gate_up": {"w": (3, 12, 12)},
    "gemma_norm": {"w": (64,)},
    "oai_gate_up": {"gate": (3, 6, 12), "up": (3, 6, 12)},
    "oai_gate_up_bias": {"gate": (3, 6), "up": (3, 6)},
    "transpose_experts": {"w": (3, 12, 6)},
}
HF_NAME = {"unstack_experts": "x.{e}.w", "split_fused_gate_up": "x.{e}.{proj}.w"}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transform_round_trips_bit_exactly(name):
    spec = _small_mla_spec()
    t = TRANSFORMS[name]
    assert set(ROLE_SHAPES[name]) == set(t.roles)
    gen = torch.Generator().manual_seed(0)
    gguf = {role: torch.randn(shape, generator=gen) for role, shape in ROLE_SHAPES[name].items()}
    if name == "gemma_norm":  # stored 1 + w: exact for stored values >= 0.5 (w - 1 and back round nowhere)
        gguf = {"w": (1 + 0.2 * gguf["w"]).clamp(0.5, 8.0)}
    hf_name = HF_NAME.get(name, "x.w")
    hf = t.to_hf(gguf, spec, hf_name)
    assert sorted(hf) == sorted(t.hf_names(spec, hf_name))
    back = t.to_gguf(hf, spec, hf_name)
    assert set(back) == set(gguf)
    for role in gguf:
        assert torch.equal(back[role], gguf[role]), role
    again = t.to_hf(back, spec, hf_name)  # and HF -> GGUF -> HF
    assert all(torch.equal(again[k], hf[k]) for k in hf)


def _rope_neox(x: torch.Tensor, pos: float, base: float = 10000.0) -> torch.Tensor:
    """HF rotate_half convention on one head vector: pairs (i, i + d/2)."""
    d = x.shape[-1]
    theta = pos * base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    a, b = x[: d // 2], x[d // 2:]
    return torch.cat([a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()])


def _rope_norm(x: torch.Tensor, pos: float, base: float = 10000.0) -> torch.Tensor:
    """ggml mode 0 on one head vector: pairs (2i, 2i+1)."""
    d = x.shape[-1]
    theta = pos * base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    a, b = x[0::2], x[1::2]
    out = torch.empty_like(x)
    out[0::2], out[1::2] = a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()
    return out


def test_llama_permutation_makes_norm_rope_equal_neox():
    """The converter's q/k permutation is exactly what lets llama.cpp use NORM rope: q.k
    scores from permuted rows with NORM equal those from HF rows with NEOX (rotate_half)."""
    n_head, hd, d_in = 3, 8, 5
    gen = torch.Generator().manual_seed(0)
    wq = torch.randn(n_head * hd, d_in, generator=gen, dtype=torch.float64)
    wk = torch.randn(n_head * hd, d_in, generator=gen, dtype=torch.float64)
    x1, x2 = torch.randn(d_in, generator=gen, dtype=torch.float64), torch.randn(d_in, generator=gen, dtype=torch.float64)
    pq, pk = llama_permute(wq, n_head), llama_permute(wk, n_head)
    assert torch.equal(llama_unpermute(pq, n_head), wq)
    assert not torch.equal(pq, wq)
    for h in range(n_head):
        rows = slice(h * hd, (h + 1) * hd)
        hf_score = _rope_neox(wq[rows] @ x1, 37.0) @ _rope_neox(wk[rows] @ x2, 11.0)
        gguf_score = _rope_norm(pq[rows] @ x1, 37.0) @ _rope_norm(pk[rows] @ x2, 11.0)
        assert math.isclose(hf_score, gguf_score, rel_tol=1e-12)


def test_kv_b_is_head_major_k_then_v():
    """architectures.md sec 7: kv_b rows per head are P key rows then V value rows, so a TP
    rank's contiguous row block holds whole heads (the [all K; all V] layout is wrong)."""
    h, l, p, v = 4, 8, 6, 5
    gen = torch.Generator().manual_seed(0)
    k_b, v_b = torch.randn(h, l, p, generator=gen), torch.randn(h, v, l, generator=gen)
    kv = kv_b_from_split(k_b, v_b)
    assert kv.shape == (h * (p + v), l)
    for i in range(h):
        block = kv[i * (p + v):(i + 1) * (p + v)]
        assert torch.equal(block[:p], k_b[i].T) and torch.equal(block[p:], v_b[i])
    tp = 2  # rank 1's rows are exactly heads 2..3, split the way vLLM does
    local = kv[h // tp * (p + v):].T.reshape(l, h // tp, p + v)
    w_uk, w_uv = local[..., :p], local[..., p:]
    assert torch.equal(w_uk.permute(1, 0, 2), k_b[2:]) and torch.equal(w_uv.permute(1, 2, 0), v_b[2:])
    k2, v2 = split_kv_b(kv, h, p, v)
    assert torch.equal(k2, k_b) and torch.equal(v2, v_b)


# --- tables ---------------------------------------------------------------------------------


def _specs():
    yield known_spec("deepseek-v3")
    yield known_spec("glm-5")
    yield known_spec("glm-5.2")
    yield _small_mla_spec()


@pytest.mark.parametrize("spec", list(_specs()), ids=["deepseek-v3", "glm-5", "glm-5.2", "small"])
def test_every_row_evaluates(spec):
    table = table_for(spec)
    for row in table.rows:
        assert row.source, row.gguf
        if row.when in ("no_q_lora", "legacy_kv_b") or row.gguf.startswith("blk.{i}.indexer") and spec.indexer is None:
            continue
        shape = shape_of(row, spec)
        assert all(d > 0 for d in shape), (row.gguf, shape)
        if row.shard.dim is not None:
            assert row.shard.dim < len(shape) and row.shard.unit_size(spec) > 0
        if row.shard.kind in (ShardKind.COLUMN, ShardKind.ROW):
            assert shape[row.shard.dim] % row.shard.unit_size(spec) == 0, row.gguf


def test_glm5_expected_tensors_match_the_doc():
    spec = known_spec("glm-5")
    exp = expected_tensors(spec, table_for(spec))
    assert exp["blk.5.attn_k_b.weight"].shape == (64, 512, 192)  # architectures.md sec 5
    assert exp["blk.5.attn_v_b.weight"].shape == (64, 256, 512)
    assert exp["blk.0.ffn_gate.weight"].shape == (12288, 6144)  # dense (first 3 layers)
    assert exp["blk.3.ffn_gate_exps.weight"].shape == (256, 2048, 6144)
    assert exp["blk.3.ffn_down_exps.weight"].shape == (256, 6144, 2048)
    assert exp["blk.3.indexer.attn_q_b.weight"].shape == (32 * 128, 2048)
    assert exp["blk.78.nextn.eh_proj.weight"].shape == (6144, 12288)
    assert not exp["blk.78.indexer.proj.weight"].required  # NextN indexer: optional
    assert "blk.77.nextn.eh_proj.weight" not in exp and "blk.0.attn_kv_b.weight" not in exp
    down = exp["blk.3.ffn_down_exps.weight"].row.shard
    assert down.experts and down.kind is ShardKind.ROW and down.splits_rows(3)
    assert exp["blk.3.attn_output.weight"].row.shard.splits_rows(2)
    assert not exp["blk.3.attn_q_b.weight"].row.shard.splits_rows(2)


def test_glm5_2_shared_layers_have_no_indexer_tensors():
    spec = known_spec("glm-5.2")
    exp = expected_tensors(spec, table_for(spec))
    assert "blk.2.indexer.proj.weight" in exp and "blk.3.indexer.proj.weight" not in exp
    assert "blk.6.indexer.proj.weight" in exp


def test_deepseek_v3_expected_tensors():
    spec = known_spec("deepseek-v3")
    exp = expected_tensors(spec, table_for(spec))
    assert exp["blk.0.attn_q_b.weight"].shape == (128 * 192, 1536)
    assert exp["blk.0.attn_kv_a_mqa.weight"].shape == (576, 7168)
    assert exp["blk.0.attn_k_b.weight"].shape == (128, 512, 128)
    assert exp["blk.3.ffn_gate_shexp.weight"].shape == (2048, 7168)
    # a fused gate_up file replaces gate + up, as llama.cpp's loader does
    fused = expected_tensors(spec, table_for(spec), ["blk.3.ffn_gate_up_exps.weight"])
    assert fused["blk.3.ffn_gate_up_exps.weight"].shape == (256, 4096, 7168)
    assert "blk.3.ffn_gate_exps.weight" not in fused and "blk.4.ffn_gate_exps.weight" in fused


def test_hf_names_are_unique_per_layout():
    for spec in _specs():
        for layout in ("checkpoint", "transformers"):
            from ggufcheck.arch.rebuild import groups

            names = [n for g in groups(spec, table_for(spec), layout=layout)
                     for n in TRANSFORMS[g.transform].hf_names(spec, g.hf_name)]
            assert len(names) == len(set(names)), layout


def test_eval_dim():
    dims = {"H": 4, "P": 6, "R": 2}
    assert eval_dim("H*(P+R)", dims) == 32 and eval_dim("P//2 - 1", dims) == 2
    with pytest.raises(KeyError):
        eval_dim("Q", dims)
    with pytest.raises(ValueError):
        eval_dim("__import__('os')", dims)
    assert set(TABLES) == {"llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen3moe", "gpt-oss", "glm4moe",
                           "deepseek2", "glm-dsa"}


def test_legacy_and_lite_deepseek2_layouts():
    """Legacy files (no *_length_mla keys) keep one attn_kv_b; V2-Lite (no q_lora) has attn_q."""
    from ggufcheck.arch.known import deepseek_v3_metadata

    meta = deepseek_v3_metadata()
    del meta["deepseek2.attention.key_length_mla"], meta["deepseek2.attention.value_length_mla"]
    del meta["deepseek2.attention.q_lora_rank"]
    meta.update({"deepseek2.attention.key_length": 192, "deepseek2.attention.value_length": 128,
                 "deepseek2.attention.head_count_kv": 128})
    spec = spec_from_metadata(meta)
    exp = expected_tensors(spec, table_for(spec))
    assert exp["blk.0.attn_kv_b.weight"].shape == (128 * 256, 512)
    assert exp["blk.0.attn_q.weight"].shape == (128 * 192, 7168)
    assert not any(n.startswith("blk.0.attn_k_b") or n.startswith("blk.0.attn_q_a") for n in exp)
    assert exp["blk.0.attn_kv_b.weight"].row.shard.unit_size(spec) == 256  # one head's P+V rows
