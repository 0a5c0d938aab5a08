"""Each file fault produces exactly what it says, in a new file, leaving the input untouched.

Faulty files are read back with gguf-py's reader (or raw bytes) to check the fault is there
and that nothing else changed; where the fault is an integrity fault, ggufcheck's own
validated reader must reject the file with a BadFileError.
"""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFValueType as T

from ggufcheck.errors import BadFileError, GGUFCheckError
from ggufcheck.testing import filefaults as ff


@pytest.fixture(scope="module")
def mla_q8(tiny_gguf):
    """A deepseek2 file with Q8_0 matrices, F16 k_b (rows of 16) and F32 norms."""
    return tiny_gguf("deepseek2", qtypes={"default": "Q8_0", "attn_k_b": "F16"}).path


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tensors(path) -> dict[str, tuple[Q, tuple[int, ...], bytes]]:
    r = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type, tuple(int(x) for x in reversed(t.shape.tolist())),
                     bytes(r.data[t.data_offset:t.data_offset + t.n_bytes])) for t in r.tensors}


def _fields(path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: (f.contents(), f.types) for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_rewrite_without_edit_is_byte_identical(mla_q8, tiny_gguf, tmp_path):
    out = ff.rewrite(mla_q8, tmp_path / "same.gguf", lambda c: None)
    assert out.read_bytes() == mla_q8.read_bytes()
    split_part = tiny_gguf("glm-dsa", qtypes="Q8_0", n_nextn=1).path
    assert ff.rewrite(split_part, tmp_path / "same2.gguf", lambda c: None).read_bytes() == split_part.read_bytes()


@pytest.mark.hf
def test_rewrite_of_a_converted_file_is_byte_identical(tiny_converted, tmp_path):
    src = tiny_converted("glm-dsa", "q8_0").gguf_path
    assert ff.rewrite(src, tmp_path / "same.gguf", lambda c: None).read_bytes() == src.read_bytes()


def test_wrong_shape_consistent_keeps_data(mla_q8, tmp_path):
    name = "blk.0.attn_q_a.weight"  # [128, 64] Q8_0
    before = _tensors(mla_q8)
    out = ff.wrong_shape(mla_q8, tmp_path / "f.gguf", name)
    after = _tensors(out)
    assert after[name][1] == (64, 128) and after[name][2] == before[name][2]
    assert {n: v for n, v in after.items() if n != name} == {n: v for n, v in before.items() if n != name}


def test_wrong_shape_inconsistent_is_rejected_by_the_reader(mla_q8, tmp_path):
    from ggufcheck.gguf.reader import open_gguf

    name = "blk.1.ffn_norm.weight"
    out = ff.wrong_shape(mla_q8, tmp_path / "f.gguf", name, consistent=False)
    with pytest.raises(BadFileError):
        with open_gguf(out):
            pass
    with pytest.raises(GGUFCheckError):  # a shape that loses elements is refused when consistent
        ff.wrong_shape(mla_q8, tmp_path / "g.gguf", name, shape=(63,))


def test_missing_tensor(mla_q8, tmp_path):
    name = "blk.2.exp_probs_b.bias"
    before = _tensors(mla_q8)
    after = _tensors(ff.missing_tensor(mla_q8, tmp_path / "f.gguf", name))
    assert name not in after
    assert after == {n: v for n, v in before.items() if n != name}


def test_swap_kb_vb(mla_q8, tmp_path):
    k, v = "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"
    before = _tensors(mla_q8)
    after = _tensors(ff.swap_kb_vb(mla_q8, tmp_path / "f.gguf", layer=1))
    assert after[k] == before[v] and after[v] == before[k]
    assert after[k][1] == (4, 48, 32)  # v_b's [H, V, L] under k_b's name
    assert {n: x for n, x in after.items() if n not in (k, v)} == \
        {n: x for n, x in before.items() if n not in (k, v)}


def test_swap_with_equal_shapes_is_a_silent_data_swap(tiny_gguf, tmp_path):
    src = tiny_gguf("llama").path
    a, b = "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"
    before = _tensors(src)
    after = _tensors(ff.swap_tensors(src, tmp_path / "f.gguf", a, b))
    assert after[a][:2] == before[a][:2] and after[a][2] == before[b][2] and after[b][2] == before[a][2]


@pytest.mark.parametrize("value", ["nan", "inf", "huge"])
def test_corrupt_block_scale_q8_0(mla_q8, tmp_path, value):
    name, block = "blk.1.ffn_up_exps.weight", 37  # [8, 32, 64]: 2 blocks of 32 per row
    out = ff.corrupt_block_scale(mla_q8, tmp_path / "f.gguf", name, block=block, value=value)
    src_bytes, out_bytes = np.frombuffer(mla_q8.read_bytes(), np.uint8), np.frombuffer(out.read_bytes(), np.uint8)
    assert src_bytes.size == out_bytes.size and np.count_nonzero(src_bytes != out_bytes) <= 2
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(out).tensors}
    clean = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(mla_q8).tensors}
    x = gguf.quants.dequantize(raw[name], Q.Q8_0).reshape(-1, 32)  # one row per block
    x0 = gguf.quants.dequantize(clean[name], Q.Q8_0).reshape(-1, 32)
    others = np.arange(len(x)) != block
    np.testing.assert_array_equal(x[others], x0[others])
    if value == "nan":
        assert np.isnan(x[block]).all()
    elif value == "inf":
        assert np.isinf(x[block][x0[block] != 0]).all()
    else:
        assert np.abs(x[block]).max() > 1000 * np.abs(x0[block]).max()


