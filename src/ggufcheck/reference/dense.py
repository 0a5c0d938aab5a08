"""Dense decoder layers: llama, qwen2, qwen3 (docs/architectures.md sec 6), and the GQA
self-attention block that glm4moe shares.

- llama: the converter permuted q and k rows for ggml's NORM rope; the reference uses NORM
  rope on the weights exactly as stored (never un-permute and NORM: that mixes the two).
  ``rope_freqs.weight`` (llama-3.1 scaling) divides theta_i.
- qwen2: q/k/v biases, NEOX rope.
- qwen3: per-head RMSNorm on q and k (``attn_q_norm`` / ``attn_k_norm``) before NEOX rope;
  ``attention.key_length`` may differ from D / H.
- phi3: q/k/v fused in ``attn_qkv`` and gate/up in ``ffn_up`` ([gate; up], layers.ffn_block);
  a sliding window on every layer when the file has one.
- gpt-oss (through gqa_moe.py): q/k/v/o biases, per-head ``attn_sinks``, a sliding window.

Dimension letters: T new tokens, S cached + new keys, H / G query / kv heads, d head dim.
"""

from __future__ import annotations

from torch import Tensor

from ggufcheck.reference.cache import LayerCache, LayerOutput
from ggufcheck.reference.config import ReferenceConfig
from ggufcheck.reference.layers import apply_rope, attention, causal_mask, ffn_block, linear, rms_norm

Weights = dict[str, Tensor]  # one layer's tensors by GGUF short name, e.g. "attn_q.weight"


def self_attention(
    cfg: ReferenceConfig, w: Weights, x: Tensor, rope: tuple[Tensor, Tensor],
    q_pos: Tensor, k_pos: Tensor, cache: LayerCache, window: int = 0,
) -> Tensor:
    """GQA self-attention of normed x [T, D] over the cache plus the new tokens -> [T, D]
    (over the last ``window`` positions only, when > 0: a sliding-window layer)."""
    n_tok = x.shape[0]
    if "attn_qkv.weight" in w:  # phi3: [q rows; k rows; v rows] in one tensor
        qkv = linear(x, w["attn_qkv.weight"], w.get("attn_qkv.bias"))  # [T, (H + 2G) * d]
        q, k, v = qkv.split([cfg.n_head * cfg.head_dim_k, cfg.n_head_kv * cfg.head_dim_k,
                             cfg.n_head_kv * cfg.head_dim_v], dim=-1)
    else:
        q = linear(x, w["attn_q.weight"], w.get("attn_q.bias"))  # [T, H*d]
        k = linear(x, w["attn_k.weight"], w.get("attn_k.bias"))  # [T, G*d]
        v = linear(x, w["attn_v.weight"], w.get("attn_v.bias"))  # [T, G*dv]
    q = q.view(n_tok, cfg.n_head, cfg.head_dim_k)  # [T, H, d]
    k = k.view(n_tok, cfg.n_head_kv, cfg.head_dim_k)  # [T, G, d]
    v = v.view(n_tok, cfg.n_head_kv, cfg.head_dim_v)  # [T, G, dv]
    if "attn_q_norm.weight" in w:  # qwen3, glm4moe with use_qk_norm: per head, before rope
        q = rms_norm(q, w["attn_q_norm.weight"], cfg.rms_eps)
        k = rms_norm(k, w["attn_k_norm.weight"], cfg.rms_eps)
    cos, sin = rope
    q = apply_rope(q, cos, sin, cfg.rope_mode)
    k = apply_rope(k, cos, sin, cfg.rope_mode)
    k_all = cache.extend("k", k)  # [S, G, d]
    v_all = cache.extend("v", v)  # [S, G, dv]
    o = attention(q, k_all, v_all, causal_mask(q_pos, k_pos, window), cfg.kq_scale,
                  w.get("attn_sinks.weight"))  # [T, H, dv]
    return linear(o.reshape(n_tok, cfg.n_head * cfg.head_dim_v), w["attn_output.weight"], w.get("attn_output.bias"))


def forward_layer(
    cfg: ReferenceConfig, i: int, w: Weights, h: Tensor, rope: tuple[Tensor, Tensor],
    q_pos: Tensor, k_pos: Tensor, cache: LayerCache, shared: dict,
) -> LayerOutput:
    """One llama / qwen2 / qwen3 / phi3 decoder layer on the residual stream h [T, D]."""
    attn_out = self_attention(cfg, w, rms_norm(h, w["attn_norm.weight"], cfg.rms_eps), rope, q_pos, k_pos, cache,
                              window=cfg.attention_window(i))
    after_attn = h + attn_out
    x = rms_norm(after_attn, w["ffn_norm.weight"], cfg.rms_eps)
    ffn_out = ffn_block(cfg, w, x, False).out
    return LayerOutput(hidden=after_attn + ffn_out, after_attn=after_attn, attn_out=attn_out, ffn_out=ffn_out)
