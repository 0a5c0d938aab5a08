"""The row-wise kernels (engines/rowwise.py) against numpy's forms of the same formulas."""

from __future__ import annotations

import numpy as np
import pytest

from ggufcheck.engines import rowwise


def _numpy_log_softmax(x):
    b = x.astype(np.float64)
    b = b - b.max(axis=1, keepdims=True)
    return b - np.log(np.exp(b).sum(axis=1, keepdims=True))


def _tables(rng, t=37, v=5003, scale=4.0, noise=1e-3):
    logits = rng.normal(0, scale, (t, v))
    ref = _numpy_log_softmax(logits)
    eng = _numpy_log_softmax(logits + rng.normal(0, noise, (t, v))).astype(np.float32)
    return logits, ref, eng


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_log_softmax_is_numpys(dtype):
    logits, _, _ = _tables(np.random.default_rng(0))
    x = logits.astype(dtype)
    got = rowwise.log_softmax_rows(x, np.float64)
    np.testing.assert_allclose(got, _numpy_log_softmax(x), rtol=1e-12, atol=1e-12)
    assert rowwise.log_softmax_rows(x, np.float32).dtype == np.float32


def test_log_softmax_of_a_row_with_nan_or_inf_is_nan_as_in_numpy():
    x = np.zeros((3, 8), np.float32)
    x[0, 3] = np.nan
    x[1, 2] = np.inf
    x[2, :4] = -np.inf
    got = rowwise.log_softmax_rows(x)
    with np.errstate(invalid="ignore"):
        want = _numpy_log_softmax(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[2], want[2])


@pytest.mark.parametrize("noise", [1e-6, 1e-3, 1.0])
def test_kl_and_nmse_are_numpys(noise):
    _, ref, eng = _tables(np.random.default_rng(1), noise=noise)
    rows = np.array([0, 5, 36, 7])
    kl, nmse = rowwise.kl_nmse(ref, eng, rows)
    lr, le = ref[rows], eng[rows].astype(np.float64)
    d = lr - le
    want_kl = (np.exp(lr) * d).sum(axis=1)
    want_nmse = (d * d).mean(axis=1) / lr.var(axis=1)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(nmse, want_nmse, rtol=1e-12)
    if noise >= 1e-3:  # below, the float32 table's own rounding (not normalised exactly) dominates
        assert (kl > 0).all()


def test_top_k_is_numpys_order():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(23, 1001)).astype(np.float32)
    x[4, 10] = np.nan  # NaN never ranks
    ids, vals = rowwise.top_k(x, 5)
    want_ids = np.argsort(-np.nan_to_num(x, nan=-np.inf), axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(vals, np.take_along_axis(x, want_ids, 1).astype(np.float64))
    nan_row = np.full((1, 4), np.nan, np.float32)
    nan_row[0, 2] = 1.0
    ids, vals = rowwise.top_k(nan_row, 3)
    assert ids[0].tolist() == [2, 0, 1] and vals[0, 0] == 1.0 and np.isnan(vals[0, 1:]).all()
    with pytest.raises(ValueError):
        rowwise.top_k(x, rowwise.MAX_K + 1)


def test_the_numpy_log_softmax_an_engine_process_without_numba_uses_agrees(monkeypatch):
    """GGUFCHECK_NO_NUMBA=1 (set in a CUDA llama.cpp's engine process, where numba's LLVM
    segfaults): the same log-softmax from numpy, NaN rows where the kernel has them."""
    from ggufcheck.engines.rowwise import NO_NUMBA, log_softmax_rows

    rng = np.random.default_rng(0)
    x = (rng.normal(size=(37, 5000)) * 5).astype(np.float32)
    x[3, 7], x[5, 2], x[6] = np.nan, np.inf, -np.inf
    fast = log_softmax_rows(x, np.float64)
    monkeypatch.setenv(NO_NUMBA, "1")
    plain = log_softmax_rows(x, np.float64)
    assert np.array_equal(np.isnan(fast), np.isnan(plain))
    finite = np.isfinite(fast)
    assert np.abs(fast[finite] - plain[finite]).max() < 1e-12
