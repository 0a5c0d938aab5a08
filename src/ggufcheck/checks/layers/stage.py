"""The ``layers`` stage itself: the residual stream layer by layer against the reference, the
bisection to the first layer that computes wrongly, and what is said when none does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from ggufcheck.checks import index_ranges
from ggufcheck.checks.layers.capture import layer_outputs_that_fit
from ggufcheck.checks.layers.localize import localize
from ggufcheck.checks.layers.metrics import (
    MaxError,
    limit_for,
    ratio,
    rel_errors,
    row_stats,
    tie_masks,
)
from ggufcheck.checks.layers.options import STAGE, LayerOptions
from ggufcheck.checks.layers.replay import ReplayedTrace, engine_input
from ggufcheck.results import Result, StageReport, failed, passed, skipped

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.diagnose.session import Session


def run_layers_stage(engine, reference, tokens_list: Sequence[Sequence[int]], baseline_reference=None,
                     options: LayerOptions | None = None, progress: Callable[[str], None] | None = None,
                     chosen: Sequence[int] | None = None,
                     remember: Callable[[Any, Sequence[int], Any], None] | None = None) -> StageReport:
    """:func:`_bisect` (its docstring says how), with the block checks that follow from ranks
    parting said to follow from it."""
    return after_ranks_part(_bisect(engine, reference, tokens_list, baseline_reference, options, progress, chosen,
                                    remember))


def after_ranks_part(report: StageReport) -> StageReport:
    """Where the ranks' residual streams part at layer L (``layers.ranks``), the block checks
    at L and after judge rank 0's tensors, which the next all-reduce has already mixed with
    the parting rank's partial sums: their failures are consequences, and say so (the verdict
    is the ranks' result, the earlier component at the same layer)."""
    parted = next((r for r in report.results if r.check == "layers.ranks" and r.failed), None)
    if parted is None:
        return report
    rank, layer = parted.stats["rank"], parted.layer
    note = (f" (on rank 0's tensors, after rank {rank}'s residual stream parted from rank 0's at layer {layer}: "
            f"the all-reduces after that point sum rank {rank}'s diverging partial results into every rank, so "
            "this follows from it)")
    report.results = [r.amended(note, stats={"follows_ranks_parting": True})
                      if r.failed and r is not parted and r.layer is not None and r.layer >= layer else r
                      for r in report.results]
    return report


