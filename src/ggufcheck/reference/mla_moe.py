"""MLA + MoE decoder layers: deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2, ...) and glm-dsa (GLM-5),
which adds the DSA indexer (docs/architectures.md sec 3 and 5).

Per layer: attn_norm -> MLA (naive or absorbed, cfg.mla_form), with glm-dsa's top-k mask
on top of the causal one -> residual -> ffn_norm -> dense SwiGLU below
``leading_dense_block_count``, else router + routed experts + shared expert -> residual.
deepseek2 may use YaRN (config.kq_scale carries mscale^2); glm-dsa does not.
"""

from __future__ import annotations

from torch import Tensor

from ggufcheck.reference import dsa, mla
from ggufcheck.reference.cache import LayerCache, LayerOutput
from ggufcheck.reference.config import ReferenceConfig
from ggufcheck.reference.layers import causal_mask, ffn_block, rms_norm

Weights = dict[str, Tensor]


def forward_layer(
    cfg: ReferenceConfig, i: int, w: Weights, h: Tensor, rope: tuple[Tensor, Tensor],
    q_pos: Tensor, k_pos: Tensor, cache: LayerCache, shared: dict,
) -> LayerOutput:
    """One deepseek2 / glm-dsa decoder layer on the residual stream h [T, D]."""
    x = rms_norm(h, w["attn_norm.weight"], cfg.rms_eps)
    qr, q_nope, q_pe = mla.project_q(cfg, w, x)
    allowed = causal_mask(q_pos, k_pos)  # [T, S]
    topk, full, ties, gap = None, False, None, None
    if cfg.has_indexer:
        topk, full = dsa.indexer_top_k(cfg, i, w, x, qr, rope, q_pos, k_pos, cache, shared)
        ties, gap = shared.get("ties"), shared.get("gap")
        allowed = allowed & dsa.top_k_mask(topk, k_pos.shape[0])
    attn_out = mla.mla_attention(cfg, w, x, q_nope, q_pe, rope, allowed, cache)
    after_attn = h + attn_out
    x = rms_norm(after_attn, w["ffn_norm.weight"], cfg.rms_eps)
    ffn = ffn_block(cfg, w, x, cfg.is_moe_layer(i))
    ffn_out, ids, weights, gap_r = ffn.out, ffn.ids, ffn.weights, ffn.gap
    return LayerOutput(hidden=after_attn + ffn_out, after_attn=after_attn, attn_out=attn_out, ffn_out=ffn_out,
                       expert_ids=ids, expert_weights=weights, router_gap=gap_r, topk=topk, topk_full=full, topk_ties=ties,
                       topk_gap=gap)
