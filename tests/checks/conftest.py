"""Fixtures for the logits / sanity / paths checks: SmolLM2 Q4_1 through llama.cpp, scored once."""

from __future__ import annotations

import pytest

TEXTS = ("The capital of France is Paris. The capital of Germany is",
         "def add(a, b):\n    return a + b\n\nprint(add(2,",
         "Le chat est assis sur le tapis et regarde la pluie tomber")


@pytest.fixture(scope="session")
def llama(smollm2_path):
    pytest.importorskip("llama_cpp")
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine(smollm2_path, n_ctx=128, n_threads=2)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def sequences(llama):
    return [llama.tokenize(t) for t in TEXTS]


@pytest.fixture(scope="session")
def llama_tables(llama, sequences):
    return [llama.score(s) for s in sequences]
