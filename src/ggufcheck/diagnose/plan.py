"""The ordered diagnosis: which stages run, what each eliminates, and in which order.

Each stage removes one variable before the next looks further up the stack:

1. ``environment`` + ``kernels``: the interpreter, its packages and GPU kernels (only when
   a Python path or a GPU is given): nothing after this can be trusted on a broken kernel;
2. ``file``: the GGUF itself: container, metadata, tensor mapping, dequantization health;
   ``template``: its chat template and special tokens, and the tokens the engine feeds for a
   chat request (a chat can be garbage with every logit right);
3. ``sharding``: with ``--tp N``, the shard plan, per-rank kv_b and sharded == unsharded;
4. ``weights``: the parameters the engine actually holds (per rank), when it exposes them;
5. ``layers``: per-layer comparison with the reference, then inside the first diverging
   layer: attention vs FFN/MoE on replayed inputs, router and indexer agreement;
6. ``sanity``, ``logits``, ``paths``: the served distributions, teacher-forced against the
   fp64 reference, and the execution paths (prefill vs decode, batch, chunks, lengths);
7. ``mtp``: a file with a NextN / MTP block: the engine's draft head on the states it feeds
   it, against the reference's head on the same states (a broken head only lowers the draft
   acceptance: the served output stays right);
8. ``switches``: after a served failure, the served comparison again with one engine setting
   flipped at a time (flash attention, KV cache type, GPU offload...): the setting whose flip
   makes the failure go away names the path that is wrong.

Each stage is one module in ``checks/`` whose ``run(session)`` returns its reports; the
:class:`~ggufcheck.diagnose.session.Session` opens what they share. A stage whose inputs do
not exist is SKIPPED with the reason; a stage that raises one of ggufcheck's own errors
becomes an ERROR result, except an unreachable engine, which ends the run (exit status 3).
The verdict is :func:`ggufcheck.diagnose.verdict.decide`.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ggufcheck.diagnose.session import NOT_REPLAYED, DiagnoseOptions, Progress, Session
from ggufcheck.diagnose.verdict import Verdict, decide
from ggufcheck.errors import EngineUnreachable, GGUFCheckError, Unavailable, UsageError
from ggufcheck.results import StageReport, errored, skipped

__all__ = ["PLAN", "DiagnoseOptions", "Diagnosis", "Stage", "diagnose"]


@dataclass
class Diagnosis:
    options: DiagnoseOptions
    stages: list[StageReport]
    verdict: Verdict
    engine: dict[str, Any] | None = None
    elapsed_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    resources: Any = None  # the resource plan made before the first stage (diagnose/resources.py)


@dataclass(frozen=True)
class Stage:
    name: str
    eliminates: str
    module: str  # the checks module whose ``run(session) -> list[StageReport]`` runs it
    when: Callable[[Session], str | None]  # None: runs; else the reason it is skipped
    skip_component: str

    def run(self, session: Session) -> list[StageReport]:
        return importlib.import_module(self.module).run(session)  # imported when it runs: heavy deps stay lazy


def _needs_engine(session: Session) -> str | None:
    return None if session.has_engine else "no --engine given"


# what each report of a stage that returns several eliminates (the served stage: three)
PART_ELIMINATES = {
    "sanity": "implausible served distributions: NaN, flat, input-blind, repetitive",
    "logits": "the served distributions against the fp64 reference, over every prompt length",
    "paths": "the execution paths: prefill vs decode, chunks, batches, determinism",
}

PLAN: tuple[Stage, ...] = (
    Stage("environment", "the interpreter, packages and GPU kernels", "ggufcheck.checks.environment",
          lambda s: None if (s.options.python or s.options.device is not None) else
          "no --python or --device given", "environment"),
    Stage("file", "the GGUF file, its metadata and tensor mapping", "ggufcheck.checks.file", lambda s: None,
          "gguf-file"),
    Stage("template", "the chat template and special tokens", "ggufcheck.checks.template", lambda s: None,
          "chat-template"),
    Stage("sharding", "tensor-parallel splitting", "ggufcheck.checks.sharding",
          lambda s: None if s.options.tp else "no --tp given", "sharding"),
    Stage("weights", "the engine's loaded parameters", "ggufcheck.checks.weights", _needs_engine, "weights"),
    Stage("layers", "each layer's computation", "ggufcheck.checks.layers", _needs_engine, "output"),
    Stage("served", "the served distributions and execution paths", "ggufcheck.checks.compare",
          lambda s: _needs_engine(s) or ("--layers: the served distributions need every layer (run without it)"
                                         if s.options.layers is not None else None), "output"),
    Stage("mtp", "the NextN / MTP draft head speculative decoding uses", "ggufcheck.checks.mtp",
          lambda s: importlib.import_module("ggufcheck.checks.mtp").when(s), "mtp"),
    Stage("switches", "one engine setting at a time (flash attention, KV cache type, GPU offload, ...)",
          "ggufcheck.checks.switches",
          lambda s: _needs_engine(s) or importlib.import_module("ggufcheck.checks.switches").when(s), "output"),
)


def diagnose(options: DiagnoseOptions, progress: Progress | None = None, engine: Any | None = None,
             on_plan: Callable[[Any], None] | None = None) -> Diagnosis:
    """Run every applicable stage in order and decide the verdict.

    ``engine`` may be an already open :class:`ggufcheck.engines.base.Engine` (tests and
    ``ggufcheck.testing.faults`` pass one); otherwise ``options.engine`` is opened. Before
    any stage, the resource plan (``diagnose/resources.py``) is made and given to ``on_plan``.
    """
    say = progress or (lambda _m: None)
    if engine is None and options.engine is None:
        raise UsageError("diagnose needs --engine SPEC: without an engine nothing about a deployment is checked",
                         tip="`ggufcheck inspect MODEL` checks the file alone, `ggufcheck shard MODEL --tp N` its "
                             "tensor-parallel split, `ggufcheck env --python PATH` an interpreter")
    options = one_tp_size(options, engine)
    session = Session(options, say, engine)
    stages: list[StageReport] = session.reports  # the stages so far, which a later stage may read
    timings: dict[str, float] = session.timings
    started = time.perf_counter()
    try:
        session.resources = plan_for(session, engine)
        if on_plan is not None:
            on_plan(session.resources)
        if engine is None:  # a bad spec or a missing package (exit 2) or an unreachable engine (exit 3)
            try:            # is said in seconds, before the long file stage
                session.engine()
            except Unavailable as err:  # nothing about the deployment could be checked: not a result
                raise UsageError(f"--engine {options.engine}: unavailable: {err.message}", tip=err.tip) from None
        spec = options.reference
        if spec not in ("none", "reference") and spec.split(":")[0] != "reference":
            try:  # another implementation as the reference (hf:fp32, hf-gguf, ...): its package first
                session.reference()
            except Unavailable as err:
                raise UsageError(f"--reference {spec}: unavailable: {err.message}", tip=err.tip) from None
        for number, stage in enumerate(PLAN, 1):
            say(f"stage {number}/{len(PLAN)}: {stage.name}")
            carried = session.carried(stage.name) if options.replayed else None
            if carried is not None:  # a saved run's stage that cannot be judged again: its reports as saved
                stages.extend(carried)
                continue
            reason = stage.when(session)
            if reason is None and options.replayed:
                reason = NOT_REPLAYED.get(stage.name)
            if reason is not None:
                report = StageReport(stage.name, info={"eliminates": stage.eliminates})
                report.add(skipped(stage.name, stage.skip_component, reason))
                if reason.startswith("--layers"):
                    report.info["not_checked"] = "the served distributions and execution paths (--layers)"
                stages.append(report)
                session.keep_for_replay(stage.name, [report])
                continue
            t0 = time.perf_counter()
            reports = _run(stage, session)
            timings[stage.name] = time.perf_counter() - t0
            for r in reports:
                r.info.setdefault("eliminates", PART_ELIMINATES.get(r.stage, stage.eliminates))
            stages.extend(reports)
            session.keep_for_replay(stage.name, reports)
        described = None
        if session.has_engine:
            try:
                described = session.engine().describe()
            except GGUFCheckError as err:  # the stages already recorded why it did not open
                described = {"name": session.options.engine, "error": err.message}
    finally:
        session.close()
    verdict = decide(stages)
    if session.recorder is not None:  # the saved run says what it concluded (rejudge compares)
        session.recorder.write_manifest({"verdict": verdict.to_json(), "calls": session.recorder.count,
                                         "carried": session.kept_for_replay})
    return Diagnosis(options, stages, verdict, described, time.perf_counter() - started, timings,
                     session.resources)


def engine_tp(options: DiagnoseOptions, engine: Any | None = None) -> int | None:
    """The tensor-parallel size the engine under test runs at: ``vllm[:tp=N]`` (1 by default)
    or an opened engine's ``capabilities.tp_size`` above 1; None for an engine without one."""
    if engine is not None:
        tp = int(getattr(getattr(engine, "capabilities", None), "tp_size", 1) or 1)
        return tp if tp > 1 else None
    spec = options.engine_spec
    return None if spec is None else spec.tp


