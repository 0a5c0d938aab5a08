"""Sanity of an engine's output with no reference: the "flat log-probs" detector.

A deployment that returns garbage usually shows it in the distributions themselves: NaN or
Inf log-probs; near-uniform distributions (entropy close to log(vocab size), top-1
probability near 1/V); the same distribution whatever the input (a runner that ignores its
prompt); natural text that the model finds as surprising as random tokens; and greedy
continuations stuck on one token. These checks assume a TRAINED model on natural-language
prompts; a tiny random-weight test model is near-uniform by construction (use the logits
stage against the reference for those).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ggufcheck.engines.base import Generation, TokenLogprobs
from ggufcheck.results import Result, failed, passed, skipped

COMPONENT = "output"


@dataclass(frozen=True)
class SanityLimits:
    """Stated limits for a trained model (fractions of log V, probabilities, tokens)."""

    max_entropy_fraction: float = 0.75  # mean entropy / log(V) above this is "flat"
    min_top1_factor: float = 20.0  # mean top-1 probability must exceed factor / V
    max_perplexity_fraction: float = 0.6  # log-perplexity / log(V) above this: text looks random
    min_input_tv: float = 1e-3  # total variation between distributions of different prompts
    max_repeat_fraction: float = 0.9  # share of a greedy continuation taken by its commonest token
    min_repeat_length: int = 8  # only judge repetition on continuations at least this long


def _probs(table: TokenLogprobs) -> np.ndarray:
    """[N, V or K+1] probabilities of the present rows (top-k gets a tail column)."""
    rows = table.present
    if table.full:
        return np.exp(table.logprobs[rows].astype(np.float64))
    p = np.exp(table.topk_logprobs[rows])
    tail = np.clip(1.0 - p.sum(axis=1, keepdims=True), 0.0, 1.0)
    return np.concatenate([p, tail], axis=1)


def check_finite(tables: Sequence[TokenLogprobs]) -> Result:
    """Every served row finite. A failure names the first bad row and what it holds: NaN from
    the first position on is a broken weight or kernel; finite rows that turn NaN or inf later
    are an overflow that grows with the context (fp16 activations)."""
    bad = 0
    total = 0
    first = None
    kinds = set()
    for s, t in enumerate(tables):
        values = t.logprobs[t.present] if t.full else t.topk_logprobs[t.present][:, :1]
        total += values.shape[0]
        rows = ~np.isfinite(values).all(axis=1) if t.full else ~np.isfinite(values[:, 0])
        bad += int(rows.sum())
        if rows.any():
            kinds |= {"NaN"} if np.isnan(values[rows]).any() else set()
            kinds |= {"inf"} if np.isinf(values[rows]).any() else set()
            if first is None:
                first = {"sequence": s, "position": int(np.flatnonzero(t.present)[np.flatnonzero(rows)[0]]),
                         "of": int(values.shape[0])}
    if bad:
        when = ("from the first position on (a broken weight or kernel)" if first["position"] == 0 else
                f"first at position {first['position']} of sequence {first['sequence']}, after finite rows (an "
                "overflow that grows with the context, e.g. fp16 activations)")
        return failed("sanity.finite", COMPONENT,
                      f"{bad}/{total} positions have {' and '.join(sorted(kinds))} log-probs, {when}; such rows "
                      "sample one token over and over ('!!!!', 'GGGG')",
                      stats={"bad_positions": bad, "positions": total, "first": first, "kinds": sorted(kinds)},
                      worst=first)
    return passed("sanity.finite", COMPONENT, f"all {total} positions have finite log-probs")


def check_entropy(tables: Sequence[TokenLogprobs], vocab_size: int, limits: SanityLimits) -> Result:
    """Mean entropy against log(V); with top-k only, the entropy of {top-k, tail} (a lower bound)."""
    ent = []
    for t in tables:
        p = _probs(t)
        with np.errstate(divide="ignore", invalid="ignore"):
            ent.append(-(np.where(p > 0, p * np.log(p), 0.0)).sum(axis=1))
    h = np.concatenate(ent)
    log_v = math.log(vocab_size)
    frac = float(h.mean() / log_v)
    msg = (f"mean entropy {h.mean():.2f} nats = {frac:.0%} of log(V)={log_v:.2f} "
           f"(limit {limit_pct(limits.max_entropy_fraction)})")
    stats = {"entropy_mean": float(h.mean()), "entropy_median": float(np.median(h)), "log_vocab": log_v,
             "fraction": frac, "limit": limits.max_entropy_fraction,
             "method": "full vocabulary" if all(t.full for t in tables) else "top-k + tail (lower bound)"}
    if frac > limits.max_entropy_fraction:
        return failed("sanity.entropy", COMPONENT, "flat distributions: " + msg, stats=stats)
    return passed("sanity.entropy", COMPONENT, msg, stats=stats)


def limit_pct(x: float) -> str:
    return f"{x:.0%}"


def check_top1(tables: Sequence[TokenLogprobs], vocab_size: int, limits: SanityLimits) -> Result:
    top1 = np.concatenate([_probs(t)[:, :-1].max(axis=1) if not t.full else _probs(t).max(axis=1) for t in tables])
    need = limits.min_top1_factor / vocab_size
    msg = f"mean top-1 probability {top1.mean():.3f} (uniform would be {1 / vocab_size:.2g}; need > {need:.2g})"
    stats = {"top1_mean": float(top1.mean()), "top1_median": float(np.median(top1)), "limit": need}
    if top1.mean() <= need:
        return failed("sanity.top1", COMPONENT, "flat distributions: " + msg, stats=stats)
    return passed("sanity.top1", COMPONENT, msg, stats=stats)


def check_perplexity(tables: Sequence[TokenLogprobs], vocab_size: int, limits: SanityLimits) -> Result:
    """Natural text must be far more predictable than random tokens (log-ppl vs log V)."""
    obs = np.concatenate([t.next_logprob[np.isfinite(t.next_logprob)] for t in tables])
    if len(obs) == 0:
        return skipped("sanity.perplexity", COMPONENT, "the engine reported no observed-token log-probs")
    log_ppl = float(-obs.mean())
    frac = log_ppl / math.log(vocab_size)
    msg = (f"perplexity {math.exp(min(log_ppl, 700)):.1f} on the prompts = V^{frac:.2f} "
           f"(random tokens would be V^1; limit V^{limits.max_perplexity_fraction:.2f})")
    stats = {"log_perplexity": log_ppl, "fraction_of_log_vocab": frac, "tokens": int(len(obs))}
    if frac > limits.max_perplexity_fraction:
        return failed("sanity.perplexity", COMPONENT, "the model finds natural text random: " + msg, stats=stats)
    return passed("sanity.perplexity", COMPONENT, msg, stats=stats)


def check_input_dependence(tables: Sequence[TokenLogprobs], limits: SanityLimits) -> Result:
    """Different prompts (and different positions) must give different distributions."""
    if len(tables) < 2:
        return skipped("sanity.input_dependence", COMPONENT, "needs at least two prompts")
    last = []
    for t in tables:
        rows = np.flatnonzero(t.present)
        p = _probs(t)
        if not t.full:  # align top-k rows on ids: dense over the union is overkill; use the tail-free ids
            dense = np.zeros(t.vocab_size + 1)
            ids = t.topk_ids[rows[-1]]
            dense[ids[ids >= 0]] = p[-1, :-1][ids >= 0]
            dense[-1] = p[-1, -1]
            last.append(dense)
        else:
            last.append(p[-1])
    tv = [0.5 * np.abs(a - b).sum() for i, a in enumerate(last) for b in last[i + 1:]]
    within = []
    for t in tables:
        p = _probs(t)
        if len(p) > 1 and t.full:
            within.append(0.5 * np.abs(p[1:] - p[:-1]).sum(axis=1).max())
    tv_min = float(min(tv))
    stats = {"min_tv_between_prompts": tv_min, "max_tv_between_prompts": float(max(tv)),
             "max_tv_within_prompt": float(max(within)) if within else None, "limit": limits.min_input_tv}
    if float(max(tv)) < limits.min_input_tv:
        return failed("sanity.input_dependence", COMPONENT,
                      f"every prompt gets the same next-token distribution (largest total variation between "
                      f"prompts {max(tv):.2g} < {limits.min_input_tv:g}): the engine ignores its input",
                      stats=stats)
    return passed("sanity.input_dependence", COMPONENT,
                  f"prompts give different distributions (total variation {tv_min:.2g}..{max(tv):.2g})", stats=stats)


def check_repetition(generations: Sequence[Generation], limits: SanityLimits) -> Result:
    judged = [g for g in generations if len(g.generated) >= limits.min_repeat_length]
    if not judged:
        return skipped("sanity.repetition", COMPONENT,
                       f"no greedy continuation of at least {limits.min_repeat_length} tokens")
    stuck = []
    for i, g in enumerate(judged):
        _, counts = np.unique(g.generated, return_counts=True)
        share = counts.max() / len(g.generated)
        if share > limits.max_repeat_fraction:
            stuck.append((i, float(share)))
    stats = {"continuations": len(judged), "stuck": len(stuck), "limit": limits.max_repeat_fraction}
    if len(stuck) * 2 > len(judged):
        return failed("sanity.repetition", COMPONENT,
                      f"{len(stuck)}/{len(judged)} greedy continuations repeat one token "
                      f"(> {limits.max_repeat_fraction:.0%} of their tokens)", stats=stats)
    return passed("sanity.repetition", COMPONENT,
                  f"{len(judged) - len(stuck)}/{len(judged)} greedy continuations are not stuck on one token",
                  stats=stats)


def run_sanity(tables: Sequence[TokenLogprobs], generations: Sequence[Generation], vocab_size: int,
               limits: SanityLimits = SanityLimits()) -> list[Result]:
    """All sanity checks over teacher-forced tables (and greedy generations when available)."""
    if not tables:
        return [skipped("sanity", COMPONENT, "no scored prompts")]
    results = [check_finite(tables)]
    if results[0].failed:
        return results  # the other statistics are meaningless on NaN
    results += [
        check_entropy(tables, vocab_size, limits),
        check_top1(tables, vocab_size, limits),
        check_perplexity(tables, vocab_size, limits),
        check_input_dependence(tables, limits),
    ]
    if generations:
        results.append(check_repetition(generations, limits))
    else:
        results.append(skipped("sanity.repetition", COMPONENT, "the engine offers no greedy generation"))
    return results