def _bisect(engine, reference, tokens_list: Sequence[Sequence[int]], baseline_reference=None,
            options: LayerOptions | None = None, progress: Callable[[str], None] | None = None,
            chosen: Sequence[int] | None = None,
            remember: Callable[[Any, Sequence[int], Any], None] | None = None) -> StageReport:
    """Bisect the layers of ``engine`` against ``reference`` (a fp64 ReferenceModel).

    ``baseline_reference`` (a fp32 ReferenceModel of the same file) gives the per-layer
    baselines; without it only the floor and the activation class allowance apply.
    ``chosen`` (``--layers``): only these layers, each replayed on the engine's own input to
    it (their weights are the only ones read; an error does not carry from layer to layer).
    ``remember(model, tokens, trace)`` is given each whole traced pass (the served stage scores
    the same prompts: its reference engines reuse them).
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
        s, eng = layer_outputs_that_fit(engine, s, want_kinds)
        if len(s) < len(seqs[n]):
            shortened.append({"prompt": n, "tokens": len(seqs[n]), "used": len(s)})
            seqs[n] = s
        with torch.no_grad():
            if chosen is not None:
                ref_trace = ReplayedTrace(reference, eng, s, chosen)
                base_trace = ReplayedTrace(baseline_reference, eng, s, chosen) if baseline_reference is not None else None
            else:
                ref_trace = on_cpu(reference.prefill(s, trace=True))
                base_trace = on_cpu(baseline_reference.prefill(s, trace=True)) if baseline_reference is not None else None
                if remember is not None:
                    remember(reference, s, ref_trace)
                    if base_trace is not None:
                        remember(baseline_reference, s, base_trace)
        runs.append((eng, ref_trace, base_trace))

    report.add(ranks_agree([eng for eng, _r, _b in runs], opts))
    per_layer = []
    errors: dict[int, MaxError] = {}
    masks = [tie_masks(ref_trace, n_layer, margin, router_margin) for _e, ref_trace, _b in runs]
    compared = sorted(chosen) if chosen is not None else list(range(n_layer))
    for i in compared:
        err, base = MaxError(), MaxError()
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
        errors[i] = err
        limit = limit_for(base.value, opts, residual_allowance)
        per_layer.append({"layer": i, "error": err.value, "baseline": base.value, "limit": limit,
                          "ratio": ratio(err.value, base.value), "tie_excluded_positions": excluded})
    report.info.update(per_layer=per_layer, shortened=shortened, multiple=opts.multiple, floor=opts.floor,
                       allowance=allowance,
                       residual_allowance=residual_allowance,
                       activation_dtype=caps.activation_dtype, prompts=len(seqs),
                       baseline=("none (floor only)" if baseline_reference is None else
                                 f"fp32 reference emulating {emulation.describe()} vs fp64" if emulation is not None
                                 else "fp32 reference vs fp64"))
    if chosen is not None:
        report.info["chosen_layers"] = compared
        report.info["not_checked"] = (f"layers other than {index_ranges(compared)} ({n_layer - len(compared)} of "
                                      f"{n_layer}): --layers")
        return _judge_chosen(report, per_layer, runs, reference, baseline_reference, kinds, opts, allowance,
                             margin, router_margin, engine.capabilities.tp_size, errors, n_layer, shortened)

    first = next((row["layer"] for row in per_layer if not row["error"] <= row["limit"]), None)
    if first is None:
        worst = max(per_layer, key=lambda r: r["error"] / r["limit"])
        report.add(passed("layers.residual", "output",
                          f"all {n_layer} layers within their limits for this precision class (closest to its limit: "
                          f"layer {worst['layer']}: "
                          f"error {worst['error']:.3g}, limit {worst['limit']:.3g})" + shortened_note(shortened),
                          stats={"layers": n_layer, "worst_layer": worst["layer"], "error": worst["error"],
                                 "limit": worst["limit"]}))
        return report

    for row in per_layer[:first]:
        report.add(passed("layers.residual", "output",
                          f"layer {row['layer']}: residual error {row['error']:.3g} <= limit {row['limit']:.3g}",
                          layer=row["layer"], stats=row_stats(row)))
    found = None
    for i in range(first, min(n_layer, first + 1 + opts.max_replays)):
        say(f"layers: replaying layer {i}/{n_layer - 1} on the engine's own input")
        results, named = localize(i, runs, reference, baseline_reference, kinds, opts, allowance, margin,
                                   router_margin, tp=engine.capabilities.tp_size)
        if named:
            found = i
            for j in range(first, i):  # diverged, but their blocks replay within baseline: carried
                row = per_layer[j]
                report.add(passed("layers.residual", "output",
                                  f"layer {j}: residual error {row['error']:.3g} > limit {row['limit']:.3g}, but "
                                  f"every block replays within its baseline on the engine's own input (carried)",
                                  layer=j, stats=dict(row_stats(row), carried=True)))
            row = per_layer[i]
            report.add(failed("layers.residual", "output",
                              f"layer {i}: residual error {row['error']:.3g} vs limit {row['limit']:.3g} "
                              f"(baseline {row['baseline']:.3g}); the first layer that diverges"
                              + (f" is {first}, the first that computes wrongly is {i}" if i != first else "")
                              + ("; its output holds NaN or inf, the first layer that does"
                                 if row["error"] == float("inf") and all(per_layer[j]["error"] < float("inf")
                                                                         for j in range(i)) else "")
                              + errors[i].text(),
                              layer=i, stats=row_stats(row), worst=errors[i].worst()))
            report.add(results)
            break
    if found is None:
        row = per_layer[first]
        last = min(n_layer, first + 1 + opts.max_replays) - 1
        identity = residual_identity(runs, range(first, last + 1))
        tol = RESIDUAL_IDENTITY_TOLERANCE.get(caps.activation_dtype, 1e-4)
        if identity is not None and identity <= tol:
            # every block replays within its baseline AND each layer's output is its input plus
            # its blocks: the stream is the engine's own rounding, accumulated over depth
            report.add(passed("layers.residual", "output",
                              f"layer {first}: residual error {row['error']:.3g} > stated limit {row['limit']:.3g}, "
                              f"but every block of layers {first}..{last} replays within its baseline on the "
                              f"engine's own input and each layer's output is its input plus its blocks (to "
                              f"{identity:.2g}): accumulated rounding of the {caps.activation_dtype} class, not a "
                              f"faulty layer", layer=first, stats=dict(row_stats(row), drift=True, identity=identity)))
        elif identity is not None:
            report.add(failed("layers.residual", "output",
                              f"layers {first}..{last}: every block replays within its baseline, but a layer's "
                              f"output is not its input plus its attention and FFN outputs (relative error "
                              f"{identity:.3g}): the residual connection is broken", layer=first,
                              stats=dict(row_stats(row), identity=identity), worst=errors[first].worst()))
        else:
            # the engine exposes at most one of attention / FFN: the other is derived from the
            # residual stream, so the replays cover each whole layer on the engine's own input
            # and they all agree: accumulated drift (e.g. tokens routed to another expert at a
            # near-tie reaching later tokens through attention), not a faulty layer
            report.add(passed("layers.residual", "output",
                              f"layer {first}: residual error {row['error']:.3g} > stated limit {row['limit']:.3g}, "
                              f"but each of layers {first}..{last}, replayed whole on the engine's own input, "
                              f"agrees with the reference: accumulated drift of the {caps.activation_dtype} class, "
                              f"not a faulty layer", layer=first, stats=dict(row_stats(row), drift=True)))
    report.info["first_diverging_layer"] = first
    report.info["localized_layer"] = found
    return report


def on_cpu(trace):
    """A trace of a GPU reference with its tensors on the CPU, where the engine's are compared."""
    from dataclasses import fields, replace

    def cpu(layer):
        return replace(layer, **{f.name: getattr(layer, f.name).cpu() for f in fields(layer)
                                 if isinstance(getattr(layer, f.name), torch.Tensor)})

    if trace.embeddings.device.type != "cpu":
        trace.layers = [cpu(layer) for layer in trace.layers]
        trace.embeddings = trace.embeddings.cpu()
    return trace


