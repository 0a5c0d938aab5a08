"""File-level fault injection: each function writes a NEW faulty copy of a GGUF file.

The input is only ever read. Two techniques, both working on any GGUF (tiny-built,
converted by llama.cpp, or a user's file):

- rewrite: parse with ``gguf.GGUFReader`` into :class:`GGUFContents` (every key/value with
  its type, every tensor's type, shape and raw bytes), change it, write it back with
  ``gguf.GGUFWriter`` (wrong shape, missing tensor, swapped tensors, bad metadata);
- byte edit: copy the file and overwrite bytes at offsets computed from the parse
  (corrupted block scale, tensor data offset, header counts, truncation).

Every function returns the output path and raises :class:`GGUFCheckError` when asked for a
fault the file cannot carry (unknown tensor, quant type without a scale table...).
"""

from __future__ import annotations

import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as T

from ggufcheck.errors import GGUFCheckError
from ggufcheck.synthetic import qblocks

_SCALE_VALUES = {"nan": np.float16(np.nan), "inf": np.float16(np.inf),
                 "-inf": np.float16(-np.inf), "huge": np.float16(65504.0)}


@dataclass
class TensorRecord:
    """One tensor as stored: type, numpy-order shape, raw bytes [n_rows, row_bytes]."""

    qtype: Q
    shape: tuple[int, ...]
    raw: np.ndarray  # uint8, shape = shape[:-1] + (row_bytes,)


@dataclass
class GGUFContents:
    """A whole GGUF in memory: metadata (value, type, array element type) and tensors."""

    kv: dict[str, tuple[Any, T, T | None]]
    tensors: dict[str, TensorRecord]
    alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT


