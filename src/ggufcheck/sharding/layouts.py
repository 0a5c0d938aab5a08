"""Known wrong layouts, tried by name when a loaded parameter is not its expected slice.

"values differ (max |diff| 0.8)" says that a loader is wrong, not which line of it. The ways
loaders have been wrong recur (docs/fault-catalog.md, issue threads): another rank's slice,
the GGUF's rope-permuted q/k rows, kv_b's K and V rows swapped inside each head or rebuilt
as [all K ; all V] and cut contiguously, gate and up swapped in a fused weight (or two
parameters swapped by name), a transposed matrix, rows in another order, a parameter never
loaded (zeros, ones), a norm's (1 + w) convention applied twice or not at all, a constant
scale folded in. Each layout is a function of the expected full tensor (then cut for the
rank by the parameter's own rule) or of the expected slice; the first one the engine holds
names the fault. They run only on a parameter that already failed, so a healthy audit pays
nothing for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ggufcheck.sharding.rules import shard

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.arch.spec import ArchSpec
    from ggufcheck.sharding.weights import HFParam

Named = tuple[str, str, dict]  # (message, component, stats), as diagnose_slice answers
Close = Callable[[Tensor, Tensor], tuple[bool, float]]


@dataclass(frozen=True)
class FullLayout:
    """A wrong arrangement of the whole tensor, cut for the rank like the right one."""

    name: str
    says: str
    component: str | None  # None: the parameter's own component
    build: Callable[[Tensor, "HFParam", "ArchSpec | None", int], Tensor | None]  # (full, param, spec, tp)


def _kv_b_parts(full: Tensor, spec: "ArchSpec | None") -> tuple[Tensor, Tensor] | None:
    from ggufcheck.arch.transforms import split_kv_b

    if spec is None or spec.mla is None or full.dim() != 2:
        return None
    per_head = spec.mla.qk_nope + spec.mla.v_head
    if full.shape[0] % per_head:
        return None
    return split_kv_b(full, full.shape[0] // per_head, spec.mla.qk_nope, spec.mla.v_head)


def _kv_b(param: "HFParam") -> bool:
    return param.group.transform == "kv_b"


def _kv_b_rows(rebuild_name: str):
    def build(full, param, spec, tp):
        from ggufcheck.sharding import faults

        parts = _kv_b_parts(full, spec) if _kv_b(param) else None
        return None if parts is None else getattr(faults, rebuild_name)(*parts)
    return build


def _kv_b_effective(layout_name: str):
    """The kv_b a rank computes with when its loader uses ``layout_name`` (what an engine that
    hands over its effective W_UK / W_UV, rebuilt into kv_b's layout, holds)."""
    def build(full, param, spec, tp):
        from ggufcheck.arch.transforms import kv_b_from_split
        from ggufcheck.sharding import faults

        parts = _kv_b_parts(full, spec) if _kv_b(param) else None
        if parts is None or parts[0].shape[0] % tp:
            return None
        return kv_b_from_split(*faults.effective_k_b_v_b(*parts, tp, getattr(faults, layout_name)))
    return build


def _gate_up_swapped(full, param, spec, tp):
    t = param.group.transform
    if t == "fuse_gate_up" and full.dim() == 3 and full.shape[1] % 2 == 0:  # [E, 2Fe, D]: gate half, up half
        gate, up = full.chunk(2, dim=1)
        return torch.cat((up, gate), dim=1)
    if t in ("oai_gate_up", "oai_gate_up_bias") and full.shape[-1] % 2 == 0:  # interleaved, gate at even
        out = torch.empty_like(full)
        out[..., 0::2], out[..., 1::2] = full[..., 1::2], full[..., 0::2]
        return out
    return None


def row_order(transform: str, spec: "ArchSpec", n_rows: int) -> Tensor:
    """For a transform that only reorders rows: the stored row each HF row comes from."""
    from ggufcheck.arch.transforms import TRANSFORMS

    index = torch.arange(n_rows, dtype=torch.float64)[:, None]
    return TRANSFORMS[transform].to_hf({"w": index}, spec, "w")["w"][:, 0].long()


def _rope_permuted(full, param, spec, tp):
    if spec is None or param.group.transform not in ("llama_q", "llama_k"):
        return None
    return full[torch.argsort(row_order(param.group.transform, spec, full.shape[0]))]


FULL_LAYOUTS: tuple[FullLayout, ...] = (
    FullLayout("rope-permuted", "rows are in the GGUF's rope-permuted order: the loader did not undo llama.cpp's "
               "q/k permutation, so NEOX rope pairs the wrong dimensions", "rope", _rope_permuted),
    FullLayout("kv-b-v-before-k", "kv_b holds each head's V rows before its K rows (read as [K_h ; V_h]): the "
               "keys are projected with value rows", None, _kv_b_rows("rebuild_v_then_k")),
    FullLayout("kv-b-v-before-k", "kv_b computes with each head's V rows before its K rows, split as "
               "[K_h ; V_h]", None, _kv_b_effective("KV_B_V_THEN_K")),
    FullLayout("kv-b-all-k-then-v", "kv_b rebuilt as [all K ; all V] (every head's key rows, then every head's "
               "value rows) and cut into contiguous rows per rank (fault catalog #21: right at TP 1 only with a "
               "split patched to w[:H*P], w[H*P:]; wrong at TP > 1)", None, _kv_b_rows("rebuild_all_k_then_v")),
    FullLayout("kv-b-all-k-then-v", "kv_b computes with [all K ; all V] rows split as w[:Hl*P], w[Hl*P:] on each "
               "rank: exact at TP 1, wrong at TP > 1 (fault catalog #21)", None,
               _kv_b_effective("KV_B_ALL_K_THEN_V")),
    FullLayout("gate-up-swapped", "gate and up are swapped in the fused gate_up weight (the activation is applied "
               "to the up projection)", None, _gate_up_swapped),
)


def name_layout(got: Tensor, want: Tensor, full: Tensor, param: "HFParam", rank: int, tp: int, n_kv: int,
                spec: "ArchSpec | None", close: Close) -> Named | None:
    """The known wrong layout ``got`` (rank ``rank``'s loaded value, same shape as ``want``,
    not close to it) holds, or None. ``close(got, x)``: the audit's closeness test."""
    component = param.component
    named = _uninitialized(got, want)
    if named is not None:
        return named[0], component, named[1]
    for other in range(tp):  # someone else's slice?
        if other != rank and close(got, shard(full, param.rule, other, tp, n_kv))[0]:
            return (f"holds rank {other}'s slice instead of its own (a loader ignoring the rank)",
                    "sharding" if component in ("weights", "moe-experts") else component,
                    {"holds_rank": other, "layout": "another-rank"})
    for layout in FULL_LAYOUTS:
        wrong = layout.build(full, param, spec, tp)
        if wrong is None or tuple(wrong.shape) != tuple(full.shape):
            continue
        theirs = shard(wrong, param.rule, rank, tp, n_kv)
        if tuple(theirs.shape) == tuple(got.shape) and close(got, theirs)[0]:
            return layout.says, layout.component or component, {"layout": layout.name}
    for name, says, value, stats in _elementwise(got, want):
        if close(got, value)[0]:
            return says, component, {"layout": name, **stats}
    moved = _rows_permuted(got, want, close)
    if moved is not None:
        return moved[0], component, {"layout": "rows-permuted", **moved[1]}
    if got.dim() == 2 and got.shape[0] == got.shape[1] and close(got, want.T)[0]:
        return _TRANSPOSED, component, {"layout": "transposed"}
    return None


def name_reshaped(got: Tensor, want: Tensor, close: Close) -> tuple[str, dict] | None:
    """For ``got`` of another shape than ``want``: the transposed matrix, or None."""
    if got.dim() == 2 and tuple(got.shape) == tuple(want.shape[::-1]) and close(got.T, want)[0]:
        return _TRANSPOSED, {"layout": "transposed"}
    return None


_TRANSPOSED = "holds the transpose ([in, out] instead of [out, in]: a loader that did not transpose, or did twice)"


def _uninitialized(got: Tensor, want: Tensor) -> tuple[str, dict] | None:
    """A parameter the loader never wrote: all zeros, or all ones (a norm's initial value)."""
    if not got.numel():
        return None
    for value, what in ((0.0, "zeros"), (1.0, "ones")):
        if bool((got == value).all()) and not bool((want.to(got.device) == value).all()):
            return (f"holds only {what}: never loaded (left at its initial value; the checkpoint key was not "
                    "matched)", {"layout": f"all-{what}"})
    return None


def _elementwise(got: Tensor, want: Tensor):
    """(name, message, expected value under that fault, stats) for faults that change every element
    alike (computed in fp64: the engine's one rounding of it is what the closeness test allows)."""
    want = want.to(torch.float64)
    yield ("plus-one", "is the expected value + 1 everywhere: a (1 + w) norm convention applied on top of a weight "
                       "that already holds it (Gemma's GGUF norms are stored as 1 + w)", want + 1, {})
    yield ("minus-one", "is the expected value - 1 everywhere: the (1 + w) norm convention's 1 removed from a "
                        "weight that needed it", want - 1, {})
    w = want.to(got.device)
    norm = float((w * w).sum())
    if norm > 0:  # the least-squares scale of got on want: a factor folded in at load time
        s = float((got.to(torch.float64) * w).sum()) / norm
        if s == s and abs(s - 1) > 1e-3 and s != 0:
            yield ("scaled", f"is the expected value times {s:.6g} everywhere: a constant folded into the weight at "
                             "load (a scaling factor applied twice, or a dequantization scale)", want * s, {"scale": s})


def _rows_permuted(got: Tensor, want: Tensor, close: Close) -> tuple[str, dict] | None:
    """``got``'s rows are ``want``'s in another order: which moved, and the pattern if known."""
    if got.dim() < 2 or got.shape[0] < 2:
        return None
    g = got.reshape(got.shape[0], -1).to(torch.float64)
    w = want.to(g.device).reshape(want.shape[0], -1).to(torch.float64)
    probe = torch.randn(g.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(g.device)
    order = torch.empty(g.shape[0], dtype=torch.long, device=g.device)
    order[torch.argsort(g @ probe)] = torch.argsort(w @ probe)  # got row i ~ want row order[i]
    n = g.shape[0]
    identity = torch.arange(n, device=g.device)
    if bool((order == identity).all()) or not close(got, want.to(got.device)[order])[0]:
        return None
    moved = int((order != identity).sum())
    first = int(torch.nonzero(order != identity)[0])
    if bool((order == identity.flip(0)).all()):
        pattern = "in reverse order"
    elif n % 2 == 0 and bool((order == torch.roll(identity, n // 2)).all()):
        pattern = "with its two halves swapped"
    else:
        pattern = f"in another order ({moved} of {n} rows moved; row {first} holds row {int(order[first])})"
    return f"holds the expected rows {pattern}", {"rows_moved": moved, "first_moved_row": first}


SWAPS = (("gate_proj", "up_proj"), ("w1", "w3"), ("k_proj", "v_proj"))


def swap_partners(name: str) -> list[str]:
    """The parameters a loader mixing up names might have put in ``name`` (gate <-> up, K <-> V)."""
    out = []
    for a, b in SWAPS:
        for x, y in ((a, b), (b, a)):
            if f".{x}." in name or name.endswith(f".{x}"):
                out.append(name.replace(f".{x}", f".{y}"))
    return out