def _judge_chosen(report: StageReport, per_layer, runs, reference, baseline_reference, kinds, opts: LayerOptions,
                  allowance: float, margin: float, router_margin, tp: int, errors, n_layer: int,
                  shortened) -> StageReport:
    """``--layers``: every chosen layer was replayed on the engine's own input, so each row is
    that layer's own error; the first over its limit is localized (its blocks replayed)."""
    failing = [row for row in per_layer if not row["error"] <= row["limit"]]
    for row in per_layer:
        if row in failing:
            continue
        report.add(passed("layers.residual", "output",
                          f"layer {row['layer']} (replayed on the engine's input): error {row['error']:.3g} <= limit "
                          f"{row['limit']:.3g}", layer=row["layer"], stats=row_stats(row)))
    if not failing:
        report.add(passed("layers.chosen", "output",
                          f"the {len(per_layer)} chosen layers ({index_ranges(r['layer'] for r in per_layer)}) "
                          "each compute "
                          f"as the reference does on the engine's own input; the other {n_layer - len(per_layer)} "
                          "layers and the served distributions were not checked (--layers)" + shortened_note(shortened),
                          stats={"layers": [r["layer"] for r in per_layer]}))
        return report
    row = failing[0]
    i = row["layer"]
    results, _named = localize(i, runs, reference, baseline_reference, kinds, opts, allowance, margin, router_margin,
                               tp=tp)
    report.add(failed("layers.residual", "output",
                      f"layer {i}, replayed on the engine's own input: error {row['error']:.3g} vs limit "
                      f"{row['limit']:.3g} (baseline {row['baseline']:.3g}); the first chosen layer that computes "
                      "wrongly" + errors[i].text(), layer=i, stats=row_stats(row), worst=errors[i].worst()))
    report.add(results)
    report.info["localized_layer"] = i
    return report


# How exactly an engine's own layer output must equal its input + attention + FFN outputs
# (the sum is done in the activation dtype: fp32 for llama.cpp whatever its weights)
RESIDUAL_IDENTITY_TOLERANCE = {"fp64": 1e-5, "fp32": 1e-4, "q8": 1e-4, "fp16": 5e-3, "bf16": 3e-2}


def residual_identity(runs, layers) -> float | None:
    """Max relative error of residual[i] against residual[i-1] + attention[i] + ffn[i], over the
    engine's own tensors (layer 0 reads the reference embeddings); None when not exposed."""
    worst = None
    for eng, ref_trace, _b in runs:
        for i in layers:
            parts = [eng.tensors.get((k, i)) for k in ("residual", "attention", "ffn")]
            if any(p is None for p in parts):
                return None
            res, attn, ffn = (torch.as_tensor(np.asarray(p), dtype=torch.float64) for p in parts)
            prev = engine_input(i, eng, ref_trace).to(torch.float64)
            err = float(rel_errors(prev + attn + ffn, res).max())
            worst = err if worst is None else max(worst, err)
    return worst


RANK_BLOCK_TEXT = {
    "input": "its layer input already differs ({input}): an earlier step on that rank",
    "attention": "its layer input agrees and its attention output, taken after the attention's all-reduce, "
                 "differs ({attention}): rank {r}'s attention or that all-reduce",
    "ffn": "its layer input and attention output agree and its FFN / MoE output, taken after that block's "
           "all-reduce, differs ({ffn}): rank {r}'s FFN or that all-reduce",
    None: "each block's output agrees: the residual additions differ on that rank",
    "unknown": "the engine exposes no per-rank block outputs to say which block",
}


