"""MLA kv_b per rank: W_UK / W_UV == k_b / v_b of the rank's heads; the [all K; all V] fault."""

from __future__ import annotations

import torch

from ggufcheck.gguf.dequant import dequantize_tensor
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.results import Status
from ggufcheck.sharding import faults
from ggufcheck.checks.sharding import check_kv_b_ranks
from ggufcheck.sharding.mla import rank_uk_uv


def _random_kb_vb(n_head=8, lora=12, nope=5, v_dim=7):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n_head, lora, nope, generator=g), torch.randn(n_head, v_dim, lora, generator=g)


def test_vllm_layout_holds_every_rank_exactly():
    k_b, v_b = _random_kb_vb()
    for tp in (1, 2, 4, 8):
        results = check_kv_b_ranks(k_b, v_b, tp)
        assert len(results) == tp and all(r.status is Status.PASS for r in results)


def test_rank_views_by_hand():
    """Rank 1 of 2 holds heads 4..7: W_UK[:, h] = k_b[4 + h], W_UV[:, h] = v_b[4 + h].T."""
    k_b, v_b = _random_kb_vb()
    uk, uv = rank_uk_uv(k_b, v_b, 1, 2)
    assert uk.shape == (12, 4, 5) and uv.shape == (12, 4, 7)
    for h in range(4):
        assert torch.equal(uk[:, h], k_b[4 + h]) and torch.equal(uv[:, h], v_b[4 + h].T)


def test_all_k_then_v_passes_at_tp1_and_fails_above():
    k_b, v_b = _random_kb_vb()
    assert all(r.status is Status.PASS for r in check_kv_b_ranks(k_b, v_b, 1, layout=faults.KV_B_ALL_K_THEN_V))
    for tp in (2, 4, 8):
        results = check_kv_b_ranks(k_b, v_b, tp, layout=faults.KV_B_ALL_K_THEN_V)
        assert results[0].status is Status.FAIL, tp  # rank 0 holds only key rows
        assert results[0].component == "mla-kv-b" and results[0].worst["rank"] == 0


def test_on_the_converted_deepseek2_file(tiny_converted):
    with open_gguf(tiny_converted("deepseek2").gguf_path) as m:
        k_b = dequantize_tensor(m, "blk.0.attn_k_b.weight")
        v_b = dequantize_tensor(m, "blk.0.attn_v_b.weight")
    for tp in (1, 2, 4):
        assert all(r.status is Status.PASS for r in check_kv_b_ranks(k_b, v_b, tp, layer=0))
    assert check_kv_b_ranks(k_b, v_b, 8)[0].status is Status.FAIL  # 4 heads over 8 ranks
    assert any(r.failed for r in check_kv_b_ranks(k_b, v_b, 2, layout=faults.KV_B_ALL_K_THEN_V))
