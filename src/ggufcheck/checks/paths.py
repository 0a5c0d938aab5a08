"""Execution-path invariance: one engine against itself, no reference needed.

A correct engine gives the same next-token distribution at a position however it got
there. Each check runs the same tokens through two paths and compares them position by
position with the logits metrics:

- prefill vs decode: teacher-forced log-probs of ``prompt + continuation`` equal the
  per-step log-probs of the greedy decode that produced the continuation (catches
  scheduler, KV-cache and decode-kernel faults: catalog #11, #16). The first prompt is
  decoded to position 272 (past the usual cache block / page sizes 16, 64, 256), the others
  a few steps; a failure says where the divergence starts and which boundary that is;
- batch invariance: a sequence scored alone equals the same sequence scored in a batch;
- determinism at temperature 0: the same request twice gives the same log-probs and tokens;
- chunked-prefill invariance: the prompt prefilled in chunks equals one prefill (#7-#9);
- for sparse-attention (DSA) models, decoding past the indexer's top_k (#13, #14).

Different paths may legitimately round differently (a mat-vec for one token against a
mat-mat for a prompt), so limits are those of the logits stage for the engine's numerical
class: ``multiple * baseline + floor``. Two paths that each sit near that limit from the
reference can be further than it from each other (their roundings add), so a failing pair is
judged again path by path against the reference where one is given: when both paths agree
with it under the same limits, the pair passes and says so (measured on the H200: llama.cpp's
CUDA Q4_1 chunks of 5 take the matrix-vector kernels, one prefill the matrix-matrix ones;
0.0236 apart, each within the limit of the reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from ggufcheck.checks.logits import (ALLOWANCES, Baseline, LogitTolerance, argmax_agreement, collect, distribution,
                                     nonfinite, wilson_interval)
from ggufcheck.engines.base import Engine, Generation, TokenLogprobs, Unsupported
from ggufcheck.results import Result, Status, failed, passed, skipped


# Positions where KV caches change block / page (vLLM 16, llama.cpp and others powers of two up
# to 256 and beyond), and where long-context bugs have been reported: a divergence that
# starts exactly there is that component's fingerprint.
BOUNDARIES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


# The reference's ambiguous rows of a sequence ([T] bool, or None): DSA top-k and MoE routing
# (near-)ties that a correct engine may resolve one way in one path and the other way in
# another (different kernels, or a tie where the order of equal scores decides), so two paths
# of one engine are not compared there (checks.compare passes the reference's marks)
Ambiguity = Callable[[Sequence[int]], "np.ndarray | None"]
# the reference's log-probs of a sequence (checks.compare scores each once): which of two
# paths is the wrong one
ReferenceScore = Callable[[Sequence[int]], TokenLogprobs]
# the logits stage's baseline measured on given sequences (the reference emulating the
# engine's rounding there): a failing pair's paths are each judged against the reference with it
ReferenceBaseline = Callable[[Sequence[Sequence[int]]], Baseline]


def mark_ambiguous(table: TokenLogprobs, ambiguity: Ambiguity | None, *, onward_from: int | None = None) -> TokenLogprobs:
    """``table`` with the reference's ambiguous rows of its sequence marked (the first table of
    a pair is the one whose marks count). With ``onward_from`` (the first generated row of a
    decode), every row after the first ambiguous generated one is marked too: later steps read
    that choice through the KV cache."""
    if ambiguity is None:
        return table
    marks = ambiguity(table.tokens)
    if marks is None or not np.any(marks):
        return table
    marks = np.asarray(marks, dtype=bool).copy()
    if onward_from is not None:
        hits = np.flatnonzero(marks[onward_from:])
        if len(hits):
            marks[onward_from + hits[0]:] = True
    return replace(table, ambiguous=marks)


@dataclass(frozen=True)
class PathOptions:
    max_new_tokens: int = 8
    decode_prompts: int = 2  # how many prompts get a step-by-step decode (it is slow)
    # the first prompt is decoded until this absolute position (past the usual cache block /
    # page sizes 16, 64 and 256); 0: every decode is max_new_tokens long
    long_decode_to: int = 272
    batch_prompts: int = 3
    chunk_sizes: tuple[int, ...] = (5,)
    tolerance: LogitTolerance = LogitTolerance()
    top_k: int = 20
    indexer_top_k: int | None = None  # DSA models: the indexer's top_k from the metadata


def _pair_verdict(check: str, component: str, what: str, pairs: Sequence[tuple[TokenLogprobs, TokenLogprobs]],
                  baseline: Baseline, tol: LogitTolerance, landmarks: dict[str, int] | None = None) -> Result:
    """Compare path A (first) with path B (second) at every shared position.

    The reference's ambiguous rows (marked on A, :func:`mark_ambiguous`) count only when the
    paths disagree: two paths that agree everywhere pass on every row, and a disagreement is
    judged again without the rows where two correct paths may legitimately differ."""
    everywhere = [(replace(a, ambiguous=None), b) for a, b in pairs]
    if any(a.ambiguous is not None for a, _ in pairs):
        full = _judge_pairs(check, component, what, everywhere, baseline, tol, landmarks)
        if full.status is Status.PASS:
            return full
        judged = _judge_pairs(check, component, what, pairs, baseline, tol, landmarks)
        if not judged.failed:
            judged = judged.amended("; the paths differ only where such a tie lets them (over every position: "
                                    f"{full.message.split(': ', 1)[-1]})", stats={"unmasked": dict(full.stats)})
        return judged
    return _judge_pairs(check, component, what, everywhere, baseline, tol, landmarks)


def _judge_pairs(check: str, component: str, what: str, pairs: Sequence[tuple[TokenLogprobs, TokenLogprobs]],
                 baseline: Baseline, tol: LogitTolerance, landmarks: dict[str, int] | None) -> Result:
    m = collect(pairs)
    if m.n == 0:
        why = (f"all {m.ambiguous} shared positions follow an indexer top-k or MoE routing tie of the reference, "
               "which two correct paths may resolve differently" if m.ambiguous else
               "no position was reported by both paths")
        return skipped(check, component, f"{what}: {why}")
    broken = nonfinite(m, check, component, what)
    if broken is not None:
        if all(_has_nan(a) for a, _ in pairs) and all(_has_nan(b) for _, b in pairs):
            return skipped(check, component, f"{what}: both paths give NaN or inf log-probs, so they cannot be told "
                                             "apart here (sanity.finite and the logits stage name it)")
        return broken
    kl = distribution(m.kl)
    limit = tol.multiple * baseline.kl_mean + tol.kl_floor
    limit99 = tol.multiple * baseline.kl_p99 + tol.kl_p99_floor
    agree, exact, _expected = argmax_agreement(m, limit)
    low, high = wilson_interval(agree, m.n)
    need = baseline.argmax_agreement - tol.argmax_floor
    max_limit = max(limit99, limit)
    # a position over the percentile limit fails the pair when a divergence starts there
    # (most positions after it are over too) or when it is grossly wrong; one position just
    # past a limit derived from a 99th percentile is what the largest of a few hundred
    # healthy positions does, all the more when both paths round (measured on the H200: Q2_K
    # chunks of 5 vs one prefill, max 0.154 against 0.151, mean 0.0007)
    onset = first_divergence(m, max_limit, landmarks, who="the first path's") if kl["max"] > max_limit else None
    max_ok = kl["max"] <= max_limit or (onset is None and kl["max"] <= GROSS_FACTOR * max_limit)
    ok = kl["mean"] <= limit and max_ok and high >= need
    worst_i = int(np.argmax(m.kl))
    stats = {"kl": kl, "kl_limit": limit, "kl_max_limit": max_limit,
             "argmax_agreement": agree / m.n, "exact_argmax_agreement": exact / m.n, "ci95": [low, high], "required_upper_bound": need,
             "baseline": baseline.source}
    worst = {"sequence": int(m.sequence[worst_i]), "position": int(m.position[worst_i]), "kl": float(m.kl[worst_i])}
    msg = (f"{what}: mean KL {kl['mean']:.3g} (limit {limit:.3g}), max {kl['max']:.3g} "
           f"(limit {max_limit:.3g}), argmax {agree}/{m.n} agree"
           f"{f' ({exact} exactly, the others near-ties)' if exact < agree else ''}, over {m.n} positions")
    if m.ambiguous:
        msg += f" ({m.ambiguous} after an indexer top-k or MoE routing near-tie left out)"
        stats["ambiguous_positions"] = m.ambiguous
    if kl["max"] > max_limit and max_ok:
        msg += (f"; the largest, at sequence {worst['sequence']} position {worst['position']}, starts no "
                f"divergence and is under {GROSS_FACTOR:g}x the limit")
    if not ok:
        first = onset or first_divergence(m, max_limit, landmarks, who="the first path's")
        if first is not None:
            stats["first_divergence"] = first
            msg += "; " + first["text"]
    return (passed if ok else failed)(check, component, msg, stats=stats, worst=worst)


def _has_nan(table: TokenLogprobs) -> bool:
    """NaN or +inf in the rows a path reported (-inf alone is a token the engine masks)."""
    values = table.logprobs[table.present] if table.full else table.topk_logprobs[table.present]
    return bool(np.isnan(values).any() or np.isposinf(values).any())


# a single position this many times over the path pair's max limit fails it on its own
GROSS_FACTOR = 10.0


def _each_within_reference(result: Result, pairs: Sequence[tuple[TokenLogprobs, TokenLogprobs]],
                           reference_score: ReferenceScore | None, baseline: Baseline, tol: LogitTolerance,
                           names: tuple[str, str], reference_baseline: ReferenceBaseline | None = None) -> Result:
    """A failing pair judged path by path against the reference (with the first path's marks of
    ambiguous rows), under the logits stage's limits: its baseline measured on these very
    sequences where ``reference_baseline`` is given, else the pair's own. Passes when both
    paths agree with the reference (two roundings that add), else stays failed with each
    path's distance to it."""
    if not result.failed or reference_score is None:
        return result
    refs = [replace(reference_score(a.tokens), ambiguous=a.ambiguous) for a, _ in pairs]
    if reference_baseline is not None:
        baseline = reference_baseline([a.tokens for a, _ in pairs])
    judged = [_judge_pairs(result.check, result.component, name, list(zip(refs, path)), baseline, tol, None)
              for name, path in zip(names, ([a for a, _ in pairs], [b for _, b in pairs]))]
    means = [j.stats.get("kl", {}).get("mean") for j in judged]
    if any(m is None for m in means):
        return result
    facts = {name: {"mean_kl": j.stats["kl"]["mean"], "max_kl": j.stats["kl"]["max"], "ok": not j.failed}
             for name, j in zip(names, judged)}
    each = f"{names[0]} {means[0]:.3g}, {names[1]} {means[1]:.3g} (mean KL from the reference, limit " \
           f"{judged[0].stats['kl_limit']:.3g})"
    if all(not j.failed for j in judged):
        return passed(result.check, result.component,
                      f"{result.message.split(';')[0]}; the two paths round differently and their errors "
                      f"add, but each agrees with the reference: {each}",
                      stats=dict(result.stats) | {"against_reference": facts}, worst=result.worst)
    wrong = [name for name, j in zip(names, judged) if j.failed]
    return result.amended(f"; against the reference: {each}; {' and '.join(wrong)} over it",
                          stats={"against_reference": facts})


