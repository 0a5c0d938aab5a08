"""The reference model's configuration: one frozen dataclass, built once from GGUF metadata.

Everything the forward pass needs to know about a model is decided here, at exactly one
boundary, with the rules of ``shared/docs/architectures.md`` (defaults, NextN layers,
gating defaults, indexer layer types). Past this file there are no metadata dicts and no
behaviour inferred from a dimension's value.

Two facts the file does not carry are explicit fields with documented defaults, so a
caller (or a test against transformers) can choose them and say so:

- ``lora_norm_eps``: eps of the MLA ``q_a`` / ``kv_a`` RMSNorms. llama.cpp and vLLM use the
  file's RMS eps; transformers' DeepSeek-V3 / GLM-DSA code uses a hard-coded 1e-6. Default:
  the file's eps (what engines that read this file compute).
- ``indexer_norm_eps``: eps of the DSA indexer's key LayerNorm. transformers and DeepSeek's
  code: 1e-6 (default here); llama.cpp's glm-dsa graph uses ``f_norm_eps``, which nothing
  sets for glm-dsa (see docs/reference-verification.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from ggufcheck.errors import BadFileError, Unavailable

# GGUF architecture -> reference family module (reference/<family>.py)
FAMILIES = {
    "llama": "dense",
    "qwen2": "dense",
    "qwen3": "dense",
    "glm4moe": "glm4moe",
    "deepseek2": "mla_moe",
    "glm-dsa": "mla_moe",
}

# RoPE pairing per architecture (architectures.md sec 2). llama: NORM on the converter's
# permuted q/k rows, which is the same as NEOX on the original rows.
ROPE_MODES = {
    "llama": "norm",
    "qwen2": "neox",
    "qwen3": "neox",
    "glm4moe": "neox",
    "deepseek2": "norm",
    "glm-dsa": "norm",
}

# expert_gating_func codes in GGUF (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*)
GATING = {1: "softmax", 2: "sigmoid"}
DEFAULT_GATING = {"deepseek2": "softmax", "glm4moe": "sigmoid", "glm-dsa": "sigmoid"}


@dataclass(frozen=True)
class YarnConfig:
    """YaRN rope scaling (architectures.md sec 2)."""

    factor: float  # F
    original_context: int  # L0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale_all_dim: float = 0.0  # = stored yarn_log_multiplier / 0.1

    @property
    def mscale(self) -> float:
        """Softmax scale multiplier: 1 + 0.1 * mscale_all_dim * ln F (squared in kq_scale)."""
        if self.factor <= 1:
            return 1.0
        return 1.0 + 0.1 * self.mscale_all_dim * math.log(self.factor)


@dataclass(frozen=True)
class ReferenceConfig:
    """What the reference forward pass needs; built by :func:`config_from_gguf`."""

    arch: str
    family: str
    n_layer: int  # layers to run (NextN / MTP layers excluded)
    n_embd: int  # D
    n_vocab: int
    n_head: int  # H
    n_head_kv: int  # Hkv (GQA); 1 for MLA's MQA view (unused by MLA)
    head_dim_k: int  # hd of q.k (GQA); P + R for MLA
    head_dim_v: int  # hd of v (GQA); V for MLA
    rms_eps: float
    # rope
    n_rot: int
    rope_base: float
    rope_mode: str  # "norm" | "neox"
    yarn: YarnConfig | None = None
    has_rope_freqs: bool = False  # rope_freqs.weight: theta_i /= rope_freqs[i]
    # dense ffn / moe
    n_ff: int = 0
    n_dense_lead: int = 0  # layers below this use the dense FFN (MoE models)
    n_expert: int = 0  # E; 0 = a dense model
    n_expert_used: int = 0  # K
    n_expert_shared: int = 0
    n_ff_exp: int = 0
    gating: str = "softmax"  # "softmax" | "sigmoid"
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0
    n_group: int = 1  # G
    n_group_used: int = 1
    # MLA (deepseek2, glm-dsa)
    q_lora_rank: int = 0  # 0: plain attn_q
    kv_lora_rank: int = 0  # L
    qk_nope: int = 0  # P
    qk_rope: int = 0  # R
    v_head: int = 0  # V
    lora_norm_eps: float = 0.0  # see module docstring
    # DSA indexer (glm-dsa)
    indexer_heads: int = 0  # Hi
    indexer_dim: int = 0  # Di
    indexer_top_k: int = 0
    indexer_full: tuple[bool, ...] = ()  # per layer: True = full, False = shared
    indexer_norm_eps: float = 1e-6
    tied_output: bool = False
    # how to compute, not what: MLA "naive" (expand k/v per head) or "absorbed" (attend in
    # the latent space, as engines do); they must agree (a test)
    mla_form: str = "naive"

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def has_indexer(self) -> bool:
        return self.indexer_heads > 0

    @property
    def kq_scale(self) -> float:
        """Softmax scale of q.k: 1/sqrt(head dim of q.k), times mscale^2 under YaRN."""
        scale = 1.0 / math.sqrt(self.head_dim_k)
        if self.yarn is not None:
            scale *= self.yarn.mscale**2
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return self.n_expert > 0 and i >= self.n_dense_lead

    def with_options(self, **changes: Any) -> "ReferenceConfig":
        """A copy with some fields changed (e.g. ``lora_norm_eps=1e-6`` to match transformers)."""
        return replace(self, **changes)


def _need(metadata: Mapping[str, Any], path: str, key: str) -> Any:
    if key not in metadata:
        raise BadFileError(path, f"metadata key {key!r} is missing (the reference needs it)", field=key)
    return metadata[key]


def config_from_gguf(
    metadata: Mapping[str, Any], tensor_names: set[str] | Mapping[str, Any], path: str = "<gguf>"
) -> ReferenceConfig:
    """Build the reference config from a GGUF's metadata and tensor names.

    Raises :class:`Unavailable` for an architecture the reference does not implement and
    :class:`BadFileError` for missing or inconsistent keys.
    """
    arch = metadata.get("general.architecture")
    if arch not in FAMILIES:
        raise Unavailable(
            f"the reference has no implementation of architecture {arch!r} "
            f"(supported: {', '.join(FAMILIES)})"
        )
    names = set(tensor_names)
    p = f"{arch}."

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(p + key, default)

    def need(key: str) -> Any:
        return _need(metadata, path, p + key)

    n_embd = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_head_kv = int(get("attention.head_count_kv", n_head))
    block_count = int(need("block_count"))
    n_layer = block_count - int(get("nextn_predict_layers", 0) or 0)
    if "token_embd.weight" not in names:
        raise BadFileError(path, "tensor token_embd.weight is missing", field="token_embd.weight")
    vocab = get("vocab_size")
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else None
    rms_eps = float(need("attention.layer_norm_rms_epsilon"))

    is_mla = get("attention.key_length_mla") is not None and get("attention.kv_lora_rank") is not None
    fields: dict[str, Any] = {}
    if is_mla:
        k_mla = int(need("attention.key_length_mla"))
        v_mla = int(need("attention.value_length_mla"))
        n_rot = int(need("rope.dimension_count"))
        fields.update(
            q_lora_rank=int(get("attention.q_lora_rank", 0) or 0),
            kv_lora_rank=int(need("attention.kv_lora_rank")),
            qk_rope=n_rot,
            qk_nope=k_mla - n_rot,
            v_head=v_mla,
            lora_norm_eps=rms_eps,
        )
        head_dim_k, head_dim_v = k_mla, v_mla
    else:
        head_dim_k = int(get("attention.key_length", n_embd // n_head))
        head_dim_v = int(get("attention.value_length", head_dim_k))
        n_rot = int(get("rope.dimension_count", head_dim_k))

    yarn = None
    if get("rope.scaling.type") == "yarn":
        factor = float(need("rope.scaling.factor"))
        orig = get("rope.scaling.original_context_length") or get("context_length")
        yarn = YarnConfig(
            factor=factor,
            original_context=int(orig),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0) or 1.0),
            mscale_all_dim=float(get("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / 0.1,
        )

    n_expert = int(get("expert_count", 0) or 0)
    if n_expert:
        code = get("expert_gating_func")
        gating = GATING.get(int(code)) if code else DEFAULT_GATING.get(arch, "softmax")
        if gating is None:
            raise BadFileError(path, f"unknown expert_gating_func {code}", field=p + "expert_gating_func")
        scale = float(get("expert_weights_scale", 0.0) or 0.0)
        fields.update(
            n_dense_lead=int(get("leading_dense_block_count", 0) or 0),
            n_expert=n_expert,
            n_expert_used=int(need("expert_used_count")),
            n_expert_shared=int(get("expert_shared_count", 0) or 0),
            n_ff_exp=int(get("expert_feed_forward_length", 0) or 0),
            gating=gating,
            expert_weights_norm=bool(get("expert_weights_norm", False)),
            expert_weights_scale=scale if scale else 1.0,
            n_group=int(get("expert_group_count", 1) or 1),
            n_group_used=int(get("expert_group_used_count", 1) or 1),
        )

    if get("attention.indexer.head_count"):
        types = get("attention.indexer.types")
        if types is None:  # GLM-5 / 5.1: every layer runs its indexer (architectures.md sec 5)
            full = tuple(True for _ in range(n_layer))
        else:
            full = tuple(bool(t) for t in list(types)[:n_layer])
            if len(full) < n_layer:
                raise BadFileError(path, f"indexer.types has {len(full)} entries for {n_layer} layers",
                                   field=p + "attention.indexer.types")
        if full and not full[0]:
            raise BadFileError(path, "layer 0 is a shared indexer layer: nothing to share from",
                               field=p + "attention.indexer.types")
        fields.update(
            indexer_heads=int(need("attention.indexer.head_count")),
            indexer_dim=int(need("attention.indexer.key_length")),
            indexer_top_k=int(need("attention.indexer.top_k")),
            indexer_full=full,
        )

    cfg = ReferenceConfig(
        arch=arch,
        family=FAMILIES[arch],
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=int(vocab) if vocab is not None else -1,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        rms_eps=rms_eps,
        n_rot=n_rot,
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_mode=ROPE_MODES[arch],
        yarn=yarn,
        has_rope_freqs="rope_freqs.weight" in names,
        n_ff=int(get("feed_forward_length", 0) or 0),
        tied_output="output.weight" not in names,
        **fields,
    )
    _check(cfg, path)
    return cfg


def _check(cfg: ReferenceConfig, path: str) -> None:
    """Invariants the forward pass relies on; a violation names the metadata at fault."""
    problems = []
    if cfg.n_layer <= 0:
        problems.append(f"no layers to run (block_count minus NextN layers = {cfg.n_layer})")
    if cfg.n_head_kv <= 0 or cfg.n_head % cfg.n_head_kv:
        problems.append(f"head_count {cfg.n_head} is not a multiple of head_count_kv {cfg.n_head_kv}")
    if cfg.n_rot % 2 or cfg.n_rot > (cfg.qk_rope if cfg.is_mla else cfg.head_dim_k):
        problems.append(f"rope.dimension_count {cfg.n_rot} is odd or larger than the head")
    if cfg.n_expert and not 0 < cfg.n_expert_used <= cfg.n_expert:
        problems.append(f"expert_used_count {cfg.n_expert_used} not in 1..{cfg.n_expert}")
    if cfg.n_expert and cfg.n_expert % cfg.n_group:
        problems.append(f"expert_count {cfg.n_expert} not divisible by expert_group_count {cfg.n_group}")
    if cfg.has_indexer and cfg.n_rot > cfg.indexer_dim:
        problems.append(f"indexer key_length {cfg.indexer_dim} < rope dims {cfg.n_rot}")
    if problems:
        raise BadFileError(path, "; ".join(problems), field=f"{cfg.arch}.*")
