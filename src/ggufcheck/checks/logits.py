"""Teacher-forced logit comparison: the engine vs the reference on the same tokens.

At every position both see the same prefix (teacher forcing), so each position is an
independent comparison of two next-token distributions; comparing free-running
generations after their first divergence would measure nothing. Per position:

- KL(ref || engine) over the full vocabulary in float64, or, when the engine returns only
  its top-k, over the coarsened distribution {top-k ids known on both sides, tail bucket}.
  Coarsening never increases KL (data-processing inequality), so top-k KL is a lower bound
  and the report says so.
- argmax agreement, with a Wilson binomial interval over all positions.
- delta-p: p_engine(observed next token) - p_ref(observed next token).
- NMSE of the log-softmax: mean((le - lr)^2) / var(lr) (model-conversion's check-nmse).

Distributions are summarized like llama-perplexity's KL report (mean +- stderr, median,
90/95/99/99.9 percentiles, max). Verdicts are relative to an honest baseline: how far a
correct engine of the same numerical class lands from the fp64 reference, either measured
(the reference run in the engine's dtype vs the fp64 reference) or, when that run is not
available, a stated allowance per activation class. A check fails when the engine exceeds
``multiple * baseline + floor``; the report prints the engine's number and the threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ggufcheck.comparison import Comparison, to_result
from ggufcheck.engines.base import TokenLogprobs
from ggufcheck.results import Result, failed, passed, skipped

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
TAIL_EPS = 1e-12  # probability floor for a tail bucket the engine says is empty


@dataclass(frozen=True)
class Baseline:
    """Expected error of a correct engine (per position), and where the numbers came from."""

    source: str  # e.g. "measured: reference fp32 vs fp64" or "stated allowance for q8 activations"
    kl_mean: float
    kl_p99: float
    argmax_agreement: float
    nmse_mean: float
    delta_p_rms: float


# Stated allowances, used only when no measured baseline run is available. They describe a
# correct engine of each numerical class on the SAME (already quantized) weights: the
# spread comes from activation rounding and accumulation order only. The q8 row is for
# llama.cpp-style engines quantizing activations to 8-bit blocks (ggml's Q8_0 / Q8_1 inputs
# to quantized matmuls); its size follows check-nmse's "good" band (NMSE < 1e-2).
ALLOWANCES: dict[str, Baseline] = {
    "fp64": Baseline("stated allowance for fp64 activations", 1e-10, 1e-9, 0.999, 1e-10, 1e-5),
    "fp32": Baseline("stated allowance for fp32 activations", 1e-6, 1e-5, 0.995, 1e-6, 1e-3),
    "fp16": Baseline("stated allowance for fp16 activations", 1e-3, 1e-2, 0.98, 1e-3, 0.01),
    "bf16": Baseline("stated allowance for bf16 activations", 3e-3, 3e-2, 0.97, 3e-3, 0.02),
    "q8": Baseline("stated allowance for 8-bit quantized activations", 5e-3, 5e-2, 0.97, 1e-2, 0.03),
}

# DSA indexer: the relative gap between the k-th and (k+1)-th scores (reference.dsa.boundary_gap)
# within which a correct engine of the class may pick the other top-k set: those positions are
# left out like exact ties. fp32 / fp64: exact ties only. Measured with transformers' glm_moe_dsa
# on a tiny glm-dsa file (tools/measure_allowances.py and tests/checks/test_low_precision.py;
# top-k 8 of up to 64 keys, so most boundaries are close): the residual stream stays at rounding
# level (fp16 0.0011, bf16 0.0087, instead of 0.2 / 0.3) from margins 3e-3 / 1e-2; the logits,
# where a flipped set also moves later positions (which are not left out), need 3e-2 for both
# (fp16 NMSE 3.5e-3 at 0, 1.8e-3 at 1e-2 on short prompts but 4.9e-3 on 60-token ones, 2.7e-5 at 3e-2).
INDEXER_TIE_MARGINS: dict[str, float] = {"fp64": 0.0, "fp32": 0.0, "fp16": 3e-2, "bf16": 3e-2, "q8": 3e-2}
# MoE routing: rows whose reference routing (weakest chosen vs best unchosen expert or group
# score, reference.layers.router_gap) is this close in any layer are ambiguous for an engine
# of that class (the layers stage's LayerOptions.router_tie_margins, the same numbers)
ROUTER_TIE_MARGINS: dict[str, float] = {"fp64": 1e-5, "fp32": 1e-5, "fp16": 5e-3, "bf16": 1e-2, "q8": 1e-2}


@dataclass(frozen=True)
class LogitTolerance:
    """fail when engine > multiple * baseline + floor (argmax: upper bound < baseline - floor)."""

    multiple: float = 3.0
    kl_floor: float = 1e-4  # nats per position
    kl_p99_floor: float = 1e-3
    argmax_floor: float = 0.02
    nmse_floor: float = 1e-4
    delta_p_floor: float = 0.005


@dataclass
class PositionMetrics:
    """Per-position metrics over every compared row of every sequence (all [N])."""

    kl: np.ndarray
    agree: np.ndarray  # bool
    delta_p: np.ndarray  # NaN where the observed token is unknown (last row, off top-k)
    nmse: np.ndarray
    sequence: np.ndarray  # which sequence each row came from
    position: np.ndarray  # row index t within the sequence
    ref_argmax: np.ndarray
    eng_argmax: np.ndarray
    full_vocab: bool = True
    sequences: list[np.ndarray] = field(default_factory=list)
    ambiguous: int = 0  # rows left out: the reference's expected distribution is ambiguous
    # the reference's top-1 minus top-2 log-prob per row (nats): a small one is a near-tie,
    # where another argmax is not evidence of a fault
    ref_margin: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.kl)

    def select(self, keep: np.ndarray) -> "PositionMetrics":
        """These metrics restricted to the rows ``keep`` (a boolean mask over the rows)."""
        fields = {name: value[keep] if isinstance(value, np.ndarray) and value.shape[:1] == keep.shape else value
                  for name, value in vars(self).items()}
        return type(self)(**fields)

    def expected_flips(self, kl_limit: float) -> float:
        """How many argmax disagreements this comparison's own error explains (see
        :func:`expected_flips`), at its mean KL capped at ``kl_limit``."""
        if self.ref_margin is None or not self.n:
            return 0.0
        kl = min(max(float(np.nanmean(self.kl)), 0.0), kl_limit)
        return expected_flips(self.ref_margin, kl)


def expected_flips(margins: np.ndarray, kl: float) -> float:
    """Expected argmax disagreements of an engine whose log-probs differ from the reference's
    by a mean KL of ``kl`` spread over the vocabulary, given the reference's top-1 minus top-2
    gaps ``margins`` [N]. A log-prob error d costs KL ~ 1/2 Var_p(d): its spread is ~sqrt(2 kl),
    a gap between two tokens moves by ~sqrt(2) times that, s = 2 sqrt(kl), and a gap m flips with
    probability Phi(-m / s). Flat random-weight models (most gaps below 0.3 nats) flip many
    argmaxes at KL 1e-3; a fault whose KL is small but concentrated on the top tokens flips more
    than its KL explains."""
    if kl <= 0:
        return 0.0
    s = 2.0 * math.sqrt(kl)
    m = np.asarray(margins, dtype=np.float64)
    m = m[np.isfinite(m)]
    return float(sum(0.5 * math.erfc(x / (s * math.sqrt(2.0))) for x in m))


def compare_tables(reference: TokenLogprobs, engine: TokenLogprobs) -> dict[str, np.ndarray]:
    """Per-row metrics for one sequence at rows both sides report. Keys as PositionMetrics."""
    if not np.array_equal(reference.tokens, engine.tokens):
        raise ValueError("reference and engine scored different token sequences")
    shared = reference.present & engine.present
    ambiguous = np.zeros_like(shared) if reference.ambiguous is None else (reference.ambiguous & shared)
    rows = np.flatnonzero(shared & ~ambiguous)  # [N]: ambiguous rows are counted, not judged
    if reference.full and engine.full:
        kl, nmse = _full_kl_nmse(reference.logprobs, engine.logprobs, rows)
        full = True
    else:
        kl, nmse = _topk_tail_kl(reference, engine, rows)
        full = False
    observed = np.exp(engine.next_logprob[rows]) - np.exp(reference.next_logprob[rows])
    _ids, top2 = reference.top_k(2)
    margin = (top2[rows, 0] - top2[rows, 1]) if top2.shape[1] > 1 else np.full(len(rows), np.inf)
    return {
        "kl": kl, "nmse": nmse, "delta_p": observed, "position": rows, "ref_margin": margin,
        "ref_argmax": reference.argmax()[rows], "eng_argmax": engine.argmax()[rows],
        "full_vocab": np.array(full), "ambiguous": np.array(int(ambiguous.sum())),
    }


def _full_kl_nmse(ref: np.ndarray, eng: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(ref || eng) and the NMSE of log-softmax at ``rows`` of two [T, V] tables, one fused
    pass per row, rows in parallel (engines/rowwise.py: no [rows, V] temporaries)."""
    from ggufcheck.engines.rowwise import kl_nmse

    return kl_nmse(ref, eng, rows)


