"""The switch stage (checks/switches.py): the served comparison again with one engine setting
flipped at a time, naming the setting whose flip makes a failure go away (issue 37 item 1)."""

from __future__ import annotations

import pytest

from ggufcheck.checks.switches import judge
from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
from ggufcheck.engines.base import Switch
from ggufcheck.engines.spec import parse_spec
from ggufcheck.results import StageReport, Status, failed, passed

FLASH = Switch({"flash_attn": 0}, {"flash_attn": 1}, "the flash-attention path", "attention")
FAULT = "python:ggufcheck.testing.faults:flash_attention_fault"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    return build_tiny_gguf("llama", tmp_path_factory.mktemp("sw") / "m.gguf", qtypes="F32", seed=1).path


def _options(path, engine, **kw):
    return DiagnoseOptions(model=path, engine=engine, sanity=False, kernels=False, max_prompts=2, sweep_to=0,
                           decode_to=0, **kw)


def test_the_setting_whose_flip_makes_the_failure_go_away_is_named(tiny):
    d = diagnose(_options(tiny, FAULT))
    stage = next(s for s in d.stages if s.stage == "switches")
    (result,) = stage.results
    assert result.status == Status.FAIL and result.component == "attention" and result.check == "switches.flash_attn=0"
    assert result.stats["still_failing"] == [] and result.stats["fixed"]
    v = d.verdict
    assert not v.healthy and "healthy with flash_attn=0" in v.message and v.evidence["switch"]["component"] == "attention"
    assert v.next_steps.startswith("run with flash_attn=0")


def test_the_stage_runs_only_when_asked_or_after_a_served_failure(tiny):
    never = diagnose(_options(tiny, FAULT, switches="never"))
    stage = next(s for s in never.stages if s.stage == "switches")
    assert stage.results[0].status == Status.SKIP and "--switches never" in stage.results[0].message
    healthy = diagnose(_options(tiny, f"{FAULT}:flash_attn=0"))
    assert healthy.verdict.healthy
    stage = next(s for s in healthy.stages if s.stage == "switches")
    assert stage.results[0].status == Status.SKIP and "every served check passed" in stage.results[0].message


def test_a_spent_budget_says_what_was_not_flipped(tiny):
    d = diagnose(_options(tiny, FAULT, switch_budget=0))
    (result,) = next(s for s in d.stages if s.stage == "switches").results
    assert result.status == Status.SKIP and "not flipped: the time budget" in result.message


@pytest.mark.llama
def test_a_healthy_llama_cpp_with_flash_attention_is_healthy_with_it_off_too(tiny):
    d = diagnose(_options(tiny, "llama-cpp:flash_attn=1", switches="always"))
    assert d.verdict.healthy, d.verdict.message
    (result,) = next(s for s in d.stages if s.stage == "switches").results
    assert result.status == Status.PASS and result.message == "healthy with flash_attn=0 too"


def test_judging_one_flip():
    def served(*results):
        return [StageReport("logits", list(results))]

    failing = ["logits.kl_mean", "paths.chunked_prefill[5]"]
    fixed = judge(FLASH, failing, served(passed("logits.kl_mean", "output", ""),
                                         passed("paths.chunked_prefill[5]", "prefill", "")))
    assert fixed.status == Status.FAIL and "healthy with flash_attn=0" in fixed.message
    part = judge(FLASH, failing, served(passed("logits.kl_mean", "output", ""),
                                        failed("paths.chunked_prefill[5]", "prefill", "")))
    assert part.status == Status.PASS and "part of the failure" in part.message
    same = judge(FLASH, failing, served(failed("logits.kl_mean", "output", ""),
                                        failed("paths.chunked_prefill[5]", "prefill", "")))
    assert same.status == Status.PASS and "changes nothing" in same.message
    other_path = judge(FLASH, [], served(failed("logits.kl_mean", "output", "")))
    assert other_path.status == Status.WARN and "healthy as run" in other_path.message


