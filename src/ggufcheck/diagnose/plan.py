"""The ordered diagnosis: which stages run, what each eliminates, and in which order.

Each stage removes one variable before the next looks further up the stack:

1. ``environment`` + ``kernels``: the interpreter, its packages and GPU kernels (only when
   a Python path or a GPU is given): nothing after this can be trusted on a broken kernel;
2. ``file``: the GGUF itself: container, metadata, tensor mapping, dequantization health;
3. ``sharding``: with ``--tp N``, the shard plan, per-rank kv_b and sharded == unsharded;
4. ``weights``: the parameters the engine actually holds (per rank), when it exposes them;
5. ``layers``: per-layer comparison with the reference, then inside the first diverging
   layer: attention vs FFN/MoE on replayed inputs, router and indexer agreement;
6. ``sanity``, ``logits``, ``paths``: the served distributions, teacher-forced against the
   fp64 reference, and the execution paths (prefill vs decode, batch, chunks).

A stage whose inputs do not exist is SKIPPED with the reason; a stage that raises one of
ggufcheck's own errors becomes an ERROR result, except an unreachable engine, which ends
the run (exit status 3). The verdict is :func:`ggufcheck.diagnose.verdict.decide`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ggufcheck.diagnose.verdict import Verdict, decide
from ggufcheck.errors import EngineUnreachable, GGUFCheckError, Unavailable, UsageError
from ggufcheck.results import StageReport, errored, skipped

Progress = Callable[[str], None]


@dataclass(frozen=True)
class DiagnoseOptions:
    """Everything ``ggufcheck diagnose`` was asked; built once by the CLI (or a caller)."""

    model: Path
    engine: str | None = None  # an --engine SPEC (see ggufcheck.engines.spec)
    python: str | None = None  # target interpreter for the environment / kernels stages
    device: int | None = None  # GPU index for the probes
    tp: int | None = None
    prompts: Path | None = None
    max_prompts: int | None = 4
    max_tokens: int = 96
    new_tokens: int = 6
    decode_to: int = 272  # the first prompt is decoded to this position (0: new_tokens only)
    sweep_to: int = 520  # prefill length sweep up to this many tokens (0: none; checks.lengths)
    health: bool = True
    kernels: bool = True
    sanity: bool = True  # off for random-weight test models, whose output is near-flat by nature
    shard_numeric: bool = True
    baseline: str = "reference:fp32"
    top_k: int = 20  # top-k requested from engines without full logits (HTTP servers)
    timeout: float = 60.0  # HTTP engines: seconds per request
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Diagnosis:
    options: DiagnoseOptions
    stages: list[StageReport]
    verdict: Verdict
    engine: dict[str, Any] | None = None
    elapsed_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


class _Context:
    """Lazily opened inputs shared by the stages (the model, engines, prompt tokens)."""

    def __init__(self, options: DiagnoseOptions, say: Progress, engine: Any | None = None):
        self.options = options
        self.say = say
        self._engine = engine
        self._owns_engine = engine is None
        self._reference = None
        self._baseline = None
        self._tokens: list[list[int]] | None = None
        self.model = None

    def open_model(self):
        from ggufcheck.gguf.reader import open_gguf

        if self.model is None:
            self.model = open_gguf(self.options.model)
        return self.model

    @property
    def has_engine(self) -> bool:
        return self._engine is not None or self.options.engine is not None

    def engine(self):
        if self._engine is None:
            from ggufcheck.engines.spec import open_engine

            self.say(f"opening engine {self.options.engine}")
            kwargs = dict(self.options.engine_kwargs)
            if self.options.engine.split(":")[0] == "vllm" and self.options.python:
                kwargs.setdefault("python", self.options.python)  # vLLM runs in the engine's interpreter
            if self.options.engine.startswith(("http://", "https://")) and "http_options" not in kwargs:
                from ggufcheck.engines.http import HttpOptions

                kwargs["http_options"] = HttpOptions(timeout_s=self.options.timeout, top_k=self.options.top_k)
            self._engine = open_engine(self.options.engine, self.options.model, **kwargs)
        return self._engine

    def reference(self):
        if self._reference is None:
            from ggufcheck.engines.reference import ReferenceEngine

            self.say("loading the fp64 reference")
            self._reference = ReferenceEngine(self.options.model, dtype="fp64", **self.semantics())
        return self._reference

    def semantics(self) -> dict:
        """The engine's documented semantics the reference adopts (Capabilities.reference_options)."""
        engine = self._engine if self._engine is not None else (self.engine() if self.options.engine else None)
        return dict(getattr(engine.capabilities, "reference_options", {}) or {}) if engine is not None else {}

    def baseline(self):
        if self._baseline is None and self.options.baseline != "none":
            from ggufcheck.engines.spec import open_engine

            spec = self.options.baseline
            kwargs = {}
            if spec.split(":")[0] == "reference":  # the engine's semantics, rounding as its class does
                kwargs = {**self.semantics(), **self.emulation()}
            self._baseline = open_engine(spec, self.options.model, **kwargs)
        return self._baseline

    def emulation(self) -> dict:
        """``emulate=`` for a reference baseline: the engine's precision class (reference.precision)."""
        from ggufcheck.reference.precision import emulation_of, matmul_weight_types

        engine = self._engine if self._engine is not None else (self.engine() if self.options.engine else None)
        if engine is None:
            return {}
        emulation = emulation_of(engine.capabilities, matmul_weight_types(self.open_model().tensors))
        return {"emulate": emulation} if emulation is not None else {}

    def tokens(self) -> list[list[int]]:
        if self._tokens is None:
            from ggufcheck.checks.prompts import builtin_prompts, load_prompts

            prompts = load_prompts(self.options.prompts) if self.options.prompts else builtin_prompts()
            if self.options.max_prompts:
                prompts = prompts[: self.options.max_prompts]
            texts = [p.text for p in prompts]
            engine = self.engine()
            if engine.capabilities.tokenize:
                seqs = [engine.tokenize(t) for t in texts]
            else:
                from ggufcheck.tokenizer import load_tokenizer

                tok = load_tokenizer(self.open_model())
                seqs = [tok.encode(t, add_special=True, parse_special=True) for t in texts]
            self._tokens = [s[: self.options.max_tokens] for s in seqs if len(s) >= 2]
        return self._tokens

    def close(self) -> None:
        for engine in (self._engine if self._owns_engine else None, self._reference, self._baseline):
            if engine is not None:
                engine.close()
        if self.model is not None:
            self.model.close()


