"""The switch stage: the served comparison again, with one engine setting flipped at a time.

In public bug threads about engines serving garbage, the most common way the cause was found
is flipping one setting and watching the output change: flash attention off, an F16 KV cache,
the GPU offload off, CUDA graphs off, prefix caching off, TP 1. This stage does that for the
user. Each engine declares the settings it is running with that have a safe value
(``Capabilities.switches``, e.g. llama.cpp's ``flash_attn=1`` -> ``flash_attn=0``); for each, the
engine is reopened with that one setting flipped (``EngineSpec.with_settings``) and the served
comparison (``checks.compare.serve``: the same prompts, reference and limits, and a baseline run
of the flipped engine's own class) runs again. The stage then says, per setting:

- FAIL "healthy with flash_attn=0: what goes wrong is in the flash-attention path" when every served
  check that failed passes with the flip (the component is the setting's: ``Switch.component``);
- PASS "flipping it changes nothing" (still failing: that path is not the cause) or "it fixes
  some checks" (a partial lead, with the checks named);
- WARN on a healthy run (``--switches always``) whose flipped setting fails: the engine's other
  path is broken, not this deployment;
- SKIP for a setting not flipped: the time budget (``--switch-budget``, estimated from the
  served stage's own time: each flip may restart the engine) or an engine that would not open.

It runs when the served stage failed (``--switches auto``), always (``always``) or never.
An engine passed as an object rather than a spec (tests, fault engines) cannot be reopened.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ggufcheck.results import Result, StageReport, Status, failed, passed, skipped, warned

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.diagnose.session import Session

SERVED = ("sanity", "logits", "paths")


def _few(checks: list[str], n: int = 3) -> str:
    """At most ``n`` check names, and how many more."""
    more = len(checks) - n
    return ", ".join(checks[:n]) + (f" and {more} more" if more > 0 else "")


def failing_served(reports: list[StageReport]) -> list[str]:
    """The served checks that failed in ``reports``."""
    return [r.check for s in reports if s.stage in SERVED for r in s.results if r.status == Status.FAIL]


def when(session: "Session") -> str | None:
    """None when the stage runs; else why it does not."""
    mode = session.options.switches
    if mode == "never":
        return "--switches never"
    if session.options.engine_spec is None or not session._owns_engine:
        return "the engine was given as an object, not a --engine spec: it cannot be reopened with a setting flipped"
    if mode == "auto" and not failing_served(session.reports):
        return "every served check passed (--switches always flips the settings anyway)"
    return None


def run(session: "Session") -> list[StageReport]:
    from ggufcheck.checks.compare import serve
    from ggufcheck.errors import GGUFCheckError

    report = StageReport("switches")
    failing = failing_served(session.reports)
    spec = session.options.engine_spec
    switches = tuple(session.engine().capabilities.switches)
    report.info.update(failing=failing, engine=spec.text,
                       settings=[{"flip": s.name, "from": dict(s.current), "what": s.what} for s in switches])
    if not switches:
        report.add(skipped("switches", "output", f"{spec.text} declares no setting to flip (Capabilities.switches)"))
        return [report]
    served_s = float(session.timings.get("served", 0.0))
    budget = float(session.options.switch_budget)
    started = time.perf_counter()
    for switch in switches:
        check = f"switches.{switch.name}"
        spent = time.perf_counter() - started
        if spent + served_s > budget:
            report.add(skipped(check, switch.component,
                               f"not flipped: the time budget ({budget:.0f} s; each flip reruns the served "
                               f"comparison, ~{served_s:.0f} s) is spent"))
            continue
        flipped = spec.with_settings(dict(switch.safe))
        session.say(f"switches: the served comparison again with {switch.name} ({flipped.text})")
        engine = baseline = None
        try:
            engine = session.open_engine(flipped)
            baseline = session.baseline_for(engine)
            stages = serve(session, engine, baseline)
        except GGUFCheckError as err:
            report.add(skipped(check, switch.component, f"not flipped: {flipped.text} did not run ({err.message})"))
            continue
        finally:
            for opened in (baseline, engine):
                if opened is not None:
                    opened.close()
        report.add(judge(switch, failing, stages))
    report.info["seconds"] = round(time.perf_counter() - started, 1)
    return [report]


def judge(switch, failing: list[str], stages: list[StageReport]) -> Result:
    """One flip's result: does the failure go away with ``switch`` set to its safe value?"""
    check = f"switches.{switch.name}"
    results = {r.check: r for s in stages for r in s.results}
    now_failing = [r.check for s in stages if s.stage in SERVED for r in s.results if r.status == Status.FAIL]
    fixed = [c for c in failing if c in results and results[c].status == Status.PASS]
    was = ", ".join(f"{k}={v}" for k, v in switch.current.items())
    stats = {"flip": dict(switch.safe), "from": dict(switch.current), "fixed": fixed, "still_failing": now_failing}
    if failing and not now_failing:
        return failed(check, switch.component,
                      f"healthy with {switch.name} (it was {was}): what goes wrong is in {switch.what}; every served check "
                      f"that failed ({_few(failing)}) passes with this one setting flipped", stats=stats)
    if not failing:
        if now_failing:  # healthy as deployed; the other path is broken (a warning: not this deployment's fault)
            return warned(check, switch.component,
                          f"healthy as run ({was}), but not with {switch.name}: {_few(now_failing)} fail there, "
                          f"so the path that setting selects is wrong in this engine", stats=stats)
        return passed(check, switch.component, f"healthy with {switch.name} too", stats=stats)
    if fixed:
        return passed(check, switch.component,
                      f"with {switch.name}, {_few(fixed)} pass but {_few(now_failing)} still fail: "
                      f"part of the failure at most is in {switch.what}", stats=stats)
    return passed(check, switch.component,
                  f"flipping {switch.name} changes nothing: {_few(now_failing)} still fail, so the cause is not in "
                  f"{switch.what}", stats=stats)
