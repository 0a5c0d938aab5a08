"""The ``layers`` stage: which layer first computes something wrong, and which part of it.

1. Per layer, the engine's residual stream (layer output) against the fp64 reference on the
   same tokens: relative error ``||a - b|| / ||b||`` per position, max over positions and
   prompts. Its limit is the honest baseline: the fp32 reference's error against fp64 for
   the same layer, times :attr:`LayerOptions.multiple`, never below
   :attr:`LayerOptions.floor`, and for engines whose activations are bf16 / fp16 / q8 never
   below the stated allowance of that class (a reference run cannot reproduce their
   rounding). glm-dsa: positions where the reference marks an indexer top-k boundary TIE
   (either set is correct) are left out from that layer on, and the later positions that
   read their keys from the next layer on. The first layer over its limit is where the
   bisection looks.
2. Inside that layer, errors must not carry over: the reference layer is REPLAYED on the
   engine's own input to it (``ReferenceModel`` family code, fp64; fp32 replay for the
   baseline), and the attention block and the FFN / MoE block are compared separately (the
   FFN replay reads the engine's own post-attention residual). Then:
   - MoE: router agreement (expert-set Jaccard vs the replay, positions whose K-th and
     (K+1)-th selection scores are within a tie margin left out) -> "moe-router"; a routed
     output that is the reference's times a constant (a routed-scale bug) -> "moe-router";
     otherwise "moe-experts" (the router agrees or is not exposed). Dense: "ffn".
   - glm-dsa: indexer top-k overlap as SETS, positions the reference marks as boundary ties
     left out -> "indexer".
   - Attention: where the engine exposes its rope call, the rope kernel is checked on the
     engine's own q / k against the reference angles (``checks/rope.py``) -> "rope".
   - Finer attribution only by positive identification: the engine's block equals, within
     the same baseline, the reference block with ONE named change: rope pairing swapped ->
     "rope"; another RMS eps (a grid of powers of ten) -> "norm"; kv_b under a known wrong TP layout ->
     "mla-kv-b"; dense instead of sparse attention -> "indexer"; bias-free routing ->
     "moe-router"; the block's output times an integer >= 2 (the TP size: a doubled
     all-reduce) -> "sharding". Nothing matched -> the block ("attention", "ffn", "moe-experts").
   When every block of the first diverging layer replays within its baseline (the layer
   itself is right and only amplifies an earlier near-limit error), the next layers are
   examined the same way (up to :attr:`LayerOptions.max_replays`); if none localizes, the
   residual divergence is accumulated drift (a PASS saying so) unless the engine's own
   tensors show a layer's output is not its input plus its blocks (a broken residual
   connection: "output").

Shapes: residuals, attention and FFN outputs [T, D]; router ids [T, K]; top-k [T, k].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ggufcheck.checks.logits import INDEXER_TIE_MARGINS, ROUTER_TIE_MARGINS
from ggufcheck.checks.rope import rope_result
from ggufcheck.engines.base import Unsupported
from ggufcheck.results import Result, StageReport, failed, passed, skipped

STAGE = "layers"
# RMS eps values tried as the "norm" hypothesis: the ones real configs use (1e-5, 1e-6) and
# the powers of ten around them; a match needs the block to agree to fp32 noise, so a wider
# grid does not make an unrelated bug look like a norm one.
EPS_CANDIDATES = (1e-5, 1e-6, 1e-4, 1e-3, 1e-2, 1e-8, 1e-12)


@dataclass(frozen=True)
class LayerOptions:
    """Thresholds of the layers stage (module docstring says how each is used)."""

    multiple: float = 10.0  # engine error may be this many times the fp32 baseline error
    # ... or this many times the error of a baseline run that emulates the engine's precision
    # class (reference.precision): that one is already the size of a correct engine's error
    emulated_multiple: float = 3.0
    floor: float = 2e-6  # relative error always accepted (about 16 fp32 roundings)
    # Activation classes whose rounding a reference run cannot reproduce: relative error
    # accepted regardless of the baseline. ``allowances``: one block replayed on the engine's
    # own input (local); ``residual_allowances``: the residual stream, which accumulates over
    # depth. q8 measured: SmolLM2-135M Q4_1 on llama.cpp CPU (30 layers, the 4 built-in prompts,
    # tools/measure_allowances.py --engines llama-cpp): local attention up to 0.092 and FFN 0.047
    # over all layers (0.0096 / 0.011 at layer 0), residual up to 0.070.
    # bf16 / fp16 measured (tools/measure_allowances.py, transformers 5.2 on this CPU and 5.17
    # on the H200, CPU and CUDA; 4 prompts; docs/thresholds.md): SmolLM2 local attention up to
    # 0.043 / 0.0061, FFN 0.012 / 0.0018, residual up to 0.137 / 0.017 (bf16 on CUDA, layer 10);
    # tiny deepseek2 and glm-dsa below those. The limits are 2-3x the worst.
    allowances: dict[str, float] = field(default_factory=lambda: {"bf16": 1e-1, "fp16": 1.5e-2, "q8": 2e-1})
    residual_allowances: dict[str, float] = field(default_factory=lambda: {"bf16": 3e-1, "fp16": 4e-2,
                                                                           "q8": 1.5e-1})
    # DSA top-k boundaries closer than this (relative gap, reference.dsa.boundary_gap) may flip
    # in a correct engine of that class: those positions are left out like exact ties.
    indexer_tie_margins: dict[str, float] = field(default_factory=lambda: dict(INDEXER_TIE_MARGINS))
    router_min_jaccard: float = 0.95  # mean expert-set Jaccard over untied positions
    router_tie_margin: float = 1e-5  # selection scores closer than this are a tie (fp32 / fp64 engines)
    # the same for engines whose rounding moves the selection scores (O(1) sigmoid values) more
    router_tie_margins: dict[str, float] = field(default_factory=lambda: dict(ROUTER_TIE_MARGINS))
    indexer_min_overlap: float = 0.95  # mean top-k set overlap over untied positions
    scale_fit_tolerance: float = 1e-3  # |alpha - 1| below this is no scale error
    max_replays: int = 3  # layers replayed after the first diverging one when it localizes nothing


# ------------------------------------------------------------------------------- metrics
def rel_errors(got: Tensor, want: Tensor) -> Tensor:
    """Per-position ||got - want|| / ||want|| [T] (float64; inf where got is not finite)."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    num = (got - want).norm(dim=-1)
    den = want.norm(dim=-1)
    den = den.clamp_min(max(float(den.mean()) * 1e-6, 1e-300))
    err = num / den
    return torch.where(torch.isfinite(got).all(dim=-1), err, torch.full_like(err, math.inf))


