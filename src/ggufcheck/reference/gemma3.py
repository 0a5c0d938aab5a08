"""gemma3 decoder layers (docs/architectures.md sec 8).

The dense family's GQA block (per-head q/k RMSNorm before NEOX rope) with Gemma's
differences, each as llama.cpp's src/models/gemma3.cpp and transformers'
modeling_gemma3.py compute them:

- sandwich norms: ``attn_norm`` before attention and ``post_attention_norm`` on its output
  before the residual add; ``ffn_norm`` before the FFN and ``post_ffw_norm`` after it (in
  ``layers.ffn_block``). The GGUF norm weights already hold Gemma's ``1 + w`` (the converter
  adds 1), so every norm here is a plain RMSNorm.
- GeGLU FFN (tanh GELU), ``cfg.ffn_act``;
- sliding-window layers (``cfg.swa_layers``) see only the last ``cfg.swa_window`` positions
  and rotate with ``cfg.rope_base_swa`` (the model picks the rope per layer);
- the embedding scale sqrt(D) and the final soft-cap are applied by the model (model.py).

``attn_out`` / ``ffn_out`` are what each block adds to the residual (after its post-norm),
so ``hidden = h + attn_out + ffn_out`` holds as in every family.
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
    """One gemma3 decoder layer on the residual stream h [T, D]."""
    attn = self_attention(cfg, w, rms_norm(h, w["attn_norm.weight"], cfg.rms_eps), rope, q_pos, k_pos, cache,
                          window=cfg.attention_window(i))
    attn_out = rms_norm(attn, w["post_attention_norm.weight"], cfg.rms_eps)
    after_attn = h + attn_out
    ffn_out = ffn_block(cfg, w, rms_norm(after_attn, w["ffn_norm.weight"], cfg.rms_eps), False).out
    return LayerOutput(hidden=after_attn + ffn_out, after_attn=after_attn, attn_out=attn_out, ffn_out=ffn_out)
