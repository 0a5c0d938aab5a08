"""Inside the first diverging layer: the attention and FFN / MoE blocks replayed on the engine's
own inputs, router and indexer agreement, the rope call, and which component failed.

Two steps, as the rest of the served stage: :func:`replay_layer` runs the reference (and the
baseline) on every sequence's captured input and keeps what it measured in one
:class:`LayerReplay`; the ``_judge_*`` functions read it, one block each, and name the component.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ggufcheck.checks.layers.hypotheses import (
    hypotheses_attention,
    hypotheses_ffn,
    integer_factor,
    match_block,
    match_ffn,
    match_router,
)
from ggufcheck.checks.layers.metrics import (
    MaxError,
    limit_for,
    near_ties,
    ratio,
    rel_errors,
)
from ggufcheck.checks.layers.options import LayerOptions
from ggufcheck.checks.layers.replay import Replayer, engine_input, shared_topk
from ggufcheck.checks.rope import rope_result
from ggufcheck.results import Result, failed, passed


@dataclass
class Agreement:
    """A mean set agreement over positions (router Jaccard, indexer overlap), and its worst one."""

    total: float = 0.0
    n: int = 0
    worst: dict = field(default_factory=lambda: {"value": 2.0})

    def add(self, value: float, **where) -> None:
        self.total += value
        self.n += 1
        if value < self.worst["value"]:
            self.worst = {"value": value, **where}

    @property
    def mean(self) -> float:
        return self.total / self.n


@dataclass
class LayerReplay:
    """What replaying one layer on the engine's inputs measured, every sequence together."""

    attn_err: MaxError = field(default_factory=MaxError)
    attn_base: MaxError = field(default_factory=MaxError)
    ffn_err: MaxError = field(default_factory=MaxError)
    ffn_base: MaxError = field(default_factory=MaxError)
    router: Agreement = field(default_factory=Agreement)  # Jaccard of the selected experts
    indexer: Agreement = field(default_factory=Agreement)  # the DSA top-k's overlap
    fit_num: float = 0.0  # routed-scale fit: f_eng - shared = alpha * routed
    fit_den: float = 0.0
    cases: list = field(default_factory=list)  # per sequence: (n, target, routed) for the routed-scale fit
    hyp_inputs: list = field(default_factory=list)  # per sequence: what the hypotheses replay
    a_fit: list = field(default_factory=list)  # (engine, reference) block outputs: an integer-factor fit
    f_fit: list = field(default_factory=list)


def localize(i: int, runs, reference, baseline_reference, kinds: set[str], opts: LayerOptions,
             allowance: float, margin: float = 0.0, router_margin: float | None = None,
             tp: int = 1) -> tuple[list[Result], bool]:
    """Compare layer i's blocks on replayed inputs: (Results, whether a failing block was named)."""
    rep = Replayer(reference, i)
    try:
        seen = replay_layer(i, runs, reference, rep, baseline_reference, opts, margin, router_margin)
        return _judge(i, runs, reference, rep, seen, kinds, opts, allowance, margin, tp)
    finally:
        rep.close()


