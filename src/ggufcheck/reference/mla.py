"""Multi-head Latent Attention (deepseek2, glm-dsa), naive AND absorbed (docs/architectures.md sec 3).

Both forms read the same cache, the latent ``c`` [S, L] and the rotated shared key
``k_pe`` [S, R], and must give the same output (a test): the naive form expands per-head
keys and values from the latent with ``k_b`` / ``v_b``; the absorbed form (what llama.cpp,
vLLM and FlashMLA run) folds ``k_b`` into the query and ``v_b`` after the softmax, so the
attention itself happens in the L-dim latent space.

Per head the query is [nope P, rope R]: rope LAST (the DSA indexer puts it first).
The q_a / kv_a RMSNorms use ``cfg.lora_norm_eps`` (see config.py for why that is a field).

Dimension letters: T queries, S keys, H heads, P nope dims, R rope dims, V value dims,
L kv_lora_rank (latent), Q q_lora_rank, D hidden.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ggufcheck.reference.cache import LayerCache
from ggufcheck.reference.config import ReferenceConfig
from ggufcheck.reference.layers import apply_rope, blocks_of, linear, rms_norm
from ggufcheck.reference.weights import materialize

Weights = dict[str, Tensor]


def kv_b_split(cfg: ReferenceConfig, w: Weights) -> tuple[Tensor, Tensor]:
    """(k_b [H, L, P], v_b [H, V, L]) from the split tensors, or from a legacy ``attn_kv_b``.

    Legacy ``attn_kv_b`` is HF's kv_b_proj [H*(P+V), L], per head K rows then V rows.
    """
    if "attn_k_b.weight" in w:
        return w["attn_k_b.weight"], w["attn_v_b.weight"]
    kv_b = materialize(w["attn_kv_b.weight"]).view(cfg.n_head, cfg.qk_nope + cfg.v_head, cfg.kv_lora_rank)  # [H, P+V, L]
    k_b = kv_b[:, : cfg.qk_nope].transpose(1, 2)  # [H, L, P]
    v_b = kv_b[:, cfg.qk_nope :]  # [H, V, L]
    return k_b, v_b


def project_q(cfg: ReferenceConfig, w: Weights, x: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
    """Normed x [T, D] -> (qr [T, Q] or None without q_lora, q_nope [T, H, P], q_pe [T, H, R])."""
    n_tok = x.shape[0]
    if cfg.q_lora_rank:
        qr = rms_norm(linear(x, w["attn_q_a.weight"]), w["attn_q_a_norm.weight"], cfg.lora_norm_eps)  # [T, Q]
        q = linear(qr, w["attn_q_b.weight"])  # [T, H*(P+R)]
    else:
        qr, q = None, linear(x, w["attn_q.weight"])
    q = q.view(n_tok, cfg.n_head, cfg.qk_nope + cfg.qk_rope)  # [T, H, P+R]
    return qr, q[..., : cfg.qk_nope], q[..., cfg.qk_nope :]


def project_kv(cfg: ReferenceConfig, w: Weights, x: Tensor) -> tuple[Tensor, Tensor]:
    """Normed x [T, D] -> (latent c [T, L] after kv_a_norm, k_pe [T, 1, R] before rope)."""
    kv = linear(x, w["attn_kv_a_mqa.weight"])  # [T, L+R]
    c = rms_norm(kv[:, : cfg.kv_lora_rank], w["attn_kv_a_norm.weight"], cfg.lora_norm_eps)  # norm only the latent
    k_pe = kv[:, cfg.kv_lora_rank :].unsqueeze(1)  # [T, 1, R]: one rope key shared by all heads
    return c, k_pe


def _softmax(scores: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """scores [H, T, S] (a temporary: scaled and masked in place) -> probabilities, -inf where
    not allowed [T, S]."""
    return torch.softmax(scores.mul_(scale).masked_fill_(~allowed[None], float("-inf")), dim=-1)


def attend_naive(q_nope: Tensor, q_pe: Tensor, c: Tensor, k_pe: Tensor, k_b: Tensor, v_b: Tensor,
                 allowed: Tensor, scale: float) -> Tensor:
    """Expand per-head keys / values from the latent, then ordinary attention -> [T, H, V]."""
    k_nope = torch.einsum("sc,hcd->shd", c, k_b)  # [S, H, P]
    v = torch.einsum("sc,hec->she", c, v_b)  # [S, H, V]
    scores = torch.einsum("thd,shd->hts", q_nope, k_nope).add_(torch.einsum("thr,sr->hts", q_pe, k_pe))  # [H, T, S]
    return torch.einsum("hts,she->the", _softmax(scores, allowed, scale), v)  # [T, H, V]


def attend_absorbed(q_nope: Tensor, q_pe: Tensor, c: Tensor, k_pe: Tensor, k_b: Tensor, v_b: Tensor,
                    allowed: Tensor, scale: float) -> Tensor:
    """Attention in the latent space: k_b folded into q, v_b applied after softmax -> [T, H, V]."""
    q_abs = torch.einsum("thd,hcd->thc", q_nope, k_b)  # [T, H, L]
    scores = torch.einsum("thc,sc->hts", q_abs, c).add_(torch.einsum("thr,sr->hts", q_pe, k_pe))  # [H, T, S]
    o_latent = torch.einsum("hts,sc->thc", _softmax(scores, allowed, scale), c)  # [T, H, L]
    return torch.einsum("thc,hec->the", o_latent, v_b)  # [T, H, V]


def mla_attention(
    cfg: ReferenceConfig, w: Weights, x: Tensor, q_nope: Tensor, q_pe: Tensor,
    rope: tuple[Tensor, Tensor], allowed: Tensor, cache: LayerCache,
) -> Tensor:
    """MLA over the latent cache plus the new tokens; x [T, D] normed -> attention out [T, D].

    ``allowed`` [T, S] is the causal mask, already intersected with the DSA top-k if any.
    """
    cos, sin = rope
    c, k_pe = project_kv(cfg, w, x)
    q_pe = apply_rope(q_pe, cos, sin, cfg.rope_mode)  # [T, H, R]
    k_pe = apply_rope(k_pe, cos, sin, cfg.rope_mode)[:, 0]  # [T, R]
    c_all = cache.extend("c", c)  # [S, L]
    k_pe_all = cache.extend("k_pe", k_pe)  # [S, R]
    k_b, v_b = kv_b_split(cfg, w)
    attend = attend_absorbed if cfg.mla_form == "absorbed" else attend_naive
    blocks = blocks_of(cfg.n_head, x.shape[0] * c_all.shape[0] * x.element_size())  # [Hb, T, S] scores per block
    o = torch.cat([attend(q_nope[:, b], q_pe[:, b], c_all, k_pe_all, k_b[b], v_b[b], allowed, cfg.kq_scale)
                   for b in blocks], dim=1)  # [T, H, V]
    return linear(o.reshape(x.shape[0], cfg.n_head * cfg.v_head), w["attn_output.weight"])
