"""Architecture specs: one frozen, typed description of a model, built once from GGUF metadata.

Every later stage (tensor tables, HF rebuild, reference model, sharding plans) reads an
:class:`ArchSpec` instead of metadata keys. It is built at exactly one boundary,
:func:`build_spec`, which applies the defaults of ``docs/architectures.md`` (and of
llama.cpp's loaders, cited where they decide) and checks the invariants there: head
divisibility, MLA dims, NextN layer count, expert counts and groups, indexer layer types.

A missing or inconsistent key never crashes: it becomes a :class:`Finding` that names the
key (typed key reading lives in :mod:`ggufcheck.arch.keys`). :func:`build_spec` returns the findings beside the spec; :func:`spec_from_metadata`
raises :class:`SpecError` (carrying them) instead. An architecture without a spec gets a
:class:`GenericSpec` with whatever generic keys exist, so integrity and health checks still
run and the mapping check can SKIP with the reason.

Dimension letters (used in the tensor tables' shape expressions, see :meth:`ArchSpec.dims`):
D hidden, H query heads, Hkv kv heads, hd / hdv head dims of q.k / v, F dense FFN,
E experts, K used, Fe expert FFN, Fs shared-expert FFN (Fe * n_shared), L kv_lora_rank,
P qk_nope, R qk_rope, V v_head (MLA), Hi / Di indexer heads / head dim.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np

from ggufcheck.arch.families import FAMILIES, archs
from ggufcheck.arch.keys import REQUIRED, Finding, Keys, SpecError, check

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.gguf.reader import GGUFModel

# the families ggufcheck can diagnose: declared once in arch/families.py
SUPPORTED = archs()
MLA_ARCHS = archs(mla=True)
MOE_ARCHS = archs(moe=True)
NEXTN_ARCHS = archs(nextn=True)


class Pairing(str, enum.Enum):
    """Which dims RoPE rotates together (docs/architectures.md sec 2)."""

    NORM = "norm"  # ggml mode 0, interleaved: (x[2i], x[2i+1])
    NEOX = "neox"  # (x[i], x[i + n_rot/2])


class Gating(str, enum.Enum):
    """Router probability function; GGUF ``expert_gating_func`` 1 / 2."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


# docs/architectures.md sec 2 table, and the gating when the key is absent (llama.cpp's)
PAIRING = {a: Pairing(f.rope) for a, f in FAMILIES.items()}
DEFAULT_GATING = {a: Gating(f.gating) for a, f in FAMILIES.items() if f.gating}
GATING_CODES = {1: Gating.SOFTMAX, 2: Gating.SIGMOID}
# llama.cpp glm-dsa.cpp: without attention.indexer.types, a training context below 2^20 means
# GLM-5 / 5.1 (every layer full), otherwise GLM-5.2's pattern
GLM_5_2_CONTEXT = 1 << 20


# ---------------------------------------------------------------------------------------
# the spec


@dataclass(frozen=True)
class Rope:
    """RoPE and its scaling (docs/architectures.md sec 2)."""

    base: float
    n_rot: int  # dims rotated per head; dims at or past n_rot pass through
    pairing: Pairing
    head_dim: int  # the head dim rope is applied in (hd, or R for MLA)
    scaling: str | None = None  # "yarn", "linear", ... (rope.scaling.type); None: none
    factor: float = 1.0  # F
    original_context: int | None = None  # L0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale_all_dim: float = 0.0  # = stored yarn_log_multiplier / 0.1 (deepseek2)

    @property
    def partial(self) -> bool:
        return self.n_rot < self.head_dim

    @property
    def yarn(self) -> bool:
        return self.scaling == "yarn"

    @property
    def mscale(self) -> float:
        """YaRN softmax multiplier ``1 + 0.1 * mscale_all_dim * ln F`` (1 without YaRN)."""
        if not self.yarn or self.factor <= 1:
            return 1.0
        return 1.0 + 0.1 * self.mscale_all_dim * math.log(self.factor)

    def yarn_corr_dims(self) -> tuple[int, int]:
        """YaRN ramp bounds ``(low, high)`` from beta_fast / beta_slow."""
        l0 = self.original_context or 0

        def corr(n: float) -> float:
            return self.n_rot * math.log(l0 / (n * 2 * math.pi)) / (2 * math.log(self.base))

        low = max(0, math.floor(corr(self.beta_fast)))
        high = min(self.n_rot - 1, math.ceil(corr(self.beta_slow)))
        return low, high