def _tail_kl(p_tail: float, q_tail: float, p_missing: float, q_missing_max: float) -> float:
    """The least KL the tail can add, split into A (the reference's own top ids the engine's
    top-k leaves out: mass ``p_missing``, engine mass at most ``q_missing_max``, each below the
    engine's k-th value) and the rest: min over the unknown q(A) of
    p(A) log(p(A)/q(A)) + p(R) log(p(R)/q(R)), q(A) + q(R) = ``q_tail``. Coarsening never
    increases KL, so this is still a lower bound of the full KL, and a tight one where the
    engine's top-k misses what the reference is sure of (a row the one bucket called 0.17 nats)."""
    p_missing = min(p_missing, p_tail)
    p_rest = p_tail - p_missing
    if p_missing <= 0:
        return p_tail * math.log(p_tail / q_tail)
    q_a = min(q_tail * p_missing / p_tail, q_missing_max, q_tail)  # the unconstrained optimum, clipped
    q_a = max(q_a, TAIL_EPS)
    value = p_missing * math.log(p_missing / q_a)
    if p_rest > 0:
        value += p_rest * math.log(p_rest / max(q_tail - q_a, TAIL_EPS))
    return value


def _topk_tail_kl(reference: TokenLogprobs, engine: TokenLogprobs, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL and NMSE over {ids known on both sides} + one tail bucket (a lower bound on KL)."""
    kl = np.empty(len(rows))
    nmse = np.empty(len(rows))
    k = engine.topk_ids.shape[1] if engine.topk_ids is not None else 64
    ref_ids, ref_lp = reference.top_k(reference.vocab_size if reference.full else k)
    eng_ids, eng_lp = engine.top_k(engine.vocab_size if engine.full else k)
    ref_top = ref_ids[:, :k] if reference.full else None  # sorted: the reference's own top k
    for i, t in enumerate(rows):
        r = {int(a): b for a, b in zip(ref_ids[t], ref_lp[t]) if a >= 0}
        e = {int(a): b for a, b in zip(eng_ids[t], eng_lp[t]) if a >= 0}
        if reference.full:
            r = {a: float(reference.logprobs[t, a]) for a in e}
        known = sorted(set(r) & set(e))
        lr = np.array([r[a] for a in known])
        le = np.array([e[a] for a in known])
        pr, pe = np.exp(lr), np.exp(le)
        tail_r = max(1.0 - pr.sum(), 0.0)
        tail_e = max(1.0 - pe.sum(), TAIL_EPS)
        value = float((pr * (lr - le)).sum())
        if reference.full and len(e) >= max(k, 2) and tail_r > 0:  # the reference's top ids the engine left out
            missing = [int(a) for a in ref_top[t] if a >= 0 and int(a) not in e]
            # each below the engine's k-th value: its second-smallest entry is a safe ceiling (a table may
            # carry one entry from outside its top-k: the observed prompt token, vLLM's prompt_logprobs)
            ceiling = math.exp(sorted(e.values())[1])
            value += _tail_kl(tail_r, tail_e, float(np.exp(reference.logprobs[t, missing]).sum()) if missing else 0.0,
                              len(missing) * ceiling)
        elif tail_r > 0:
            value += tail_r * math.log(tail_r / tail_e)
        kl[i] = value
        nmse[i] = ((le - lr) ** 2).mean() / max(lr.var(), 1e-30) if len(known) > 1 else 0.0
    return kl, nmse


def collect(pairs: Sequence[tuple[TokenLogprobs, TokenLogprobs]]) -> PositionMetrics:
    """Per-position metrics over several (reference, engine) sequence pairs."""
    parts = [compare_tables(r, e) for r, e in pairs]
    cat = lambda key: np.concatenate([p[key] for p in parts]) if parts else np.zeros(0)  # noqa: E731
    seq = np.concatenate([np.full(len(p["kl"]), i) for i, p in enumerate(parts)]) if parts else np.zeros(0, int)
    ref_argmax, eng_argmax = cat("ref_argmax"), cat("eng_argmax")
    return PositionMetrics(
        kl=cat("kl"), agree=ref_argmax == eng_argmax, delta_p=cat("delta_p"), nmse=cat("nmse"),
        sequence=seq, position=cat("position"), ref_argmax=ref_argmax, eng_argmax=eng_argmax,
        full_vocab=all(bool(p["full_vocab"]) for p in parts), sequences=[r.tokens for r, _ in pairs],
        ambiguous=sum(int(p["ambiguous"]) for p in parts), ref_margin=cat("ref_margin"),
    )


def distribution(values: np.ndarray) -> dict[str, float]:
    """llama-perplexity style summary of a per-position metric (NaNs dropped)."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) == 0:
        return {"n": 0}
    out = {"n": int(len(x)), "mean": float(x.mean()),
           "stderr": float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0}
    for q in PERCENTILES:
        out["median" if q == 50.0 else f"p{q:g}"] = float(np.percentile(x, q))
    out["max"] = float(x.max())
    out["min"] = float(x.min())
    out["rms"] = float(math.sqrt((x ** 2).mean()))
    return out


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% for z = 1.96)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def baseline_from(metrics: PositionMetrics, source: str) -> Baseline:
    """A measured baseline from a trusted low-precision run vs the fp64 reference."""
    dp = metrics.delta_p[np.isfinite(metrics.delta_p)]
    return Baseline(
        source=source,
        kl_mean=float(np.mean(metrics.kl)) if metrics.n else 0.0,
        kl_p99=float(np.percentile(metrics.kl, 99)) if metrics.n else 0.0,
        argmax_agreement=float(np.mean(metrics.agree)) if metrics.n else 1.0,
        nmse_mean=float(np.mean(metrics.nmse)) if metrics.n else 0.0,
        delta_p_rms=float(np.sqrt(np.mean(dp ** 2))) if len(dp) else 0.0,
    )


