"""``ggufcheck inspect`` end to end on the real registry models and on broken files."""

from __future__ import annotations

import json


from ggufcheck.cli import main
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.testing import filefaults
from ggufcheck.synthetic.tiny import build_tiny_gguf


def _inspect(path, tmp_path, *extra):
    out = tmp_path / "inspect.json"
    status = main(["inspect", str(path), "--json", str(out), *extra])
    return status, json.loads(out.read_text()) if out.exists() else None


def _by_check(doc):
    results = doc["stages"][0]["results"]
    return {r["check"]: r for r in results}, results


def test_smollm2_is_clean(smollm2_path, tmp_path):
    status, doc = _inspect(smollm2_path, tmp_path)
    assert status == 0
    checks, results = _by_check(doc)
    assert doc["schema_version"] == 1
    summary = doc["stages"][0]["info"]["summary"]
    assert summary["architecture"] == "llama" and summary["layers"] == 30
    assert checks["mapping.tensors"]["status"] == "PASS"
    health = [r for r in results if r["check"] == "health.values"]
    assert len(health) == summary["n_tensors"] and all(r["status"] == "PASS" for r in health)
    scan = doc["stages"][0]["info"]["health_scan"]
    with open_gguf(smollm2_path) as model:
        assert scan["tensor_bytes"] == sum(info.nbytes for info in model.tensors.values())
    assert scan["seconds"] > 0 and scan["mb_per_s"] > 0


def test_gemma3_file_maps_onto_its_table(gemma3_path, tmp_path):
    status, doc = _inspect(gemma3_path, tmp_path)
    assert status == 0
    checks, results = _by_check(doc)
    assert checks["mapping.tensors"]["status"] == "PASS" and "gemma3 table" in checks["mapping.tensors"]["message"]
    assert sum(r["check"] == "health.values" and r["status"] == "PASS" for r in results) == 236


def test_tp_plan_findings(smollm2_path, tmp_path):
    status, doc = _inspect(smollm2_path, tmp_path, "--tp", "2", "--no-health")
    assert status == 1  # 9 query heads and 3 kv heads do not split over 2 ranks
    failing = [r for r in doc["stages"][0]["results"] if r["status"] == "FAIL"]
    assert failing and all(r["component"] == "sharding" for r in failing)


def test_file_faults_are_findings(tmp_path):
    good = build_tiny_gguf("deepseek2", tmp_path / "good.gguf", qtypes="Q8_0").path
    assert main(["inspect", str(good)]) == 0
    cases = {
        "scale": (filefaults.corrupt_block_scale(good, tmp_path / "scale.gguf", "blk.1.attn_output.weight",
                                                 value="nan"), "dequant"),
        "missing": (filefaults.missing_tensor(good, tmp_path / "missing.gguf", "blk.0.attn_kv_a_mqa.weight"),
                    "mapping"),
        "swap": (filefaults.swap_kb_vb(good, tmp_path / "swap.gguf", 0), "mapping"),
    }
    for name, (path, component) in cases.items():
        status, doc = _inspect(path, tmp_path)
        assert status == 1, name
        failing = [r for r in doc["stages"][0]["results"] if r["status"] == "FAIL"]
        assert any(r["component"] == component for r in failing), (name, failing[:3])


def test_truncated_file_exit_2(tmp_path, capsys):
    good = build_tiny_gguf("llama", tmp_path / "good.gguf").path
    bad = filefaults.truncate(good, tmp_path / "cut.gguf", good.stat().st_size // 2)
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cut.gguf" in err and "byte offset" in err and "Traceback" not in err