@dataclass(frozen=True)
class SlidingWindow:
    """Sliding-window (local) attention layers (gemma3; docs/architectures.md sec 8).

    llama.cpp ``LLAMA_SWA_TYPE_STANDARD`` (src/llama-hparams.h is_masked_swa): a query at
    position p sees keys k with ``p - k < window``; transformers' sliding mask is the same
    (``kv_idx > q_idx - sliding_window``). Those layers rotate with their own rope base.
    """

    window: int
    layers: tuple[bool, ...]  # per run layer: True = sliding window, False = global
    rope_base: float  # llama.cpp rope_freq_base_train_swa (rope.freq_base_swa; gemma3 default 10000)
    same_rope: bool = False  # the local layers rotate exactly as the global ones (gpt-oss: YaRN too)

    def is_swa(self, layer: int) -> bool:
        return layer < len(self.layers) and self.layers[layer]


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention dims (deepseek2, glm-dsa; docs/architectures.md sec 3)."""

    q_lora_rank: int | None  # None: plain attn_q (DeepSeek-V2-Lite)
    kv_lora_rank: int  # L
    qk_nope: int  # P
    qk_rope: int  # R
    v_head: int  # V
    split_kv_b: bool = True  # False: a legacy file with one attn_kv_b (no *_length_mla keys)

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope


@dataclass(frozen=True)
class MoE:
    """Routed and shared experts, router semantics (docs/architectures.md sec 3, router)."""

    n_expert: int  # E
    n_used: int  # K
    n_shared: int
    expert_ff: int  # Fe
    leading_dense: int  # layers below this use the dense FFN
    gating: Gating
    weights_norm: bool
    weights_scale: float  # absent or 0 in the file -> 1
    n_group: int = 1  # G
    n_group_used: int = 1


@dataclass(frozen=True)
class Indexer:
    """DeepSeek Sparse Attention indexer (glm-dsa; docs/architectures.md sec 5)."""

    n_head: int  # Hi
    head_dim: int  # Di
    top_k: int
    full: tuple[bool, ...]  # per run layer: True = full (own tensors), False = shared
    types_source: str  # "metadata", "default: GLM-5 (all full)", "default: GLM-5.2 pattern"

    def is_full(self, layer: int) -> bool:
        """A NextN layer past the listed ones counts as full (its tensors are optional)."""
        return self.full[layer] if layer < len(self.full) else True

    def source_layer(self, layer: int) -> int:
        """The full layer whose top-k indices ``layer`` uses (itself when full)."""
        for i in range(min(layer, len(self.full) - 1), -1, -1):
            if self.full[i]:
                return i
        return layer


@dataclass(frozen=True)
class ArchSpec:
    """A supported architecture, fully typed. Built only by :func:`build_spec`."""

    arch: str
    n_embd: int  # D
    n_block: int  # block_count: every blk.{i}, NextN layers included
    n_nextn: int  # NextN / MTP layers at the end (not run)
    n_vocab: int
    n_head: int  # H
    n_head_kv: int  # Hkv as stored (1 for MLA's MQA view)
    head_dim_k: int  # hd of q.k (P + R for MLA)
    head_dim_v: int  # hd of v (V for MLA)
    n_ff: int  # dense FFN (F); 0 when no layer is dense
    rms_eps: float
    context_length: int | None
    rope: Rope
    mla: MLA | None = None
    moe: MoE | None = None
    indexer: Indexer | None = None
    tied_output: bool | None = None  # None: tensor names were not given
    # gemma3 (docs/architectures.md sec 8); the defaults are every other family's
    swa: SlidingWindow | None = None
    embed_scale: float = 1.0  # token embeddings are multiplied by this (gemma: sqrt(D))
    attn_scale: float | None = None  # q.k scale when not 1/sqrt(hd) (llama.cpp f_attention_scale)
    final_softcap: float = 0.0  # logits = c * tanh(logits / c) when > 0
    notes: tuple[str, ...] = field(default=(), compare=False)  # defaults applied, and why

    supported = True

    @property
    def n_layer(self) -> int:
        """Layers to run: ``block_count - nextn_predict_layers``."""
        return self.n_block - self.n_nextn

    @property
    def kq_scale(self) -> float:
        """Softmax scale of q.k: ``mscale^2 / sqrt(head dim of q.k)`` (mscale 1 without YaRN),
        or the family's own (gemma3 27B: ``1/sqrt(D/H)``)."""
        if self.attn_scale is not None:
            return self.attn_scale
        return self.rope.mscale**2 / math.sqrt(self.head_dim_k)

    def is_nextn_layer(self, i: int) -> bool:
        return i >= self.n_layer

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i >= self.moe.leading_dense

    def dims(self) -> dict[str, int]:
        """The dimension letters the tensor tables' shape expressions use."""
        d = dict(D=self.n_embd, vocab=self.n_vocab, H=self.n_head, Hkv=self.n_head_kv,
                 hd=self.head_dim_k, hdv=self.head_dim_v, F=self.n_ff, n_rot=self.rope.n_rot)
        if self.moe is not None:
            d.update(E=self.moe.n_expert, K=self.moe.n_used, Fe=self.moe.expert_ff,
                     Fs=self.moe.expert_ff * self.moe.n_shared)
        if self.mla is not None:
            d.update(L=self.mla.kv_lora_rank, P=self.mla.qk_nope, R=self.mla.qk_rope,
                     V=self.mla.v_head, q_lora=self.mla.q_lora_rank or 0)
        if self.indexer is not None:
            d.update(Hi=self.indexer.n_head, Di=self.indexer.head_dim)
        return d


