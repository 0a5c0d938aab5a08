"""How the layers stage measures: relative errors per position, the worst one and where it is,
the limit a layer is held to, and which positions a DSA / MoE near-tie takes out of the comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ggufcheck.checks.layers.options import LayerOptions


def rel_errors(got: Tensor, want: Tensor) -> Tensor:
    """Per-position ||got - want|| / ||want|| [T] (float64; inf where got is not finite)."""
    got, want = got.to("cpu", torch.float64), want.to("cpu", torch.float64)  # (a GPU reference's too)
    num = (got - want).norm(dim=-1)
    den = want.norm(dim=-1)
    den = den.clamp_min(max(float(den.mean()) * 1e-6, 1e-300))
    err = num / den
    return torch.where(torch.isfinite(got).all(dim=-1), err, torch.full_like(err, math.inf))


@dataclass
class MaxError:
    """Max relative error over prompts and positions, and where it is."""

    value: float = 0.0
    sequence: int | None = None
    position: int | None = None
    element: int | None = None
    got: float | None = None  # both sides at the worst element
    want: float | None = None

    def update(self, errs: Tensor, got: Tensor, want: Tensor, seq: int, keep: Tensor | None = None) -> None:
        if keep is not None:
            errs = torch.where(keep, errs, torch.zeros_like(errs))
        if errs.numel() == 0:
            return
        t = int(torch.argmax(torch.nan_to_num(errs, nan=math.inf)))
        v = float(errs[t])
        if math.isnan(v):
            v = math.inf
        if v > self.value or self.sequence is None:
            diff = (got[t].to(torch.float64) - want[t].to(torch.float64)).abs()
            diff = torch.nan_to_num(diff, nan=math.inf)
            self.value, self.sequence, self.position, self.element = v, seq, t, int(torch.argmax(diff))
            self.got, self.want = float(got[t, self.element]), float(want[t, self.element])

    def worst(self) -> dict[str, Any] | None:
        if self.sequence is None:
            return None
        return {"sequence": self.sequence, "position": self.position, "element": self.element,
                "got": self.got, "want": self.want}

    def text(self) -> str:
        """'; worst at sequence 0, position 5, element 17: got 1.5, want 1.2' (empty when none)."""
        if self.sequence is None:
            return ""
        return (f"; worst at sequence {self.sequence}, position {self.position}, element {self.element}: "
                f"got {self.got:.4g}, want {self.want:.4g}")


def limit_for(baseline: float, opts: LayerOptions, allowance: float) -> float:
    return max(opts.multiple * baseline, opts.floor, allowance)


def ratio(err: float, base: float) -> float | None:
    if base > 0:
        return err / base
    return None if err == 0 else math.inf


def row_stats(row: dict) -> dict:
    return {"error": row["error"], "baseline": row["baseline"], "limit": row["limit"], "ratio": row["ratio"]}


def near_ties(layer, margin: float) -> Tensor | None:
    """[T] bool of one traced layer: its DSA top-k boundary gap is within ``margin`` (0: exact ties)."""
    if layer.topk_gap is not None:
        return layer.topk_gap.cpu() <= margin
    return None if layer.topk_ties is None else layer.topk_ties.cpu()


def tie_masks(ref_trace, n_layer: int, margin: float = 0.0, router_margin: float | None = None) -> list[Tensor | None]:
    """Per layer, [T] bool: positions whose residual can be compared (None: all).

    Where the reference's DSA top-k boundary at (layer j, position t) is a tie, or within
    ``margin`` of one (the engine class's rounding, :data:`checks.logits.INDEXER_TIE_MARGINS`),
    a correct engine may pick the other set, so position t is not compared from layer j on,
    and the later positions that read its keys (t' > t) not from layer j + 1 on. A token whose
    MoE routing is within ``router_margin`` of choosing another expert or group (a correct
    engine may route it the other way) is not compared from layer j on; one token's expert
    reaches the others only through attention, so later positions stay compared.
    """
    masks: list[Tensor | None] = []
    bad: Tensor | None = None  # positions excluded from this layer on
    spread: Tensor | None = None  # positions excluded from the next layer on
    for i in range(n_layer):
        layer = ref_trace.layers[i]
        ties = near_ties(layer, margin)
        gap = getattr(layer, "router_gap", None)
        if router_margin is not None and gap is not None:  # the token itself, from this layer on
            flips = gap.cpu() < router_margin
            bad = flips if bad is None else bad | flips
        if spread is not None:
            bad = spread if bad is None else bad | spread
        if ties is not None and bool(ties.any()):
            ties = ties.cpu()
            bad = ties.clone() if bad is None else bad | ties
            first = int(torch.nonzero(ties)[0])
            later = torch.arange(len(ties)) > first
            spread = later if spread is None else spread | later
        masks.append(None if bad is None else ~bad)
    return masks