@dataclass
class _Err:
    """Max relative error over prompts and positions, and where it is."""

    value: float = 0.0
    sequence: int | None = None
    position: int | None = None
    element: int | None = None

    def update(self, errs: Tensor, got: Tensor, want: Tensor, seq: int, keep: Tensor | None = None) -> None:
        if keep is not None:
            errs = torch.where(keep, errs, torch.zeros_like(errs))
        if errs.numel() == 0:
            return
        t = int(torch.argmax(torch.nan_to_num(errs, nan=math.inf)))
        v = float(errs[t])
        if math.isnan(v):
            v = math.inf
        if v > self.value or self.sequence is None:
            diff = (got[t].to(torch.float64) - want[t].to(torch.float64)).abs()
            diff = torch.nan_to_num(diff, nan=math.inf)
            self.value, self.sequence, self.position, self.element = v, seq, t, int(torch.argmax(diff))

    def worst(self) -> dict[str, Any] | None:
        if self.sequence is None:
            return None
        return {"sequence": self.sequence, "position": self.position, "element": self.element}


def _limit(baseline: float, opts: LayerOptions, allowance: float) -> float:
    return max(opts.multiple * baseline, opts.floor, allowance)


# ------------------------------------------------------------------------------- replay
def _ffn_parts(cfg, w: dict[str, Tensor], after_attn: Tensor, layer: int):
    """The FFN / MoE block on ``after_attn`` [T, D]: (out, routed, shared, ids, routing gap [T])."""
    from ggufcheck.reference.layers import moe, rms_norm, swiglu

    norm = w["ffn_norm.weight"] if "ffn_norm.weight" in w else w["post_attention_norm.weight"]
    x = rms_norm(after_attn, norm, cfg.rms_eps)
    if not cfg.is_moe_layer(layer):
        return swiglu(x, w["ffn_gate.weight"], w["ffn_up.weight"], w["ffn_down.weight"]), None, None, None, None
    from ggufcheck.reference.layers import route, router_gap

    ids, weights = route(x, w["ffn_gate_inp.weight"], w.get("exp_probs_b.bias"), cfg)
    gap = router_gap(x, w["ffn_gate_inp.weight"], w.get("exp_probs_b.bias"), cfg, ids)  # [T]: for tie margins
    if "ffn_gate_up_exps.weight" in w:
        gate_up = w["ffn_gate_up_exps.weight"]  # [E, 2F, D]
        gate, up = gate_up[:, : cfg.n_ff_exp], gate_up[:, cfg.n_ff_exp:]
    else:
        gate, up = w["ffn_gate_exps.weight"], w["ffn_up_exps.weight"]
    routed = moe(x, ids, weights, gate, up, w["ffn_down_exps.weight"])
    shared = None
    if "ffn_gate_shexp.weight" in w:
        shared = swiglu(x, w["ffn_gate_shexp.weight"], w["ffn_up_shexp.weight"], w["ffn_down_shexp.weight"])
    out = routed if shared is None else routed + shared
    return out, routed, shared, ids, gap


class _Replayer:
    """Replays of one reference layer (fp64, and fp32 for baselines) on given inputs."""

    def __init__(self, ref, layer: int):
        self.ref, self.layer = ref, layer
        self.w = ref.weights.layer(layer)

    def attention(self, h_in: Tensor, shared_topk: Tensor | None, cfg=None,
                  weights: Callable | None = None):
        """Run the whole layer (family code) on h_in; the LayerOutput (attn_out, topk, ...)."""
        from ggufcheck.reference.cache import LayerCache

        ref = self.ref
        cfg = ref.cfg if cfg is None else cfg
        w = self.w if weights is None else weights(cfg, self.layer, dict(self.w))
        h = h_in.to(dtype=ref.dtype, device=ref.device)
        pos = torch.arange(h.shape[0], device=ref.device)
        shared = {} if shared_topk is None else {"topk": shared_topk.to(ref.device)}
        with torch.no_grad():
            return ref.family.forward_layer(cfg, self.layer, w, h, ref.rope(pos), pos, pos, LayerCache(), shared)

    def ffn(self, after_attn: Tensor, cfg=None, weights: Callable | None = None):
        ref = self.ref
        cfg = ref.cfg if cfg is None else cfg
        w = self.w if weights is None else weights(cfg, self.layer, dict(self.w))
        with torch.no_grad():
            return _ffn_parts(cfg, w, after_attn.to(dtype=ref.dtype, device=ref.device), self.layer)

    def close(self) -> None:
        self.ref.weights.release(self.layer)