@dataclass(frozen=True)
class GenericSpec:
    """An architecture ggufcheck has no spec or table for: the generic keys that exist."""

    arch: str
    reason: str
    n_embd: int | None = None
    n_block: int | None = None
    n_vocab: int | None = None
    n_head: int | None = None
    n_head_kv: int | None = None
    n_ff: int | None = None
    context_length: int | None = None
    tied_output: bool | None = None

    supported = False


# ---------------------------------------------------------------------------------------
# the builder


def build_spec(metadata: Mapping[str, Any], tensor_names: Iterable[str] | None = None
               ) -> tuple[ArchSpec | GenericSpec | None, list[Finding]]:
    """The spec of a model from its metadata, and every finding about the keys.

    Returns ``(spec, [])`` when all is consistent; ``(None, findings)`` when a supported
    architecture's keys are missing or inconsistent; ``(GenericSpec, [])`` for an
    architecture without a spec (never a finding: it is not the file's fault). Tensor
    names, when given, decide ``tied_output`` (no ``output.weight``).
    """
    names = set(tensor_names) if tensor_names is not None else None
    tied = None if names is None else "output.weight" not in names
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        return None, [Finding("general.architecture", f"missing or not a string: {arch!r}")]
    if arch not in SUPPORTED:
        return _generic(metadata, arch, tied), []
    if arch in ("llama", "qwen2", "qwen3") and f"{arch}.expert_count" in metadata:
        # Mixtral-style MoE under a dense architecture name: no table (and a dense table
        # would report every expert tensor as unexpected, which would be a false finding)
        return _generic(metadata, arch, tied, reason=f"{arch} with {arch}.expert_count (a "
                        "Mixtral-style MoE) has no spec or tensor table in ggufcheck yet"), []
    keys = Keys(metadata, arch)
    spec = _build(keys, arch, tied)
    if keys.findings or spec is None:
        return None, keys.findings or [Finding(f"{arch}.*", "inconsistent metadata")]
    return spec, []


def spec_from_metadata(metadata: Mapping[str, Any], tensor_names: Iterable[str] | None = None
                       ) -> ArchSpec | GenericSpec:
    """As :func:`build_spec`, but raises :class:`SpecError` carrying the findings."""
    spec, findings = build_spec(metadata, tensor_names)
    if findings or spec is None:
        raise SpecError(str(metadata.get("general.architecture", "?")), findings)
    return spec


def spec_for_model(model: "GGUFModel") -> tuple[ArchSpec | GenericSpec | None, list[Finding]]:
    """:func:`build_spec` on an open GGUF's metadata and tensor names."""
    return build_spec(model.metadata, model.tensors.keys())