def landmarks(options) -> dict[str, int]:
    """Positions that fingerprint a component when a divergence starts exactly there."""
    top_k = getattr(options, "indexer_top_k", None)
    return {"the DSA indexer's top_k": top_k} if top_k else {}


def first_divergence(m, limit: float, landmarks: dict[str, int] | None = None, who: str = "the reference's") -> dict | None:
    """Where a divergence starts: the first position whose KL exceeds ``limit`` and from which on
    at least half of the positions do (an isolated near-tie is not an onset), over the
    sequence where it starts earliest; with the boundary it sits on, if any."""
    best = None
    for s in np.unique(m.sequence):
        rows = np.flatnonzero(m.sequence == s)
        rows = rows[np.argsort(m.position[rows])]
        bad = np.nan_to_num(m.kl[rows], nan=np.inf) > limit
        for j in np.flatnonzero(bad):
            if bad[j:].mean() >= 0.5:
                pos = int(m.position[rows[j]])
                if best is None or pos < best["position"]:
                    before = int(m.position[rows[j - 1]]) if j > 0 else None
                    best = {"sequence": int(s), "position": pos, "first_compared": int(m.position[rows[0]]),
                            "seen_before": before == pos - 1,  # the row just before was compared
                            "last_good": before, "wrong_after": float(bad[j:].mean()),
                            "kl": float(m.kl[rows[j]]), "argmax_agrees": bool(m.agree[rows[j]]),
                            "reference_margin": None if m.ref_margin is None else float(m.ref_margin[rows[j]])}
                break
    if best is None:
        return None
    pos = best["position"]
    marks = dict(landmarks or {})
    # the row at position P is the first to read a cache entry P: a block starting at b shows
    # first at P = b exactly. A boundary is cited only where the data show a change there: the
    # row just before it was compared (and is not part of the onset); where the onset is the
    # first compared row, the comparison cannot tell where the divergence starts
    hit = None
    if best.pop("seen_before"):
        hit = next((f"{name} {value}" for name, value in marks.items() if value and pos == value), None)
        if hit is None:
            b = next((b for b in BOUNDARIES if pos == b), None)
            if b is not None:
                hit = f"a cache block / page boundary ({b} tokens)"
    best["boundary"] = hit
    if best["first_compared"] < pos:
        where = (f"it starts at position {pos} (sequence {best['sequence']}; positions "
                 f"{best['first_compared']}..{pos - 1} agree)")
        best["text"] = where + (f", at {hit}" if hit else ", not at a usual block boundary")
    else:
        best["text"] = (f"it is wrong from the first compared position {pos} (sequence {best['sequence']}) on: "
                        "where it starts before that is not measured here")
    margin = best["reference_margin"]
    if margin is not None and math.isfinite(margin):
        tie = "a near-tie" if margin < 0.1 else "not a near-tie"
        best["text"] += (f"; there, KL {best['kl']:.3g}, {who} top-1 leads its top-2 by {margin:.3g} nats "
                         f"({tie})")
    return best


