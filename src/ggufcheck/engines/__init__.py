"""Engines: the deployments ggufcheck compares, behind one small interface (base.py).

``open_engine(spec, model_path)`` (spec.py) opens ``reference``, ``hf``, ``llama-cpp``,
``http://HOST:PORT[/v1]`` or ``python:module:factory``; each adapter imports its heavy
library only when opened. ``faults.py`` wraps a healthy engine with a known corruption.
"""

from ggufcheck.engines.base import (
    LAYER_KINDS,
    Capabilities,
    Engine,
    Generation,
    LayerTrace,
    TokenLogprobs,
    Unsupported,
)
from ggufcheck.engines.spec import open_engine

__all__ = ["LAYER_KINDS", "Capabilities", "Engine", "Generation", "LayerTrace", "TokenLogprobs", "Unsupported",
           "open_engine"]