def _generic(metadata: Mapping[str, Any], arch: str, tied: bool | None,
             reason: str | None = None) -> GenericSpec:
    def num(name: str) -> int | None:
        v = metadata.get(f"{arch}.{name}")
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == int(v) else None

    tokens = metadata.get("tokenizer.ggml.tokens")
    head_kv = metadata.get(f"{arch}.attention.head_count_kv")
    return GenericSpec(
        arch=arch, reason=reason or f"ggufcheck has no spec or tensor table for architecture "
        f"{arch!r} (supported: {', '.join(SUPPORTED)})",
        n_embd=num("embedding_length"), n_block=num("block_count"),
        n_vocab=num("vocab_size") or (len(tokens) if isinstance(tokens, list) else None),
        n_head=num("attention.head_count"),
        n_head_kv=num("attention.head_count_kv") if not isinstance(head_kv, list) else None,
        n_ff=num("feed_forward_length"), context_length=num("context_length"), tied_output=tied)


def _vocab(keys: Keys) -> int | None:
    if keys.has("vocab_size"):
        return keys.int("vocab_size")
    tokens = keys.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, (list, tuple)) and tokens:
        keys.notes.append("vocab from the tokenizer.ggml.tokens count")
        return len(tokens)
    keys.fail("vocab_size", "missing, and no tokenizer.ggml.tokens to count")
    return None


def _build(keys: Keys, arch: str, tied: bool | None) -> ArchSpec | None:
    n_embd = keys.int("embedding_length")
    n_block = keys.int("block_count")
    n_head = keys.int("attention.head_count")
    n_head_kv = keys.int("attention.head_count_kv", n_head)
    n_vocab = _vocab(keys)
    rms_eps = keys.float("attention.layer_norm_rms_epsilon", positive=True)
    context = keys.int("context_length", None)
    n_nextn = keys.int("nextn_predict_layers", 0, minimum=0) if arch in NEXTN_ARCHS else 0
    if None in (n_embd, n_block, n_head, n_head_kv, n_vocab, rms_eps, n_nextn):
        return None
    check(keys, n_nextn < n_block, "nextn_predict_layers",
           f"{n_nextn} NextN layers leave no layer to run (block_count {n_block})")
    if arch in MLA_ARCHS:
        return _build_mla(keys, arch, n_embd, n_block, n_nextn, n_head, n_head_kv, n_vocab,
                          rms_eps, context, tied)
    return _build_gqa(keys, arch, n_embd, n_block, n_nextn, n_head, n_head_kv, n_vocab,
                      rms_eps, context, tied)


