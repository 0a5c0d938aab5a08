"""``--engine hf[:DTYPE][@DEVICE]``: the dtype and device parts, and what a bad one says.

On a machine without CUDA, ``@cuda`` is "unavailable" with the reason (it must not crash or
fall back to the CPU silently); a malformed device or dtype is a usage error naming the spec.
The CUDA path itself runs on the GPU machine (tools/measure_allowances.py --engines hf:bf16@cuda).
"""

from __future__ import annotations

import pytest
import torch

from ggufcheck.engines.spec import open_engine
from ggufcheck.errors import Unavailable, UsageError

pytest.importorskip("transformers")


@pytest.mark.parametrize("spec,match", [("hf:bf16@gpu", "device must be cpu, cuda or cuda:N"),
                                        ("hf@cuda:x", "device must be"), ("hf:int8@cpu", "dtype must be")])
def test_bad_hf_specs_are_usage_errors(tiny_converted, spec, match):
    with pytest.raises(UsageError, match=match) as err:
        open_engine(spec, tiny_converted("llama").gguf_path)
    assert spec in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("spec", ["hf@cuda", "hf:bf16@cuda:0"])
def test_cuda_without_a_device_is_unavailable(tiny_converted, spec):
    with pytest.raises(Unavailable, match="no CUDA device"):
        open_engine(spec, tiny_converted("llama").gguf_path)


def test_cpu_device_and_dtype_are_taken(tiny_converted):
    engine = open_engine("hf:fp16@cpu", tiny_converted("llama").gguf_path)
    assert engine.capabilities.activation_dtype == "fp16"
    assert engine.device.type == "cpu"
    assert next(engine.module.parameters()).dtype == torch.float16
    table = engine.score([1, 2, 3, 4])
    assert table.logprobs.shape == (4, engine.vocab_size)
    engine.close()


def test_hf_moe_weights_are_audited_in_transformers_layout_and_an_expert_swap_is_named(tmp_path):
    """transformers holds glm4moe's experts fused (gate_up_proj [E, 2F, D]): the weights stage
    asks in that layout, so every expert parameter and the router bias (a buffer) is compared,
    none skipped; two experts swapped in the live module are named moe-experts at their layer."""
    import torch

    from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
    from ggufcheck.engines.hf import HFEngine
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    model = build_tiny_gguf("glm4moe", tmp_path / "g.gguf", qtypes="F32", seed=1).path
    engine = HFEngine.from_gguf(model)
    opts = DiagnoseOptions(model=model, engine="hf", health=False, sanity=False, max_prompts=1, max_tokens=24)
    d = diagnose(opts, engine=engine)
    weights = next(s for s in d.stages if s.stage == "weights")
    assert weights.info["layout"] == "transformers"
    assert [r.status.value for r in weights.results] == ["PASS"]
    assert weights.results[0].stats["parameters"] == weights.info["parameters"]
    experts = engine.module.model.layers[2].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj[[0, 1]] = experts.gate_up_proj[[1, 0]].clone()
    d = diagnose(opts, engine=engine)
    assert (d.verdict.stage, d.verdict.component, d.verdict.layer) == ("weights", "moe-experts", 2)
    engine.close()


def test_a_file_transformers_cannot_express_is_unsupported_by_the_hf_engine(tmp_path):
    """A softmax-routed deepseek2 (DeepSeek-V2): transformers' deepseek_v3 routes with sigmoid, so
    arch.hf_config refuses it (Unavailable) and the engine says Unsupported, naming the router."""
    pytest.importorskip("transformers")
    from ggufcheck.arch.hf_config import hf_config
    from ggufcheck.arch.spec import spec_for_model
    from ggufcheck.engines.base import Unsupported
    from ggufcheck.engines.hf import HFEngine
    from ggufcheck.errors import Unavailable
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.synthetic.tiny import build_tiny_gguf, tiny_dims

    model = build_tiny_gguf(tiny_dims("deepseek2", gating_func=1), tmp_path / "v2.gguf", qtypes="F32").path
    with open_gguf(model) as f:
        spec, _ = spec_for_model(f)
    with pytest.raises(Unavailable, match="sigmoid"):
        hf_config(spec)
    with pytest.raises(Unsupported, match="sigmoid"):
        HFEngine.from_gguf(model)
