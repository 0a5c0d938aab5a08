"""Our own tiny GGUF writer: layout, metadata, quant types, determinism, splits, llama.cpp.

The layout itself is checked against llama.cpp's converter in test_producers_agree.py;
here the files are read back with gguf-py's reader (an implementation we did not write)
and with ggufcheck's validated reader, and loaded by llama.cpp where it is installed.
"""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ggufcheck.synthetic import qblocks
from ggufcheck.synthetic.tiny import (ARCHS, metadata, random_weights, resolve_qtypes, tensor_shapes,
                                    tiny_dims)


def _shapes(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_and_metadata_read_back(tiny_gguf, arch):
    m = tiny_gguf(arch)
    r = gguf.GGUFReader(m.path)
    assert list(_shapes(r).items()) == list(tensor_shapes(m.dims).items())
    assert all(t.tensor_type == Q.F32 for t in r.tensors)
    for key, (value, vtype) in metadata(m.dims, file_type=0).items():
        assert r.fields[key].types[0] == vtype, key
        got = r.fields[key].contents()
        if vtype == gguf.GGUFValueType.FLOAT32:
            assert got == pytest.approx(value, rel=1e-7), key
        else:
            assert got == value, key
    weights = random_weights(m.dims, m.seed)
    for t in r.tensors:  # F32 data is the planned weights, bit for bit
        np.testing.assert_array_equal(np.asarray(t.data).reshape(weights[t.name].shape), weights[t.name])


@pytest.mark.parametrize("arch", ["llama", "deepseek2", "glm-dsa"])
def test_project_reader_accepts(tiny_gguf, arch):
    from ggufcheck.gguf.reader import open_gguf

    m = tiny_gguf(arch, qtypes="Q8_0")
    with open_gguf(m.path) as model:
        assert model.architecture == arch
        assert {n: ti.shape for n, ti in model.tensors.items()} == tensor_shapes(m.dims)
        assert {n: ti.qtype for n, ti in model.tensors.items()} == m.qtypes


def test_same_seed_same_bytes_other_seed_other_bytes(tiny_gguf):
    a = tiny_gguf("glm-dsa", qtypes={"default": "Q8_0", "attn_k_b": "F16"})
    b = tiny_gguf("glm-dsa", qtypes={"default": "Q8_0", "attn_k_b": "F16"})
    c = tiny_gguf("glm-dsa", qtypes={"default": "Q8_0", "attn_k_b": "F16"}, seed=1)
    assert a.path != b.path
    assert _digest(a.path) == _digest(b.path)
    assert _digest(a.path) != _digest(c.path)


def test_qtype_resolution_precedence_and_fallbacks():
    d = tiny_dims("deepseek2")
    shapes = tensor_shapes(d)
    chosen, fallbacks = resolve_qtypes(shapes, {"default": "Q8_0", "attn_v_b": "Q4_0",
                                                "blk.1.attn_v_b.weight": "F16",
                                                "attn_kv_a_norm": "F16"})
    assert chosen["token_embd.weight"] == Q.Q8_0
    assert chosen["blk.0.attn_v_b.weight"] == Q.Q4_0  # role beats default
    assert chosen["blk.1.attn_v_b.weight"] == Q.F16  # full name beats role
    assert chosen["blk.0.attn_norm.weight"] == Q.F32  # 1-D stays F32 unless named
    assert chosen["blk.0.attn_kv_a_norm.weight"] == Q.F16  # ... named here
    # k_b rows have length P = 16: no Q8_0 block fits, it falls back to F16
    assert chosen["blk.0.attn_k_b.weight"] == Q.F16 and "blk.0.attn_k_b.weight" in fallbacks
    assert all(shapes[n][-1] % qblocks.block_size(chosen[n]) == 0 for n in shapes)


def test_quantized_data_dequantizes_to_the_weights(tiny_gguf):
    m = tiny_gguf("qwen3", qtypes={"default": "Q8_0", "ffn_down": "Q4_0", "attn_q": "BF16"})
    weights = random_weights(m.dims, m.seed)
    r = gguf.GGUFReader(m.path)
    for t in r.tensors:
        assert t.tensor_type == m.qtypes[t.name]
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(weights[t.name].shape)
        w = weights[t.name]
        # per-type error bound relative to the tensor's scale (Q4_0: 1/8 of the block max)
        bound = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15}[t.tensor_type]
        assert np.abs(x - w).max() <= bound * np.abs(w).max() + 1e-7, t.name
    assert m.qtypes["blk.0.ffn_down.weight"] == Q.Q4_0 and m.qtypes["blk.0.attn_q.weight"] == Q.BF16


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS",
                                   "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL",
                                   "IQ4_XS"])
