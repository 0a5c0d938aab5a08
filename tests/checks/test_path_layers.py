"""A failing chunked prefill is looked into: which path the reference agrees with, and the layer
and block where the chunked path leaves the one prefill (checks/path_layers.py), on the
catalogued fault chunk-context-lost (a chunk reads the earlier chunks' cache as zeros)."""

from __future__ import annotations

import numpy as np
import pytest

from ggufcheck.checks.compare import CompareOptions, run_compare
from ggufcheck.engines.reference import ReferenceEngine
from ggufcheck.testing.faults import make_faulty_engine


def _prompts(seed: int = 3, lengths=(23, 17), vocab: int = 250) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, vocab, n)] for n in lengths]


def _chunked(engine, reference, prompts):
    stages = run_compare(engine, prompts, reference=reference,
                         options=CompareOptions(max_new_tokens=4, decode_prompts=1, long_decode_to=0, run_sanity=False,
                                                chunk_sizes=(5,), sweep_to=0))
    paths = next(s for s in stages if s.stage == "paths")
    return next(r for r in paths.results if r.check == "paths.chunked_prefill[5]"), stages


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return tiny_gguf("llama", seed=2).path


@pytest.fixture(scope="module")
def reference(model):
    ref = ReferenceEngine(model, dtype="fp64")
    yield ref
    ref.close()


@pytest.mark.parametrize("layer", [None, 1])
def test_chunk_context_lost_is_the_chunked_path_at_its_layer_in_the_attention(model, reference, layer):
    engine = make_faulty_engine("chunk-context-lost", model, **({} if layer is None else {"layer": layer}))
    result, stages = _chunked(engine, reference, _prompts())
    engine.close()
    assert result.failed and result.component == "prefill", result.message
    found = result.stats["localized"]
    assert found["which_path"]["wrong"] == ["chunks"], found["which_path"]
    where = found["where"]
    want = 0 if layer is None else layer
    assert (where["layer"], where["block"], result.layer) == (want, "attention", want), where["text"]
    assert where["position"] >= 5  # the first chunk reads no earlier chunk: it cannot differ
    assert "chunks path is the wrong one" in result.message and f"at layer {want}" in result.message
    # the served stages elsewhere agree with the reference: one prefill and decode are right
    logits = next(s for s in stages if s.stage == "logits")
    assert not logits.failures, [r.message for r in logits.failures]


def test_healthy_engine_passes_the_chunked_pair_without_looking_inside(model, reference):
    engine = ReferenceEngine(model, dtype="fp32")
    result, _ = _chunked(engine, reference, _prompts())
    engine.close()
    assert not result.failed and "localized" not in result.stats, result.message


def test_the_chunked_trace_of_a_healthy_reference_is_its_one_prefill(model):
    """Two paths of one correct fp64 implementation: the chunked trace (through the KV cache)
    equals the one-prefill trace to rounding, and its last chunk's logits are score_chunked's."""
    engine = ReferenceEngine(model, dtype="fp64")
    tokens = _prompts()[0]
    whole = engine.layer_outputs(tokens, ["residual", "attention", "ffn"]).tensors
    chunked = engine.chunked_layer_outputs(tokens, 5, ["residual", "attention", "ffn"]).tensors
    assert set(whole) == set(chunked)
    for key, want in whole.items():
        np.testing.assert_allclose(chunked[key], want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    engine.close()


def test_without_a_chunked_trace_the_engine_says_only_which_path(model, reference):
    """An engine that cannot trace a chunked prefill (a server, a wrapper): the reference still
    says which path is wrong, and no layer is claimed."""

    class NoChunkedTrace:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def chunked_layer_outputs(self, *args, **kwargs):
            from ggufcheck.engines.base import Unsupported

            raise Unsupported("no chunked trace here")

    inner = make_faulty_engine("chunk-context-lost", model)
    result, _ = _chunked(NoChunkedTrace(inner), reference, _prompts())
    inner.close()
    assert result.failed and result.layer is None
    assert "where" not in result.stats["localized"] and result.stats["localized"]["which_path"]["wrong"] == ["chunks"]
