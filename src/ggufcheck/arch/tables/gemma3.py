"""Tensor table of gemma3 (text): GQA attention with per-head q/k norms and Gemma's
sandwich norms, a GeGLU FFN.

Sources: llama.cpp conversion/gemma.py Gemma3Model (no q/k permutation; every ``*norm.weight``
is stored as ``1 + w``: Gemma3RMSNorm multiplies by ``1 + weight``), loader
src/models/gemma3.cpp (attn_post_norm, ffn_post_norm; output optional, tied to token_embd);
transformers 5.25 modeling_gemma3.py (Gemma3DecoderLayer: input_layernorm,
post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm;
Gemma3Attention q_norm / k_norm over head_dim).
"""

from __future__ import annotations

from dataclasses import replace

from ggufcheck.arch.table import HF, TensorTable
from ggufcheck.arch.tables.common import DENSE_FFN, GLOBAL, L, row  # Gemma3MLP: gate / up / down_proj
from ggufcheck.arch.tables.dense import gqa_attention

_NORM = "gemma_norm"  # GGUF holds 1 + w (arch/transforms.py)


def _gemma_norms(rows):
    """The rows with every norm weight stored as 1 + w (conversion/gemma.py norm_shift)."""
    return tuple(replace(r, hf=HF(r.hf.name, _NORM), source=r.source + "; GGUF stores 1 + w (norm_shift)")
                 if r.gguf.endswith("norm.weight") and r.hf is not None else r for r in rows)


_ATTENTION = tuple(r for r in gqa_attention(permute=False, bias="none", qk_norm="required")
                   if not r.gguf.endswith("ffn_norm.weight"))

GEMMA3 = TensorTable("gemma3", _gemma_norms(GLOBAL + _ATTENTION + (
    row("blk.{i}.post_attention_norm.weight", "D", L + "post_attention_layernorm.weight",
        src="constants.py ATTN_POST_NORM; gemma3.cpp attn_post_norm on the attention output"),
    row("blk.{i}.ffn_norm.weight", "D", L + "pre_feedforward_layernorm.weight",
        src="constants.py FFN_NORM; transformers pre_feedforward_layernorm"),
    row("blk.{i}.post_ffw_norm.weight", "D", L + "post_feedforward_layernorm.weight",
        src="constants.py FFN_POST_NORM; gemma3.cpp ffn_post_norm on the FFN output"),
) + DENSE_FFN), source="conversion/gemma.py Gemma3Model; src/models/gemma3.cpp; modeling_gemma3.py")