# ----------------------------------------------------------------------------------- stages
def _environment(ctx: _Context) -> list[StageReport]:
    from ggufcheck.checks.environment import EnvOptions, run_environment_stage
    from ggufcheck.probe.runner import ProbeTarget

    o = ctx.options
    target = ProbeTarget(python=o.python or sys.executable, device=o.device)
    ctx.say(f"probing the environment of {target.python}")
    stages = [run_environment_stage(EnvOptions(target=target))]
    if o.kernels:
        from ggufcheck.checks.kernels import KernelOptions, run_kernel_stage

        ctx.say("running kernels: imports, runs, agrees with fp64")
        stages.append(run_kernel_stage(KernelOptions(target=target, model=o.model)))
    return stages


def _file(ctx: _Context) -> list[StageReport]:
    from ggufcheck.checks.file import FileStageOptions, run_file_stage

    ctx.say("checking the file: integrity, metadata, mapping, dequantization health")
    return [run_file_stage(ctx.open_model(), FileStageOptions(health=ctx.options.health))]


def _sharding(ctx: _Context) -> list[StageReport]:
    from ggufcheck.checks.sharding import ShardOptions, run_sharding_stage

    ctx.say(f"checking tensor-parallel sharding at TP {ctx.options.tp}")
    return [run_sharding_stage(ctx.open_model(), ShardOptions(tp=ctx.options.tp, numeric=ctx.options.shard_numeric))]


def _weights(ctx: _Context) -> list[StageReport]:
    from ggufcheck.arch.spec import ArchSpec, spec_for_model
    from ggufcheck.arch.tables import table_for
    from ggufcheck.sharding.weights import check_engine_weights, hf_params

    report = StageReport("weights")
    engine = ctx.engine()
    if not engine.capabilities.weights:
        report.add(skipped("weights.loaded", "weights", engine.capabilities.why_not("weights")))
        return [report]
    model = ctx.open_model()
    spec, findings = spec_for_model(model)
    table = table_for(spec) if isinstance(spec, ArchSpec) and not findings else None
    if table is None:
        report.add(skipped("weights.loaded", "weights", "no spec/table for this architecture: nothing to audit against"))
        return [report]
    caps = engine.capabilities
    names = sorted(hf_params(spec, table, model.tensors, caps.weight_layout))
    ctx.say(f"auditing {len(names)} loaded parameters on {caps.tp_size} rank(s)")
    report.add(check_engine_weights(model, spec, table, engine, names))
    report.info.update(tp=caps.tp_size, parameters=len(names), layout=caps.weight_layout)
    return [report]


def _layers(ctx: _Context) -> list[StageReport]:
    engine = ctx.engine()
    if not engine.capabilities.layer_outputs:
        report = StageReport("layers")
        report.add(skipped("layers", "output", engine.capabilities.why_not("layer_outputs")))
        return [report]
    from ggufcheck.checks.layers import run_layers_stage

    reference, baseline = ctx.reference().model, _baseline_model(ctx)  # loaded first: the label follows the work
    ctx.say("comparing every layer with the reference")
    return [run_layers_stage(engine, reference, ctx.tokens(), baseline_reference=baseline, progress=ctx.say)]


def _baseline_model(ctx: _Context):
    base = ctx.baseline()
    return getattr(base, "model", None)


