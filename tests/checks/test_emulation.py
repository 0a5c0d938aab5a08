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


def _q4_1_blocks(raw: np.ndarray, n_out: int, n_in: int):
    """A Q4_1 matrix's raw bytes read by hand: scale d and offset m (f16) and 32 nibbles a block
    (low nibbles are values 0..15 of a block, high nibbles 16..31: ggml's block_q4_1)."""
    blocks = raw.reshape(n_out, n_in // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64)  # [out, nb, 32]
    return d, m, q


def test_cuda_block_sums_are_cudas_q8_1_product_computed_from_the_raw_blocks():
    """precision.unrounded_sums_error against llama.cpp CUDA's q8_1 product written out from a
    Q4_1 matrix's own bytes (vec_dot_q4_1_q8_1: d_w*d_x*sum(q*r) + m*s, with s the f16 sum of the
    activations before rounding); the CPU's form (s from the rounded values) is the plain
    emulation. The two forms are different numbers, and the CUDA one is further from exact."""
    import gguf.quants

    from ggufcheck.reference.layers import linear
    from ggufcheck.reference.precision import emulating

    rng = np.random.default_rng(0)
    n_out, n_in, rows = 24, 256, 5
    w = rng.normal(0, 0.05, (n_out, n_in)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    d_w, m_w, q_w = _q4_1_blocks(raw, n_out, n_in)
    weight = torch.from_numpy(d_w[..., None] * q_w + m_w[..., None]).reshape(n_out, n_in)
    weight.ggml_type = "Q4_1"  # as the reference's WeightStore tags what it dequantized
    x = torch.from_numpy(rng.normal(0.1, 1.0, (rows, n_in)))

    xb = x.numpy().reshape(rows, n_in // 32, 32)
    amax = np.abs(xb).max(-1)
    r = np.round(xb / (amax / 127.0)[..., None])
    d_x = (amax / 127.0).astype(np.float16).astype(np.float64)
    s = xb.sum(-1).astype(np.float16).astype(np.float64)
    cuda = (np.einsum("onk,tnk->ton", q_w, r) * d_w[None] * d_x[:, None] + m_w[None] * s[:, None]).sum(-1)
    cpu = (np.einsum("onk,tnk->ton", q_w, r) * d_w[None] * d_x[:, None]
           + m_w[None] * (d_x * r.sum(-1))[:, None]).sum(-1)
    exact = x.numpy() @ weight.numpy().T

    with emulating(Emulation(activations="q8_0", block_sums="unrounded")):
        got_cuda = linear(x, weight).numpy()
    with emulating(Emulation(activations="q8_0")):
        got_cpu = linear(x, weight).numpy()
    np.testing.assert_allclose(got_cuda, cuda, rtol=0, atol=1e-9 * np.abs(cuda).max())
    np.testing.assert_allclose(got_cpu, cpu, rtol=0, atol=1e-9 * np.abs(cpu).max())
    err = lambda y: float(np.linalg.norm(y - exact) / np.linalg.norm(exact))  # noqa: E731
    weight.ggml_type = "Q8_0"  # a type without an offset (and so the tied Q8_0 head): the CPU's form
    with emulating(Emulation(activations="q8_0", block_sums="unrounded")):
        np.testing.assert_array_equal(linear(x, weight).numpy(), got_cpu)
    assert err(got_cuda) > 1.5 * err(got_cpu), (err(got_cuda), err(got_cpu))
