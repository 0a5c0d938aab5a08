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
    ("Q4_0", "q8_0", "q8_0"), ("Q8_0", "q8_0", "q8_0"), ("IQ4_NL", "q8_0", "q8_0"),
    ("Q4_K", "q8_k", "q8_0"), ("Q6_K", "q8_k", "q8_0"), ("IQ2_XXS", "q8_k", "q8_0"), ("IQ4_XS", "q8_k", "q8_0"),
])
def test_activation_rounding_per_backend(tiny_gguf, qtype, cpu, cuda):
    from ggufcheck.checks.quant_matrix import MATRIX_DIMS

    path = tiny_gguf("llama", qtypes=qtype, **MATRIX_DIMS).path
    assert rounding(path, F16_CACHE) == {"activations": cpu, "kv": "f16"}
    assert gpu_rounding(path, F16_CACHE) == {"activations": cuda, "kv": "f16"}


def test_f16_weights_round_matmul_outputs_on_cuda_only(tiny_gguf):
    path = tiny_gguf("llama", qtypes="F16").path
    assert rounding(path, F16_CACHE) == {"activations": "f16", "kv": "f16"}
    assert gpu_rounding(path, F16_CACHE) == {"activations": "f16", "outputs": "f16", "kv": "f16"}
    assert "kv" not in rounding(path, SimpleNamespace(type_k=0, type_v=0))  # an F32 cache does not round
