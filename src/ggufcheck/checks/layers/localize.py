"""Inside the first diverging layer: the attention and FFN / MoE blocks replayed on the engine's
own inputs, router and indexer agreement, the rope call, and which component failed.
"""

from __future__ import annotations

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


def localize(i: int, runs, reference, baseline_reference, kinds: set[str], opts: LayerOptions,
              allowance: float, margin: float = 0.0, router_margin: float | None = None,
              tp: int = 1) -> tuple[list[Result], bool]:
    """Compare layer i's blocks on replayed inputs: (Results, whether a failing block was named)."""
    cfg = reference.cfg
    moe_layer = cfg.is_moe_layer(i)
    rep = Replayer(reference, i)
    base_rep = Replayer(baseline_reference, i) if baseline_reference is not None else None
    attn_err, attn_base, ffn_err, ffn_base = MaxError(), MaxError(), MaxError(), MaxError()
    jac, n_jac, ov, n_ov = 0.0, 0, 0.0, 0
    jac_worst: dict = {"value": 2.0}
    ov_worst: dict = {"value": 2.0}
    fit_num = fit_den = 0.0
    cases = []  # per sequence: (n, target, routed) for the routed-scale fit
    hyp_inputs = []  # per sequence: what the hypotheses replay
    a_fit, f_fit = [], []  # (engine, reference) block outputs: an integer-factor fit
    for n, (eng, ref_trace, _b) in enumerate(runs):
        h_in = engine_input(i, eng, ref_trace)

        def inputs(j, eng=eng, ref_trace=ref_trace):
            return engine_input(j, eng, ref_trace)

        shared = shared_topk(i, cfg, eng, reference, inputs)
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
    a_limit = limit_for(attn_base.value, opts, allowance)
    f_limit = limit_for(ffn_base.value, opts, allowance)
    a_stats = {"error": attn_err.value, "baseline": attn_base.value, "limit": a_limit,
               "ratio": ratio(attn_err.value, attn_base.value)}
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
            comp, how = match_block(hyp_inputs, rep, a_limit, hypotheses_attention(cfg), "hidden", margin)
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
            comp, how = match_block(hyp_inputs, rep, a_limit, hypotheses_attention(cfg), "attn_out", margin)
        if comp is None:
            comp, how = integer_factor(a_fit, a_limit, "attention", tp, rep.w.get("attn_output.bias"))
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
               "ratio": ratio(ffn_err.value, ffn_base.value)}
    block = "moe-experts" if moe_layer else "ffn"
    ffn_bad = not ffn_err.value <= f_limit
    if moe_layer and n_jac:
        mean_jac = jac / n_jac
        st = {"mean_jaccard": mean_jac, "positions": n_jac, "error": 1 - mean_jac, "baseline": 0.0,
              "limit": 1 - opts.router_min_jaccard, "ratio": None}
        if mean_jac < opts.router_min_jaccard:
            how = match_router(hyp_inputs, runs, rep, i, hypotheses_ffn(cfg, moe_layer), opts.router_min_jaccard)
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
            comp, how = match_ffn(hyp_inputs, rep, f_limit, hypotheses_ffn(cfg, moe_layer))
        if comp is None:
            comp, how = integer_factor(f_fit, f_limit, "MoE" if moe_layer else "FFN", tp)
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
