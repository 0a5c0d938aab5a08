"""The NextN / MTP draft head: is the engine's speculative-decoding head right?

GLM-5 and DeepSeek-V3 ship a NextN (MTP) block after the trunk; engines run it to draft
tokens that the trunk then verifies. A broken head never shows in the output (the trunk
rejects its drafts): only the draft acceptance rate drops, and the served checks, which
read the trunk, pass. So this stage runs the engine's head on a prompt as the engine feeds it
when drafting (:meth:`Engine.mtp_outputs`: each row's token with the trunk state the engine
carried) and judges its distributions against the reference's head fed the very same states
(reference/mtp.py): a fault in the trunk cannot reach this comparison, and a fault in the
head, its weights or the state it is given (another row's, one taken before the final norm)
fails it, named ``mtp``. The state itself is judged against the engine's own trunk state of
the row before (``mtp.state``): a draft loop that feeds another row's state is named there.
Not caught: an engine whose trunk hands over a state taken before the final norm in both
places (its reported trunk state and the fed one agree); measured on the tiny models, such a
head moves the drafts by KL 6e-3..5e-2 only (``hnorm`` renormalises).

The allowance is the logits stage's: KL against the fp64 reference within ``multiple x``
the baseline run's KL (the baseline model's head on the same states, rounding as the
engine's class does) ``+ floor``, widened to the class's stated allowance; rows where the
head's MoE routing is a near-tie for the engine's class are left out. The report also gives
the acceptance at draft position 1 that speculative decoding would see at temperature 0
(the head's top-1 equal to the trunk's), for the engine's head and for the reference's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ggufcheck.checks.logits import ROUTER_TIE_MARGINS, LogitTolerance, baseline_from, collect, judge
from ggufcheck.engines.base import MTPTrace, TokenLogprobs, Unsupported
from ggufcheck.results import Result, StageReport, failed, passed, skipped

if TYPE_CHECKING:
    from ggufcheck.diagnose.session import Session

STAGE = "mtp"
PROMPTS = 2  # prompts the head is run on (each a trunk pass and a head pass on the engine)


def nextn_layers(session: "Session") -> int:
    """The file's NextN / MTP block count (``{arch}.nextn_predict_layers``, 0 if absent)."""
    meta = session.open_model().metadata
    arch = meta.get("general.architecture")
    return int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)


def when(session: "Session") -> str | None:
    """None when the stage runs; else why it is skipped."""
    if not session.has_engine:
        return "no --engine given"
    if nextn_layers(session) == 0:
        return "the file has no NextN / MTP layer (nextn_predict_layers absent or 0)"
    return None


def _head_table(model, trace: MTPTrace) -> tuple[TokenLogprobs, np.ndarray | None]:
    """A reference model's head over the engine's rows and states: its table and the MoE
    router gaps of its block (None for a dense block)."""
    import torch

    from ggufcheck.reference.mtp import MTPHead

    out = MTPHead(model).forward([int(t) for t in trace.tokens], torch.from_numpy(np.asarray(trace.states)))
    logprobs = out.logprobs.to("cpu", torch.float64).numpy()
    gap = out.layer.router_gap
    return (TokenLogprobs(trace.tokens, logprobs.shape[-1], logprobs),
            None if gap is None else gap.to("cpu", torch.float64).numpy())


def _judge_states(traces: list[MTPTrace], klass: str, name: str) -> Result:
    """The state each row was fed against the one the engine's own trunk computed for the row
    before (row 0, a fresh sequence's, is not judged: llama.cpp feeds zeros there): a driver
    that feeds another row's state, or a stale one, gives its head the wrong input, which the
    head comparison (fed the same states on both sides) cannot see. Relative L2 error per
    row; a correct driver copies the state (0), the median is held to the layers stage's
    residual allowance of the engine's class."""
    from ggufcheck.checks.path_layers import allowance_for

    if any(t.trunk_states is None for t in traces):
        return skipped("mtp.state", "mtp", f"{name} does not report its trunk states: the state fed is not judged")
    errors = []
    for t in traces:
        want = np.asarray(t.trunk_states, dtype=np.float64)[:-1]
        fed = np.asarray(t.states, dtype=np.float64)[1:]
        errors.append(np.linalg.norm(fed - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30))
    rel = np.concatenate(errors) if errors else np.zeros(0)
    if rel.size == 0:
        return skipped("mtp.state", "mtp", "no MTP row after the first to judge")
    limit = allowance_for(klass)
    median, worst = float(np.median(rel)), float(rel.max())
    what = (f"the state {name} fed MTP row p vs its trunk's own post-output_norm state of row p - 1: relative error "
            f"median {median:.3g} over {rel.size} rows (max {worst:.3g}), allowance {limit:.3g}")
    stats = {"median": median, "max": worst, "rows": int(rel.size), "limit": limit}
    if not np.isfinite(median) or median > limit:
        return failed("mtp.state", "mtp", what + ": the head is given the wrong state (another row's, or a stale one)",
                      stats=stats)
    return passed("mtp.state", "mtp", what, stats=stats)


def run(session: "Session") -> list[StageReport]:
    report = StageReport(STAGE)
    engine = session.engine()
    reference = session.reference()
    model = getattr(reference, "model", None)
    if model is None:
        report.add(skipped("mtp.head", "mtp", "the MTP head is computed by ggufcheck's own reference only "
                                              f"(--reference {session.options.reference})"))
        return [report]
    prompts = session.tokens()[:PROMPTS]
    try:
        traces = [engine.mtp_outputs(p) for p in prompts]
    except Unsupported as why:
        report.add(skipped("mtp.head", "mtp", str(why)))
        return [report]
    klass = engine.capabilities.activation_dtype
    report.add(_judge_states(traces, klass, engine.name))
    margin = ROUTER_TIE_MARGINS.get(klass, 0.0)
    pairs, base_pairs, accepted = [], [], {"engine": 0, "reference": 0, "rows": 0}
    baseline_model = session.baseline_model()
    for trace in traces:
        ref, gap = _head_table(model, trace)
        if gap is not None and margin:
            ref = replace(ref, ambiguous=gap < margin)
        pairs.append((ref, trace.table))
        if baseline_model is not None:
            base_pairs.append((ref, _head_table(baseline_model, trace)[0]))
        trunk = np.asarray(trace.trunk_argmax)
        accepted["engine"] += int(np.sum(trace.table.argmax() == trunk))
        accepted["reference"] += int(np.sum(ref.argmax() == trunk))
        accepted["rows"] += len(trunk)
    from ggufcheck.checks.compare import combined_baseline

    measured = (baseline_from(collect(base_pairs), f"measured: the baseline run's head ({str(baseline_model.dtype).replace('torch.', '')})")
                if base_pairs else None)
    baseline = combined_baseline(measured, klass)
    results = judge(collect(pairs), baseline, LogitTolerance(), detokenize=None, component="mtp")
    n = accepted["rows"]
    rate = (f"; draft acceptance at position 1 (the head's top-1 = the trunk's) {accepted['engine']}/{n} for "
            f"{engine.name}'s head, {accepted['reference']}/{n} for the reference's head on the same states")
    report.info["acceptance"] = accepted
    report.info["rows"] = f"{len(traces)} prompt(s), {n} MTP rows, each fed the trunk state {engine.name} carried"
    for r in results:
        r = replace(r, check=r.check.replace("logits.", "mtp."))
        report.add(r.amended(rate) if r.check == "mtp.kl_mean" else r)
    return [report]
