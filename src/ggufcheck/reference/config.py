"""The reference model's configuration: one frozen dataclass, built once per model.

The facts come from the arch helper's frozen spec (``ggufcheck.arch.spec``), which applies
the rules of ``docs/architectures.md`` (defaults, NextN layers, gating defaults,
indexer layer types) at exactly one boundary; this module flattens it into the fields the
forward pass reads and adds the reference's own options. Past this file there are no
metadata dicts and no behaviour inferred from a dimension's value.

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
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ggufcheck.arch.families import FAMILIES as ARCH_FAMILIES
from ggufcheck.errors import BadFileError, Unavailable

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.arch.spec import ArchSpec

# GGUF architecture -> reference family module (reference/<family>.py)
# GGUF architecture -> the reference module that runs it (arch/families.py)
FAMILIES = {a: f.reference for a, f in ARCH_FAMILIES.items()}



@dataclass(frozen=True)
class YarnConfig:
    """YaRN rope scaling (docs/architectures.md sec 2)."""

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
    gating_in_file: bool = True  # False: expert_gating_func absent, ``gating`` is the loader's default
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
    # gemma3 (docs/architectures.md sec 8)
    swa_window: int = 0  # sliding-window layers see keys with q_pos - k_pos < window; 0: none
    swa_layers: tuple[bool, ...] = ()  # per layer: True = sliding window
    rope_base_swa: float = 0.0  # the sliding-window layers' rope base
    swa_same_rope: bool = False  # the sliding-window layers rotate exactly as the global ones (gpt-oss)
    rope_freq_scale: float = 1.0  # linear rope scaling (1 / rope.scaling.factor) of the global layers
    embed_scale: float = 1.0  # token embeddings times this (gemma: sqrt(D))
    attn_scale: float | None = None  # q.k scale when not 1/sqrt(hd)
    final_softcap: float = 0.0  # logits = c * tanh(logits / c) when > 0
    ffn_act: str = "silu"  # gated FFN / experts: "silu" (SwiGLU), "gelu_tanh" (GeGLU, gemma), "swiglu_oai" (gpt-oss)
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
        """Softmax scale of q.k: 1/sqrt(head dim of q.k), times mscale^2 under YaRN (or the
        family's own, gemma3 27B)."""
        if self.attn_scale is not None:
            return self.attn_scale
        scale = 1.0 / math.sqrt(self.head_dim_k)
        if self.yarn is not None:
            scale *= self.yarn.mscale**2
        return scale

    def is_swa_layer(self, i: int) -> bool:
        """A sliding-window (local) layer: its own rope base, and the window when > 0."""
        return i < len(self.swa_layers) and self.swa_layers[i]

    def attention_window(self, i: int) -> int:
        """The window layer ``i`` attends over (0: every earlier position)."""
        return self.swa_window if self.is_swa_layer(i) else 0

    def is_moe_layer(self, i: int) -> bool:
        return self.n_expert > 0 and i >= self.n_dense_lead

    def with_options(self, **changes: Any) -> "ReferenceConfig":
        """A copy with some fields changed (e.g. ``lora_norm_eps=1e-6`` to match transformers)."""
        return replace(self, **changes)


def config_from_spec(spec: "ArchSpec", tensor_names: Iterable[str]) -> ReferenceConfig:
    """Flatten the arch helper's :class:`~ggufcheck.arch.spec.ArchSpec` (which applies every
    default and invariant of docs/architectures.md) into what the forward pass reads."""
    names = set(tensor_names)
    rope = spec.rope
    yarn = None
    if rope.yarn:
        yarn = YarnConfig(factor=rope.factor, original_context=int(rope.original_context),
                          beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
                          mscale_all_dim=rope.mscale_all_dim)
    elif rope.scaling not in (None, "none", "linear"):
        raise Unavailable(f"rope scaling {rope.scaling!r} is not implemented by the reference")
    if "rope_factors_long.weight" in names:
        raise Unavailable("LongRoPE (rope_factors_long / rope_factors_short, Phi-3 128k models) is not implemented "
                          "by the reference")
    fields: dict[str, Any] = {}
    if rope.scaling == "linear":  # positions / factor (llama.cpp freq_scale = 1 / factor)
        fields["rope_freq_scale"] = 1.0 / rope.factor
    if spec.swa is not None:
        fields.update(swa_window=spec.swa.window, swa_layers=spec.swa.layers[:spec.n_layer],
                      rope_base_swa=spec.swa.rope_base, swa_same_rope=spec.swa.same_rope)
    fam = ARCH_FAMILIES[spec.arch]
    fields["ffn_act"] = fam.ffn_act
    if fam.gemma:
        fields.update(embed_scale=spec.embed_scale, attn_scale=spec.attn_scale, final_softcap=spec.final_softcap)
    if spec.mla is not None:
        fields.update(q_lora_rank=spec.mla.q_lora_rank or 0, kv_lora_rank=spec.mla.kv_lora_rank,
                      qk_nope=spec.mla.qk_nope, qk_rope=spec.mla.qk_rope, v_head=spec.mla.v_head,
                      lora_norm_eps=spec.rms_eps)
    if spec.moe is not None:
        moe = spec.moe
        fields.update(n_dense_lead=moe.leading_dense, n_expert=moe.n_expert, n_expert_used=moe.n_used,
                      n_expert_shared=moe.n_shared, n_ff_exp=moe.expert_ff, gating=moe.gating.value,
                      gating_in_file=not any(n.startswith("expert_gating_func absent") for n in spec.notes),
                      expert_weights_norm=moe.weights_norm, expert_weights_scale=moe.weights_scale,
                      n_group=moe.n_group, n_group_used=moe.n_group_used)
    if spec.indexer is not None:
        ix = spec.indexer
        fields.update(indexer_heads=ix.n_head, indexer_dim=ix.head_dim, indexer_top_k=ix.top_k,
                      indexer_full=tuple(ix.is_full(i) for i in range(spec.n_layer)))
    return ReferenceConfig(
        arch=spec.arch, family=FAMILIES[spec.arch], n_layer=spec.n_layer, n_embd=spec.n_embd,
        n_vocab=spec.n_vocab, n_head=spec.n_head, n_head_kv=spec.n_head_kv,
        head_dim_k=spec.head_dim_k, head_dim_v=spec.head_dim_v, rms_eps=spec.rms_eps,
        n_rot=rope.n_rot, rope_base=rope.base, rope_mode=rope.pairing.value, yarn=yarn,
        has_rope_freqs="rope_freqs.weight" in names, n_ff=spec.n_ff,
        tied_output="output.weight" not in names, **fields,
    )


def config_from_gguf(
    metadata: Mapping[str, Any], tensor_names: Iterable[str], path: str = "<gguf>"
) -> ReferenceConfig:
    """The reference config of a GGUF: its arch spec (``ggufcheck.arch.spec``), flattened.

    Raises :class:`Unavailable` for an architecture the reference does not implement and
    ``SpecError`` (a :class:`GGUFCheckError` naming each bad key) for inconsistent metadata.
    """
    from ggufcheck.arch.spec import ArchSpec, spec_from_metadata

    names = list(tensor_names)
    arch = metadata.get("general.architecture")
    if arch not in FAMILIES:
        raise Unavailable(f"the reference has no implementation of architecture {arch!r} "
                          f"(supported: {', '.join(FAMILIES)})")
    spec = spec_from_metadata(metadata, names)
    if not isinstance(spec, ArchSpec):  # pragma: no cover - FAMILIES == spec.SUPPORTED
        raise Unavailable(f"{path}: no architecture spec for {arch!r}")
    if "token_embd.weight" not in names:
        raise BadFileError(path, "tensor token_embd.weight is missing", field="token_embd.weight")
    return config_from_spec(spec, names)
