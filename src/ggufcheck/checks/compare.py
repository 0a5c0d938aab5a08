"""The compare stages: an engine against the reference (logits), and against itself.

``run_compare`` takes token sequences (tokenized once, so every engine sees the same ids),
the engine under test, the reference (fp64) and optionally a baseline engine (the
reference in a lower precision) and returns three StageReports:

- ``sanity``: the engine's own distributions (no reference needed);
- ``logits``: teacher-forced metrics against the reference, judged relative to the honest
  baseline (measured baseline run vs fp64; for quantized-activation engines the stated
  allowance of their class as well, whichever is larger);
- ``paths``: prefill vs decode, batch, determinism, chunked prefill, past the indexer top_k.

A missing reference or capability SKIPs the checks that need it, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

import math

import numpy as np

from ggufcheck.checks.logits import (
    ALLOWANCES,
    INDEXER_TIE_MARGINS,
    ROUTER_TIE_MARGINS,
    Baseline,
    LogitTolerance,
    baseline_from,
    collect,
    distribution,
    judge,
)
from ggufcheck.checks.alignment import Realigned, detect_offset, input_ignored, shift_rows
from ggufcheck.checks.paths import first_divergence, landmarks, PathOptions, run_paths
from ggufcheck.checks.sanity import SanityLimits, run_sanity
from ggufcheck.engines.base import Engine, TokenLogprobs, Unsupported, coarsest
from ggufcheck.results import Result, StageReport, Status, failed, passed, skipped, warned

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.diagnose.session import Session

Progress = Callable[[str], None]


@dataclass(frozen=True)
class CompareOptions:
    top_k: int = 20
    max_new_tokens: int = 8
    decode_prompts: int = 2
    long_decode_to: int = 272  # the first prompt decoded to this position (PathOptions)
    # prefill length sweep (checks.lengths) over prompts of up to this many tokens (520: past
    # llama.cpp's 512-token micro-batch); 0: no sweep
    sweep_to: int = 520
    chunk_sizes: tuple[int, ...] = (5,)
    tolerance: LogitTolerance = field(default_factory=LogitTolerance)
    sanity: SanityLimits = field(default_factory=SanityLimits)
    run_sanity: bool = True
    run_paths: bool = True
    indexer_top_k: int | None = None


def combined_baseline(measured: Baseline | None, activation_dtype: str) -> Baseline:
    """The measured baseline, widened to the stated allowance of a lower-precision class.

    The reference computes in fp32 or fp64 only, so for engines whose activations are
    bf16, fp16 or 8-bit quantized the measured fp32-vs-fp64 spread understates a correct
    engine's error; the larger of the two is used and both sources are named.
    """
    allowance = ALLOWANCES.get(activation_dtype)
    if measured is None:
        return allowance or ALLOWANCES["fp32"]
    if activation_dtype in ("fp32", "fp64") or allowance is None:
        return measured
    return Baseline(
        source=f"the larger of {measured.source} (KL {measured.kl_mean:.2g}) and the {allowance.source} "
               f"(KL {allowance.kl_mean:.2g})",
        kl_mean=max(measured.kl_mean, allowance.kl_mean),
        kl_p99=max(measured.kl_p99, allowance.kl_p99),
        argmax_agreement=min(measured.argmax_agreement, allowance.argmax_agreement),
        nmse_mean=max(measured.nmse_mean, allowance.nmse_mean),
        delta_p_rms=max(measured.delta_p_rms, allowance.delta_p_rms),
    )


class Scorer:
    """Each token sequence scored once on a judging engine (the reference, the baseline run).

    Both are causal: a prefix's rows are the first rows of any longer sequence that starts
    with it. So a sequence that is a prefix of one already scored, or of the ``planned`` one
    (the length sweep's sequence, known once the generations are: it starts with the longest
    generated sequence), is read from that sequence's first rows instead of a pass of its own
    (SmolLM2: the long decode's 272 tokens inside the 520-token sweep, on both engines).
    ``keep``: keep every table scored (the reference's are read again by later checks), else
    only the planned one's."""

    def __init__(self, engine: Engine, say: Progress, keep: bool = True):
        self.engine, self.say, self.keep = engine, say, keep
        self.planned: tuple[int, ...] | None = None
        self.tables: dict[tuple[int, ...], TokenLogprobs] = {}

    def __call__(self, seq: Sequence[int]) -> TokenLogprobs:
        from ggufcheck.checks.lengths import prefix_rows

        key = tuple(int(t) for t in seq)
        if key in self.tables:
            return self.tables[key]
        for longer, table in self.tables.items():
            if len(longer) > len(key) and longer[:len(key)] == key:
                return prefix_rows(table, len(key))
        if self.planned is not None and len(self.planned) > len(key) and self.planned[:len(key)] == key:
            return prefix_rows(self(self.planned), len(key))
        self.say(f"scoring {len(key)} tokens on {self.engine.name}")
        table = self.engine.score(list(key))
        if self.keep or key == self.planned:
            self.tables[key] = table
        return table

    def forget(self) -> None:
        self.tables.clear()


@dataclass
class _Run:
    """One comparison's engines and what they answered so far: the engine under test (realigned
    when its rows are shifted), its prompt tables, and the judging engines' scorers."""

    engine: Engine
    seqs: list[list[int]]
    tables: list[TokenLogprobs]
    reference: Engine | None
    baseline_engine: Engine | None
    options: CompareOptions
    say: Progress
    reference_score: Scorer | None = None
    baseline_score: Scorer | None = None
    ref_tables: list[TokenLogprobs] | None = None

    def __post_init__(self):
        if self.reference is not None:
            self.reference_score = Scorer(self.reference, self.say)
        if self.baseline_engine is not None:
            self.baseline_score = Scorer(self.baseline_engine, self.say, keep=False)

    def plan_sweep(self, generations) -> None:
        """The sweep's sequence, scored first on the judging engines (known once the generations are)."""
        if self.options.sweep_to and self.reference is not None:
            planned = tuple(_sweep_sequence(self.engine, self.seqs, generations, self.options))
            for scorer in (self.reference_score, self.baseline_score):
                if scorer is not None:
                    scorer.planned = planned

    def judged_class(self) -> str:
        """The coarser of the two sides' classes: another engine as the reference rounds too."""
        return coarsest(self.engine.capabilities.activation_dtype, self.reference.capabilities.activation_dtype)

    def measured(self, refs: Sequence[TokenLogprobs]) -> Baseline:
        """The baseline run against the reference on these rows (the reference's tables)."""
        base = [self.baseline_score(r.tokens) for r in refs]
        return baseline_from(collect(list(zip(refs, base))), self.measured_source())

    def measured_source(self) -> str:
        return f"measured {_short(self.baseline_engine)} vs {_short(self.reference)}"


def run_compare(engine: Engine, sequences: Sequence[Sequence[int]], *, reference: Engine | None = None,
                reference_reason: str = "no reference engine was given", baseline_engine: Engine | None = None,
                options: CompareOptions = CompareOptions(), progress: Progress | None = None,
                long_prompt: Sequence[int] | None = None) -> list[StageReport]:
    """Score ``sequences`` on every engine and judge; returns [sanity, logits, paths] reports."""
    say = progress or (lambda _msg: None)
    seqs = [[int(t) for t in s] for s in sequences if len(s) >= 2]
    seqs, tables, declined = _score_what_the_engine_takes(engine, seqs, options.top_k, say)
    if not seqs:  # e.g. every prompt longer than the engine's context: nothing to compare
        why = declined[0].message if declined else "no prompt of at least 2 tokens"
        return [StageReport(name, results=[skipped(name, "output", f"no prompt was scored: {why}")])
                for name in ("sanity", "logits", "paths")]
    run = _Run(engine, seqs, tables, reference, baseline_engine, options, say)
    alignment = _align(run)
    forced_tables: dict[tuple[int, ...], TokenLogprobs] = {}  # the engine's teacher-forced generations
    paths_stage, generations = _paths_stage(run, long_prompt, forced_tables)
    sanity_stage = StageReport("sanity", info={"engine": run.engine.name})
    if options.run_sanity:
        sanity_stage.add(run_sanity(run.tables, generations, run.engine.vocab_size, options.sanity))
    else:
        sanity_stage.add(skipped("sanity", "output", "disabled (--no-sanity)"))
    logits_stage = StageReport("logits", info={"engine": run.engine.name})
    if reference is None:
        logits_stage.add(skipped("logits", "output", reference_reason))
    else:
        _logits_stage(run, logits_stage, alignment, generations, forced_tables, paths_stage)
    logits_stage.add(declined)
    return [sanity_stage, logits_stage, paths_stage]


def _align(run: _Run) -> Result | None:
    """The reference's prompt tables (near-ties marked for the engine's class); served prompt
    log-probs at the wrong rows (an API dialect) are named, and every check judges the
    realigned rows: the alignment Result, or None."""
    if run.reference is None:
        return None
    # the DSA top-k and MoE routing near-ties the engine's class may flip: the reference marks them
    dtype = run.engine.capabilities.activation_dtype
    measured_margin = _measured_router_margin(run.reference, run.baseline_engine, run.seqs)
    run.reference.judge_ties(indexer_margin=INDEXER_TIE_MARGINS.get(dtype, 0.0),
                             router_margin=max(ROUTER_TIE_MARGINS.get(dtype, 0.0), measured_margin or 0.0))
    run.ref_tables = [run.reference_score(s) for s in run.seqs]
    found = detect_offset(run.ref_tables, run.tables)
    if found is None:
        return None
    alignment, offset = found
    run.engine = Realigned(run.engine, offset)
    run.tables = [shift_rows(t, offset) for t in run.tables]
    return alignment


def _paths_stage(run: _Run, long_prompt, forced_tables) -> tuple[StageReport, list]:
    """The engine against itself (checks.paths): the report and the greedy generations."""
    engine, options, reference, say = run.engine, run.options, run.reference, run.say
    paths_stage = StageReport("paths", info={"engine": engine.describe()})
    if not options.run_paths:
        paths_stage.add(skipped("paths", "decode", "disabled (--no-paths)"))
        return paths_stage, []
    popts = PathOptions(max_new_tokens=options.max_new_tokens, decode_prompts=options.decode_prompts,
                        chunk_sizes=options.chunk_sizes, tolerance=options.tolerance, top_k=options.top_k,
                        indexer_top_k=options.indexer_top_k, long_decode_to=options.long_decode_to)
    path_baseline = combined_baseline(None, engine.capabilities.activation_dtype)
    ambiguity = (lambda seq: run.reference_score(seq).ambiguous) if reference is not None else None

    def baseline_on(sequences) -> Baseline:  # the logits stage's baseline, on a failing pair's sequences
        if run.baseline_engine is None:
            return combined_baseline(None, run.judged_class())
        refs = [run.reference_score(s) for s in sequences]
        say(f"scoring {len(refs)} sequences on {run.baseline_engine.name} (baseline of a failing path pair)")
        return combined_baseline(run.measured(refs), run.judged_class())

    results, generations = run_paths(engine, run.seqs, run.tables, popts, baseline=path_baseline,
                                     long_prompt=long_prompt, ambiguity=ambiguity,
                                     reference_score=run.reference_score if reference is not None else None,
                                     reference_baseline=baseline_on if reference is not None else None,
                                     progress=say, forced_tables=forced_tables, on_generations=run.plan_sweep)
    paths_stage.add(results)
    paths_stage.info["baseline"] = path_baseline.source
    # what the engine generated (the decode checks' rows), kept with the report: the kernel
    # matrix measures its emulated decode arithmetic on the same rows
    paths_stage.info["generations"] = [{"prompt_length": len(g.prompt), "tokens": [int(t) for t in g.sequence]}
                                       for g in generations]
    return paths_stage, generations


def _judged_rows(run: _Run, generations, forced_tables) -> tuple[list[TokenLogprobs], list[TokenLogprobs]]:
    """The reference's and the engine's tables the prefill is judged on: the prompts, and the
    long decode's sequence teacher-forced (prefill positions past the prompts)."""
    judged_refs, judged_tables = list(run.ref_tables), list(run.tables)
    longest = max(len(q) for q in run.seqs)
    for g in generations[:1]:
        if len(g.generated) > run.options.max_new_tokens and len(g.sequence) > longest:
            long_table = forced_tables.get(tuple(int(t) for t in g.sequence))
            if long_table is None:
                try:
                    long_table = run.engine.score(list(g.sequence), top_k=run.options.top_k)
                except Unsupported:
                    continue
            judged_refs.append(run.reference_score(g.sequence))
            judged_tables.append(long_table)
    forced_tables.clear()  # [T, V] each: not held through the sweep
    return judged_refs, judged_tables


def _logits_stage(run: _Run, stage: StageReport, alignment: Result | None, generations, forced_tables,
                  paths_stage: StageReport) -> None:
    """The engine against the reference: the prefill, the length sweep, the decode steps, and
    which path owns a failure."""
    engine, reference, options, say = run.engine, run.reference, run.options, run.say
    if alignment is not None:
        stage.add(alignment)
    ignored = input_ignored(run.ref_tables, _fit_vocab(run.tables, reference.vocab_size))
    if ignored is not None:
        stage.add(ignored)
    judged_refs, judged_tables = _judged_rows(run, generations, forced_tables)
    prefill_checks, metrics, baseline, measured = _judge_prefill(run, judged_refs, judged_tables)
    prefill = prefill_checks[0]
    stage.add(prefill_checks)
    skipped_dsa = (_dense_fits_better(reference, run.seqs, run.tables, prefill, say)
                   if prefill.failed and len(prefill_checks) > 1 else None)  # (one check: NaN rows)
    if skipped_dsa is not None:
        stage.add(skipped_dsa)
    sweep = (_sweep(engine, run.seqs, generations, run.reference_score, baseline, options, say, run.baseline_score,
                    known=judged_tables) if options.sweep_to else None)
    if run.baseline_score is not None:
        run.baseline_score.forget()  # the sweep's [T, V] baseline table
    if sweep is not None:
        stage.add(sweep)
    stage.info["per_position"] = _plotted_positions(metrics, judged_refs, judged_tables, prefill_checks,
                                                    _detokenizer(engine, reference))
    if generations:
        stage.add(_judge_decode(run, generations, baseline, prefill, sweep, paths_stage))
    stage.info.update({
        "reference": reference.name, "baseline": baseline.source,
        "measured_baseline": None if measured is None else vars(measured),
        "kl": distribution(metrics.kl), "argmax_agreement": float(metrics.agree.mean()) if metrics.n else None,
        "positions": metrics.n, "full_vocab": metrics.full_vocab,
    })


def _judge_prefill(run: _Run, judged_refs, judged_tables):
    """The prefill's checks (the first amended with ties and where it first diverges), its
    metrics, the baseline it was held to, and the measured baseline (or None)."""
    reference, options = run.reference, run.options
    measured, base_tables = None, None
    if run.baseline_engine is not None:  # on the very sequences judged (the long one accumulates more)
        run.say(f"scoring {len(judged_refs)} sequences on {run.baseline_engine.name} (baseline)")
        base_tables = [run.baseline_score(r.tokens) for r in judged_refs]
        measured = baseline_from(collect(list(zip(judged_refs, base_tables))), run.measured_source())
    judged_class = run.judged_class()
    baseline = combined_baseline(measured, judged_class)
    fitted = _fit_vocab(judged_tables, reference.vocab_size)
    metrics = collect(list(zip(judged_refs, fitted)))
    tie_note = ""
    if _mostly_ties(metrics) and base_tables is not None:
        metrics, baseline, tie_note = _judged_through_ties(judged_refs, fitted, base_tables, metrics.ambiguous,
                                                           run.measured_source(), judged_class)
    del base_tables  # [T, V] each: not held through the sweep (1.5 GB on a 262k vocabulary)
    checks = judge(metrics, baseline, options.tolerance, detokenize=_detokenizer(run.engine, reference))
    prefill = checks[0].amended(tie_note)
    if prefill.failed and len(checks) > 1:
        first = first_divergence(metrics, checks[1].stats["limit"], landmarks(options))
        if first is not None:
            prefill = prefill.amended("; " + first["text"], stats={"first_divergence": first})
    return [prefill, *checks[1:]], metrics, baseline, measured


def _plotted_positions(metrics, judged_refs, judged_tables, prefill_checks, detokenize) -> list[dict]:
    """Per-position rows for the report's plots, with the per-position limit and what the argmax
    check counted."""
    entries = per_position(metrics, judged_refs, judged_tables, detokenize)
    if len(prefill_checks) > 1:  # the per-position limit, drawn on the KL plots
        for entry in entries:
            entry["kl_limit"] = prefill_checks[1].stats["limit"]
    argmax = next((r for r in prefill_checks if r.check == "logits.argmax"), None)
    if argmax is not None:  # what the argmax check counted, said on its plot (exact rows plotted)
        n = int(argmax.stats["n"])
        for entry in entries:
            entry["argmax_check"] = {"agree": round(argmax.stats["agreement"] * n), "exact":
                                     round(argmax.stats["exact"] * n), "n": n}
    return entries


def _judge_decode(run: _Run, generations, baseline: Baseline, prefill: Result, sweep: Result | None,
                  paths_stage: StageReport) -> list[Result]:
    """The greedy continuations against the reference (decode steps), the decode against the
    arithmetic the engine states, and which path owns a failure."""
    reference, options = run.reference, run.options
    run.say(f"scoring {len(generations)} greedy continuations on {reference.name} (decode vs reference)")
    decode_pairs = [(_ambiguous_onwards(run.reference_score(g.sequence), g), g.steps) for g in generations]
    decode_metrics = collect(decode_pairs)
    decode_baseline, decode_note = baseline, ""
    if _mostly_ties(decode_metrics) and run.baseline_engine is not None:
        refs = [run.reference_score(g.sequence) for g in generations]
        decode_metrics, decode_baseline, decode_note = _judged_through_ties(
            refs, [g.steps for g in generations], [run.baseline_score(r.tokens) for r in refs],
            decode_metrics.ambiguous, run.measured_source(), run.judged_class())
    checks = judge(decode_metrics, decode_baseline, options.tolerance, component="decode")
    steps = ", ".join(str(len(g.generated)) for g in generations)
    decode = checks[0].amended(decode_note, message=f"decode steps vs the reference ({steps} steps): "
                                                    + checks[0].message, check="logits.decode_kl_mean")
    if decode.failed and len(checks) > 1:
        first = first_divergence(decode_metrics, checks[1].stats["limit"], landmarks(options))
        if first is not None:
            decode = decode.amended("; " + first["text"], stats={"first_divergence": first})
    if decode.failed and prefill.failed:
        decode = decode.amended(component="output")  # both paths wrong: not a decode-path fault
    # where the decode parts from the prefill, layer by layer (the paths stage traced it)
    traced = next((r for r in paths_stage.results if r.check == "paths.prefill_vs_decode" and r.failed
                   and r.stats.get("localized", {}).get("layer") is not None), None)

    def at_layer(result: Result) -> Result:
        if traced is None or not result.failed or result.component != "decode":
            return result
        return result.amended("; " + traced.stats["localized"]["text"], layer=traced.layer,
                              stats={"localized": traced.stats["localized"]})

    results = [at_layer(decode)]
    if not results[0].failed and run.baseline_engine is not None:
        arithmetic = _decode_arithmetic(run.reference_score, run.baseline_engine, generations, options.max_new_tokens)
        if arithmetic is not None:
            results.append(arithmetic)
    blame = at_layer(_which_path(prefill, results[0]))
    if blame.failed and blame.component == "prefill" and sweep is not None and sweep.failed \
            and sweep.stats.get("threshold"):  # the length where the prefill goes wrong, and its owner
        blame = blame.amended("; " + sweep.message, component=sweep.component)
    results.append(blame)
    return results


def _decode_arithmetic(reference_score, baseline_engine, generations, steps: int) -> Result | None:
    """The decode steps against the arithmetic the engine states, on the same rows (checks.
    arithmetic): the first ``steps`` steps of each generation, fed to the baseline run as a decode
    (prompt, then one token per forward). A WARN where they exceed it: a one-token kernel far off
    its own rounding still passes the class allowance (the kernel matrix names the type)."""
    from ggufcheck.checks.arithmetic import excess, means, row_kls
    from ggufcheck.checks.lengths import prefix_rows

    if not hasattr(baseline_engine, "score_decoded"):
        return None
    unemulated = getattr(getattr(getattr(baseline_engine, "model", None), "emulation", None), "decode_unemulated", None)
    if unemulated:
        return skipped("logits.decode_arithmetic", "decode", f"not judged: {unemulated}")
    rows = []
    for g in generations:
        n = min(len(g.sequence), len(g.prompt) + steps)
        tokens = [int(t) for t in g.sequence[:n]]
        rows.append(row_kls(reference_score(tokens), prefix_rows(g.steps, n),
                            baseline_engine.score_decoded(tokens, len(g.prompt)), len(g.prompt) - 1))
    pair = means(rows)
    if pair is None:
        return None
    ratio = excess(pair)
    stats = {"kl": pair[0], "emulated_kl": pair[1], "ratio": pair[0] / pair[1] if pair[1] > 0 else None}
    if ratio is None:
        return passed("logits.decode_arithmetic", "decode",
                      f"decode steps within the arithmetic the engine states (KL {pair[0]:.3g}, the reference computing "
                      f"that rounding {pair[1]:.3g} on the same rows)", stats=stats)
    return warned("logits.decode_arithmetic", "decode",
                  f"decode steps round {ratio:.1f}x more than the arithmetic the engine states (KL {pair[0]:.3g}, the "
                  f"reference computing that rounding {pair[1]:.3g} on the same rows): inside the class allowance, "
                  "but a one-token (matrix-vector) kernel far off its own rounding; `ggufcheck quants --engine SPEC` "
                  "names the quant type", stats=stats)


def _sweep_sequence(engine: Engine, seqs, generations, options: CompareOptions) -> list[int]:
    """The length sweep's one long sequence (checks.lengths.sweep_sequence) for this engine."""
    from ggufcheck.checks.lengths import sweep_sequence

    longest = min(options.sweep_to, engine.capabilities.max_sequence or options.sweep_to)
    return sweep_sequence([*seqs, *(g.sequence for g in generations)], longest)


def _sweep(engine: Engine, seqs, generations, reference_score, baseline: Baseline, options: CompareOptions,
           say: Progress, baseline_score=None, known: Sequence[TokenLogprobs] = ()) -> Result:
    """The prefill length sweep (checks.lengths) on one long sequence built from the prompts;
    ``known``: tables the engine already scored (those of prefixes of that sequence are reused)."""
    from ggufcheck.checks.lengths import check_prefill_lengths, landmarks

    caps = engine.capabilities
    sequence = _sweep_sequence(engine, seqs, generations, options)
    marks = landmarks(indexer_top_k=options.indexer_top_k, micro_batch=caps.prefill_micro_batch,
                      longest=len(sequence))
    if not marks:
        return skipped("logits.prefill_lengths", "prefill",
                       f"the prompts make only {len(sequence)} tokens: below every landmark length")
    say(f"sweeping prompt lengths up to {len(sequence)} tokens across {len(marks)} landmarks")
    return check_prefill_lengths(engine, sequence, reference_score(sequence), baseline, options.tolerance, marks,
                                 options.top_k,
                                 measured=baseline_score(sequence) if baseline_score is not None else None,
                                 known={len(t): t for t in known if list(t.tokens) == sequence[:len(t)]})


def _score_what_the_engine_takes(engine: Engine, seqs: list[list[int]], top_k: int, say: Progress | None = None):
    """Score each sequence; one the engine declines (:class:`Unsupported`, e.g. longer than its
    context) is left out of every check, with a SKIP saying which and why."""
    kept, tables, declined = [], [], []
    for i, seq in enumerate(seqs):
        if say is not None:
            say(f"scoring prompt {i + 1}/{len(seqs)} ({len(seq)} tokens) on {engine.name}")
        try:
            tables.append(engine.score(seq, top_k=top_k))
            kept.append(seq)
        except Unsupported as err:
            declined.append(skipped("logits.prompt_declined", "output",
                                    f"prompt {i} ({len(seq)} tokens) left out: {err} (shorten it with "
                                    "--max-tokens, or give the engine a longer context)"))
    return kept, tables, declined


def _dense_fits_better(reference, seqs, tables, prefill: Result, say) -> Result | None:
    """DSA models: did the sparse path actually run? An engine whose output agrees with the
    reference run with the indexer switched off (dense causal attention) within the limit,
    while it disagrees with the sparse reference, has silently skipped sparse attention."""
    model = getattr(reference, "model", None)
    cfg = getattr(model, "cfg", None)
    if cfg is None or not getattr(cfg, "has_indexer", False):
        return None
    from ggufcheck.engines.reference import ReferenceEngine

    say("scoring the prompts on the reference with the DSA indexer off (did sparse attention run?)")
    dense = ReferenceEngine(model.path, dtype="fp64", device=model.device, indexer_heads=0,
                            lora_norm_eps=cfg.lora_norm_eps)
    try:
        dense_tables = [dense.score(s) for s in seqs]
    finally:
        dense.close()
    fit = collect(list(zip(dense_tables, _fit_vocab(tables, dense.vocab_size))))
    kl_dense = float(np.nanmean(fit.kl)) if fit.n else math.inf
    limit = prefill.stats["limit"]
    kl_sparse = prefill.stats["kl"]["mean"]
    if kl_dense > limit:
        return None
    return failed("logits.dsa_ran", "indexer",
                  f"the engine's prompt log-probs agree with the reference run with the DSA indexer switched off "
                  f"(dense attention: mean KL {kl_dense:.3g}, within the limit {limit:.3g}) and not with the sparse "
                  f"reference (mean KL {kl_sparse:.3g}): the engine silently skipped sparse attention (DSA)",
                  stats={"kl_dense": kl_dense, "kl_sparse": kl_sparse, "limit": limit, "positions": fit.n})


def _measured_router_margin(reference, baseline_engine, seqs, n_seqs: int = 2) -> float | None:
    """How far the baseline run's MoE routing gaps (weakest chosen vs best unchosen expert)
    move from the reference's, at the 99th percentile over the first sequences: routing whose
    gap is within that of flipping is a near-tie for an engine of this class. The stated
    margins (ROUTER_TIE_MARGINS) come from other models; a model's own router scores set how
    far rounding moves them (measured: tiny deepseek2 Q8_0 under the q8 emulation, median
    0.0045 and 99th percentile 0.024 against the stated 0.01; an unmarked flip at gap 0.012
    was the last false alarm of benchmarks/fidelity.py). None without a traced baseline run."""
    model_r = getattr(reference, "model", None)
    model_b = getattr(baseline_engine, "model", None)
    if model_r is None or model_b is None or not getattr(getattr(model_r, "cfg", None), "n_expert", 0):
        return None
    import torch

    moved = []
    with torch.no_grad():
        for seq in seqs[:n_seqs]:
            _, marks_a = model_r.prefill_marks(list(seq))
            _, marks_b = model_b.prefill_marks(list(seq))
            for la, lb in zip(marks_a, marks_b):
                if la.router_gap is not None and lb.router_gap is not None:
                    moved.append((la.router_gap - lb.router_gap).abs().double().cpu().numpy())
    return float(np.percentile(np.concatenate(moved), 99)) if moved else None


# with fewer judged positions than this (the rest follow a routing / indexer near-tie of the
# reference), the comparison is made over every position instead (_judged_through_ties). Not a
# share: while a handful of untied positions remain, judging them is sharper than judging the
# ties against a baseline run that flips less often than the engine (measured: tiny glm-dsa
# F32 on llama.cpp, 59 of 501 positions untied, every-position KL 0.0042 against a 0.0031
# limit; transformers bf16 on tiny glm-dsa, NMSE 0.013 against 0.0091 over every position)
MIN_UNTIED_POSITIONS = 8


def _mostly_ties(metrics) -> bool:
    return metrics.ambiguous > 0 and metrics.n < MIN_UNTIED_POSITIONS


def _judged_through_ties(refs, tables, base_tables, ambiguous: int, source: str, judged_class: str):
    """Metrics and baseline over every position, ties included, when nearly no position is
    left after the near-tie rows: tiny random MoE / DSA models (and some real ones) have a
    routing or indexer near-tie in almost every sequence, and leaving those rows out left
    nothing to judge (measured: a tiny glm-dsa Q4_K on llama.cpp, CPU and CUDA, skipped the
    whole logits stage and was called healthy).

    A correct engine may resolve a tie the other way; that moves a few positions a lot and
    the rest not at all, while a wrong engine moves most positions. So the positions over the
    per-position limit are left out as flips when they are a minority (at most
    MAX_FLIP_SHARE), and every other position is judged against the baseline run on the same
    positions; when more are over the limit, all are judged (and fail)."""
    unmasked = [replace(r, ambiguous=None) for r in refs]
    metrics = collect(list(zip(unmasked, tables)))
    measured = baseline_from(collect(list(zip(unmasked, base_tables))), source + " over every position, ties included")
    baseline = combined_baseline(measured, judged_class)
    tol = LogitTolerance()
    far = metrics.kl > tol.multiple * baseline.kl_p99 + tol.kl_p99_floor
    note = (f"; {ambiguous} of {metrics.n} positions follow a routing or indexer near-tie of the reference, so "
            "every position is judged, against the baseline run on the same positions")
    if 0 < far.sum() <= MAX_FLIP_SHARE * metrics.n:
        metrics = metrics.select(~far)
        metrics.ambiguous = int(far.sum())
        note += f", but the {int(far.sum())} far off it: a correct engine can resolve those ties the other way"
    return metrics, baseline, note


# at most this share of tie-following positions may be left out as flips (_judged_through_ties)
MAX_FLIP_SHARE = 0.25


def _ambiguous_onwards(table: TokenLogprobs, generation) -> TokenLogprobs:
    """Decode: once the reference marks a generated row ambiguous (a routing / indexer near-tie
    the engine may resolve the other way), every later step reads that choice through the KV
    cache, so those rows are left out too."""
    if table.ambiguous is None or not table.ambiguous.any():
        return table
    amb = table.ambiguous.copy()
    start = len(generation.prompt) - 1
    hits = np.flatnonzero(amb[start:])
    if len(hits):
        amb[start + hits[0]:] = True
    return TokenLogprobs(table.tokens, table.vocab_size, table.logprobs, table.topk_ids, table.topk_logprobs,
                         table.next_logprob, table.present, amb)


def _which_path(prefill: Result, decode: Result) -> Result:
    """Name the broken path when prefill and decode disagree with the reference differently."""
    check = "logits.path_blame"
    if Status.SKIP in (prefill.status, decode.status):
        return skipped(check, "output", "prefill and decode were not both judged against the reference (every "
                                        "row of one was left out as ambiguous, or it did not run)")
    if prefill.failed == decode.failed:
        state = "both fail" if prefill.failed else "both agree with the reference"
        return passed(check, "output", f"teacher-forced prefill and step-by-step decode: {state}") if not prefill.failed \
            else failed(check, "output", "teacher-forced prefill and step-by-step decode both disagree with the "
                                         "reference: the fault is common to both paths (weights, kernels, model code)")
    if prefill.failed:
        return failed(check, "prefill", "step-by-step decode agrees with the reference but teacher-forced prefill "
                                        "does not: the prefill / prompt-logprob path is wrong (for servers: how the "
                                        "echoed prompt log-probs are produced or aligned)")
    return failed(check, "decode", "teacher-forced prefill agrees with the reference but decode does not: the "
                                   "decode path (KV cache, single-token kernels, scheduler) is wrong")


MAX_PLOTTED_SEQUENCES = 4


def per_position(metrics, ref_tables: Sequence[TokenLogprobs], tables: Sequence[TokenLogprobs],
                 detokenize: Callable[[Sequence[int]], str] | None = None) -> list[dict]:
    """Per-position series for the HTML plots: KL, argmax agreement and entropies (nats),
    one dict per sequence (the first few), NaN-free lists with None where a row was not compared;
    with ``detokenize``, each position's token text for the axis."""
    out = []
    for seq in range(min(len(tables), MAX_PLOTTED_SEQUENCES)):
        n = len(tables[seq])
        kl: list[float | None] = [None] * n
        agree: list[float | None] = [None] * n
        rows = np.flatnonzero(metrics.sequence == seq)
        for i in rows:
            kl[int(metrics.position[i])] = float(max(metrics.kl[i], 0.0))
            agree[int(metrics.position[i])] = float(metrics.agree[i])
        entry = {"prompt": f"prompt {seq}", "kl": kl, "argmax_agree": agree,
                 "entropy": _entropy(tables[seq]), "ref_entropy": _entropy(ref_tables[seq])}
        if detokenize is not None:
            entry["tokens"] = [_token_text(detokenize, int(t)) for t in tables[seq].tokens]
        out.append(entry)
    return out


def _token_text(detokenize, token: int) -> str:
    try:
        return detokenize([token])
    except Exception:  # noqa: BLE001 - display only
        return str(token)


def _entropy(table: TokenLogprobs) -> list[float | None] | None:
    if not table.full:
        return None  # top-k only: the entropy is not known
    lp = table.logprobs.astype(np.float64)  # [T, V]
    ent = -(np.exp(lp) * np.where(np.isfinite(lp), lp, 0.0)).sum(axis=1)
    return [float(e) if ok else None for e, ok in zip(ent, table.present)]


def _short(engine: Engine) -> str:
    return engine.name.split(" (")[0]


def _fit_vocab(tables: list[TokenLogprobs], vocab_size: int) -> list[TokenLogprobs]:
    """Drop an engine's padded vocabulary columns beyond the model's (vLLM pads under TP)."""
    out = []
    for t in tables:
        if t.full and t.vocab_size > vocab_size:
            t = TokenLogprobs(t.tokens, vocab_size, t.logprobs[:, :vocab_size], present=t.present)
        out.append(t)
    return out


def _detokenizer(*engines: Engine) -> Callable[[Sequence[int]], str] | None:
    for e in engines:
        if e.capabilities.tokenize:
            return e.detokenize
    return None


def compare_options(session: "Session") -> CompareOptions:
    """The served stage's options from the run's (the switch stage reruns with the same)."""
    o = session.options
    return CompareOptions(max_new_tokens=o.new_tokens, run_sanity=o.sanity, run_paths=o.paths,
                          indexer_top_k=session.indexer_top_k(), top_k=o.top_k, long_decode_to=o.decode_to,
                          sweep_to=o.sweep_to)


def run(session: "Session") -> list[StageReport]:
    """The stage entry point (``served``): the session's engine against the reference on its
    prompts: sanity, logits and paths reports."""
    return serve(session, session.engine())


def serve(session: "Session", engine: Engine, baseline: Engine | None = None) -> list[StageReport]:
    """The served comparison of ``engine`` (the session's, or another: the switch stage's
    flipped one, with its own ``baseline`` run) against the session's reference and prompts."""
    from ggufcheck.errors import GGUFCheckError

    o = session.options
    indexer_top_k = session.indexer_top_k()
    long_prompt = session.long_prompt(indexer_top_k) if indexer_top_k else None
    tokens = session.tokens()
    given_baseline = baseline
    reference, reason, baseline = None, "--reference none: no reference run", None
    try:
        reference = session.reference()
    except GGUFCheckError as err:  # e.g. an architecture ggufcheck's reference lacks: sanity and paths still run
        reason = f"the reference is unavailable: {err.message}"
    independent = reference is not None and o.reference not in ("reference", "reference:fp64")
    if reference is not None and not independent:  # a measured baseline is ggufcheck's reference's own
        try:
            baseline = given_baseline if given_baseline is not None else session.baseline()
        except GGUFCheckError as err:
            session.say(f"baseline {o.baseline} unavailable ({err.message}); using stated allowances")
    stages = run_compare(engine, tokens, reference=reference, reference_reason=reason, baseline_engine=baseline,
                         options=compare_options(session), progress=session.say, long_prompt=long_prompt)
    if independent:  # two implementations: agreement is evidence, a disagreement does not say who is wrong
        for stage in stages:
            if stage.stage == "logits":
                stage.info["reference"] = f"{reference.name} (--reference {o.reference})"
                note = (f"; the engine and the reference {reference.name} disagree: without a third implementation "
                        "this does not say which of the two is wrong")
                stage.results = [r.amended(note) if r.failed else r for r in stage.results]
    return stages
