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

Drafting more than one token chains the head (:meth:`Engine.mtp_drafts`; llama.cpp's
draft-mtp driver with one NextN block): step k + 1 is fed step k's greedy draft and the
head's OWN output state of step k, through its KV cache holding the sequence's MTP rows
before the start row. On a sequence that is the reference trunk's greedy continuation of the
first prompt (reference/mtp.py ``greedy_continuation``), from ``DRAFT_STARTS`` start rows,
``DRAFT_STEPS`` steps each, the stage judges (a) the engine's distributions at draft
positions 2..K against the reference's head chained on exactly what the engine fed each step
(the same tokens and states: ``mtp.chain_kl_mean`` / ``mtp.chain_kl_p99`` /
``mtp.chain_argmax``, the same allowance as position 1), and (b) the state the engine fed
each step after the first against the reference head's output state of the step before on
those inputs (``mtp.chain_state``: a driver that feeds the trunk's state, or the head's
state before shared_head_norm, again is named there). Position 1 of a chain is the row judged
above. The report gives acceptance by draft position (reference/mtp.py
``acceptance_by_position``: draft k accepted iff drafts 1..k equal the greedy sequence's
next k tokens) for the engine's chain, for the reference's head chained on the engine's
trunk states, and for the reference end to end (its own trunk states): the acceptance that
speculative decoding at temperature 0 would see against the reference trunk's own choices.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ggufcheck.checks.logits import ROUTER_TIE_MARGINS, LogitTolerance, baseline_from, collect, judge
from ggufcheck.engines.base import MTPDrafts, MTPTrace, TokenLogprobs, Unsupported
from ggufcheck.results import Result, StageReport, failed, passed, skipped

if TYPE_CHECKING:
    from ggufcheck.diagnose.session import Session