Detokenize = Callable[[Sequence[int]], str]


def worst_positions(metrics: PositionMetrics, detokenize: Detokenize | None, count: int = 5) -> list[dict]:
    """The ``count`` positions with the largest KL, with their context and tokens."""
    order = np.argsort(-metrics.kl, kind="stable")[:count]
    text = detokenize or (lambda toks: " ".join(str(t) for t in toks))
    out = []
    for i in order:
        seq = metrics.sequences[int(metrics.sequence[i])]
        t = int(metrics.position[i])
        entry = {
            "sequence": int(metrics.sequence[i]), "position": t, "kl": float(metrics.kl[i]),
            "context": _safe(text, seq[max(0, t - 7):t + 1]),
            "reference_top": _safe(text, [int(metrics.ref_argmax[i])]),
            "engine_top": _safe(text, [int(metrics.eng_argmax[i])]),
        }
        if metrics.ref_margin is not None:
            entry["reference_margin"] = float(metrics.ref_margin[i])
        if t + 1 < len(seq):
            entry["observed_next"] = _safe(text, [int(seq[t + 1])])
            entry["delta_p"] = float(metrics.delta_p[i])
        out.append(entry)
    return out


def _safe(text: Detokenize, tokens: Sequence[int]) -> str:
    try:
        return text([int(t) for t in tokens])
    except Exception:  # noqa: BLE001 - display only; never fail a check on a display string
        return " ".join(str(int(t)) for t in tokens)


