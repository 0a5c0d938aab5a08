"""The primitives against facts stated independently (architectures.md numbers, the
converter's permutation, brute-force formulations)."""

import math

import pytest
import torch

from ggufcheck.reference import dsa, mla
from ggufcheck.reference.config import ReferenceConfig, YarnConfig
from ggufcheck.reference.layers import apply_rope, moe, rope_cos_sin, rope_inv_freq, route


def _cfg(**kw):
    base = dict(arch="deepseek2", family="mla_moe", n_layer=1, n_embd=8, n_vocab=10, n_head=2, n_head_kv=1,
                head_dim_k=8, head_dim_v=8, rms_eps=1e-6, n_rot=4, rope_base=1e4, rope_mode="norm")
    base.update(kw)
    return ReferenceConfig(**base)


def test_yarn_matches_deepseek_v3_numbers():
    """architectures.md: DeepSeek-V3 (n_rot 64, base 1e4, L0 4096, F 40): low 10, high 23;
    kq_scale 1.36889^2 / sqrt(192) = 0.13523."""
    yarn = YarnConfig(factor=40.0, original_context=4096, mscale_all_dim=1.0)
    ratio = rope_inv_freq(64, 1e4, yarn) / rope_inv_freq(64, 1e4)  # [32]
    assert torch.allclose(ratio[:11], torch.ones(11, dtype=torch.float64))  # i <= low: unchanged
    assert torch.allclose(ratio[23:], torch.full((9,), 1 / 40, dtype=torch.float64))  # i >= high: / F
    assert ((ratio[11:23] < 1) & (ratio[11:23] > 1 / 40)).all()
    cfg = _cfg(head_dim_k=192, yarn=yarn)
    assert abs(cfg.kq_scale - 0.13523) < 5e-5


def test_rope_position_zero_is_identity_and_norm_neox_differ_elsewhere():
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.tensor([0, 5, 9]), rope_inv_freq(6, 1e4), torch.float64)
    for mode in ("norm", "neox"):
        y = apply_rope(x, cos, sin, mode)
        assert torch.equal(y[0], x[0])
        assert torch.equal(y[..., 6:], x[..., 6:])  # dims past n_rot pass through
    assert not torch.allclose(apply_rope(x, cos, sin, "norm")[1:], apply_rope(x, cos, sin, "neox")[1:])


def test_norm_on_converter_permuted_rows_equals_neox_on_original():
    """llama: the converter permutes q/k rows (w.reshape(n, 2, hd/2, in).swapaxes(1, 2));
    NORM rope on permuted rows must give the same q.k as NEOX on the original rows."""
    n_head, hd, d_in, T = 2, 8, 12, 5
    w_q, w_k = torch.randn(n_head * hd, d_in, dtype=torch.float64), torch.randn(n_head * hd, d_in, dtype=torch.float64)

    def permute(w):
        return w.reshape(n_head, 2, hd // 2, d_in).swapaxes(1, 2).reshape(n_head * hd, d_in)

    x = torch.randn(T, d_in, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(3, 3 + T), rope_inv_freq(hd, 1e4), torch.float64)

    def scores(wq, wk, mode):
        q = apply_rope((x @ wq.T).view(T, n_head, hd), cos, sin, mode)
        k = apply_rope((x @ wk.T).view(T, n_head, hd), cos, sin, mode)
        return torch.einsum("thd,shd->hts", q, k)

    assert torch.allclose(scores(permute(w_q), permute(w_k), "norm"), scores(w_q, w_k, "neox"), atol=1e-12)
    assert not torch.allclose(scores(w_q, w_k, "norm"), scores(w_q, w_k, "neox"))


def test_router_groups_use_minus_inf_and_unbiased_weights():
    """Biased scores can be negative: dropped groups must get -inf, not 0; weights come from
    the unbiased probabilities, normalized, then scaled once."""
    cfg = _cfg(n_expert=4, n_expert_used=2, gating="sigmoid", n_group=2, n_group_used=1,
               expert_weights_norm=True, expert_weights_scale=2.5)
    x = torch.eye(4, dtype=torch.float64)[:1]  # logits = row 0 of gate_inp
    gate_inp = torch.tensor([[0.0], [0.1], [-3.0], [-2.5]], dtype=torch.float64).repeat(1, 4) * torch.eye(4)[0]
    bias = torch.tensor([-3.5, -3.5, -1.5, -1.5], dtype=torch.float64)  # all biased scores < 0; group 1 wins
    ids, weights = route(x, gate_inp, bias, cfg)
    assert sorted(ids[0].tolist()) == [2, 3]
    p = torch.sigmoid(gate_inp[:, 0])
    expected = p[[2, 3]] / p[[2, 3]].sum() * 2.5
    assert torch.allclose(weights[0].sort().values, expected.sort().values)
    # the group's top-2 sum decides: group 0 has a higher max but a lower top-2 sum
    cfg2 = _cfg(n_expert=4, n_expert_used=1, gating="softmax", n_group=2, n_group_used=1)
    ids2, _ = route(x, torch.zeros(4, 4, dtype=torch.float64), torch.tensor([0.9, -0.9, 0.5, 0.45], dtype=torch.float64), cfg2)
    assert ids2[0].item() == 2


def test_moe_loop_equals_dense_formulation():
    torch.manual_seed(0)
    T, D, F, E, K = 6, 8, 5, 4, 2
    x = torch.randn(T, D, dtype=torch.float64)
    gate, up, down = (torch.randn(E, F, D, dtype=torch.float64), torch.randn(E, F, D, dtype=torch.float64),
                      torch.randn(E, D, F, dtype=torch.float64))
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K, dtype=torch.float64)
    every = torch.einsum("edf,etf->ted", down, torch.nn.functional.silu(torch.einsum("efd,td->etf", gate, x))
                         * torch.einsum("efd,td->etf", up, x))  # [T, E, D]: every expert on every token
    dense = (every.gather(1, ids[:, :, None].expand(T, K, D)) * w[:, :, None]).sum(1)
    assert torch.allclose(moe(x, ids, w, gate, up, down), dense, atol=1e-12)