def _served(ctx: _Context) -> list[StageReport]:
    from ggufcheck.checks.compare import CompareOptions, run_compare

    o = ctx.options
    indexer_top_k = _indexer_top_k(ctx)
    long_prompt = None
    if indexer_top_k:
        long_prompt = _long_prompt(ctx, indexer_top_k)
    return run_compare(
        ctx.engine(), ctx.tokens(), reference=ctx.reference(), baseline_engine=ctx.baseline(),
        options=CompareOptions(max_new_tokens=o.new_tokens, run_sanity=o.sanity, indexer_top_k=indexer_top_k,
                               top_k=o.top_k, long_decode_to=o.decode_to, sweep_to=o.sweep_to),
        progress=ctx.say, long_prompt=long_prompt,
    )


def _indexer_top_k(ctx: _Context) -> int | None:
    from ggufcheck.arch.spec import spec_for_model

    spec, _ = spec_for_model(ctx.open_model())
    indexer = getattr(spec, "indexer", None)
    return getattr(indexer, "top_k", None)


def _long_prompt(ctx: _Context, top_k: int) -> list[int] | None:
    """A prompt longer than the indexer's top_k (sparse attention actually selects)."""
    seqs = sorted(ctx.tokens(), key=len, reverse=True)
    if seqs and len(seqs[0]) > top_k + 2:
        return seqs[0]
    return None


@dataclass(frozen=True)
class Stage:
    name: str
    eliminates: str
    run: Callable[[_Context], list[StageReport]]
    when: Callable[[_Context], str | None]  # None: runs; else the reason it is skipped
    skip_component: str


def _needs_engine(ctx: _Context) -> str | None:
    return None if ctx.has_engine else "no --engine given"


PLAN: tuple[Stage, ...] = (
    Stage("environment", "the interpreter, packages and GPU kernels", _environment,
          lambda c: None if (c.options.python or c.options.device is not None) else
          "no --python or --device given", "environment"),
    Stage("file", "the GGUF file, its metadata and tensor mapping", _file, lambda c: None, "gguf-file"),
    Stage("sharding", "tensor-parallel splitting", _sharding,
          lambda c: None if c.options.tp else "no --tp given", "sharding"),
    Stage("weights", "the engine's loaded parameters", _weights, _needs_engine, "weights"),
    Stage("layers", "each layer's computation", _layers, _needs_engine, "output"),
    Stage("served", "the served distributions and execution paths", _served, _needs_engine, "output"),
)


def diagnose(options: DiagnoseOptions, progress: Progress | None = None, engine: Any | None = None) -> Diagnosis:
    """Run every applicable stage in order and decide the verdict.

    ``engine`` may be an already open :class:`ggufcheck.engines.base.Engine` (tests and
    ``ggufcheck.testing.faults`` pass one); otherwise ``options.engine`` is opened.
    """
    say = progress or (lambda _m: None)
    if engine is None and options.engine is None:
        raise UsageError("diagnose needs --engine SPEC: without an engine nothing about a deployment is checked",
                         tip="`ggufcheck inspect MODEL` checks the file alone, `ggufcheck shard MODEL --tp N` its "
                             "tensor-parallel split, `ggufcheck env --python PATH` an interpreter")
    ctx = _Context(options, say, engine)
    stages: list[StageReport] = []
    timings: dict[str, float] = {}
    started = time.perf_counter()
    try:
        if engine is None:  # a bad spec (exit 2) or an unreachable engine (exit 3) is said in seconds,
            try:            # before the long file stage
                ctx.engine()
            except Unavailable:
                pass  # the stages that need it record why (SKIP "unavailable: ...")
        for number, stage in enumerate(PLAN, 1):
            say(f"stage {number}/{len(PLAN)}: {stage.name}")
            reason = stage.when(ctx)
            if reason is not None:
                report = StageReport(stage.name, info={"eliminates": stage.eliminates})
                report.add(skipped(stage.name, stage.skip_component, reason))
                stages.append(report)
                continue
            t0 = time.perf_counter()
            try:
                reports = stage.run(ctx)
            except (EngineUnreachable, UsageError):
                raise  # an unreachable engine (exit 3) or a bad --engine / option (exit 2) ends the run
            except Unavailable as err:
                reports = [StageReport(stage.name)]
                reports[0].add(skipped(stage.name, stage.skip_component, f"unavailable: {err.message}"))
            except GGUFCheckError as err:
                if stage.name == "file":
                    raise  # an unreadable model file ends the diagnosis (exit 2)
                reports = [StageReport(stage.name)]
                reports[0].add(errored(stage.name, stage.skip_component, err.message))
            except Exception as err:  # a defect in a stage must not hide the other stages' evidence
                if os.environ.get("GGUFCHECK_DEBUG"):
                    raise
                reports = [StageReport(stage.name)]
                reports[0].add(errored(stage.name, stage.skip_component,
                                       f"internal error in the {stage.name} stage: {type(err).__name__}: {err}"))
            timings[stage.name] = time.perf_counter() - t0
            for r in reports:
                r.info.setdefault("eliminates", stage.eliminates)
            stages.extend(reports)
        described = None
        if ctx.has_engine:
            try:
                described = ctx.engine().describe()
            except GGUFCheckError as err:  # the stages already recorded why it did not open
                described = {"name": ctx.options.engine, "error": err.message}
    finally:
        ctx.close()
    return Diagnosis(options, stages, decide(stages), described, time.perf_counter() - started, timings)