def nonfinite(metrics: PositionMetrics, check: str, component: str, what: str) -> Result | None:
    """A FAIL when any compared row's KL is NaN or inf (a NaN or -inf log-prob where the other
    side has mass): such rows would otherwise drop out of every mean and percentile, and a
    run whose rows are all non-finite has no statistics at all. None when every row is finite."""
    bad = ~np.isfinite(metrics.kl)
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    where = {"sequence": int(metrics.sequence[i]), "position": int(metrics.position[i])}
    return failed(check, component,
                  f"{what}: {int(bad.sum())} of {metrics.n} positions give a non-finite KL (NaN or inf log-probs, "
                  f"or -inf where the other side has mass), first at sequence {where['sequence']} position "
                  f"{where['position']} (judged before any statistic: a mean or a percentile would drop these rows)",
                  stats={"nonfinite_positions": int(bad.sum()), "positions": metrics.n, "first": where},
                  worst=where)


def judge(metrics: PositionMetrics, baseline: Baseline, tolerance: LogitTolerance = LogitTolerance(),
          *, detokenize: Detokenize | None = None, component: str = "output") -> list[Result]:
    """The logits stage's results: KL mean, KL p99, argmax agreement, delta-p, NMSE."""
    if metrics.n == 0:
        return [skipped("logits.kl", component, "no position was reported by both the reference and the engine")]
    broken = nonfinite(metrics, "logits.kl_mean", component, "KL(ref||engine)")
    if broken is not None:
        return [broken]
    m = tolerance.multiple
    kl = distribution(metrics.kl)
    method = "full vocabulary" if metrics.full_vocab else "top-k + tail bucket (a lower bound on the full KL)"
    if metrics.ambiguous:
        method += f"; {metrics.ambiguous} position(s) with an indexer top-k or MoE routing near-tie left out"
    worst = {"positions": worst_positions(metrics, detokenize)}
    base_note = f"baseline ({baseline.source})"
    results: list[Result] = []

    def held(metric: str, value: float, base: float, floor: float, what: str, n: int) -> Comparison:
        """A statistic held to multiple x its baseline + floor (comparison.py)."""
        return Comparison(metric, value, m * base + floor, what, base, size=n)

    mean = held("kl_mean", kl["mean"], baseline.kl_mean, tolerance.kl_floor, "mean KL(ref||engine)", kl["n"])
    results.append(to_result(
        mean, "logits.kl_mean", component,
        message=f"mean KL(ref||engine) {kl['mean']:.3g} nats over {kl['n']} positions ({method}); "
                f"{base_note} {baseline.kl_mean:.3g}, limit {mean.limit:.3g}",
        stats={"kl": kl, "method": method, "ambiguous_positions": metrics.ambiguous}, worst=worst))
    limit = mean.limit

    p99 = held("kl_p99", kl["p99"], baseline.kl_p99, tolerance.kl_p99_floor, "99th-percentile KL", kl["n"])
    results.append(to_result(
        p99, "logits.kl_p99", component,
        message=f"99th-percentile KL {kl['p99']:.3g} (max {kl['max']:.3g}); baseline {baseline.kl_p99:.3g}, "
                f"limit {p99.limit:.3g}",
        stats={"p99": kl["p99"], "max": kl["max"]}))

    results.append(judge_argmax(metrics, baseline, tolerance, limit, component))

    dp = distribution(metrics.delta_p)
    if dp.get("n", 0):
        # A systematic shift of the observed token's probability: |mean| vs its own noise
        # (3 standard errors) plus the baseline's spread.
        limit_dp = m * baseline.delta_p_rms / math.sqrt(dp["n"]) + 3 * dp["stderr"] + tolerance.delta_p_floor
        rms_limit = m * baseline.delta_p_rms + tolerance.delta_p_floor
        ok = abs(dp["mean"]) <= limit_dp and dp["rms"] <= rms_limit
        results.append(_verdict(
            "logits.delta_p", component, ok,
            f"delta-p of the observed token: mean {dp['mean']:+.4f} (limit +-{limit_dp:.4f}), rms {dp['rms']:.4f} "
            f"(limit {rms_limit:.4f}); baseline rms {baseline.delta_p_rms:.4f}",
            stats={"delta_p": dp, "mean_limit": limit_dp, "rms_limit": rms_limit}))
    else:
        results.append(skipped("logits.delta_p", component, "the engine reported no observed-token probability"))

    nm = distribution(metrics.nmse)
    nmse = held("nmse_mean", nm["mean"], baseline.nmse_mean, tolerance.nmse_floor, "NMSE of log-softmax",
                nm.get("n", 0))
    results.append(to_result(
        nmse, "logits.nmse", component,
        message=f"NMSE of log-softmax {nm['mean']:.3g} ({'full vocabulary' if metrics.full_vocab else 'top-k ids'}); "
                f"baseline {baseline.nmse_mean:.3g}, limit {nmse.limit:.3g}" + _one_row_carries(metrics),
        stats={"nmse": nm}))
    return results


