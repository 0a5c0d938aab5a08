"""The transformers config of an architecture spec: what rebuilds a GGUF as a transformers model.

A pure function of the spec (``arch/spec.py``), read by the transformers engine
(``engines/hf.py``, which runs transformers' modeling code on the rebuilt weights) and by the
checkpoint export (``arch/export.py``, which vLLM and transformers load). Its field names are
transformers' (``Glm4MoeConfig``, ``DeepseekV3Config``, ``GlmMoeDsaConfig``, ``Gemma3TextConfig``,
``GptOssConfig``, ...); ``tests/arch/test_spec.py`` holds the spec to the config of every tiny
converted model, the reverse direction.
"""

from __future__ import annotations

from typing import Any

from ggufcheck.arch.families import FAMILIES
from ggufcheck.errors import Unavailable

# GGUF arch -> transformers model_type
MODEL_TYPES = {a: f.hf_model_type for a, f in FAMILIES.items()}  # arch/families.py


def _rope_parameters(spec: Any) -> dict[str, Any]:
    rope = spec.rope
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": rope.base}
    if rope.partial:
        params["partial_rotary_factor"] = rope.n_rot / rope.head_dim
    if rope.yarn:
        params.update(rope_type="yarn", factor=rope.factor, original_max_position_embeddings=rope.original_context,
                      beta_fast=rope.beta_fast, beta_slow=rope.beta_slow)
        if spec.mla is not None:  # DeepSeek's mscale / mscale_all_dim; the others: transformers' default
            params.update(mscale=1.0, mscale_all_dim=rope.mscale_all_dim)  # attention factor 1 + 0.1 ln F
    elif rope.scaling == "linear":
        params.update(rope_type="linear", factor=rope.factor)
    elif rope.scaling not in (None, "none"):
        raise Unavailable(f"rope scaling {rope.scaling!r} is not mapped to a transformers config yet")
    return params


def _gemma3_config(spec: Any) -> dict[str, Any]:
    """Gemma3TextConfig's own fields: per-layer attention types, the local rope, the q scale."""
    global_rope = _rope_parameters(spec)
    if spec.rope.scaling == "linear":
        global_rope = {"rope_type": "linear", "rope_theta": spec.rope.base, "factor": spec.rope.factor}
    swa = spec.swa
    layer_types = ["sliding_attention" if swa is not None and swa.is_swa(i) else "full_attention"
                   for i in range(spec.n_layer)]
    local_base = swa.rope_base if swa is not None else spec.rope.base
    return dict(
        layer_types=layer_types, sliding_window=swa.window if swa is not None else spec.context_length or 4096,
        rope_parameters={"full_attention": global_rope,
                         "sliding_attention": {"rope_type": "default", "rope_theta": local_base}},
        query_pre_attn_scalar=round(1.0 / spec.kq_scale**2), hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=spec.final_softcap or None, attn_logit_softcapping=None,
        head_dim=spec.head_dim_k, use_bidirectional_attention=False,
    )


def hf_config(spec: Any) -> dict[str, Any]:
    """transformers config kwargs for an ArchSpec (every family ggufcheck has a table for)."""
    if spec.arch not in MODEL_TYPES:
        raise Unavailable(f"no transformers config builder for {spec.arch!r} (have: {', '.join(MODEL_TYPES)})")
    cfg: dict[str, Any] = dict(
        vocab_size=spec.n_vocab, hidden_size=spec.n_embd, intermediate_size=spec.n_ff or 1,
        num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head, rms_norm_eps=spec.rms_eps,
        max_position_embeddings=spec.context_length or 4096, tie_word_embeddings=bool(spec.tied_output),
        rope_parameters=_rope_parameters(spec),
    )
    if spec.mla is None:
        cfg.update(num_key_value_heads=spec.n_head_kv, head_dim=spec.head_dim_k)
    else:
        mla = spec.mla
        cfg.update(num_key_value_heads=spec.n_head, kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank,
                   qk_rope_head_dim=mla.qk_rope, qk_nope_head_dim=mla.qk_nope, v_head_dim=mla.v_head)
    if spec.moe is not None:
        moe = spec.moe
        if spec.arch == "deepseek2" and moe.gating.value != "sigmoid":
            raise Unavailable("transformers' deepseek_v3 routes with sigmoid; this file's router is softmax (V2)")
        cfg.update(n_routed_experts=moe.n_expert, num_experts_per_tok=moe.n_used, n_shared_experts=moe.n_shared,
                   moe_intermediate_size=moe.expert_ff, first_k_dense_replace=moe.leading_dense,
                   norm_topk_prob=moe.weights_norm, routed_scaling_factor=moe.weights_scale,
                   n_group=moe.n_group, topk_group=moe.n_group_used)
    if spec.arch == "phi3":
        # Phi3Config defaults its special ids to 32000+ (outside small vocabularies): ggufcheck tokenizes itself
        cfg.update(sliding_window=spec.swa.window if spec.swa is not None else None, pad_token_id=None,
                   bos_token_id=None, eos_token_id=None)
    if spec.arch == "gpt-oss":  # GptOssConfig's own names
        moe, swa = spec.moe, spec.swa
        cfg.update(num_local_experts=moe.n_expert, num_experts_per_tok=moe.n_used, intermediate_size=moe.expert_ff,
                   attention_bias=True, sliding_window=swa.window if swa is not None else None,
                   layer_types=["sliding_attention" if swa is not None and swa.is_swa(i) else "full_attention"
                                for i in range(spec.n_layer)])
    if spec.arch == "qwen3moe":  # Qwen3MoeConfig's own names; every layer sparse
        moe = spec.moe
        cfg.update(num_experts=moe.n_expert, num_experts_per_tok=moe.n_used, moe_intermediate_size=moe.expert_ff,
                   norm_topk_prob=moe.weights_norm, decoder_sparse_step=1, mlp_only_layers=[])
    if spec.arch in ("deepseek2", "glm4moe", "glm-dsa"):
        cfg["num_nextn_predict_layers"] = 0
    if spec.arch == "glm4moe":
        cfg["attention_bias"] = True
        cfg["use_qk_norm"] = True
    if FAMILIES[spec.arch].gemma:
        cfg.update(_gemma3_config(spec))
    if spec.indexer is not None:
        idx = spec.indexer
        cfg.update(index_topk=idx.top_k, index_head_dim=idx.head_dim, index_n_heads=idx.n_head,
                   indexer_types=["full" if f else "shared" for f in idx.full[:spec.n_layer]])
    return cfg
