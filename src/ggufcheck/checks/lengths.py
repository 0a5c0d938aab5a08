"""Prefill length sweep: is the engine right for prompts of every length it will be given?

Engines switch code paths with the prompt's length: a DSA model starts to select keys once a
query sees more than the indexer's top_k, llama.cpp splits a prompt into micro-batches of
n_ubatch (512) tokens, paged caches fill a block of 16 / 64 / 256 tokens. A fault in one of
those paths is invisible to prompts shorter than its threshold, and a divergence that starts
exactly there is that component's fingerprint. So the sweep scores prefixes of one long token
sequence whose lengths straddle every such landmark (b + 1 tokens, the first of each path;
and b, the last of the one before, where b + 1 fails: half the engine's tokens on a healthy
engine, the same answer on a faulty one) and judges each
prefix's rows against the reference's rows of the whole sequence (the reference is causal: a
prefix's rows are the sequence's first rows; one reference prefill serves every length).

The answer says which lengths are right, the threshold where they stop being right, which
landmark it sits on, and whether the longer prompt is wrong everywhere (the length switched
the path: a length-triggered fault) or only from some position on (a position-triggered one).
A length fails when its mean KL is over the logits stage's limit (``multiple * baseline +
floor`` of the engine's class, widened by the emulated baseline at that length), or when its
rows go wrong from some position on (at least half of the rows from there over the per-row
limit); an isolated row over it (a routing near-tie flip) is not a threshold, nor is one row
within the per-row limit that lifts the mean of a few rows over the mean's limit while the
others are within it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ggufcheck.checks.logits import Baseline, LogitTolerance, collect
from ggufcheck.checks.paths import BOUNDARIES
from ggufcheck.engines.base import Engine, TokenLogprobs, Unsupported
from ggufcheck.results import Result, failed, passed, skipped

CHECK = "logits.prefill_lengths"


@dataclass(frozen=True)
class Landmark:
    """A prompt length where an engine may switch paths, and the component that owns it."""

    length: int
    what: str
    component: str


def landmarks(*, indexer_top_k: int | None = None, micro_batch: int | None = None,
              longest: int) -> list[Landmark]:
    """The landmarks up to ``longest`` tokens, shortest first (one per length; the more
    specific component wins where two coincide)."""
    out: dict[int, Landmark] = {}
    for b in BOUNDARIES:
        out[b] = Landmark(b, f"a cache block / page boundary ({b} tokens)", "kv-cache")
    if micro_batch:
        out[micro_batch] = Landmark(micro_batch, f"the engine's prompt micro-batch (n_ubatch {micro_batch})", "prefill")
    if indexer_top_k:
        out[indexer_top_k] = Landmark(indexer_top_k, f"the DSA indexer's top_k ({indexer_top_k})", "indexer")
    return [out[b] for b in sorted(out) if 2 <= b < longest]


def sweep_lengths(marks: Sequence[Landmark]) -> list[int]:
    """b and b + 1 for every landmark b (the lengths the sweep may score)."""
    return sorted({n for m in marks for n in (m.length, m.length + 1)})


def sweep_sequence(seqs: Sequence[Sequence[int]], length: int) -> list[int]:
    """One token sequence of up to ``length`` tokens: the longest given, extended with the
    others and itself again, in turn (a repeated sequence's BOS dropped)."""
    ordered = sorted(seqs, key=len, reverse=True)
    if not ordered:
        return []
    out = [int(t) for t in ordered[0]]
    bos = out[0] if out else None
    while len(out) < length:
        grew = False
        for s in [*ordered[1:], ordered[0]]:
            extra = [int(t) for t in s]
            if extra and extra[0] == bos:
                extra = extra[1:]
            out.extend(extra)
            grew = grew or bool(extra)
            if len(out) >= length:
                break
        if not grew:
            break
    return out[:length]


def prefix_rows(table: TokenLogprobs, n: int) -> TokenLogprobs:
    """The reference's rows of the first ``n`` tokens (causal: equal to scoring the prefix)."""
    cut = lambda a: None if a is None else a[:n]  # noqa: E731
    return TokenLogprobs(table.tokens[:n], table.vocab_size, cut(table.logprobs), cut(table.topk_ids),
                         cut(table.topk_logprobs), present=cut(table.present), ambiguous=cut(table.ambiguous))


def check_prefill_lengths(engine: Engine, sequence: Sequence[int], reference: TokenLogprobs, baseline: Baseline,
                          tolerance: LogitTolerance, marks: Sequence[Landmark], top_k: int = 20,
                          measured: TokenLogprobs | None = None,
                          known: dict[int, TokenLogprobs] | None = None) -> Result:
    """Score each sweep length's prefix of ``sequence`` on ``engine`` and judge it against the
    reference's rows (``reference`` is the reference's table of the whole ``sequence``).
    ``measured``: the baseline run's table of the same sequence (an emulation of the engine's
    class, reference.precision); where its error at a length exceeds ``baseline``, the limits
    of that length grow with it (long prompts accumulate more rounding and more flips).
    ``known``: the engine's tables of prefixes of ``sequence`` it already scored, by length
    (a prompt, the long decode teacher-forced), used in place of scoring a length of the same
    path again."""
    lengths = [n for n in sweep_lengths(marks) if n <= len(sequence)]  # b, b + 1, b', b' + 1, ...
    if not lengths:
        return skipped(CHECK, "prefill", f"no landmark length below the {len(sequence)}-token sweep sequence")

    # the baseline run's KL per row, once (a prefix's rows are the whole sequence's first rows:
    # causal); the [T, V] table itself is not kept through the sweep
    measured_kl = None
    if measured is not None:
        b = collect([(reference, measured)])
        measured_kl = (b.position, b.kl)
        measured = None

    def limits(n: int) -> tuple[float, float]:
        kl_mean, kl_p99 = baseline.kl_mean, baseline.kl_p99
        if measured_kl is not None:
            rows = measured_kl[1][measured_kl[0] < n]
            if rows.size:
                kl_mean, kl_p99 = max(kl_mean, float(np.nanmean(rows))), max(kl_p99, float(np.nanpercentile(rows, 99)))
        limit = tolerance.multiple * kl_mean + tolerance.kl_floor
        return limit, max(tolerance.multiple * kl_p99 + tolerance.kl_p99_floor, limit)

    rows: list[dict] = []
    refused = None
    longest_rows: tuple[np.ndarray, np.ndarray] | None = None  # (position, KL) of the longest length scored

    def score(n: int) -> dict | None:
        nonlocal refused, longest_rows
        table = known.get(n)
        if table is None:
            try:
                table = engine.score(list(sequence[:n]), top_k=top_k)
            except Unsupported as why:
                refused = f"{n} tokens refused ({why})"
                return None
        m = collect([(prefix_rows(reference, n), table)])
        if m.n == 0:
            return None
        limit, max_limit = limits(n)
        kl = np.nan_to_num(m.kl, nan=np.inf)
        if longest_rows is None or n > int(longest_rows[0].max(initial=-1)):
            longest_rows = (m.position, kl)
        mean = float(np.mean(kl))
        row = {"length": n, "rows": int(m.n), "mean_kl": mean, "p99_kl": float(np.percentile(kl, 99)),
               "max_kl": float(np.max(kl)), "kl_limit": limit, "kl_p99_limit": max_limit,
               "onset": _onset(kl > max_limit, m.position)}
        # a length fails on its mean, or where its rows go wrong from some position on; not on a
        # percentile, which over a short prefix is one row (a routing near-tie flip). Nor on one
        # row within the per-row limit that lifts the mean of a few rows over the limit (a tiny
        # DSA model leaves ~8 rows of 513 outside its near-ties): the others must be within it
        worst = float(np.max(kl))
        rest = (float(np.sum(kl)) - worst) / (kl.size - 1) if kl.size > 1 else worst
        row["mean_kl_without_worst_row"] = rest
        within = mean <= limit or (rest <= limit and worst <= max_limit)
        row["ok"] = bool(within and row["onset"] is None)
        rows.append(row)
        return row

    # One length per path: b + 1 for each landmark b (the first length past it), or a length
    # the engine already scored in (b, next landmark] (``known``); where it fails, b + 1 and b:
    # does b pass (a threshold at b), or fail too? A healthy engine is scored at half the
    # lengths or fewer.
    bounds = sorted({m.length for m in marks if m.length <= len(sequence)})
    known = {n: t for n, t in (known or {}).items() if 2 <= n <= len(sequence)}
    for i, b in enumerate(bounds):
        upper = bounds[i + 1] if i + 1 < len(bounds) else len(sequence)
        first = b + 1 if b + 1 <= len(sequence) else b
        reuse = max((n for n in known if b < n <= upper), default=None)
        got = score(reuse if reuse is not None else first)
        if got is not None and not got["ok"] and not refused:
            for n in (first, b):
                if n not in (r["length"] for r in rows) and not refused:
                    score(n)
        if refused:
            break
    rows.sort(key=lambda r: r["length"])
    stats = {"lengths": rows, "baseline": baseline.source + ("; per length, the baseline run's error where larger"
                                                             if measured is not None else "")}
    if not rows:
        return skipped(CHECK, "prefill", "the engine scored none of the sweep lengths" +
                       (f": {refused}" if refused else ""))
    judged = ", ".join(str(r["length"]) for r in rows)
    tail = f"; longer prompts not tried: {refused}" if refused else ""
    if all(r["ok"] for r in rows):
        longest = rows[-1]
        return passed(CHECK, "prefill", f"prompts of {judged} tokens (one past each landmark b) agree with the "
                                        f"reference (at {longest['length']}: mean KL {longest['mean_kl']:.3g} within "
                                        f"{longest['kl_limit']:.3g}, no run of rows over {longest['kl_p99_limit']:.3g})"
                                        + tail, stats=stats)
    early = _early_positions(rows, longest_rows)
    if early is not None:
        return failed(CHECK, "output", early["text"], stats=stats | {"threshold": None, "early_positions": early})
    return failed(CHECK, *_threshold(rows, marks), stats=stats | {"threshold": _first_failing(rows)})


def _early_positions(rows: list[dict], longest: tuple[np.ndarray, np.ndarray] | None) -> dict | None:
    """When only the shortest prompts fail and every longer one passes, and the longest prompt's
    own first rows are over the same limit: the error sits at the first positions of every
    prompt (a short prompt is mostly those rows), not at a length that switches a path."""
    fails = [r["length"] for r in rows if not r["ok"]]
    passes = [r["length"] for r in rows if r["ok"]]
    if not fails or not passes or max(fails) > min(passes) or longest is None:
        return None
    position, kl = longest
    n = max(fails)
    first, rest = kl[position < n], kl[position >= n]
    limit = next(r for r in rows if r["length"] == n)["kl_limit"]
    if not first.size or not rest.size or float(np.mean(first)) <= limit:
        return None
    mean_first, mean_rest = float(np.mean(first)), float(np.mean(rest))
    text = (f"prompts of {', '.join(map(str, fails))} tokens disagree with the reference and the longer "
            f"{', '.join(map(str, passes))} agree, but not because of their length: in the {rows[-1]['length']}-token "
            f"prompt too the first {n} positions are off (mean KL {mean_first:.3g} over positions 0..{n - 1}, over "
            f"the limit {limit:.3g}, against {mean_rest:.3g} after them); the engine computes the first positions "
            "of every prompt less precisely (a short prompt is mostly those rows), whichever path serves them")
    return {"positions": n, "mean_kl_first": mean_first, "mean_kl_rest": mean_rest, "limit": limit, "text": text}


def _onset(bad: np.ndarray, position: np.ndarray) -> int | None:
    """The first row from which at least half of the rows are over the limit (an isolated
    near-tie is not an onset), or None."""
    order = np.argsort(position)
    bad, position = bad[order], position[order]
    for j in np.flatnonzero(bad):
        if bad[j:].mean() >= 0.5:
            return int(position[j])
    return None


def _first_failing(rows: list[dict]) -> int | None:
    """The shortest length from which every longer tried length fails (None: not monotone)."""
    ok = [r["ok"] for r in rows]
    if ok[-1]:
        return None
    i = len(ok) - 1
    while i > 0 and not ok[i - 1]:
        i -= 1
    return rows[i]["length"]


def _threshold(rows: list[dict], marks: Sequence[Landmark]) -> tuple[str, str]:
    """(component, message) for a failing sweep."""
    fails = [r["length"] for r in rows if not r["ok"]]
    passes = [r["length"] for r in rows if r["ok"]]
    first = _first_failing(rows)
    if not passes:
        return "output", (f"prompts of every length tried ({fails[0]}..{fails[-1]} tokens) disagree with the "
                          "reference: the fault does not depend on the prompt's length")
    if first is None or max(passes) > first:
        return "prefill", (f"prompts of {', '.join(map(str, fails))} tokens disagree with the reference and "
                           f"{', '.join(map(str, passes)) or 'none'} agree: no single length threshold")
    last_ok = max(p for p in passes if p < first)
    row = next(r for r in rows if r["length"] == first)
    failing = f"{', '.join(map(str, fails))} fail; at {first}: mean KL {row['mean_kl']:.3g} (limit {row['kl_limit']:.3g})"
    onset = row["onset"]
    if onset is not None and onset > 0:  # the first rows agree: the fault follows the position
        mark = next((m for m in marks if m.length == onset), None)
        where = f"at {mark.what}" if mark else "not at a known landmark"
        return (mark.component if mark else "prefill",
                f"prompts of up to {last_ok} tokens agree with the reference, longer ones do not ({failing}): "
                f"from position {onset} on, the rows before it agree (the fault follows the position, not the "
                f"prompt's length); position {onset} is {where}")
    mark = next((m for m in marks if m.length == last_ok), None) if first == last_ok + 1 else None
    where = f"at {mark.what}" if mark else f"between {last_ok} and {first} tokens, not at one known landmark"
    return (mark.component if mark else "prefill",
            f"prompts of up to {last_ok} tokens agree with the reference, prompts of {first} tokens or more do not "
            f"({failing}), at every position, the first ones included (the length switches the whole prompt's "
            f"path); the threshold is {where}")