STAGE = "mtp"
PROMPTS = 2  # prompts the head is run on (each a trunk pass and a head pass on the engine)
DRAFT_STEPS = 3  # K: draft tokens per chain (llama.cpp's --spec-draft-n-max default)
DRAFT_STARTS = 4  # S: start rows chained (the last rows of the first prompt's greedy continuation)


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
    served = _judge_served(session, engine, model)
    try:
        traces = [engine.mtp_outputs(p) for p in prompts]
    except Unsupported as why:
        report.add(served if served is not None else skipped("mtp.head", "mtp", str(why)))
        return [report]
    if served is not None:
        report.add(served)
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

    base_dtype = str(getattr(baseline_model, "dtype", "")).replace("torch.", "")
    measured = (baseline_from(collect(base_pairs), f"measured: the baseline run's head ({base_dtype})")
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
    _judge_chains(session, engine, model, baseline_model, klass, margin, report)
    return [report]


def _chain_tables(model, drafts: MTPDrafts) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A reference model's head chained on exactly what the engine fed each step (its tokens,
    its states, its cache rows): (log-probabilities [S, K, V], output states [S, K, D],
    router gaps [S, K] or None)."""
    import torch

    from ggufcheck.reference.mtp import chained_drafts

    chains = chained_drafts(model, [int(t) for t in drafts.tokens], [int(p) for p in drafts.start_rows],
                            drafts.fed_tokens.shape[1], row_states=torch.from_numpy(np.asarray(drafts.states)),
                            feed=(drafts.fed_tokens, np.asarray(drafts.fed_states)))
    logprobs = np.stack([c.logprobs.to("cpu", torch.float64).numpy() for c in chains])
    hidden = np.stack([c.hidden.to("cpu", torch.float64).numpy() for c in chains])
    gaps = (None if chains[0].router_gap is None
            else np.stack([c.router_gap.to("cpu", torch.float64).numpy() for c in chains]))
    return logprobs, hidden, gaps


def _position_table(tokens: np.ndarray, logprobs: np.ndarray, ambiguous: np.ndarray | None = None) -> TokenLogprobs:
    """Draft steps 2..K of every chain as one table (rows: chain-major)."""
    vocab = logprobs.shape[-1]
    return TokenLogprobs(tokens[:, 1:].reshape(-1), vocab, logprobs[:, 1:].reshape(-1, vocab),
                         ambiguous=None if ambiguous is None else ambiguous[:, 1:].reshape(-1))


def _judge_chain_states(drafts: MTPDrafts, ref_hidden: np.ndarray, klass: str, name: str) -> Result:
    """The state the engine fed each draft step after the first against the reference head's
    output state (after shared_head_norm) of the step before, computed on the engine's inputs:
    a driver that feeds the trunk's state, a stale one, or the head's state before its norm is
    named here. Relative L2 error per step, held like ``mtp.state``."""
    from ggufcheck.checks.path_layers import allowance_for

    fed = np.asarray(drafts.fed_states, dtype=np.float64)[:, 1:]
    want = ref_hidden[:, :-1]
    rel = (np.linalg.norm(fed - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)).reshape(-1)
    if rel.size == 0:
        return skipped("mtp.chain_state", "mtp", "a single draft step: no chained state to judge")
    limit = allowance_for(klass)
    median, worst = float(np.median(rel)), float(rel.max())
    what = (f"the state {name} fed draft step k + 1 vs the reference head's own output state of step k on the same "
            f"inputs: relative error median {median:.3g} over {rel.size} steps (max {worst:.3g}), "
            f"allowance {limit:.3g}")
    stats = {"median": median, "max": worst, "steps": int(rel.size), "limit": limit}
    if not np.isfinite(median) or median > limit:
        return failed("mtp.chain_state", "mtp", what + ": a chained draft step is given the wrong state (the "
                      "trunk's, a stale one, or the head's before its norm)", stats=stats)
    return passed("mtp.chain_state", "mtp", what, stats=stats)


def _judge_chains(session: "Session", engine, model, baseline_model, klass: str, margin: float,
                  report: StageReport) -> None:
    """Chained drafts: draft positions 2..K judged, acceptance by draft position reported."""
    import torch

    from ggufcheck.checks.compare import combined_baseline
    from ggufcheck.reference.mtp import acceptance_by_position, chained_drafts, greedy_continuation

    prompts = session.tokens()
    if not prompts:
        return
    prompt = list(prompts[0])
    seq = greedy_continuation(model, prompt, DRAFT_STARTS + DRAFT_STEPS - 1)
    starts = list(range(len(prompt) - 1, len(prompt) - 1 + DRAFT_STARTS))
    try:
        drafts = engine.mtp_drafts(seq, starts, DRAFT_STEPS)
    except Unsupported as why:
        report.add(skipped("mtp.chain", "mtp", f"{why}: only draft position 1 is judged"))
        return
    ref_logprobs, ref_hidden, gaps = _chain_tables(model, drafts)
    ambiguous = gaps < margin if gaps is not None and margin else None
    tokens = np.asarray(drafts.fed_tokens)
    pairs = [(_position_table(tokens, ref_logprobs, ambiguous), _position_table(tokens, np.asarray(drafts.logprobs)))]
    measured = None
    if baseline_model is not None:
        base = _position_table(tokens, _chain_tables(baseline_model, drafts)[0])
        measured = baseline_from(collect([(pairs[0][0], base)]),
                                 f"measured: the baseline run's head chained on the same inputs "
                                 f"({str(baseline_model.dtype).replace('torch.', '')})")
    # KL per draft position (position 1 included: the chain's first step is a row judged above)
    p, q = ref_logprobs, np.asarray(drafts.logprobs, dtype=np.float64)
    kl = np.sum(np.exp(p) * (p - q), axis=-1)  # [S, K]
    # acceptance by draft position against the reference trunk's greedy sequence
    own = chained_drafts(model, seq, starts, DRAFT_STEPS, row_states=torch.from_numpy(np.asarray(drafts.states)))
    end_to_end = chained_drafts(model, seq, starts, DRAFT_STEPS)
    accepted = {
        "engine": acceptance_by_position(drafts.drafts, seq, starts),
        "reference_head": acceptance_by_position([c.drafts for c in own], seq, starts),
        "reference": acceptance_by_position([c.drafts for c in end_to_end], seq, starts),
        "rounds": len(starts), "steps": DRAFT_STEPS,
        "trunk_agrees": int(np.sum(np.asarray(drafts.trunk_argmax)[starts[0]:len(seq) - 1]
                                   == np.asarray(seq)[starts[0] + 1:])),
        "trunk_rows": len(seq) - 1 - starts[0],
    }
    report.info["acceptance_by_position"] = accepted
    report.info["chain"] = (f"{len(starts)} chains of {DRAFT_STEPS} draft steps from rows {starts[0]}..{starts[-1]} of "
                            f"the first prompt continued greedily by the reference trunk ({len(seq)} tokens)")
    report.info["chain_kl_by_position"] = [float(v) for v in kl.mean(axis=0)]
    n = len(starts)

    def rates(counts: list[int]) -> str:
        return ", ".join(f"{c}/{n}" for c in counts)

    note = (f"; KL mean by draft position {', '.join(f'{v:.3g}' for v in kl.mean(axis=0))}; acceptance by draft "
            f"position 1..{DRAFT_STEPS} (all drafts up to k equal to the reference trunk's greedy tokens) "
            f"{rates(accepted['engine'])} for {engine.name}'s chain, {rates(accepted['reference_head'])} for the "
            f"reference's head chained on {engine.name}'s trunk states, {rates(accepted['reference'])} for the "
            f"reference end to end")
    report.add(_judge_chain_states(drafts, ref_hidden, klass, engine.name))
    if DRAFT_STEPS < 2:
        return
    results = judge(collect(pairs), combined_baseline(measured, klass), LogitTolerance(), detokenize=None,
                    component="mtp")
    for r in results:
        if r.check not in ("logits.kl", "logits.kl_mean", "logits.kl_p99", "logits.argmax"):
            continue
        r = replace(r, check=r.check.replace("logits.", "mtp.chain_"),
                    message=f"draft positions 2..{DRAFT_STEPS}, chained: " + r.message)
        report.add(r.amended(note) if r.check == "mtp.chain_kl_mean" else r)


SERVED_NEW_TOKENS = 32  # tokens a speculative generation runs (about 8-16 drafting rounds at K = 3)
INFORMATIVE_RATE = 0.5  # the reference's own acceptance below which the served rate is not judged


def _judge_served(session: "Session", engine, model) -> Result | None:
    """The acceptance a server's own speculative decoding reports (:meth:`Engine.speculative_generate`)
    against what the reference's head would have accepted on the same sequence.

    The server generates greedily from the first prompt with its drafts on and reports how many
    it drafted and how many the trunk accepted. On the sequence it produced, the reference's
    head drafts K tokens from every row, chained as llama.cpp's draft-mtp driver chains them
    (reference/mtp.py ``chained_drafts``), and each start row accepts its longest prefix that
    the sequence continues (``acceptance_by_position``): accepted / drafted over those rows is
    the rate a correct head would give (the server drafts from a subset of those rows: where
    each of its rounds ended). It is judged only where it is informative: a head that predicts
    its trunk (the reference's rate at least ``INFORMATIVE_RATE``; random weights give ~0 on
    both sides, and a broken head could not be told from them). A served rate under half the
    reference's FAILS: the server's draft head (its weights as loaded, its graph, or the state
    its driver feeds it) is wrong, while its output, which the trunk verifies, stays right.
    None when the engine has no speculative decoding to report."""
    from ggufcheck.reference.mtp import acceptance_by_position, chained_drafts

    check = "mtp.served_acceptance"
    prompts = session.tokens()
    if not prompts:
        return None
    try:
        run = engine.speculative_generate(list(prompts[0]), SERVED_NEW_TOKENS)
    except Unsupported:
        return None
    k = max(1, int(run.draft_max))
    seq = [int(t) for t in run.prompt + run.generated]
    starts = list(range(len(run.prompt) - 1, len(seq) - k))
    stats = {"drafted": run.drafted, "accepted": run.accepted, "draft_max": k, "generated": len(run.generated),
             "source": run.source}
    if run.drafted == 0 or not starts:
        return skipped(check, "mtp", f"{engine.name} drafted nothing over {len(run.generated)} generated tokens "
                                     "(speculative decoding reported on, no draft made)", stats=stats)
    chains = chained_drafts(model, seq, starts, k)
    counts = acceptance_by_position([c.drafts for c in chains], seq, starts)
    expected = sum(counts) / (len(starts) * k)
    stats.update(reference_by_position=counts, reference_rows=len(starts), reference_rate=expected,
                 served_rate=run.rate)
    by_position = ", ".join(f"{c}/{len(starts)}" for c in counts)
    what = (f"{engine.name}'s speculative decoding accepted {run.accepted}/{run.drafted} drafts ({run.rate:.0%}) over "
            f"{len(run.generated)} greedy tokens; the reference's head, chained K = {k} from each of {len(starts)} rows "
            f"of that sequence, would accept {expected:.0%} (by draft position 1..{k}: {by_position})")
    if expected < INFORMATIVE_RATE:
        return skipped(check, "mtp", what + f": not judged, the reference's own head accepts under "
                                            f"{INFORMATIVE_RATE:.0%} here (a head that does not predict its trunk, as "
                                            "random weights give), so a broken head could not be told apart",
                       stats=stats)
    if not run.rate >= expected / 2:
        return failed(check, "mtp", what + ": the server's drafts are rejected at under half the rate a correct head "
                                           "gives: its MTP / NextN draft head (the weights it loaded, its graph, or "
                                           "the state its draft driver feeds) is wrong; the output stays right "
                                           "because the trunk verifies every draft", stats=stats)
    return passed(check, "mtp", what, stats=stats)
