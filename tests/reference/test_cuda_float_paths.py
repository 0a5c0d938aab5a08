"""ggufcheck's emulation of ggml-cuda's tensor-core paths for unquantized weights
(reference.precision: ``float_sums`` ``cuda``), each against an implementation written
another way: TF32 operands by per-value arithmetic on the mantissa (math.frexp), cuBLAS's F16
compute type by a numpy loop with float16 accumulation, and the kernel choice by the column
limits in ggml-cuda's dispatch (mmvf.cu, mmf.cu)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ggufcheck.reference.precision import (CUDA_F32_VECTOR_MAX, CUDA_MMF_MAX, Emulation, emulating,
                                           linear_f16_sums, round_tf32, truncate_tf32)


def tf32_by_frexp(v: float) -> float:
    """v rounded to 11 significant bits (TF32: 10 stored), ties away from zero."""
    if v == 0 or not math.isfinite(v):
        return v
    m, e = math.frexp(v)  # v = m * 2**e, 0.5 <= |m| < 1
    scaled = abs(m) * 2 ** 11
    q = math.floor(scaled + 0.5)
    return math.copysign(q * 2.0 ** (e - 11), v)


def test_tf32_rounding_matches_per_value_arithmetic():
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.normal(0, 1, 2000), rng.normal(0, 1e-20, 200), rng.normal(0, 1e20, 200),
                        [0.0, -0.0, 1.0, -1.0, 1 + 2 ** -11, 1 + 3 * 2 ** -12, 65504.0]]).astype(np.float32)
    got = round_tf32(torch.from_numpy(v.astype(np.float64))).numpy()
    want = np.array([tf32_by_frexp(float(x)) for x in v])
    assert np.array_equal(got, want)
    assert torch.isnan(round_tf32(torch.tensor([float("nan")], dtype=torch.float64))).all()


def tf32_cut_by_frexp(v: float) -> float:
    """v cut to 11 significant bits (TF32: 10 stored), toward zero."""
    if v == 0 or not math.isfinite(v):
        return v
    m, e = math.frexp(v)
    return math.copysign(math.floor(abs(m) * 2 ** 11) * 2.0 ** (e - 11), v)


def test_tf32_truncation_matches_per_value_arithmetic():
    """What a tf32 mma makes of raw f32 bits (ggml's mmf kernels): the low 13 bits ignored."""
    rng = np.random.default_rng(3)
    v = np.concatenate([rng.normal(0, 1, 2000), rng.normal(0, 1e-20, 200), rng.normal(0, 1e20, 200),
                        [0.0, -0.0, 1.0, -1.0, 1 + 2 ** -11, -(1 + 2 ** -12), 65504.0]]).astype(np.float32)
    got = truncate_tf32(torch.from_numpy(v.astype(np.float64))).numpy()
    want = np.array([tf32_cut_by_frexp(float(x)) for x in v])
    assert np.array_equal(got, want)
    assert (np.abs(got) <= np.abs(v)).all() and not np.array_equal(got, round_tf32(torch.from_numpy(
        v.astype(np.float64))).numpy())


def f16_sums_numpy(x: np.ndarray, w: np.ndarray, step: int = 16) -> np.ndarray:
    """x [T, n] @ w [m, n].T with a float16 running sum, rounded after every ``step`` products."""
    xs, ws = x.astype(np.float16).astype(np.float64), w.astype(np.float16).astype(np.float64)
    out = np.zeros((x.shape[0], w.shape[0]), dtype=np.float16)
    for t in range(x.shape[0]):
        for o in range(w.shape[0]):
            acc = np.float16(0)
            for s in range(0, x.shape[1], step):
                acc = np.float16(float(acc) + float(np.dot(xs[t, s:s + step], ws[o, s:s + step])))
            out[t, o] = acc
    return out.astype(np.float64)


def test_f16_sums_match_a_float16_accumulator():
    """Small integers: every partial sum is exact in fp64, so the two implementations must agree
    bit for bit, and past 2048 the f16 running sum rounds (odd integers are not representable)."""
    rng = np.random.default_rng(1)
    x, w = rng.integers(-40, 41, (5, 256)).astype(np.float64), rng.integers(-40, 41, (7, 256)).astype(np.float64)
    got = linear_f16_sums(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    assert np.array_equal(got, f16_sums_numpy(x, w))
    assert not np.array_equal(got, x @ w.T)  # the f16 running sum did round here


def test_f16_sums_err_more_than_one_f16_rounding_of_the_result():
    """The running sum's roundings add up with the width: well above rounding the exact product once."""
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.normal(0, 1, (32, 1024)))
    w = torch.from_numpy(rng.normal(0, 0.05, (64, 1024)).astype(np.float16).astype(np.float64))
    exact = x.to(torch.float16).double() @ w.T
    once = (exact.to(torch.float16).double() - exact).abs().mean()
    summed = (linear_f16_sums(x, w) - exact).abs().mean()
    assert summed > 2 * once, (float(summed), float(once))


def tagged(t: torch.Tensor, kind: str) -> torch.Tensor:
    t.ggml_type = kind
    return t


def fits(kind: str) -> torch.Tensor:  # a shape ggml's mma kernels (mmf) take: 32-multiples of rows and values
    return tagged(torch.zeros(64, 128, dtype=torch.float64), kind)


@pytest.mark.parametrize("kind,limit,small,mmf,cublas", [("F32", CUDA_F32_VECTOR_MAX, "vector", "tf32-rz", "tf32"),
                                                         ("F16", 1, "f16-vector-sums", "mma", "f16-sums")])
def test_the_kernel_follows_ggml_cudas_column_limits(kind, limit, small, mmf, cublas):
    """mmvf.cu: F32 weights take the f32 vector kernel for at most 3 columns, F16 its half-sums
    form for one; ggml's
    mma kernels (mmf.cu) up to 16 columns (F32 as raw bits to the tf32 instruction: cut), then
    cuBLAS (TF32 math, to nearest; F16: CUBLAS_COMPUTE_16F); quantized weights are not touched."""
    stated = Emulation(float_sums="cuda")
    assert stated.for_batch(limit).float_form(fits(kind)) == small
    assert stated.for_batch(limit + 1).float_form(fits(kind)) == mmf
    assert stated.for_batch(CUDA_MMF_MAX).float_form(fits(kind)) == mmf
    assert stated.for_batch(CUDA_MMF_MAX + 1).float_form(fits(kind)) == cublas
    assert Emulation().for_batch(limit + 1).float_form(fits(kind)) is None  # not stated: exact
    assert stated.for_batch(64).float_form(tagged(torch.zeros(64, 128), "Q4_K")) is None


def test_a_shape_mmf_does_not_take_goes_to_cublas():
    """mmf.cu's shape rule: a router of 8 experts (8 rows) is multiplied by cuBLAS at 2-16 tokens."""
    stated = Emulation(float_sums="cuda")
    assert stated.for_batch(8).float_form(tagged(torch.zeros(8, 128), "F32")) == "tf32"
    assert stated.for_batch(8).float_form(tagged(torch.zeros(8, 128), "F16")) == "f16-sums"
    assert stated.for_batch(8).float_form(tagged(torch.zeros(64, 96), "F16")) == "f16-sums"  # 96 % 64


def test_the_reference_multiplies_through_the_stated_path(tiny_gguf):
    """Wired through layers.linear: an F16 model's prefill of more than 16 tokens moves away
    from fp64 under the stated cuBLAS path, one of at most 16 tokens rounds only as before."""
    from ggufcheck.reference.model import ReferenceModel

    model = ReferenceModel(tiny_gguf("llama", qtypes="F16", n_embd=256, head_dim=64, n_ff=512).path, dtype="fp64")
    plain = Emulation(activations="f16", outputs="f16", kv="f16")
    cuda = Emulation(activations="f16", outputs="f16", kv="f16", float_sums="cuda")
    for tokens, moves in ((12, False), (24, True)):
        ids = list(range(3, 3 + tokens))
        truth = model.forward(ids)[0]
        errors = []
        for emulation in (plain, cuda):
            model.emulation = emulation
            errors.append(float((model.forward(ids)[0] - truth).abs().max()))
            model.emulation = None
        assert (errors[1] > 1.5 * errors[0]) == moves, (tokens, errors)


def test_one_token_and_bf16_take_their_kernels_rounding():
    """mmvf (one column): BF16 with f32 activations, sums and result (F16: half sums); BF16 in mmf
    and in cuBLAS: bf16 operands, f32 sums and an f32 result (ggml-cuda.cu: prefer_f32_output)."""
    stated = Emulation(float_sums="cuda")
    assert stated.for_batch(1).float_form(fits("BF16")) == "vector"
    assert stated.for_batch(1).float_form(fits("F16")) == "f16-vector-sums"
    for kind in ("F16", "BF16"):
        assert stated.for_batch(8).float_form(fits(kind)) == "mma"
    assert stated.for_batch(64).float_form(fits("BF16")) == "mma"


def expert(kind: str, rows: int = 64, glu: bool = False) -> torch.Tensor:
    w = tagged(torch.zeros(rows, 128), kind)
    w.ggml_expert = True
    if glu:
        w.ggml_glu = True
    return w


def test_routed_experts_follow_mul_mat_id_and_cublas_f32_turns_f16_into_tf32():
    """mul_mat_id (ggml_cuda_mul_mat_id): experts take ggml's mma kernels up to 512 tokens (128
    for experts of over 1024 rows; F32 cut to TF32), cuBLAS past that; on one token the gate and
    up are fused with the GLU into the f32 vector kernel (F16 / BF16 stacks of at most 512 rows),
    unless fusion is off; GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 makes cuBLAS multiply F16 in TF32."""
    stated = Emulation(float_sums="cuda")
    assert stated.for_batch(1).float_form(expert("F32")) == "tf32-rz"  # down
    assert stated.for_batch(1).float_form(expert("F32", glu=True)) == "vector"
    assert stated.for_batch(1).float_form(expert("F32", rows=2048, glu=True)) == "vector"
    assert Emulation(float_sums="cuda", glu_fusion=False).for_batch(1).float_form(expert("F32", glu=True)) \
        == "tf32-rz"
    assert stated.for_batch(1).float_form(expert("F16", glu=True)) == "vector"
    assert stated.for_batch(1).float_form(expert("F16", rows=768, glu=True)) == "mma"
    assert stated.for_batch(1).float_form(expert("F16")) == "mma"
    assert stated.for_batch(64).float_form(expert("F16")) == "mma"
    assert stated.for_batch(600).float_form(expert("F16")) == "f16-sums"
    assert stated.for_batch(200).float_form(expert("F16", rows=2048)) == "f16-sums"
    assert stated.for_batch(200).float_form(expert("F32", rows=2048)) == "tf32"
    forced = Emulation(float_sums="cuda-cublas-f32")
    assert forced.for_batch(64).float_form(fits("F16")) == "tf32"
    assert forced.for_batch(2).float_form(fits("F16")) == "mma"


def test_the_engine_states_cublas_f32_when_its_process_forces_it(tiny_gguf, monkeypatch):
    from types import SimpleNamespace

    from ggufcheck.engines.llama_cpp import gpu_rounding

    path = tiny_gguf("llama", qtypes="F16").path
    params = SimpleNamespace(type_k=1, type_v=1)
    assert gpu_rounding(path, params)["float_sums"] == "cuda"
    monkeypatch.setenv("GGML_CUDA_CUBLAS_COMPUTE_TYPE", "f32")
    assert gpu_rounding(path, params)["float_sums"] == "cuda-cublas-f32"


def test_a_moes_experts_are_tagged_as_experts_with_their_stored_type(tiny_gguf):
    """Resident stacks and per-expert reads alike: what float_form and the block sums read."""
    from ggufcheck.reference import layers
    from ggufcheck.reference.model import ReferenceModel

    model = ReferenceModel(tiny_gguf("qwen3moe", qtypes="F32").path, dtype="fp64")
    seen = []
    original = layers.linear

    def spy(x, weight, bias=None):
        seen.append((getattr(weight, "ggml_type", None), getattr(weight, "ggml_expert", False)))
        return original(x, weight, bias)

    layers.linear = spy
    try:
        model.forward([3, 4, 5])
    finally:
        layers.linear = original
    assert ("F32", True) in seen and ("F32", False) in seen


def test_a_prompt_in_pieces_takes_the_pieces_kernels(tiny_gguf):
    """n_batch=8: llama.cpp feeds a long prompt 8 tokens at a time, so its kernels are the small
    batches' (mmf for F16, the decode forms for quantized weights), whatever the prompt's length;
    the engine states the piece size from its context (min of n_batch and n_ubatch)."""
    from types import SimpleNamespace

    from ggufcheck.engines.llama_cpp import gpu_rounding

    f16 = fits("F16")
    assert Emulation(float_sums="cuda").for_batch(64).float_form(f16) == "f16-sums"
    pieces = Emulation(float_sums="cuda", ubatch=8, block_sums="cuda-mmq", decode_block_sums="cuda-mmvq")
    assert pieces.for_batch(64).float_form(f16) == "mma" and pieces.for_batch(64).block_sums == "cuda-mmvq"
    path = tiny_gguf("llama", qtypes="F16").path
    assert gpu_rounding(path, SimpleNamespace(type_k=1, type_v=1, n_batch=8, n_ubatch=512))["ubatch"] == 8
    assert gpu_rounding(path, SimpleNamespace(type_k=1, type_v=1, n_batch=512, n_ubatch=512))["ubatch"] == 512


def f16_vector_sums_numpy(x: np.ndarray, w: np.ndarray, threads: int) -> np.ndarray:
    """mmvf.cu's half-precision path, thread by thread: thread t takes column pairs t, t + B, ...,
    keeping a float16 running sum per half (each step a fused multiply-add: the exact product
    added, then one rounding), then adds its two halves and the threads add theirs."""
    xs = x.astype(np.float16).astype(np.float64)
    out = np.zeros((x.shape[0], w.shape[0]))
    pairs = x.shape[1] // 2
    for r in range(x.shape[0]):
        for o in range(w.shape[0]):
            total = 0.0
            for t in range(threads):
                low = high = np.float16(0)
                for c2 in range(t, pairs, threads):
                    low = np.float16(float(low) + float(w[o, 2 * c2]) * xs[r, 2 * c2])
                    high = np.float16(float(high) + float(w[o, 2 * c2 + 1]) * xs[r, 2 * c2 + 1])
                total += float(low) + float(high)
            out[r, o] = total
    return out


@pytest.mark.parametrize("n,threads", [(256, 128), (576, 160), (1024, 256)])
def test_f16_vector_sums_match_the_kernel_thread_by_thread(n, threads):
    """The vector kernel's block size as its launcher picks it, and its half2 sums, bit for bit
    on values whose products and partial sums are exact in fp64 (the f16 rounding is the only
    one); the f16 running sums do round here (they differ from the exact product)."""
    from ggufcheck.reference.precision import linear_f16_vector_sums, mmvf_block_size

    assert mmvf_block_size(n) == threads
    rng = np.random.default_rng(n)
    x = rng.integers(-60, 61, (2, n)).astype(np.float64) / 4
    w = rng.integers(-60, 61, (5, n)).astype(np.float64)
    got = linear_f16_vector_sums(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    assert np.array_equal(got, f16_vector_sums_numpy(x, w, threads))
    if n == 1024:
        assert not np.array_equal(got, x @ w.T)


def test_an_f16_one_token_step_sums_in_halves_but_a_fused_glu_and_an_f32_node_do_not():
    """mmvf's precision comes from the node: the default (half sums) for a plain F16 matmul, f32
    sums for gate / up fused with their GLU (the GLU's op parameter is read as the precision)
    and for a node llama.cpp asks f32 sums of (GLM-4's output projections)."""
    stated = Emulation(float_sums="cuda")
    assert stated.for_batch(1).float_form(fits("F16")) == "f16-vector-sums"
    gate = fits("F16")
    gate.ggml_glu = True
    assert stated.for_batch(1).float_form(gate) == "vector"
    assert Emulation(float_sums="cuda", glu_fusion=False).for_batch(1).float_form(gate) == "f16-vector-sums"
    wo = fits("F16")
    wo.ggml_f32_sums = True
    assert stated.for_batch(1).float_form(wo) == "vector"
    assert stated.for_batch(64).float_form(wo) == "tf32"  # cuBLAS in its F32 compute type
    assert stated.for_batch(1).float_form(fits("BF16")) == "vector"


def test_the_weight_store_tags_the_matmuls_llama_cpp_asks_f32_sums_of(tiny_gguf):
    """llama-graph.cpp asks f32 sums of GLM-4's attention output and FFN down projections
    (ggml_prec_set_acc); the reference's weight store tags them so, and no other family's."""
    from ggufcheck.reference.model import ReferenceModel

    glm = ReferenceModel(tiny_gguf("glm4moe", qtypes="F16").path, dtype="fp64")
    layer = glm.weights.layer(0)
    assert layer["attn_output.weight"].ggml_f32_sums and layer["ffn_down.weight"].ggml_f32_sums
    assert not hasattr(layer["attn_q.weight"], "ggml_f32_sums")
    llama = ReferenceModel(tiny_gguf("llama", qtypes="F16").path, dtype="fp64").weights.layer(0)
    assert not hasattr(llama["attn_output.weight"], "ggml_f32_sums")