def _hypotheses_attention(cfg) -> list[tuple[str, str, dict | None, Callable | None]]:
    """(component, what changed, config changes, weight transform) for the attention block."""
    from ggufcheck.sharding import faults

    out: list[tuple[str, str, dict | None, Callable | None]] = [
        ("rope", f"rope pairing {'NEOX' if cfg.rope_mode == 'norm' else 'NORM'} instead of "
                 f"{cfg.rope_mode.upper()}", {"rope_mode": "neox" if cfg.rope_mode == "norm" else "norm"}, None),
    ]
    for eps in EPS_CANDIDATES:
        if not math.isclose(eps, cfg.rms_eps, rel_tol=1e-3):
            out.append(("norm", f"RMSNorm eps {eps:g} instead of {cfg.rms_eps:.3g}", {"rms_eps": eps}, None))
    if cfg.is_mla:
        for eps in EPS_CANDIDATES:
            if not math.isclose(eps, cfg.lora_norm_eps, rel_tol=1e-3):
                out.append(("norm", f"q_a / kv_a RMSNorm eps {eps:g} instead of {cfg.lora_norm_eps:.3g} (transformers' "
                                    f"DeepSeek-V3 / GLM-DSA code hard-codes 1e-6)", {"lora_norm_eps": eps}, None))
        for tp in (2, 4, 8):
            if cfg.n_head % tp == 0:
                out.append(("mla-kv-b", f"kv_b as [all K; all V] with a patched split under TP {tp}", None,
                            faults.kv_b_layout_patch(faults.KV_B_ALL_K_THEN_V, tp)))
        out.append(("mla-kv-b", "kv_b with V rows before K rows inside each head", None,
                    faults.kv_b_layout_patch(faults.KV_B_V_THEN_K, 1)))
    if cfg.has_indexer:
        out.append(("indexer", "dense causal attention instead of the DSA top-k (indexer ignored)",
                    {"indexer_heads": 0}, None))
    return out


def _hypotheses_ffn(cfg, moe_layer: bool) -> list[tuple[str, str, dict | None, Callable | None]]:
    out: list[tuple[str, str, dict | None, Callable | None]] = []
    for eps in EPS_CANDIDATES:
        if not math.isclose(eps, cfg.rms_eps, rel_tol=1e-3):
            out.append(("norm", f"RMSNorm eps {eps:g} instead of {cfg.rms_eps:.3g}", {"rms_eps": eps}, None))
    if moe_layer:
        out.append(("moe-router", "routing without the selection bias exp_probs_b", None,
                    lambda c, i, w: {k: v for k, v in w.items() if k != "exp_probs_b.bias"}))
        other = "sigmoid" if cfg.gating == "softmax" else "softmax"
        how = f"{other} router gating instead of {cfg.gating}"
        if not cfg.gating_in_file:
            how += (f" (the file has no expert_gating_func: llama.cpp reads {cfg.gating}, the {cfg.arch} default; "
                    f"a model trained with {other} needs the key written)")
        out.append(("moe-router", how, {"gating": other}, None))
    return out


