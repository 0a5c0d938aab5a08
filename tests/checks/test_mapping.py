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

ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen3moe", "gpt-oss", "glm4moe", "deepseek2", "glm-dsa"]


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


def test_real_gemma3_maps_onto_its_table():
    from ggufcheck.errors import Unavailable
    from ggufcheck.testing.models import gemma3_path

    try:
        path = gemma3_path()
    except Unavailable as err:
        pytest.skip(str(err))
    results = [r for r in _results(path) if r.component == "mapping"]
    assert results and all(r.status is Status.PASS for r in results), [r.message for r in results]
    assert any("all 236 tensors match the gemma3 table" in r.message for r in results)


# Faults go into the small files of ggufcheck's own writer (vocab 512: fast to rewrite);
# that writer agrees with the tables (first test below), and the converted files pass above.


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_writer_files_pass(tiny_gguf, arch):
    assert not _failures(_results(tiny_gguf(arch).path))


def _edit(tiny_gguf, tmp_path, arch, edit, **dims):
    return filefaults.rewrite(tiny_gguf(arch, **dims).path, tmp_path / f"{arch}-fault.gguf", edit)


def test_missing_tensor(tiny_gguf, tmp_path):
    path = filefaults.missing_tensor(tiny_gguf("glm-dsa").path, tmp_path / "m.gguf",
                                     "blk.1.attn_k_b.weight")
    (f,) = _failures(_results(path))
    assert f.check == "mapping.missing" and f.tensor == "blk.1.attn_k_b.weight" and f.layer == 1


def test_unexpected_tensor(tiny_gguf, tmp_path):
    def add(c):
        c.tensors["blk.0.attn_extra.weight"] = c.tensors["blk.0.attn_norm.weight"]

    (f,) = _failures(_results(_edit(tiny_gguf, tmp_path, "qwen3", add)))
    assert f.check == "mapping.unexpected" and f.tensor == "blk.0.attn_extra.weight"


def test_shape_mismatch(tiny_gguf, tmp_path):
    name = "blk.0.attn_q_b.weight"  # [H*(P+R), q_lora], stored transposed
    found = {}

    def transpose_shape(c):
        rec = c.tensors[name]
        rows, cols = found["shape"] = rec.shape
        assert rows != cols
        rec.shape = (cols, rows)
        rec.raw = rec.raw.reshape(cols, -1)

    (f,) = _failures(_results(_edit(tiny_gguf, tmp_path, "deepseek2", transpose_shape)))
    rows, cols = found["shape"]
    assert f.check == "mapping.shape" and f.tensor == name
    assert f.stats == {"expected": [rows, cols], "found": [cols, rows]}


def test_both_split_and_fused_kv_b(tiny_gguf, tmp_path):
    def add_fused(c):
        k_b, v_b = (c.tensors[f"blk.0.attn_{r}.weight"] for r in ("k_b", "v_b"))
        assert k_b.qtype == v_b.qtype == filefaults.Q.F32
        kb = torch.from_numpy(k_b.raw.view(np.float32).reshape(k_b.shape).copy())
        vb = torch.from_numpy(v_b.raw.view(np.float32).reshape(v_b.shape).copy())
        kv = kv_b_from_split(kb, vb).numpy()
        c.tensors["blk.0.attn_kv_b.weight"] = filefaults.TensorRecord(
            filefaults.Q.F32, kv.shape, kv.view(np.uint8).reshape(kv.shape[0], -1))

    failures = _failures(_results(_edit(tiny_gguf, tmp_path, "glm-dsa", add_fused)))
    assert [f.check for f in failures] == ["mapping.kv_b"]
    assert failures[0].layer == 0 and "both attn_kv_b and attn_k_b/attn_v_b" in failures[0].message


def test_indexer_on_shared_layer_is_unexpected_with_hint(tiny_gguf, tmp_path):
    def shared_layer_1(c):
        value, vtype, sub = c.kv["glm-dsa.attention.indexer.types"]
        c.kv["glm-dsa.attention.indexer.types"] = ([True, False] + [True] * (len(value) - 2), vtype, sub)

    failures = _failures(_results(_edit(tiny_gguf, tmp_path, "glm-dsa", shared_layer_1)))
    assert {f.tensor for f in failures} == {
        "blk.1.indexer.attn_q_b.weight", "blk.1.indexer.attn_k.weight",
        "blk.1.indexer.k_norm.weight", "blk.1.indexer.k_norm.bias", "blk.1.indexer.proj.weight"}
    assert all("shared-indexer layer" in f.message for f in failures)


def test_tied_output_detected_and_rebuilt(tiny_gguf, tmp_path):
    path = filefaults.missing_tensor(tiny_gguf("llama").path, tmp_path / "tied.gguf", "output.weight")
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


