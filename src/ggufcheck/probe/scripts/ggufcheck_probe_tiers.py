"""The three tiers every kernel case goes through: imports, runs, agrees with fp64.

Standard library at import time; torch is imported inside the functions (this file runs in
the target interpreter, and the host's tests import it to inject fake kernels).

1. imports: ``case.load()`` returns the kernel from the exact module path the engine uses.
   Not installed -> SKIP; installed but raising -> FAIL (tier "imports").
2. runs: the output buffer is poisoned with NaN first (``out=`` kernels get the poisoned
   buffer; kernels that allocate their own output on CUDA get blocks of the caching
   allocator filled with NaN just before, best effort). If NaN remains, a second run with a
   finite sentinel tells never-written elements (sentinel and NaN at the same place) from
   NaN the kernel computed. A raise, or any unwritten element -> FAIL (tier "runs"). A
   kernel that declines the shape or dtype up front (:class:`Unsupported`, e.g. SDPA's "No
   available kernel") -> SKIP with its reason: a capability, not a fault.
3. agrees: relative L2 error against an fp64 reference computed from the same (already
   rounded) inputs, within ``tol = multiple * baseline + floor``: ``baseline`` is the
   relative L2 error of an honest low-precision run of the same math (stated per case),
   ``multiple`` 3 and ``floor`` the unit roundoff of the output dtype unless the case says
   otherwise. NaN/Inf where the reference is finite always fails.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8,
                 "float16": 2.0 ** -11}
BASELINE_MULTIPLE = 3.0
SENTINEL = -1234.5  # exactly representable in fp16, bf16 and fp32
INT_POISON = -7


class Unsupported(Exception):
    """The kernel declines this shape/dtype/device before computing: a capability answer."""


class NotInstalled(Exception):
    """The package that provides the kernel is not installed in the target interpreter."""


@dataclass
class KernelCase:
    """One kernel at one shape and dtype; the callables are the tiers' hooks."""

    id: str
    kind: str
    dtype: str
    device: str
    load: Callable[[], Any]
    prepare: Callable[[], dict]
    execute: Callable[[Any, dict, Any], Any]  # (kernel, inputs, out) -> output, or None = out
    reference: Callable[[dict], Any]  # fp64 truth
    out_spec: Callable[[dict], tuple] | None = None  # (shape, torch dtype) of the output
    baseline: Callable[[dict], Any] | None = None  # the same math, honest low precision
    baseline_doc: str = "output of the fp64 reference rounded to the dtype"
    compare: Callable[..., tuple[bool, dict, str]] | None = None  # custom agreement
    multiple: float = BASELINE_MULTIPLE
    floor: float | None = None
    info: dict = field(default_factory=dict)


