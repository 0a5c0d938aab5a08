"""The tiering logic with injected fake kernels: each fault lands on its tier and status."""

from __future__ import annotations

import math

import pytest
import torch

from ggufcheck.probe.scripts import ggufcheck_probe_tiers as tiers


def _case(load=None, execute=None, **kw) -> tiers.KernelCase:
    """A softmax 'kernel' over (8, 33) rows in float32 on the CPU, with hooks to break it."""
    def prepare():
        g = torch.Generator().manual_seed(torch.randint(0, 2**31, (1,)).item())
        return {"x": torch.randn(8, 33, generator=g)}

    def good(_kernel, x, out):
        out.copy_(torch.softmax(x["x"], dim=-1))

    return tiers.KernelCase(
        id="fake.softmax", kind="fake", dtype="float32", device="cpu",
        load=load or (lambda: torch.softmax), prepare=prepare, execute=execute or good,
        reference=lambda x: torch.softmax(x["x"].double(), dim=-1),
        baseline=lambda x: torch.softmax(x["x"], dim=-1),
        out_spec=lambda x: (tuple(x["x"].shape), torch.float32), **kw)


def test_correct_kernel_passes_all_three_tiers():
    r = tiers.run_case(_case())
    assert (r["status"], r["tier"]) == ("PASS", "agrees"), r
    assert r["stats"]["tiers"] == {"imports": "PASS", "runs": "PASS", "agrees": "PASS"}
    assert r["stats"]["rel_l2"] <= r["stats"]["tol"]


def test_import_failure_fails_the_imports_tier():
    def load():
        raise ImportError("libcudart.so.12: cannot open shared object file")

    r = tiers.run_case(_case(load=load))
    assert (r["status"], r["tier"]) == ("FAIL", "imports")
    assert "libcudart" in r["message"]


def test_not_installed_is_a_skip_not_a_failure():
    def load():
        raise tiers.NotInstalled("vllm is not installed")

    r = tiers.run_case(_case(load=load))
    assert (r["status"], r["tier"]) == ("SKIP", "imports")


def test_runtime_failure_fails_the_runs_tier():
    def execute(_k, x, out):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    r = tiers.run_case(_case(execute=execute))
    assert (r["status"], r["tier"]) == ("FAIL", "runs")
    assert "no kernel image" in r["message"]
    assert r["stats"]["tiers"]["imports"] == "PASS"


def test_declined_shape_is_a_skip_at_the_runs_tier():
    def execute(_k, x, out):
        raise tiers.Unsupported("head dim 576 not supported")

    r = tiers.run_case(_case(execute=execute))
    assert (r["status"], r["tier"]) == ("SKIP", "runs")


def test_wrong_result_fails_the_agrees_tier():
    def execute(_k, x, out):  # a classic bug: softmax without max-subtraction is fine; a wrong scale is not
        out.copy_(torch.softmax(x["x"] * 1.05, dim=-1))

    r = tiers.run_case(_case(execute=execute))
    assert (r["status"], r["tier"]) == ("FAIL", "agrees")
    assert r["stats"]["rel_l2"] > r["stats"]["tol"]


def test_output_left_partly_unwritten_fails_the_runs_tier():
    def execute(_k, x, out):
        y = torch.softmax(x["x"], dim=-1)
        out[:, :20] = y[:, :20]  # columns 20..32 never written

    r = tiers.run_case(_case(execute=execute))
    assert (r["status"], r["tier"]) == ("FAIL", "runs")
    assert r["stats"]["unwritten"] == 8 * 13


def test_nan_computed_by_the_kernel_is_not_mistaken_for_unwritten_output():
    def execute(_k, x, out):
        y = torch.softmax(x["x"], dim=-1)
        y[3, 5] = math.nan  # written, but wrong
        out.copy_(y)

    r = tiers.run_case(_case(execute=execute))
    assert (r["status"], r["tier"]) == ("FAIL", "agrees")
    assert r["stats"]["nonfinite"] == 1


