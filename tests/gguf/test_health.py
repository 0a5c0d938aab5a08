"""The health scan finds NaN/Inf block scales, zero tensors and absurd magnitudes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from ggufcheck.gguf import stats
from ggufcheck.gguf.health import SCALE_FIELDS, scan_model
from ggufcheck.gguf.reader import open_gguf

Q = gguf.GGMLQuantizationType


def write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32,):
            w.add_tensor(name, data)
        else:
            raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_corrupted_block_scale_is_located(tmp_path, qtype, bad):
    rng = np.random.default_rng(0)
    path = write(tmp_path / "m.gguf", {"w": (rng.standard_normal((8, 256)).astype(np.float32), qtype)})
    data = bytearray(path.read_bytes())
    with open_gguf(path) as model:
        info = model.tensors["w"]
        block = 13
        at = info.offset + block * info.type_size + SCALE_FIELDS[qtype][0]
    data[at : at + 2] = np.array([bad], dtype=np.float16).tobytes()
    path.write_bytes(bytes(data))
    with open_gguf(path) as model:
        (h,) = scan_model(model)
    assert not h.healthy
    assert h.bad_scales == 1 and h.first_bad_block == block
    assert h.nan + h.inf > 0 and h.first_bad_value // 32 == block


def test_healthy_zero_and_absurd_tensors(tmp_path):
    rng = np.random.default_rng(1)
    path = write(tmp_path / "m.gguf", {
        "ok": (rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0),
        "zero": (np.zeros((4, 64), np.float32), Q.F32),
        "huge": (np.full((2, 32), 1e6, np.float32), Q.F32),
    })
    with open_gguf(path) as model:
        by_name = {h.name: h for h in scan_model(model)}
    assert by_name["ok"].healthy and by_name["ok"].zero_rows == 0
    assert "every row is all zeros" in by_name["zero"].problems[0]
    assert "exceeds" in by_name["huge"].problems[0]


def test_numba_and_numpy_statistics_agree():
    pytest.importorskip("numba")
    rng = np.random.default_rng(2)
    values = rng.standard_normal((37, 96)).astype(np.float32)
    values[3] = 0.0
    values[5, 7] = np.nan
    values[9, 1] = -np.inf
    values[20, 50] = np.inf
    a = stats.chunk_stats(values)
    b = stats._stats_numpy(values)
    assert (a.nan, a.inf, a.zero_rows, a.first_bad) == (b.nan, b.inf, b.zero_rows, b.first_bad) == (1, 2, 1, 5 * 96 + 7)
    assert a.absmax == b.absmax
    assert a.total == pytest.approx(b.total, rel=1e-12, abs=1e-9)
    assert a.total_sq == pytest.approx(b.total_sq, rel=1e-12)
