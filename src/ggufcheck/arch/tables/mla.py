"""Tensor tables of the MLA families: deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2, GLM-4.7-Flash)
and glm-dsa (GLM-5: deepseek2's MLA and MoE plus the DSA indexer).

Sources: llama.cpp conversion/deepseek.py DeepseekV2Model (kv_b_proj split into attn_k_b
[H, L, P] and attn_v_b [H, V, L], no q/k permutation, experts stacked),
conversion/glm.py GlmMoeDsaModel (indexer keys, NextN appended), src/models/deepseek2.cpp
(attn_q without q_lora; legacy attn_kv_b when the *_length_mla keys are absent;
ffn_gate_up_exps alternative), src/models/glm-dsa.cpp (indexer tensors, absent on shared
layers); transformers 5.24 modeling_deepseek_v3.py and modeling_glm_moe_dsa.py.
"""

from __future__ import annotations

from ggufcheck.arch.table import Row, Shard, ShardKind, TensorTable
from ggufcheck.arch.tables.common import DENSE_FFN, GLOBAL, NEXTN, ROPE_FREQS, L, moe_rows, row

A = L + "self_attn."
_HEAD = Shard(ShardKind.COLUMN, 0, unit="1", note="whole heads per rank")
_KV_B = Shard(ShardKind.COLUMN, 0, unit="P+V",
              note="head-major, K rows then V rows per head: rank r takes heads [r*H/tp, (r+1)*H/tp)")

MLA_ATTENTION: tuple[Row, ...] = (
    row("blk.{i}.attn_norm.weight", "D", L + "input_layernorm.weight", src="constants.py ATTN_NORM"),
    row("blk.{i}.attn_q_a.weight", "q_lora, D", A + "q_a_proj.weight", when="q_lora",
        src="constants.py ATTN_Q_A; replicated in vLLM (fused with kv_a, disable_tp)"),
    row("blk.{i}.attn_q_a_norm.weight", "q_lora", A + "q_a_layernorm.weight", when="q_lora",
        src="constants.py ATTN_Q_A_NORM"),
    row("blk.{i}.attn_q_b.weight", "H*(P+R), q_lora", A + "q_b_proj.weight",
        Shard(ShardKind.COLUMN, 0, unit="P+R"), when="q_lora",
        src="constants.py ATTN_Q_B; per head [nope P, rope R]"),
    row("blk.{i}.attn_q.weight", "H*(P+R), D", A + "q_proj.weight",
        Shard(ShardKind.COLUMN, 0, unit="P+R"), when="no_q_lora",
        src="deepseek2.cpp: wq when q_lora_rank == 0 (DeepSeek-V2-Lite)"),
    row("blk.{i}.attn_kv_a_mqa.weight", "L+R, D", A + "kv_a_proj_with_mqa.weight",
        src="constants.py ATTN_KV_A_MQA; [latent L, k_pe R]"),
    row("blk.{i}.attn_kv_a_norm.weight", "L", A + "kv_a_layernorm.weight",
        src="constants.py ATTN_KV_A_NORM"),
    row("blk.{i}.attn_k_b.weight", "H, L, P", A + "kv_b_proj.weight", _HEAD, transform="kv_b",
        role="k_b", when="split_kv_b", src="conversion/deepseek.py: k_b = kv_b.view(H, P+V, L)[:, :P].T"),
    row("blk.{i}.attn_v_b.weight", "H, V, L", A + "kv_b_proj.weight", _HEAD, transform="kv_b",
        role="v_b", when="split_kv_b", src="conversion/deepseek.py: v_b = kv_b.view(H, P+V, L)[:, P:]"),
    row("blk.{i}.attn_kv_b.weight", "H*(P+V), L", A + "kv_b_proj.weight", _KV_B,
        when="legacy_kv_b", src="deepseek2.cpp: legacy files (no key_length_mla) keep wkv_b"),
    row("blk.{i}.attn_output.weight", "D, H*V", A + "o_proj.weight",
        Shard(ShardKind.ROW, 1, unit="V"), src="constants.py ATTN_OUT"),
    row("blk.{i}.ffn_norm.weight", "D", L + "post_attention_layernorm.weight",
        src="the pre-FFN norm: transformers post_attention_layernorm"),
)

_I = A + "indexer."
# glm-dsa.cpp loads these TENSOR_NOT_REQUIRED and uses them only on full layers; HF keeps
# weights_proj in fp32 (modeling_glm_moe_dsa.py GlmMoeDsaIndexer); vLLM replicates them.
INDEXER: tuple[Row, ...] = (
    row("blk.{i}.indexer.attn_q_b.weight", "Hi*Di, q_lora", _I + "wq_b.weight", part="indexer",
        src="constants.py INDEXER_ATTN_Q_B; per head [rope, nope]"),
    row("blk.{i}.indexer.attn_k.weight", "Di, D", _I + "wk.weight", part="indexer",
        src="constants.py INDEXER_ATTN_K"),
    row("blk.{i}.indexer.k_norm.weight", "Di", _I + "k_norm.weight", part="indexer",
        src="constants.py INDEXER_K_NORM (LayerNorm weight)"),
    row("blk.{i}.indexer.k_norm.bias", "Di", _I + "k_norm.bias", part="indexer",
        src="constants.py INDEXER_K_NORM (LayerNorm bias)"),
    row("blk.{i}.indexer.proj.weight", "Hi, D", _I + "weights_proj.weight", part="indexer",
        src="constants.py INDEXER_PROJ"),
)

DEEPSEEK2 = TensorTable("deepseek2", GLOBAL + (ROPE_FREQS,) + MLA_ATTENTION + DENSE_FFN
                        + moe_rows(probs_b_required=False, fused_gate_up=True) + NEXTN,
                        source="conversion/deepseek.py DeepseekV2Model; src/models/deepseek2.cpp; "
                               "modeling_deepseek_v3.py")
GLM_DSA = TensorTable("glm-dsa", GLOBAL + (ROPE_FREQS,) + MLA_ATTENTION + INDEXER + DENSE_FFN
                      + moe_rows(probs_b_required=False, fused_gate_up=False) + NEXTN,
                      source="conversion/glm.py GlmMoeDsaModel; src/models/glm-dsa.cpp; "
                             "modeling_glm_moe_dsa.py")
