"""GQA + MoE decoder layers: glm4moe (GLM-4.5 / 4.6 / 4.7, docs/architectures.md sec 4),
qwen3moe (Qwen3-30B-A3B / 235B-A22B, sec 6) and gpt-oss (sec 9: attention sinks, a sliding
window on the even layers, a biased router, biased experts with the clamped SwiGLU).

GQA attention (the dense family's block: optional q/k/v biases, optional per-head q/k
RMSNorm before rope) with NEOX rope on the first ``rope.dimension_count`` dims of each head
(partial rotary for glm4moe), then a dense SwiGLU below ``leading_dense_block_count`` and the
router + routed experts (+ shared expert) above: glm4moe's sigmoid router with a selection
bias, qwen3moe's softmax router whose chosen weights llama.cpp always renormalizes. The
pre-FFN norm is ``post_attention_norm`` in glm4moe files, ``ffn_norm`` in qwen3moe files.
NextN layers (counted in block_count) are not run: the config excludes them.
"""

from __future__ import annotations

from torch import Tensor

from ggufcheck.reference.cache import LayerCache, LayerOutput
from ggufcheck.reference.config import ReferenceConfig
from ggufcheck.reference.dense import Weights, self_attention
from ggufcheck.reference.layers import ffn_block, rms_norm


def forward_layer(
    cfg: ReferenceConfig, i: int, w: Weights, h: Tensor, rope: tuple[Tensor, Tensor],
    q_pos: Tensor, k_pos: Tensor, cache: LayerCache, shared: dict,
) -> LayerOutput:
    """One glm4moe / qwen3moe / gpt-oss decoder layer on the residual stream h [T, D]."""
    attn_out = self_attention(cfg, w, rms_norm(h, w["attn_norm.weight"], cfg.rms_eps), rope, q_pos, k_pos, cache,
                              window=cfg.attention_window(i))
    after_attn = h + attn_out
    norm = w["ffn_norm.weight"] if "ffn_norm.weight" in w else w["post_attention_norm.weight"]
    x = rms_norm(after_attn, norm, cfg.rms_eps)
    ffn = ffn_block(cfg, w, x, cfg.is_moe_layer(i))
    ffn_out, ids, weights, gap_r = ffn.out, ffn.ids, ffn.weights, ffn.gap
    return LayerOutput(hidden=after_attn + ffn_out, after_attn=after_attn, attn_out=attn_out, ffn_out=ffn_out,
                       expert_ids=ids, expert_weights=weights, router_gap=gap_r)
