"""The baseline run that emulates an engine's precision class (reference.precision): its
rounding is gguf-py's, and its error against fp64 is the size of a real engine's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ggufcheck.checks.logits import collect
from ggufcheck.reference.precision import Emulation, emulation_for, matmul_weight_types, round_as


def test_q8_0_rounding_is_gguf_pys_quantize_dequantize():
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    x = np.random.default_rng(0).normal(0, 3, size=(16, 256)).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block
    want = quants.dequantize(quants.quantize(x, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    got = round_as(torch.from_numpy(x).double(), "q8_0").numpy()
    assert np.abs(got - want).max() <= 1e-6 * np.abs(x).max()


def test_emulations_of_each_class():
    assert emulation_for("fp32", ["Q4_K"]) is None
    assert emulation_for("q8", ["Q4_K", "Q4_K", "Q6_K", "Q8_0"]) == Emulation(activations="q8_k", kv="f16")
    assert emulation_for("q8", ["Q4_1"]) == Emulation(activations="q8_0", kv="f16")
    assert emulation_for("q8", ["F16"]) == Emulation(kv="f16")
    assert emulation_for("bf16", ["F32"]) == Emulation("bf16", "bf16", "bf16")


def test_q8_emulation_errs_like_llama_cpp_on_smollm2(llama, sequences, smollm2_path):
    """Measured against an independent engine: the fp32 reference emulating llama.cpp's q8
    class differs from fp64 by the same order as llama.cpp itself (measured: KL 0.0048 and
    0.0056 on these three prompts), ten orders of magnitude above plain fp32 (1.5e-11)."""
    from ggufcheck.engines.reference import ReferenceEngine

    with ReferenceEngine(smollm2_path, dtype="fp64") as ref:
        emulation = emulation_for(llama.capabilities.activation_dtype, matmul_weight_types(ref.model.gguf.tensors))
        assert emulation == Emulation(activations="q8_0", kv="f16")  # Q4_1 weights, f16 KV cache
        truth = [ref.score(s) for s in sequences]
    with ReferenceEngine(smollm2_path, dtype="fp32", emulate=emulation) as emulated:
        kl_emulated = float(np.mean(collect(list(zip(truth, [emulated.score(s) for s in sequences]))).kl))
        assert "emulating activations q8_0, KV cache f16" in emulated.name
    kl_engine = float(np.mean(collect(list(zip(truth, [llama.score(s) for s in sequences]))).kl))
    assert 1 / 3 <= kl_emulated / kl_engine <= 3, (kl_emulated, kl_engine)


def test_llama_cpp_says_where_it_rounds(tiny_gguf):
    """F32 weights with the default f16 KV cache: only the cache; Q8_0 weights: Q8_0 activations;
    Q4_K: Q8_K; an F32 cache: nothing for the cache (llama.cpp's own type_k / type_v)."""
    pytest.importorskip("llama_cpp")
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    f32, q8, q4k = (tiny_gguf("llama", qtypes=q, n_embd=256).path for q in ("F32", "Q8_0", "Q4_K"))
    cases = ((f32, {}, {"kv": "f16"}), (q8, {}, {"activations": "q8_0", "kv": "f16"}),
             (q4k, {}, {"activations": "q8_k", "kv": "f16"}), (q8, {"type_k": 0, "type_v": 0}, {"activations": "q8_0"}))
    for path, kwargs, want in cases:
        with LlamaCppEngine(path, n_ctx=64, n_threads=1, **kwargs) as engine:
            assert dict(engine.capabilities.rounding) == want, (path.name, kwargs)