def check_prefill_vs_decode(engine: Engine, prompts: Sequence[Sequence[int]], baseline: Baseline,
                            options: PathOptions, ambiguity: Ambiguity | None = None,
                            reference_score: ReferenceScore | None = None,
                            reference_baseline: ReferenceBaseline | None = None,
                            forced_tables: dict | None = None,
                            on_generations: Callable[[list[Generation]], None] | None = None
                            ) -> tuple[Result, list[Generation]]:
    """Each prompt decoded step by step against the same sequence teacher-forced; the
    teacher-forced tables are left in ``forced_tables`` (by token tuple) for the logits stage."""
    caps = engine.capabilities
    if not caps.generate:
        return skipped("paths.prefill_vs_decode", "decode", caps.why_not("generate")), []
    # Each teacher-forced request follows a request for the bare prompt: an engine that caches
    # computed logits by prefix (llama-cpp-python keeps the last sequence's rows) must not
    # answer the teacher-forced request with the rows of the decode it is compared with.
    generations, note = [], ""
    for i, p in enumerate(prompts[:options.decode_prompts]):
        n = options.max_new_tokens
        if i == 0 and options.long_decode_to > len(p) + n:
            try:  # decode far enough to cross the usual cache block sizes
                generations.append(engine.generate(p, options.long_decode_to - len(p), top_k=options.top_k))
                continue
            except Unsupported as why:
                note = f"; a decode to position {options.long_decode_to} was refused ({why})"
        generations.append(engine.generate(p, n, top_k=options.top_k))
    if on_generations is not None:
        on_generations(generations)
    pairs = []
    for prompt, gen in zip(prompts, generations):
        engine.score(prompt, top_k=options.top_k)  # replaces a single-slot cache with a prefill
        forced = engine.score(gen.sequence, top_k=options.top_k)
        if forced_tables is not None:
            forced_tables[tuple(int(t) for t in gen.sequence)] = forced
        pairs.append((mark_ambiguous(forced, ambiguity, onward_from=len(gen.prompt) - 1), gen.steps))
    steps = ", ".join(str(len(g.generated)) for g in generations)
    result = _pair_verdict("paths.prefill_vs_decode", "decode",
                           f"teacher-forced prefill vs step-by-step decode ({steps} steps)", pairs, baseline,
                           options.tolerance, landmarks(options))
    result = _each_within_reference(result, pairs, reference_score, baseline, options.tolerance,
                                    ("the prefill", "the decode"), reference_baseline)
    if result.failed and "nonfinite_positions" not in result.stats:
        result = _decode_layers(engine, result, generations)
    if caps.stepwise_score:  # its teacher forcing takes the decode's one-token path too
        note += ("; this engine's teacher forcing is itself one-token steps through its prompt cache, so both sides "
                 "take the decode's kernels here: its batched prefill is judged by paths.cold_prefill")
    return result.amended(note), generations