def replay_layer(i: int, runs, reference, rep: Replayer, baseline_reference, opts: LayerOptions, margin: float,
                 router_margin: float | None) -> LayerReplay:
    """Layer i replayed by the reference (and the baseline) on each sequence's captured input."""
    cfg = reference.cfg
    base_rep = Replayer(baseline_reference, i) if baseline_reference is not None else None
    seen = LayerReplay()
    tie_margin = opts.router_tie_margin if router_margin is None else router_margin
    for n, (eng, ref_trace, _b) in enumerate(runs):
        h_in = engine_input(i, eng, ref_trace)

        def inputs(j, eng=eng, ref_trace=ref_trace):
            return engine_input(j, eng, ref_trace)

        shared = shared_topk(i, cfg, eng, reference, inputs)
        out = rep.attention(h_in, shared)
        h_out = _f64(eng.tensors[("residual", i)])
        h64 = h_in.to(torch.float64)
        a_eng, f_eng = _block_outputs(eng, i, h64, h_out)
        ties = near_ties(out, margin)
        keep_a = None if ties is None else ~ties  # a (near) tie at the top-k boundary: either set is correct
        if a_eng is not None:
            seen.attn_err.update(rel_errors(a_eng, out.attn_out), a_eng, out.attn_out, n, keep_a)
            seen.a_fit.append((a_eng, out.attn_out))
            if base_rep is not None:
                b = base_rep.attention(h_in, shared)
                seen.attn_base.update(rel_errors(b.attn_out, out.attn_out), b.attn_out, out.attn_out, n, keep_a)
            after = h64 + a_eng
            f_ref, routed, shexp, ids, gap = rep.ffn(after)
            keep_f = None
            if ids is not None:
                keep_f = gap >= tie_margin  # no near-tie
                _router_agreement(seen, eng.tensors.get(("router", i)), ids, keep_f, n)
                target = f_eng - (shexp if shexp is not None else 0.0)
                r, tt = routed[keep_f], target[keep_f]
                seen.fit_num += float((tt * r).sum())
                seen.fit_den += float((r * r).sum())
                seen.cases.append((n, tt, r))
            seen.ffn_err.update(rel_errors(f_eng, f_ref), f_eng, f_ref, n, keep_f)
            seen.f_fit.append((f_eng, f_ref))
            if base_rep is not None:
                fb = base_rep.ffn(after)[0]
                seen.ffn_base.update(rel_errors(fb, f_ref), fb, f_ref, n, keep_f)
        else:  # only the residual: the whole layer
            seen.attn_err.update(rel_errors(h_out, out.hidden), h_out, out.hidden, n, keep_a)
            if base_rep is not None:
                b = base_rep.attention(h_in, shared)
                seen.attn_base.update(rel_errors(b.hidden, out.hidden), b.hidden, out.hidden, n, keep_a)
        _indexer_overlap(seen, eng.tensors.get(("indexer", i)), out, ties, n)
        seen.hyp_inputs.append((n, h_in, shared, a_eng, f_eng, h64, h_out))
    return seen


def _f64(array) -> torch.Tensor:
    return torch.as_tensor(np.asarray(array)).to(torch.float64)


def _block_outputs(eng, i: int, h64: torch.Tensor, h_out: torch.Tensor):
    """The engine's attention and FFN outputs of layer i (one from the other and the residual
    when it exposes only one); (None, None) when it exposes neither."""
    a_eng, f_eng = eng.tensors.get(("attention", i)), eng.tensors.get(("ffn", i))
    a_eng = None if a_eng is None else _f64(a_eng)
    f_eng = None if f_eng is None else _f64(f_eng)
    if a_eng is None and f_eng is not None:
        a_eng = h_out - h64 - f_eng
    if f_eng is None and a_eng is not None:
        f_eng = h_out - h64 - a_eng
    return a_eng, f_eng


def _router_agreement(seen: LayerReplay, eng_ids, ids: torch.Tensor, keep: torch.Tensor, n: int) -> None:
    """The engine's selected experts against the reference's, at positions without a near-tie."""
    if eng_ids is None:
        return
    eng_ids = torch.as_tensor(np.asarray(eng_ids)).to(torch.int64)
    for t in torch.nonzero(keep).flatten().tolist():
        a, b = set(eng_ids[t].tolist()), set(ids[t].tolist())
        seen.router.add(len(a & b) / max(len(a | b), 1), sequence=n, position=t, engine=sorted(a),
                        reference=sorted(b))


def _indexer_overlap(seen: LayerReplay, eng_topk, out, ties, n: int) -> None:
    """The engine's DSA top-k against the reference's, at positions without a near-tie."""
    if eng_topk is None or out.topk is None or not out.topk_full:
        return
    eng_topk = torch.as_tensor(np.asarray(eng_topk)).to(torch.int64)
    for t in range(out.topk.shape[0]):
        if ties is not None and bool(ties[t]):
            continue
        a = {x for x in eng_topk[t].tolist() if x >= 0}
        b = {x for x in out.topk[t].tolist() if x >= 0}
        if b:
            seen.indexer.add(len(a & b) / len(b), sequence=n, position=t, missing=sorted(b - a)[:16],
                             extra=sorted(a - b)[:16])


