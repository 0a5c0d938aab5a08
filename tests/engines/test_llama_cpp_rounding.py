"""Where llama.cpp rounds, per backend, as the baseline run emulates it (engines.llama_cpp).

CPU: activations go to the weight type's vec_dot_type (ggml-cpu's type traits: Q8_0 for the
32-block types and IQ4_NL, Q8_K for K-quants, the other IQ types and TQ). CUDA: mmq / mmvq
quantize activations to Q8_1 blocks of 32 for every type (ggml-cuda's quantize_q8_1), and
F16 / BF16 weights go through cuBLAS, whose output is rounded to the type.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ggufcheck.engines.llama_cpp import gpu_rounding, rounding

F16_CACHE = SimpleNamespace(type_k=1, type_v=1)


@pytest.mark.parametrize("qtype,cpu,cuda", [
    ("Q8_0", "q8_0", "q8_0"), ("IQ4_NL", "q8_0", "q8_0"),
    ("Q6_K", "q8_k", "q8_0"), ("IQ2_XXS", "q8_k", "q8_0"), ("IQ4_XS", "q8_k", "q8_0"),
])
def test_activation_rounding_per_backend(tiny_gguf, qtype, cpu, cuda):
    from ggufcheck.checks.quant_matrix import MATRIX_DIMS

    path = tiny_gguf("llama", qtypes=qtype, **MATRIX_DIMS).path
    assert rounding(path, F16_CACHE) == {"activations": cpu, "kv": "f16"}
    assert gpu_rounding(path, F16_CACHE) == {"activations": cuda, "kv": "f16"}


CUDA_SUMS = {"block_sums": "cuda-mmq", "decode_block_sums": "cuda-mmvq"}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K", "IQ1_S"])
def test_offset_types_take_cudas_unrounded_block_sums_on_the_gpu_only(tiny_gguf, qtype):
    """docs/real-world-cases.md case 4: CUDA's q8_1 keeps the activations' group sums before
    rounding, which a weight's group offset multiplies (in the kernels SUMS_FORMS names for each
    path); the CPU's sums are of the rounded values (the plain emulation)."""
    from ggufcheck.checks.quant_matrix import MATRIX_DIMS

    path = tiny_gguf("llama", qtypes=qtype, **MATRIX_DIMS).path
    act = "q8_k" if qtype[-1] == "K" or qtype.startswith("IQ") else "q8_0"
    assert rounding(path, F16_CACHE) == {"activations": act, "kv": "f16"}
    assert gpu_rounding(path, F16_CACHE) == {"activations": "q8_0", "kv": "f16", **CUDA_SUMS}


def test_gpu_rounding_never_imports_torch(tiny_gguf):
    """It runs inside the CUDA engine's own process, where torch must never be loaded (a CUDA
    libllama dies at model load next to it: docs/real-world-cases.md, engines/isolated.py);
    a first version imported reference.precision and every GPU engine died at start."""
    import subprocess
    import sys

    from ggufcheck.engines.llama_cpp import CUDA_MMQ_SUM_TYPES, CUDA_MMVQ_SUM_TYPES
    from ggufcheck.reference.precision import SUMS_FORMS

    assert CUDA_MMQ_SUM_TYPES == set(SUMS_FORMS["cuda-mmq"]) and CUDA_MMVQ_SUM_TYPES == set(SUMS_FORMS["cuda-mmvq"])
    path = tiny_gguf("llama", qtypes="Q4_1", n_embd=256, head_dim=64, n_ff=512).path
    code = ("import sys, types; from ggufcheck.engines.llama_cpp import gpu_rounding; "
            f"print(gpu_rounding({str(path)!r}, types.SimpleNamespace(type_k=1, type_v=1))); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "block_sums" in done.stdout


def test_the_reference_knows_each_weights_stored_type(tiny_gguf):
    """The block sums apply per weight (SmolLM2's tied head is Q8_0 among Q4_1 layers): the
    reference's weight store tags what it dequantized with the file's type."""
    from ggufcheck.reference.model import ReferenceModel

    built = tiny_gguf("llama", qtypes={"attn_q": "Q4_1", "default": "Q8_0"}, n_embd=256, head_dim=64, n_ff=512)
    model = ReferenceModel(built.path, dtype="fp32")
    layer = model.weights.layer(0)
    assert layer["attn_q.weight"].ggml_type == "Q4_1" and layer["ffn_up.weight"].ggml_type == "Q8_0"
    (_, head), = model.weights.head_chunks(1 << 20)
    assert head.ggml_type == model.gguf.tensors["output.weight" if model.weights.has("output.weight")
                                                else "token_embd.weight"].qtype.name


def test_f16_and_bf16_weights_take_the_cuda_float_paths_with_f32_results(tiny_gguf):
    """ggml-cuda returns every matmul in f32 (cuBLAS's F16 compute type aside, which float_sums
    states): no output rounding is stated; BF16 files take the float paths too."""
    path = tiny_gguf("llama", qtypes="F16").path
    assert rounding(path, F16_CACHE) == {"activations": "f16", "kv": "f16"}
    assert gpu_rounding(path, F16_CACHE) == {"activations": "f16", "kv": "f16", "float_sums": "cuda"}
    assert gpu_rounding(tiny_gguf("llama", qtypes="BF16").path, F16_CACHE)["float_sums"] == "cuda"
    assert "kv" not in rounding(path, SimpleNamespace(type_k=0, type_v=0))  # an F32 cache does not round


def test_unquantized_matmul_weights_take_the_tensor_core_paths_on_cuda(tiny_gguf):
    """F32 / F16 layer weights or head: ggml-cuda's TF32 and cuBLAS-F16 paths are stated
    (precision.Emulation.float_form); a quantized file whose only F32 tensors are norms is not."""
    f32 = tiny_gguf("llama", qtypes="F32").path
    assert gpu_rounding(f32, F16_CACHE) == {"kv": "f16", "float_sums": "cuda"}
    assert "float_sums" not in rounding(f32, F16_CACHE)
    q8 = tiny_gguf("llama", qtypes="Q8_0").path
    assert "float_sums" not in gpu_rounding(q8, F16_CACHE)
    mixed = tiny_gguf("llama", qtypes={"output": "F16", "default": "Q8_0"}).path
    assert gpu_rounding(mixed, F16_CACHE)["float_sums"] == "cuda"
