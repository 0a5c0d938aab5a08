"""Tensor tables of the GQA + MoE families: glm4moe (GLM-4.5 / 4.6 / 4.7: GQA attention + MoE
+ NextN) and qwen3moe (Qwen3 MoE: qwen3's attention, every layer MoE, no shared expert).

Sources: llama.cpp conversion/glm.py Glm4MoeModel (no q/k permutation: NEOX already;
experts stacked; NextN layers appended to block_count), src/models/glm4-moe.cpp (q/k norm
TENSOR_NOT_REQUIRED for GLM-4.5 355B; exp_probs_b required; post_attention_norm is the
pre-FFN norm); transformers 5.24 modeling_glm4_moe.py (attention_bias on q/k/v, use_qk_norm).
qwen3moe: conversion/qwen.py Qwen3MoeModel (experts stacked), src/models/qwen3moe.cpp (q/k
norms required, ffn_norm before the MoE, no exp_probs_b, no shared expert);
modeling_qwen3_moe.py (mlp.gate router, fused experts.gate_up_proj).
"""

from __future__ import annotations

from ggufcheck.arch.table import TensorTable
from ggufcheck.arch.tables.common import DENSE_FFN, GLOBAL, NEXTN, moe_rows
from ggufcheck.arch.tables.dense import gqa_attention

GLM4MOE = TensorTable("glm4moe", GLOBAL + gqa_attention(
    permute=False, bias="optional", qk_norm="optional", ffn_norm="post_attention_norm")
    + DENSE_FFN + moe_rows(probs_b_required=True, fused_gate_up=False) + NEXTN,
    source="conversion/glm.py Glm4MoeModel; src/models/glm4-moe.cpp; modeling_glm4_moe.py")

QWEN3MOE = TensorTable("qwen3moe", GLOBAL + gqa_attention(
    permute=False, bias="optional", qk_norm="required")
    + DENSE_FFN + moe_rows(probs_b_required=False, fused_gate_up=False),
    source="conversion/qwen.py Qwen3MoeModel; src/models/qwen3moe.cpp; modeling_qwen3_moe.py")
