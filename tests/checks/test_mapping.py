"""The mapping check on llama.cpp-converted files, real registry models, and faulty copies
(made with ggufcheck.testing.filefaults): each fault gives a FAIL naming the tensor."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from ggufcheck.arch.rebuild import hf_state_dict
from ggufcheck.arch.spec import build_spec, spec_for_model
from ggufcheck.arch.tables import table_for
from ggufcheck.arch.transforms import kv_b_from_split
from ggufcheck.checks.mapping import check_mapping, mapping_stage
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.results import Status
from ggufcheck.testing import filefaults

ARCHS = ["llama", "qwen2", "qwen3", "glm4moe", "deepseek2", "glm-dsa"]


def _results(path):
    with open_gguf(path) as model:
        return mapping_stage(model)


def _failures(results, check=None):
    return [r for r in results if r.failed and (check is None or r.check == check)]


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_files_pass(tiny_converted, arch):
    results = _results(tiny_converted(arch, "f16").gguf_path)
    assert not _failures(results), [r.message for r in _failures(results)]
    summary = [r for r in results if r.check == "mapping.tensors"]
    assert summary and summary[0].status is Status.PASS


def test_smollm2_passes_with_tied_output(smollm2_path):
    results = _results(smollm2_path)
    assert not _failures(results)
    tied = [r for r in results if r.check == "mapping.tied_output"]
    assert tied and tied[0].status is Status.PASS and tied[0].tensor == "token_embd.weight"


def test_gemma3_is_skipped_with_reason():
    from ggufcheck.errors import Unavailable
    from ggufcheck.testing.models import gemma3_path

    try:
        path = gemma3_path()
    except Unavailable as err:
        pytest.skip(str(err))
    results = [r for r in _results(path) if r.component == "mapping"]
    assert len(results) == 1 and results[0].status is Status.SKIP
    assert "no tensor table for architecture 'gemma3'" in results[0].message


def _edit(tiny_converted, tmp_path, arch, edit, outtype="f16"):
    src = tiny_converted(arch, outtype).gguf_path
    return filefaults.rewrite(src, tmp_path / f"{arch}-fault.gguf", edit)


def test_missing_tensor(tiny_converted, tmp_path):
    path = filefaults.missing_tensor(tiny_converted("glm-dsa", "f16").gguf_path,
                                     tmp_path / "m.gguf", "blk.1.attn_k_b.weight")
    (f,) = _failures(_results(path))
    assert f.check == "mapping.missing" and f.tensor == "blk.1.attn_k_b.weight" and f.layer == 1


def test_unexpected_tensor(tiny_converted, tmp_path):
    def add(c):
        c.tensors["blk.0.attn_extra.weight"] = c.tensors["blk.0.attn_norm.weight"]

    (f,) = _failures(_results(_edit(tiny_converted, tmp_path, "qwen3", add)))
    assert f.check == "mapping.unexpected" and f.tensor == "blk.0.attn_extra.weight"


def test_shape_mismatch(tiny_converted, tmp_path):
    name = "blk.0.attn_q_b.weight"  # [H*(P+R), q_lora], stored transposed
    with open_gguf(tiny_converted("deepseek2", "f16").gguf_path) as model:
        rows, cols = model.tensors[name].shape
    assert rows != cols

    def transpose_shape(c):
        rec = c.tensors[name]
        rows, cols = rec.shape
        rec.shape = (cols, rows)
        rec.raw = rec.raw.reshape(cols, -1)

    (f,) = _failures(_results(_edit(tiny_converted, tmp_path, "deepseek2", transpose_shape)))
    assert f.check == "mapping.shape" and f.tensor == name
    assert f.stats == {"expected": [rows, cols], "found": [cols, rows]}


def test_both_split_and_fused_kv_b(tiny_converted, tmp_path):
    def add_fused(c):
        k_b, v_b = (c.tensors[f"blk.0.attn_{r}.weight"] for r in ("k_b", "v_b"))
        assert k_b.qtype == v_b.qtype == filefaults.Q.F16
        kb = torch.from_numpy(k_b.raw.view(np.float16).reshape(k_b.shape).copy())
        vb = torch.from_numpy(v_b.raw.view(np.float16).reshape(v_b.shape).copy())
        kv = kv_b_from_split(kb, vb).numpy()
        c.tensors["blk.0.attn_kv_b.weight"] = filefaults.TensorRecord(
            filefaults.Q.F16, kv.shape, kv.view(np.uint8).reshape(kv.shape[0], -1))

    failures = _failures(_results(_edit(tiny_converted, tmp_path, "glm-dsa", add_fused)))
    assert [f.check for f in failures] == ["mapping.kv_b"]
    assert failures[0].layer == 0 and "both attn_kv_b and attn_k_b/attn_v_b" in failures[0].message


def test_indexer_on_shared_layer_is_unexpected_with_hint(tiny_converted, tmp_path):
    def shared_layer_1(c):
        value, vtype, sub = c.kv["glm-dsa.attention.indexer.types"]
        c.kv["glm-dsa.attention.indexer.types"] = ([True, False, True], vtype, sub)

    failures = _failures(_results(_edit(tiny_converted, tmp_path, "glm-dsa", shared_layer_1)))
    assert {f.tensor for f in failures} == {
        "blk.1.indexer.attn_q_b.weight", "blk.1.indexer.attn_k.weight",
        "blk.1.indexer.k_norm.weight", "blk.1.indexer.k_norm.bias", "blk.1.indexer.proj.weight"}
    assert all("shared-indexer layer" in f.message for f in failures)


def test_tied_output_detected_and_rebuilt(tiny_converted, tmp_path):
    path = filefaults.missing_tensor(tiny_converted("llama", "f16").gguf_path,
                                     tmp_path / "tied.gguf", "output.weight")
    results = _results(path)
    assert not _failures(results)
    assert any(r.check == "mapping.tied_output" and r.status is Status.PASS for r in results)
    with open_gguf(path) as model:
        spec, _ = spec_for_model(model)
        assert spec.tied_output is True
        sd = hf_state_dict(model, spec, table_for(spec))
        assert "lm_head.weight" not in sd
        tied = hf_state_dict(model, spec, table_for(spec), tied_lm_head=True)
        assert torch.equal(tied["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_metadata_findings_skip_the_mapping(tiny_converted, tmp_path):
    path = filefaults.drop_key(tiny_converted("glm-dsa", "f16").gguf_path, tmp_path / "k.gguf",
                               "glm-dsa.attention.kv_lora_rank")
    results = _results(path)
    meta = [r for r in results if r.component == "metadata"]
    assert meta and meta[0].status is Status.FAIL and "glm-dsa.attention.kv_lora_rank" in meta[0].message
    (mapping,) = [r for r in results if r.component == "mapping"]
    assert mapping.status is Status.SKIP


def test_generic_spec_skips(tmp_path):
    spec, _ = build_spec({"general.architecture": "gemma3"})

    class Fake:
        architecture = "gemma3"

    (r,) = check_mapping(Fake(), spec, table_for(spec))
    assert r.status is Status.SKIP and "gemma3" in r.message


# --- NextN: a checkpoint with an MTP layer, converted by llama.cpp ---------------------------


@pytest.fixture(scope="module")
def glm_dsa_with_nextn(tiny_converted, tmp_path_factory):
    """The tiny GLM-DSA checkpoint plus one MTP layer (model.layers.3.*: a decoder block and
    eh_proj / enorm / hnorm / shared_head / embed_tokens), converted by llama.cpp."""
    from safetensors.torch import load_file, save_file

    from ggufcheck.errors import Unavailable
    from ggufcheck.testing.convert import convert_to_gguf

    tiny = tiny_converted("glm-dsa", "f32")
    hf_dir = tmp_path_factory.mktemp("glm-dsa-nextn")
    for f in tiny.hf_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, hf_dir / f.name)
    config = json.loads((hf_dir / "config.json").read_text())
    n = config["num_hidden_layers"]
    config["num_nextn_predict_layers"] = 1
    (hf_dir / "config.json").write_text(json.dumps(config))
    weights = load_file(tiny.hf_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    d = config["hidden_size"]
    for name in [k for k in weights if k.startswith(f"model.layers.{n - 1}.")]:
        w = weights[name]
        weights[name.replace(f".{n - 1}.", f".{n}.", 1)] = w + 0.01 * torch.randn(w.shape, generator=gen)
    p = f"model.layers.{n}."
    weights[p + "eh_proj.weight"] = torch.randn(d, 2 * d, generator=gen)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[p + norm + ".weight"] = 1 + 0.1 * torch.randn(d, generator=gen)
    weights[p + "shared_head.head.weight"] = torch.randn(config["vocab_size"], d, generator=gen)
    weights[p + "embed_tokens.weight"] = torch.randn(config["vocab_size"], d, generator=gen)
    save_file(weights, hf_dir / "model.safetensors")
    try:
        gguf_path = convert_to_gguf(hf_dir, hf_dir / "nextn.gguf", "f32")
    except Unavailable as err:
        pytest.skip(str(err))
    return hf_dir, gguf_path, weights


def test_nextn_layer_recognized_and_rebuilt(glm_dsa_with_nextn):
    hf_dir, gguf_path, weights = glm_dsa_with_nextn
    results = _results(gguf_path)
    assert not _failures(results), [r.message for r in _failures(results)]
    (nextn,) = [r for r in results if r.check == "mapping.nextn"]
    assert nextn.stats["layers"] == [3] and nextn.stats["tensors"] > 20
    with open_gguf(gguf_path) as model:
        spec, _ = spec_for_model(model)
        assert (spec.n_block, spec.n_layer, spec.n_nextn) == (4, 3, 1)
        rebuilt = hf_state_dict(model, spec, table_for(spec))
        without = hf_state_dict(model, spec, table_for(spec), layout="transformers")
    assert set(rebuilt) == set(weights)
    for name, ref in weights.items():
        assert torch.equal(rebuilt[name], ref), name
    assert not any(k.startswith("model.layers.3.") for k in without)


def test_nextn_tensors_without_the_key_get_a_hint(glm_dsa_with_nextn, tmp_path):
    _, gguf_path, _ = glm_dsa_with_nextn
    # without nextn_predict_layers, the per-run-layer indexer types no longer fit: a finding
    path = filefaults.drop_key(gguf_path, tmp_path / "no-nextn.gguf", "glm-dsa.nextn_predict_layers")
    meta = [r for r in _results(path) if r.component == "metadata"]
    assert meta[0].failed and "glm-dsa.attention.indexer.types" in meta[0].message

    def drop_both(c):
        del c.kv["glm-dsa.nextn_predict_layers"], c.kv["glm-dsa.attention.indexer.types"]

    failures = _failures(_results(filefaults.rewrite(gguf_path, tmp_path / "no-keys.gguf", drop_both)))
    assert failures and {f.check for f in failures} == {"mapping.unexpected"}
    assert {f.tensor for f in failures} == {
        f"blk.3.nextn.{t}.weight" for t in
        ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")}
    assert all("nextn_predict_layers = 0" in f.message for f in failures)


def test_swapped_k_b_v_b_are_shape_mismatches(tiny_converted, tmp_path):
    """k_b [H, L, P] and v_b [H, V, L] differ in shape unless P = V = L: the swap is named."""
    path = filefaults.swap_kb_vb(tiny_converted("glm-dsa", "f16").gguf_path, tmp_path / "s.gguf", layer=1)
    failures = _failures(_results(path))
    assert {(f.check, f.tensor) for f in failures} == {
        ("mapping.shape", "blk.1.attn_k_b.weight"), ("mapping.shape", "blk.1.attn_v_b.weight")}