def one_tp_size(options: DiagnoseOptions, engine: Any | None = None) -> DiagnoseOptions:
    """One TP size for a run: the engine's, when it has one. ``--tp`` alone checks a split of
    the file (an engine on one rank); with an engine that runs at TP N, the sharding stage
    checks that split (``--tp`` may be left out), and a ``--tp`` that disagrees is a usage
    error naming both: checking a split that is not deployed would pass silently."""
    tp = engine_tp(options, engine)
    if tp is None:
        return options
    if options.tp is None:
        return replace(options, tp=tp) if tp > 1 else options
    if options.tp != tp:
        raise UsageError(f"--tp {options.tp} disagrees with the engine's tensor-parallel size {tp} "
                         f"(--engine {options.engine or getattr(engine, 'name', 'given')}): one run checks one "
                         "deployment", tip=f"leave --tp out (the engine's {tp} is checked) or give --tp {tp}")
    return options


def plan_for(session: Session, engine: Any | None = None):
    """The resource plan of this diagnosis (None for an architecture the reference lacks),
    applied: the weight cache's budget set from it. A stage that cannot fit ends the run here
    (UsageError: exit 2), before anything is loaded."""
    from ggufcheck.diagnose.resources import Rates, cheaper_options, plan_resources, probe_host
    from ggufcheck.reference.config import config_from_gguf
    from ggufcheck.reference.weights import set_cache_budget

    model = session.open_model()
    try:
        cfg = config_from_gguf(model.metadata, model.tensors, str(model.path))
    except GGUFCheckError:
        return None  # no reference for this architecture: the stages say so
    o = session.options
    if o.layers is not None and max(o.layers) >= cfg.n_layer:
        raise UsageError(f"--layers {max(o.layers)}: {o.model.name} has layers 0..{cfg.n_layer - 1}")
    if o.experts is not None and not cfg.n_expert:
        raise UsageError(f"--experts: {o.model.name} is a dense model (its metadata names no routed experts)")
    if o.experts is not None and max(o.experts) >= cfg.n_expert:
        raise UsageError(f"--experts {max(o.experts)}: {o.model.name} has experts 0..{cfg.n_expert - 1} per MoE layer")
    host = probe_host(with_gpus=o.reference_device != "cpu")
    device = o.reference_device if o.reference_device not in ("auto", "cpu") else "cpu"
    spec = None if engine is not None else o.engine_spec
    plan = plan_resources(o, model, cfg, host, Rates.calibrate(model, device), spec, o.max_memory)
    if plan.refusal:
        raise UsageError(f"{o.model.name}: {plan.refusal}", tip=f"cheaper: {cheaper_options(plan)}")
    set_cache_budget(plan.cache_budget, compact=plan.compact)
    return plan


def _run(stage: Stage, session: Session) -> list[StageReport]:
    """One stage's reports; its failures to run become SKIP / ERROR results of that stage."""
    try:
        return stage.run(session)
    except (EngineUnreachable, UsageError):
        raise  # an unreachable engine (exit 3) or a bad --engine / option (exit 2) ends the run
    except Unavailable as err:
        report = StageReport(stage.name)
        report.add(skipped(stage.name, stage.skip_component, f"unavailable: {err.message}"))
    except GGUFCheckError as err:
        if stage.name == "file":
            raise  # an unreadable model file ends the diagnosis (exit 2)
        report = StageReport(stage.name)
        report.add(errored(stage.name, stage.skip_component, err.message))
    except Exception as err:  # a defect in a stage must not hide the other stages' evidence
        if os.environ.get("GGUFCHECK_DEBUG"):
            raise
        report = StageReport(stage.name)
        report.add(errored(stage.name, stage.skip_component,
                           f"internal error in the {stage.name} stage: {type(err).__name__}: {err}"))
    return [report]