# ------------------------------------------------------------------------------- the stage
def run_layers_stage(engine, reference, tokens_list: Sequence[Sequence[int]], baseline_reference=None,
                     options: LayerOptions | None = None, progress: Callable[[str], None] | None = None) -> StageReport:
    """Bisect the layers of ``engine`` against ``reference`` (a fp64 ReferenceModel).

    ``baseline_reference`` (a fp32 ReferenceModel of the same file) gives the per-layer
    baselines; without it only the floor and the activation class allowance apply.
    """
    opts = options or LayerOptions()
    emulation = getattr(baseline_reference, "emulation", None)
    if emulation is not None:
        opts = replace(opts, multiple=opts.emulated_multiple)
    report = StageReport(STAGE)
    caps = engine.capabilities
    kinds = set(caps.layer_outputs)
    if "residual" not in kinds:
        report.add(skipped(STAGE, "output", caps.why_not("layer_outputs") if not kinds else
                           f"the engine exposes {sorted(kinds)} but not the residual stream"))
        return report
    seqs = [[int(t) for t in s] for s in tokens_list if len(s) >= 1]
    if not seqs:
        report.add(skipped(STAGE, "output", "no token sequences to run"))
        return report
    cfg = reference.cfg
    n_layer = cfg.n_layer
    allowance = opts.allowances.get(caps.activation_dtype, 0.0)
    residual_allowance = opts.residual_allowances.get(caps.activation_dtype, 0.0)
    margin = opts.indexer_tie_margins.get(caps.activation_dtype, 0.0)
    router_margin = opts.router_tie_margins.get(caps.activation_dtype, opts.router_tie_margin)
    want_kinds = [k for k in ("residual", "attention", "ffn", "router", "indexer", "rope") if k in kinds]

    runs = []  # per sequence: (engine trace, reference trace, baseline trace or None)
    shortened = []
    say = progress or (lambda _m: None)
    for n, s in enumerate(seqs):
        say(f"layers: prompt {n + 1}/{len(seqs)} ({len(s)} tokens) on the engine and the reference")
        s, eng = _layer_outputs_that_fit(engine, s, want_kinds)
        if len(s) < len(seqs[n]):
            shortened.append({"prompt": n, "tokens": len(seqs[n]), "used": len(s)})
            seqs[n] = s
        with torch.no_grad():
            ref_trace = reference.prefill(s, trace=True)
            base_trace = baseline_reference.prefill(s, trace=True) if baseline_reference is not None else None
        runs.append((eng, ref_trace, base_trace))

    report.add(_ranks_agree([eng for eng, _r, _b in runs], opts))
    per_layer = []
    errors: list[_Err] = []
    masks = [_tie_masks(ref_trace, n_layer, margin, router_margin) for _e, ref_trace, _b in runs]
    for i in range(n_layer):
        err, base = _Err(), _Err()
        excluded = 0
        for n, (eng, ref_trace, base_trace) in enumerate(runs):
            got = eng.tensors.get(("residual", i))
            if got is None:
                continue
            got = torch.as_tensor(np.asarray(got))
            want = ref_trace.layers[i].hidden
            keep = masks[n][i]
            excluded += int((~keep).sum()) if keep is not None else 0
            err.update(rel_errors(got, want), got, want, n, keep)
            if base_trace is not None:
                b = base_trace.layers[i].hidden
                base.update(rel_errors(b, want), b, want, n, keep)
        errors.append(err)
        limit = _limit(base.value, opts, residual_allowance)
        per_layer.append({"layer": i, "error": err.value, "baseline": base.value, "limit": limit,
                          "ratio": _ratio(err.value, base.value), "tie_excluded_positions": excluded})
    report.info.update(per_layer=per_layer, shortened=shortened, multiple=opts.multiple, floor=opts.floor,
                       allowance=allowance,
                       residual_allowance=residual_allowance,
                       activation_dtype=caps.activation_dtype, prompts=len(seqs),
                       baseline=("none (floor only)" if baseline_reference is None else
                                 f"fp32 reference emulating {emulation.describe()} vs fp64" if emulation is not None
                                 else "fp32 reference vs fp64"))

    first = next((row["layer"] for row in per_layer if not row["error"] <= row["limit"]), None)
    if first is None:
        worst = max(per_layer, key=lambda r: r["error"] / r["limit"])
        report.add(passed("layers.residual", "output",
                          f"all {n_layer} layers within their limits for this precision class (worst layer {worst['layer']}: "
                          f"error {worst['error']:.3g}, limit {worst['limit']:.3g})" + _shortened_note(shortened),
                          stats={"layers": n_layer, "worst_layer": worst["layer"], "error": worst["error"],
                                 "limit": worst["limit"]}))
        return report

    for row in per_layer[:first]:
        report.add(passed("layers.residual", "output",
                          f"layer {row['layer']}: residual error {row['error']:.3g} <= limit {row['limit']:.3g}",
                          layer=row["layer"], stats=_stats(row)))
    found = None
    for i in range(first, min(n_layer, first + 1 + opts.max_replays)):
        say(f"layers: replaying layer {i}/{n_layer - 1} on the engine's own input")
        results, named = _localize(i, runs, reference, baseline_reference, kinds, opts, allowance, margin,
                                   router_margin, tp=engine.capabilities.tp_size)
        if named:
            found = i
            for j in range(first, i):  # diverged, but their blocks replay within baseline: carried
                row = per_layer[j]
                report.add(passed("layers.residual", "output",
                                  f"layer {j}: residual error {row['error']:.3g} > limit {row['limit']:.3g}, but "
                                  f"every block replays within its baseline on the engine's own input (carried)",
                                  layer=j, stats=dict(_stats(row), carried=True)))
            row = per_layer[i]
            report.add(failed("layers.residual", "output",
                              f"layer {i}: residual error {row['error']:.3g} vs limit {row['limit']:.3g} "
                              f"(baseline {row['baseline']:.3g}); the first layer that diverges"
                              + (f" is {first}, the first that computes wrongly is {i}" if i != first else ""),
                              layer=i, stats=_stats(row), worst=errors[i].worst()))
            report.add(results)
            break
    if found is None:
        row = per_layer[first]
        last = min(n_layer, first + 1 + opts.max_replays) - 1
        identity = _residual_identity(runs, range(first, last + 1))
        tol = RESIDUAL_IDENTITY_TOLERANCE.get(caps.activation_dtype, 1e-4)
        if identity is not None and identity <= tol:
            # every block replays within its baseline AND each layer's output is its input plus
            # its blocks: the stream is the engine's own rounding, accumulated over depth
            report.add(passed("layers.residual", "output",
                              f"layer {first}: residual error {row['error']:.3g} > stated limit {row['limit']:.3g}, "
                              f"but every block of layers {first}..{last} replays within its baseline on the "
                              f"engine's own input and each layer's output is its input plus its blocks (to "
                              f"{identity:.2g}): accumulated rounding of the {caps.activation_dtype} class, not a "
                              f"faulty layer", layer=first, stats=dict(_stats(row), drift=True, identity=identity)))
        elif identity is not None:
            report.add(failed("layers.residual", "output",
                              f"layers {first}..{last}: every block replays within its baseline, but a layer's "
                              f"output is not its input plus its attention and FFN outputs (relative error "
                              f"{identity:.3g}): the residual connection is broken", layer=first,
                              stats=dict(_stats(row), identity=identity), worst=errors[first].worst()))
        else:
            # the engine exposes at most one of attention / FFN: the other is derived from the
            # residual stream, so the replays cover each whole layer on the engine's own input
            # and they all agree: accumulated drift (e.g. tokens routed to another expert at a
            # near-tie reaching later tokens through attention), not a faulty layer
            report.add(passed("layers.residual", "output",
                              f"layer {first}: residual error {row['error']:.3g} > stated limit {row['limit']:.3g}, "
                              f"but each of layers {first}..{last}, replayed whole on the engine's own input, "
                              f"agrees with the reference: accumulated drift of the {caps.activation_dtype} class, "
                              f"not a faulty layer", layer=first, stats=dict(_stats(row), drift=True)))
    report.info["first_diverging_layer"] = first
    report.info["localized_layer"] = found
    return report


# How exactly an engine's own layer output must equal its input + attention + FFN outputs
# (the sum is done in the activation dtype: fp32 for llama.cpp whatever its weights)
RESIDUAL_IDENTITY_TOLERANCE = {"fp64": 1e-5, "fp32": 1e-4, "q8": 1e-4, "fp16": 5e-3, "bf16": 3e-2}


def _residual_identity(runs, layers) -> float | None:
    """Max relative error of residual[i] against residual[i-1] + attention[i] + ffn[i], over the
    engine's own tensors (layer 0 reads the reference embeddings); None when not exposed."""
    worst = None
    for eng, ref_trace, _b in runs:
        for i in layers:
            parts = [eng.tensors.get((k, i)) for k in ("residual", "attention", "ffn")]
            if any(p is None for p in parts):
                return None
            res, attn, ffn = (torch.as_tensor(np.asarray(p), dtype=torch.float64) for p in parts)
            prev = _engine_input(i, eng, ref_trace).to(torch.float64)
            err = float(rel_errors(prev + attn + ffn, res).max())
            worst = err if worst is None else max(worst, err)
    return worst


