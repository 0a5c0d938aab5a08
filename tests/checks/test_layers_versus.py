"""The layers stage with another engine as the reference (checks/layers/versus.py): transformers
(ggufcheck's rebuild, fp32) judging the tiny gemma3 in ggufcheck's fp32 reference engine.
Healthy passes every layer; a sliding window ignored from layer 0 on fails at layer 0 (most
positions of a 16-token prompt are past the window of 8); an RMS eps changed in the LAST
layer only fails there, the earlier layers pass."""

from __future__ import annotations

import numpy as np
import pytest

from ggufcheck.checks.layers.versus import run_layers_vs_engine
from ggufcheck.diagnose.verdict import decide
from ggufcheck.engines.reference import ReferenceEngine
from ggufcheck.results import Status
from ggufcheck.testing.faults import make_faulty_engine

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gemma(tiny_converted):
    from ggufcheck.engines.hf import HFEngine

    path = tiny_converted("gemma3").gguf_path
    return path, HFEngine.from_gguf(path, dtype="fp32")


def _prompts():
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(1, 49000, n)] for n in (16, 12)]


def test_healthy_engine_agrees_with_transformers_layer_by_layer(gemma):
    path, hf = gemma
    report = run_layers_vs_engine(ReferenceEngine(path, dtype="fp32"), hf, _prompts())
    (result,) = report.results
    assert result.status is Status.PASS and "all 6 layers agree" in result.message
    assert max(r["error"] for r in report.info["per_layer"]) < 1e-5  # fp32 vs fp32: far under the 1e-4 limit


@pytest.mark.parametrize("fault,layer,kw", [("sliding-window-ignored", 0, {}),
                                            ("norm-eps-wrong", 5, {"eps": 1e-2})])
def test_a_fault_is_placed_at_its_first_layer_without_blaming_either_side(gemma, fault, layer, kw):
    path, hf = gemma
    engine = make_faulty_engine(fault, path, expose_weights=False, **kw)
    report = run_layers_vs_engine(engine, hf, _prompts())
    failing = [r for r in report.results if r.status is Status.FAIL]
    assert len(failing) == 1 and failing[0].layer == layer, [r.message for r in report.results]
    assert "does not say which of the two is wrong" in failing[0].message
    assert all(r.status is Status.PASS for r in report.results if r.layer is not None and r.layer < layer)
    assert decide([report]).layer == layer
