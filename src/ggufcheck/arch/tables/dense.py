"""Tensor tables of the GQA families: llama, qwen2, qwen3 (and the attention of glm4moe).

Sources: llama.cpp conversion/llama.py (LlamaModel.permute on q/k weights and biases),
conversion/qwen.py (no permutation), loaders src/models/llama.cpp, qwen2.cpp, qwen3.cpp
(create_tensor_qkv: q/k/v biases TENSOR_NOT_REQUIRED); transformers 5.24
modeling_llama.py / modeling_qwen2.py / modeling_qwen3.py (LlamaAttention q_proj ... o_proj,
Qwen2Attention bias=True on q/k/v, Qwen3Attention q_norm / k_norm over head_dim).
"""

from __future__ import annotations

from ggufcheck.arch.table import Row, Shard, ShardKind, TensorTable
from ggufcheck.arch.tables.common import DENSE_FFN, GLOBAL, L, ROPE_FREQS, row

A = L + "self_attn."
_Q = Shard(ShardKind.COLUMN, 0, unit="hd")
_KV = Shard(ShardKind.COLUMN, 0, unit="hd", note="vLLM replicates kv heads when TP > Hkv")
_VV = Shard(ShardKind.COLUMN, 0, unit="hdv", note="vLLM replicates kv heads when TP > Hkv")
_O = Shard(ShardKind.ROW, 1, unit="hdv")


def gqa_attention(*, permute: bool, bias: str, qk_norm: str, out_bias: bool = False,
                  ffn_norm: str = "ffn_norm") -> tuple[Row, ...]:
    """Attention rows. ``bias`` / ``qk_norm``: "required", "optional" or "none"."""
    q_t, k_t = ("llama_q", "llama_k") if permute else ("identity", "identity")
    rows = [
        row("blk.{i}.attn_norm.weight", "D", L + "input_layernorm.weight",
            src="constants.py ATTN_NORM; transformers *DecoderLayer.input_layernorm"),
        row("blk.{i}.attn_q.weight", "H*hd, D", A + "q_proj.weight", _Q, transform=q_t,
            src="constants.py ATTN_Q" + ("; conversion/llama.py permute(n_head)" if permute else "")),
        row("blk.{i}.attn_k.weight", "Hkv*hd, D", A + "k_proj.weight", _KV, transform=k_t,
            src="constants.py ATTN_K" + ("; conversion/llama.py permute(n_head_kv)" if permute else "")),
        row("blk.{i}.attn_v.weight", "Hkv*hdv, D", A + "v_proj.weight", _VV,
            src="constants.py ATTN_V"),
        row("blk.{i}.attn_output.weight", "D, H*hdv", A + "o_proj.weight", _O,
            src="constants.py ATTN_OUT; transformers o_proj"),
    ]
    if bias != "none":
        need = bias == "required"
        rows += [
            row("blk.{i}.attn_q.bias", "H*hd", A + "q_proj.bias", _Q, transform=q_t, required=need,
                src="create_tensor_qkv; conversion/llama.py permutes q_proj.bias too"),
            row("blk.{i}.attn_k.bias", "Hkv*hd", A + "k_proj.bias", _KV, transform=k_t,
                required=need, src="create_tensor_qkv"),
            row("blk.{i}.attn_v.bias", "Hkv*hdv", A + "v_proj.bias", _VV, required=need,
                src="create_tensor_qkv"),
        ]
    if out_bias:
        rows.append(row("blk.{i}.attn_output.bias", "D", A + "o_proj.bias", required=False,
                        src="src/models/llama.cpp wo_b TENSOR_NOT_REQUIRED (added once after the all-reduce)"))
    if qk_norm != "none":
        need = qk_norm == "required"
        rows += [
            row("blk.{i}.attn_q_norm.weight", "hd", A + "q_norm.weight", required=need,
                src="constants.py ATTN_Q_NORM; transformers q_norm (RMSNorm over head_dim)"),
            row("blk.{i}.attn_k_norm.weight", "hd", A + "k_norm.weight", required=need,
                src="constants.py ATTN_K_NORM; transformers k_norm"),
        ]
    rows.append(row(f"blk.{{i}}.{ffn_norm}.weight", "D", L + "post_attention_layernorm.weight",
                    src="the pre-FFN norm: transformers post_attention_layernorm"))
    return tuple(rows)


LLAMA = TensorTable("llama", GLOBAL + (ROPE_FREQS,) + gqa_attention(
    permute=True, bias="optional", qk_norm="none", out_bias=True) + DENSE_FFN,
    source="conversion/llama.py LlamaModel; src/models/llama.cpp; modeling_llama.py")
QWEN2 = TensorTable("qwen2", GLOBAL + gqa_attention(
    permute=False, bias="required", qk_norm="none") + DENSE_FFN,
    source="conversion/qwen.py Qwen2Model; src/models/qwen2.cpp; modeling_qwen2.py")
QWEN3 = TensorTable("qwen3", GLOBAL + gqa_attention(
    permute=False, bias="optional", qk_norm="required") + DENSE_FFN,
    source="conversion/qwen.py Qwen3Model; src/models/qwen3.cpp; modeling_qwen3.py")
