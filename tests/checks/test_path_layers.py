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


def test_routing_near_tie_flips_are_found_only_below_the_margin():
    from ggufcheck.checks.path_layers import routing_near_tie_flips, selection_gap

    probs = np.array([[0.5, 0.3, 0.2995, 0.0], [0.6, 0.3, 0.05, 0.05]])  # row 0: 2nd vs 3rd 5e-4 apart
    assert np.allclose(selection_gap(probs, 2), [5e-4, 0.25])
    whole = {("router", 1): np.array([[0, 1], [0, 1]]), ("router_probs", 1): probs}
    chunked = {("router", 1): np.array([[0, 2], [0, 2]]), ("router_probs", 1): probs}
    flips = routing_near_tie_flips(whole, chunked, margin=1e-2)
    assert [(f["position"], f["layer"]) for f in flips] == [(0, 1)]  # row 1 flipped at a 0.25 gap: not a tie
    assert routing_near_tie_flips(whole, chunked, margin=1e-4) == []


def test_an_ffn_parting_with_the_same_experts_says_how_far_the_router_scores_moved():
    """The tiny deepseek2 on CUDA (docs/real-world-cases.md): both paths chose the same experts
    where they parted, but their router scores were 0.11 apart, which a MoE output follows."""
    from ggufcheck.checks.path_layers import where_paths_part

    rng = np.random.default_rng(0)
    residual = {i: rng.normal(size=(6, 8)) for i in (0, 1)}
    probs = np.tile([0.5, 0.3, 0.15, 0.05], (6, 1))
    whole = {("residual", 0): residual[0], ("residual", 1): residual[1],
             ("after_attention", 1): residual[0].copy(), ("router", 1): np.tile([0, 1], (6, 1)),
             ("router_probs", 1): probs}
    chunked = {key: value.copy() for key, value in whole.items()}
    chunked[("residual", 1)][4] += 5.0  # the layer's output parts at position 4 ...
    chunked[("router_probs", 1)][4] = [0.4, 0.35, 0.2, 0.05]  # ... same top-2, scores 0.1 apart
    found = where_paths_part(None, list(range(6)), 5, 5, 0.15, traced=(whole, chunked))
    assert (found["layer"], found["block"], found["position"]) == (1, "ffn", 4), found["text"]
    assert found["router_scores_difference"] == pytest.approx(0.1)
    assert "same experts chosen and their router scores up to 0.1 apart" in found["text"]


class _FlipsAtOneRow:
    """A q8-class engine over the fp32 reference whose chunked path routes row ``at`` of layer 1
    to another expert at a selection gap of ``gap`` and, from that row on, serves other
    log-probs (what a flip does downstream): a near-tie flip or a routing fault, by ``gap``."""

    def __init__(self, model, at: int, gap: float):
        from dataclasses import replace

        self.inner = ReferenceEngine(model, dtype="fp32")
        self.at, self.gap = at, gap
        self.capabilities = replace(self.inner.capabilities, activation_dtype="q8")
        self.name, self.vocab_size = "flips", self.inner.vocab_size

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def score_chunked(self, tokens, chunk_size, *, top_k=20):
        from dataclasses import replace

        table = self.inner.score(tokens)
        rolled = table.logprobs.copy()
        rolled[self.at:] = np.roll(rolled[self.at:], 7, axis=-1)
        return replace(table, logprobs=rolled)

    def _route(self, trace, tokens, flipped):
        from dataclasses import replace

        n = len(tokens)
        ids = np.tile([0, 1], (n, 1))
        probs = np.tile([0.5, 0.3, 0.05, 0.05], (n, 1)).astype(np.float64)
        probs[self.at] = [0.5, 0.3, 0.3 - self.gap, 0.0]
        if flipped:
            ids = ids.copy()
            ids[self.at] = [0, 2]
        return replace(trace, tensors={**trace.tensors, ("router", 1): ids, ("router_probs", 1): probs})

    def layer_outputs(self, tokens, kinds=()):
        return self._route(self.inner.layer_outputs(tokens, ["residual"]), tokens, False)

    def chunked_layer_outputs(self, tokens, chunk_size, kinds=()):
        return self._route(self.inner.layer_outputs(tokens, ["residual"]), tokens, True)


def test_a_routing_near_tie_broken_differently_is_left_out_and_a_clear_flip_still_fails(model, reference):
    """Measured on the H100 (tiny deepseek2 Q4_K, llama.cpp CUDA, f32 cuBLAS): the chunked path
    routed a token to another expert where the engine's own scores were a near-tie, and every
    later row differed. Such rows are left out of the pair (its rest agrees: pass, said so); a
    flip at a clear gap stays a failure and is named as a routing difference."""
    prompts = _prompts(lengths=(23,))
    tie = _FlipsAtOneRow(model, at=12, gap=1e-3)
    result, _ = _chunked(tie, reference, prompts)
    assert not result.failed, result.message
    assert "routing near-tie" in result.message and result.stats["routing_ties"][0][0]["position"] == 12
    clear = _FlipsAtOneRow(model, at=12, gap=0.2)
    result, _ = _chunked(clear, reference, prompts)
    assert result.failed and "routing_ties" not in result.stats, result.message
    tie.inner.close()
    clear.inner.close()


def test_without_block_outputs_the_residual_between_the_blocks_names_the_attention(model, reference):
    """llama.cpp's MLA graphs name no attention output ("attn_out"), only the residual between the
    blocks ("ffn_inp"): that alone still names the attention."""
    from dataclasses import replace

    class NoAttentionOutput:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def _strip(self, trace):
            return replace(trace, tensors={k: v for k, v in trace.tensors.items() if k[0] != "attention"})

        def layer_outputs(self, tokens, kinds=()):
            return self._strip(self.inner.layer_outputs(tokens, kinds))

        def chunked_layer_outputs(self, tokens, chunk_size, kinds=()):
            return self._strip(self.inner.chunked_layer_outputs(tokens, chunk_size, kinds))

    inner = make_faulty_engine("chunk-context-lost", model, layer=1)
    result, _ = _chunked(NoAttentionOutput(inner), reference, _prompts())
    inner.close()
    where = result.stats["localized"]["where"]
    assert (where["layer"], where["block"]) == (1, "attention") and "attention_difference" not in where, where
