"""Metadata of real large models, as llama.cpp's converter writes it, without the 400 GB files.

The sharding checks plan TP 8 / 16 for GLM-5 and DeepSeek-V3, and tests check derived
numbers (kq_scale, YaRN correction dims) against ``docs/architectures.md``; both
need the real dimensions. Each function returns a fresh metadata dict with exactly the
keys the converter writes for that model (conversion/deepseek.py DeepseekV2Model and
conversion/glm.py GlmMoeDsaModel in llama.cpp), built from the numbers in
docs/architectures.md sec 3 and 5. Feed it to :func:`ggufcheck.arch.spec.spec_from_metadata`.
"""

from __future__ import annotations

from typing import Any, Callable

from ggufcheck.arch.spec import ArchSpec, spec_from_metadata


def _mla_keys(arch: str, *, n_embd: int, n_block: int, n_head: int, q_lora: int,
              kv_lora: int, nope: int, rope: int, v_head: int, n_ff: int, vocab: int,
              eps: float, context: int, base: float) -> dict[str, Any]:
    p = f"{arch}."
    return {
        "general.architecture": arch,
        p + "context_length": context,
        p + "embedding_length": n_embd,
        p + "block_count": n_block,
        p + "feed_forward_length": n_ff,
        p + "vocab_size": vocab,
        p + "attention.head_count": n_head,
        p + "attention.head_count_kv": 1,  # MLA stored as MQA
        p + "attention.layer_norm_rms_epsilon": eps,
        p + "attention.q_lora_rank": q_lora,
        p + "attention.kv_lora_rank": kv_lora,
        p + "attention.key_length": kv_lora + rope,  # MQA view: L + R
        p + "attention.value_length": kv_lora,  # MQA view: L
        p + "attention.key_length_mla": nope + rope,  # P + R
        p + "attention.value_length_mla": v_head,  # V
        p + "rope.dimension_count": rope,
        p + "rope.freq_base": base,
    }


def _moe_keys(arch: str, *, n_expert: int, n_used: int, n_shared: int, expert_ff: int,
              dense: int, scale: float, n_group: int, n_group_used: int) -> dict[str, Any]:
    p = f"{arch}."
    return {
        p + "expert_count": n_expert,
        p + "expert_used_count": n_used,
        p + "expert_shared_count": n_shared,
        p + "expert_feed_forward_length": expert_ff,
        p + "leading_dense_block_count": dense,
        p + "expert_weights_scale": scale,
        p + "expert_weights_norm": True,
        p + "expert_group_count": n_group,
        p + "expert_group_used_count": n_group_used,
    }


def deepseek_v3_metadata() -> dict[str, Any]:
    """DeepSeek-V3 (671B): 61 layers (the converter drops the MTP layer), YaRN factor 40."""
    arch = "deepseek2"
    meta = _mla_keys(arch, n_embd=7168, n_block=61, n_head=128, q_lora=1536, kv_lora=512,
                     nope=128, rope=64, v_head=128, n_ff=18432, vocab=129280, eps=1e-6,
                     context=163840, base=10000.0)
    meta.update(_moe_keys(arch, n_expert=256, n_used=8, n_shared=1, expert_ff=2048, dense=3,
                          scale=2.5, n_group=8, n_group_used=4))
    meta.update({
        f"{arch}.expert_gating_func": 2,  # sigmoid
        f"{arch}.rope.scaling.type": "yarn",
        f"{arch}.rope.scaling.factor": 40.0,
        f"{arch}.rope.scaling.original_context_length": 4096,
        f"{arch}.rope.scaling.yarn_beta_fast": 32.0,
        f"{arch}.rope.scaling.yarn_beta_slow": 1.0,
        f"{arch}.rope.scaling.yarn_log_multiplier": 0.1,  # 0.1 * mscale_all_dim (= 1)
    })
    return meta


def kimi_k2_metadata() -> dict[str, Any]:
    """Kimi-K2 (1T): DeepSeek-V3's architecture with 64 heads, 384 experts, one leading dense
    layer, no expert groups, routed scale 2.827, rope base 50000 and YaRN factor 32 over 4096
    (its config.json: n_routed_experts 384, first_k_dense_replace 1, vocab 163840)."""
    arch = "deepseek2"
    meta = _mla_keys(arch, n_embd=7168, n_block=61, n_head=64, q_lora=1536, kv_lora=512,
                     nope=128, rope=64, v_head=128, n_ff=18432, vocab=163840, eps=1e-6,
                     context=131072, base=50000.0)
    meta.update(_moe_keys(arch, n_expert=384, n_used=8, n_shared=1, expert_ff=2048, dense=1,
                          scale=2.827, n_group=1, n_group_used=1))
    meta.update({
        f"{arch}.expert_gating_func": 2,  # sigmoid
        f"{arch}.rope.scaling.type": "yarn",
        f"{arch}.rope.scaling.factor": 32.0,
        f"{arch}.rope.scaling.original_context_length": 4096,
        f"{arch}.rope.scaling.yarn_beta_fast": 1.0,
        f"{arch}.rope.scaling.yarn_beta_slow": 1.0,
        f"{arch}.rope.scaling.yarn_log_multiplier": 0.1,
    })
    return meta


def glm5_metadata() -> dict[str, Any]:
    """GLM-5 (744B): 78 layers + 1 NextN, DSA indexer on every layer (no types key)."""
    arch = "glm-dsa"
    meta = _mla_keys(arch, n_embd=6144, n_block=79, n_head=64, q_lora=2048, kv_lora=512,
                     nope=192, rope=64, v_head=256, n_ff=12288, vocab=154880, eps=1e-5,
                     context=202752, base=1e6)
    meta.update(_moe_keys(arch, n_expert=256, n_used=8, n_shared=1, expert_ff=2048, dense=3,
                          scale=2.5, n_group=1, n_group_used=1))
    meta.update({
        f"{arch}.nextn_predict_layers": 1,
        f"{arch}.attention.indexer.head_count": 32,
        f"{arch}.attention.indexer.key_length": 128,
        f"{arch}.attention.indexer.top_k": 2048,
    })
    return meta


def glm5_2_metadata() -> dict[str, Any]:
    """GLM-5.2: as GLM-5 with rope base 8e6 and a 2^20 context, so llama.cpp's default
    indexer pattern applies (full where ``max(i - 2, 0) % 4 == 0``) without a types key."""
    meta = glm5_metadata()
    meta["glm-dsa.rope.freq_base"] = 8e6
    meta["glm-dsa.context_length"] = 1 << 20
    return meta


KNOWN: dict[str, Callable[[], dict[str, Any]]] = {
    "deepseek-v3": deepseek_v3_metadata,
    "glm-5": glm5_metadata,
    "glm-5.2": glm5_2_metadata,
    "kimi-k2": kimi_k2_metadata,
}


def known_spec(name: str) -> ArchSpec:
    """The spec of a known model by name (``deepseek-v3``, ``glm-5``, ``glm-5.2``, ``kimi-k2``)."""
    spec = spec_from_metadata(KNOWN[name]())
    assert isinstance(spec, ArchSpec)
    return spec
