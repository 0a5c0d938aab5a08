"""What the device lead scripts (chunk_lead.py, real_lead.py, op_lead.py) share: the engine
options from a ``--spec`` string, the engine and reference pair, and the per-row metrics."""

from __future__ import annotations

import numpy as np


def spec_options(spec: str) -> dict[str, int]:
    """'n_gpu_layers=99,flash_attn=1' -> {'n_gpu_layers': 99, 'flash_attn': 1} ('' -> {}: the CPU)."""
    options = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        options[key] = int(value)
    return options


def open_engines(model: str, spec: str):
    """llama.cpp in a process of its own (a CUDA libllama cannot share one with torch) and the
    fp64 reference; prints which."""
    from ggufcheck.engines.isolated import IsolatedEngine
    from ggufcheck.engines.reference import ReferenceEngine

    engine = IsolatedEngine("ggufcheck.engines.llama_cpp:LlamaCppEngine", model, preload=("llama_cpp",),
                            **spec_options(spec))
    reference = ReferenceEngine(model, dtype="fp64")
    print(f"engine: {engine.name}; reference: {reference.name}")
    return engine, reference


def kl_rows(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """KL(ref || got) per row of two [T, V] log-prob tables."""
    p = np.exp(ref)
    return (p * (ref - got)).sum(axis=-1)


def rel_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row relative error ||a - b|| / ||b|| of two [T, D] arrays."""
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)
