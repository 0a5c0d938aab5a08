"""Every architecture ggufcheck can diagnose, declared once.

A family is what the rest of the code needs to know about a GGUF ``general.architecture``
before reading its keys: which attention (GQA or MLA), MoE or not, a DSA indexer, NextN
layers counted in ``block_count``, the main rope pairing, the router's gating when the file
does not say, the reference module that runs it, its tensor table, and the transformers
``model_type`` that rebuilds it. The metadata rules (``arch/spec.py``), the tensor tables
(``arch/tables/``), the reference (``reference/config.py``), the transformers config
(``arch/hf_config.py``) and the tiny-model builders (``synthetic/``, ``testing/``) read these
records instead of keeping their own lists, and ``tests/arch/test_families.py`` walks the registry so that a
family cannot be half-added: each one needs its table rows, reference module, tiny builder
dimensions, converter config and fault coverage.

Facts: docs/architectures.md sec 2 (rope pairing), sec 3-6 and 8 (families); gating defaults are
llama.cpp's (src/models/deepseek2.cpp: softmax, for old V2 files; glm4-moe.cpp and
glm-dsa.cpp: sigmoid; qwen3moe.cpp: softmax, weights always renormalized).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    arch: str  # general.architecture
    reference: str  # the module ggufcheck.reference.<reference> with forward_layer
    table: str  # "module:NAME" of its TensorTable under ggufcheck.arch.tables
    hf_model_type: str  # transformers' config model_type
    rope: str  # main rope pairing: "norm" (interleaved) or "neox"
    mla: bool = False  # Multi-head Latent Attention (else GQA)
    moe: bool = False
    indexer: bool = False  # DeepSeek Sparse Attention indexer
    nextn: bool = False  # block_count includes nextn_predict_layers NextN / MTP layers
    gating: str | None = None  # MoE gating when expert_gating_func is absent
    gemma: bool = False  # Gemma 3 layer: sandwich norms, GELU FFN, scaled embeddings, sliding-window layers
    weights_norm: bool | None = None  # MoE: the loader renormalizes the chosen weights whatever the file says
    biased_router: bool = False  # MoE: DeepSeek-V3-style router, exp_probs_b selection bias and routed scaling
    ffn_act: str = "silu"  # the gated FFN / experts' activation: silu, gelu_tanh (gemma), swiglu_oai (gpt-oss)
    # sliding-window layers: llama.cpp's default pattern n (layer i local when i % n < n - 1), and
    # whether they rotate like the global layers (gpt-oss) or with their own unscaled base (gemma3)
    swa_pattern: int = 0
    swa_same_rope: bool = False
    sinks: bool = False  # per-head attention sinks (attn_sinks.weight)


FAMILIES: dict[str, Family] = {f.arch: f for f in (
    Family("llama", "dense", "dense:LLAMA", "llama", rope="norm"),  # on q/k rows the converter permuted
    Family("qwen2", "dense", "dense:QWEN2", "qwen2", rope="neox"),
    Family("qwen3", "dense", "dense:QWEN3", "qwen3", rope="neox"),
    # Phi-3 / Phi-3.5 / Phi-4 (mini): fused attn_qkv and gate_up, NEOX rope
    Family("phi3", "dense", "dense:PHI3", "phi3", rope="neox"),
    Family("gemma3", "gemma3", "gemma3:GEMMA3", "gemma3_text", rope="neox", gemma=True, ffn_act="gelu_tanh",
           swa_pattern=6),
    # llama.cpp openai-moe.cpp: softmax over the chosen logits (= renormalized softmax), the
    # clamped SwiGLU, even layers sliding-window with the global (YaRN) rope
    Family("gpt-oss", "gqa_moe", "gpt_oss:GPT_OSS", "gpt_oss", rope="neox", moe=True, gating="softmax",
           weights_norm=True, ffn_act="swiglu_oai", swa_pattern=2, swa_same_rope=True, sinks=True),
    # llama.cpp qwen3moe.cpp: softmax routing with renormalized weights (norm_w = true) hard-coded
    Family("qwen3moe", "gqa_moe", "glm4moe:QWEN3MOE", "qwen3_moe", rope="neox", moe=True, gating="softmax",
           weights_norm=True),
    Family("glm4moe", "gqa_moe", "glm4moe:GLM4MOE", "glm4_moe", rope="neox", moe=True, nextn=True,
           gating="sigmoid", biased_router=True),
    Family("deepseek2", "mla_moe", "mla:DEEPSEEK2", "deepseek_v3", rope="norm", mla=True, moe=True, nextn=True,
           gating="softmax", biased_router=True),
    Family("glm-dsa", "mla_moe", "mla:GLM_DSA", "glm_moe_dsa", rope="norm", mla=True, moe=True, indexer=True,
           nextn=True, gating="sigmoid", biased_router=True),
)}


def archs(**flags: bool) -> tuple[str, ...]:
    """The architectures whose flags match, e.g. ``archs(mla=True)``; all with no flags."""
    return tuple(a for a, f in FAMILIES.items() if all(getattr(f, k) == v for k, v in flags.items()))


def family(arch: str) -> Family | None:
    return FAMILIES.get(arch)
