"""The streaming builder writes the in-memory builder's file, in bounded memory, at any size.

The in-memory builder (``build_tiny_gguf``) is the oracle: same dims, types and seed must
give the same bytes, with row blocks small enough that every tensor is written in several.
Large-vocabulary files are read back by gguf-py and tokenized by ggufcheck's tokenizer.
"""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from ggufcheck.synthetic.streaming import build_streaming_gguf, scale_dims
from ggufcheck.synthetic.tiny import build_tiny_gguf, tensor_shapes, tiny_dims, tokenizer_metadata


@pytest.mark.parametrize("arch,qtypes", [
    ("glm-dsa", "Q8_0"),
    ("deepseek2", {"default": "Q4_0", "attn_kv_a_mqa": "F16", "token_embd": "BF16", "ffn_down_exps": "Q5_1"}),
    ("llama", "F32"),
    ("gpt-oss", {"default": "Q8_0", "ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4"}),
])
def test_same_bytes_as_the_in_memory_builder(tmp_path, arch, qtypes):
    d = tiny_dims(arch, n_embd=64)
    tiny = build_tiny_gguf(d, tmp_path / "tiny.gguf", qtypes=qtypes, seed=3)
    # 1 KiB blocks: every matrix is generated, encoded and written in several row blocks
    streamed = build_streaming_gguf(d, tmp_path / "streamed.gguf", qtypes=qtypes, seed=3, block_bytes=1024)
    assert streamed.qtypes == tiny.qtypes
    assert (tmp_path / "streamed.gguf").read_bytes() == (tmp_path / "tiny.gguf").read_bytes()


def test_random_block_types_are_valid_and_spread_like_the_weights(tmp_path):
    d = tiny_dims("llama", n_embd=256, n_ff=256)
    m = build_streaming_gguf(d, tmp_path / "q4k.gguf", qtypes="Q4_K", block_bytes=4096)
    r = gguf.GGUFReader(m.path)
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    assert np.isfinite(values).all()
    assert 0.3 < float(values.std()) * np.sqrt(256) < 3.0  # ~ N(0, 1/fan_in), as the weights


def test_scale_dims_are_the_real_models():
    glm = scale_dims("glm-5")
    assert (glm.n_embd, glm.n_head, glm.n_layer, glm.n_expert, glm.n_vocab, glm.n_dense_lead) == \
        (6144, 64, 78, 256, 154880, 3)
    assert (glm.q_lora_rank, glm.kv_lora_rank, glm.qk_nope, glm.qk_rope, glm.v_head_dim) == (2048, 512, 192, 64, 256)
    assert (glm.indexer_heads, glm.indexer_dim, glm.indexer_top_k, glm.n_ff, glm.n_ff_exp) == (32, 128, 2048, 12288, 2048)
    # the weights of the real model's trunk (the paper: ~744e9 with the NextN layer)
    n = sum(int(np.prod(s)) for s in tensor_shapes(glm).values())
    assert 7.2e11 < n < 7.5e11
    small = scale_dims("glm-5", n_layer=2, n_expert=16, n_vocab=900)
    assert (small.n_layer, small.n_dense_lead, small.n_expert) == (2, 1, 16)
    kimi = scale_dims("kimi-k2", n_layer=2)
    assert (kimi.n_embd, kimi.n_head, kimi.n_expert, kimi.n_dense_lead, kimi.yarn_factor) == (7168, 64, 384, 1, 32.0)
    v3 = scale_dims("deepseek-v3")
    assert (v3.n_head, v3.n_group, v3.n_group_used, v3.n_vocab) == (128, 8, 4, 129280)


def test_a_glm5_vocabulary_is_a_valid_bpe_ggufcheck_tokenizes(tmp_path):
    kv = tokenizer_metadata(154880)
    tokens, merges = kv["tokenizer.ggml.tokens"][0], kv["tokenizer.ggml.merges"][0]
    assert len(tokens) == 154880 and len(set(tokens)) == 154880
    known = set(tokens)
    assert all(a in known and b in known and a + b in known for a, b in (m.split(" ") for m in merges))
    # the first 959 tokens are those of the small vocabularies (older test files unchanged)
    assert tokenizer_metadata(959)["tokenizer.ggml.tokens"][0][:-1] == tokens[:958]
    d = tiny_dims("llama", n_layer=1, n_embd=32, n_head=2, head_dim=16, n_ff=32, n_vocab=154880)
    m = build_streaming_gguf(d, tmp_path / "big-vocab.gguf", qtypes="F16")
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.tokenizer import load_tokenizer

    with open_gguf(m.path) as model:
        tok = load_tokenizer(model)
        ids = tok.encode("the theatre thereafter", add_special=False, parse_special=False)
        assert max(ids) > 959  # long merges (levels 3 and 4) used
        assert tok.decode(ids) == "the theatre thereafter"


def test_peak_memory_does_not_grow_with_the_file(tmp_path):
    """Two files 8x apart in size written in one fresh process each: peak RSS within 60 MB."""
    code = ("import resource, sys; from ggufcheck.synthetic.streaming import build_streaming_gguf; "
            "from ggufcheck.synthetic.tiny import tiny_dims; "
            "d = tiny_dims('llama', n_layer=int(sys.argv[2]), n_embd=1024, head_dim=256, n_ff=4096); "
            "build_streaming_gguf(d, sys.argv[1], qtypes='Q8_0', block_bytes=4 << 20); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    peaks = []
    for layers in (1, 8):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"m{layers}.gguf"), str(layers)],
                             capture_output=True, text=True, check=True)
        peaks.append(int(out.stdout.split()[-1]) / 1024)  # MB
    sizes = [(tmp_path / f"m{n}.gguf").stat().st_size / 1e6 for n in (1, 8)]
    assert sizes[1] > 5 * sizes[0] and sizes[1] > 100
    assert peaks[1] - peaks[0] < 60, (peaks, sizes)
