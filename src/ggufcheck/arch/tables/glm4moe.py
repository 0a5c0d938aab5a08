"""Tensor table of glm4moe (GLM-4.5 / 4.6 / 4.7): GQA attention + MoE + NextN.

Sources: llama.cpp conversion/glm.py Glm4MoeModel (no q/k permutation: NEOX already;
experts stacked; NextN layers appended to block_count), src/models/glm4-moe.cpp (q/k norm
TENSOR_NOT_REQUIRED for GLM-4.5 355B; exp_probs_b required; post_attention_norm is the
pre-FFN norm); transformers 5.24 modeling_glm4_moe.py (attention_bias on q/k/v, use_qk_norm).
"""

from __future__ import annotations

from ggufcheck.arch.table import TensorTable
from ggufcheck.arch.tables.common import DENSE_FFN, GLOBAL, NEXTN, moe_rows
from ggufcheck.arch.tables.dense import gqa_attention

GLM4MOE = TensorTable("glm4moe", GLOBAL + gqa_attention(
    permute=False, bias="optional", qk_norm="optional", ffn_norm="post_attention_norm")
    + DENSE_FFN + moe_rows(probs_b_required=True, fused_gate_up=False) + NEXTN,
    source="conversion/glm.py Glm4MoeModel; src/models/glm4-moe.cpp; modeling_glm4_moe.py")