def _judge(i: int, runs, reference, rep: Replayer, seen: LayerReplay, kinds: set[str], opts: LayerOptions,
           allowance: float, margin: float, tp: int) -> tuple[list[Result], bool]:
    """Each block's verdict from the replay, in the order a reader follows the layer: the indexer
    (whatever the attention says), the attention (its rope call first), the router, the FFN."""
    cfg = reference.cfg
    results = _judge_indexer(i, seen, opts)
    a_limit = limit_for(seen.attn_base.value, opts, allowance)
    if not any(k in kinds for k in ("attention", "ffn")):  # only the residual: the whole layer
        whole = _judge_whole(i, rep, seen, cfg, a_limit, margin)
        return results + whole, bool(whole)
    attention = _judge_attention(i, runs, reference, rep, seen, a_limit, margin, tp,
                                 indexer_bad=any(r.failed for r in results))
    router = _judge_router(i, runs, rep, seen, cfg, opts)
    if router is not None and router.failed:  # the router explains the FFN difference: no separate FFN verdict
        ffn = []
    else:
        ffn = _judge_ffn(i, rep, seen, cfg, opts, limit_for(seen.ffn_base.value, opts, allowance), tp)
    judged = [*attention, *([router] if router is not None else []), *ffn]
    named = attention[-1].failed or any(r.failed for r in judged if r.check in ("layers.router", "layers.ffn"))
    return results + judged, named


def _judge_indexer(i: int, seen: LayerReplay, opts: LayerOptions) -> list[Result]:
    if not seen.indexer.n:
        return []
    overlap = seen.indexer.mean
    st = {"mean_overlap": overlap, "positions": seen.indexer.n, "error": 1 - overlap, "baseline": 0.0,
          "limit": 1 - opts.indexer_min_overlap, "ratio": None}
    if overlap < opts.indexer_min_overlap:
        return [failed("layers.indexer", "indexer",
                       f"layer {i}: indexer top-k overlaps the reference's by {overlap:.1%} "
                       f"(limit {opts.indexer_min_overlap:.0%}) on the engine's own input",
                       layer=i, stats=st, worst=seen.indexer.worst)]
    return [passed("layers.indexer", "indexer", f"layer {i}: indexer top-k overlap {overlap:.1%}", layer=i, stats=st)]


def _attention_stats(seen: LayerReplay, limit: float) -> dict:
    return {"error": seen.attn_err.value, "baseline": seen.attn_base.value, "limit": limit,
            "ratio": ratio(seen.attn_err.value, seen.attn_base.value)}


def _judge_whole(i: int, rep: Replayer, seen: LayerReplay, cfg, limit: float, margin: float) -> list[Result]:
    """The layer's output as one block (the engine exposes no attention / FFN outputs)."""
    err = seen.attn_err
    if err.value <= limit:
        return []
    what = "layer output (the engine exposes no attention / FFN outputs)"
    comp, how = match_block(seen.hyp_inputs, rep, limit, hypotheses_attention(cfg), "hidden", margin)
    return [failed("layers.replay", comp or "output",
                   f"layer {i}: {what} differs from the reference replayed on the engine's input: "
                   f"error {err.value:.3g} > limit {limit:.3g}" + (f"; matches {how}" if how else ""),
                   layer=i, stats=_attention_stats(seen, limit), worst=err.worst())]


def _judge_attention(i: int, runs, reference, rep: Replayer, seen: LayerReplay, limit: float, margin: float,
                     tp: int, indexer_bad: bool) -> list[Result]:
    """[the rope call's result, if any,] the attention block's result (the last)."""
    err, stats = seen.attn_err, _attention_stats(seen, limit)
    if err.value <= limit:
        return [passed("layers.attention", "attention",
                       f"layer {i}: attention within baseline on replay (error {err.value:.3g}, "
                       f"limit {limit:.3g})", layer=i, stats=stats)]
    results = []
    rope = rope_result(runs, i, reference, limit)  # the engine's own rope call, on its own q / k
    if rope is not None:
        results.append(rope)
    if rope is not None and rope.failed:
        comp, how = "rope", None
    else:
        comp, how = match_block(seen.hyp_inputs, rep, limit, hypotheses_attention(reference.cfg), "attn_out", margin)
    if comp is None:
        comp, how = integer_factor(seen.a_fit, limit, "attention", tp, rep.w.get("attn_output.bias"))
    if comp is None:
        comp = "indexer" if indexer_bad else "attention"
    msg = (f"layer {i}: attention output differs from the reference replayed on the engine's own input: "
           f"error {err.value:.3g} > limit {limit:.3g} (baseline {seen.attn_base.value:.3g})")
    if how:
        msg += f"; it matches the reference with {how}"
    elif comp == "rope":
        msg += "; the engine's rope kernel is not a rotation by the reference angles on its own q / k (layers.rope)"
    results.append(failed("layers.attention", comp, msg, layer=i, stats=stats, worst=err.worst()))
    return results


