"""Is the engine's rotary-embedding kernel a rotation by the right angles? (layers stage)

When a layer's attention block disagrees with the reference replayed on the engine's own
input, the rope is the first suspect that can be tested on its own: an engine that exposes
its rope call (``layer_outputs`` kind ``"rope"``: the query and key heads going in and
coming out, and the positions it was given) is checked here against the reference's
formula (``reference.layers.apply_rope``) with the reference's angles (fp64) at the
positions the rows really have, on the engine's OWN inputs. No other part of the model is
involved, so a failure names the rope kernel (or the positions, or the cos / sin table it
was built with) and nothing else.

Under YaRN an engine may fold the magnitude correction (mscale) into its cos / sin table
(vLLM does; llama.cpp scales cos / sin by attn_factor): there the check fits one magnitude
for the whole layer and reports it, so only the angles are judged.

The pairing (NORM: interleaved pairs; NEOX: halves) is the engine's business: it follows
the order its q / k rows were loaded in, which the weights stage audits. So both pairings
are tried and the better one is reported; a wrong pairing of correctly rotated rows is the
"rope" hypothesis of the attention replay, not this check.

Shapes: ``("rope", i)`` [T, 2, N, R] (in / out; the first ``("ropeqheads", i)`` of the N
head rows are query heads, the rest key heads; R rotated dims), ``("ropepos", i)`` [T].
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ggufcheck.reference.layers import apply_rope
from ggufcheck.results import Result, failed, passed

# A rotation computed in fp32 from an fp32 cos / sin table drifts with the angle (p * theta,
# rounded to ~6e-8 relative): ~1e-4 relative at position 2,000. The limit leaves room for
# that and for bf16 rounding; a wrong kernel, table or position is off by O(1).
FLOOR = 2e-3


def rope_result(runs, layer: int, reference, limit: float) -> Result | None:
    """PASS / FAIL for the engine's rope at ``layer`` over the prompts in ``runs``
    ((engine trace, reference trace, _) per prompt); None when the engine does not expose it
    or its rotated width is not the reference's."""
    limit = max(limit, FLOOR)
    scaled = getattr(getattr(reference, "cfg", None), "yarn", None) is not None
    magnitude = 1.0
    best: dict[str, dict[str, Any]] = {}
    for mode in ("norm", "neox"):
        worst = {"error": 0.0}
        for n, (eng, _ref, _b) in enumerate(runs):
            pair = eng.tensors.get(("rope", layer))
            if pair is None:
                return None
            pair = torch.as_tensor(np.asarray(pair)).to(torch.float64)  # [T, 2, N, R]
            t, _, heads, r = pair.shape
            pos = torch.arange(t)
            cos, sin = reference.rope(pos.to(reference.device), layer)
            if 2 * cos.shape[-1] != r:
                return None
            cos, sin = cos.to("cpu", torch.float64), sin.to("cpu", torch.float64)
            want = apply_rope(pair[:, 0], cos, sin, mode)  # [T, N, R]
            got = pair[:, 1]
            if scaled:  # YaRN: engines may fold the magnitude correction into cos / sin
                fine = torch.isfinite(got) & torch.isfinite(want)
                g, w_ = torch.where(fine, got, 0.0), torch.where(fine, want, 0.0)
                magnitude = float((g * w_).sum() / (w_ * w_).sum().clamp_min(1e-300))
                want = want * magnitude
            num = (got - want).norm(dim=-1)
            den = want.norm(dim=-1).clamp_min(1e-30)
            err = torch.where(torch.isfinite(got).all(-1), num / den, torch.full_like(num, math.inf))
            err = torch.where(torch.isnan(pair[:, 0]).any(-1), torch.zeros_like(err), err)  # rows not found
            flat = int(torch.argmax(err))
            if float(err.flatten()[flat]) > worst["error"] or "sequence" not in worst:
                q_heads = eng.tensors.get(("ropeqheads", layer))
                nq = int(np.asarray(q_heads)[0]) if q_heads is not None else heads
                p, h = divmod(flat, heads)
                given = eng.tensors.get(("ropepos", layer))
                ok = (err.max(dim=-1).values <= limit).tolist()
                worst = {"error": float(err.flatten()[flat]), "sequence": n, "position": p, "magnitude": magnitude,
                         "head": f"query {h}" if h < nq else f"key {h - nq}",
                         "given_position": None if given is None else int(np.asarray(given)[p]),
                         "positions_right": sum(ok), "positions": len(ok),
                         "first_wrong": next((j for j, good in enumerate(ok) if not good), None)}
        best[mode] = worst
    mode = min(best, key=lambda m: best[m]["error"])
    w = best[mode]
    stats = {"error": w["error"], "limit": limit, "baseline": 0.0, "ratio": None, "pairing": mode.upper()}
    if scaled:
        stats["magnitude"] = w["magnitude"]  # the YaRN magnitude the engine folded into its table (1: none)
    where = {k: w[k] for k in ("sequence", "position", "head", "given_position")}
    if w["error"] <= limit:
        return passed("layers.rope", "rope",
                      f"layer {layer}: the engine's rope rotates its own q / k as {mode.upper()} pairs by the "
                      f"reference angles (error {w['error']:.2g}, limit {limit:.2g})", layer=layer, stats=stats)
    pos_note = ""
    if w["given_position"] is not None and w["given_position"] != w["position"]:
        pos_note = f" (it was given position {w['given_position']} for that row)"
    return failed("layers.rope", "rope",
                  f"layer {layer}: the engine's rope kernel, applied to its own q / k, is not a rotation by the "
                  f"reference angles in either pairing: error {w['error']:.3g} > limit {limit:.3g} at position "
                  f"{w['position']}, {w['head'].replace(' ', ' head ')}{pos_note}; {w['positions_right']} of {w['positions']} positions "
                  f"right", layer=layer, stats=stats, worst=where)
