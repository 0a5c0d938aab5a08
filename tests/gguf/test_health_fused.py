"""The fused one-pass health scan gives the plain path's answers, for every type.

The plain path (dequantize into a buffer, then ``stats.chunk_stats``) is itself checked
against numpy and against located corruptions in ``test_health.py``; here the fused path
(``quants.fused_row_stats``) must reproduce it on blocks that hold every special case: sane
rows, an all-zero row, rows of fuzz blocks with NaN/Inf/subnormal scales (redone exactly on
the plain path), spread over several fused chunks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggufcheck.gguf import health, quants
from ggufcheck.gguf.quants import samples, tables
from ggufcheck.gguf.reader import open_gguf

pytest.importorskip("numba")

Q = gguf.GGMLQuantizationType
TYPES = [Q.F32, *quants.KERNELS]
N_ROWS = 11
ZERO_ROW, FUZZ_ROWS = 4, (6, 9)


def _tensor_bytes(qtype: Q) -> tuple[np.ndarray, int]:
    """(N_ROWS, row_bytes) raw rows and the row length in elements."""
    block, size = tables.block_geometry(qtype)
    blocks_per_row = max(2, 512 // block)
    rows = samples.realistic_blocks(qtype, N_ROWS * blocks_per_row, seed=3).reshape(N_ROWS, -1)
    rows[ZERO_ROW] = 0
    # fuzz_blocks puts its special scales first; pick +Inf (index 8) and NaN (10) into the rows
    fuzz = samples.fuzz_blocks(qtype, 64 + 2 * blocks_per_row, seed=4)
    picked = np.r_[8, 64 : 63 + blocks_per_row, 10, 63 + blocks_per_row : 62 + 2 * blocks_per_row]
    fuzz = fuzz[picked].reshape(len(FUZZ_ROWS), -1)
    if qtype == Q.F32:  # F32 has no scales: put NaN/Inf into the values themselves
        fuzz.view(np.float32)[:, 1:3] = (np.nan, -np.inf)
    rows[list(FUZZ_ROWS)] = fuzz
    return rows, blocks_per_row * block


def _write(path: Path, tensors: dict[str, Q]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, qtype in tensors.items():
        raw, row_elements = _tensor_bytes(qtype)
        if qtype == Q.F32:
            w.add_tensor(name, raw.view(np.float32))
        else:
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("fused") / "all_types.gguf", {t.name: t for t in TYPES})


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fused_scan_equals_plain_scan(model_path, qtype, monkeypatch):
    with open_gguf(model_path) as model:
        info = model.tensors[qtype.name]
        monkeypatch.setattr(health, "FUSED_CHUNK_BYTES", 3 * info.row_bytes)  # 4 fused calls
        rows = quants.fused_row_stats(model.raw_rows(info.name, 0, 2), qtype, tables.F16_SCALE_FIELDS.get(qtype, ()))
        assert rows is not None, f"fused path unavailable for {qtype.name}: {quants.cpu_path(qtype)}"
        fused = health.scan_tensor(model, info, fused=True)
        plain = health.scan_tensor(model, info, fused=False)
    exact = ("nan", "inf", "zero_rows", "absmax", "bad_scales", "first_bad_block", "first_bad_value", "problems")
    assert {k: getattr(fused, k) for k in exact} == {k: getattr(plain, k) for k in exact}
    assert fused.mean == pytest.approx(plain.mean, rel=1e-9, abs=1e-12)
    assert fused.std == pytest.approx(plain.std, rel=1e-9, abs=1e-12)
    # the sample must exercise what it is meant to: a zero row, and NaN/Inf to be redone exactly
    assert plain.zero_rows >= 1
    if qtype != Q.NVFP4:  # its UE4M3 scale has no NaN/Inf code in gguf-py (0x7F decodes to 0)
        assert plain.nan + plain.inf > 0 and plain.first_bad_value is not None
    if qtype in tables.F16_SCALE_FIELDS:
        assert plain.bad_scales > 0


def test_fused_rows_match_per_row_plain_statistics():
    """Per-row columns (not just the totals) against dequantize + numpy, on sane Q4_K rows."""
    from ggufcheck.gguf.quants import fused

    raw, row_elements = _tensor_bytes(Q.Q4_K)
    sane = np.delete(raw, FUZZ_ROWS, axis=0)
    rows = quants.fused_row_stats(sane, Q.Q4_K, tables.F16_SCALE_FIELDS[Q.Q4_K])
    values = quants.dequantize(sane, Q.Q4_K).astype(np.float64)
    assert (rows[:, fused.NONFINITE] == 0).all() and (rows[:, fused.BAD_SCALES] == 0).all()
    absmax = rows[:, fused.ABSMAX_BITS].astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(absmax, np.abs(values).max(axis=1).astype(np.float32))
    np.testing.assert_array_equal(rows[:, fused.OR_BITS] == 0, (values == 0).all(axis=1))
    np.testing.assert_allclose(rows[:, fused.SUM], values.sum(axis=1), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rows[:, fused.SUM_SQ], (values**2).sum(axis=1), rtol=1e-10)


def test_gguf_py_forced_takes_the_plain_path(model_path, monkeypatch):
    monkeypatch.setenv(quants.FORCE_ENV, "gguf-py")
    with open_gguf(model_path) as model:
        info = model.tensors["Q4_K"]
        assert quants.fused_row_stats(model.raw_rows(info.name, 0, 1), Q.Q4_K, ()) is None
        h = health.scan_tensor(model, info)
    assert h.bad_scales > 0 and h.nan + h.inf > 0


def test_rows_too_long_for_scratch_take_the_plain_path(model_path, monkeypatch):
    with open_gguf(model_path) as model:
        info = model.tensors["Q8_0"]
        want = health.scan_tensor(model, info, fused=False)
        monkeypatch.setattr(health, "FUSED_MAX_ROW_ELEMENTS", info.row_elements - 1)
        monkeypatch.setattr(quants, "fused_row_stats", lambda *a: pytest.fail("fused path taken"))
        got = health.scan_tensor(model, info)
    assert dataclasses.asdict(got) == dataclasses.asdict(want)


def test_read_ahead_is_clipped_to_the_file(model_path):
    """touch_pages runs past a tensor into the next ones and stops at the end of the file."""
    with open_gguf(model_path) as model:
        infos = list(model.tensors.values())
        for info in (infos[0], infos[-1]):
            model.touch_pages(info.name, 0, 1 << 40)
            model.touch_pages(info.name, info.n_rows, 1 << 40)
        assert health.scan_tensor(model, infos[-1]).n_elements == infos[-1].n_elements


def test_without_numba_the_plain_path_gives_the_same_health(model_path):
    """A missing or broken numba (import fails) falls back to gguf-py + numpy statistics."""
    import json
    import subprocess
    import sys

    code = ("import sys, json; sys.modules['numba'] = None\n"
            "from ggufcheck.gguf.health import scan_model\n"
            "from ggufcheck.gguf.reader import open_gguf\n"
            "from ggufcheck.gguf.quants import cpu_path\n"
            "import gguf\n"
            "assert cpu_path(gguf.GGMLQuantizationType.Q4_K).startswith('gguf-py'), cpu_path(gguf.GGMLQuantizationType.Q4_K)\n"
            "with open_gguf(sys.argv[1]) as m:\n"
            "    print(json.dumps({h.name: [h.nan, h.inf, h.zero_rows, h.absmax, h.bad_scales, h.first_bad_block,"
            " h.first_bad_value] for h in scan_model(m)}))\n")
    done = subprocess.run([sys.executable, "-c", code, str(model_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    without = json.loads(done.stdout)
    with open_gguf(model_path) as model:
        fused = {h.name: [h.nan, h.inf, h.zero_rows, h.absmax, h.bad_scales, h.first_bad_block, h.first_bad_value]
                 for h in health.scan_model(model)}
    assert without == fused