def _judge_router(i: int, runs, rep: Replayer, seen: LayerReplay, cfg, opts: LayerOptions) -> Result | None:
    """The selected experts against the reference's (MoE layers whose engine exposes them)."""
    if not cfg.is_moe_layer(i) or not seen.router.n:
        return None
    mean_jac = seen.router.mean
    st = {"mean_jaccard": mean_jac, "positions": seen.router.n, "error": 1 - mean_jac, "baseline": 0.0,
          "limit": 1 - opts.router_min_jaccard, "ratio": None}
    if mean_jac >= opts.router_min_jaccard:
        return passed("layers.router", "moe-router", f"layer {i}: selected experts agree (Jaccard {mean_jac:.3f})",
                      layer=i, stats=st)
    how = match_router(seen.hyp_inputs, runs, rep, i, hypotheses_ffn(cfg, True), opts.router_min_jaccard)
    return failed("layers.router", "moe-router",
                  f"layer {i}: selected experts agree with the reference by Jaccard {mean_jac:.2f} "
                  f"(limit {opts.router_min_jaccard}) on the engine's own FFN input"
                  + (f"; they agree with the reference routing with {how}" if how else ""),
                  layer=i, stats=st, worst=seen.router.worst)


def _judge_ffn(i: int, rep: Replayer, seen: LayerReplay, cfg, opts: LayerOptions, limit: float,
               tp: int) -> list[Result]:
    moe_layer = cfg.is_moe_layer(i)
    err = seen.ffn_err
    stats = {"error": err.value, "baseline": seen.ffn_base.value, "limit": limit,
             "ratio": ratio(err.value, seen.ffn_base.value)}
    block = "moe-experts" if moe_layer else "ffn"
    if err.value <= limit:
        return [passed("layers.ffn", block, f"layer {i}: {block} within baseline on replay "
                                            f"(error {err.value:.3g}, limit {limit:.3g})", layer=i, stats=stats)]
    comp, how = _routed_scale(seen, cfg, opts, limit, stats) if moe_layer else (None, None)
    if comp is None:
        comp, how = match_ffn(seen.hyp_inputs, rep, limit, hypotheses_ffn(cfg, moe_layer))
    if comp is None:
        comp, how = integer_factor(seen.f_fit, limit, "MoE" if moe_layer else "FFN", tp)
    comp = comp or block
    msg = (f"layer {i}: {'MoE' if moe_layer else 'FFN'} output differs from the reference replayed on the "
           f"engine's own post-attention residual: error {err.value:.3g} > limit {limit:.3g} "
           f"(baseline {seen.ffn_base.value:.3g})")
    if how:
        msg += f"; it matches {how}"
    return [failed("layers.ffn", comp, msg, layer=i, stats=stats, worst=err.worst())]


def _routed_scale(seen: LayerReplay, cfg, opts: LayerOptions, limit: float, stats: dict):
    """("moe-router", how) when the engine's routed output is the reference's times one factor
    (routed_scaling_factor applied twice, never, or wrongly), else (None, None)."""
    if seen.fit_den <= 0:
        return None, None
    alpha = seen.fit_num / seen.fit_den
    worst_fit = 0.0
    for _n, tt, r in seen.cases:
        worst_fit = max(worst_fit, float(rel_errors(tt, alpha * r).max()) if len(r) else 0.0)
    if abs(alpha - 1) <= opts.scale_fit_tolerance or worst_fit > limit:
        return None, None
    scale = cfg.expert_weights_scale
    how_often = ("twice" if abs(alpha - scale) < 1e-2 else "never" if abs(alpha - 1 / scale) < 1e-2 else "wrongly")
    stats["routed_scale_fit"] = alpha
    return "moe-router", f"routed experts' output scaled by {alpha:.4g} (routed_scaling_factor {scale:g} applied {how_often}?)"