def rank_blocks(traces, i: int, r: int, floor: float) -> tuple[dict[str, float], str | None]:
    """Rank ``r``'s layer-``i`` input, attention and FFN outputs against rank 0's (each rank
    holds the same values after an all-reduce): their largest relative differences, and the
    first one over ``floor`` (None: none; "unknown": none exposed)."""
    keys = {"input": ("residual", i - 1), "attention": ("attention", i), "ffn": ("ffn", i)}
    found: dict[str, float] = {}
    for name, key in keys.items():
        if key[1] < 0:
            continue
        values = [float(rel_errors(torch.as_tensor(t.per_rank[r][key]), torch.as_tensor(t.tensors[key])).max())
                  for t in traces if key in t.per_rank.get(r, {}) and key in t.tensors]
        if values:
            found[name] = max(values)
    if not found.keys() - {"input"}:
        return found, "unknown"
    return found, next((name for name in keys if found.get(name, 0.0) > floor), None)


def ranks_agree(traces, opts: LayerOptions) -> list[Result]:
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
                blocks, block = rank_blocks(traces, i, r, opts.floor)
                return [failed("layers.ranks", "sharding",
                               f"layer {i}: rank {r}'s residual stream differs from rank 0's (relative error "
                               f"{worst:.3g}): the ranks do not hold the same activations after the all-reduce; "
                               + RANK_BLOCK_TEXT[block].format(r=r, **{k: f"{v:.3g}" for k, v in blocks.items()}),
                               layer=i, stats={"rank": r, "error": worst, "block": block, "blocks": blocks},
                               worst={"rank": r})]
    return [passed("layers.ranks", "sharding", f"ranks 0..{ranks[-1]} hold the same residual stream after every "
                                               f"layer (relative difference <= {opts.floor:g})",
                   stats={"ranks": len(ranks) + 1})]


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
        s, eng = layer_outputs_that_fit(engine, [int(t) for t in s], kinds)
        with torch.no_grad():
            runs.append((eng, reference.prefill(s, trace=True), None))
    rows = []
    masks = [tie_masks(trace, reference.cfg.n_layer, margin, router_margin) for _e, trace, _b in runs]
    for i in range(reference.cfg.n_layer):
        residual = 0.0
        for n, (eng, trace, _b) in enumerate(runs):
            errs = rel_errors(torch.as_tensor(np.asarray(eng.tensors[("residual", i)])), trace.layers[i].hidden)
            errs = errs if masks[n][i] is None else errs[masks[n][i]]
            residual = max(residual, float(errs.max()) if errs.numel() else 0.0)
        results, _ = localize(i, runs, reference, None, set(kinds), opts, 0.0, margin, router_margin,
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


def shortened_note(shortened: list[dict]) -> str:
    if not shortened:
        return ""
    parts = ", ".join(f"{x['tokens']} -> {x['used']}" for x in shortened)
    return f"; prompts the engine declined whole were shortened to a prefix it takes ({parts} tokens)"


def run(session: "Session") -> list[StageReport]:
    """The stage entry point: the session's engine against its reference, layer by layer."""
    engine = session.engine()
    if not engine.capabilities.layer_outputs:
        report = StageReport(STAGE)
        report.add(skipped(STAGE, "output", engine.capabilities.why_not("layer_outputs")))
        return [report]
    trusted = session.reference()
    reference = getattr(trusted, "model", None)
    if reference is None:
        if trusted is not None and trusted.capabilities.layer_outputs:
            from ggufcheck.checks.layers.versus import run_layers_vs_engine

            session.say(f"comparing every layer with {trusted.name}")
            return [run_layers_vs_engine(engine, trusted, session.tokens(), progress=session.say)]
        report = StageReport(STAGE)
        why = (trusted.capabilities.why_not("layer_outputs") if trusted is not None else "no reference")
        report.add(skipped(STAGE, "output", f"the layers stage needs per-layer outputs from the reference; "
                                            f"--reference {session.options.reference}: {why}"))
        return [report]
    baseline = session.baseline_model()  # loaded first: the label follows the work
    session.say("comparing every layer with the reference")
    engines = [e for e in (trusted, session.baseline()) if hasattr(e, "remember")]

    def remember(model, tokens, trace) -> None:  # the served stage scores these prompts again
        for e in engines:
            if e.model is model:
                e.remember(tokens, trace)

    return [run_layers_stage(engine, reference, session.tokens(), baseline_reference=baseline, progress=session.say,
                             chosen=session.options.layers, remember=remember)]
