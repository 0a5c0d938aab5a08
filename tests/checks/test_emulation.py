"""The baseline run that emulates an engine's precision class (reference.precision): its
rounding is gguf-py's, and its error against fp64 is the size of a real engine's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ggufcheck.checks.logits import collect
from ggufcheck.gguf.matmuls import matmul_weight_types
from ggufcheck.reference.precision import Emulation, emulation_for, round_as


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


def _zeroed_offsets(raw: np.ndarray, qtype: str, quant_bytes: tuple[int, int], block_bytes: int, group: int):
    """Each group's offset, derived without ggufcheck: gguf-py dequantizes the blocks with their
    quants zeroed, and what is left is ``o``."""
    import gguf.quants

    rows = raw.shape[0]
    z = raw.reshape(rows, -1, block_bytes).copy()
    z[..., quant_bytes[0]:quant_bytes[1]] = 0
    left = gguf.quants.dequantize(z.reshape(rows, -1), gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    return left.reshape(rows, -1, group)[..., 0]  # [out, groups]


def _q8(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded to 8-bit blocks of ``block`` values with an f16 scale, as CUDA's q8_1 stores them."""
    xb = x.reshape(*x.shape[:-1], -1, block)
    d = np.abs(xb).max(-1, keepdims=True) / 127.0
    return (np.round(xb / d) * d.astype(np.float16).astype(np.float64)).reshape(x.shape)


def _cuda_form(x, w, offsets, block, group, rounded_tail=0):
    """``sum((w - o) * r) + o * S`` per group, S the f16 sum of the unrounded x (of the rounded
    ones for the groups in the last ``rounded_tail`` values of each 128), written out in numpy."""
    r = _q8(x, block)
    t, n = x.shape
    ng = n // group
    rest = w - np.repeat(offsets, group, axis=-1)
    kept = x.reshape(t, ng, group).sum(-1).astype(np.float16).astype(np.float64)
    if rounded_tail:
        tail = (np.arange(ng) * group) % 128 >= 128 - rounded_tail
        kept = np.where(tail[None], r.reshape(t, ng, group).sum(-1), kept)
    return r @ rest.T + kept @ offsets.T


@pytest.mark.parametrize("qtype, form, block, group, tail", [
    ("Q2_K", "cuda-mmq", 64, 16, 32),  # D2S6: scales per 64, sums per 16, the last 32 of 128 rounded
    ("Q4_K", "cuda-mmq", 32, 32, 0),
    ("Q4_0", "cuda-mmvq", 32, 32, 0),  # the matrix-vector kernels' -8d offset times ds8.y
    ("Q5_0", "cuda-mmvq", 32, 32, 0),
])
def test_cudas_sum_forms_per_kernel_against_the_product_written_out(qtype, form, block, group, tail):
    """The emulation of each kernel's arithmetic (precision.SUMS_FORMS) against llama.cpp CUDA's
    product written out in numpy from offsets gguf-py derives, on random valid blocks; and the
    same weight under the other kernel's form where that one reads no sums is the plain rounding."""
    import gguf.quants

    from ggufcheck.gguf.quants.offsets import LAYOUT, group_offsets
    from ggufcheck.reference.layers import linear
    from ggufcheck.reference.precision import emulating

    rng = np.random.default_rng(3)
    n_out, n_in, rows = 16, 256, 5
    block_bytes = LAYOUT[qtype][0]
    raw = rng.integers(0, 256, (n_out, n_in // LAYOUT[qtype][1], block_bytes), dtype=np.uint8)
    f16_at = {"Q2_K": (80, 82), "Q4_K": (0, 2), "Q4_0": (0,), "Q5_0": (0,)}[qtype]
    for at in f16_at:
        raw[..., at:at + 2] = np.abs(rng.normal(0, 0.01, raw.shape[:2])).astype(np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(n_out, -1)
    quant_bytes = {"Q2_K": (16, 80), "Q4_K": (16, 144), "Q4_0": (2, 18), "Q5_0": (2, 22)}[qtype]
    offsets = _zeroed_offsets(raw, qtype, quant_bytes, block_bytes, group)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    x = rng.normal(0.1, 1.0, (rows, n_in))
    want = _cuda_form(x, w, offsets, block, group, tail)

    weight = torch.from_numpy(w.copy())
    weight.ggml_type = qtype
    weight.ggml_offsets = lambda: group_offsets(qtype, raw)
    with emulating(Emulation(activations="q8_0", block_sums=form)):
        got = linear(torch.from_numpy(x), weight).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())
    plain = _q8(x, 32) @ w.T
    assert np.abs(want - plain).max() > 1e-4 * np.abs(plain).max()  # the forms are different numbers
    other = "cuda-mmvq" if form == "cuda-mmq" else "cuda-mmq"
    if qtype in ("Q2_K", "Q4_K", "Q4_0", "Q5_0"):  # each reads sums in one kernel only
        with emulating(Emulation(activations="q8_0", block_sums=other)):
            np.testing.assert_allclose(linear(torch.from_numpy(x), weight).numpy(), plain, rtol=0,
                                       atol=1e-9 * np.abs(plain).max())


def test_the_decode_path_takes_its_own_form():
    e = Emulation(activations="q8_0", kv="f16", block_sums="cuda-mmq", decode_block_sums="cuda-mmvq")
    assert e.on_decode() == Emulation(activations="q8_0", kv="f16", block_sums="cuda-mmvq")
    assert Emulation(activations="q8_0").on_decode() == Emulation(activations="q8_0")