def test_unquantizable_types_become_valid_random_blocks(tiny_gguf, qtype):
    m = tiny_gguf("llama", qtypes=qtype, n_embd=256, n_ff=256, head_dim=64)
    assert "blk.0.ffn_up.weight" in m.random_block_tensors
    r = gguf.GGUFReader(m.path)
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    assert t.tensor_type == Q[qtype]
    x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    assert x.shape == (256, 256) and np.isfinite(x).all() and 0 < np.abs(x).max() < 100
    # down has rows of length n_ff: quantized too; 1-D norms stay F32
    assert m.qtypes["blk.0.ffn_down.weight"] == Q[qtype]
    assert m.qtypes["blk.0.attn_norm.weight"] == Q.F32


@pytest.mark.parametrize("qtype", sorted(qblocks.F16_SCALE_OFFSETS, key=int))
def test_scale_offset_table_against_gguf_py(qtype):
    """A NaN written at the table's offset makes exactly that block NaN in gguf-py's dequantize."""
    rng = np.random.default_rng(0)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    blocks = qblocks.random_blocks(rng, 2, 2 * max(bs, 256), qtype)
    clean = gguf.quants.dequantize(blocks, qtype)
    assert np.isfinite(clean).all()
    for offset in qblocks.F16_SCALE_OFFSETS[qtype]:
        bad = blocks.copy()
        bad[1, ts + offset:ts + offset + 2] = np.array([np.nan], "<f2").view(np.uint8)  # row 1, block 1
        x = gguf.quants.dequantize(bad, qtype)
        hit = np.zeros_like(x, dtype=bool)
        hit[1, bs:2 * bs] = True
        assert np.isnan(x[hit]).any(), (qtype.name, offset)
        np.testing.assert_array_equal(x[~hit], clean[~hit])


def test_nextn_layers(tiny_gguf):
    m = tiny_gguf("glm4moe", n_nextn=1)
    r = gguf.GGUFReader(m.path)
    names = {t.name for t in r.tensors}
    assert r.fields["glm4moe.block_count"].contents() == 4
    assert r.fields["glm4moe.nextn_predict_layers"].contents() == 1
    for part in ("eh_proj", "enorm", "hnorm", "shared_head_norm"):
        assert f"blk.3.nextn.{part}.weight" in names
    assert _shapes(r)["blk.3.nextn.eh_proj.weight"] == (64, 128)  # [D, 2D]
    assert "blk.3.ffn_gate_exps.weight" in names and "blk.2.nextn.eh_proj.weight" not in names


def test_indexer_types_shared_layers_have_no_indexer(tiny_gguf):
    m = tiny_gguf("glm-dsa", indexer_types=(True, False, True))
    r = gguf.GGUFReader(m.path)
    names = {t.name for t in r.tensors}
    assert r.fields["glm-dsa.attention.indexer.types"].contents() == [True, False, True]
    assert r.fields["glm-dsa.attention.indexer.types"].types == [gguf.GGUFValueType.ARRAY,
                                                                 gguf.GGUFValueType.BOOL]
    for i, full in enumerate((True, False, True)):
        assert (f"blk.{i}.indexer.attn_k.weight" in names) == full
        assert (f"blk.{i}.indexer.k_norm.bias" in names) == full