def check_decode_layers(engine: Engine, generations: Sequence[Generation], decode: Result,
                        ambiguity: Ambiguity | None = None) -> Result:
    """The decode path layer by layer, when its logits pass: the shortest generation fed again
    as a decode (its prompt in one prefill, then a token per step) and as one prefill, each
    layer's residual stream compared (checks.path_layers, the engine's class allowance). A
    one-token kernel wrong in a block whose contribution barely reaches the logits (a small
    model, a small block) passes the logits and fails here, named at its layer and block.
    Rows from the reference's first ambiguous generated row on are not compared, nor past a
    MoE routing near-tie the two paths broke differently."""
    from ggufcheck.checks.logits import ROUTER_TIE_MARGINS
    from ggufcheck.checks.path_layers import localize_decode

    check = "paths.decode_layers"
    if decode.status is not Status.PASS:
        return skipped(check, "decode", "the decode's logits already " + ("fail (traced there)" if decode.failed else
                                                                         "were not compared"))
    gens = [g for g in generations if len(g.generated) >= 2]
    if not gens:
        return skipped(check, "decode", "no decode of two steps or more to trace")
    gen = min(gens, key=lambda g: len(g.sequence))
    # rows p.. are the decode steps' (the prompt's come from the same prefill in both traces); a
    # DSA / MoE selection near-tie of the reference at a decode row may be broken either way there
    tokens, p = [int(t) for t in gen.sequence], len(gen.prompt)
    last, cut = len(tokens) - 1, ""
    rows = ambiguity(tokens) if ambiguity is not None else None
    if rows is not None:
        tied = np.flatnonzero(np.asarray(rows, bool)[p:]) + p
        if len(tied):
            last, cut = int(tied[0]) - 1, f"; rows from {int(tied[0])} on left out (a selection near-tie of the reference)"
    if last < p:
        return skipped(check, "decode", "the first decode row is a selection near-tie of the reference" + cut)
    found = localize_decode(engine, tokens[:last + 1], p, last)
    if found is None:
        return skipped(check, "decode", f"{engine.name} traces no decode steps")
    steps = f"{last - p + 1} decode step(s) after a {p}-token prompt"
    if found.get("layer") is None:
        top = max(found["per_layer"], key=lambda r: r["max"])
        return passed(check, "decode", f"traced layer by layer over {steps}, every layer's residual stream agrees with "
                                       f"the one prefill's within {found['allowance']:.3g} (largest {top['max']:.3g}, "
                                       f"layer {top['layer']})" + cut, stats={"localized": found})
    margin = ROUTER_TIE_MARGINS.get(engine.capabilities.activation_dtype, 0.0)
    if found.get("block") == "routing" and (found.get("routing_gap") is None or found["routing_gap"] < margin):
        return passed(check, "decode", f"traced layer by layer over {steps}, the paths agree up to a MoE routing "
                                       f"near-tie they broke differently (" + found["text"] + "): not judged past it",
                      stats={"localized": found})
    return failed(check, "decode", "the decode's logits agree within the class allowance, but " + found["text"]
                  + f" ({steps}): a one-token path computes that block wrong" + cut,
                  layer=found["layer"], stats={"localized": found})


