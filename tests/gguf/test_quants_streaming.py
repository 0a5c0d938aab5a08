"""The streaming-store kernels of large outputs vs gguf-py and vs their plain twins, bit for bit.

The kernels only run on outputs past ``registry.STREAM_MIN_BYTES`` (tens of MB); here that threshold is
lowered so that fuzz blocks (NaN/Inf/subnormal scales forced in) and real registry tensors take the
streaming path through the public ``dequantize_into``, and the bytes around the output are checked
untouched (a streaming store writes 16 bytes at a time).
"""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest

pytest.importorskip("numba")

from ggufcheck.gguf.quants import compare, dequantize_into, host, registry, samples, tables  # noqa: E402

Q = gguf.GGMLQuantizationType
STREAMED = list(registry.STREAMED)


def _oracle(raw: np.ndarray, qtype: Q) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)


def _aligned_window(n: int, guard: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(buffer poisoned with NaN, its 16-byte aligned float32 window of n elements) with guards around."""
    buffer = np.full(n + 2 * guard + 8, np.nan, np.float32)
    first = guard + (-(buffer.ctypes.data // 4 + guard)) % 4  # first element on a 16-byte boundary
    return buffer, buffer[first:first + n]


@pytest.fixture
def stream_everything(monkeypatch):
    monkeypatch.setattr(registry, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(host, "_broken_streaming", {})


@pytest.mark.parametrize("qtype", STREAMED, ids=lambda q: q.name)
def test_streaming_fuzz_bit_exact_and_in_bounds(qtype, stream_everything):
    block, _ = tables.block_geometry(qtype)
    raw = samples.fuzz_blocks(qtype, 257, seed=100 + int(qtype))  # odd count: uneven task shares
    buffer, window = _aligned_window(raw.size // tables.block_geometry(qtype)[1] * block)
    guards = buffer.view(np.uint32).copy()
    assert registry.streams(qtype, window)
    dequantize_into(raw, qtype, window)
    assert not host._broken_streaming, host._broken_streaming
    result = compare.compare_blocks(window, _oracle(raw, qtype), block, qtype.name)
    assert result, str(result)
    # the same bits as the ordinary-store kernel (-0.0 included; a NaN may differ in sign, as
    # x - m and x + (-m) do, which gguf-py's comparison treats alike), and nothing written outside
    plain = np.empty(window.size, np.float32)
    registry.KERNELS[qtype].plain()(raw, plain, *registry.KERNELS[qtype].tables())
    both_nan = np.isnan(window) & np.isnan(plain)
    assert np.array_equal(window.view(np.uint32)[~both_nan], plain.view(np.uint32)[~both_nan])
    assert np.array_equal(np.isnan(window), np.isnan(plain))
    start = (window.ctypes.data - buffer.ctypes.data) // 4
    outside = np.r_[0:start, start + window.size:buffer.size]
    assert np.array_equal(buffer.view(np.uint32)[outside], guards[outside])


@pytest.mark.parametrize("qtype", STREAMED, ids=lambda q: q.name)
def test_streaming_realistic_blocks_match_gguf_py(qtype, stream_everything):
    block, size = tables.block_geometry(qtype)
    raw = samples.realistic_blocks(qtype, 1000, seed=int(qtype)).reshape(10, -1)
    _, window = _aligned_window(1000 * block)
    out = dequantize_into(raw, qtype, window.reshape(10, -1))
    assert compare.compare_blocks(out, _oracle(raw, qtype), block, qtype.name)


def test_unaligned_or_small_outputs_take_the_plain_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(registry.KERNELS[Q.Q4_K].module(), "q4_k_streaming", lambda *args: calls.append(args))
    raw = samples.realistic_blocks(Q.Q4_K, 64, seed=3)
    buffer, window = _aligned_window(64 * 256)
    monkeypatch.setattr(registry, "STREAM_MIN_BYTES", 1 << 40)
    assert compare.compare_blocks(dequantize_into(raw, Q.Q4_K, window), _oracle(raw, Q.Q4_K), 256)
    monkeypatch.setattr(registry, "STREAM_MIN_BYTES", 0)
    start = (window.ctypes.data - buffer.ctypes.data) // 4
    shifted = buffer[start + 1:start + 1 + window.size]  # 4 bytes past a 16-byte boundary
    assert not registry.streams(Q.Q4_K, shifted)
    assert compare.compare_blocks(dequantize_into(raw, Q.Q4_K, shifted), _oracle(raw, Q.Q4_K), 256)
    assert not calls  # neither the small nor the misaligned output reached the streaming kernel
    assert registry.streams(Q.Q4_K, window)
    dequantize_into(raw, Q.Q4_K, window)
    assert len(calls) == 1


def test_failing_streaming_kernel_falls_back_to_plain(monkeypatch, stream_everything):
    def broken(*args):
        raise RuntimeError("simulated streaming failure")

    monkeypatch.setattr(registry.KERNELS[Q.Q6_K].module(), "q6_k_streaming", broken)
    raw = samples.fuzz_blocks(Q.Q6_K, 40, seed=4)
    _, window = _aligned_window(40 * 256)
    assert compare.compare_blocks(dequantize_into(raw, Q.Q6_K, window), _oracle(raw, Q.Q6_K), 256)
    assert "simulated streaming failure" in host._broken_streaming[Q.Q6_K]


def test_last_level_cache_size_is_read():
    assert registry.STREAM_MIN_BYTES >= 2**20 and registry.STREAM_MIN_BYTES % 2**10 == 0


@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_streaming_real_tensors_match_gguf_py(model, request, stream_everything):
    """Every streamed type found in a registry model, whole tensors, through the streaming path."""
    from ggufcheck.gguf.reader import open_gguf

    path = request.getfixturevalue(model)  # skips where the registry package is absent
    seen = set()
    with open_gguf(path) as gguf_file:
        for info in gguf_file.tensors.values():
            if info.qtype not in registry.STREAMED or info.qtype in seen:
                continue
            seen.add(info.qtype)
            n_rows = min(info.n_rows, max(1, (4 << 20) // info.row_bytes))
            raw = gguf_file.raw_rows(info.name, 0, n_rows)
            _, window = _aligned_window(n_rows * info.row_elements)
            out = dequantize_into(raw, info.qtype, window.reshape(n_rows, info.row_elements))
            block, _ = tables.block_geometry(info.qtype)
            result = compare.compare_blocks(out, _oracle(raw, info.qtype), block, f"{path.name}:{info.name}")
            assert result, str(result)
    assert seen and not host._broken_streaming, (seen, host._broken_streaming)