def _ranks_agree(traces, opts: LayerOptions) -> list[Result]:
    """Tensor-parallel engines: every rank's residual stream must equal rank 0's (each layer
    ends in an all-reduce); the first (layer, rank) that differs is a broken collective or a
    rank computing on other weights."""
    ranks = sorted({r for t in traces for r in getattr(t, "per_rank", {})})
    if not ranks:
        return []
    for i in sorted({layer for t in traces for kind, layer in t.tensors if kind == "residual"}):
        for r in ranks:
            worst = 0.0
            for t in traces:
                mine, theirs = t.per_rank.get(r, {}).get(("residual", i)), t.tensors.get(("residual", i))
                if mine is None or theirs is None:
                    continue
                worst = max(worst, float(rel_errors(torch.as_tensor(mine), torch.as_tensor(theirs)).max()))
            if worst > opts.floor:
                return [failed("layers.ranks", "sharding",
                               f"layer {i}: rank {r}'s residual stream differs from rank 0's (relative error "
                               f"{worst:.3g}): the ranks do not hold the same activations after the all-reduce",
                               layer=i, stats={"rank": r, "error": worst}, worst={"rank": r})]
    return [passed("layers.ranks", "sharding", f"ranks 0..{ranks[-1]} hold the same residual stream after every "
                                               f"layer (relative difference <= {opts.floor:g})",
                   stats={"ranks": len(ranks) + 1})]


def near_ties(layer, margin: float) -> Tensor | None:
    """[T] bool of one traced layer: its DSA top-k boundary gap is within ``margin`` (0: exact ties)."""
    if layer.topk_gap is not None:
        return layer.topk_gap.cpu() <= margin
    return None if layer.topk_ties is None else layer.topk_ties.cpu()


def replay_errors(engine, reference, tokens_list: Sequence[Sequence[int]], options: LayerOptions | None = None,
                  *, activation_dtype: str | None = None) -> list[dict[str, Any]]:
    """Per layer: the engine's residual error and the local errors of its blocks replayed on its
    own inputs, for EVERY layer (the stage replays only diverging ones). For measuring what a
    correct engine of a class does against its allowances (tools/measure_allowances.py, tests).

    DSA / MoE near-ties are left out with the margins of ``activation_dtype`` (default: the
    engine's class), as the stage does. Rows: {"layer", "residual", "attention", "ffn",
    "router_jaccard" (MoE layers whose engine reports its router choices, else None)}.
    """
    opts = options or LayerOptions()
    cls = activation_dtype or engine.capabilities.activation_dtype
    margin = opts.indexer_tie_margins.get(cls, 0.0)
    router_margin = opts.router_tie_margins.get(cls, opts.router_tie_margin)
    kinds = [k for k in ("residual", "attention", "ffn", "router", "indexer", "rope")
             if k in engine.capabilities.layer_outputs]
    runs = []
    for s in tokens_list:
        s, eng = _layer_outputs_that_fit(engine, [int(t) for t in s], kinds)
        with torch.no_grad():
            runs.append((eng, reference.prefill(s, trace=True), None))
    rows = []
    masks = [_tie_masks(trace, reference.cfg.n_layer, margin, router_margin) for _e, trace, _b in runs]
    for i in range(reference.cfg.n_layer):
        residual = 0.0
        for n, (eng, trace, _b) in enumerate(runs):
            errs = rel_errors(torch.as_tensor(np.asarray(eng.tensors[("residual", i)])), trace.layers[i].hidden)
            errs = errs if masks[n][i] is None else errs[masks[n][i]]
            residual = max(residual, float(errs.max()) if errs.numel() else 0.0)
        results, _ = _localize(i, runs, reference, None, set(kinds), opts, 0.0, margin, router_margin,
                               tp=engine.capabilities.tp_size)
        block: dict[str, float | None] = {"attention": 0.0, "ffn": 0.0, "router_jaccard": None}
        for r in results:
            kind = {"layers.attention": "attention", "layers.replay": "attention", "layers.ffn": "ffn"}.get(r.check)
            if kind:
                block[kind] = max(block[kind], float(r.stats.get("error", 0.0)))
            if r.check == "layers.router" and "mean_jaccard" in r.stats:
                block["router_jaccard"] = float(r.stats["mean_jaccard"])
        rows.append({"layer": i, "residual": residual, **block})
    return rows


def _shortened_note(shortened: list[dict]) -> str:
    if not shortened:
        return ""
    parts = ", ".join(f"{x['tokens']} -> {x['used']}" for x in shortened)
    return f"; prompts the engine declined whole were shortened to a prefix it takes ({parts} tokens)"


