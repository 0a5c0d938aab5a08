"""What the stages of one diagnosis share, opened once, lazily, and closed together.

A :class:`Session` owns the model file, the engine under test, the fp64 reference, the
baseline run (which emulates the engine's precision class), the prompts' tokens and the long
prompt. Each stage is one module in ``checks/`` with one entry point, ``run(session) ->
list[StageReport]``; the plan (``diagnose/plan.py``) lists them in dependency order. A stage
asks the session for what it needs, so nothing is opened that no stage uses, and an input
two stages need (the reference, the tokens) is built once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

Progress = Callable[[str], None]

# the stages a saved run cannot judge again (`ggufcheck rejudge`): it holds the engine's answers
# only. A run saves their reports, and a replay carries them over as they were (Session.carried);
# a run that did not get to one leaves it skipped, for this reason
NOT_REPLAYED = {
    "environment": "not re-judged: the environment and kernel probes run in the engine's interpreter, and a saved "
                   "run holds the engine's answers only (rerun diagnose)",
    "weights": "not re-judged: the weights audit reads the engine's loaded weights (rerun diagnose)",
    "switches": "not re-judged: each flip reruns the engine with one setting changed (rerun diagnose)",
}


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
    reference: str = "reference"  # the trusted engine's SPEC ("reference": ggufcheck's fp64; "none")
    baseline: str = "reference:fp32"  # a low-precision run giving a correct engine's error ("none")
    paths: bool = True  # the execution-path checks of the served stage
    top_k: int = 20  # top-k requested from engines without full logits (HTTP servers)
    timeout: float = 60.0  # HTTP engines: seconds per request
    max_memory: int | None = None  # bytes ggufcheck may hold (None: 80% of the memory available; resources.py)
    reference_device: str = "auto"  # where the reference runs: auto (a GPU with room, else cpu), cpu, cuda[:N]
    layers: tuple[int, ...] | None = None  # --layers: check only these layers (their weights alone are read)
    experts: tuple[int, ...] | None = None  # --experts: audit only these routed experts of each MoE layer
    switches: str = "auto"  # the switch stage: after a served failure (auto), always, never (checks.switches)
    switch_budget: float = 600.0  # seconds the switch stage may spend flipping settings
    save_run: Path | None = None  # --save-run DIR: the engine's answers saved there (engines/recorded.py)
    replayed: bool = False  # the engine is a saved run played back (`ggufcheck rejudge`; diagnose/rejudge.py)

    @cached_property
    def engine_spec(self):
        """``engine`` parsed once (engines/spec.py: its kind, options, TP size); None without one."""
        from ggufcheck.engines.spec import parse_spec

        return parse_spec(self.engine) if self.engine else None

    def to_json(self) -> dict[str, Any]:
        """What the run was asked, as JSON (a saved run keeps it; paths as strings)."""
        out = {}
        for f in fields(self):
            if f.name not in _NOT_SAVED:
                value = getattr(self, f.name)
                out[f.name] = str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: Path) -> "DiagnoseOptions":
        """:meth:`to_json` read back (``where``: the file it came from, for errors)."""
        from ggufcheck.errors import UsageError

        unknown = sorted(set(doc) - ({f.name for f in fields(cls)} - set(_NOT_SAVED)))
        if unknown:
            raise UsageError(f"{where}: 'options' has fields this ggufcheck does not know: {', '.join(unknown)}")
        if "model" not in doc:
            raise UsageError(f"{where}: 'options' names no model")
        values = dict(doc)
        for name in ("model", "prompts"):
            if values.get(name) is not None:
                values[name] = Path(values[name])
        for name in ("layers", "experts"):
            if values.get(name) is not None:
                values[name] = tuple(int(i) for i in values[name])
        try:
            return cls(**values)
        except TypeError as err:
            raise UsageError(f"{where}: 'options' unusable ({err})") from None

    def tensor_chosen(self, name: str) -> bool:
        """Whether ``--layers`` keeps tensor ``name`` (every non-layer tensor is kept)."""
        if self.layers is None or not name.startswith("blk."):
            return True
        return int(name.split(".")[1]) in self.layers
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)


# options that say where a run was made, not what it asked: not saved with a run, not replayed
_NOT_SAVED = ("engine_kwargs", "save_run", "replayed")


class Session:
    """Lazily opened inputs shared by the stages (the model, engines, prompt tokens)."""

    def __init__(self, options: DiagnoseOptions, say: Progress, engine: Any | None = None):
        self.options = options
        self.say = say
        self._engine = engine
        self._owns_engine = engine is None
        self._reference = None
        self._baseline = None
        self._tokens: list[list[int]] | None = None
        self.tokenizer_used: str | None = None  # whose tokenizer made the prompts' tokens
        self.model = None
        self._lent = None  # lend(self.model) while the run holds it
        self.resources = None  # the resource plan (diagnose/resources.py), made before the first stage
        self.reports: list = []  # the stages' reports so far (diagnose/plan.py fills it)
        self.timings: dict[str, float] = {}  # seconds per stage so far
        self.recorder = None  # --save-run: where the engine's answers go (engines/recorded.py)
        self.kept_for_replay: dict[str, list] = {}  # --save-run: reports of the stages a replay carries over
        if options.save_run is not None:
            from ggufcheck.engines.recorded import RunRecorder

            self.recorder = RunRecorder(options.save_run)
            if engine is not None:
                self._engine = self._recording(engine)

    @property
    def reference_device(self) -> str:
        return self.resources.device if self.resources is not None else "cpu"

    # -- the file -------------------------------------------------------------------------
    def open_model(self):
        from ggufcheck.gguf.reader import open_gguf

        if self.model is None:
            from ggufcheck.gguf.reader import lend

            self.model = open_gguf(self.options.model)
            self._lent = lend(self.model)  # the engines, the reference and the checks borrow it
            self._lent.__enter__()
        return self.model

    def indexer_top_k(self) -> int | None:
        """The DSA indexer's top_k from the metadata (None: no sparse attention)."""
        from ggufcheck.arch.spec import spec_for_model

        spec, _ = spec_for_model(self.open_model())
        return getattr(getattr(spec, "indexer", None), "top_k", None)

    # -- the engine and the references ----------------------------------------------------
    @property
    def has_engine(self) -> bool:
        return self._engine is not None or self.options.engine is not None

    def engine(self):
        if self._engine is None:
            self._engine = self._recording(self.open_engine(self.options.engine_spec))
        return self._engine

    def keep_for_replay(self, stage: str, reports: list) -> None:
        """With --save-run, the reports of a stage a replay cannot judge again (diagnose/plan.py
        NOT_REPLAYED), saved with the run."""
        if self.recorder is not None and stage in NOT_REPLAYED:
            self.kept_for_replay[stage] = [r.to_json() for r in reports]

    def carried(self, stage: str) -> list | None:
        """A replayed run's saved reports of ``stage`` (None: not saved, or a stage judged again)."""
        from ggufcheck.results import StageReport

        saved = (getattr(self._engine, "manifest", None) or {}).get("carried") or {}
        if stage not in saved:
            return None
        reports = [StageReport.from_json(doc) for doc in saved[stage]]
        for r in reports:
            r.info["carried"] = "from the saved run, not judged again (it needs the engine)"
        return reports

    def _recording(self, engine):
        """``engine``, its answers saved with --save-run (as they return); else itself."""
        if self.recorder is None:
            return engine
        from ggufcheck.engines.recorded import RecordingEngine, engine_manifest, model_identity

        self.recorder.write_manifest({"options": self.options.to_json(),
                                      "model": model_identity(Path(self.options.model)),
                                      "engine": engine_manifest(engine)})
        return RecordingEngine(engine, self.recorder)

    def open_engine(self, spec):
        """Open ``spec`` (the run's engine spec, or one with a setting flipped) as this run opens
        engines: its interpreter, its HTTP options. The caller owns what it did not ask via engine()."""
        self.say(f"opening engine {spec.text}")
        kwargs = dict(self.options.engine_kwargs)
        if spec.kind.interpreter and self.options.python:
            # vLLM, and an isolated llama.cpp, run in the engine's interpreter
            kwargs.setdefault("python", self.options.python)
        if spec.name in ("http", "llama-server") and "http_options" not in kwargs:
            from ggufcheck.engines.http import HttpOptions

            kwargs["http_options"] = HttpOptions(timeout_s=self.options.timeout, top_k=self.options.top_k)
        return spec.open(self.options.model, **kwargs)

    def reference(self):
        """The trusted engine (``options.reference``; None for "none"). ggufcheck's reference
        adopts the engine's documented semantics (:meth:`semantics`)."""
        if self._reference is None and self.options.reference != "none":
            spec = self.options.reference
            if spec == "reference":
                from ggufcheck.engines.reference import ReferenceEngine

                self.say("loading the fp64 reference")
                self._reference = ReferenceEngine(self.options.model, dtype="fp64", device=self.reference_device,
                                                  **self.semantics())
            else:
                from ggufcheck.engines.spec import open_engine

                self.say(f"opening the reference {spec}")
                kwargs = self.semantics() if spec.split(":")[0] == "reference" else {}
                self._reference = open_engine(spec, self.options.model, **kwargs)
        return self._reference

    def semantics(self) -> dict:
        """The engine's documented semantics the reference adopts (Capabilities.reference_options)."""
        engine = self._engine if self._engine is not None else (self.engine() if self.options.engine else None)
        return dict(getattr(engine.capabilities, "reference_options", {}) or {}) if engine is not None else {}

    def emulation(self, engine: Any | None = None) -> dict:
        """``emulate=`` for a reference baseline: the precision class of ``engine`` (default: the
        session's engine; reference.precision)."""
        from ggufcheck.gguf.matmuls import matmul_weight_types
        from ggufcheck.reference.precision import emulation_of

        if engine is None:
            engine = self._engine if self._engine is not None else (self.engine() if self.options.engine else None)
        if engine is None:
            return {}
        emulation = emulation_of(engine.capabilities, matmul_weight_types(self.open_model().tensors))
        return {"emulate": emulation} if emulation is not None else {}

    def baseline(self):
        """The baseline run (``--baseline``): a correct engine's expected error, measured."""
        if self._baseline is None and self.options.baseline != "none":
            self._baseline = self.baseline_for(None)
        return self._baseline

    def baseline_for(self, engine: Any):
        """A new baseline run for ``engine`` (None: the session's; another: the switch stage's
        flipped one, with its own precision class): the engine's semantics, rounding as its class
        does; the caller closes one it asked for itself. None with --baseline none."""
        from ggufcheck.engines.spec import open_engine

        spec = self.options.baseline
        if spec == "none":
            return None
        kwargs = {}
        if spec.split(":")[0] == "reference":  # the engine's semantics, rounding as its class does
            kwargs = {**self.semantics(), **self.emulation(engine), "device": self.reference_device}
        return open_engine(spec, self.options.model, **kwargs)

    def baseline_model(self):
        """The baseline's ReferenceModel (the layers stage replays with it), or None."""
        return getattr(self.baseline(), "model", None)

    # -- the prompts ----------------------------------------------------------------------
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
                self.tokenizer_used = f"{engine.name}'s tokenizer"
            else:
                from ggufcheck.tokenizer import load_tokenizer

                tok = load_tokenizer(self.open_model())
                seqs = [tok.encode(t, add_special=True, parse_special=True) for t in texts]
                self.tokenizer_used = "the GGUF's own tokenizer"
            self._tokens = [s[: self.options.max_tokens] for s in seqs if len(s) >= 2]
        return self._tokens

    def long_prompt(self, top_k: int) -> list[int] | None:
        """DSA models: a prompt longer than the indexer's top_k, so that sparse attention
        actually selects (the longest prompt, or the prompts joined and repeated)."""
        seqs = sorted(self.tokens(), key=len, reverse=True)
        if not seqs:
            return None
        if len(seqs[0]) > top_k + 8:
            return seqs[0]
        joined: list[int] = []
        while len(joined) <= top_k + 32:
            for s in seqs:
                joined.extend(s)
        return joined[: top_k + 32]

    def close(self) -> None:
        for engine in (self._engine if self._owns_engine else None, self._reference, self._baseline):
            if engine is not None:
                engine.close()
        if self.model is not None:
            if self._lent is not None:
                self._lent.__exit__(None, None, None)
                self._lent = None
            self.model.close()