def test_legacy_kv_b_split_inverts_the_converters_merge():
    H, L, P, V = 3, 7, 4, 5
    cfg = _cfg(n_head=H, kv_lora_rank=L, qk_nope=P, qk_rope=2, v_head=V)
    k_b, v_b = torch.randn(H, L, P), torch.randn(H, V, L)
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(H * (P + V), L)  # architectures.md's inverse
    k2, v2 = mla.kv_b_split(cfg, {"attn_kv_b.weight": kv_b})
    assert torch.equal(k2, k_b) and torch.equal(v2, v_b)


def test_top_k_selection_mask_and_ties():
    inf = float("-inf")
    scores = torch.tensor([[1.0, inf, inf, inf], [0.5, 2.0, inf, inf], [0.0, 3.0, 0.0, 0.0]], dtype=torch.float64)
    idx = dsa.select_top_k(scores, 2)
    assert idx[0].tolist() == [0, -1]  # only one visible key: -1 marks "none"
    mask = dsa.top_k_mask(idx, 4)
    assert mask.tolist() == [[True, False, False, False], [True, True, False, False],
                             [idx[2, 1].item() == 0, True, idx[2, 1].item() == 2, idx[2, 1].item() == 3]]
    ties = dsa.boundary_ties(scores, 2)
    assert ties.tolist() == [False, False, True]  # row 2: three zeros compete for one slot


def test_mla_absorbed_equals_naive_on_random_tensors():
    torch.manual_seed(0)
    T, S, H, P, R, L, V = 3, 5, 2, 4, 2, 6, 3
    args = (torch.randn(T, H, P), torch.randn(T, H, R), torch.randn(S, L), torch.randn(S, R),
            torch.randn(H, L, P), torch.randn(H, V, L))
    args = tuple(a.double() for a in args)
    allowed = torch.rand(T, S) > 0.3
    allowed[:, 0] = True
    a = mla.attend_naive(*args, allowed, 0.3)
    b = mla.attend_absorbed(*args, allowed, 0.3)
    assert torch.allclose(a, b, atol=1e-12) and a.shape == (T, H, V)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_matches_cpu(tiny, prompt):
    from ggufcheck.reference import ReferenceModel

    tokens = prompt(12)
    path = tiny("glm-dsa").gguf_path
    with ReferenceModel(path, device="cpu") as cpu, ReferenceModel(path, device="cuda") as gpu:
        a, b = cpu.prefill(tokens).logprobs, gpu.prefill(tokens).logprobs.cpu()
    assert (a - b).abs().max() < 1e-9
    assert math.isfinite(float(b.sum()))
