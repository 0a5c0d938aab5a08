"""Tensor table of gpt-oss (OpenAI gpt-oss-20b / 120b): GQA attention with q/k/v/o biases and
per-head attention sinks, then MoE in every layer: a router with a bias, experts with
biases and the clamped SwiGLU, no shared expert.

Sources: llama.cpp conversion/gpt_oss.py GptOssModel (gate_up_proj split into its even
[gate] and odd [up] columns and transposed; ``sinks`` -> ``attn_sinks.weight``; MXFP4 expert
blocks repacked as ggml MXFP4), loader src/models/openai-moe.cpp (every tensor required,
``attn_post_norm`` = the pre-MoE norm ``post_attention_norm``); transformers 5.25
modeling_gpt_oss.py (GptOssExperts gate_up_proj [E, D, 2F] and down_proj [E, F, D] as
parameters, GptOssTopKRouter weight / bias, GptOssAttention sinks).
"""

from __future__ import annotations

from ggufcheck.arch.table import Shard, ShardKind, TensorTable
from ggufcheck.arch.tables.common import GLOBAL, L, row
from ggufcheck.arch.tables.dense import gqa_attention

_X = L + "mlp.experts."
_EXP_COL = Shard(ShardKind.COLUMN, 1, experts=True, note="TP splits the expert FF dim; EP dim 0")
_EXP_ROW = Shard(ShardKind.ROW, 2, experts=True, note="TP splits the expert FF dim; EP dim 0")
_EXP_BIAS = Shard(ShardKind.COLUMN, 1, experts=True, note="split with its expert's FF rows")
_HEADS = Shard(ShardKind.COLUMN, 0, note="one sink per query head: split with the heads")

GPT_OSS = TensorTable("gpt-oss", GLOBAL + gqa_attention(
    permute=False, bias="required", qk_norm="none", out_bias=True, ffn_norm="post_attention_norm") + (
    row("blk.{i}.attn_sinks.weight", "H", L + "self_attn.sinks", _HEADS,
        src="constants.py ATTN_SINKS; conversion/gpt_oss.py 'sinks' + '.weight'; GptOssAttention.sinks"),
    row("blk.{i}.ffn_gate_inp.weight", "E, D", L + "mlp.router.weight", part="moe",
        src="constants.py FFN_GATE_INP; GptOssTopKRouter.weight"),
    row("blk.{i}.ffn_gate_inp.bias", "E", L + "mlp.router.bias", part="moe",
        src="openai-moe.cpp ffn_gate_inp_b; GptOssTopKRouter.bias (added before the top-k)"),
    row("blk.{i}.ffn_gate_exps.weight", "E, Fe, D", _X + "gate_up_proj", _EXP_COL, "moe", transform="oai_gate_up",
        role="gate", src="conversion/gpt_oss.py gate_up_proj[:, ::2] transposed; GptOssExperts.gate_up_proj"),
    row("blk.{i}.ffn_up_exps.weight", "E, Fe, D", _X + "gate_up_proj", _EXP_COL, "moe", transform="oai_gate_up",
        role="up", src="conversion/gpt_oss.py gate_up_proj[:, 1::2] transposed"),
    row("blk.{i}.ffn_down_exps.weight", "E, D, Fe", _X + "down_proj", _EXP_ROW, "moe",
        transform="transpose_experts", src="conversion/gpt_oss.py down_proj transposed; GptOssExperts.down_proj"),
    row("blk.{i}.ffn_gate_exps.bias", "E, Fe", _X + "gate_up_proj_bias", _EXP_BIAS, "moe",
        transform="oai_gate_up_bias", role="gate", src="conversion/gpt_oss.py gate_up_proj_bias[..., ::2]"),
    row("blk.{i}.ffn_up_exps.bias", "E, Fe", _X + "gate_up_proj_bias", _EXP_BIAS, "moe",
        transform="oai_gate_up_bias", role="up", src="conversion/gpt_oss.py gate_up_proj_bias[..., 1::2]"),
    row("blk.{i}.ffn_down_exps.bias", "E, D", _X + "down_proj_bias", part="moe",
        src="conversion/gpt_oss.py down_proj_bias; added once after the experts' sum per rank 0"),
), source="conversion/gpt_oss.py GptOssModel; src/models/openai-moe.cpp; modeling_gpt_oss.py")
