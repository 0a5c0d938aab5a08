"""Model-level fault injection: healthy-model-derived engines carrying one known bug.

Public on purpose: a user who writes an engine adapter (or a new check) runs ggufcheck
against these and sees each fault named, which is the evidence that a healthy verdict on
their own engine means something. Every faulty engine is the fp32/fp64 reference
(:class:`ggufcheck.engines.reference.ReferenceEngine`) whose :class:`ReferenceModel`
carries the fault INSIDE the computation, the way a real engine bug would: a weight
transform applied when a layer's tensors are dequantized, a per-layer config change, or a
corrupted KV cache on the decode path. So the fault shows in ``layer_outputs`` (per-layer
residuals, attention / FFN outputs, router choices, indexer top-k), in ``score``, in
``generate`` and, through :meth:`FaultyReferenceEngine.weight`, in the parameters the
engine "loaded" (HF names, per TP rank), exactly as the real bug would.

Output-level faults (flat output) reuse :mod:`ggufcheck.engines.faults`.

Each :class:`Fault` records the component the diagnosis must name (verdict vocabulary),
the layer it shows in first, the architectures it applies to, and the stage expected to
name it. Two components are recorded when the answer depends on what the engine exposes:
``component`` with loaded weights exposed (``expose_weights=True``, the default), and
``layers_component`` when only layer outputs are (the weights stage skips).

Choices a careful engineer would want explained:

- llama q/k permutation missing -> "weights". Numerically the engine then runs NEOX rope on
  rows the converter permuted for NORM, which is EXACTLY the computation of a rope pairing
  swap; no amount of activation comparison can tell the two apart, so from layers alone it is
  "rope". What distinguishes them is the loaded ``q_proj`` / ``k_proj``: with weights exposed
  the weights stage names that parameter in layer 0, which points the engineer at the
  loader's permutation, the actual bug.
- one quant block's scale corrupted -> "weights" (the named tensor's loaded values differ
  from the GGUF's dequantization; the GGUF itself is healthy, so it is not "dequant" of the
  file); from layers alone the block that reads it ("attention" for attn_output).
- decode path corrupting the KV cache -> "decode": the paths stage compares step-by-step
  decode with teacher-forced prefill and names "decode"; nothing in a prefill (layers,
  logits) can see it, and telling a cache write bug from a decode kernel bug needs the
  engine's cache, which no adapter exposes.
- kv_b [all K; all V] under TP N: the engine computes, per rank, with the W_UK / W_UV that
  the patched split makes of that rank's rows (:mod:`ggufcheck.sharding.faults`); this
  module turns them back into the per-head k_b / v_b the whole model effectively uses. At
  TP 1 that is exact (the fault is silent, as in the real bug); ``weight(kv_b_proj, rank)``
  returns the rank's effective rows in HF head-major order, so the weights stage compares
  what each rank computes with, not a storage order that would be harmless at TP 1.

Dimension letters: H heads, Hl heads per rank, P nope dims, V value dims, L kv_lora_rank,
E experts, T tokens, D hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ggufcheck.arch.families import FAMILIES, archs
from ggufcheck.engines.base import (
    LAYER_KINDS,
    Capabilities,
    Engine,
    LayerTrace,
    Unsupported,
)
from ggufcheck.engines.faults import FlatDistribution
from ggufcheck.engines.reference import ReferenceEngine
from ggufcheck.errors import UsageError
from ggufcheck.reference.cache import KVCache, LayerCache, LayerOutput
from ggufcheck.reference.config import ReferenceConfig
from ggufcheck.reference.model import ReferenceModel
from ggufcheck.reference.precision import emulating
from ggufcheck.reference.weights import WeightStore
from ggufcheck.sharding.faults import (  # noqa: F401 - re-exported: the layouts the faults use
    KV_B_ALL_K_THEN_V,
    KV_B_V_THEN_K,
    effective_k_b_v_b,
    kv_b_layout_patch,
    rebuild_v_then_k,
)

Weights = dict[str, Tensor]
MLA_ARCHS = frozenset(archs(mla=True))
MOE_ARCHS = frozenset(archs(moe=True))
ALL_ARCHS = frozenset(archs())
GEMMA_ARCHS = frozenset(archs(gemma=True))
SWA_ARCHS = frozenset(a for a in archs() if FAMILIES[a].swa_pattern)  # sliding-window layers
SINK_ARCHS = frozenset(archs(sinks=True))  # attention sinks (attn_sinks.weight)
BIASED_ROUTER_ARCHS = frozenset(archs(biased_router=True))  # exp_probs_b and a routed scale to get wrong


# ----------------------------------------------------------------------------- the patch
@dataclass
class ModelPatch:
    """What a fault changes in the reference model.

    - ``config``: global config overrides (``ReferenceConfig.with_options``);
    - ``layer_config(cfg, i) -> cfg``: a per-layer config (e.g. a wrong eps in one layer);
    - ``layer_weights(cfg, i, w) -> w``: a transform of layer i's dequantized tensors;
    - ``tensor_hook(name, tensor) -> tensor``: applied when a tensor is dequantized;
    - ``decode_corrupt_after``: corrupt the KV cache entries written by decode step >= N;
    - ``chunk_context_lost``: in a chunked prefill, the layers listed (all when empty) read the
      cache of earlier chunks as zeros (a context chunk's attention lost in the merge);
    - ``decode_layer_weights(cfg, i, w) -> w``: layer i's weights on one-token steps after a
      prefill only (a decode-path kernel fault).
    """

    config: dict[str, Any] = field(default_factory=dict)
    layer_config: Callable[[ReferenceConfig, int], ReferenceConfig] | None = None
    layer_weights: Callable[[ReferenceConfig, int, Weights], Weights] | None = None
    tensor_hook: Callable[[str, Tensor], Tensor] | None = None
    decode_corrupt_after: int | None = None
    chunk_context_lost: tuple[int, ...] | None = None
    tp: int = 1
    # ``decode_layer_weights(cfg, i, w) -> w``: the weights a one-token step after a prefill
    # computes with (a matrix-vector kernel that is wrong where the batched one is right)
    decode_layer_weights: Callable[[ReferenceConfig, int, Weights], Weights] | None = None


@dataclass(frozen=True)
class ScaledConfig(ReferenceConfig):
    """A config whose softmax scale is multiplied by ``kq_scale_factor`` (a wrong-scale fault)."""

    kq_scale_factor: float = 1.0

    @property
    def kq_scale(self) -> float:  # type: ignore[override]
        return ReferenceConfig.kq_scale.fget(self) * self.kq_scale_factor  # type: ignore[attr-defined]


def scaled_config(cfg: ReferenceConfig, factor: float) -> ReferenceConfig:
    values = {f.name: getattr(cfg, f.name) for f in fields(ReferenceConfig)}
    return ScaledConfig(**values, kq_scale_factor=factor)


class PatchedWeightStore(WeightStore):
    """A resident WeightStore whose tensors pass through the fault's hooks when dequantized."""

    def __init__(self, model, dtype, device, patch: ModelPatch, cfg_of: Callable[[int], ReferenceConfig]):
        super().__init__(model, dtype, device, streaming=False)
        self.patch = patch
        self._cfg_of = cfg_of
        self._patched: dict[int, Weights] = {}

    def lazy(self, name: str) -> Tensor:
        return self.tensor(name)  # whole tensors, so that the fault's hooks see every one

    def tensor(self, name: str, rows: slice | None = None) -> Tensor:
        t = super().tensor(name, rows)
        if self.patch.tensor_hook is not None and rows is None:
            t = self.patch.tensor_hook(name, t)
        return t

    def layer(self, i: int) -> Weights:
        if i not in self._patched:
            w = dict(super().layer(i))
            if self.patch.layer_weights is not None:
                w = self.patch.layer_weights(self._cfg_of(i), i, w)
            self._patched[i] = w
        return self._patched[i]


class FaultyReferenceModel(ReferenceModel):
    """The reference forward pass with a :class:`ModelPatch` applied inside the layers."""

    def __init__(self, model: str | Path, patch: ModelPatch, dtype: Any = torch.float64, device: Any = "cpu",
                 **options: Any):
        super().__init__(model, dtype=dtype, device=device, streaming=False, **{**patch.config, **options})
        self.patch = patch
        self.weights = PatchedWeightStore(self.gguf, self.dtype, self.device, patch, self.layer_cfg)

    def layer_cfg(self, i: int) -> ReferenceConfig:
        return self.patch.layer_config(self.cfg, i) if self.patch.layer_config else self.cfg

    def _layer(self, i: int, h: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache, shared: dict,
               release: bool = True) -> LayerOutput:
        w = self.weights.layer(i)
        if self.patch.decode_layer_weights is not None and h.shape[-2] == 1 and int(q_pos.reshape(-1)[0]) > 0:
            w = self.patch.decode_layer_weights(self.layer_cfg(i), i, w)  # a one-token step after a prefill
        with emulating(self._emulation_for(h.shape[-2])):  # an engine's arithmetic, where one is emulated
            return self.family.forward_layer(self.layer_cfg(i), i, w, h, self.rope(q_pos, i), q_pos, k_pos,
                                             cache.layer(i), shared)


class _CorruptingLayerCache(LayerCache):
    """A layer cache whose entries written by decode steps >= ``after`` are stored wrong
    (each such entry is overwritten with the previous slot's value: an off-by-one write)."""

    def __init__(self, start: int):
        super().__init__()
        self.start = start  # cache length from which writes are corrupted

    def extend(self, name: str, new: Tensor) -> Tensor:
        old = self.tensors.get(name)
        n_old = 0 if old is None else old.shape[0]
        if n_old >= self.start and old is not None:
            new = old[-1:].expand_as(new).clone()  # written to the wrong slot: the stale entry stays
        return super().extend(name, new)


class _ContextLostLayerCache(LayerCache):
    """A layer cache that, from the second chunk of a chunked prefill on, gives attention the
    earlier chunks' entries as zeros (their keys score 0 and their values add nothing: the
    context's share of the softmax is kept, its output lost). Kept entries stay right."""

    def extend(self, name: str, new: Tensor) -> Tensor:
        old = self.tensors.get(name)
        full = super().extend(name, new)
        if old is None:
            return full
        return torch.cat((torch.zeros_like(old), full[old.shape[0]:]), dim=0)


class _ContextLostKVCache(KVCache):
    def __init__(self, layers: tuple[int, ...]):
        super().__init__()
        self.broken = layers

    def layer(self, i: int) -> LayerCache:
        if self.broken and i not in self.broken:
            return super().layer(i)
        return self.layers.setdefault(i, _ContextLostLayerCache())


class _CorruptingKVCache(KVCache):
    def __init__(self, start: int):
        super().__init__()
        self.start = start

    def layer(self, i: int) -> LayerCache:
        return self.layers.setdefault(i, _CorruptingLayerCache(self.start))


# ----------------------------------------------------------------------------- the engine
class FaultyReferenceEngine(ReferenceEngine):
    """A ReferenceEngine over a :class:`FaultyReferenceModel`: same capabilities, one bug.

    ``weight(hf_name, rank)`` returns the parameter the faulty engine computes with, in HF
    checkpoint layout, cut for ``rank`` by vLLM's shard rule (``tp`` from the fault, 1 for
    most). ``expose_weights=False`` drops that capability (then the layers stage has to
    localize on its own).
    """

    def __init__(self, model_path: str | Path, fault: "Fault", patch: ModelPatch, *, dtype: str = "fp32",
                 expose_weights: bool = True, **options: Any):
        super().__init__(model_path, dtype=dtype, **options)
        self.model.close()
        self.model = FaultyReferenceModel(model_path, patch, dtype=dtype, **options)
        self.fault = fault
        self.patch = patch
        self.name = f"reference {dtype} with fault {fault.name} ({Path(model_path).name})"
        caps = self.capabilities
        kinds = caps.layer_outputs
        if patch.config.get("indexer_heads") == 0:  # dense attention: no indexer to report
            kinds = kinds - {"indexer"}
        why = dict(caps.reasons)
        if not expose_weights:
            why["weights"] = "fault engine built with expose_weights=False"
        self.capabilities = Capabilities(
            tokenize=caps.tokenize, score=True, full_vocab=True, max_top_k=caps.max_top_k, generate=True,
            batch=False, chunked_prefill=True, layer_outputs=kinds, weights=expose_weights,
            tp_size=patch.tp, activation_dtype=dtype,
            reasons=_reasons(why),
        )
        self._hf = None

    # -- decode with a corrupting cache ------------------------------------------------
    def _decode_cache(self, prompt_length: int):
        after = self.patch.decode_corrupt_after
        if after is None:
            return super()._decode_cache(prompt_length)
        return _CorruptingKVCache(prompt_length + max(after, 1) - 1)  # decode step `after` is the first wrong one

    def _chunk_cache(self):
        lost = self.patch.chunk_context_lost
        return super()._chunk_cache() if lost is None else _ContextLostKVCache(lost)

    # -- loaded weights ------------------------------------------------------------------
    def _hf_index(self):
        if self._hf is None:
            from ggufcheck.arch.spec import ArchSpec, spec_for_model
            from ggufcheck.arch.tables import table_for
            from ggufcheck.sharding.weights import hf_params

            spec, _ = spec_for_model(self.model.gguf)
            table = table_for(spec) if isinstance(spec, ArchSpec) else None
            if table is None:
                raise Unsupported("no arch table for this model: cannot name its HF parameters")
            present = self.model.gguf.tensors
            params = {n: p for n, p in hf_params(spec, table, present).items()  # absent optional rows dropped
                      if all(e.name in present for e in p.group.inputs.values())}
            if "lm_head.weight" not in params and "model.embed_tokens.weight" in params:
                params["lm_head.weight"] = params["model.embed_tokens.weight"]
            self._hf = (spec, params)
        return self._hf

    def _gguf_tensor(self, name: str) -> Tensor:
        if name.startswith("blk."):
            layer, short = name[4:].split(".", 1)
            return self.model.weights.layer(int(layer))[short]
        return self.model.weights.tensor(name)

    def weight(self, hf_name: str, *, rank: int = 0) -> np.ndarray:
        if not self.capabilities.weights:
            raise Unsupported(self.capabilities.why_not("weights"))
        from ggufcheck.arch.transforms import TRANSFORMS
        from ggufcheck.sharding.rules import shard

        spec, params = self._hf_index()
        param = params.get(hf_name)
        if param is None:
            raise Unsupported(f"no parameter {hf_name!r} in this model")
        values = {role: self._gguf_tensor(e.name).to(torch.float32) for role, e in param.group.inputs.items()}
        hf = TRANSFORMS[param.group.transform].to_hf(values, spec, param.group.hf_name)
        full = hf[hf_name] if hf_name in hf else next(iter(hf.values()))
        n_kv = 0 if spec.mla is not None else spec.n_head_kv
        return shard(full, param.rule, rank, self.capabilities.tp_size, n_kv).numpy()


def _reasons(why: dict[str, str]):
    from ggufcheck.engines.base import reasons

    return reasons(**why)


class FlatOutputEngine(FlatDistribution):
    """Near-uniform served distributions over healthy internals (catalog #18): the layers
    and weights are right, the output is garbage, so only the served checks can name it."""

    def layer_outputs(self, tokens: Sequence[int], kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        return self.inner.layer_outputs(tokens, kinds)

    def weight(self, hf_name: str, *, rank: int = 0) -> np.ndarray:
        return self.inner.weight(hf_name, rank=rank)


# ----------------------------------------------------------------------------- the faults
@dataclass(frozen=True)
class Fault:
    """One known bug: what it is, where it shows, what the diagnosis must name."""

    name: str
    component: str  # the verdict with every capability exposed (vocabulary name)
    description: str
    archs: frozenset[str]
    stage: str  # the stage that must name it: "weights", "layers", "paths" or "logits"
    build: Callable[..., tuple[ModelPatch, int | None]] = field(repr=False, compare=False)
    layers_component: str | None = None  # what the layers stage names when weights are hidden
    per_layer: bool = False  # the fault sits in ONE layer (``layer=`` chooses which)

    def applies_to(self, arch: str) -> bool:
        return arch in self.archs

    def layer_for(self, cfg: ReferenceConfig, layer: int | None = None) -> int | None:
        """The layer the fault shows in first for this model (``layer`` overrides a per-layer default)."""
        return _FIRST_LAYER[self.name](cfg, layer)


def _last(cfg: ReferenceConfig, layer: int | None) -> int:
    return cfg.n_layer - 1 if layer is None else layer


def _first_moe(cfg: ReferenceConfig, layer: int | None) -> int:
    return cfg.n_dense_lead if layer is None else layer


def _zero(cfg: ReferenceConfig, layer: int | None) -> int:
    return 0


def _none(cfg: ReferenceConfig, layer: int | None) -> None:
    return None


def _build_kv_b_tp(cfg: ReferenceConfig, layer: int | None = None, tp: int = 2, **_: Any) -> ModelPatch:
    return ModelPatch(layer_weights=kv_b_layout_patch(KV_B_ALL_K_THEN_V, tp), tp=tp)


def _build_v_then_k(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    return ModelPatch(layer_weights=kv_b_layout_patch(KV_B_V_THEN_K, 1))


def _expert_names(w: Weights) -> list[str]:
    return [n for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                        "ffn_gate_up_exps.weight") if n in w]


def _build_experts_permuted(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    target = _last(cfg, layer)
    if not cfg.is_moe_layer(target):
        raise UsageError(f"layer {target} is not an MoE layer")
    perm = torch.roll(torch.arange(cfg.n_expert), 1)  # slot e holds expert e-1: every expert moved

    def patch(c: ReferenceConfig, i: int, w: Weights) -> Weights:
        if i != target:
            return w
        return dict(w, **{n: w[n][perm] for n in _expert_names(w)})

    return ModelPatch(layer_weights=patch)


def _build_router_bias_ignored(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    def patch(c: ReferenceConfig, i: int, w: Weights) -> Weights:
        return {k: v for k, v in w.items() if k != "exp_probs_b.bias"}

    return ModelPatch(layer_weights=patch)


def _build_router_bias_zeros(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    target = _first_moe(cfg, layer)

    def patch(c: ReferenceConfig, i: int, w: Weights) -> Weights:
        if i != target or "exp_probs_b.bias" not in w:
            return w
        return {**w, "exp_probs_b.bias": torch.zeros_like(w["exp_probs_b.bias"])}

    return ModelPatch(layer_weights=patch)


def _build_expert_gate_up_swapped(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    target = _last(cfg, layer)

    def patch(c: ReferenceConfig, i: int, w: Weights) -> Weights:
        if i != target or "ffn_gate_exps.weight" not in w:
            return w
        return {**w, "ffn_gate_exps.weight": w["ffn_up_exps.weight"], "ffn_up_exps.weight": w["ffn_gate_exps.weight"]}

    return ModelPatch(layer_weights=patch)


def _build_decode_matvec(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    """One layer's FFN down projection wrong on one-token steps only: the second half of each
    32-value block of its input negated (a matrix-vector kernel bug; the batched path is right)."""
    target = _last(cfg, layer)

    def patch(c: ReferenceConfig, i: int, w: Weights) -> Weights:
        name = next((n for n in ("ffn_down.weight", "ffn_down_exps.weight") if n in w), None)
        if i != target or name is None:
            return w
        t = w[name].clone()
        blocks = t.reshape(*t.shape[:-1], -1, 32)
        blocks[..., 16:] = -blocks[..., 16:]
        return {**w, name: blocks.reshape(t.shape)}

    return ModelPatch(decode_layer_weights=patch)


def _build_scale_twice(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    return ModelPatch(config={"expert_weights_scale": cfg.expert_weights_scale ** 2})


def _build_scale_never(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    return ModelPatch(config={"expert_weights_scale": 1.0})


def _build_rope_swapped(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    return ModelPatch(config={"rope_mode": "neox" if cfg.rope_mode == "norm" else "norm"})


def wrong_eps(eps: float) -> float:
    """The other common eps (1e-5 <-> 1e-6): the realistic wrong value for ``eps``."""
    return 1e-6 if math.isclose(eps, 1e-5, rel_tol=1e-3) else 1e-5


def _build_norm_eps(cfg: ReferenceConfig, layer: int | None = None, eps: float | None = None,
                    **_: Any) -> ModelPatch:
    target = _last(cfg, layer)
    value = wrong_eps(cfg.rms_eps) if eps is None else eps

    def layer_config(c: ReferenceConfig, i: int) -> ReferenceConfig:
        return c.with_options(rms_eps=value) if i == target else c

    return ModelPatch(layer_config=layer_config)


def default_scale_factor(cfg: ReferenceConfig) -> float:
    """The classic wrong softmax scale: MLA scaled by the nope dim only (1/sqrt(P) instead of
    1/sqrt(P+R)); GQA with 1/d instead of 1/sqrt(d)."""
    if cfg.is_mla:
        return math.sqrt((cfg.qk_nope + cfg.qk_rope) / cfg.qk_nope)
    return 1.0 / math.sqrt(cfg.head_dim_k)


def _build_attention_scale(cfg: ReferenceConfig, layer: int | None = None, factor: float | None = None,
                           **_: Any) -> ModelPatch:
    f = default_scale_factor(cfg) if factor is None else factor

    def layer_config(c: ReferenceConfig, i: int) -> ReferenceConfig:
        return scaled_config(c, f)

    return ModelPatch(layer_config=layer_config)


def _build_indexer_ignored(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    return ModelPatch(config={"indexer_heads": 0})


def _build_kv_cache(cfg: ReferenceConfig, layer: int | None = None, after: int = 2, **_: Any) -> ModelPatch:
    return ModelPatch(decode_corrupt_after=after)


def _build_chunk_context(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    return ModelPatch(chunk_context_lost=() if layer is None else (layer,))


def _build_qk_perm_missing(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    from ggufcheck.arch.transforms import llama_permute

    # The loader holds the GGUF rows W_g as HF q_proj (HF's NEOX rope); in the reference's
    # GGUF layout (NORM rope) that parameter is permute(W_g).
    def patch(c: ReferenceConfig, i: int, w: Weights) -> Weights:
        return dict(w, **{"attn_q.weight": llama_permute(w["attn_q.weight"], c.n_head),
                          "attn_k.weight": llama_permute(w["attn_k.weight"], c.n_head_kv)})

    return ModelPatch(layer_weights=patch)


def _build_block_scale(cfg: ReferenceConfig, layer: int | None = None, tensor: str | None = None,
                       mode: str = "huge", block: int = 0, **_: Any) -> ModelPatch:
    target = tensor or f"blk.{_last(cfg, layer)}.attn_output.weight"
    if mode not in ("huge", "nan"):
        raise UsageError(f"block-scale mode {mode!r}: use 'huge' or 'nan'")

    def hook(name: str, t: Tensor) -> Tensor:
        if name != target:
            return t
        t = t.clone()
        flat = t.view(-1, t.shape[-1])  # [rows, ne0]: a block is 32 consecutive elements of a row
        row, col = divmod(block * 32, flat.shape[1])
        seg = flat[row, col:col + 32]
        flat[row, col:col + 32] = float("nan") if mode == "nan" else seg * 1e4  # scale d corrupted x1e4
        return t

    return ModelPatch(tensor_hook=hook)


def _build_allreduce_doubled(cfg: ReferenceConfig, layer: int | None = None, tp: int = 2, **_: Any) -> ModelPatch:
    """One layer's attention output times the TP size (its o_proj partial sums all-reduced
    twice). The o_proj weight carries the factor here; the engine's weight() must not expose
    it (a doubled all-reduce leaves the loaded weights right), see make_faulty_engine."""
    target = _last(cfg, layer)

    def patch(c: ReferenceConfig, i: int, w: Weights) -> Weights:
        if i != target:
            return w
        return {**w, "attn_output.weight": w["attn_output.weight"] * tp}

    return ModelPatch(layer_weights=patch, tp=tp)


def _build_gating_swapped(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    return ModelPatch(config={"gating": "sigmoid" if cfg.gating == "softmax" else "softmax"})


def _build_window_ignored(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    return ModelPatch(config={"swa_window": 0})


def _build_swa_rope_base(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    return ModelPatch(config={"rope_base_swa": cfg.rope_base})


def _build_sinks_ignored(cfg: ReferenceConfig, layer: int | None = None, **_: Any) -> ModelPatch:
    def patch(c: ReferenceConfig, i: int, w: Weights) -> Weights:
        return {k: v for k, v in w.items() if k != "attn_sinks.weight"}

    return ModelPatch(layer_weights=patch)


def _patch_builders() -> dict[str, Callable[..., ModelPatch]]:
    return {
        "kv-b-all-k-then-v": _build_kv_b_tp, "kv-b-v-before-k": _build_v_then_k,
        "experts-permuted": _build_experts_permuted, "router-bias-ignored": _build_router_bias_ignored,
        "router-bias-zeros": _build_router_bias_zeros, "expert-gate-up-swapped": _build_expert_gate_up_swapped,
        "routed-scale-twice": _build_scale_twice, "routed-scale-never": _build_scale_never,
        "rope-pairing-swapped": _build_rope_swapped, "norm-eps-wrong": _build_norm_eps,
        "attention-scale-wrong": _build_attention_scale, "indexer-ignored": _build_indexer_ignored,
        "kv-cache-corrupt-decode": _build_kv_cache, "qk-permutation-missing": _build_qk_perm_missing,
        "block-scale-corrupted": _build_block_scale, "allreduce-doubled": _build_allreduce_doubled,
        "gating-swapped": _build_gating_swapped, "sliding-window-ignored": _build_window_ignored,
        "swa-rope-base-wrong": _build_swa_rope_base, "attention-sinks-ignored": _build_sinks_ignored,
        "chunk-context-lost": _build_chunk_context, "decode-matvec-wrong": _build_decode_matvec,
    }


_FIRST_LAYER: dict[str, Callable[[ReferenceConfig, int | None], int | None]] = {
    "kv-b-all-k-then-v": _zero, "kv-b-v-before-k": _zero, "experts-permuted": _last,
    "router-bias-ignored": _first_moe, "router-bias-zeros": _first_moe, "expert-gate-up-swapped": _last,
    "routed-scale-twice": _first_moe, "routed-scale-never": _first_moe,
    "rope-pairing-swapped": _zero, "norm-eps-wrong": _last, "attention-scale-wrong": _zero,
    "indexer-ignored": _zero, "kv-cache-corrupt-decode": _none, "flat-output": _none,
    "qk-permutation-missing": _zero, "block-scale-corrupted": _last, "allreduce-doubled": _last,
    "gating-swapped": _first_moe, "sliding-window-ignored": _zero, "swa-rope-base-wrong": _zero,
    "attention-sinks-ignored": _zero, "chunk-context-lost": _none, "decode-matvec-wrong": _last,
}


def _f(name: str, component: str, archs: frozenset[str], stage: str, description: str,
       layers_component: str | None = None, per_layer: bool = False) -> Fault:
    build = _patch_builders().get(name)
    return Fault(name, component, description, archs, stage, build, layers_component, per_layer)


FAULTS: dict[str, Fault] = {f.name: f for f in (
    _f("kv-b-all-k-then-v", "mla-kv-b", MLA_ARCHS, "weights",
       "kv_b rebuilt as [all K; all V] with the split patched to w[:Hl*P], w[Hl*P:], under TP `tp` (default 2): "
       "exact at TP 1, rank r computes with the wrong rows at TP > 1 (catalog #21)", layers_component="mla-kv-b"),
    _f("kv-b-v-before-k", "mla-kv-b", MLA_ARCHS, "weights",
       "kv_b rebuilt with each head's V rows before its K rows, split as [K; V]", layers_component="mla-kv-b"),
    _f("experts-permuted", "moe-experts", MOE_ARCHS, "layers",
       "one MoE layer's stacked experts rolled by one slot (router unchanged)", per_layer=True,
       layers_component="moe-experts"),
    _f("router-bias-ignored", "moe-router", BIASED_ROUTER_ARCHS, "layers",
       "the selection bias exp_probs_b (e_score_correction_bias) ignored in every MoE layer",
       layers_component="moe-router"),
    _f("router-bias-zeros", "moe-router", BIASED_ROUTER_ARCHS, "weights",
       "the first MoE layer's selection bias exp_probs_b (e_score_correction_bias) loaded as zeros (its key "
       "not matched)", per_layer=True, layers_component="moe-router"),
    _f("expert-gate-up-swapped", "moe-experts", MOE_ARCHS, "weights",
       "the last layer's routed experts computed with gate and up swapped (ffn_gate_exps <-> ffn_up_exps)",
       per_layer=True, layers_component="moe-experts"),
    _f("routed-scale-twice", "moe-router", BIASED_ROUTER_ARCHS, "layers",
       "routed_scaling_factor applied twice (s^2) in every MoE layer", layers_component="moe-router"),
    _f("routed-scale-never", "moe-router", BIASED_ROUTER_ARCHS, "layers",
       "routed_scaling_factor never applied (1.0) in every MoE layer", layers_component="moe-router"),
    _f("rope-pairing-swapped", "rope", ALL_ARCHS, "layers",
       "rope pairing NORM <-> NEOX swapped everywhere (weights right)", layers_component="rope"),
    _f("norm-eps-wrong", "norm", ALL_ARCHS, "layers",
       "RMSNorm eps of one layer 1e-5 <-> 1e-6 (`eps=` to choose)", per_layer=True, layers_component="norm"),
    _f("attention-scale-wrong", "attention", ALL_ARCHS, "layers",
       "softmax scale: MLA 1/sqrt(P) instead of 1/sqrt(P+R); GQA 1/d instead of 1/sqrt(d) (`factor=`)",
       layers_component="attention"),
    _f("indexer-ignored", "indexer", frozenset({"glm-dsa"}), "layers",
       "DSA indexer ignored: dense causal attention (differs once a query sees more than top_k keys)",
       layers_component="indexer"),
    _f("kv-cache-corrupt-decode", "decode", ALL_ARCHS, "paths",
       "decode writes the KV cache to the wrong slot from decode step `after` (default 2); prefill correct"),
    _f("chunk-context-lost", "prefill", ALL_ARCHS, "paths",
       "a chunked prefill reads the earlier chunks' KV cache as zeros (`layer=` one layer, default all); one "
       "prefill and decode correct (catalog #7-#9: a context chunk's attention lost in the merge)"),
    _f("decode-matvec-wrong", "decode", ALL_ARCHS, "paths",
       "one layer's FFN down projection (default the last layer's) wrong on one-token decode steps only (a "
       "matrix-vector kernel fault: half of each 32-value block negated); prefill and chunks right",
       per_layer=True),
    _f("flat-output", "output", ALL_ARCHS, "logits",
       "near-uniform served distributions over healthy layers (engines.faults.FlatDistribution)"),
    _f("qk-permutation-missing", "rope", frozenset({"llama"}), "weights",
       "llama attn_q / attn_k loaded without undoing the converter's permutation (HF NEOX rope on NORM rows)",
       layers_component="rope"),
    _f("block-scale-corrupted", "weights", ALL_ARCHS, "weights",
       "one 32-element quant block of a loaded weight (default the last layer's attn_output) scaled x1e4 "
       "(`mode='nan'`: NaN)", per_layer=True, layers_component="attention"),
    # not gemma3: its post-attention RMSNorm is scale-invariant, so a doubled partial sum before
    # it changes nothing the model computes (measured: healthy verdict, benchmarks/fidelity.py)
    _f("allreduce-doubled", "sharding", ALL_ARCHS - GEMMA_ARCHS, "layers",
       "one layer's attention output all-reduced twice under TP `tp` (default 2): x TP size, weights right",
       per_layer=True, layers_component="sharding"),
    _f("gating-swapped", "moe-router", MOE_ARCHS, "layers",
       "the router's gating function swapped (softmax <-> sigmoid; an absent expert_gating_func read "
       "another way than the model was trained)", layers_component="moe-router"),
    _f("sliding-window-ignored", "attention", SWA_ARCHS, "layers",
       "the sliding-window layers (gemma3, gpt-oss) attend to every earlier position (the window ignored; "
       "shows once a prompt is longer than the window)", layers_component="attention"),
    _f("swa-rope-base-wrong", "rope", GEMMA_ARCHS, "layers",
       "gemma3's sliding-window layers rotate with the global rope base (1e6) instead of their own (1e4)",
       layers_component="rope"),
    _f("attention-sinks-ignored", "attention", SINK_ARCHS, "layers",
       "gpt-oss's per-head attention sinks left out of the softmax (an engine without sink support)",
       layers_component="attention"),
)}


def make_faulty_engine(name: str, model_path: str | Path, *, dtype: str = "fp32", layer: int | None = None,
                       expose_weights: bool = True, **kw: Any) -> Engine:
    """A healthy-model-derived engine carrying fault ``name`` (a key of :data:`FAULTS`).

    ``dtype`` "fp32" (default) or "fp64"; ``layer`` picks the layer of a per-layer fault
    (default: the last layer, so earlier layers must pass); fault options: ``tp`` (kv-b),
    ``eps`` (norm), ``factor`` (scale), ``after`` (kv-cache), ``tensor`` / ``mode`` /
    ``block`` (block scale), ``temperature`` (flat). Raises UsageError for an unknown fault
    or one that does not apply to the model's architecture.
    """
    if name not in FAULTS:
        raise UsageError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    fault = FAULTS[name]
    if name == "flat-output":
        inner = ReferenceEngine(model_path, dtype=dtype)
        engine = FlatOutputEngine(inner, temperature=kw.get("temperature", 50.0))
        engine.name = f"reference {dtype} with fault flat-output ({Path(model_path).name})"
        return engine
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.reference.config import config_from_gguf

    with open_gguf(model_path) as g:
        cfg = config_from_gguf(g.metadata, g.tensors, str(g.path))
    if not fault.applies_to(cfg.arch):
        raise UsageError(f"fault {name!r} does not apply to architecture {cfg.arch!r} "
                         f"(applies to {', '.join(sorted(fault.archs))})")
    patch = fault.build(cfg, layer=layer, **kw)
    if name == "allreduce-doubled":
        expose_weights = False  # the factor is carried by o_proj here; a real one leaves weights right
    return FaultyReferenceEngine(model_path, fault, patch, dtype=dtype, expose_weights=expose_weights)


def fault_layer(name: str, model_path: str | Path, layer: int | None = None) -> int | None:
    """The layer the diagnosis must name for fault ``name`` on this model (None: no layer)."""
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.reference.config import config_from_gguf

    with open_gguf(model_path) as g:
        cfg = config_from_gguf(g.metadata, g.tensors, str(g.path))
    return FAULTS[name].layer_for(cfg, layer)


# ------------------------------------------------------------ engines for harness self-tests
def wrong_kernel_engine(model_path: str | Path, qtype: str = "Q4_K", dtype: str = "fp32") -> Engine:
    """The reference, except that every matrix stored as ``qtype`` multiplies with the second
    half of each 256-value block negated: a kernel that is wrong for one quant type only, the
    fault the kernel matrix (``ggufcheck quants``) exists to find. Other types are untouched."""
    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(model_path) as g:
        targets = {n for n, t in g.tensors.items() if t.qtype.name == qtype and len(t.ne) >= 2 and t.ne[0] % 256 == 0}

    def hook(name: str, t: Tensor) -> Tensor:
        if name not in targets:
            return t
        t = t.clone()
        blocks = t.reshape(-1, 256)
        blocks[:, 128:] = -blocks[:, 128:]
        return blocks.reshape(t.shape)

    fault = Fault("quant-kernel-wrong", "dequant", f"{qtype} matmuls with half of each block negated",
                  frozenset(), "logits", build=lambda *a, **k: ModelPatch())
    engine = FaultyReferenceEngine(model_path, fault, ModelPatch(tensor_hook=hook), dtype=dtype)
    engine.name = f"reference {dtype} with a wrong {qtype} kernel ({Path(model_path).name})"
    return engine


def q4_k_kernel_wrong(model_path: str | Path) -> Engine:
    """``--engine python:ggufcheck.testing.faults:q4_k_kernel_wrong``: see wrong_kernel_engine."""
    return wrong_kernel_engine(model_path, "Q4_K")


CUDA_FORMS = dict(block_sums="cuda-mmq", decode_block_sums="cuda-mmvq")


def _cuda_emulation(model_path: str | Path):
    from dataclasses import replace

    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.gguf.matmuls import matmul_weight_types
    from ggufcheck.reference.precision import Emulation, emulation_for

    with open_gguf(model_path) as g:
        types = matmul_weight_types(g.tensors)
    plain = emulation_for("q8", types) or Emulation()
    # CUDA's q8_1 has 32-value blocks for every quant type (the CPU's Q8_K 256 for K-quants)
    return replace(plain, activations="q8_0" if plain.activations else None, **CUDA_FORMS)


def cuda_q8_1_sums_engine(model_path: str | Path) -> Engine:
    """The reference computing as llama.cpp's CUDA backend does (activations in 8-bit 32-blocks,
    each kernel's q8_1 sums: precision.SUMS_FORMS; batches of up to 8 tokens in the matrix-vector
    kernels' form), KV cache in f16, while it states only the CPU's plain rounding: the kernel
    matrix must find the types and paths whose arithmetic is not what the engine states
    (Q4_0 / Q5_0 decode, Q4_1 / Q5_1 both, Q2_K prefill) and pass the others."""
    from dataclasses import replace

    engine = ReferenceEngine(model_path, dtype="fp32", emulate=_cuda_emulation(model_path))
    engine.capabilities = replace(engine.capabilities, activation_dtype="q8")  # stated rounding: the plain one
    engine.name = f"reference fp32 with CUDA's q8_1 sums, stating the CPU's rounding ({Path(model_path).name})"
    return engine


def cuda_arithmetic_engine(model_path: str | Path) -> Engine:
    """The same CUDA arithmetic, stated as it is (Capabilities.rounding, as engines.llama_cpp.
    gpu_rounding states it for a CUDA build): every type must land near 1x its stated arithmetic."""
    from dataclasses import asdict, replace

    emulation = _cuda_emulation(model_path)
    engine = ReferenceEngine(model_path, dtype="fp32", emulate=emulation)
    stated = {k: v for k, v in asdict(emulation).items() if v is not None and k != "decode_batch_max"}
    engine.capabilities = replace(engine.capabilities, activation_dtype="q8", rounding=stated)
    engine.name = f"reference fp32 with CUDA's q8_1 sums, stated ({Path(model_path).name})"
    return engine


def subtle_matvec_engine(model_path: str | Path, qtype: str = "Q5_K", error: float = 0.6) -> Engine:
    """The CUDA arithmetic engine (stated), except that on one-token decode steps every matrix
    stored as ``qtype`` multiplies with a relative error of ``error`` per weight (fixed noise): a
    matrix-vector kernel slightly wrong for one type, far inside the class allowance and far
    outside its own arithmetic (issue 36's Q5_K case)."""
    import torch

    from ggufcheck.gguf.reader import open_gguf

    engine = cuda_arithmetic_engine(model_path)
    with open_gguf(model_path) as g:
        types = {name.split(".", 2)[-1]: t.qtype.name for name, t in g.tensors.items() if name.startswith("blk.")}

    def patch(cfg, i, w):
        out = dict(w)
        for key, value in w.items():
            if types.get(key) == qtype and isinstance(value, torch.Tensor) and value.dim() == 2:
                noise = torch.randn(value.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                out[key] = value * (1 + error * noise.to(value.dtype))
        return out

    fault = Fault("matvec-subtle", "dequant", f"{qtype} matrix-vector products off by {error:g} per weight",
                  frozenset(), "decode", build=lambda *a, **k: ModelPatch())
    faulty = FaultyReferenceEngine(model_path, fault, ModelPatch(decode_layer_weights=patch), dtype="fp32",
                                   emulate=engine.model.emulation)
    faulty.capabilities = engine.capabilities
    faulty.name = f"reference fp32 with a {qtype} matrix-vector kernel off by {error:g} ({Path(model_path).name})"
    engine.close()
    return faulty


def q5_k_matvec_subtle(model_path: str | Path) -> Engine:
    """``--engine python:ggufcheck.testing.faults:q5_k_matvec_subtle``: see subtle_matvec_engine."""
    return subtle_matvec_engine(model_path, "Q5_K")


def f16_experts_cublas_engine(model_path: str | Path, stated: int = 1) -> Engine:
    """F16 matrices off on one-token steps (as cuBLAS's F16 compute type makes llama.cpp CUDA's
    F16 routed experts on a decode step: half-precision sums), the engine stating it
    (``stated=1``: Emulation.decode_unemulated, as engines.llama_cpp.gpu_rounding does for F16
    experts) or not (``stated=0``): the kernel matrix must judge the stated one's decode by its
    class allowance alone, and name the other's."""
    from dataclasses import replace

    from ggufcheck.engines.llama_cpp import CUDA_F16_EXPERTS_DECODE

    engine = subtle_matvec_engine(model_path, "F16", error=0.015)
    if int(stated):
        engine.capabilities = replace(engine.capabilities, rounding={**engine.capabilities.rounding,
                                                                     "decode_unemulated": CUDA_F16_EXPERTS_DECODE})
    return engine


def flash_attention_fault(model_path: str | Path, flash_attn: int = 1) -> Engine:
    """``--engine python:ggufcheck.testing.faults:flash_attention_fault[:flash_attn=0|1]``: an
    engine with a setting, as llama.cpp's flash_attn: with 1 its attention is wrong (the
    attention-scale-wrong fault, in the last layer), with 0 it is the healthy fp32 reference. It
    declares the setting (Capabilities.switches): the switch stage must find that flipping it
    makes the failure go away (checks.switches)."""
    from dataclasses import replace

    from ggufcheck.engines.base import Switch

    if not int(flash_attn):
        engine = ReferenceEngine(model_path, dtype="fp32")
        engine.name = f"reference fp32, flash_attn=0 ({Path(model_path).name})"
        return engine
    engine = make_faulty_engine("attention-scale-wrong", model_path)
    engine.capabilities = replace(engine.capabilities, switches=(
        Switch({"flash_attn": 0}, {"flash_attn": 1}, "the flash-attention path", "attention"),))
    engine.name = f"reference fp32 with a wrong flash-attention kernel ({Path(model_path).name})"
    return engine


def crashing_engine(model_path: str | Path) -> Engine:
    """The fp32 reference that prints to fd 1 when scoring and dies of SIGSEGV when asked to
    generate, as a native library can: for the isolated-engine tests (engines.isolated)."""
    import os
    import signal

    class Crashing(ReferenceEngine):
        def score(self, tokens, *, top_k=20):
            os.write(1, b"native noise on stdout\n")
            return super().score(tokens, top_k=top_k)

        def generate(self, prompt, max_new_tokens, *, top_k=20):
            os.kill(os.getpid(), signal.SIGSEGV)

    return Crashing(model_path, dtype="fp32")
