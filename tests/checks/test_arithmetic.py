"""The served stage's decode steps against the arithmetic the engine states (checks/arithmetic.py):
a one-token kernel far off its own rounding is a warning in `diagnose` (its limits are the class
allowance), and a correct one lands at 1x."""

from __future__ import annotations

import pytest

from ggufcheck.checks.arithmetic import excess
from ggufcheck.results import Status


@pytest.fixture(scope="module")
def q5k(tmp_path_factory):
    from ggufcheck.checks.quant_matrix import build_model

    return build_model("Q5_K", tmp_path_factory.mktemp("ar"))


def _arithmetic(path, factory):
    from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose

    engine = factory(str(path))
    try:
        d = diagnose(DiagnoseOptions(model=path, sanity=False, kernels=False, max_prompts=2, decode_to=0, sweep_to=0),
                     engine=engine)
    finally:
        engine.close()
    return d, next(r for s in d.stages for r in s.results if r.check == "logits.decode_arithmetic")


def test_a_matrix_vector_kernel_off_its_arithmetic_is_a_warning_in_diagnose(q5k):
    from ggufcheck.testing.faults import q5_k_matvec_subtle

    d, result = _arithmetic(q5k, q5_k_matvec_subtle)
    assert result.status == Status.WARN and result.stats["ratio"] > 10, result.message
    assert d.verdict.healthy and any("decode_arithmetic" in w for w in d.verdict.warnings)  # never the verdict


def test_the_stated_arithmetic_lands_at_one(q5k):
    from ggufcheck.testing.faults import cuda_arithmetic_engine

    _, result = _arithmetic(q5k, cuda_arithmetic_engine)
    assert result.status == Status.PASS and 0.99 < result.stats["ratio"] < 1.01, result.stats


def test_excess_is_the_served_formula_without_the_class_allowance():
    assert excess((1e-4, 1e-5)) is None  # 3 x 1e-5 + 1e-4 = 1.3e-4
    assert excess((2e-4, 1e-5)) == pytest.approx(20.0)
    assert excess(None) is None