def test_corrupt_block_scale_second_field_and_float_tensor(tiny_gguf, tmp_path):
    src = tiny_gguf("llama", qtypes="Q4_1").path
    out = ff.corrupt_block_scale(src, tmp_path / "m.gguf", "blk.0.attn_q.weight", block=3, field=1)
    t = next(t for t in gguf.GGUFReader(out).tensors if t.name == "blk.0.attn_q.weight")
    x = gguf.quants.dequantize(np.asarray(t.data), Q.Q4_1).reshape(-1, 32)
    assert np.isnan(x[3]).all() and np.isfinite(np.delete(x, 3, axis=0)).all()
    out2 = ff.corrupt_block_scale(src, tmp_path / "n.gguf", "blk.0.attn_norm.weight", block=5, value="inf")
    t2 = next(t for t in gguf.GGUFReader(out2).tensors if t.name == "blk.0.attn_norm.weight")
    data = np.asarray(t2.data)
    assert np.isinf(data[5]) and np.isfinite(np.delete(data, 5)).all()
    with pytest.raises(GGUFCheckError):
        ff.corrupt_block_scale(src, tmp_path / "o.gguf", "blk.0.attn_q.weight", field=2)


def test_metadata_faults(mla_q8, tmp_path):
    before = _fields(mla_q8)
    key = "deepseek2.attention.kv_lora_rank"
    after = _fields(ff.drop_key(mla_q8, tmp_path / "a.gguf", key))
    assert key not in after and after == {k: v for k, v in before.items() if k != key}

    key = "deepseek2.attention.head_count"
    after = _fields(ff.set_key(mla_q8, tmp_path / "b.gguf", key, "four", T.STRING))
    assert after[key] == ("four", [T.STRING])

    after = _fields(ff.inconsistent_mla(mla_q8, tmp_path / "c.gguf"))
    P_R = before["deepseek2.attention.key_length_mla"][0]
    assert P_R == 16 + 8  # the file's P + R
    assert after["deepseek2.attention.key_length_mla"] == (P_R + 8, [T.UINT32])


def test_non_dividing_heads(tiny_gguf, tmp_path):
    src = tiny_gguf("qwen2").path
    after = _fields(ff.non_dividing_heads(src, tmp_path / "f.gguf"))
    h, hkv = after["qwen2.attention.head_count"][0], after["qwen2.attention.head_count_kv"][0]
    assert h % hkv != 0


def test_truncate_and_offsets_are_rejected_by_the_reader(mla_q8, tmp_path):
    from ggufcheck.gguf.reader import open_gguf

    size = mla_q8.stat().st_size
    cut = ff.truncate(mla_q8, tmp_path / "cut.gguf")
    assert cut.stat().st_size < size and cut.read_bytes() == mla_q8.read_bytes()[:cut.stat().st_size]
    bad = [cut,
           ff.truncate(mla_q8, tmp_path / "cut2.gguf", size=20),
           ff.tensor_data_offset(mla_q8, tmp_path / "off.gguf", "blk.0.attn_norm.weight", 10 ** 9),
           ff.tensor_data_offset(mla_q8, tmp_path / "mis.gguf", "blk.0.attn_q_a.weight", 3),
           ff.header_count(mla_q8, tmp_path / "cnt.gguf", "tensor_count", 2 ** 40),
           ff.header_count(mla_q8, tmp_path / "kv.gguf", "kv_count", 2 ** 63 - 1)]
    for path in bad:
        with pytest.raises(BadFileError):
            with open_gguf(path):
                pass


def test_input_is_never_written(mla_q8, tmp_path):
    digest = _sha(mla_q8)
    ff.wrong_shape(mla_q8, tmp_path / "1.gguf", "blk.0.attn_q_a.weight")
    ff.swap_kb_vb(mla_q8, tmp_path / "2.gguf")
    ff.corrupt_block_scale(mla_q8, tmp_path / "3.gguf", "token_embd.weight")
    ff.truncate(mla_q8, tmp_path / "4.gguf")
    ff.header_count(mla_q8, tmp_path / "5.gguf", "kv_count", 0)
    assert _sha(mla_q8) == digest
    with pytest.raises(GGUFCheckError):
        ff.truncate(mla_q8, mla_q8)
    with pytest.raises(GGUFCheckError):
        ff.missing_tensor(mla_q8, mla_q8, "token_embd.weight")
    assert _sha(mla_q8) == digest
    with pytest.raises(GGUFCheckError):
        ff.missing_tensor(mla_q8, tmp_path / "6.gguf", "no.such.tensor")
