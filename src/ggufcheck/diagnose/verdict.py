"""From stage results to one verdict: the first component that fails, with its evidence.

Stages arrive in dependency order; the first stage holding a FAIL decides. Inside it the
earliest layer wins (errors carry forward through the residual stream, so later layers are
symptoms), and at the same layer a specific component beats a generic one ("mla-kv-b"
before "attention", anything before "output"). ERROR results (a check that could not run)
never become the verdict; when only errors remain the verdict is inconclusive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ggufcheck.diagnose.vocabulary import CHECK_NEXT_STEPS, ORDER, component
from ggufcheck.results import Result, StageReport, Status, _jsonable

GENERIC = {"attention": 1, "output": 2}


@dataclass
class Verdict:
    healthy: bool
    component: str | None
    layer: int | None
    stage: str | None
    check: str | None
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next_steps: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def inconclusive(self) -> bool:
        return not self.healthy and self.component is None

    def to_json(self) -> dict[str, Any]:
        return _jsonable({
            "healthy": self.healthy, "component": self.component, "layer": self.layer,
            "stage": self.stage, "check": self.check, "message": self.message,
            "evidence": self.evidence, "next_steps": self.next_steps, "errors": self.errors,
        })


def _rank(r: Result) -> tuple:
    return (
        r.layer if r.layer is not None else -1,
        GENERIC.get(r.component, 0),
        ORDER.get(r.component, len(ORDER)),
    )


def decide(stages: Iterable[StageReport]) -> Verdict:
    stages = list(stages)
    errors = [f"{s.stage}/{r.check}: {r.message}" for s in stages for r in s.results if r.status == Status.ERROR]
    for stage in stages:
        fails = [r for r in stage.results if r.status == Status.FAIL]
        if not fails:
            continue
        first = min(fails, key=_rank)
        evidence = {"stats": first.stats} if first.stats else {}
        if first.worst:
            evidence["worst"] = first.worst
        if first.tensor:
            evidence["tensor"] = first.tensor
        return Verdict(
            healthy=False, component=first.component, layer=first.layer, stage=stage.stage,
            check=first.check, message=first.message, evidence=evidence,
            next_steps=CHECK_NEXT_STEPS.get(first.check) or (
                component(first.component).next_steps if first.component in ORDER else ""),
            errors=errors,
        )
    if errors:
        return Verdict(False, None, None, None, None,
                       f"inconclusive: {len(errors)} check(s) could not run", errors=errors)
    ran = sum(1 for s in stages for r in s.results if r.status == Status.PASS)
    return Verdict(True, None, None, None, None, f"healthy: {ran} checks passed, none failed")