def _decode_layers(engine: Engine, result: Result, generations: Sequence[Generation]) -> Result:
    """A failing prefill / decode pair traced layer by layer: the decode of the sequence where
    the divergence starts (its first position, else the worst) against its prefill."""
    from ggufcheck.checks.path_layers import localize_decode

    at = result.stats.get("first_divergence") or result.worst or {}
    seq, pos = at.get("sequence"), at.get("position")
    if seq is None or pos is None or not 0 <= seq < len(generations):
        return result
    gen = generations[seq]
    found = localize_decode(engine, [int(t) for t in gen.sequence], len(gen.prompt), int(pos))
    if found is None:
        return result
    layer = found.get("layer")
    return result.amended("; " + found["text"], stats={"localized": found},
                          layer=layer if layer is not None else result.layer)


def check_prefix_cache(engine: Engine, sequence: Sequence[int], cold: TokenLogprobs, baseline: Baseline,
                       options: PathOptions) -> Result:
    """A request whose prefix the engine's prefix cache holds (a request for the first half of
    ``sequence`` just before) must score like the cold one (``cold``, the engine's own score
    of ``sequence``): the rows the warm request computes read the cached KV blocks."""
    check = "paths.prefix_cache"
    cached = len(sequence) // 2
    try:
        warm = engine.score_cached(list(sequence), cached, top_k=options.top_k)
    except Unsupported as why:
        return skipped(check, "kv-cache", str(why))
    n = len(sequence)
    rows = np.flatnonzero(warm.present) if warm.present is not None else np.arange(n)
    computed = len(rows)
    if computed >= n:
        return skipped(check, "kv-cache", f"a {cached}-token prefix gave no cache hit (every position was "
                                          "computed again: shorter than one cache block?)")
    if computed and rows[0] == n - computed:  # one request: the cached positions, then the rows it computed
        hit = n - computed
        what = f"a cold request vs the same request after its first {cached} tokens were cached ({hit} positions " \
               "read from the prefix cache)"
        stats = {"cached_positions": hit, "computed_positions": computed}
    else:  # a server: each row the last of its own request, after the prefix was cached
        what = (f"a cold request vs {computed} requests for its prefixes after its first {cached} tokens were cached "
                "(each row the next-token distribution of one request that read the prefix cache)")
        stats = {"cached_prefix": cached, "rows": [int(r) for r in rows]}
    result = _pair_verdict(check, "kv-cache", what, [(cold, warm)], baseline, options.tolerance, landmarks(options))
    return result.amended("", stats=stats)


