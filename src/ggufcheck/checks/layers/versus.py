"""The layers stage against another ENGINE as the reference (``--reference hf-gguf``, ...).

Two implementations that expose their residual streams are compared layer by layer on the
same tokens, without replay: ggufcheck's own reference (which can replay a layer on the
engine's input and name the block) may not have the architecture, and an engine cannot be
replayed. So this says less than the replay stage: WHERE the two first disagree (the first
layer whose residual differs beyond the two precision classes' allowance), not which block
and not which side is wrong; with no third implementation the verdict is that the two
disagree.

Statistic: per layer, the relative error ``||a - b|| / ||b||`` per position; the 90th
percentile over positions and prompts is judged (a routing or top-k near-tie flips a few
positions in either of two correct implementations; a faulty layer moves most), the max is
reported. Limit: the larger of the two engines' residual allowances for their activation
classes (:class:`LayerOptions` ``residual_allowances``; fp32: ``fp32_versus_allowance``) and
the floor.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ggufcheck.checks.layers.metrics import rel_errors
from ggufcheck.checks.layers.options import STAGE, LayerOptions
from ggufcheck.checks.layers.capture import layer_outputs_that_fit
from ggufcheck.results import StageReport, failed, passed, skipped

QUANTILE = 0.9


def run_layers_vs_engine(engine, reference, tokens_list: Sequence[Sequence[int]],
                         options: LayerOptions | None = None,
                         progress: Callable[[str], None] | None = None) -> StageReport:
    """The engine's residual stream against ``reference`` (another Engine), layer by layer."""
    opts = options or LayerOptions()
    report = StageReport(STAGE)
    for who, eng in (("the engine", engine), (f"the reference {reference.name}", reference)):
        if "residual" not in eng.capabilities.layer_outputs:
            report.add(skipped(STAGE, "output", f"{who} exposes no per-layer residual stream: "
                                                f"{eng.capabilities.why_not('layer_outputs')}"))
            return report
    classes = (engine.capabilities.activation_dtype, reference.capabilities.activation_dtype)
    allowance = max([opts.floor] + [opts.residual_allowances.get(c, opts.fp32_versus_allowance if c == "fp32" else 0.0)
                                    for c in classes])
    say = progress or (lambda _m: None)
    per_layer: dict[int, list[torch.Tensor]] = {}
    for n, tokens in enumerate(tokens_list):
        say(f"layers: prompt {n + 1}/{len(tokens_list)} on the engine and the reference {reference.name}")
        used, mine = layer_outputs_that_fit(engine, [int(t) for t in tokens], ["residual"])
        theirs = reference.layer_outputs(used, ["residual"])
        for (kind, i), got in mine.tensors.items():
            want = theirs.tensors.get((kind, i))
            if kind == "residual" and want is not None:
                per_layer.setdefault(i, []).append(rel_errors(torch.as_tensor(np.asarray(got)),
                                                              torch.as_tensor(np.asarray(want))))
    if not per_layer:
        report.add(skipped(STAGE, "output", "the engine and the reference expose no common layers"))
        return report
    rows = []
    for i in sorted(per_layer):
        errs = torch.cat(per_layer[i])
        rows.append({"layer": i, "error": float(torch.quantile(errs.clamp_max(1e30), QUANTILE)),
                     "max": float(errs.max()), "limit": allowance})
    report.info.update(per_layer=rows, reference=reference.name, statistic=f"p{int(QUANTILE * 100)} over positions",
                       activation_dtype=classes[0], baseline=f"stated residual allowance of {classes[0]} / "
                                                             f"{classes[1]} (no replay: an engine reference)")
    first = next((r for r in rows if not r["error"] <= r["limit"]), None)
    if first is None:
        worst = max(rows, key=lambda r: r["error"])
        report.add(passed("layers.residual", "output",
                          f"all {len(rows)} layers agree with {reference.name} within the residual allowance "
                          f"{allowance:.3g} of the {classes[0]} / {classes[1]} classes (worst layer {worst['layer']}: "
                          f"p90 error {worst['error']:.3g}, max {worst['max']:.3g})",
                          stats={"layers": len(rows), "worst_layer": worst["layer"], "error": worst["error"],
                                 "limit": allowance}))
        return report
    for r in rows[:rows.index(first)]:
        report.add(passed("layers.residual", "output", f"layer {r['layer']}: p90 error {r['error']:.3g} <= limit "
                                                       f"{r['limit']:.3g}", layer=r["layer"],
                          stats={"error": r["error"], "limit": r["limit"]}))
    report.add(failed("layers.residual", "output",
                      f"layer {first['layer']}: the engine and {reference.name} first disagree here (p90 relative "
                      f"error {first['error']:.3g}, max {first['max']:.3g}, limit {first['limit']:.3g}); an engine "
                      "reference cannot be replayed on the engine's input, so the block is not named, and without a "
                      "third implementation this does not say which of the two is wrong",
                      layer=first["layer"], stats={"error": first["error"], "max": first["max"],
                                                   "limit": first["limit"]}))
    return report
