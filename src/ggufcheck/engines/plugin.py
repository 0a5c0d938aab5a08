"""``--engine python:module:factory``: a user's own engine object.

``factory`` is called as ``factory(model_path)`` (or with no argument if it takes none)
and must return an :class:`ggufcheck.engines.base.Engine` (subclass it, or provide the
same attributes: ``name``, ``capabilities``, ``vocab_size`` and ``score``).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from ggufcheck.engines.base import Capabilities, Engine
from ggufcheck.errors import UsageError


def load_plugin(target: str, model_path: str | Path | None) -> Engine:
    """``module:factory`` -> the engine the factory returns, checked for the interface."""
    module_name, sep, attr = target.partition(":")
    attr, _, options_text = attr.partition(":")
    options = {}
    for item in filter(None, options_text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UsageError(f"--engine python:{target}: bad option {item!r}", tip="options are key=value, comma-separated")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    if not sep or not module_name or not attr:
        raise UsageError(f"--engine python:{target}: expected python:MODULE:FACTORY",
                         tip="e.g. --engine python:my_serving.ggufcheck_adapter:make_engine")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"--engine python:{target}: cannot import {module_name!r}: {err}",
                         tip="is the module on PYTHONPATH?") from err
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise UsageError(f"--engine python:{target}: {module_name} has no attribute {attr!r}")
    if not callable(factory):
        raise UsageError(f"--engine python:{target}: {attr} is not callable")
    try:
        takes_arg = bool(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        takes_arg = True
    engine = factory(model_path, **options) if takes_arg else factory()
    missing = [name for name in ("score", "capabilities", "vocab_size", "name") if not hasattr(engine, name)]
    if missing or not isinstance(getattr(engine, "capabilities", None), Capabilities):
        raise UsageError(f"--engine python:{target}: the factory returned {type(engine).__name__}, which lacks "
                         f"{', '.join(missing) or 'a Capabilities object'}",
                         tip="subclass ggufcheck.engines.base.Engine")
    return engine