def exception_text(exc: BaseException, limit: int = 500) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rel_l2(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64 (0/0 -> 0)."""
    import torch

    x = x.to(torch.float64)
    ref = ref.to(torch.float64)
    num = torch.linalg.vector_norm((x - ref).flatten()).item()
    den = torch.linalg.vector_norm(ref.flatten()).item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def run_case(case: KernelCase, time_it: bool = False) -> dict:
    """Run the three tiers; returns a JSON-able result with status, tier and stats."""
    base = {"case": case.id, "kind": case.kind, "dtype": case.dtype, "device": case.device,
            **case.info}
    tiers: dict[str, str] = {}

    def finish(status: str, tier: str, message: str, **stats: Any) -> dict:
        tiers[tier] = status
        return {**base, "type": "result", "status": status, "tier": tier, "message": message,
                "stats": {"tiers": dict(tiers), **stats}}

    try:
        kernel = case.load()
    except NotInstalled as exc:
        return finish("SKIP", "imports", f"not installed: {exc}")
    except Unsupported as exc:
        return finish("SKIP", "imports", f"unavailable here: {exc}")
    except BaseException as exc:  # noqa: BLE001 - an import may raise anything
        return finish("FAIL", "imports", f"import failed: {exception_text(exc)}")
    tiers["imports"] = "PASS"
    try:
        inputs = case.prepare()
    except Exception as exc:  # noqa: BLE001 - our own input building failed
        return finish("ERROR", "runs", f"could not build inputs: {exception_text(exc)}")
    try:
        out, unwritten, total, computed_nan = _run_poisoned(case, kernel, inputs)
    except Unsupported as exc:
        return finish("SKIP", "runs", f"kernel declines this case: {exc}")
    except Exception as exc:  # noqa: BLE001 - a kernel failure is the finding
        return finish("FAIL", "runs", f"raised: {exception_text(exc)}")
    if unwritten:
        return finish("FAIL", "runs", f"{unwritten} of {total} output elements never written "
                      "(poison remains after the kernel returned)", unwritten=unwritten)
    tiers["runs"] = "PASS"
    stats: dict[str, Any] = {}
    if time_it:
        try:
            stats["ms"] = _time(case, kernel, inputs)
        except Exception as exc:  # noqa: BLE001
            stats["timing_error"] = exception_text(exc)
    try:
        ref = case.reference(inputs)
    except Exception as exc:  # noqa: BLE001
        return finish("ERROR", "agrees", f"fp64 reference failed: {exception_text(exc)}", **stats)
    if case.compare is not None:
        ok, more, message = case.compare(out, ref, inputs, case)
        stats.update(more)
        return finish("PASS" if ok else "FAIL", "agrees", message, **stats)
    return _agree(case, out, ref, inputs, computed_nan, finish, stats)


def _agree(case, out, ref, inputs, computed_nan, finish, stats) -> dict:
    import torch

    ref = ref.to(torch.float64)
    finite_ref = torch.isfinite(ref)
    bad = (~torch.isfinite(out.to(torch.float64))) & finite_ref
    if bad.any():
        return finish("FAIL", "agrees", f"{int(bad.sum())} NaN/Inf output elements where the "
                      f"fp64 reference is finite", nonfinite=int(bad.sum()), **stats)
    err = rel_l2(out, ref)
    diff = (out.to(torch.float64) - ref).abs()
    worst = int(diff.flatten().argmax()) if diff.numel() else 0
    baseline_doc = case.baseline_doc if case.baseline else "none (floor only)"
    note = ""
    base_err = 0.0
    if case.baseline:
        low = case.baseline(inputs).to(torch.float64)
        overflow = (~torch.isfinite(low)) & finite_ref
        if overflow.any():
            # the plain low-precision math overflows on these inputs (fp16 scores of real
            # MLA activations, say): no error to scale; fall back to output rounding, and say so
            stats["baseline_nonfinite"] = int(overflow.sum())
            note = (f"; the plain {case.dtype} baseline overflows here ({int(overflow.sum())} "
                    "non-finite values), so the tolerance uses output rounding instead")
            baseline_doc = "fp64 reference rounded to the dtype (the stated baseline overflowed)"
            base_err = rel_l2(ref.to(out.dtype), ref)
        else:
            base_err = rel_l2(low, ref)
    floor = case.floor if case.floor is not None else UNIT_ROUNDOFF.get(case.dtype, 0.0)
    tol = case.multiple * base_err + floor
    stats.update(rel_l2=err, max_abs=float(diff.max()) if diff.numel() else 0.0,
                 baseline_rel_l2=base_err, tol=tol, multiple=case.multiple, floor=floor,
                 baseline=baseline_doc,
                 worst={"index": worst, "got": float(out.flatten()[worst]),
                        "want": float(ref.flatten()[worst])})
    verdict = f"rel L2 err {err:.3g} vs fp64, tol {tol:.3g} = {case.multiple:g} x baseline " \
              f"{base_err:.3g} + floor {floor:.3g}{note}"
    if err <= tol:
        return finish("PASS", "agrees", verdict, **stats)
    return finish("FAIL", "agrees", "disagrees with fp64: " + verdict, **stats)


def _poisoned(case, inputs, value):
    import torch

    if case.out_spec is None:
        return None
    shape, dtype = case.out_spec(inputs)
    if dtype.is_floating_point:
        return torch.full(shape, value, dtype=dtype, device=case.device)
    return torch.full(shape, INT_POISON, dtype=dtype, device=case.device)


def _poison_allocator(case, inputs, value) -> None:
    """Fill freed CUDA caching-allocator blocks of the output's size, so a kernel that
    allocates its own output (and leaves part of it unwritten) shows the poison."""
    import torch

    if case.out_spec is None or not str(case.device).startswith("cuda"):
        return
    shape, dtype = case.out_spec(inputs)
    fill = value if dtype.is_floating_point else INT_POISON
    blocks = [torch.full(shape, fill, dtype=dtype, device=case.device) for _ in range(4)]
    del blocks


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _call(case, kernel, inputs, value):
    out = _poisoned(case, inputs, value)
    _poison_allocator(case, inputs, value)
    y = case.execute(kernel, inputs, out)
    _sync(case.device)
    return out if y is None else y


def _run_poisoned(case, kernel, inputs):
    """Output, number of never-written elements, total, whether NaN was computed."""
    import torch

    y = _call(case, kernel, inputs, math.nan)
    total = y.numel()
    if not y.dtype.is_floating_point:
        return y, int((y == INT_POISON).sum()), total, False
    nan1 = torch.isnan(y)
    if not nan1.any():
        return y, 0, total, False
    y2 = _call(case, kernel, inputs, SENTINEL)
    unwritten = int((nan1 & (y2 == SENTINEL)).sum())
    return y, unwritten, total, bool((nan1 & (y2 != SENTINEL)).any())


def _time(case, kernel, inputs, reps: int = 20) -> float:
    """Median milliseconds of one call (CUDA events on GPU, perf_counter on CPU)."""
    import torch

    out = _poisoned(case, inputs, 0.0)
    for _ in range(3):
        case.execute(kernel, inputs, out)
    _sync(case.device)
    times = []
    if str(case.device).startswith("cuda"):
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            case.execute(kernel, inputs, out)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    else:
        for _ in range(min(reps, 5)):
            t0 = time.perf_counter()
            case.execute(kernel, inputs, out)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def topk_compare(margin_of: Callable[[Any, Any, dict], float]):
    """Agreement for selections: every index chosen that fp64 did not choose must be a near
    tie (its fp64 score within ``margin`` of the fp64 k-th score); ``margin_of(out, ref,
    inputs)`` derives the margin from an honest baseline."""

    def compare(out, ref, inputs, case):
        import torch

        idx, scores64, k = out, ref, inputs["k"]
        ref_vals, ref_idx = scores64.topk(k, dim=-1)
        kth = ref_vals[..., -1:]
        valid = torch.isfinite(kth).squeeze(-1)
        got = scores64.gather(-1, idx.clamp(0, scores64.shape[-1] - 1).long())
        chosen_ref = torch.zeros_like(scores64, dtype=torch.bool).scatter_(-1, ref_idx, True)
        in_ref = chosen_ref.gather(-1, idx.long())
        margin = margin_of(out, ref, inputs)
        finite_got = torch.isfinite(got)
        near_tie = finite_got & (got >= kth - margin)
        swaps = (~in_ref) & valid.unsqueeze(-1) & finite_got
        hard = swaps & ~near_tie
        dup = _duplicates(idx)
        stats = {"rows": int(valid.sum()), "k": k, "margin": margin,
                 "swapped": int(swaps.sum()), "near_tie_swaps": int((swaps & near_tie).sum()),
                 "hard_mismatches": int(hard.sum()), "duplicate_indices": dup,
                 "overlap": 1.0 - float(swaps.sum()) / max(1, int(valid.sum()) * k)}
        if hard.any() or dup:
            return False, stats, (f"selection differs from fp64: {int(hard.sum())} chosen indices "
                                  f"score below the fp64 k-th by more than margin {margin:.3g}"
                                  + (f"; {dup} duplicate indices" if dup else ""))
        return True, stats, (f"same top-{k} as fp64 in {stats['rows']} rows "
                             f"({int((swaps & near_tie).sum())} near-tie swaps within margin "
                             f"{margin:.3g})")

    return compare


def _duplicates(idx) -> int:
    s, _ = idx.sort(dim=-1)
    return int((s[..., 1:] == s[..., :-1]).sum()) if s.shape[-1] > 1 else 0