def _layer_outputs_that_fit(engine, tokens: list[int], kinds: list[str]):
    """(tokens used, the engine's LayerTrace): the whole sequence, or, where the engine declines
    it (e.g. longer than its context), the longest halved prefix it takes (>= 2 tokens)."""
    while True:
        try:
            return tokens, engine.layer_outputs(tokens, kinds)
        except Unsupported:
            if len(tokens) < 4:
                raise
            tokens = tokens[: len(tokens) // 2]


def _tie_masks(ref_trace, n_layer: int, margin: float = 0.0, router_margin: float | None = None) -> list[Tensor | None]:
    """Per layer, [T] bool: positions whose residual can be compared (None: all).

    Where the reference's DSA top-k boundary at (layer j, position t) is a tie, or within
    ``margin`` of one (the engine class's rounding, :data:`checks.logits.INDEXER_TIE_MARGINS`),
    a correct engine may pick the other set, so position t is not compared from layer j on,
    and the later positions that read its keys (t' > t) not from layer j + 1 on. A token whose
    MoE routing is within ``router_margin`` of choosing another expert or group (a correct
    engine may route it the other way) is not compared from layer j on; one token's expert
    reaches the others only through attention, so later positions stay compared.
    """
    masks: list[Tensor | None] = []
    bad: Tensor | None = None  # positions excluded from this layer on
    spread: Tensor | None = None  # positions excluded from the next layer on
    for i in range(n_layer):
        layer = ref_trace.layers[i]
        ties = near_ties(layer, margin)
        gap = getattr(layer, "router_gap", None)
        if router_margin is not None and gap is not None:  # the token itself, from this layer on
            flips = gap.cpu() < router_margin
            bad = flips if bad is None else bad | flips
        if spread is not None:
            bad = spread if bad is None else bad | spread
        if ties is not None and bool(ties.any()):
            ties = ties.cpu()
            bad = ties.clone() if bad is None else bad | ties
            first = int(torch.nonzero(ties)[0])
            later = torch.arange(len(ties)) > first
            spread = later if spread is None else spread | later
        masks.append(None if bad is None else ~bad)
    return masks


def _ratio(err: float, base: float) -> float | None:
    if base > 0:
        return err / base
    return None if err == 0 else math.inf


def _stats(row: dict) -> dict:
    return {"error": row["error"], "baseline": row["baseline"], "limit": row["limit"], "ratio": row["ratio"]}


def _engine_input(i: int, eng, ref_trace) -> Tensor:
    if i == 0:
        return ref_trace.embeddings  # engines do not expose embeddings: layer 0 reads the reference's
    return torch.as_tensor(np.asarray(eng.tensors[("residual", i - 1)]))


def _shared_topk(i: int, cfg, eng, ref_rep, inputs) -> Tensor | None:
    """A glm-dsa shared layer's top-k: the engine's own from its latest full layer when it
    reports one, else the reference's latest full layer replayed on the engine's input."""
    if not cfg.has_indexer or cfg.indexer_full[i]:
        return None
    for j in range(i - 1, -1, -1):
        if cfg.indexer_full[j]:
            got = eng.tensors.get(("indexer", j))
            if got is not None:
                return torch.as_tensor(np.asarray(got)).to(torch.int64)
            return _Replayer(ref_rep, j).attention(inputs(j), _shared_topk(j, cfg, eng, ref_rep, inputs)).topk
    return None


def _localize(i: int, runs, reference, baseline_reference, kinds: set[str], opts: LayerOptions,
              allowance: float, margin: float = 0.0, router_margin: float | None = None,
              tp: int = 1) -> tuple[list[Result], bool]:
    """Compare layer i's blocks on replayed inputs: (Results, whether a failing block was named)."""
    cfg = reference.cfg
    moe_layer = cfg.is_moe_layer(i)
    rep = _Replayer(reference, i)
    base_rep = _Replayer(baseline_reference, i) if baseline_reference is not None else None
    attn_err, attn_base, ffn_err, ffn_base = _Err(), _Err(), _Err(), _Err()
    jac, n_jac, ov, n_ov = 0.0, 0, 0.0, 0
    jac_worst: dict = {"value": 2.0}
    ov_worst: dict = {"value": 2.0}
    fit_num = fit_den = 0.0
    cases = []  # per sequence: (n, target, routed) for the routed-scale fit
    hyp_inputs = []  # per sequence: what the hypotheses replay
    a_fit, f_fit = [], []  # (engine, reference) block outputs: an integer-factor fit
    for n, (eng, ref_trace, _b) in enumerate(runs):
        h_in = _engine_input(i, eng, ref_trace)

        def inputs(j, eng=eng, ref_trace=ref_trace):
            return _engine_input(j, eng, ref_trace)

        shared = _shared_topk(i, cfg, eng, reference, inputs)
        out = rep.attention(h_in, shared)
        h_out = torch.as_tensor(np.asarray(eng.tensors[("residual", i)])).to(torch.float64)
        a_eng = eng.tensors.get(("attention", i))
        f_eng = eng.tensors.get(("ffn", i))
        h64 = h_in.to(torch.float64)
        if a_eng is not None:
            a_eng = torch.as_tensor(np.asarray(a_eng)).to(torch.float64)
        if f_eng is not None:
            f_eng = torch.as_tensor(np.asarray(f_eng)).to(torch.float64)
        if a_eng is None and f_eng is not None:
            a_eng = h_out - h64 - f_eng
        if f_eng is None and a_eng is not None:
            f_eng = h_out - h64 - a_eng
        if a_eng is None:  # only the residual: the whole layer
            a_eng, f_eng = None, None
        keep_a = None
        ties = near_ties(out, margin)
        if ties is not None:
            keep_a = ~ties  # a (near) tie at the top-k boundary: either set is correct
        if a_eng is not None:
            attn_err.update(rel_errors(a_eng, out.attn_out), a_eng, out.attn_out, n, keep_a)
            a_fit.append((a_eng, out.attn_out))
            if base_rep is not None:
                b = base_rep.attention(h_in, shared)
                attn_base.update(rel_errors(b.attn_out, out.attn_out), b.attn_out, out.attn_out, n, keep_a)
            after = h64 + a_eng
            f_ref, routed, shexp, ids, gap = rep.ffn(after)
            keep_f = None
            if ids is not None:
                keep_f = gap >= (opts.router_tie_margin if router_margin is None else router_margin)  # no near-tie
                eng_ids = eng.tensors.get(("router", i))
                if eng_ids is not None:
                    eng_ids = torch.as_tensor(np.asarray(eng_ids)).to(torch.int64)
                    for t in torch.nonzero(keep_f).flatten().tolist():
                        a, b = set(eng_ids[t].tolist()), set(ids[t].tolist())
                        j = len(a & b) / max(len(a | b), 1)
                        jac += j
                        n_jac += 1
                        if j < jac_worst["value"]:
                            jac_worst = {"value": j, "sequence": n, "position": t, "engine": sorted(a),
                                         "reference": sorted(b)}
                # routed-scale fit: f_eng - shared = alpha * routed
                target = f_eng - (shexp if shexp is not None else 0.0)
                r = routed[keep_f] if keep_f is not None else routed
                tt = target[keep_f] if keep_f is not None else target
                fit_num += float((tt * r).sum())
                fit_den += float((r * r).sum())
                cases.append((n, tt, r))
            ffn_err.update(rel_errors(f_eng, f_ref), f_eng, f_ref, n, keep_f)
            f_fit.append((f_eng, f_ref))
            if base_rep is not None:
                fb = base_rep.ffn(after)[0]
                ffn_base.update(rel_errors(fb, f_ref), fb, f_ref, n, keep_f)
        else:
            attn_err.update(rel_errors(h_out, out.hidden), h_out, out.hidden, n, keep_a)
            if base_rep is not None:
                b = base_rep.attention(h_in, shared)
                attn_base.update(rel_errors(b.hidden, out.hidden), b.hidden, out.hidden, n, keep_a)
        eng_topk = eng.tensors.get(("indexer", i))
        if eng_topk is not None and out.topk is not None and out.topk_full:
            eng_topk = torch.as_tensor(np.asarray(eng_topk)).to(torch.int64)
            ties = near_ties(out, margin)
            ties = ties if ties is not None else torch.zeros(len(out.topk), dtype=torch.bool)
            for t in range(out.topk.shape[0]):
                if bool(ties[t]):
                    continue
                a = {x for x in eng_topk[t].tolist() if x >= 0}
                b = {x for x in out.topk[t].tolist() if x >= 0}
                if b:
                    o = len(a & b) / len(b)
                    ov += o
                    n_ov += 1
                    if o < ov_worst["value"]:
                        ov_worst = {"value": o, "sequence": n, "position": t, "missing": sorted(b - a)[:16],
                                    "extra": sorted(a - b)[:16]}
        hyp_inputs.append((n, h_in, shared, a_eng, f_eng, h64, h_out))

    results: list[Result] = []
    named = False
    whole = not any(k in kinds for k in ("attention", "ffn"))
    a_limit = _limit(attn_base.value, opts, allowance)
    f_limit = _limit(ffn_base.value, opts, allowance)
    a_stats = {"error": attn_err.value, "baseline": attn_base.value, "limit": a_limit,
               "ratio": _ratio(attn_err.value, attn_base.value)}
    attn_bad = not attn_err.value <= a_limit
    # --- indexer agreement (reported whatever the attention says)
    if n_ov:
        overlap = ov / n_ov
        st = {"mean_overlap": overlap, "positions": n_ov, "error": 1 - overlap, "baseline": 0.0,
              "limit": 1 - opts.indexer_min_overlap, "ratio": None}
        if overlap < opts.indexer_min_overlap:
            results.append(failed("layers.indexer", "indexer",
                                  f"layer {i}: indexer top-k overlaps the reference's by {overlap:.1%} "
                                  f"(limit {opts.indexer_min_overlap:.0%}) on the engine's own input",
                                  layer=i, stats=st, worst=ov_worst))
        else:
            results.append(passed("layers.indexer", "indexer", f"layer {i}: indexer top-k overlap {overlap:.1%}",
                                  layer=i, stats=st))
    if whole:
        what = "layer output (the engine exposes no attention / FFN outputs)"
        if attn_bad:
            comp, how = _match(hyp_inputs, rep, a_limit, _hypotheses_attention(cfg), "hidden", margin)
            results.append(failed("layers.replay", comp or "output",
                                  f"layer {i}: {what} differs from the reference replayed on the engine's input: "
                                  f"error {attn_err.value:.3g} > limit {a_limit:.3g}" + (f"; matches {how}" if how else ""),
                                  layer=i, stats=a_stats, worst=attn_err.worst()))
            named = True
        rep.close()
        return results, named
    if attn_bad:
        rope = rope_result(runs, i, reference, a_limit)  # the engine's own rope call, on its own q / k
        if rope is not None:
            results.append(rope)
        if rope is not None and rope.failed:
            comp, how = "rope", None
        else:
            comp, how = _match(hyp_inputs, rep, a_limit, _hypotheses_attention(cfg), "attn_out", margin)
        if comp is None:
            comp, how = _integer_factor(a_fit, a_limit, "attention", tp)
        indexer_bad = any(r.check == "layers.indexer" and r.status.value == "FAIL" for r in results)
        if comp is None:
            comp = "indexer" if indexer_bad else "attention"
        msg = (f"layer {i}: attention output differs from the reference replayed on the engine's own input: "
               f"error {attn_err.value:.3g} > limit {a_limit:.3g} (baseline {attn_base.value:.3g})")
        if how:
            msg += f"; it matches the reference with {how}"
        elif comp == "rope":
            msg += "; the engine's rope kernel is not a rotation by the reference angles on its own q / k (layers.rope)"
        results.append(failed("layers.attention", comp, msg, layer=i, stats=a_stats, worst=attn_err.worst()))
        named = True
    else:
        results.append(passed("layers.attention", "attention",
                              f"layer {i}: attention within baseline on replay (error {attn_err.value:.3g}, "
                              f"limit {a_limit:.3g})", layer=i, stats=a_stats))
    f_stats = {"error": ffn_err.value, "baseline": ffn_base.value, "limit": f_limit,
               "ratio": _ratio(ffn_err.value, ffn_base.value)}
    block = "moe-experts" if moe_layer else "ffn"
    ffn_bad = not ffn_err.value <= f_limit
    if moe_layer and n_jac:
        mean_jac = jac / n_jac
        st = {"mean_jaccard": mean_jac, "positions": n_jac, "error": 1 - mean_jac, "baseline": 0.0,
              "limit": 1 - opts.router_min_jaccard, "ratio": None}
        if mean_jac < opts.router_min_jaccard:
            how = _match_router(hyp_inputs, runs, rep, i, _hypotheses_ffn(cfg, moe_layer), opts.router_min_jaccard)
            results.append(failed("layers.router", "moe-router",
                                  f"layer {i}: selected experts agree with the reference by Jaccard {mean_jac:.2f} "
                                  f"(limit {opts.router_min_jaccard}) on the engine's own FFN input"
                                  + (f"; they agree with the reference routing with {how}" if how else ""),
                                  layer=i, stats=st, worst=jac_worst))
            named = True
            ffn_bad = None  # the router explains the FFN difference: no separate FFN verdict
        else:
            results.append(passed("layers.router", "moe-router",
                                  f"layer {i}: selected experts agree (Jaccard {mean_jac:.3f})", layer=i, stats=st))
    if ffn_bad:
        comp, how = None, None
        if moe_layer and fit_den > 0:
            alpha = fit_num / fit_den
            worst_fit = 0.0
            for _n, tt, r in cases:
                worst_fit = max(worst_fit, float(rel_errors(tt, alpha * r).max()) if len(r) else 0.0)
            if abs(alpha - 1) > opts.scale_fit_tolerance and worst_fit <= f_limit:
                comp = "moe-router"
                how = (f"routed experts' output scaled by {alpha:.4g} (routed_scaling_factor "
                       f"{cfg.expert_weights_scale:g} applied {'twice' if abs(alpha - cfg.expert_weights_scale) < 1e-2 else 'never' if abs(alpha - 1 / cfg.expert_weights_scale) < 1e-2 else 'wrongly'}?)")
                f_stats["routed_scale_fit"] = alpha
        if comp is None:
            comp, how = _match_ffn(hyp_inputs, rep, f_limit, _hypotheses_ffn(cfg, moe_layer))
        if comp is None:
            comp, how = _integer_factor(f_fit, f_limit, "MoE" if moe_layer else "FFN", tp)
        comp = comp or block
        msg = (f"layer {i}: {'MoE' if moe_layer else 'FFN'} output differs from the reference replayed on the "
               f"engine's own post-attention residual: error {ffn_err.value:.3g} > limit {f_limit:.3g} "
               f"(baseline {ffn_base.value:.3g})")
        if how:
            msg += f"; it matches {how}"
        results.append(failed("layers.ffn", comp, msg, layer=i, stats=f_stats, worst=ffn_err.worst()))
        named = True
    elif ffn_bad is False:
        results.append(passed("layers.ffn", block, f"layer {i}: {block} within baseline on replay "
                                                   f"(error {ffn_err.value:.3g}, limit {f_limit:.3g})",
                              layer=i, stats=f_stats))
    rep.close()
    return results, named


def _integer_factor(pairs, limit: float, block: str, tp: int) -> tuple[str | None, str | None]:
    """("sharding", how) when the engine's block output is the reference's times an integer
    factor >= 2 (within the limit after scaling): a tensor-parallel partial sum all-reduced
    twice, or summed without the division; (None, None) otherwise."""
    if not pairs:
        return None, None
    num = sum(float((e * r).sum()) for e, r in pairs)
    den = sum(float((r * r).sum()) for _e, r in pairs)
    if den <= 0:
        return None, None
    alpha = num / den
    if not math.isfinite(alpha):
        return None, None
    k = round(alpha)
    if k < 2 or abs(alpha - k) > 1e-3 * k:
        return None, None
    if max(float(rel_errors(e, alpha * r).max()) for e, r in pairs) > limit:
        return None, None
    if k == tp:
        return "sharding", (f"its {block} output multiplied by {alpha:.4g}, the tensor-parallel size ({alpha:.4g}x "
                            f"the reference's, the tensor-parallel size {tp}): partial sums all-reduced twice, or "
                            "summed where they should be averaged")
    return "sharding", (f"its {block} output multiplied by {alpha:.4g} ({alpha:.4g}x the reference's, an integer "
                        f"factor; tensor-parallel size here {tp}): a partial sum counted {k} times")


def _match(hyp_inputs, rep: _Replayer, limit: float, hypotheses, field_name: str, margin: float = 0.0):
    """The first hypothesis under which the reference block equals the engine's (within limit)."""
    for comp, how, changes, weights in hypotheses:
        cfg = rep.ref.cfg.with_options(**changes) if changes else rep.ref.cfg
        worst = 0.0
        for _n, h_in, shared, a_eng, f_eng, h64, h_out in hyp_inputs:
            try:
                alt = rep.attention(h_in, shared, cfg=cfg, weights=weights)
            except (RuntimeError, ValueError, KeyError):  # a hypothesis that cannot run is not a match
                worst = math.inf
                break
            got, want = (h_out, alt.hidden) if field_name == "hidden" else (a_eng, alt.attn_out)
            ties = near_ties(alt, margin)
            keep = None if ties is None else ~ties
            errs = rel_errors(got, want)
            if keep is not None:
                errs = errs[keep]
            worst = max(worst, float(errs.max()) if errs.numel() else 0.0)
        if worst <= limit:
            return comp, how
    return None, None


def _match_router(hyp_inputs, runs, rep: _Replayer, layer: int, hypotheses, min_jaccard: float) -> str | None:
    """The first routing hypothesis under which the reference selects the engine's experts."""
    for comp, how, changes, weights in hypotheses:
        if comp != "moe-router":
            continue
        cfg = rep.ref.cfg.with_options(**changes) if changes else rep.ref.cfg
        jac, n = 0.0, 0
        for n_seq, _h_in, _shared, a_eng, _f_eng, h64, _h_out in hyp_inputs:
            eng_ids = runs[n_seq][0].tensors.get(("router", layer))
            if a_eng is None or eng_ids is None:
                return None
            ids = rep.ffn(h64 + a_eng, cfg=cfg, weights=weights)[3]
            eng_ids = torch.as_tensor(np.asarray(eng_ids)).to(torch.int64)
            for t in range(len(ids)):
                a, b = set(eng_ids[t].tolist()), set(ids[t].tolist())
                jac += len(a & b) / max(len(a | b), 1)
                n += 1
        if n and jac / n >= min_jaccard:
            return how
    return None


def _match_ffn(hyp_inputs, rep: _Replayer, limit: float, hypotheses):
    for comp, how, changes, weights in hypotheses:
        cfg = rep.ref.cfg.with_options(**changes) if changes else rep.ref.cfg
        worst = 0.0
        for _n, h_in, shared, a_eng, f_eng, h64, h_out in hyp_inputs:
            if a_eng is None or f_eng is None:
                worst = math.inf
                break
            alt = rep.ffn(h64 + a_eng, cfg=cfg, weights=weights)[0]
            worst = max(worst, float(rel_errors(f_eng, alt).max()))
        if worst <= limit:
            return comp, how
    return None, None
