"""The comparison value and the frozen Result: each metric against numpy's own formula on random
arrays (NaN, infinities and shape mismatches included), the worst element holding both sides,
and a Result that cannot be changed once made, only amended into a new one."""

from __future__ import annotations

import copy
import json
import math
import pickle
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
import torch

from ggufcheck.comparison import exact, max_abs, rel_error, to_result, within_rtol
from ggufcheck.results import Status, failed, passed


@pytest.fixture
def pair():
    rng = np.random.default_rng(7)
    want = rng.normal(size=(5, 9))
    got = want + rng.normal(scale=1e-3, size=want.shape)
    return got, want


def test_max_abs_is_numpys_max_of_differences_and_names_its_element(pair):
    got, want = pair
    cmp = max_abs(got, want, 1e-2, "x")
    diff = np.abs(got - want)
    assert cmp.value == pytest.approx(diff.max()) and bool(cmp) and cmp.size == got.size
    assert cmp.worst.index == tuple(int(i) for i in np.unravel_index(diff.argmax(), diff.shape))
    assert (cmp.worst.got, cmp.worst.want) == (got[cmp.worst.index], want[cmp.worst.index])
    assert not max_abs(got, want, diff.max() / 2)  # the same numbers, a tighter limit


def test_max_abs_counts_equal_infinities_as_equal_and_nan_or_one_sided_infinity_as_infinite():
    want = np.array([-np.inf, 1.0, 2.0])
    assert max_abs(np.array([-np.inf, 1.0, 2.0]), want, 0.0).value == 0.0  # masked scores on both sides
    assert max_abs(np.array([np.inf, 1.0, 2.0]), want, 1.0).value == math.inf
    nan = max_abs(np.array([-np.inf, np.nan, 2.0]), want, 1.0)
    assert nan.value == math.inf and not nan and nan.worst.index == (1,)


def test_rel_error_is_the_frobenius_ratio_on_numpy_and_torch(pair):
    got, want = pair
    expected = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel_error(got, want, 1.0).value == pytest.approx(expected)
    assert rel_error(torch.tensor(got), torch.tensor(want, dtype=torch.bfloat16), 1.0).value == pytest.approx(
        np.linalg.norm(got - torch.tensor(want, dtype=torch.bfloat16).float().numpy()) /
        np.linalg.norm(torch.tensor(want, dtype=torch.bfloat16).float().numpy()), rel=1e-6)
    not_finite = got.copy()
    not_finite[0, 0] = np.nan
    assert not rel_error(not_finite, want, 1e9)  # NaN is never within a limit


def test_within_rtol_agrees_with_the_elementwise_rule(pair):
    got, want = pair
    for rtol in (1e-1, 1e-3, 1e-5):
        rule = bool(np.all(np.abs(got - want) <= rtol * np.abs(want) + 1e-30))
        assert bool(within_rtol(got, want, rtol)) is rule, rtol


def test_exact_counts_differing_elements_with_nan_equal_to_nan():
    want = np.array([1.0, np.nan, 3.0, 4.0])
    assert exact(want.copy(), want) and exact(want.copy(), want).value == 0
    got = np.array([1.0, np.nan, 3.5, 5.0])
    cmp = exact(got, want, "case")
    assert cmp.value == 2 and cmp.worst.index == (2,) and "2 of 4 elements differ" in cmp.text()


def test_a_shape_mismatch_fails_and_says_both_shapes():
    cmp = max_abs(np.zeros((2, 3)), np.zeros((3, 2)), 1.0)
    assert not cmp and cmp.extra == {"shape_got": [2, 3], "shape_want": [3, 2]}


def test_to_result_converts_once_with_the_evidence(pair):
    got, want = pair
    bad = to_result(max_abs(got, want, 1e-9, "blk.0.x"), "t.check", "weights", tensor="blk.0.x")
    assert bad.status is Status.FAIL and bad.tensor == "blk.0.x"
    assert bad.message.startswith("blk.0.x: max |diff|") and "got" in bad.message and "want" in bad.message
    assert bad.stats["limit"] == 1e-9 and set(bad.worst) == {"element", "got", "want"}
    assert to_result(max_abs(got, want, 1.0), "t.check", "weights").status is Status.PASS


def test_a_result_is_never_changed_once_made_only_amended():
    r = failed("t.check", "weights", "wrong", stats={"kl": 1.0}, worst={"rank": 2})
    with pytest.raises(FrozenInstanceError):
        r.message = "changed"
    with pytest.raises(TypeError):
        r.stats["kl"] = 0.0
    with pytest.raises(TypeError):
        r.worst.update(rank=0)
    again = r.amended("; more", stats={"layer": 3}, component="attention")
    assert (r.message, r.component, dict(r.stats)) == ("wrong", "weights", {"kl": 1.0})
    assert (again.message, again.component, dict(again.stats)) == ("wrong; more", "attention", {"kl": 1.0, "layer": 3})
    assert again.amended(message="new").message == "new"


def test_a_frozen_result_still_pickles_copies_and_serializes():
    r = passed("t.check", "weights", "ok", stats={"nested": {"a": [1, 2]}}, worst={"rank": 0})
    for clone in (pickle.loads(pickle.dumps(r)), copy.deepcopy(r), copy.copy(r)):
        assert clone.to_json() == r.to_json()
    assert json.loads(json.dumps(r.to_json()))["stats"] == {"nested": {"a": [1, 2]}}


def test_a_kernel_probes_agreement_is_judged_by_a_comparison_on_the_host():
    """The probe (in the target interpreter) measures the kernel against fp64; the host turns
    the measurement into a Comparison and a Result the way every other check does, worst
    element included; cases with their own agreement rule keep the probe's words."""
    from ggufcheck.checks.kernels import result_from_answer

    stats = {"rel_l2": 0.5, "tol": 0.1, "baseline_rel_l2": 0.03, "multiple": 3.0, "floor": 0.01,
             "baseline": "fp16 math", "worst": {"index": 3, "got": 1.5, "want": 1.0}}
    answer = {"case": "sdpa.flash.gqa_128.fp16.cuda", "kind": "sdpa", "tier": "agrees", "dtype": "fp16",
              "device": "cuda", "status": "PASS", "message": "the probe's own words", "stats": stats}
    result = result_from_answer(answer)
    assert result.failed  # the host's judgment: 0.5 > 0.1, whatever the probe said
    assert "relative error 0.5 > 0.1 at [3]: got 1.5, want 1" in result.message
    assert "3 x baseline 0.03 + floor 0.01" in result.message
    assert result.worst == {"element": [3], "got": 1.5, "want": 1.0}
    assert result.stats["metric"] == "rel_error" and result.stats["baseline"] == "fp16 math"

    within = result_from_answer({**answer, "status": "FAIL", "stats": {**stats, "rel_l2": 0.05}})
    assert within.status is Status.PASS and "relative error 0.05 <= 0.1" in within.message

    own_rule = result_from_answer({**answer, "status": "FAIL", "message": "top-k sets differ at 2 rows",
                                   "stats": {"jaccard": 0.5}})
    assert own_rule.failed and "top-k sets differ" in own_rule.message