def test_metadata_findings_skip_the_mapping(tiny_gguf, tmp_path):
    path = filefaults.drop_key(tiny_gguf("glm-dsa").path, tmp_path / "k.gguf",
                               "glm-dsa.attention.kv_lora_rank")
    results = _results(path)
    meta = [r for r in results if r.component == "metadata"]
    assert meta and meta[0].status is Status.FAIL and "glm-dsa.attention.kv_lora_rank" in meta[0].message
    (mapping,) = [r for r in results if r.component == "mapping"]
    assert mapping.status is Status.SKIP


def test_generic_spec_skips(tmp_path):
    spec, _ = build_spec({"general.architecture": "mamba"})

    class Fake:
        architecture = "mamba"

    (r,) = check_mapping(Fake(), spec, table_for(spec))
    assert r.status is Status.SKIP and "mamba" in r.message


# --- NextN: a checkpoint with an MTP layer, converted by llama.cpp ---------------------------


def _with_nextn(tiny_converted, tmp_path_factory, arch):
    """The tiny checkpoint plus one MTP layer (model.layers.{n}.*: a decoder block and
    eh_proj / enorm / hnorm / shared_head / embed_tokens), converted by llama.cpp."""
    from safetensors.torch import load_file, save_file

    from ggufcheck.errors import Unavailable
    from ggufcheck.testing.convert import convert_to_gguf

    tiny = tiny_converted(arch, "f32")
    hf_dir = tmp_path_factory.mktemp(f"{arch}-nextn")
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


@pytest.fixture(scope="module")
def glm_dsa_with_nextn(tiny_converted, tmp_path_factory):
    return _with_nextn(tiny_converted, tmp_path_factory, "glm-dsa")


@pytest.fixture(scope="module")
def glm4moe_with_nextn(tiny_converted, tmp_path_factory):
    return _with_nextn(tiny_converted, tmp_path_factory, "glm4moe")


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["glm_dsa_with_nextn", "glm4moe_with_nextn"])
def test_nextn_layer_recognized_and_rebuilt(request, fixture):
    hf_dir, gguf_path, weights = request.getfixturevalue(fixture)
    results = _results(gguf_path)
    assert not _failures(results), [r.message for r in _failures(results)]
    (nextn,) = [r for r in results if r.check == "mapping.nextn"]
    with open_gguf(gguf_path) as model:
        spec, _ = spec_for_model(model)
        n = spec.n_layer
        assert spec.n_nextn == 1 and spec.n_block == n + 1
        assert nextn.stats["layers"] == [n] and nextn.stats["tensors"] > 20
        rebuilt = hf_state_dict(model, spec, table_for(spec))
        without = hf_state_dict(model, spec, table_for(spec), layout="transformers")
    assert set(rebuilt) == set(weights)
    for name, ref in weights.items():
        assert torch.equal(rebuilt[name], ref), name
    assert not any(k.startswith(f"model.layers.{n}.") for k in without)
    assert any(k.startswith(f"model.layers.{n}.") for k in rebuilt)


def test_nextn_tensors_without_the_key_get_a_hint(tiny_gguf, tmp_path):
    src = tiny_gguf("glm-dsa", n_nextn=1).path
    assert not _failures(_results(src))
    # without nextn_predict_layers, the per-run-layer indexer types no longer fit: a finding
    path = filefaults.drop_key(src, tmp_path / "no-nextn.gguf", "glm-dsa.nextn_predict_layers")
    meta = [r for r in _results(path) if r.component == "metadata"]
    assert meta[0].failed and "glm-dsa.attention.indexer.types" in meta[0].message

    def drop_both(c):
        del c.kv["glm-dsa.nextn_predict_layers"], c.kv["glm-dsa.attention.indexer.types"]

    failures = _failures(_results(filefaults.rewrite(src, tmp_path / "no-keys.gguf", drop_both)))
    assert failures and {f.check for f in failures} == {"mapping.unexpected"}
    assert all(".nextn." in f.tensor and "nextn_predict_layers = 0" in f.message for f in failures)
    assert {f.tensor.split(".nextn.")[1] for f in failures} >= {"eh_proj.weight", "enorm.weight", "hnorm.weight"}


def test_swapped_k_b_v_b_are_shape_mismatches(tiny_gguf, tmp_path):
    """k_b [H, L, P] and v_b [H, V, L] differ in shape unless P = V = L: the swap is named."""
    path = filefaults.swap_kb_vb(tiny_gguf("glm-dsa").path, tmp_path / "s.gguf", layer=1)
    failures = _failures(_results(path))
    assert {(f.check, f.tensor) for f in failures} == {
        ("mapping.shape", "blk.1.attn_k_b.weight"), ("mapping.shape", "blk.1.attn_v_b.weight")}