def read_contents(path: str | Path) -> GGUFContents:
    """Parse ``path`` into :class:`GGUFContents` (tensor bytes are copied out of the mmap)."""
    reader = _reader(path)
    kv: dict[str, tuple[Any, T, T | None]] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's virtual header fields
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == T.ARRAY and len(f.types) > 1 else None
        if vtype == T.ARRAY and sub == T.ARRAY:
            raise GGUFCheckError(f"{path}: nested arrays ({key}) are not supported by the rewriter")
        kv[key] = (f.contents(), vtype, sub)
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # numpy order
        raw = np.array(reader.data[t.data_offset:t.data_offset + t.n_bytes], dtype=np.uint8)
        bs, ts = gguf.GGML_QUANT_SIZES[t.tensor_type]
        tensors[t.name] = TensorRecord(t.tensor_type, shape, raw.reshape(*shape[:-1], shape[-1] // bs * ts))
    alignment = int(kv["general.alignment"][0]) if "general.alignment" in kv else gguf.GGUF_DEFAULT_ALIGNMENT
    return GGUFContents(kv=kv, tensors=tensors, alignment=alignment)


def write_contents(contents: GGUFContents, path: str | Path) -> Path:
    """Write :class:`GGUFContents` as a GGUF file. Declared shapes are written as given,
    even when they disagree with the data size (that is how shape faults are made)."""
    out = Path(path)
    arch = contents.kv.get("general.architecture", ("", T.STRING, None))[0]
    writer = gguf.GGUFWriter(out, str(arch))
    writer.kv_data[0].clear()  # the kv below carries general.architecture (or not)
    writer.data_alignment = contents.alignment
    for key, (value, vtype, sub) in contents.kv.items():
        if vtype == T.ARRAY and len(value) == 0:
            raise GGUFCheckError(f"{out}: gguf.GGUFWriter cannot write the empty array {key}")
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for name, rec in contents.tensors.items():
        # element-shape given directly with a non-uint8 dtype marker: GGUFWriter keeps it
        writer.add_tensor_info(name, rec.shape, np.dtype(np.float32), rec.raw.nbytes, raw_dtype=rec.qtype)
        writer.tensors[-1][name].tensor = rec.raw
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def rewrite(src: str | Path, dst: str | Path, edit: Callable[[GGUFContents], None]) -> Path:
    """Read ``src``, apply ``edit`` to its contents, write ``dst``. The general fault hook."""
    src_p, dst_p = _distinct(src, dst)
    contents = read_contents(src_p)
    edit(contents)
    return write_contents(contents, dst_p)


# ---------------------------------------------------------------------------------------
# tensor faults (rewrite)


def wrong_shape(src: str | Path, dst: str | Path, tensor: str, shape: tuple[int, ...] | None = None,
                *, consistent: bool = True) -> Path:
    """Declare another shape for ``tensor`` (numpy order).

    ``consistent=True``: same element count, data unchanged (a valid file whose tensor has
    the wrong layout: a mapping check must find it). Default: the last two dims swapped
    (a transposed-looking matrix). ``consistent=False``: a declared size that disagrees
    with the data (an integrity check must find it). Default: first dim + 1.
    """
    def edit(c: GGUFContents) -> None:
        rec = _tensor(c, tensor, src)
        new = tuple(shape) if shape is not None else _default_wrong_shape(rec.shape, consistent)
        if consistent and int(np.prod(new)) != int(np.prod(rec.shape)):
            raise GGUFCheckError(f"{tensor}: shape {new} does not keep {int(np.prod(rec.shape))} elements")
        if consistent and new[-1] % qblocks.block_size(rec.qtype):
            raise GGUFCheckError(f"{tensor}: row length {new[-1]} is not a multiple of "
                                 f"{rec.qtype.name}'s block size")
        if new == rec.shape:
            raise GGUFCheckError(f"{tensor}: shape {new} is the tensor's own shape")
        rec.shape = new
    return rewrite(src, dst, edit)


def _default_wrong_shape(shape: tuple[int, ...], consistent: bool) -> tuple[int, ...]:
    if not consistent:
        return (shape[0] + 1, *shape[1:])
    if len(shape) < 2 or shape[-1] == shape[-2]:
        raise GGUFCheckError(f"no default consistent wrong shape for {shape}: pass shape=")
    return (*shape[:-2], shape[-1], shape[-2])


def missing_tensor(src: str | Path, dst: str | Path, tensor: str) -> Path:
    """Drop ``tensor`` from the file (header and data)."""
    def edit(c: GGUFContents) -> None:
        _tensor(c, tensor, src)
        del c.tensors[tensor]
    return rewrite(src, dst, edit)


def swap_tensors(src: str | Path, dst: str | Path, a: str, b: str) -> Path:
    """Exchange two tensors' names: the name ``a`` then holds b's type, shape and data.

    With equal shapes and types this is a silent data swap; otherwise both shapes are wrong.
    """
    def edit(c: GGUFContents) -> None:
        ra, rb = _tensor(c, a, src), _tensor(c, b, src)
        c.tensors = {(b if n == a else a if n == b else n): r for n, r in c.tensors.items()}
        c.tensors[a], c.tensors[b] = rb, ra
    return rewrite(src, dst, edit)


def swap_kb_vb(src: str | Path, dst: str | Path, layer: int = 0) -> Path:
    """Swap ``blk.{layer}.attn_k_b`` and ``attn_v_b`` (see :func:`swap_tensors`)."""
    return swap_tensors(src, dst, f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight")


# ---------------------------------------------------------------------------------------
# metadata faults (rewrite)


def drop_key(src: str | Path, dst: str | Path, key: str) -> Path:
    """Remove metadata ``key``."""
    def edit(c: GGUFContents) -> None:
        if key not in c.kv:
            raise GGUFCheckError(f"{src}: no metadata key {key}")
        del c.kv[key]
    return rewrite(src, dst, edit)


def set_key(src: str | Path, dst: str | Path, key: str, value: Any, vtype: T | None = None,
            sub_type: T | None = None) -> Path:
    """Set metadata ``key`` to ``value``; ``vtype`` defaults to the key's current type.

    Give another ``vtype`` for a wrong-typed key (e.g. a STRING head count, a FLOAT32
    block count); a new key needs ``vtype``.
    """
    def edit(c: GGUFContents) -> None:
        if vtype is None and key not in c.kv:
            raise GGUFCheckError(f"{src}: no metadata key {key}; give vtype for a new key")
        old = c.kv.get(key, (None, vtype, sub_type))
        c.kv[key] = (value, vtype if vtype is not None else old[1],
                     sub_type if sub_type is not None else old[2])
    return rewrite(src, dst, edit)


def inconsistent_mla(src: str | Path, dst: str | Path) -> Path:
    """Make ``{arch}.attention.key_length_mla`` != P + R (P + R + 8, data unchanged)."""
    c = read_contents(src)
    arch = c.kv["general.architecture"][0]
    key = f"{arch}.attention.key_length_mla"
    if key not in c.kv:
        raise GGUFCheckError(f"{src}: not an MLA file (no {key})")
    return set_key(src, dst, key, int(c.kv[key][0]) + 8)


def non_dividing_heads(src: str | Path, dst: str | Path) -> Path:
    """Set ``head_count_kv`` so it does not divide ``head_count`` (head_count - 1, or 3 if that is 1)."""
    c = read_contents(src)
    arch = c.kv["general.architecture"][0]
    n_head = int(c.kv[f"{arch}.attention.head_count"][0])
    kv_heads = n_head - 1 if n_head - 1 > 1 else 3
    if n_head % kv_heads == 0:
        raise GGUFCheckError(f"{src}: cannot pick a non-dividing kv head count for {n_head} heads")
    return set_key(src, dst, f"{arch}.attention.head_count_kv", kv_heads)


# ---------------------------------------------------------------------------------------
# byte faults (copy, then edit bytes)


def corrupt_block_scale(src: str | Path, dst: str | Path, tensor: str, *, block: int = 0,
                        value: str | float = "nan", field: int = 0) -> Path:
    """Overwrite one block's fp16 scale of a quantized ``tensor`` (all other bytes equal).

    ``block`` counts blocks over the whole tensor in storage order; ``value`` is "nan",
    "inf", "-inf", "huge" (65504) or a number; ``field`` picks d (0) or m / dmin (1).
    For F16 / F32 / BF16 tensors the element ``block`` itself is overwritten.
    """
    src_p, dst_p = _distinct(src, dst)
    reader = _reader(src_p)
    t = _reader_tensor(reader, tensor, src_p)
    qt = t.tensor_type
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    n_blocks = int(t.n_elements) // bs
    if not 0 <= block < n_blocks:
        raise GGUFCheckError(f"{tensor}: block {block} out of range (0..{n_blocks - 1})")
    half = _SCALE_VALUES.get(value, None) if isinstance(value, str) else np.float16(value)
    if half is None:
        raise GGUFCheckError(f"unknown scale value {value!r}; use nan, inf, -inf, huge or a number")
    if qt in (Q.F16, Q.F32):
        payload = np.array([half], dtype=np.float16 if qt == Q.F16 else np.float32).tobytes()
        pos = t.data_offset + block * ts
    elif qt == Q.BF16:
        payload = (np.array([half], np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        pos = t.data_offset + block * ts
    else:
        offsets = qblocks.F16_SCALE_OFFSETS.get(qt)
        if offsets is None or field >= len(offsets):
            raise GGUFCheckError(f"{tensor}: no fp16 scale field {field} known for {qt.name}")
        payload = np.array([half], "<f2").tobytes()
        pos = t.data_offset + block * ts + offsets[field]
    del reader
    shutil.copyfile(src_p, dst_p)
    _poke(dst_p, pos, payload)
    return dst_p


def tensor_data_offset(src: str | Path, dst: str | Path, tensor: str, relative_offset: int) -> Path:
    """Set ``tensor``'s stored data offset (relative to the data section): misaligned,
    overlapping another tensor, or past the end of the file."""
    src_p, dst_p = _distinct(src, dst)
    reader = _reader(src_p)
    t = _reader_tensor(reader, tensor, src_p)
    parts = t.field.parts
    pos = t.field.offset + sum(int(p.nbytes) for p in parts[:-1])  # the offset is the last part
    del reader
    shutil.copyfile(src_p, dst_p)
    _poke(dst_p, pos, struct.pack("<Q", relative_offset))
    return dst_p


def header_count(src: str | Path, dst: str | Path, which: str, value: int) -> Path:
    """Overwrite the header's ``tensor_count`` or ``kv_count`` (uint64, GGUF v2/v3)."""
    positions = {"tensor_count": 8, "kv_count": 16}
    if which not in positions:
        raise GGUFCheckError(f"unknown header field {which!r}; use tensor_count or kv_count")
    src_p, dst_p = _distinct(src, dst)
    shutil.copyfile(src_p, dst_p)
    _poke(dst_p, positions[which], struct.pack("<Q", value))
    return dst_p


def truncate(src: str | Path, dst: str | Path, size: int | None = None) -> Path:
    """Copy only the first ``size`` bytes; default: cut inside the last tensor's data."""
    src_p, dst_p = _distinct(src, dst)
    if size is None:
        reader = _reader(src_p)
        last = max(reader.tensors, key=lambda t: t.data_offset)
        size = int(last.data_offset) + max(1, int(last.n_bytes) // 2)
        del reader
    with open(src_p, "rb") as fin, open(dst_p, "wb") as fout:
        fout.write(fin.read(size))
    return dst_p


# ---------------------------------------------------------------------------------------
# helpers


def _distinct(src: str | Path, dst: str | Path) -> tuple[Path, Path]:
    src_p, dst_p = Path(src), Path(dst)
    if dst_p.exists() and dst_p.resolve() == src_p.resolve():
        raise GGUFCheckError(f"refusing to overwrite the input {src_p}: give another output path")
    return src_p, dst_p


def _reader(path: str | Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the gguf reader raises anything on a bad file
        raise GGUFCheckError(f"{path}: cannot parse as GGUF: {exc}") from None


def _reader_tensor(reader: gguf.GGUFReader, name: str, path: Path):
    for t in reader.tensors:
        if t.name == name:
            return t
    raise GGUFCheckError(f"{path}: no tensor {name}")


def _tensor(c: GGUFContents, name: str, path: str | Path) -> TensorRecord:
    if name not in c.tensors:
        raise GGUFCheckError(f"{path}: no tensor {name}")
    return c.tensors[name]


def _poke(path: Path, pos: int, payload: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(payload)
