"""Internal consistency of the reference: step-by-step decode through the KV cache (MLA:
the latent cache) equals prefill at every position; MLA's naive and absorbed forms agree;
streaming (one layer in memory) equals resident weights; replaying one layer from a trace
reproduces it."""

import pytest
import torch

from ggufcheck.reference import KVCache, ReferenceModel, Trace

# Two paths through the same fp64 arithmetic that differ only in how a matrix is laid out in
# memory (a freshly dequantized tensor vs a cached one, a row block vs the whole matrix) are
# not bit-identical on every CPU: MKL's GEMM on AMD EPYC (this project's CI machines) rounds
# differently with the operands' alignment and with the output width (measured: 8 of 14
# realigned fp64 products differ in the last bits). They agree to a few ulps of fp64 (measured
# there: streaming vs resident 1.8e-15, row / expert / score blocks 3.6e-15 on logprobs of ~11),
# which this bound states with room; a wrong block, row or expert moves logprobs by 1e-3 or more.
SAME_ARITHMETIC = 1e-12


def same_arithmetic(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b are one computation up to fp64 summation order."""
    scale = max(1.0, float(a.abs().max()))
    return a.shape == b.shape and float((a - b).abs().max()) <= SAME_ARITHMETIC * scale


@pytest.mark.parametrize("arch", ["llama", "qwen3", "glm4moe", "deepseek2-yarn", "glm-dsa-shared"])
def test_decode_equals_prefill(arch, tiny, prompt):
    tokens = prompt(14)  # > top_k (6) of glm-dsa-shared: decode steps use the sparse mask
    with ReferenceModel(tiny(arch).gguf_path, dtype="fp64") as ref:
        prefill = ref.prefill(tokens, trace=False)
        decode = ref.decode(tokens)
        # a prompt chunk then decode steps, through one cache
        cache = KVCache()
        head, _, _ = ref.forward(tokens[:5], cache)
        rest = ref.decode(tokens[5:], cache)
    assert decode.shape == prefill.shape
    assert (decode - prefill).abs().max() < 1e-10
    assert (torch.cat([head, rest]) - prefill).abs().max() < 1e-10


@pytest.mark.parametrize("arch", ["deepseek2", "glm-dsa-shared"])
def test_mla_absorbed_equals_naive(arch, tiny, prompt):
    tokens = prompt(12)
    path = tiny(arch).gguf_path
    with ReferenceModel(path, dtype="fp64", mla_form="naive") as naive, \
            ReferenceModel(path, dtype="fp64", mla_form="absorbed") as absorbed:
        a, b = naive.prefill(tokens), absorbed.prefill(tokens)
        step = absorbed.decode(tokens[:6])
        short = naive.prefill(tokens[:6], trace=False)
    for la, lb in zip(a.layers, b.layers):
        assert (la.attn_out - lb.attn_out).abs().max() < 1e-11 * la.attn_out.abs().max()
    assert (a.logprobs - b.logprobs).abs().max() < 1e-10
    assert (step - short).abs().max() < 1e-10


def test_fp32_close_to_fp64(tiny, prompt):
    tokens = prompt(10)
    path = tiny("glm4moe").gguf_path
    with ReferenceModel(path, dtype="fp64") as r64, ReferenceModel(path, dtype="fp32") as r32:
        lp64, lp32 = r64.prefill(tokens).logprobs, r32.prefill(tokens).logprobs
    assert lp32.dtype == torch.float32
    assert (lp64 - lp32.double()).abs().max() < 1e-4


def test_streaming_equals_resident(tiny, prompt):
    tokens = prompt(10)
    path = tiny("glm-dsa").gguf_path
    with ReferenceModel(path, streaming=True) as s, ReferenceModel(path, streaming=False) as r:
        ts, tr = s.prefill(tokens), r.prefill(tokens)
        kept = [key[1] for key in s.weights.cache._items]
        assert kept == ["output_norm.weight"] and r.weights.cache.used > 0  # streaming kept no layer tensor
    assert same_arithmetic(ts.logprobs, tr.logprobs)


@pytest.mark.parametrize("arch", ["glm-dsa", "deepseek2", "gpt-oss", "gemma3"])
def test_bounded_memory_paths_give_the_same_numbers(arch, tiny, prompt, monkeypatch):
    """Per-expert reads, row-blocked matrices, query-blocked scores and a cache that keeps part
    of the model (forced on a tiny model by shrinking their limits) give the same traces (to fp64 summation order: see SAME_ARITHMETIC)."""
    from ggufcheck.reference import layers, weights

    tokens = prompt(24)
    path = tiny(arch).gguf_path
    with ReferenceModel(path, streaming=False) as r:
        want = r.prefill(tokens)
    monkeypatch.setattr(weights, "ROW_BLOCK_BYTES", 4096)  # every matrix over 4 KiB in blocks
    monkeypatch.setattr(weights, "BLOCK_BYTES", 2048)  # of 2 KiB
    monkeypatch.setattr(layers, "SCORES_BYTES", 512)  # a few query rows per score block
    cache = weights.WeightCache(20_000)  # keeps a few small tensors, streams the rest
    with ReferenceModel(path) as b:
        b.weights.close()
        b.weights = weights.WeightStore(b.gguf, b.dtype, b.device, cache=cache)
        first = b.prefill(tokens)
        got = b.prefill(tokens)  # the second pass reads what the cache kept
        assert torch.equal(first.logprobs, got.logprobs)
        kept = sum(t.numel() * t.element_size() for k, t in cache._items.items() if k[1].startswith("blk."))
        assert 0 < kept <= 20_000 and cache.hits > 0  # (plus the always-kept output_norm)
        assert isinstance(b.weights.layer(0)["attn_output.weight"], weights.RowBlocked)
    assert same_arithmetic(got.logprobs, want.logprobs)
    for a, c in zip(want.layers, got.layers):
        assert same_arithmetic(a.hidden, c.hidden) and same_arithmetic(a.attn_out, c.attn_out)
    assert cache.used == 0  # the last store over the file closed: its entries went
    compact = weights.WeightCache(1 << 30, compact=True)  # float32 entries widened per read
    with ReferenceModel(path) as c:
        c.weights.close()
        c.weights = weights.WeightStore(c.gguf, c.dtype, c.device, cache=compact)
        c.prefill(tokens)
        assert all(t.dtype == torch.float32 for k, t in compact._items.items() if k[1].startswith("blk."))
        assert same_arithmetic(c.prefill(tokens).logprobs, want.logprobs)


@pytest.mark.parametrize("arch", ["glm4moe", "glm-dsa-shared"])
def test_trace_save_load_and_replay(arch, tiny, prompt, tmp_path):
    tokens = prompt(12)
    with ReferenceModel(tiny(arch).gguf_path, dtype="fp64") as ref:
        trace = ref.prefill(tokens)
        files = trace.save(tmp_path / "golden")
        assert [f.suffix for f in files] == [".safetensors", ".json"]
        loaded = Trace.load(tmp_path / "golden.safetensors")
        assert loaded.tokens == tokens and loaded.dtype == "fp64"
        assert loaded.meta["model_fingerprint"]["method"] == "sha256"
        assert loaded.meta["model_fingerprint"] == trace.meta["model_fingerprint"]
        assert torch.equal(loaded.logprobs, trace.logprobs)
        for i, (a, b) in enumerate(zip(trace.layers, loaded.layers)):
            assert a.topk_full == b.topk_full
            for name in ("after_attn", "hidden", "attn_out", "ffn_out", "expert_ids", "expert_weights", "topk"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None and y is None) or torch.equal(x, y), (i, name)
            out = loaded.replay(ref, i)  # one layer on the recorded input
            assert torch.equal(out.hidden, a.hidden), i
            if a.topk is not None:
                assert torch.equal(out.topk, a.topk)


def test_trace_load_errors(tmp_path):
    from ggufcheck.errors import BadFileError

    with pytest.raises(BadFileError, match="not found"):
        Trace.load(tmp_path / "missing")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 16)
    (tmp_path / "bad.json").write_text('{"format": 1, "n_layer": 0}')
    with pytest.raises(BadFileError):
        Trace.load(tmp_path / "bad")


def test_sampled_fingerprint_for_big_files(tiny, tmp_path, monkeypatch):
    """Files over FULL_HASH_LIMIT get a cheap fingerprint (header, size, 64 samples) that
    still changes when the data changes."""
    import shutil

    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.reference import trace as trace_mod

    monkeypatch.setattr(trace_mod, "FULL_HASH_LIMIT", 0)
    monkeypatch.setattr(trace_mod, "_SAMPLE", 4096)
    copy = tmp_path / "m.gguf"
    shutil.copy(tiny("llama").gguf_path, copy)
    with open_gguf(copy) as m:
        first = trace_mod.model_fingerprint(m)
        data_start = m.parts[0][2]
    assert first["method"] == "sampled" and first == trace_mod.model_fingerprint(open_gguf(copy))
    with open(copy, "r+b") as f:  # flip a byte inside the first sample of the data
        f.seek(data_start + 10)
        byte = f.read(1)
        f.seek(data_start + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open_gguf(copy) as m:
        assert trace_mod.model_fingerprint(m)["value"] != first["value"]