def _one_row_carries(metrics: PositionMetrics) -> str:
    """Where one position carries most of the mean NMSE, which one and what it is: a single
    row whose distribution is another one entirely (a kernel wrong at one token) reads as a
    mean over hundreds of healthy rows otherwise."""
    total = float(np.nansum(metrics.nmse)) if metrics.n else 0.0
    if total <= 0:
        return ""
    i = int(np.nanargmax(metrics.nmse))
    share = float(metrics.nmse[i]) / total
    if share < 0.5:
        return ""
    agree = "its argmax agrees" if bool(metrics.agree[i]) else \
        f"argmax {int(metrics.eng_argmax[i])} where the reference's is {int(metrics.ref_argmax[i])}"
    return (f"; one position carries {share:.0%} of it: sequence {int(metrics.sequence[i])}, position "
            f"{int(metrics.position[i])} (NMSE {float(metrics.nmse[i]):.3g}, KL at least {float(metrics.kl[i]):.3g}, "
            f"{agree})")


def argmax_agreement(metrics: PositionMetrics, kl_limit: float) -> tuple[int, int, float]:
    """(judged agreeing, exactly agreeing, explained): the rows whose argmax is the reference's,
    plus the disagreements the comparison's own error explains (up to the expected number plus
    two of its Poisson standard deviations, :func:`expected_flips`)."""
    exact = int(metrics.agree.sum())
    expected = metrics.expected_flips(kl_limit)
    explained = min(metrics.n - exact, int(math.floor(expected + 2.0 * math.sqrt(expected))))
    return exact + explained, exact, expected


def judge_argmax(metrics: PositionMetrics, baseline: Baseline, tolerance: LogitTolerance, kl_limit: float,
                 component: str) -> Result:
    agree, exact, expected = argmax_agreement(metrics, kl_limit)
    n = metrics.n
    need = baseline.argmax_agreement - tolerance.argmax_floor
    low, high = wilson_interval(agree, n)
    how = (f"; {exact} exactly, and {agree - exact} of the {n - exact} others are near-ties that the engine's own "
           f"mean KL explains (expected {expected:.1f} flips)" if agree > exact else "")
    return _verdict(
        "logits.argmax", component, high >= need,
        f"argmax agrees at {agree}/{n} positions ({agree / n:.1%}, 95% CI {low:.1%}-{high:.1%}{how}); "
        f"baseline {baseline.argmax_agreement:.1%}, need upper bound >= {need:.1%}",
        stats={"agreement": agree / n, "exact": exact / n, "expected_flips": expected, "ci95": [low, high],
               "n": n, "baseline": baseline.argmax_agreement, "required_upper_bound": need})


def _verdict(check: str, component: str, ok: bool, message: str, **kw) -> Result:
    return passed(check, component, message, **kw) if ok else failed(check, component, message, **kw)
