"""The transformers engine is built in bounded host memory and holds what it always held.

Oracle: the old whole-model path (``from_config`` in float32, the full state dict from
``iter_hf_tensors``, ``load_state_dict``, ``.to(dtype)``), kept here; the engine now builds
the model in its dtype where it runs and fills it from ``iter_hf_parts`` (blocks of experts).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ggufcheck.arch.hf_config import MODEL_TYPES, hf_config  # noqa: E402
from ggufcheck.arch.rebuild import iter_hf_parts, iter_hf_tensors  # noqa: E402
from ggufcheck.arch.spec import spec_for_model  # noqa: E402
from ggufcheck.arch.tables import table_for  # noqa: E402
from ggufcheck.engines.hf import HFEngine  # noqa: E402
from ggufcheck.gguf.reader import open_gguf  # noqa: E402


def _old_module(path, dtype):
    with open_gguf(path) as model:
        spec, _ = spec_for_model(model)
        table = table_for(spec)
        config = transformers.AutoConfig.for_model(MODEL_TYPES.get(spec.arch, spec.arch), **hf_config(spec))
        module = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        module.load_state_dict({n: t.to(dtype) for n, t in iter_hf_tensors(model, spec, table, layout="transformers",
                                                                           include_nextn=False)}, strict=False)
        if spec.tied_output:
            module.tie_weights()
    return module


@pytest.mark.parametrize("arch", ["glm-dsa", "gpt-oss", "gemma3", "qwen3moe"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_every_parameter_and_buffer_as_before(tiny_gguf, arch, dtype):
    path = tiny_gguf(arch, qtypes="Q8_0").path
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    new, old = HFEngine.from_gguf(path, dtype=dtype).module, _old_module(path, torch_dtype)
    a, b = new.state_dict(), old.state_dict()
    assert set(a) == set(b)
    for name in b:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    for (name, x), (_, y) in zip(sorted(new.named_buffers()), sorted(old.named_buffers())):
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_expert_blocks_assemble_to_the_whole_tensors(tiny_gguf):
    path = tiny_gguf("glm-dsa", qtypes="Q8_0").path
    with open_gguf(path) as model:
        spec, _ = spec_for_model(model)
        table = table_for(spec)
        whole = dict(iter_hf_tensors(model, spec, table, layout="transformers", include_nextn=False))
        parts: dict[str, list] = {}
        blocks = 0
        for name, t, experts in iter_hf_parts(model, spec, table, layout="transformers", include_nextn=False,
                                              block_bytes=3 * 32 * 64 * 4):  # ~2 experts per block
            parts.setdefault(name, []).append((experts, t))
            blocks += experts is not None
    assert blocks > len([n for n in whole if whole[n].dim() == 3])  # stacked experts came in several blocks
    for name, pieces in parts.items():
        got = pieces[0][1] if pieces[0][0] is None else torch.cat([t for _, t in pieces])
        assert torch.equal(got, whole[name]), name


def test_the_audit_reads_stacked_experts_in_blocks_and_names_the_wrong_ones(tiny_gguf, monkeypatch):
    from ggufcheck.arch.tables import table_for as table_of
    from ggufcheck.checks import weights as audit

    monkeypatch.setattr(audit, "EXPERT_BLOCK_BYTES", 2 * 2 * 32 * 64 * 4)  # two experts of gate_up per block
    path = tiny_gguf("glm-dsa", qtypes="Q8_0").path
    engine = HFEngine.from_gguf(path, dtype="fp32")
    with open_gguf(path) as model:
        spec, _ = spec_for_model(model)
        table = table_of(spec)
        results = audit.check_engine_weights(model, spec, table, engine)
        assert not [r for r in results if r.failed], [r.message for r in results if r.failed]
        calls = []
        original = engine.weight_tensor  # the audit takes expert blocks as held, where held
        monkeypatch.setattr(engine, "weight_tensor",
                            lambda *a, **k: (len(a) > 1 and calls.append(a[1])) or original(*a, **k))
        name = "model.layers.1.mlp.experts.gate_up_proj"
        with torch.no_grad():
            dict(engine.module.named_parameters())[name][5] *= -1  # expert 5 loaded wrong
        results = audit.check_engine_weights(model, spec, table, engine)
    bad = [r for r in results if r.failed]
    assert len(bad) == 1 and bad[0].tensor == name and "experts 4..5" in bad[0].message, [r.message for r in bad]
    assert calls and all(s.stop - s.start < 8 for s in calls)  # never the whole stack of 8


def test_a_vocabulary_that_is_not_a_multiple_of_64_is_audited_unpadded(tiny_gguf):
    """Regression (a false alarm found by benchmarks/audit_experts.py, 2026-12): transformers
    holds lm_head / embed_tokens with the file's 900 rows; the audit expected vLLM's padded
    960 ("shape (900, 6144) != expected slice (960, 6144)")."""
    from ggufcheck.arch.tables import table_for as table_of
    from ggufcheck.checks import weights as audit

    path = tiny_gguf("llama", qtypes="Q8_0", n_vocab=900).path
    engine = HFEngine.from_gguf(path, dtype="fp32")
    with open_gguf(path) as model:
        spec, _ = spec_for_model(model)
        assert spec.n_vocab == 900
        results = audit.check_engine_weights(model, spec, table_of(spec), engine)
        assert not [r for r in results if r.failed], [r.message for r in results if r.failed]
        with torch.no_grad():
            engine.module.lm_head.weight[899] += 1  # the last real row wrong: still found
        results = audit.check_engine_weights(model, spec, table_of(spec), engine)
    assert [r.tensor for r in results if r.failed] == ["lm_head.weight"]
