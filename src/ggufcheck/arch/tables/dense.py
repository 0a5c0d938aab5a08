"""Tensor tables of the GQA families: llama, qwen2, qwen3, phi3 (and the attention of glm4moe).

Sources: llama.cpp conversion/llama.py (LlamaModel.permute on q/k weights and biases),
conversion/qwen.py (no permutation), loaders src/models/llama.cpp, qwen2.cpp, qwen3.cpp
(create_tensor_qkv: q/k/v biases TENSOR_NOT_REQUIRED); transformers 5.24
modeling_llama.py / modeling_qwen2.py / modeling_qwen3.py (LlamaAttention q_proj ... o_proj,
Qwen2Attention bias=True on q/k/v, Qwen3Attention q_norm / k_norm over head_dim).
"""

from __future__ import annotations

from ggufcheck.arch.table import Row, Shard, ShardKind, TensorTable
from ggufcheck.arch.tables.common import DENSE_FFN, GLOBAL, ROW, L, ROPE_FREQS, row

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

# phi3: q, k and v fused in attn_qkv ([q rows; k rows; v rows], as HF's qkv_proj) and gate and
# up in ffn_up ([gate rows; up rows], as HF's gate_up_proj); LongRoPE factors when present.
# vLLM splits each section of a fused tensor by itself (QKVParallelLinear,
# MergedColumnParallelLinear): a plain split of the whole would mix them.
_FUSED = Shard(ShardKind.COLUMN, 0, unit="1", note="fused sections: vLLM splits q / k / v (gate / up) each")
PHI3 = TensorTable("phi3", GLOBAL + (
    row("blk.{i}.attn_norm.weight", "D", L + "input_layernorm.weight", src="constants.py ATTN_NORM"),
    row("blk.{i}.attn_qkv.weight", "(H+2*Hkv)*hd, D", A + "qkv_proj.weight", _FUSED,
        src="constants.py ATTN_QKV; conversion/phi.py (Phi3's qkv_proj as is); phi3.cpp build_qkv"),
    row("blk.{i}.attn_output.weight", "D, H*hd", A + "o_proj.weight", _O, src="constants.py ATTN_OUT"),
    row("blk.{i}.ffn_norm.weight", "D", L + "post_attention_layernorm.weight",
        src="the pre-FFN norm: transformers post_attention_layernorm"),
    row("blk.{i}.ffn_up.weight", "2*F, D", L + "mlp.gate_up_proj.weight", _FUSED, "dense_ffn",
        src="constants.py FFN_UP; phi3.cpp {n_embd, 2 * n_ff}: LLM_FFN_SWIGLU on [gate; up]; Phi3MLP.gate_up_proj"),
    row("blk.{i}.ffn_down.weight", "D, F", L + "mlp.down_proj.weight", ROW, "dense_ffn",
        src="constants.py FFN_DOWN; Phi3MLP.down_proj"),
    row("rope_factors_long.weight", "n_rot//2", None, part="global", required=False,
        src="phi3.cpp ROPE_FACTORS_LONG (LongRoPE, 128k models), TENSOR_NOT_REQUIRED"),
    row("rope_factors_short.weight", "n_rot//2", None, part="global", required=False,
        src="phi3.cpp ROPE_FACTORS_SHORT, TENSOR_NOT_REQUIRED"),
), source="conversion/phi.py Phi3MiniModel; src/models/phi3.cpp; modeling_phi3.py")
