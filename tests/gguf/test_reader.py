"""The validated reader against gguf-py's reader, and its errors on malformed files."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggufcheck.errors import BadFileError
from ggufcheck.gguf.dequant import dequantize_tensor
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.testing.fuzz import write_seed_file


@pytest.fixture
def seed_file(tmp_path: Path) -> Path:
    return write_seed_file(tmp_path / "seed.gguf")


def assert_same_as_gguf_py(path: Path) -> None:
    ref = gguf.GGUFReader(str(path))
    with open_gguf(path) as model:
        assert [t.name for t in ref.tensors] == list(model.tensors)
        for t in ref.tensors:
            info = model.tensors[t.name]
            assert info.ne == tuple(int(x) for x in t.shape)
            assert info.qtype == t.tensor_type
            assert info.offset == t.data_offset and info.nbytes == t.n_bytes
            ours = dequantize_tensor(model, t.name).numpy()
            theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
            np.testing.assert_array_equal(ours, theirs)
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):
                continue
            value = field.contents()
            if isinstance(value, float):
                assert model.metadata[key] == pytest.approx(value, rel=1e-7)
            elif isinstance(value, list) and value and isinstance(value[0], float):
                assert model.metadata[key] == pytest.approx(value, rel=1e-7)
            else:
                assert model.metadata[key] == value, key


def test_matches_gguf_py_on_seed_file(seed_file: Path):
    assert_same_as_gguf_py(seed_file)


@pytest.mark.slow
def test_matches_gguf_py_on_smollm2(smollm2_path: Path):
    assert_same_as_gguf_py(smollm2_path)


def test_raw_rows_reads_only_the_slice(seed_file: Path):
    with open_gguf(seed_file) as model:
        name = "blk.0.q8_0.weight"
        full = dequantize_tensor(model, name)
        part = dequantize_tensor(model, name, rows=slice(2, 5))
        assert part.shape == (3, 64)
        assert (part == full[2:5]).all()
        with pytest.raises(IndexError):
            model.raw_rows(name, 5, 100)


def test_file_is_opened_read_only(seed_file: Path):
    before = seed_file.read_bytes()
    with open_gguf(seed_file) as model:
        raw = model.raw("token_embd.weight")
        assert not raw.flags.writeable
        with pytest.raises(ValueError):
            raw[0, 0] = 1
    assert seed_file.read_bytes() == before


def _patched(seed: Path, out: Path, offset: int, fmt: str, value: int) -> Path:
    data = bytearray(seed.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(
    "offset,fmt,value,expect",
    [
        (0, "<I", 0x12345678, "not a GGUF file"),
        (4, "<I", 1, "unsupported GGUF version 1"),
        (4, "<I", 3 << 24, "byte-swapped"),
        (8, "<Q", 2**63, "tensor_count"),
        (16, "<Q", 2**40, "metadata_kv_count"),
    ],
)
def test_header_errors_name_field_and_offset(seed_file, tmp_path, offset, fmt, value, expect):
    bad = _patched(seed_file, tmp_path / "bad.gguf", offset, fmt, value)
    with pytest.raises(BadFileError) as err:
        open_gguf(bad)
    assert expect in str(err.value)
    assert str(bad) in str(err.value)
    assert err.value.offset is not None


def _tensor_info_offsets(path: Path) -> dict[str, int]:
    """Byte offset of each tensor's info record, found with gguf-py's reader."""
    ref = gguf.GGUFReader(str(path))
    return {t.name: int(t.field.offset) for t in ref.tensors}


def _info_field_offset(path: Path, name: str, which: str) -> int:
    """Offset of n_dims / ne[0] / type / data offset inside a tensor info record."""
    start = _tensor_info_offsets(path)[name]
    n_dims_at = start + 8 + len(name.encode())
    (n_dims,) = struct.unpack_from("<I", path.read_bytes(), n_dims_at)
    return {
        "n_dims": n_dims_at,
        "ne0": n_dims_at + 4,
        "type": n_dims_at + 4 + 8 * n_dims,
        "offset": n_dims_at + 8 + 8 * n_dims,
    }[which]


@pytest.mark.parametrize(
    "which,fmt,value,expect",
    [
        ("n_dims", "<I", 5, "n_dims 5"),
        ("n_dims", "<I", 0, "n_dims 0"),
        ("ne0", "<Q", 2**63 + 5, "negative as int64"),
        ("ne0", "<Q", 48, "not a multiple of Q8_0's block size 32"),
        ("ne0", "<Q", 2**40, "runs past the end"),
        ("type", "<I", 4, "unknown tensor type 4"),
        ("type", "<I", 99, "unknown tensor type 99"),
        ("offset", "<Q", 3, "not aligned"),
        ("offset", "<Q", 2**62, "runs past the end"),
        ("offset", "<Q", 0, "overlaps"),
    ],
)
def test_tensor_errors_name_the_tensor(seed_file, tmp_path, which, fmt, value, expect):
    name = "blk.0.q8_0.weight"
    offset = _info_field_offset(seed_file, name, which)
    bad = _patched(seed_file, tmp_path / "bad.gguf", offset, fmt, value)
    with pytest.raises(BadFileError) as err:
        open_gguf(bad)
    assert expect in str(err.value)
    if expect != "overlaps":
        assert name in str(err.value)


def test_truncated_file_is_rejected(seed_file, tmp_path):
    data = seed_file.read_bytes()
    for cut in (0, 3, 23, 100, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(BadFileError):
            open_gguf(bad)


def test_lying_string_length_is_bounded(seed_file, tmp_path):
    # the first metadata key's length field sits right after the 24-byte header
    bad = _patched(seed_file, tmp_path / "bad.gguf", 24, "<Q", 2**60)
    with pytest.raises(BadFileError) as err:
        open_gguf(bad)
    assert "runs past the end" in str(err.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(BadFileError, match="file not found"):
        open_gguf(tmp_path / "nope.gguf")
    with pytest.raises(BadFileError, match="directory"):
        open_gguf(tmp_path)


def _write_split(tmp_path: Path, n_parts: int = 3) -> list[Path]:
    """A split model written the way llama.cpp's gguf-split lays it out."""
    rng = np.random.default_rng(1)
    names = [f"blk.{i}.w.weight" for i in range(n_parts * 2)]
    paths = []
    for no in range(n_parts):
        path = tmp_path / f"model-{no + 1:05d}-of-{n_parts:05d}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint16("split.no", no)
        w.add_uint16("split.count", n_parts)
        w.add_int32("split.tensors.count", len(names))
        for name in names[no * 2 : no * 2 + 2]:
            w.add_tensor(name, rng.standard_normal((2, 32)).astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


def test_split_model_opens_as_one(tmp_path):
    paths = _write_split(tmp_path)
    for p in paths:  # any part opens the whole model
        with open_gguf(p) as model:
            assert len(model.tensors) == 6 and model.paths == paths


def test_split_model_missing_part(tmp_path):
    paths = _write_split(tmp_path)
    paths[1].unlink()
    with pytest.raises(BadFileError, match="missing 1 of 3 parts"):
        open_gguf(paths[0])


def test_split_model_inconsistent_keys(tmp_path):
    paths = _write_split(tmp_path)
    paths[2].rename(tmp_path / "x.gguf")
    paths[1].rename(paths[2])  # part 2's content under part 3's name
    (tmp_path / "x.gguf").rename(paths[1])
    with pytest.raises(BadFileError, match="split.no"):
        open_gguf(paths[0])


def test_split_model_duplicate_tensor(tmp_path):
    paths = _write_split(tmp_path, 2)
    data = paths[1].read_bytes().replace(b"blk.2.w.weight", b"blk.0.w.weight")
    paths[1].write_bytes(data)
    with pytest.raises(BadFileError, match="also in"):
        open_gguf(paths[0])