def check_cold_prefill(engine: Engine, prompts: Sequence[Sequence[int]], singles: Sequence[TokenLogprobs],
                       baseline: Baseline, options: PathOptions, ambiguity: Ambiguity | None = None,
                       reference_score: ReferenceScore | None = None,
                       reference_baseline: ReferenceBaseline | None = None) -> Result:
    """An engine whose score is stepwise (llama-server: every row a one-token step through the
    prompt cache) never runs its batched prefill there: rows of the same prompts requested cold
    (the cache off, each row the last of one prefill from position 0) against the engine's own
    stepwise rows, at the end of each quarter of each prompt (:func:`cold_rows`). A failing pair is judged path by path
    against the reference: the cold prefill over it is ``prefill``, the stepwise rows over it
    (the one-token kernels reading the prompt cache) ``decode``."""
    check = "paths.cold_prefill"
    pairs = []
    for prompt, single in zip(prompts, singles):
        n = len(prompt)
        if n < 2:
            continue
        cold = engine.score_cold(list(prompt), cold_rows(n), top_k=options.top_k)
        pairs.append((mark_ambiguous(cold, ambiguity), single))
    if not pairs:
        return skipped(check, "prefill", "no prompt of two tokens or more")
    rows = sum(int(c.present.sum()) for c, _ in pairs)
    names = ("the cold prefill", "the one-token steps through the prompt cache")
    result = _pair_verdict(check, "prefill", f"{rows} rows from cold requests (a prefill from position 0 in one batch) "
                                             "vs the same rows as one-token steps through the prompt cache",
                           pairs, baseline, options.tolerance)
    result = _each_within_reference(result, pairs, reference_score, baseline, options.tolerance, names,
                                    reference_baseline)
    over = {name for name, fact in result.stats.get("against_reference", {}).items() if not fact["ok"]}
    if result.failed and over == {names[1]}:  # the prefill agrees with the reference; the steps do not
        result = replace(result, component="decode")
    return result


