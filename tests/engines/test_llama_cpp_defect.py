"""A fault in the real engine (issue 36 item 6): llama.cpp built from its own source with one line
of one CPU kernel changed (testing/llama_cpp_build.py: the AVX2 Q4_K matrix-vector kernel's min
term 3% small). The kernel matrix must fail exactly that type on exactly that path, naming the
kernels, though the error is far inside the class allowance; the other types pass on the same
build. (The same kind of defect on the GPU: tools/gpu/llama_cpp_cuda.sh defectq5k.)"""

from __future__ import annotations

import json

import pytest

from ggufcheck.cli import main
from ggufcheck.errors import Unavailable

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def defect_library():
    from ggufcheck.testing.llama_cpp_build import built_library

    try:
        return built_library("q4_k-gemv-min")  # ~2-4 minutes on 2 cores, once (cached)
    except Unavailable as why:
        pytest.skip(str(why))


def test_the_kernel_matrix_names_the_broken_kernel_of_a_real_build(defect_library, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(defect_library))  # loaded by the engine's own process
    out = tmp_path / "m.json"
    assert main(["quants", "--engine", "llama-cpp:isolate=1", "--types", "Q4_0,Q4_K", "--json", str(out)]) == 1
    rows = {r["check"][len("quant_matrix["):-1]: r for r in json.loads(out.read_text())["stages"][0]["results"]}
    assert rows["Q4_0"]["status"] == "PASS" and "rounding_excess" not in rows["Q4_0"]["stats"]
    q4k = rows["Q4_K"]
    assert q4k["status"] == "FAIL" and set(q4k["stats"]["rounding_excess"]) == {"decode"}, q4k
    assert q4k["stats"]["rounding_excess"]["decode"] > 10 and q4k["stats"]["decode_kl"] < q4k["stats"]["prefill_limit"]
    engine_kl, emulated_kl = q4k["stats"]["arithmetic"]["prefill"]
    assert 0.7 < engine_kl / emulated_kl < 1.4  # its matrix-matrix kernels are right
    assert q4k["message"].startswith("Q4_K decode (matrix-vector kernels): ")
    assert "off their stated arithmetic" in capsys.readouterr().out


def test_a_defect_whose_line_moved_is_refused(tmp_path):
    from ggufcheck.testing.llama_cpp_build import DEFECTS, apply_defect

    defect = DEFECTS["q4_k-gemv-min"]
    path = tmp_path / defect.file
    path.parent.mkdir(parents=True)
    path.write_text(f"{defect.after} ... {defect.old} ... {defect.old}\n")
    apply_defect(tmp_path, defect)
    assert path.read_text() == f"{defect.after} ... {defect.new} ... {defect.old}\n"  # the first one only
    path.write_text("nothing here\n")
    with pytest.raises(ValueError, match="not where it was"):
        apply_defect(tmp_path, defect)
