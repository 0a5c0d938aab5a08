"""llama.cpp in process: tables are log-softmax, decode/chunks line up, cb_eval layer tensors add up."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.llama


def test_score_is_log_softmax_and_greedy_matches(llama_engine, prompts):
    tokens = llama_engine.tokenize(prompts[0])
    table = llama_engine.score(tokens)
    assert table.logprobs.shape == (len(tokens), llama_engine.vocab_size)
    np.testing.assert_allclose(np.exp(table.logprobs.astype(np.float64)).sum(axis=1), 1.0, rtol=1e-4)
    gen = llama_engine.generate(tokens, 3)
    assert gen.generated[0] == table.argmax()[-1]  # the first greedy token is the prefill's argmax
    assert gen.steps.present.sum() == 3 and gen.steps.present[len(tokens) - 1]


def test_chunked_prefill_matches_one_prefill(llama_engine, prompts):
    tokens = llama_engine.tokenize(prompts[1])
    whole = llama_engine.score(tokens)
    chunked = llama_engine.score_chunked(tokens, 4)
    assert np.array_equal(whole.argmax(), chunked.argmax())
    assert np.abs(whole.logprobs - chunked.logprobs).max() < 0.5


def test_eval_callback_layer_tensors_form_the_residual_stream(llama_engine, prompts):
    """cb_eval captures real nodes: l_out[i] == l_out[i-1] + attn_out[i] + ffn_out[i] (llama block)."""
    tokens = llama_engine.tokenize(prompts[0])
    trace = llama_engine.layer_outputs(tokens)
    n_layer = max(layer for _, layer in trace.tensors) + 1
    assert n_layer == 30
    for i in range(1, n_layer):
        res, prev = trace.tensors[("residual", i)], trace.tensors[("residual", i - 1)]
        attn, ffn = trace.tensors[("attention", i)], trace.tensors[("ffn", i)]
        assert res.shape == (len(tokens), 576)
        np.testing.assert_allclose(prev + attn + ffn, res, rtol=1e-4, atol=1e-4 * np.abs(res).max())
    # and they are not all the same tensor
    assert np.abs(trace.tensors[("attention", 5)] - trace.tensors[("ffn", 5)]).max() > 1e-3


def test_too_long_sequence_is_unsupported(llama_engine):
    from ggufcheck.engines.base import Unsupported

    with pytest.raises(Unsupported, match="n_ctx"):
        llama_engine.score([1] * 200)