def test_a_kernel_that_allocates_its_own_output_is_checked_too():
    r = tiers.run_case(_case(execute=lambda _k, x, out: torch.softmax(x["x"], dim=-1)))
    assert r["status"] == "PASS"
    r = tiers.run_case(_case(execute=lambda _k, x, out: torch.softmax(x["x"], dim=0)))
    assert (r["status"], r["tier"]) == ("FAIL", "agrees")


def test_broken_input_builder_is_an_error_not_a_kernel_failure():
    case = _case()
    case.prepare = lambda: 1 / 0
    r = tiers.run_case(case)
    assert r["status"] == "ERROR"


def _topk_case(run):
    def prepare():
        scores = torch.randn(16, 64, dtype=torch.float64)
        scores[:, 10] = scores[:, 11] = scores.max() + 1.0  # an exact tie at the top
        return {"s": scores, "k": 4}

    return tiers.KernelCase(
        id="fake.topk", kind="fake", dtype="float32", device="cpu", load=lambda: None,
        prepare=prepare, execute=lambda _k, x, out: run(x), reference=lambda x: x["s"],
        compare=tiers.topk_compare(lambda out, ref, x: 1e-6), out_spec=None)


def test_topk_agrees_up_to_ties_and_catches_a_wrong_selection():
    ok = tiers.run_case(_topk_case(lambda x: x["s"].float().topk(4, dim=-1).indices))
    assert ok["status"] == "PASS", ok
    wrong = tiers.run_case(_topk_case(lambda x: (-x["s"]).topk(4, dim=-1).indices))  # bottom-k
    assert (wrong["status"], wrong["tier"]) == ("FAIL", "agrees")
    assert wrong["stats"]["hard_mismatches"] > 0
    dup = tiers.run_case(_topk_case(lambda x: x["s"].topk(1, dim=-1).indices.repeat(1, 4)))
    assert dup["status"] == "FAIL" and dup["stats"]["duplicate_indices"] > 0


@pytest.mark.parametrize("dtype,u", [("bfloat16", 2**-8), ("float16", 2**-11), ("float32", 2**-24)])
def test_tolerance_is_multiple_times_baseline_plus_unit_roundoff(dtype, u):
    case = _case()
    case.dtype = dtype
    r = tiers.run_case(case)
    s = r["stats"]
    assert s["floor"] == u
    assert s["tol"] == pytest.approx(3 * s["baseline_rel_l2"] + u)


def test_baseline_that_overflows_falls_back_to_output_rounding_and_says_so():
    """Real MLA activations overflow fp16 q.k in plain math while fused kernels do not
    (seen on the H200 with a tiny glm-dsa): the check must not fail the kernel for that."""
    case = _case()
    case.dtype = "float16"
    case.baseline = lambda x: torch.full_like(x["x"], math.inf)
    r = tiers.run_case(case)
    assert r["status"] == "PASS", r["message"]
    assert r["stats"]["baseline_nonfinite"] == 8 * 33 and "overflows" in r["message"]
    wrong = _case(execute=lambda _k, x, out: out.copy_(torch.softmax(x["x"] * 1.05, dim=-1)))
    wrong.dtype = "float16"
    wrong.baseline = case.baseline
    assert tiers.run_case(wrong)["status"] == "FAIL"


def test_compact_report_survives_nan_statistics():
    import io

    from rich.console import Console

    from ggufcheck.cli.kernels import render_compact
    from ggufcheck.results import Result, StageReport, Status

    stage = StageReport("kernels", [Result("kernels.sdpa", Status.PASS, "kernel", "x | agrees: ok",
                                           stats={"rel_l2": "nan", "tol": "nan"}),
                                    Result("kernels.sdpa", Status.PASS, "kernel", "y | agrees: ok",
                                           stats={"rel_l2": 1e-3, "tol": 2e-3})])
    out = io.StringIO()
    render_compact(Console(file=out, width=200), stage)
    assert "2 cases" in out.getvalue() and "y" in out.getvalue()