@pytest.mark.parametrize("text, settings, want", [
    ("llama-cpp:n_gpu_layers=99,flash_attn=1", {"flash_attn": 0}, "llama-cpp:n_gpu_layers=99,flash_attn=0"),
    ("llama-cpp", {"type_k": 1, "type_v": 1}, "llama-cpp:type_k=1,type_v=1"),
    ("hf:bf16@cuda", {"dtype": "fp32"}, "hf:fp32@cuda"),
    ("vllm:tp=2,dtype=bf16", {"tp": 1}, "vllm:tp=1,dtype=bf16"),
    (f"{FAULT}:flash_attn=1", {"flash_attn": 0}, f"{FAULT}:flash_attn=0"),
])
def test_a_spec_with_one_setting_flipped(text, settings, want):
    flipped = parse_spec(text).with_settings(settings)
    assert flipped.text == want and parse_spec(flipped.text).kind == flipped.kind


def test_vllm_and_transformers_declare_their_settings():
    from ggufcheck.engines.vllm import parse_options, vllm_switches

    names = [s.name for s in vllm_switches(parse_options("tp=2,eager=0,kv_cache_dtype=fp8", "vllm:..."))]
    assert names == ["eager=1", "prefix_caching=0", "kv_cache_dtype=auto", "tp=1"]
    assert [s.name for s in vllm_switches(parse_options("prefix_caching=0", "vllm:..."))] == []


def test_llama_cpps_gpu_switches_keep_the_library_out_of_torchs_process():
    from types import SimpleNamespace

    from ggufcheck.engines.llama_cpp import llama_cpp_switches

    params = SimpleNamespace(flash_attn_type=-1, type_k=8, type_v=8)
    switches = {s.name: s for s in llama_cpp_switches(params, n_gpu_layers=99, n_batch=512)}
    assert set(switches) == {"flash_attn=0", "type_k=1,type_v=1", "n_gpu_layers=0,isolate=1", "n_batch=8",
                             "cuda_graphs=0", "cuda_fusion=0"}
    flipped = parse_spec("llama-cpp:n_gpu_layers=99").with_settings(switches["n_gpu_layers=0,isolate=1"].safe)
    assert flipped.text == "llama-cpp:n_gpu_layers=0,isolate=1"
    assert llama_cpp_switches(SimpleNamespace(flash_attn_type=0, type_k=1, type_v=1), 0, 512) == ()


def test_llama_cpps_cuda_runtime_switches_are_set_in_the_engines_own_process(monkeypatch, tmp_path):
    """cuda_graphs=0 / cuda_fusion=0 / cublas_f32=1 become the variables ggml-cuda reads when it
    loads (GGML_CUDA_DISABLE_GRAPHS, ..._FUSION, GGML_CUDA_CUBLAS_COMPUTE_TYPE), in the
    engine's process only; a variable the user set is removed when the option says 1."""
    import subprocess

    from ggufcheck.engines.spec import open_engine
    from ggufcheck.errors import UsageError

    seen = {}

    class Stop(Exception):
        pass

    def popen(cmd, **kw):
        seen.update(kw["env"])
        raise Stop

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setenv("GGML_CUDA_DISABLE_FUSION", "1")
    with pytest.raises(Stop):
        open_engine("llama-cpp:cuda_graphs=0,cuda_fusion=1,cublas_f32=1", tmp_path / "m.gguf")
    assert seen["GGML_CUDA_DISABLE_GRAPHS"] == "1" and seen["GGML_CUDA_CUBLAS_COMPUTE_TYPE"] == "f32"
    assert "GGML_CUDA_DISABLE_FUSION" not in seen
    import os

    assert os.environ["GGML_CUDA_DISABLE_FUSION"] == "1" and "GGML_CUDA_DISABLE_GRAPHS" not in os.environ  # ours kept
    with pytest.raises(UsageError, match="need an engine process of its own"):
        open_engine("llama-cpp:cuda_graphs=0,isolate=0", tmp_path / "m.gguf")
    with pytest.raises(UsageError, match="must be 0 or 1"):
        open_engine("llama-cpp:cuda_graphs=2", tmp_path / "m.gguf")
