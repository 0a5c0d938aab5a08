"""The kernel matrix (``ggufcheck quants``): every quant type's tiny model on an engine.

Two independent implementations meet here: llama.cpp's own kernels (on this CPU; the same
command ran its CUDA kernels on the H200, docs/gpu-evidence.md) against ggufcheck's fp64
reference over gguf-py-compatible dequantization. The matrix must pass a healthy engine
with a tight allowance, and name the one type whose kernel is wrong.
"""

from __future__ import annotations

import json

import pytest

from ggufcheck.checks.quant_matrix import CUDA_TYPES, MATRIX_DIMS, build_model
from ggufcheck.cli import main


def _rows(path):
    doc = json.loads(path.read_text())
    (stage,) = doc["stages"]
    return {r["check"][len("quant_matrix["):-1]: r for r in stage["results"]}, doc


@pytest.mark.llama
def test_llama_cpp_passes_every_quick_type_with_a_tight_allowance(tmp_path):
    out = tmp_path / "m.json"
    assert main(["quants", "--engine", "llama-cpp", "--types", "quick", "--json", str(out)]) == 0
    rows, doc = _rows(out)
    assert len(rows) == 6 and all(r["status"] == "PASS" for r in rows.values())
    for qtype, row in rows.items():
        stats = row["stats"]
        # a real comparison happened, under a limit that a wrong kernel would exceed
        assert 0 < stats["prefill_kl"] < stats["prefill_limit"] <= 0.02, (qtype, stats)
        assert stats["decode_kl"] < stats["prefill_limit"] and stats["argmax"] >= 0.95
        # and it rounds as its class says: llama.cpp's CPU kernels against the reference's
        # emulation of 8-bit activations, two implementations of the same rounding
        assert 0.5 < stats["prefill_kl"] / stats["emulation_kl"] < 2.0, (qtype, stats)
        assert "rounding_excess" not in stats, (qtype, stats)
    assert set(doc["checks_per_type"]) == set(rows)


@pytest.mark.llama
def test_cudas_q8_1_block_sums_are_named_and_the_cpus_are_not(tmp_path, capsys):
    """The H100 / H200 case (docs/real-world-cases.md): llama.cpp's CUDA Q4_1 / Q5_1 products
    keep the block sums of the activations before rounding. An engine computing that form
    passes the class allowance, as the GPUs did, and the matrix names the types it rounds more
    on; llama.cpp's own CPU kernels on the same models are not named."""
    emulated, cpu = tmp_path / "cuda.json", tmp_path / "cpu.json"
    assert main(["quants", "--engine", "python:ggufcheck.testing.faults:cuda_q8_1_sums_engine",
                 "--types", "Q4_0,Q4_1,Q5_1", "--json", str(emulated)]) == 0
    out = capsys.readouterr().out
    rows, _ = _rows(emulated)
    assert all(r["status"] == "PASS" for r in rows.values())
    assert "rounding_excess" not in rows["Q4_0"]["stats"]
    for qtype in ("Q4_1", "Q5_1"):
        excess = rows[qtype]["stats"]["rounding_excess"]
        assert excess["prefill"] > 3 and excess["decode"] > 3, (qtype, excess)
        assert "rounds more than its class explains" in rows[qtype]["message"]
    assert "Q4_1: rounds more" in out and "Q4_0: rounds more" not in out
    assert main(["quants", "--engine", "llama-cpp", "--types", "Q4_1,Q5_1", "--json", str(cpu)]) == 0
    for qtype, row in _rows(cpu)[0].items():
        assert "rounding_excess" not in row["stats"], (qtype, row["stats"])


@pytest.mark.slow
def test_the_one_wrong_type_is_named_and_the_others_pass(tmp_path):
    out = tmp_path / "m.json"
    code = main(["quants", "--engine", "python:ggufcheck.testing.faults:q4_k_kernel_wrong",
                 "--types", "Q4_0,Q4_K,Q6_K", "--json", str(out)])
    rows, _ = _rows(out)
    assert code == 1
    assert {t: r["status"] for t, r in rows.items()} == {"Q4_0": "PASS", "Q4_K": "FAIL", "Q6_K": "PASS"}
    assert "prefill" in rows["Q4_K"]["stats"]["failed_paths"]


def test_unknown_types_are_a_usage_error(capsys):
    assert main(["quants", "--engine", "reference:fp32", "--types", "Q4_0,Q9_9"]) == 2
    assert "Q9_9" in capsys.readouterr().err


@pytest.mark.parametrize("qtype", CUDA_TYPES)
def test_each_types_model_has_the_float_models_spread(tmp_path, qtype):
    """Random quant blocks are rescaled to the weights' spread: without it, types differed
    1000x in weight size, and a model with exploding activations judged nothing (the
    emulated baseline's own error, and with it the limit, reached several nats)."""
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.gguf.dequant import dequantize_tensor

    (tmp_path / "f32").mkdir()
    ref = build_model("F32", tmp_path / "f32", seed=0)
    path = build_model(qtype, tmp_path, seed=0)
    with open_gguf(ref) as f32, open_gguf(path) as q:
        for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output.weight"):
            assert q.tensors[name].qtype.name == qtype
            want = float(dequantize_tensor(f32, name).double().std())
            got = float(dequantize_tensor(q, name).double().std())
            assert 0.5 < got / want < 2.0, (name, got, want)
    assert MATRIX_DIMS["n_embd"] % 256 == 0


@pytest.mark.llama
def test_asking_a_cpu_build_to_offload_says_so_in_one_line(capsys):
    """No GPU here: the matrix on a GPU engine is a clear, specific refusal (the library
    loaded, why it cannot offload, how to point at a GPU build), not a traceback or a hang."""
    llama_cpp = pytest.importorskip("llama_cpp")
    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama.cpp library has a GPU backend")
    assert main(["quants", "--engine", "llama-cpp:n_gpu_layers=99", "--types", "Q4_0"]) == 2
    err = capsys.readouterr().err
    assert "has no GPU backend" in err and "LLAMA_CPP_LIB_PATH" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.hf
def test_transformers_own_gguf_loader_agrees_on_every_type_at_fp32_rounding(tmp_path):
    """An independent implementation on every row: transformers' GGUF loader (gguf-py's
    dequantization, transformers' llama code) against ggufcheck's reference (its own
    dequantization kernels) agree at fp32 rounding for all 21 types (measured: KL 2e-13 to
    4.4e-12). A dequantization bug for one type on either side would show here first."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "m.json"
    assert main(["quants", "--engine", "hf-gguf", "--types", "all", "--json", str(out)]) == 0
    rows, _ = _rows(out)
    assert len(rows) == 21
    for qtype, row in rows.items():
        assert row["status"] == "PASS" and row["stats"]["prefill_kl"] < 1e-9, (qtype, row["stats"])
