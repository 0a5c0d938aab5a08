"""Two independent producers agree: llama.cpp's converter and our own tiny writer.

For every architecture the converted file (transformers' model run through llama.cpp's
convert_hf_to_gguf.py) must have exactly the tensor names and numpy shapes, and exactly the
``{arch}.*`` metadata keys, value types and values, that ggufcheck.synthetic.tiny computes
from the same dimensions. Then the converted data is checked against the HF checkpoint
for the tensors whose layout is a plain copy, a stack or the kv_b split.

Converted files carry SmolLM2's 49152-token vocabulary, which gguf-py's reader takes
seconds to parse, so they are read here with ggufcheck's validated reader (itself tested
against gguf-py in tests/gguf/); our own files are read with gguf-py in test_tiny.py.
"""

from __future__ import annotations

import dataclasses
import functools

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ggufcheck.testing import convert
from ggufcheck.synthetic.tiny import metadata, tensor_shapes, tiny_dims

pytestmark = pytest.mark.hf


def _own_dims(arch: str):
    base = "deepseek2" if arch == "deepseek2-yarn" else arch
    d = tiny_dims(base, n_vocab=convert.VOCAB_SIZE)
    if arch == "deepseek2-yarn":
        rope = convert.HF_CONFIGS[arch][2]["rope_parameters"]
        d = dataclasses.replace(d, yarn_factor=rope["factor"],
                                yarn_orig_ctx=rope["original_max_position_embeddings"],
                                yarn_log_mul=0.1 * rope["mscale_all_dim"])
    return d


@functools.lru_cache(maxsize=None)
def _open(path):
    from ggufcheck.gguf.reader import open_gguf

    return open_gguf(path)  # kept open for the session: read-only mmaps of cached files


def _shapes(model):
    return {name: info.shape for name, info in model.tensors.items()}


def _values(model, name) -> np.ndarray:
    info = model.tensors[name]
    return gguf.quants.dequantize(model.raw(name), info.qtype).reshape(info.shape)


@pytest.mark.parametrize("arch", convert.ARCHS)
def test_same_tensor_names_and_shapes(tiny_converted, arch):
    model = _open(tiny_converted(arch, "f32").gguf_path)
    assert _shapes(model) == tensor_shapes(_own_dims(arch))
    assert all(info.qtype == Q.F32 for info in model.tensors.values())


@pytest.mark.parametrize("arch", convert.ARCHS)
def test_same_arch_metadata(tiny_converted, arch):
    model = _open(tiny_converted(arch, "f32").gguf_path)
    own = metadata(_own_dims(arch))
    gguf_arch = own["general.architecture"][0]
    assert model.architecture == gguf_arch
    theirs = {k for k in model.metadata if k.startswith(gguf_arch + ".")}
    ours = {k: v for k, v in own.items() if k.startswith(gguf_arch + ".")}
    assert theirs == set(ours)
    for key, (value, vtype) in ours.items():
        assert int(model.field_type(key).type) == int(vtype), key
        got = model.metadata[key]
        assert got == (pytest.approx(value, rel=1e-6) if vtype == gguf.GGUFValueType.FLOAT32 else value), key


@pytest.mark.parametrize("arch", convert.ARCHS)
def test_q8_0_file_matches_f32_file_within_quantization_error(tiny_converted, arch):
    f32 = _open(tiny_converted(arch, "f32").gguf_path)
    q8 = _open(tiny_converted(arch, "q8_0").gguf_path)
    assert _shapes(q8) == _shapes(f32)
    n_q8 = 0
    for name, info in q8.tensors.items():
        x, w = _values(q8, name), _values(f32, name)
        bound = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 1e-2}[info.qtype]
        assert np.abs(x - w).max() <= bound * np.abs(w).max() + 1e-8, name
        n_q8 += info.qtype == Q.Q8_0
    assert n_q8 >= len(q8.tensors) // 3  # most matrices really are Q8_0


@pytest.mark.parametrize("arch", convert.ARCHS)
def test_converted_data_equals_hf_checkpoint(tiny_converted, arch):
    safetensors = pytest.importorskip("safetensors.numpy")
    m = tiny_converted(arch, "f32")
    hf = safetensors.load_file(m.hf_dir / "model.safetensors")
    model = _open(m.gguf_path)
    g = {name: _values(model, name) for name in model.tensors}
    d = _own_dims(arch)
    np.testing.assert_array_equal(g["token_embd.weight"], hf["model.embed_tokens.weight"])
    if "lm_head.weight" in hf:  # gemma3 ties its output to the embeddings
        np.testing.assert_array_equal(g["output.weight"], hf["lm_head.weight"])
    else:
        assert "output.weight" not in g
    shift = 1.0 if arch == "gemma3" else 0.0  # Gemma's norms are stored as 1 + w (conversion/gemma.py)
    np.testing.assert_array_equal(g["output_norm.weight"], hf["model.norm.weight"] + shift)
    assert np.abs(g["output_norm.weight"] - 1).max() > 0.01  # perturbed away from init
    if d.n_expert:
        i = d.n_dense_lead
        if f"blk.{i}.exp_probs_b.bias" in g:  # the DeepSeek-V3-style routers (not qwen3moe)
            bias = hf[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
            assert np.abs(bias).min() > 0  # nonzero router bias, as promised
            np.testing.assert_array_equal(g[f"blk.{i}.exp_probs_b.bias"], bias)
        if arch == "gpt-oss":  # fused [E, D, 2Fe], gate at the even columns (conversion/gpt_oss.py)
            stacked = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"][..., ::2].transpose(0, 2, 1)
        else:
            stacked = np.stack([hf[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"]
                                for e in range(d.n_expert)])  # [E, Fe, D]
        np.testing.assert_array_equal(g[f"blk.{i}.ffn_gate_exps.weight"], stacked)
    if d.kv_lora_rank:
        H, P, V, L = d.n_head, d.qk_nope, d.v_head_dim, d.kv_lora_rank
        kv_b = hf["model.layers.0.self_attn.kv_b_proj.weight"].reshape(H, P + V, L)
        np.testing.assert_array_equal(g["blk.0.attn_k_b.weight"], kv_b[:, :P].transpose(0, 2, 1))  # [H, L, P]
        np.testing.assert_array_equal(g["blk.0.attn_v_b.weight"], kv_b[:, P:])  # [H, V, L]