def test_kv_b_layouts(tiny_gguf):
    fused = tiny_gguf("deepseek2", kv_b="fused")
    both = tiny_gguf("deepseek2", kv_b="both")
    rf, rb = gguf.GGUFReader(fused.path), gguf.GGUFReader(both.path)
    nf, nb = set(_shapes(rf)), set(_shapes(rb))
    assert "blk.0.attn_kv_b.weight" in nf and "blk.0.attn_k_b.weight" not in nf
    assert {"blk.0.attn_kv_b.weight", "blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= nb
    assert _shapes(rf)["blk.0.attn_kv_b.weight"] == (4 * (16 + 48), 32)  # [H*(P+Vd), L]
    assert "deepseek2.attention.key_length_mla" not in rf.fields  # legacy: the MHA view
    assert rf.fields["deepseek2.attention.head_count_kv"].contents() == 4
    assert rf.fields["deepseek2.attention.key_length"].contents() == 16 + 8
    data = {t.name: np.asarray(t.data) for t in rb.tensors}
    H, P, Vd, L = 4, 16, 48, 32
    kv_b = data["blk.1.attn_kv_b.weight"].reshape(H, P + Vd, L)  # per head: P K rows, Vd V rows
    np.testing.assert_array_equal(kv_b[:, :P].transpose(0, 2, 1), data["blk.1.attn_k_b.weight"].reshape(H, L, P))
    np.testing.assert_array_equal(kv_b[:, P:], data["blk.1.attn_v_b.weight"].reshape(H, Vd, L))
    fused_kv_b = next(np.asarray(t.data) for t in rf.tensors if t.name == "blk.1.attn_kv_b.weight")
    np.testing.assert_array_equal(fused_kv_b, data["blk.1.attn_kv_b.weight"])  # same model


def test_split_files_as_gguf_split_writes_them(tiny_gguf, tiny_split):
    whole = tiny_gguf("deepseek2", qtypes="Q8_0")
    split = tiny_split("deepseek2", 3, qtypes="Q8_0")
    assert [p.name for p in split.paths] == [f"deepseek2-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]
    whole_r = gguf.GGUFReader(whole.path)
    total = len(whole_r.tensors)
    seen = {}
    for k, p in enumerate(split.paths):
        r = gguf.GGUFReader(p)
        T = gguf.GGUFValueType
        assert (r.fields["split.no"].contents(), r.fields["split.no"].types) == (k, [T.UINT16])
        assert (r.fields["split.count"].contents(), r.fields["split.count"].types) == (3, [T.UINT16])
        assert r.fields["split.tensors.count"].contents() == total
        assert r.fields["split.tensors.count"].types == [T.INT32]
        model_keys = [f for f in r.fields if not f.startswith(("GGUF.", "split."))]
        assert bool(model_keys) == (k == 0)  # metadata in the first file only
        assert len(r.tensors) > 0
        for t in r.tensors:
            seen[t.name] = (t.tensor_type, bytes(np.asarray(t.data).tobytes()))
    assert seen == {t.name: (t.tensor_type, bytes(np.asarray(t.data).tobytes())) for t in whole_r.tensors}


def test_project_reader_accepts_split(tiny_split):
    from ggufcheck.gguf.reader import open_gguf

    split = tiny_split("llama", 2)
    with open_gguf(split.path) as model:
        assert tuple(model.paths) == split.paths
        assert set(model.tensors) == set(tensor_shapes(split.dims))


# ---------------------------------------------------------------------------------------
# llama.cpp loads and runs what we write


def _llama_eval(path, text=b"the quick brown fox jumps over the lazy dog again and again"):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=1,
                          type_k=0, type_v=0)  # F32 KV cache: the F16 default moves logits ~1e-3
    tokens = llm.tokenize(text)
    llm.eval(tokens)
    logits = np.array(llm.scores[:len(tokens)])
    llm.close()
    return tokens, logits


@pytest.mark.llama
@pytest.mark.parametrize("arch,kwargs", [
    ("llama", {}), ("deepseek2", {"qtypes": "Q8_0"}), ("deepseek2", {"yarn_factor": 4.0}),
    ("glm-dsa", {"n_nextn": 1, "indexer_types": (True, False, True)}), ("glm4moe", {}),
    ("qwen2", {}), ("qwen3", {}), ("llama", {"tied_output": True}),
    ("deepseek2", {"kv_b": "fused"}),
    # (q_lora_rank=0, V2-Lite style, is not loadable: llama.cpp requires q_lora_rank unless
    # the model has V2-Lite's layer count, 26/27, or 48 with a 128256 vocabulary)
])
def test_llama_cpp_loads_and_evaluates(tiny_gguf, arch, kwargs):
    m = tiny_gguf(arch, **kwargs)
    tokens, logits = _llama_eval(m.path)
    assert len(tokens) > 8  # longer than glm-dsa's top_k: the indexer selects
    assert logits.shape == (len(tokens), m.dims.n_vocab) and np.isfinite(logits).all()
    assert np.abs(logits[1] - logits[-1]).max() > 1e-3  # the output depends on the input


@pytest.mark.llama
def test_llama_cpp_split_and_fused_kv_b_are_the_same_model(tiny_gguf):
    """llama.cpp's MLA path (attn_k_b / attn_v_b) and its legacy MHA path (attn_kv_b) on
    files of one seed: our fused kv_b means what llama.cpp's split tensors mean."""
    _, split = _llama_eval(tiny_gguf("deepseek2").path)
    _, fused = _llama_eval(tiny_gguf("deepseek2", kv_b="fused").path)
    assert np.abs(split - fused).max() < 1e-4 * np.abs(split).max()
    assert np.abs(split[1:] - split[:-1]).max() > 0.1


@pytest.mark.llama
def test_llama_cpp_loads_split(tiny_split, tiny_gguf):
    split = tiny_split("llama", 3)
    whole = tiny_gguf("llama")
    _, a = _llama_eval(split.path)
    _, b = _llama_eval(whole.path)
    np.testing.assert_array_equal(a, b)


def test_qwen2_and_phi3_head_dim_follows_n_embd():
    """Their files carry no attention.key_length (as llama.cpp's converter writes them), so a
    reader takes head_dim = n_embd / n_head: a wider tiny model gets that head_dim (llama.cpp
    refused the file before: 'attn_q has wrong shape'), and a contradicting head_dim is refused."""
    from ggufcheck.errors import GGUFCheckError
    from ggufcheck.synthetic.tiny import tiny_dims

    for arch in ("qwen2", "phi3"):
        d = tiny_dims(arch, n_embd=256)
        assert d.n_head * d.head_dim == 256
        with pytest.raises(GGUFCheckError, match="key_length"):
            tiny_dims(arch, n_embd=256, head_dim=16)
