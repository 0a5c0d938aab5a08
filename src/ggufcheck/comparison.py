"""One comparison of numbers: the value measured, the limit it is held to, and where it is worst.

Domain code (sharding, quants, reference) measures; ``checks/`` judges. A :class:`Comparison`
is the hand-over between the two: a frozen value that says what was compared (``what``),
by which metric, how far apart the two sides are, the limit (and the honest baseline the
limit came from, when there is one), and the worst element with both sides' values. It is
truthy when the value is within the limit, so a check reads ``if cmp:``; NaN is never within
a limit. Every check turns it into a :class:`~ggufcheck.results.Result` the same way
(:func:`to_result`), so evidence reads the same everywhere: "max |diff| 0.5 > 1e-06 at
[3, 17]: got 1.5, want 1".

The metrics here are the ones the checks use: :func:`max_abs` (the largest elementwise
difference, NaN / inf where either side is not finite and they differ), :func:`rel_error`
(``||got - want|| / ||want||``), :func:`within_rtol` (every element within a relative
tolerance of the wanted value), and :func:`exact` (bitwise equal). Statistics measured
elsewhere are held to a limit the same way by building the value directly: the logits stage's
mean KL, 99th-percentile KL and NMSE (``multiple * baseline + floor``), and the kernel probe's
relative error against fp64 (checks/kernels.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggufcheck.results import Result, failed, passed

# how each metric is written in a message
_SYMBOL = {"max_abs": "max |diff|", "rel_error": "relative error", "exact": "mismatching elements",
           "rtol": "max |diff| / |want|"}


@dataclass(frozen=True)
class Worst:
    """The element where the two sides differ most."""

    index: tuple[int, ...]
    got: float
    want: float

    def text(self) -> str:
        return f"at {list(self.index)}: got {self.got:.6g}, want {self.want:.6g}"


@dataclass(frozen=True)
class Comparison:
    """``value`` of ``metric`` between two arrays, held to ``limit`` (``value <= limit`` passes)."""

    metric: str
    value: float
    limit: float
    what: str = ""
    baseline: float | None = None  # the error a correct implementation shows, where the limit came from
    worst: Worst | None = None
    size: int = 0  # elements compared
    extra: dict[str, Any] = field(default_factory=dict)  # metric-specific facts (e.g. mismatch count)

    @property
    def ok(self) -> bool:
        return bool(not math.isnan(self.value) and self.value <= self.limit)

    def __bool__(self) -> bool:
        return self.ok

    def text(self) -> str:
        """'what: max |diff| 0.5 > 1e-06 at [3, 17]: got 1.5, want 1'."""
        symbol = _SYMBOL.get(self.metric, self.metric)
        if self.metric == "exact":
            body = "bitwise equal" if self.ok else f"{int(self.value)} of {self.size} elements differ"
        else:
            body = f"{symbol} {self.value:.3g} {'<=' if self.ok else '>'} {self.limit:.3g}"
        if not self.ok and self.worst is not None:
            body += " " + self.worst.text()
        return f"{self.what}: {body}" if self.what else body

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"metric": self.metric, "value": self.value, "limit": self.limit, "size": self.size}
        if self.baseline is not None:
            out["baseline"] = self.baseline
        return out | self.extra

    def worst_json(self) -> dict[str, Any] | None:
        if self.worst is None:
            return None
        return {"element": list(self.worst.index), "got": self.worst.got, "want": self.worst.want}


def to_result(cmp: Comparison, check: str, component: str, *, message: str | None = None,
              stats: dict[str, Any] | None = None, worst: dict[str, Any] | None = None, **where: Any) -> Result:
    """The one conversion of a comparison into a PASS / FAIL :class:`Result`."""
    make = passed if cmp.ok else failed
    return make(check, component, message if message is not None else cmp.text(),
                stats=cmp.stats() | (stats or {}), worst=(cmp.worst_json() or {}) | (worst or {}) or None, **where)


def _numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor, on any device
        a = a.detach().cpu()
        if str(a.dtype) == "torch.bfloat16":
            a = a.float()
        a = a.numpy()
    return np.asarray(a)


def _worst(diff: np.ndarray, got: np.ndarray, want: np.ndarray) -> Worst | None:
    if diff.size == 0:
        return None
    flat = int(np.nanargmax(np.where(np.isnan(diff), np.inf, diff)))
    index = tuple(int(i) for i in np.unravel_index(flat, diff.shape))
    return Worst(index, float(got[index]), float(want[index]))


def _shape_mismatch(metric: str, what: str, got: np.ndarray, want: np.ndarray, limit: float) -> Comparison:
    return Comparison(metric, math.inf, limit, what, extra={"shape_got": list(got.shape), "shape_want": list(want.shape)})


def max_abs(got: Any, want: Any, limit: float, what: str = "", *, baseline: float | None = None) -> Comparison:
    """The largest |got - want|; elements equal on both sides (inf == inf) count as 0, a NaN or
    a one-sided inf as inf."""
    g, w = _numpy(got).astype(np.float64), _numpy(want).astype(np.float64)
    if g.shape != w.shape:
        return _shape_mismatch("max_abs", what, g, w, limit)
    with np.errstate(invalid="ignore"):
        diff = np.where(g == w, 0.0, np.abs(g - w))
    diff = np.nan_to_num(diff, nan=np.inf, posinf=np.inf)
    value = float(diff.max()) if diff.size else 0.0
    return Comparison("max_abs", value, limit, what, baseline, _worst(diff, g, w), int(diff.size))


def rel_error(got: Any, want: Any, limit: float, what: str = "", *, baseline: float | None = None) -> Comparison:
    """||got - want|| / ||want|| (Frobenius), with the worst element by absolute difference."""
    g, w = _numpy(got).astype(np.float64), _numpy(want).astype(np.float64)
    if g.shape != w.shape:
        return _shape_mismatch("rel_error", what, g, w, limit)
    diff = np.abs(g - w)
    norm = float(np.linalg.norm(w))
    value = float(np.linalg.norm(g - w)) / norm if norm > 0 else (0.0 if not diff.any() else math.inf)
    if not np.isfinite(g).all():
        value = math.nan
    return Comparison("rel_error", float(value), limit, what, baseline,
                      _worst(np.nan_to_num(diff, nan=np.inf, posinf=np.inf), g, w),
                      int(diff.size))


def within_rtol(got: Any, want: Any, rtol: float, what: str = "", *, atol: float = 1e-30) -> Comparison:
    """Every element within ``rtol * |want| + atol`` of ``want``: the value is the largest
    |got - want| / (|want| + atol / rtol) and the limit ``rtol``."""
    g, w = _numpy(got).astype(np.float64), _numpy(want).astype(np.float64)
    if g.shape != w.shape:
        return _shape_mismatch("rtol", what, g, w, rtol)
    diff = np.abs(g - w)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.nan_to_num(diff / (np.abs(w) + atol / max(rtol, 1e-300)), nan=np.inf, posinf=np.inf)
    value = float(ratio.max()) if ratio.size else 0.0
    return Comparison("rtol", value, rtol, what, None, _worst(ratio, g, w), int(ratio.size),
                      extra={"max_abs_diff": float(np.nan_to_num(diff, nan=np.inf, posinf=np.inf).max())
                             if diff.size else 0.0})


def exact(got: Any, want: Any, what: str = "") -> Comparison:
    """Bitwise equality (NaN equals NaN): the value is the number of differing elements."""
    g, w = _numpy(got), _numpy(want)
    if g.shape != w.shape:
        return _shape_mismatch("exact", what, g, w, 0.0)
    same = (g == w) | (np.isnan(g) & np.isnan(w)) if np.issubdtype(g.dtype, np.floating) else (g == w)
    bad = ~same
    n_bad = int(bad.sum())
    worst = None
    if n_bad:
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        worst = Worst(index, float(g[index]), float(w[index]))
    return Comparison("exact", float(n_bad), 0.0, what, None, worst, int(g.size))
