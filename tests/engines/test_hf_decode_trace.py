"""transformers' decode path, layer by layer (HFEngine.decode_layer_outputs; issue 36 item 2).

The prompt in one forward, then one token per forward through transformers' own KV cache, as
``generate`` decodes: a healthy model's decode trace agrees with its prefill trace at every
layer, and a fault put into transformers' modules on one-token forwards only (one layer's MLP,
as a wrong matrix-vector kernel would be) is named by ``diagnose`` at that layer and block.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from ggufcheck.checks.path_layers import allowance_for  # noqa: E402
from ggufcheck.engines.spec import open_engine  # noqa: E402


def test_a_healthy_decode_trace_agrees_with_the_prefill_trace_at_every_layer(tiny_converted):
    engine = open_engine("hf:fp32", tiny_converted("llama").gguf_path)
    tokens = [1, 5, 9, 14, 3, 7, 11, 2, 8, 6]
    whole = engine.layer_outputs(tokens, ("residual", "ffn"))
    decoded = engine.decode_layer_outputs(tokens, 4, ("residual", "ffn"))
    assert set(decoded.tensors) == set(whole.tensors)
    for key, want in whole.tensors.items():
        got = decoded.tensors[key]
        assert got.shape == want.shape
        rel = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
        assert rel.max() <= allowance_for("fp32"), (key, rel.max())
    # the decode's last rows are what generate computes step by step
    gen = engine.generate(tokens[:4], 3)
    assert len(gen.generated) == 3


def _decode_only_mlp_fault(engine, layer: int) -> None:
    """One layer's MLP output with its second half scaled by 1.5 on one-token forwards only."""
    mlp = engine.module.model.layers[layer].mlp
    forward = mlp.forward

    def wrong_on_one_token(hidden, *a, **k):
        out = forward(hidden, *a, **k)
        if hidden.shape[-2] == 1:
            out = out.clone()
            out[..., out.shape[-1] // 2:] *= 1.5
        return out

    mlp.forward = wrong_on_one_token


@pytest.mark.parametrize("model,check", [("built", "logits.decode_kl_mean"), ("converted", "paths.decode_layers")])
def test_a_decode_only_fault_in_transformers_is_named_at_its_layer_and_block(tiny_gguf, tiny_converted, model, check):
    """On ggufcheck's tiny llama the fault moves the logits (the decode check fails and traces
    it); on the converted transformers llama (weights at std 0.02: the MLP barely reaches the
    logits, KL 3e-5 within the fp32 allowance) only the decode traced layer by layer sees it."""
    from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose

    path = tiny_gguf("llama", qtypes="F32").path if model == "built" else tiny_converted("llama").gguf_path
    engine = open_engine("hf:fp32", path)
    last = len(engine.module.model.layers) - 1
    _decode_only_mlp_fault(engine, last)
    try:
        d = diagnose(DiagnoseOptions(model=path, sanity=False, kernels=False, max_prompts=2), engine=engine)
    finally:
        engine.close()
    v = d.verdict
    assert (v.component, v.layer) == ("decode", last), v.message
    localized = v.evidence["stats"]["localized"]
    assert localized["block"] == "ffn" and "decode step" in v.message, v.message
    assert "the one-token decode first leaves the one prefill at layer" in v.message
    assert v.check == check