def cold_rows(n: int) -> list[int]:
    """The rows of an n-token prompt the cold-prefill check asks for: the last row of each
    quarter (each a prefill of that many tokens: about 2.5 n tokens in all)."""
    return sorted({max(0, (n * q) // 4 - 1) for q in (1, 2, 3, 4)})


def check_batch_invariance(engine: Engine, prompts: Sequence[Sequence[int]], singles: Sequence[TokenLogprobs],
                           baseline: Baseline, options: PathOptions, ambiguity: Ambiguity | None = None) -> Result:
    caps = engine.capabilities
    if not caps.batch:
        return skipped("paths.batch_invariance", "batching", caps.why_not("batch"))
    if len(prompts) < 2:
        return skipped("paths.batch_invariance", "batching", "needs at least two prompts")
    n = min(options.batch_prompts, len(prompts))
    batched = engine.score_batch(list(prompts[:n]), top_k=options.top_k)
    return _pair_verdict("paths.batch_invariance", "batching", f"alone vs in a batch of {n}",
                         [(mark_ambiguous(a, ambiguity), b) for a, b in zip(singles[:n], batched)], baseline,
                         options.tolerance)


DETERMINISM_STEPS = 16  # greedy steps generated again by the determinism check


def check_determinism(engine: Engine, prompt: Sequence[int], first: TokenLogprobs,
                      first_generation: Generation | None, baseline: Baseline, options: PathOptions) -> Result:
    """Same request twice at temperature 0: bitwise equality is expected; differences are judged."""
    again = engine.score(prompt, top_k=options.top_k)
    result = _pair_verdict("paths.determinism", "sampling", "the same request twice", [(first, again)],
                           baseline, options.tolerance)
    if first.full and again.full:
        bitwise = bool(np.array_equal(first.logprobs[first.present], again.logprobs[again.present]))
    else:
        bitwise = bool(np.array_equal(first.topk_logprobs, again.topk_logprobs))
    facts: dict = {"bitwise": bitwise}
    notes = ["bitwise identical" if bitwise else "not bitwise identical"]
    if first_generation is not None:  # a note, not a verdict: the first steps again (not a 272-token decode)
        steps = min(len(first_generation.generated), DETERMINISM_STEPS)
        regen = engine.generate(first_generation.prompt, steps, top_k=options.top_k)
        same = bool(np.array_equal(regen.generated, first_generation.generated[:steps]))
        facts["same_greedy_tokens"] = same
        notes.append(f"same greedy tokens over {steps} steps" if same else f"greedy tokens differ within {steps} steps")
    return result.amended("; " + ", ".join(notes), stats=facts)


def check_chunked_prefill(engine: Engine, prompts: Sequence[Sequence[int]], singles: Sequence[TokenLogprobs],
                          baseline: Baseline, options: PathOptions, ambiguity: Ambiguity | None = None,
                          reference_score: ReferenceScore | None = None,
                          reference_baseline: ReferenceBaseline | None = None) -> list[Result]:
    """One prefill vs chunks of each size; a failing size is looked into
    (checks.path_layers): which path the reference agrees with, and the layer where they part."""
    caps = engine.capabilities
    if not caps.chunked_prefill:
        return [skipped("paths.chunked_prefill", "prefill", caps.why_not("chunked_prefill"))]
    out = []
    for size in options.chunk_sizes:
        pairs, used = [], []
        for prompt, single in zip(prompts, singles):
            if len(prompt) <= size:
                continue
            try:
                pairs.append((mark_ambiguous(single, ambiguity), engine.score_chunked(prompt, size, top_k=options.top_k)))
                used.append(prompt)
            except Unsupported as why:
                out.append(skipped(f"paths.chunked_prefill[{size}]", "prefill", str(why)))
                break
        else:
            if not pairs:
                out.append(skipped(f"paths.chunked_prefill[{size}]", "prefill",
                                   f"no prompt longer than the chunk size {size}"))
                continue
            check, what = f"paths.chunked_prefill[{size}]", f"one prefill vs chunks of {size}"
            marks = {**landmarks(options), f"the start of the second chunk of {size} tokens, position": size}
            result = _pair_verdict(check, "prefill", what, pairs, baseline, options.tolerance, marks)
            taken: dict = {}
            finite = "nonfinite_positions" not in result.stats  # NaN rows: no tie or layer to look for
            if result.failed and finite:
                result, taken = _past_routing_ties(engine, used, pairs, size, result, what, baseline, options, marks)
            result = _each_within_reference(result, pairs, reference_score, baseline, options.tolerance,
                                            ("one prefill", "the chunks"), reference_baseline)
            if result.failed and finite:
                from ggufcheck.checks.path_layers import localize_chunked

                seq, pos = result.worst["sequence"], result.worst["position"]
                found = localize_chunked(engine, used[seq], size, pos, *pairs[seq], result.stats["kl_max_limit"],
                                         reference_score, taken.get(seq))
                if found["text"]:
                    where = found.get("where") or {}
                    result = result.amended(f"; at sequence {seq} position {pos}: " + found["text"],
                                            stats={"localized": found},
                                            layer=where["layer"] if where.get("layer") is not None else result.layer)
            out.append(result)
    return out


def _past_routing_ties(engine: Engine, prompts, pairs, size: int, result: Result, what: str, baseline: Baseline,
                       options: PathOptions, marks: dict[str, int]) -> tuple[Result, dict]:
    """A failing chunked pair judged again without the rows after a MoE routing near-tie
    that the two paths broke differently, in the engine's own router scores (the reference's
    ties are already left out; an engine whose inputs already differ from the reference's has
    ties of its own there). Passes only if the rest agrees; the traces taken are returned."""
    from ggufcheck.checks.logits import ROUTER_TIE_MARGINS
    from ggufcheck.checks.path_layers import routing_tie_rows

    margin = ROUTER_TIE_MARGINS.get(engine.capabilities.activation_dtype, 0.0)
    if margin <= 0:
        return result, {}
    rows, flips, taken = routing_tie_rows(engine, prompts, pairs, size, result.stats["kl_max_limit"], margin)
    if not flips:
        return result, taken
    marked = []
    for (a, b), extra in zip(pairs, rows):
        if extra is not None:
            a = replace(a, ambiguous=extra if a.ambiguous is None else (np.asarray(a.ambiguous, bool) | extra))
        marked.append((a, b))
    again = _pair_verdict(result.check, result.component, what, marked, baseline, options.tolerance, marks)
    where = "; ".join(f"sequence {s} from position {f[0]['position']} (layer {f[0]['layer']}, scores "
                      f"{f[0]['gap']:.2g} apart)" for s, f in flips.items())
    note = (f"; the two paths broke a MoE routing near-tie of the engine's own router scores (below the "
            f"{engine.capabilities.activation_dtype} margin {margin:g}) differently: {where}")
    if again.failed:
        return result.amended(note + ", and the pair fails without those rows too", stats={"routing_ties": flips}), taken
    return again.amended(note + "; those rows, which read that token through the cache, are left out",
                         stats={"routing_ties": flips,
                                "with_them": {k: result.stats.get(k) for k in ("kl", "kl_limit", "kl_max_limit")}}), taken


def check_past_indexer_top_k(engine: Engine, long_prompt: Sequence[int] | None, baseline: Baseline,
                             options: PathOptions, ambiguity: Ambiguity | None = None,
                             reference_score: ReferenceScore | None = None,
                             reference_baseline: ReferenceBaseline | None = None) -> Result:
    """DSA models: decode past the indexer's top_k must still match the teacher-forced prefill."""
    if options.indexer_top_k is None:
        return skipped("paths.past_indexer_top_k", "indexer", "the model has no sparse-attention indexer")
    if long_prompt is None or len(long_prompt) <= options.indexer_top_k:
        return skipped("paths.past_indexer_top_k", "indexer",
                       f"no prompt longer than the indexer top_k={options.indexer_top_k} (raise n_ctx / add one)")
    result, _ = check_prefill_vs_decode(engine, [long_prompt], baseline,
                                        PathOptions(max_new_tokens=options.max_new_tokens, decode_prompts=1,
                                                    tolerance=options.tolerance, top_k=options.top_k,
                                                    long_decode_to=0), ambiguity, reference_score,
                                        reference_baseline)
    return result.amended(check="paths.past_indexer_top_k", component="indexer")


def run_paths(engine: Engine, prompts: Sequence[Sequence[int]], singles: Sequence[TokenLogprobs],
              options: PathOptions = PathOptions(), *, baseline: Baseline | None = None,
              long_prompt: Sequence[int] | None = None, ambiguity: Ambiguity | None = None,
              reference_score: ReferenceScore | None = None,
              reference_baseline: ReferenceBaseline | None = None,
              progress: Callable[[str], None] | None = None,
              forced_tables: dict | None = None,
              on_generations: Callable[[list[Generation]], None] | None = None
              ) -> tuple[list[Result], list[Generation]]:
    """All path checks. ``singles`` are the engine's own teacher-forced tables of ``prompts``;
    ``ambiguity`` gives the reference's ambiguous rows of a sequence (left out of every pair);
    ``reference_score`` its log-probs (a failing pair: is each path within the reference's
    limits, and which one is wrong), ``reference_baseline`` the logits stage's baseline on
    given sequences (those limits).

    A check whose engine call raises :class:`Unsupported` (a sequence beyond n_ctx, a chunk
    size the engine refuses) is SKIPPED with that reason.
    """
    baseline = baseline or ALLOWANCES.get(engine.capabilities.activation_dtype, ALLOWANCES["fp32"])
    results: list[Result] = []
    generations: list[Generation] = []

    say = progress or (lambda _m: None)
    labels = {"paths.prefill_vs_decode": "prefill vs step-by-step decode",
              "paths.decode_layers": "the decode layer by layer", "paths.batch_invariance": "batch invariance",
              "paths.determinism": "determinism", "paths.chunked_prefill": "chunked prefill",
              "paths.past_indexer_top_k": "decode past the indexer's top-k",
              "paths.prefix_cache": "a request whose prefix is cached",
              "paths.cold_prefill": "a cold prefill vs the prompt cache's steps"}
    if not engine.capabilities.stepwise_score:  # score() already prefills in one batch
        del labels["paths.cold_prefill"]

    def attempt(check: str, component: str, run):
        say(f"paths {list(labels).index(check) + 1}/{len(labels)}: {labels[check]}")
        try:
            return run()
        except Unsupported as why:
            return skipped(check, component, str(why))

    decode = attempt("paths.prefill_vs_decode", "decode",
                     lambda: check_prefill_vs_decode(engine, prompts, baseline, options, ambiguity,
                                                     reference_score, reference_baseline, forced_tables,
                                                     on_generations))
    if isinstance(decode, tuple):
        decode, generations = decode
    results.append(decode)
    results.append(attempt("paths.decode_layers", "decode",
                           lambda: check_decode_layers(engine, generations, decode, ambiguity)))
    results.append(attempt("paths.batch_invariance", "batching",
                           lambda: check_batch_invariance(engine, prompts, singles, baseline, options, ambiguity)))
    results.append(attempt("paths.determinism", "sampling",
                           lambda: check_determinism(engine, prompts[0], singles[0],
                                                     generations[0] if generations else None, baseline, options)))
    chunked = attempt("paths.chunked_prefill", "prefill",
                      lambda: check_chunked_prefill(engine, prompts, singles, baseline, options, ambiguity,
                                                    reference_score, reference_baseline))
    results.extend(chunked if isinstance(chunked, list) else [chunked])
    results.append(attempt("paths.past_indexer_top_k", "indexer",
                           lambda: check_past_indexer_top_k(engine, long_prompt, baseline, options, ambiguity,
                                                            reference_score, reference_baseline)))
    # the longest sequence scored cold so far (the long decode's, teacher-forced), warm
    seq, cold = max([(list(map(int, g.sequence)), (forced_tables or {}).get(tuple(int(t) for t in g.sequence)))
                     for g in generations] + [(list(map(int, p)), t) for p, t in zip(prompts, singles)],
                    key=lambda st: len(st[0]))
    results.append(attempt("paths.prefix_cache", "kv-cache",
                           lambda: check_prefix_cache(engine, seq, mark_ambiguous(
                               cold if cold is not None else engine.score(seq, top_k=options.top_k), ambiguity),
                               baseline, options)))
    if "paths.cold_prefill" in labels:
        results.append(attempt("paths.cold_prefill", "prefill",
                               lambda: check_cold_prefill(engine, prompts, singles, baseline, options, ambiguity,
                                                          reference_score, reference_baseline)))
    return results, generations
