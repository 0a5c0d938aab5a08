"""The real kernel probe on this (GPU-less) machine: CPU kernels run, GPU-only cases SKIP."""

from __future__ import annotations

import sys

import pytest

from ggufcheck.checks.kernels import (DEFAULT_QTYPES, KernelOptions, build_plan, model_shapes,
                                      run_kernel_stage)
from ggufcheck.errors import Unavailable
from ggufcheck.probe.runner import ProbeTarget
from ggufcheck.results import Status

torch = pytest.importorskip("torch")
if torch.cuda.is_available():  # pragma: no cover - these tests are about the CPU path
    pytest.skip("a GPU is visible: the CPU-path expectations do not apply", allow_module_level=True)


@pytest.fixture(scope="module")
def report():
    return run_kernel_stage(KernelOptions(target=ProbeTarget(sys.executable, 0)))


def test_the_stage_says_where_its_time_went(report):
    """Each case's wall time (building, compiling, running) and the probe's own start are in
    the stage's info; the cases' sum fits inside the probe's whole time."""
    split = report.info["time"]
    assert split["probe_s"] > 0 and split["startup_s"] > 0
    assert 0 < split["cases_s"] <= split["probe_s"]
    assert len(split["slowest"]) == 5 and split["slowest"][0][1] >= split["slowest"][-1][1]


def test_cpu_kernels_agree_with_fp64(report):
    bad = [r for r in report.results if r.status in (Status.FAIL, Status.ERROR)]
    assert not bad, "\n".join(r.message for r in bad)
    passed = {r.stats["case"] for r in report.results if r.status == Status.PASS}
    for kind in ("rmsnorm", "rope", "router", "indexer", "linear"):
        assert any(c.startswith(kind + ".") for c in passed), kind
    # the math backend runs every attention shape, MLA decode 576/512 included
    for shape in ("mla_prefill_192_128", "mla_prefill_256_256", "mla_decode_576_512", "gqa_128"):
        assert f"sdpa.math.{shape}.fp32.cpu" in passed
        assert f"sdpa.math.{shape}.bf16.cpu" in passed


def test_gpu_only_cases_skip_with_a_reason(report):
    skipped = {r.stats["case"]: r for r in report.results if r.status == Status.SKIP}
    for case in ("sdpa.efficient.gqa_128.fp32.cpu", "sdpa.cudnn.gqa_128.bf16.cpu",
                 "varlen.flash_attn.gqa_128.fp32.cpu", "dequant.ggufcheck.Q4_K.fp32.cpu",
                 "dequant.vllm.Q4_K.fp32.cpu", "rmsnorm.vllm.7168.fp32.cpu"):
        assert case in skipped, case
        assert skipped[case].message and skipped[case].stats["tier"] in ("imports", "runs")
    # flash on the CPU declines different q/k and v head dims, and says why
    flash = skipped["sdpa.flash.mla_prefill_192_128.fp32.cpu"]
    assert "same last dimension" in flash.message


def test_plan_covers_the_required_shapes_and_every_quant_type():
    plan = build_plan()
    ids = {p["id"] for p in plan}
    for backend in ("flash", "efficient", "cudnn", "math"):
        for shape in ("mla_prefill_192_128", "mla_prefill_256_256", "mla_decode_576_512", "gqa_128"):
            for dt in ("bf16", "fp16"):
                assert f"sdpa.{backend}.{shape}.{dt}.cuda" in ids
    for q in DEFAULT_QTYPES:
        assert f"dequant.ggufcheck.{q}.fp32.cuda" in ids
    assert {p["shape"]["d"] for p in plan if p["kind"] == "sdpa"} >= {128, 192, 256, 576}


def test_model_shapes_and_real_data_from_smollm2(tmp_path):
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.testing.models import smollm2_path

    try:
        path = smollm2_path()
    except Unavailable as err:
        pytest.skip(str(err))
    with open_gguf(path) as model:
        shapes = model_shapes(model)
    assert (shapes.heads, shapes.kv_heads, shapes.head_dim_qk) == (9, 3, 64)
    assert "Q4_1" in shapes.qtypes
    report = run_kernel_stage(KernelOptions(model=path, only=("sdpa", "dequant")))
    assert not [r for r in report.results if r.failed], [r.message for r in report.results if r.failed]
    notes = report.info["data"]
    assert "real layer-0 q/k/v" in notes["attention"] and "Q4_1" in " ".join(notes)
    gqa = [r for r in report.results if r.stats.get("case", "").startswith("sdpa.math.gqa_9x3_64")]
    assert gqa and all(r.status == Status.PASS for r in gqa)


def test_sliding_window_models_get_windowed_attention_cases(tiny_converted):
    """gemma3's sliding-window layers (window 8 in the tiny model): an attention case with the
    window's mask next to the full one; torch's math backend agrees with the fp64 reference
    there (an engine whose windowed kernel ignored the mask would not)."""
    from ggufcheck.gguf.reader import open_gguf

    path = tiny_converted("gemma3").gguf_path
    with open_gguf(path) as model:
        shapes = model_shapes(model)
    assert shapes.window == 8
    report = run_kernel_stage(KernelOptions(model=path, only=("sdpa",)))
    assert not [r for r in report.results if r.failed], [r.message for r in report.results if r.failed]
    cases = {r.stats.get("case"): r for r in report.results}
    windowed = [c for c in cases if c and "_swa8." in c and c.startswith("sdpa.math.")]
    assert windowed and all(cases[c].status == Status.PASS for c in windowed), windowed


def test_the_probe_window_mask_is_llama_cpps(monkeypatch):
    """Query i sees key j when j <= i and i - j < window (llama.cpp LLAMA_SWA_TYPE_STANDARD),
    also bottom-right aligned for decode-like shapes (T < S): the same rule as the reference's
    ``causal_mask``."""
    import importlib.util
    from pathlib import Path

    import ggufcheck.probe as probe
    from ggufcheck.reference.layers import causal_mask

    scripts = Path(probe.__file__).parent / "scripts"
    monkeypatch.syspath_prepend(str(scripts))  # the script imports its sibling as the probe does
    spec = importlib.util.spec_from_file_location("probe_kernels", scripts / "ggufcheck_probe_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.torch = torch  # the probe imports torch in its target interpreter at run time
    for t, s, w in ((6, 6, 3), (2, 7, 4), (5, 5, 0)):
        got = module.attention_mask(t, s, "cpu", w)
        want = causal_mask(torch.arange(s - t, s), torch.arange(s), w)
        assert torch.equal(got, want), (t, s, w)
