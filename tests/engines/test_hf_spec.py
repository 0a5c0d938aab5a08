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
