"""Shard rules and slices, against slices written out by hand from vLLM's loaders."""

from __future__ import annotations

import pytest
import torch

from ggufcheck.arch.known import known_spec
from ggufcheck.arch.tables import table_for
from ggufcheck.sharding.rules import (ShardRule, pad_vocab, rules_from_table, shard, split_problem,
                                      vocab_range)


def test_column_and_row_slices_are_vllm_narrows():
    w = torch.arange(8 * 6).reshape(8, 6)
    for tp in (1, 2, 4):
        for r in range(tp):
            col = shard(w, ShardRule("column", 0), r, tp)
            row = shard(w, ShardRule("row", 1), r, tp)
            n, k = 8 // tp, 6 // tp if 6 % tp == 0 else None
            assert torch.equal(col, w[r * n:(r + 1) * n])
            if k:
                assert torch.equal(row, w[:, r * k:(r + 1) * k])


def test_fused_gate_up_splits_each_half():
    gate, up = torch.arange(8)[:, None].float(), 100 + torch.arange(8)[:, None].float()
    fused = torch.cat((gate, up))[None]  # [E=1, 2F=16, D=1]
    piece = shard(fused, ShardRule("column", 1, parts=2), 1, 2)
    assert piece[0, :, 0].tolist() == [4, 5, 6, 7, 104, 105, 106, 107]


def test_kv_heads_replicated_when_tp_exceeds_them():
    k = torch.arange(2 * 3).reshape(2 * 3, 1)  # 2 kv heads of 3 rows
    rule = ShardRule("column", 0, unit=3, kv_heads=True)
    got = [shard(k, rule, r, 8, n_kv=2)[:, 0].tolist() for r in range(8)]
    assert got == [[0, 1, 2]] * 4 + [[3, 4, 5]] * 4  # vLLM: rank r reads kv head r // (tp / Hkv)
    assert split_problem(6, rule, 8, n_kv=2) is None
    assert "not a multiple" in split_problem(6, ShardRule("column", 0, 3, True), 3, n_kv=2)


def test_vocab_padding_as_vllm():
    assert pad_vocab(500) == 512 and pad_vocab(512) == 512 and pad_vocab(154880) == 154880
    assert vocab_range(500, 7, 8) == (448, 500, 64)
    w = torch.randn(500, 3)
    last = shard(w, ShardRule("vocab", 0), 7, 8)
    assert last.shape == (64, 3) and torch.equal(last[:52], w[448:]) and not last[52:].any()
    with pytest.raises(ValueError):
        vocab_range(500, 0, 3)  # 512 / 3: vLLM's divide() asserts


def test_units_are_whole_heads():
    rule = ShardRule("column", 0, unit=16)
    assert split_problem(64, rule, 4) is None
    assert "cuts through a unit" in split_problem(64, rule, 8)


def test_rules_from_the_arch_table_glm5():
    spec = known_spec("glm-5")
    rules = rules_from_table(spec, table_for(spec))
    assert rules["attn_q_b.weight"] == ShardRule("column", 0, spec.mla.qk_nope + spec.mla.qk_rope)
    assert rules["attn_output.weight"].kind == "row" and rules["attn_output.weight"].unit == spec.mla.v_head
    assert rules["ffn_down_exps.weight"] == ShardRule("row", 2)
    assert rules["token_embd.weight"].kind == "vocab"
    assert not rules["attn_kv_a_mqa.weight"].is_split and not rules["indexer.proj.weight"].is_split
    assert not rules["ffn_gate_inp.weight"].is_split