def _build_gqa(keys: Keys, arch: str, n_embd: int, n_block: int, n_nextn: int, n_head: int,
               n_head_kv: int, n_vocab: int, rms_eps: float, context: int | None,
               tied: bool | None) -> ArchSpec | None:
    """llama, qwen2, qwen3, phi3, gemma3, qwen3moe, gpt-oss, glm4moe: grouped-query attention."""
    check(keys, n_head % n_head_kv == 0, "attention.head_count_kv",
           f"{n_head_kv} kv heads do not divide {n_head} query heads")
    if not keys.has("attention.key_length"):
        if not check(keys, n_embd % n_head == 0, "attention.key_length",
                      f"missing, and embedding_length {n_embd} is not a multiple of {n_head} heads"):
            return None
    head_k = keys.int("attention.key_length", n_embd // n_head)
    head_v = keys.int("attention.value_length", head_k)
    if head_k is None or head_v is None:
        return None
    rope = _rope(keys, arch, head_dim=head_k, n_rot_default=head_k)
    moe = _moe(keys, arch, n_block, n_vocab) if arch in MOE_ARCHS else None
    n_ff = keys.int("feed_forward_length", 0 if moe is not None else REQUIRED, minimum=0)
    if rope is None or n_ff is None or (arch in MOE_ARCHS and moe is None):
        return None
    check(keys, moe is None or moe.leading_dense == 0 or n_ff > 0, "feed_forward_length",
           "missing or 0, but leading dense layers need it")
    extras = _window_and_scales(keys, arch, n_block, n_embd, n_head, head_k, rope)
    if extras is None:
        return None
    return ArchSpec(arch=arch, n_embd=n_embd, n_block=n_block, n_nextn=n_nextn,
                    n_vocab=n_vocab, n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_k,
                    head_dim_v=head_v, n_ff=n_ff, rms_eps=rms_eps, context_length=context,
                    rope=rope, moe=moe, tied_output=tied, notes=tuple(keys.notes), **extras)


def _window_and_scales(keys: Keys, arch: str, n_block: int, n_embd: int, n_head: int, head_dim: int,
                       rope: Rope) -> dict[str, Any] | None:
    """The ArchSpec fields of the families with sliding-window layers or their own scales:
    gemma3 (``_gemma``), phi3 (``_phi3_window``), gpt-oss (the window required, its local layers
    rotating as the global ones); {} for the others, None on a bad key."""
    fam = FAMILIES[arch]
    if fam.gemma:
        return _gemma(keys, n_block, n_embd, n_head, head_dim)
    if arch == "phi3":
        return _phi3_window(keys, n_block, rope)
    if fam.swa_same_rope:
        window = keys.int("attention.sliding_window")
        layers = _swa_layers(keys, n_block, fam.swa_pattern)
        if window is None or layers is None:
            return None
        return dict(swa=SlidingWindow(window=window, layers=layers, rope_base=rope.base, same_rope=True))
    return {}


def _phi3_window(keys: Keys, n_block: int, rope: Rope) -> dict[str, Any] | None:
    """phi3's ``attention.sliding_window`` (0: Phi-4, none): the model (transformers' Phi3)
    masks every layer to it, while llama.cpp's phi3 loader switches sliding-window attention
    off (src/models/phi3.cpp, "Phi SWA is currently disabled", PR 13676): past the window the
    two compute different models, and the reference computes the trained one."""
    window = keys.int("attention.sliding_window", 0, minimum=0)
    if window is None:
        return None
    if not window:
        return {}
    keys.notes.append(f"sliding window {window} on every layer (the model's; llama.cpp disables Phi SWA, "
                      "so prompts longer than the window differ there)")
    return dict(swa=SlidingWindow(window=window, layers=(True,) * n_block, rope_base=rope.base, same_rope=True))


def _swa_layers(keys: Keys, n_block: int, default_pattern: int) -> tuple[bool, ...] | None:
    """Which layers are sliding-window (llama.cpp load_swa_pattern): the per-layer array
    ``attention.sliding_window_pattern``, or every layer i with ``i % n < n - 1`` for the
    pattern n (the key's, else the architecture's default)."""
    if isinstance(keys.metadata.get(keys.key("attention.sliding_window_pattern")), (list, tuple)):
        layers = keys.bool_list("attention.sliding_window_pattern")
        if layers is None or not check(keys, len(layers) >= n_block, "attention.sliding_window_pattern",
                                       f"{len(layers)} entries for {n_block} layers"):
            return None
        return tuple(layers[:n_block])
    n = keys.int("attention.sliding_window_pattern", default_pattern, minimum=0)
    if n is None:
        return None
    return tuple(n == 0 or i % n < n - 1 for i in range(n_block))


GEMMA3_SWA_PATTERN = 6  # llama.cpp gemma3.cpp load_swa_pattern(ml, 6): five local layers, one global
GEMMA3_27B_LAYERS = 62  # llama.cpp gemma3.cpp: LLM_TYPE_27B scales q by 1/sqrt(D/H), not 1/sqrt(hd)


def _gemma(keys: Keys, n_block: int, n_embd: int, n_head: int, head_dim: int) -> dict[str, Any] | None:
    """gemma3's facts, as llama.cpp's loader (src/models/gemma3.cpp) reads them: the
    sliding window and its layer pattern, the local layers' rope base, the final soft-cap,
    the embedding scale sqrt(D) and the q scale (docs/architectures.md sec 8)."""
    window = keys.int("attention.sliding_window", 0, minimum=0)
    softcap = keys.float("final_logit_softcapping", 0.0)
    base_swa = keys.float("rope.freq_base_swa", 10000.0, positive=True)
    if None in (window, softcap, base_swa):
        return None
    swa = None
    if window > 0:
        layers = _swa_layers(keys, n_block, GEMMA3_SWA_PATTERN)
        if layers is None:
            return None
        swa = SlidingWindow(window=window, layers=layers, rope_base=base_swa)
    else:
        keys.notes.append("no attention.sliding_window: every layer attends globally")
    scale = 1.0 / math.sqrt(head_dim)
    if n_block == GEMMA3_27B_LAYERS:
        scale = 1.0 / math.sqrt(n_embd // n_head)
        keys.notes.append("27B (62 layers): q scaled by 1/sqrt(D/H), as llama.cpp and Gemma's code do")
    return dict(swa=swa, embed_scale=math.sqrt(n_embd), attn_scale=scale, final_softcap=softcap)


def _build_mla(keys: Keys, arch: str, n_embd: int, n_block: int, n_nextn: int, n_head: int,
               n_head_kv: int, n_vocab: int, rms_eps: float, context: int | None,
               tied: bool | None) -> ArchSpec | None:
    """deepseek2, glm-dsa: MLA attention (+ MoE, + the DSA indexer for glm-dsa)."""
    mla = _mla(keys, arch, n_head_kv)
    moe = _moe(keys, arch, n_block, n_vocab) if keys.has("expert_count") or arch == "glm-dsa" else None
    if mla is None or (arch == "glm-dsa" and moe is None):
        return None
    if moe is None:  # a deepseek2 without experts (llama.cpp: every layer dense)
        keys.notes.append("no expert_count: every layer uses the dense FFN")
    n_ff = keys.int("feed_forward_length", REQUIRED if moe is None or moe.leading_dense else 0,
                    minimum=0)
    rope = _rope(keys, arch, head_dim=mla.qk_rope, n_rot_default=mla.qk_rope)
    indexer = (_indexer(keys, n_block - n_nextn, context, rope)
               if arch == "glm-dsa" and rope is not None else None)
    if n_ff is None or rope is None or (arch == "glm-dsa" and indexer is None):
        return None
    check(keys, rope.n_rot == mla.qk_rope, "rope.dimension_count",
           f"{rope.n_rot} != qk_rope {mla.qk_rope}")
    return ArchSpec(arch=arch, n_embd=n_embd, n_block=n_block, n_nextn=n_nextn,
                    n_vocab=n_vocab, n_head=n_head, n_head_kv=n_head_kv,
                    head_dim_k=mla.qk_head, head_dim_v=mla.v_head, n_ff=n_ff, rms_eps=rms_eps,
                    context_length=context, rope=rope, mla=mla, moe=moe, indexer=indexer,
                    tied_output=tied, notes=tuple(keys.notes))


def _rope(keys: Keys, arch: str, head_dim: int, n_rot_default: int) -> Rope | None:
    base = keys.float("rope.freq_base", 10000.0, positive=True)
    n_rot = keys.int("rope.dimension_count", n_rot_default if arch not in MLA_ARCHS else REQUIRED)
    scaling = keys.str("rope.scaling.type", None)
    if base is None or n_rot is None:
        return None
    ok = check(keys, n_rot % 2 == 0, "rope.dimension_count", f"{n_rot} is odd")
    ok &= check(keys, n_rot <= head_dim, "rope.dimension_count",
                 f"{n_rot} rotated dims exceed the head dim {head_dim}")
    if scaling is None and keys.float("rope.scaling.factor", 0.0) not in (None, 0.0, 1.0):
        scaling = "linear"  # llama.cpp's default type string; its factor then scales every position
        keys.notes.append("rope.scaling.type absent with a scaling factor: linear (llama.cpp's default)")
    if scaling in (None, "none"):
        return Rope(base, n_rot, PAIRING[arch], head_dim) if ok else None
    factor = keys.float("rope.scaling.factor", positive=True)
    original = keys.int("rope.scaling.original_context_length", None)
    if scaling == "yarn" and original is None:
        original = keys.int("context_length", None)
        keys.notes.append("YaRN original context missing: llama.cpp falls back to context_length, "
                          "which moves the correction dims")
        ok &= check(keys, original is not None, "rope.scaling.original_context_length",
                     "missing, and no context_length to fall back to")
    log_mul = keys.float("rope.scaling.yarn_log_multiplier", 0.0)
    beta_fast = keys.float("rope.scaling.yarn_beta_fast", 32.0)
    beta_slow = keys.float("rope.scaling.yarn_beta_slow", 1.0)
    if None in (factor, log_mul, beta_fast, beta_slow) or not ok:
        return None
    # deepseek2's converter stores 0.1 * mscale_all_dim (TAG_DEEPSEEK2_YARN_LOG_MUL_FIX);
    # llama.cpp divides by 0.1f in float32, which gives back e.g. exactly 1.0
    mscale_all_dim = float(np.float32(log_mul) / np.float32(0.1))
    if scaling == "yarn" and arch not in MLA_ARCHS and log_mul == 0.0:
        # llama.cpp (llama-context.cpp) cancels its attn factor and ggml's rope_yarn scales cos
        # and sin by 1 + 0.1 ln F: q.k grows by that squared, as transformers' default YaRN
        # attention_factor does (gpt-oss)
        mscale_all_dim = 1.0
        keys.notes.append("YaRN magnitude 1 + 0.1 ln F on cos / sin (ggml rope_yarn)")
    return Rope(base, n_rot, PAIRING[arch], head_dim, scaling=scaling, factor=factor,
                original_context=original, beta_fast=beta_fast, beta_slow=beta_slow,
                mscale_all_dim=mscale_all_dim)


def _mla(keys: Keys, arch: str, n_head_kv: int) -> MLA | None:
    q_lora = keys.int("attention.q_lora_rank", None if arch == "deepseek2" else REQUIRED)
    kv_lora = keys.int("attention.kv_lora_rank")
    n_rot = keys.int("rope.dimension_count")
    split = keys.has("attention.key_length_mla") or keys.has("attention.value_length_mla")
    if split:  # the MLA files: *_length_mla = P+R and V; *_length the MQA view L+R and L
        k_mla = keys.int("attention.key_length_mla")
        v_mla = keys.int("attention.value_length_mla")
        k_mqa = keys.int("attention.key_length", None)
        v_mqa = keys.int("attention.value_length", None)
        if None in (kv_lora, n_rot, k_mla, v_mla):
            return None
        check(keys, k_mqa is None or k_mqa == kv_lora + n_rot, "attention.key_length",
               f"MQA view {k_mqa} != kv_lora_rank + rope dims = {kv_lora + n_rot}")
        check(keys, v_mqa is None or v_mqa == kv_lora, "attention.value_length",
               f"MQA view {v_mqa} != kv_lora_rank {kv_lora}")
        check(keys, n_head_kv == 1, "attention.head_count_kv",
               f"MLA files store the MQA view with 1 kv head, found {n_head_kv}")
    else:  # legacy deepseek2 files: attn_kv_b unsplit, *_length = P+R and V (MHA view)
        if arch == "glm-dsa":  # llama.cpp glm-dsa.cpp: "GLM_DSA architecture requires MLA"
            keys.fail("attention.key_length_mla", "missing: glm-dsa requires the split MLA layout")
            return None
        k_mla = keys.int("attention.key_length")
        v_mla = keys.int("attention.value_length")
        if None in (kv_lora, n_rot, k_mla, v_mla):
            return None
        keys.notes.append("legacy MLA layout: one attn_kv_b per layer")
    if not check(keys, k_mla > n_rot, "attention.key_length_mla" if split else "attention.key_length",
                  f"{k_mla} leaves no nope dims after {n_rot} rope dims (must be P + R, P > 0)"):
        return None
    return MLA(q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope=k_mla - n_rot, qk_rope=n_rot,
               v_head=v_mla, split_kv_b=split)


def glm_lite_gating(arch: str, n_block: int, n_vocab: int) -> bool:
    """llama.cpp's rule (2026) for a deepseek2 file without expert_gating_func: 47 or 48 blocks
    and GLM's 154880-token vocabulary is GLM-4.7 Lite (Flash), a sigmoid router; any other is
    an old DeepSeek V2 / V2.5 file, softmax. Builds before the rule read softmax for all."""
    return arch == "deepseek2" and n_block in (47, 48) and n_vocab == 154880


def _moe(keys: Keys, arch: str, n_block: int, n_vocab: int = 0) -> MoE | None:
    n_expert = keys.int("expert_count")
    n_used = keys.int("expert_used_count")
    # deepseek2 / glm-dsa files always say how many shared experts; glm4moe and qwen3moe may not (0)
    n_shared = keys.int("expert_shared_count", REQUIRED if arch in MLA_ARCHS else 0, minimum=0)
    expert_ff = keys.int("expert_feed_forward_length")
    dense = keys.int("leading_dense_block_count", 0, minimum=0)
    code = keys.int("expert_gating_func", None, minimum=0)
    forced_norm = FAMILIES[arch].weights_norm
    norm = keys.bool("expert_weights_norm", bool(forced_norm))
    if forced_norm is not None and norm != forced_norm:
        keys.notes.append(f"expert_weights_norm {norm} ignored: llama.cpp's {arch} loader always uses {forced_norm}")
        norm = forced_norm
    scale = keys.float("expert_weights_scale", 0.0)
    n_group = keys.int("expert_group_count", 1)
    n_group_used = keys.int("expert_group_used_count", 1)
    if None in (n_expert, n_used, n_shared, expert_ff, dense, norm, scale, n_group, n_group_used):
        return None
    if code in (None, 0):  # 0 = LLAMA_EXPERT_GATING_FUNC_TYPE_NONE: the loader's default
        gating = Gating.SIGMOID if glm_lite_gating(arch, n_block, n_vocab) else DEFAULT_GATING[arch]
        keys.notes.append(f"expert_gating_func absent: {gating.value} (the {arch} default"
                          + (", GLM-4.7 Lite's dims)" if glm_lite_gating(arch, n_block, n_vocab) else ")"))
    elif code in GATING_CODES:
        gating = GATING_CODES[code]
    else:
        keys.fail("expert_gating_func", f"unsupported gating function {code} (1 softmax, 2 sigmoid)")
        return None
    ok = check(keys, n_used <= n_expert, "expert_used_count",
                f"{n_used} used experts > {n_expert} experts")
    ok &= check(keys, n_expert % n_group == 0, "expert_group_count",
                 f"{n_group} groups do not divide {n_expert} experts")
    ok &= check(keys, n_group_used <= n_group, "expert_group_used_count",
                 f"{n_group_used} used groups > {n_group} groups")
    if ok:
        ok &= check(keys, n_used <= n_expert // n_group * n_group_used, "expert_used_count",
                     f"{n_used} used experts > the {n_expert // n_group * n_group_used} experts "
                     f"in {n_group_used} of {n_group} groups")
    ok &= check(keys, dense <= n_block, "leading_dense_block_count",
                 f"{dense} dense layers > block_count {n_block}")
    if not ok:
        return None
    return MoE(n_expert=n_expert, n_used=n_used, n_shared=n_shared, expert_ff=expert_ff,
               leading_dense=dense, gating=gating, weights_norm=norm,
               weights_scale=scale if scale != 0.0 else 1.0, n_group=n_group,
               n_group_used=n_group_used)


def _indexer(keys: Keys, n_layer: int, context: int | None, rope: Rope) -> Indexer | None:
    n_head = keys.int("attention.indexer.head_count")
    head_dim = keys.int("attention.indexer.key_length")
    top_k = keys.int("attention.indexer.top_k")
    types = keys.bool_list("attention.indexer.types")  # not in gguf 0.19's constants: raw key
    if None in (n_head, head_dim, top_k):
        return None
    # llama.cpp glm-dsa.cpp: GGML_ASSERT(n_rot <= indexer head size)
    if not check(keys, rope.n_rot <= head_dim, "attention.indexer.key_length",
                  f"{head_dim} < {rope.n_rot} rope dims"):
        return None
    if types is not None:
        source = "metadata"
        # llama.cpp reads it with get_key_or_arr(..., n_layer()): one entry per run layer
        if not check(keys, len(types) == n_layer, "attention.indexer.types",
                      f"{len(types)} entries, expected one per run layer ({n_layer})"):
            return None
    elif context is not None and context >= GLM_5_2_CONTEXT:
        source = "default: GLM-5.2 pattern (context >= 2^20)"
        types = tuple(max(i - 2, 0) % 4 == 0 for i in range(n_layer))
    else:
        source = "default: GLM-5/5.1 (every layer full)"
        types = (True,) * n_layer
    if not check(keys, not types or types[0], "attention.indexer.types",
                  "layer 0 is shared, but a shared layer needs an earlier full layer"):
        return None
    if source != "metadata":
        keys.notes.append(f"indexer types {source}")
    return Indexer(n_head=n_head, head_dim=head_dim, top_k=top_k, full=types, types_source=source)
