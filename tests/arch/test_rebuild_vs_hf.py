"""The independent check of the tensor tables: tiny random transformers models, converted by
llama.cpp's own converter, rebuilt by ggufcheck into HF layout, compared with the
transformers weights they came from. Every HF parameter must be covered and every GGUF
tensor used. F32 files must match exactly; F16 files exactly after rounding the HF tensor
to f16; Q8_0 files within Q8_0's quantization error.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from ggufcheck.arch.rebuild import groups, gguf_tensors_from_hf, hf_state_dict
from ggufcheck.arch.spec import spec_for_model
from ggufcheck.arch.tables import table_for
from ggufcheck.arch.transforms import TRANSFORMS
from ggufcheck.gguf.dequant import dequantize_tensor
from ggufcheck.gguf.reader import open_gguf

pytest.importorskip("safetensors")
Q = gguf.GGMLQuantizationType
ARCHS = ["llama", "qwen2", "qwen3", "glm4moe", "deepseek2", "glm-dsa"]


def _load_hf(tiny) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(tiny.hf_dir.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _rebuilt(tiny, layout="checkpoint"):
    model = open_gguf(tiny.gguf_path)
    spec, findings = spec_for_model(model)
    assert not findings, findings
    table = table_for(spec)
    return model, spec, table, hf_state_dict(model, spec, table, layout=layout)


def _input_types(model, spec, table, layout="checkpoint") -> dict[str, set]:
    """HF name -> the GGUF tensor types it was rebuilt from."""
    out = {}
    for g in groups(spec, table, model.tensors, layout):
        types = {model.tensors[e.name].qtype for e in g.inputs.values() if e.name in model.tensors}
        for name in TRANSFORMS[g.transform].hf_names(spec, g.hf_name):
            out[name] = types
    return out


def _used_gguf_names(model, spec, table, layout="checkpoint") -> set[str]:
    return {e.name for g in groups(spec, table, model.tensors, layout) for e in g.inputs.values()
            if e.name in model.tensors}


@pytest.mark.parametrize("arch", ARCHS + ["deepseek2-yarn"])
def test_f32_rebuild_equals_hf_exactly(tiny_converted, arch):
    tiny = tiny_converted(arch, "f32")
    model, spec, table, rebuilt = _rebuilt(tiny)
    hf = _load_hf(tiny)
    assert set(rebuilt) == set(hf), (set(hf) - set(rebuilt), set(rebuilt) - set(hf))
    assert _used_gguf_names(model, spec, table) == set(model.tensors)
    for name, ref in hf.items():
        assert rebuilt[name].shape == ref.shape, name
        assert torch.equal(rebuilt[name], ref.float()), name


ROUNDED = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}


@pytest.mark.parametrize("arch,outtype", [(a, "f16") for a in ARCHS] + [("glm-dsa", "bf16")])
def test_f16_rebuild_equals_hf_rounded(tiny_converted, arch, outtype):
    tiny = tiny_converted(arch, outtype)
    model, spec, table, rebuilt = _rebuilt(tiny)
    hf = _load_hf(tiny)
    assert set(rebuilt) == set(hf)
    assert _used_gguf_names(model, spec, table) == set(model.tensors)
    types = _input_types(model, spec, table)
    n_rounded = 0
    for name, ref in hf.items():
        (qtype,) = types[name]  # one type per HF parameter (k_b and v_b agree)
        assert qtype in (Q.F32, *ROUNDED), (name, qtype.name)
        expected = ref.float() if qtype == Q.F32 else ref.to(ROUNDED[qtype]).float()
        n_rounded += qtype in ROUNDED
        assert torch.equal(rebuilt[name], expected), (name, qtype.name)
    assert n_rounded > len(hf) // 3  # the file really is mostly f16 / bf16


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_rebuild_within_quantization_error(tiny_converted, arch):
    tiny = tiny_converted(arch, "q8_0")
    model, spec, table, rebuilt = _rebuilt(tiny)
    hf = _load_hf(tiny)
    assert set(rebuilt) == set(hf)
    assert _used_gguf_names(model, spec, table) == set(model.tensors)
    types = _input_types(model, spec, table)
    n_q8 = 0
    for name, ref in hf.items():
        ref = ref.float()
        got = rebuilt[name]
        qtypes = types[name]
        if Q.Q8_0 in qtypes:
            n_q8 += 1
            # Q8_0: per 32-block scale d = amax/127 in f16, |x - q*d| <= d/2 (+ f16 rounding
            # of d); the tensor's amax bounds every block's. kv_b mixes a Q8_0 v_b with an
            # F16 k_b (rows of P = 16 cannot be 32-blocks): f16 rounding is within the bound.
            assert qtypes <= {Q.Q8_0, Q.F16, Q.F32}, (name, qtypes)
            bound = 0.6 * ref.abs().max() / 127 + 1e-8
            err = (got - ref).abs().max()
            assert err <= bound, (name, float(err), float(bound))
            rel = ((got - ref).norm() / ref.norm()).item()
            assert rel < 0.01, (name, rel)
        elif qtypes == {Q.F16}:
            assert torch.equal(got, ref.half().float()), name
        else:
            assert qtypes == {Q.F32} and torch.equal(got, ref), (name, qtypes)
    assert n_q8 > len(hf) // 3


@pytest.mark.parametrize("arch", ["llama", "glm4moe", "deepseek2", "glm-dsa"])
def test_transformers_layout_equals_module_state_dict(tiny_converted, arch):
    """transformers 5.x fuses experts in its modules (gate_up_proj): rebuild that layout."""
    transformers = pytest.importorskip("transformers")
    tiny = tiny_converted(arch, "f32")
    model, spec, table, rebuilt = _rebuilt(tiny, layout="transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny.hf_dir, dtype=torch.float32)
    state = hf_model.state_dict()
    assert set(rebuilt) == set(state), (set(state) - set(rebuilt), set(rebuilt) - set(state))
    for name, ref in state.items():
        assert torch.equal(rebuilt[name], ref), name
    if spec.moe is not None:
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in rebuilt)


@pytest.mark.parametrize("layout", ["checkpoint", "transformers"])
@pytest.mark.parametrize("arch", ["llama", "glm4moe", "deepseek2", "glm-dsa"])
def test_gguf_hf_gguf_round_trip_is_bit_exact(tiny_converted, arch, layout):
    tiny = tiny_converted(arch, "f16")  # f16 values, widened to f32: exactness is bitwise
    model, spec, table, rebuilt = _rebuilt(tiny, layout=layout)
    back = gguf_tensors_from_hf(rebuilt, spec, table, model.tensors, layout)
    assert set(back) == set(model.tensors)
    for name in model.tensors:
        original = dequantize_tensor(model, name)
        assert back[name].shape == original.shape, name
        assert torch.equal(back[name].view(torch.int32), original.view(torch.int32)), name
