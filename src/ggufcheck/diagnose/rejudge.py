"""A saved run judged again, without the engine: ``ggufcheck rejudge DIR``.

``diagnose --save-run DIR`` keeps the engine's answers (engines/recorded.py) beside the
options the run was asked with. Re-judging opens the model file again, recomputes the
reference, and runs the same stages with the saved answers in place of the engine: the run
made on the deployment (a GPU server, an engine that is gone now) is judged here, later, or
again after a check changed. What a saved run cannot judge again is said per stage: the
environment probes and the switch stage need the engine's interpreter or a restarted engine,
the weights audit its loaded weights.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ggufcheck.diagnose.session import DiagnoseOptions, Progress
from ggufcheck.errors import UsageError


def rejudge(directory: Path, *, model: Path | None = None, reference_device: str | None = None,
            progress: Progress | None = None, on_plan=None):
    """The diagnosis of the run saved in ``directory``, judged again from its saved answers.
    ``model``: the GGUF where it is now (default: where the run read it; its identity is checked)."""
    from ggufcheck.diagnose.plan import diagnose
    from ggufcheck.engines.recorded import MANIFEST, ReplayEngine, model_identity

    directory = Path(directory)
    engine = ReplayEngine(directory)
    where = directory / MANIFEST
    options = DiagnoseOptions.from_json(engine.manifest.get("options") or {}, where)
    path = Path(model) if model is not None else options.model
    if not path.is_file():
        raise UsageError(f"{path}: no such file (the model the run in {directory} read)",
                         tip="give its path now with --model PATH")
    saved, now = engine.manifest.get("model") or {}, model_identity(path)
    if saved and (saved.get("size"), saved.get("sha256_ends")) != (now["size"], now["sha256_ends"]):
        raise UsageError(f"{path}: not the file the run in {directory} read ({saved.get('name')}, "
                         f"{saved.get('size')} bytes; this one: {now['size']} bytes"
                         + (", same size, other bytes" if saved.get("size") == now["size"] else "") + ")")
    engine.set_model_path(path)
    options = replace(options, model=path, replayed=True,
                      **({"reference_device": reference_device} if reference_device else {}))
    return diagnose(options, progress=progress, engine=engine, on_plan=on_plan), engine


def saved_verdict(engine) -> dict[str, Any] | None:
    """The verdict the saved run reached (None for a run cut short)."""
    return engine.manifest.get("verdict")


def describe_replay(engine) -> str:
    """One line: what was replayed, and what the saved run concluded."""
    verdict = saved_verdict(engine)
    was = ("a run cut short (no verdict saved)" if verdict is None else
           "healthy" if verdict.get("healthy") else f"{verdict.get('component')}"
           + (f" (layer {verdict['layer']})" if verdict.get("layer") is not None else ""))
    unused = engine.unused
    return (f"re-judged from {engine.directory}: {engine.calls - unused} of {engine.calls} saved engine answers "
            f"replayed" + (f" ({unused} not asked for again)" if unused else "") + f"; the saved run's verdict: {was}")
