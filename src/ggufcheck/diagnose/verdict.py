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
    warnings: list[str] = field(default_factory=list)  # WARN results: never the verdict, always shown
    # nothing failed, but no stage compared the deployment with a reference (layers, logits):
    # never "healthy"; ``message`` says what ran and why the rest could not
    unverified: bool = False

    @property
    def inconclusive(self) -> bool:
        return not self.healthy and self.component is None and not self.unverified

    def to_json(self) -> dict[str, Any]:
        return _jsonable({
            "healthy": self.healthy, "component": self.component, "layer": self.layer,
            "stage": self.stage, "check": self.check, "message": self.message,
            "evidence": self.evidence, "next_steps": self.next_steps, "errors": self.errors,
            "warnings": self.warnings, "unverified": self.unverified,
        })


def _rank(r: Result) -> tuple:
    return (
        r.layer if r.layer is not None else -1,
        GENERIC.get(r.component, 0),
        ORDER.get(r.component, len(ORDER)),
    )


def decide(stages: Iterable[StageReport]) -> Verdict:
    stages = list(stages)
    warnings = [f"{s.stage}/{r.check}: {r.message}" for s in stages for r in s.results if r.status == Status.WARN]
    verdict = _decide(stages)
    verdict.warnings = warnings
    flips = [r for s in stages if s.stage == "switches" for r in s.results if r.status == Status.FAIL]
    if flips and not verdict.healthy and verdict.stage != "switches":  # the setting that makes it go away
        verdict.message += "; " + flips[0].message
        verdict.evidence["switch"] = {"check": flips[0].check, "component": flips[0].component,
                                      "stats": flips[0].stats}
        flip = (flips[0].stats or {}).get("flip") or {}
        setting = ",".join(f"{k}={v}" for k, v in flip.items())
        verdict.next_steps = (f"run with {setting} until the path it avoids is fixed, and report that path with this "
                              "evidence; " + verdict.next_steps).rstrip("; ")
    if verdict.healthy and warnings:
        verdict.message += f" ({len(warnings)} warning{'s' if len(warnings) > 1 else ''}: read them before trusting it)"
    return verdict


def _decide(stages: list[StageReport]) -> Verdict:
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
    engine_stages = [s for s in stages if s.stage in ENGINE_STAGES]
    judged = [s for s in stages if s.stage in JUDGING_STAGES and any(r.status == Status.PASS for r in s.results)]
    if engine_stages and not judged:
        why = "; ".join(f"{s.stage}: {_skip_reason(s)}" for s in stages if s.stage in JUDGING_STAGES)
        checked = ", ".join(f"{s.stage} {sum(r.status == Status.PASS for r in s.results)}" for s in stages
                            if any(r.status == Status.PASS for r in s.results))
        return Verdict(False, None, None, None, None,
                       f"not verified: nothing failed ({ran} checks passed: {checked or 'none'}), but no stage "
                       f"compared the deployment with a reference ({why or 'the layers and logits stages did not run'})",
                       next_steps="give the engine's architecture a reference (see docs/verdicts.md) or check "
                                  "what the skipped stages need", unverified=True)
    unchecked = [f"{s.stage}: {s.info['not_checked']}" for s in stages if s.info.get("not_checked")]
    if unchecked:  # --layers: healthy as far as it looked, and it says how far that was
        return Verdict(True, None, None, None, None,
                       f"healthy in what was checked: {ran} checks passed, none failed; not checked: "
                       + "; ".join(unchecked))
    return Verdict(True, None, None, None, None, f"healthy: {ran} checks passed, none failed")


# stages that talk to the engine, and those of them that compare its output with a reference:
# with engine stages present, "healthy" needs at least one judging stage that passed checks
ENGINE_STAGES = ("weights", "layers", "sanity", "logits", "paths")
JUDGING_STAGES = ("layers", "logits")


def _skip_reason(stage: StageReport) -> str:
    skips = [r.message for r in stage.results if r.status == Status.SKIP]
    return skips[0] if skips else "no checks ran"
