"""Validated, read-only access to GGUF files.

The official ``gguf`` reader trusts its input: offsets past the end, absurd dimensions or
string lengths make it crash, hang or allocate without bound. This module parses the
container itself, checking every count, length, dimension, type, offset and region against
the file before anything is trusted, and raises one :class:`BadFileError` naming the file,
the field or tensor, and the byte offset. Memory stays proportional to the real file size,
never to what a header claims. Files are memory-mapped read-only and never written.

Split models (``NAME-00001-of-0000N.gguf``) are opened as one model: every part must be
present, the ``split.*`` keys consistent, and tensor names unique across parts.
"""

from __future__ import annotations

import contextlib
import copy
import mmap
import os
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np

FAULT_AROUND_BYTES = 64 << 10  # Linux fault_around_bytes default: pages mapped around a fault

from ggufcheck.errors import BadFileError
from ggufcheck.gguf.format import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    INT64_MAX,
    MAX_ARRAY_NESTING,
    MAX_DIMS,
    MAX_TENSOR_NAME,
    NUMPY_DTYPES,
    SCALAR_FORMATS,
    SUPPORTED_VERSIONS,
    ValueType,
    quant_geometry,
)

SPLIT_PATTERN = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file declares it, after validation."""

    name: str
    qtype: gguf.GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order: ne[0] is the fastest-varying (row length)
    nbytes: int
    offset: int  # absolute byte offset of the data in ``path``
    path: Path
    block_size: int
    type_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / torch order: ``reversed(ne)``; a 2-D weight is [out, in]."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def row_elements(self) -> int:
        return self.ne[0]

    @property
    def row_bytes(self) -> int:
        return self.ne[0] // self.block_size * self.type_size

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.ne[0] if self.ne[0] else 0

    @property
    def type_name(self) -> str:
        return self.qtype.name


@dataclass(frozen=True)
class MetadataField:
    """A metadata key's declared type (and element type for arrays) and where it sits."""

    key: str
    type: ValueType
    element_type: ValueType | None
    offset: int


class _Cursor:
    """Bounds-checked little-endian reads over a buffer; every error names the offset."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def fail(self, problem: str, field: str | None = None, offset: int | None = None):
        raise BadFileError(self.path, problem, field=field, offset=self.pos if offset is None else offset)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"{what} needs {n} bytes but the file ends at {self.size}", field=what)

    def scalar(self, vtype: ValueType, what: str) -> Any:
        fmt, size = SCALAR_FORMATS[vtype]
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar(ValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(ValueType.UINT64, what)

    def string(self, what: str) -> str:
        start = self.pos
        length = self.u64(f"{what} length")
        if length > self.size - self.pos:
            self.fail(f"{what}: string length {length} runs past the end of the file", what, start)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="surrogateescape")


def _read_value(cur: _Cursor, vtype: ValueType, key: str, depth: int = 0) -> tuple[Any, ValueType | None]:
    """Read one metadata value; returns (value, element type for arrays)."""
    if vtype == ValueType.STRING:
        return cur.string(f"value of {key}"), None
    if vtype in SCALAR_FORMATS:
        value = cur.scalar(vtype, f"value of {key}")
        return value, None
    if vtype != ValueType.ARRAY:
        cur.fail(f"unknown value type {int(vtype)}", key)
    if depth >= MAX_ARRAY_NESTING:
        cur.fail(f"arrays nested deeper than {MAX_ARRAY_NESTING}", key)
    etype_offset = cur.pos
    etype_code = cur.u32(f"array element type of {key}")
    try:
        etype = ValueType(etype_code)
    except ValueError:
        cur.fail(f"unknown array element type {etype_code}", key, etype_offset)
    count_offset = cur.pos
    count = cur.u64(f"array length of {key}")
    remaining = cur.size - cur.pos
    if etype in SCALAR_FORMATS:
        size = SCALAR_FORMATS[etype][1]
        if count > remaining // size:
            cur.fail(f"array of {count} {etype.name} runs past the end of the file", key, count_offset)
        arr = np.frombuffer(cur.buf, dtype=NUMPY_DTYPES[etype], count=count, offset=cur.pos)
        cur.pos += count * size
        values = arr.astype(bool).tolist() if etype == ValueType.BOOL else arr.tolist()
        return values, etype
    # strings take >= 8 bytes each, arrays >= 12: a lying count cannot outgrow the file
    min_size = 8 if etype == ValueType.STRING else 12
    if count > remaining // min_size:
        cur.fail(f"array of {count} {etype.name} cannot fit in the {remaining} bytes left", key, count_offset)
    items = []
    for _ in range(count):
        value, _ = _read_value(cur, etype, key, depth + 1)
        items.append(value)
    return items, etype


@dataclass
class _Part:
    """One physical file: its metadata and tensors, validated."""

    path: Path
    file: Any
    mm: mmap.mmap | None
    version: int
    alignment: int
    metadata: dict[str, Any]
    fields: dict[str, MetadataField]
    tensors: dict[str, TensorInfo]
    data_start: int
    size: int


# Parsed headers of the files opened last, by identity (path, inode, size, mtime): a diagnosis
# opens one model ~6 times (engine, reference, baseline, checks), and a 49k-token vocabulary's
# metadata takes ~0.3 s of Python to parse each time. The parsed values are never mutated.
PARSED_KEPT = 4
_PARSED: dict[tuple, _Part] = {}


def _parse_part(path: Path) -> _Part:
    try:
        f = open(path, "rb")  # read-only, always
    except FileNotFoundError:
        raise BadFileError(path, "file not found") from None
    except IsADirectoryError:
        raise BadFileError(path, "is a directory, not a GGUF file") from None
    except OSError as err:
        raise BadFileError(path, f"cannot open: {err.strerror or err}") from None
    try:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise BadFileError(path, f"too small to be a GGUF file ({size} bytes)", field="header", offset=0)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            st = os.fstat(f.fileno())
            key = (str(path), st.st_dev, st.st_ino, size, st.st_mtime_ns)
            parsed = _PARSED.get(key)
            if parsed is None:
                part = _parse_header(path, f, mm, size)
                _PARSED[key] = part
                while len(_PARSED) > PARSED_KEPT:
                    _PARSED.pop(next(iter(_PARSED)))
                return part
            return replace(parsed, file=f, mm=mm)  # the same file unchanged: its parsed header again
        except BaseException:
            mm.close()
            raise
    except BaseException:
        f.close()
        raise


def _parse_header(path: Path, f: Any, mm: mmap.mmap, size: int) -> _Part:
    buf = memoryview(mm)
    cur = _Cursor(buf, path)
    try:
        magic = bytes(buf[0:4])
        if magic != GGUF_MAGIC:
            if magic == GGUF_MAGIC[::-1]:
                cur.fail("byte-swapped (big-endian) GGUF is not supported", "magic", 0)
            cur.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})", "magic", 0)
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if version and version.to_bytes(4, "little")[0] == 0:
                cur.fail(f"version {version} looks byte-swapped: big-endian GGUF is not supported", "version", 4)
            cur.fail(f"unsupported GGUF version {version} (supported: 2, 3)", "version", 4)
        n_tensors = cur.u64("tensor_count")
        n_kv = cur.u64("metadata_kv_count")
        remaining = size - cur.pos
        if n_kv > remaining // 13:  # a key (>= 8 bytes) + type (4) + value (>= 1)
            cur.fail(f"metadata_kv_count {n_kv} cannot fit in a {size}-byte file", "metadata_kv_count", 16)
        if n_tensors > remaining // 24:  # name (>= 8) + n_dims + ne (>= 8) + type (4)... >= 24
            cur.fail(f"tensor_count {n_tensors} cannot fit in a {size}-byte file", "tensor_count", 8)

        metadata: dict[str, Any] = {}
        fields: dict[str, MetadataField] = {}
        for i in range(n_kv):
            start = cur.pos
            key = cur.string(f"metadata key #{i}")
            if not key:
                cur.fail(f"metadata key #{i} is empty", f"metadata key #{i}", start)
            if key in metadata:
                cur.fail(f"duplicate metadata key {key!r}", key, start)
            type_offset = cur.pos
            code = cur.u32(f"type of {key}")
            try:
                vtype = ValueType(code)
            except ValueError:
                cur.fail(f"unknown value type {code}", key, type_offset)
            value, etype = _read_value(cur, vtype, key)
            metadata[key] = value
            fields[key] = MetadataField(key, vtype, etype, start)

        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in metadata:
            fld = fields["general.alignment"]
            alignment = metadata["general.alignment"]
            if fld.type != ValueType.UINT32:
                cur.fail(f"general.alignment must be UINT32, not {fld.type.name}", "general.alignment", fld.offset)
            if alignment <= 0 or alignment & (alignment - 1):
                cur.fail(f"general.alignment {alignment} is not a power of two", "general.alignment", fld.offset)

        raw_infos = []
        seen: set[str] = set()
        for i in range(n_tensors):
            start = cur.pos
            name = cur.string(f"tensor #{i} name")
            where = f"tensor {name!r}" if name else f"tensor #{i}"
            if not name:
                cur.fail(f"tensor #{i} has an empty name", where, start)
            if len(name.encode("utf-8", errors="surrogateescape")) > MAX_TENSOR_NAME:
                cur.fail(f"tensor name longer than {MAX_TENSOR_NAME} bytes", where, start)
            if name in seen:
                cur.fail("duplicate tensor name", where, start)
            seen.add(name)
            dims_offset = cur.pos
            n_dims = cur.u32(f"{where} n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                cur.fail(f"n_dims {n_dims} (must be 1..{MAX_DIMS})", where, dims_offset)
            ne = []
            n_elements = 1
            for d in range(n_dims):
                dim_offset = cur.pos
                dim = cur.u64(f"{where} ne[{d}]")
                if dim > INT64_MAX:
                    cur.fail(f"ne[{d}] = {dim} is negative as int64", where, dim_offset)
                ne.append(dim)
                if dim and n_elements > INT64_MAX // dim:
                    cur.fail(f"element count overflows int64 (ne = {ne}...)", where, dim_offset)
                n_elements *= dim
            type_offset = cur.pos
            code = cur.u32(f"{where} type")
            geometry = quant_geometry(code)
            if geometry is None:
                cur.fail(f"unknown tensor type {code}", where, type_offset)
            qtype, block_size, type_size = geometry
            if ne[0] % block_size:
                cur.fail(
                    f"row length ne[0] = {ne[0]} is not a multiple of {qtype.name}'s block size {block_size}",
                    where, dims_offset,
                )
            offset_pos = cur.pos
            rel_offset = cur.u64(f"{where} data offset")
            nbytes = (n_elements // block_size) * type_size if n_elements else 0
            raw_infos.append((name, qtype, tuple(ne), nbytes, rel_offset, offset_pos, block_size, type_size))

        header_end = cur.pos
        data_start = (header_end + alignment - 1) // alignment * alignment
        if n_tensors and data_start > size:
            cur.fail(f"tensor data would start at {data_start}, past the end of the file", "tensor data", header_end)

        tensors: dict[str, TensorInfo] = {}
        for name, qtype, ne, nbytes, rel, offset_pos, block_size, type_size in raw_infos:
            where = f"tensor {name!r}"
            if rel % alignment:
                cur.fail(f"data offset {rel} is not aligned to {alignment}", where, offset_pos)
            absolute = data_start + rel
            if rel > size or nbytes > size - absolute:
                cur.fail(
                    f"data [{absolute}, {absolute + nbytes}) runs past the end of the file ({size} bytes)",
                    where, offset_pos,
                )
            tensors[name] = TensorInfo(name, qtype, ne, nbytes, absolute, path, block_size, type_size)

        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for prev, nxt in zip(ordered, ordered[1:]):
            if prev.nbytes and nxt.nbytes and prev.offset + prev.nbytes > nxt.offset:
                raise BadFileError(
                    path,
                    f"data of tensor {nxt.name!r} [{nxt.offset}, {nxt.offset + nxt.nbytes}) overlaps "
                    f"tensor {prev.name!r} [{prev.offset}, {prev.offset + prev.nbytes})",
                    field=f"tensor {nxt.name!r}", offset=nxt.offset,
                )
        return _Part(path, f, mm, version, alignment, metadata, fields, tensors, data_start, size)
    finally:
        try:
            buf.release()
        except BufferError:  # a numpy view of a metadata array is still referenced
            pass


class GGUFModel:
    """A validated GGUF model (one file or all parts of a split model), read-only.

    ``metadata`` holds plain Python values (the first part's, for split models);
    ``tensors`` maps names to :class:`TensorInfo` in file order across parts.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, parts: list[_Part]):
        self._parts = parts
        first = parts[0]
        self.path: Path = first.path
        self.paths: list[Path] = [p.path for p in parts]
        self.version: int = first.version
        self.alignment: int = first.alignment
        self.metadata: dict[str, Any] = first.metadata
        self.fields: dict[str, MetadataField] = first.fields
        self.tensors: dict[str, TensorInfo] = {}
        for part in parts:
            self.tensors.update(part.tensors)
        self._mmaps = {p.path: p.mm for p in parts}
        self._borrowed = False

    # -- metadata ---------------------------------------------------------------
    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def field_type(self, key: str) -> MetadataField | None:
        return self.fields.get(key)

    @property
    def file_size(self) -> int:
        return sum(p.size for p in self._parts)

    @property
    def parts(self) -> list[tuple[Path, int, int]]:
        """(path, size, data start) per part."""
        return [(p.path, p.size, p.data_start) for p in self._parts]

    # -- tensor data ------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view: shape ``shape[:-1] + (row_bytes,)``."""
        info = self._info(name)
        mm = self._mmaps[info.path]
        if mm is None:
            raise ValueError("model is closed")
        data = np.frombuffer(mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(info.shape[:-1] + (info.row_bytes,))

    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the flattened 2-D view [n_rows, row_bytes]; touches only them."""
        info = self._info(name)
        if not 0 <= start <= stop <= info.n_rows:
            raise IndexError(f"rows [{start}, {stop}) outside tensor {name!r} with {info.n_rows} rows")
        mm = self._mmaps[info.path]
        count = (stop - start) * info.row_bytes
        data = np.frombuffer(mm, dtype=np.uint8, count=count, offset=info.offset + start * info.row_bytes)
        return data.reshape(stop - start, info.row_bytes)

    def touch_pages(self, name: str, start: int, n_bytes: int) -> None:
        """Fault ``n_bytes`` of the file from row ``start`` of ``name`` into the mapping, in order.

        For read-ahead from a background thread: one reader touching one byte per page keeps
        the kernel's read-ahead sequential, where the compute threads' own faults arrive at
        many offsets at once (measured on 16 cores: +12% cold scan rate). The range may run
        past the tensor into the ones stored after it; it is clipped to the file.
        """
        info = self._info(name)
        mm = self._mmaps.get(info.path)
        if mm is None:
            return
        begin = info.offset + start * info.row_bytes
        n = min(n_bytes, len(mm) - begin)
        if n > 0:
            int(np.frombuffer(mm, dtype=np.uint8, count=n, offset=begin)[:: mmap.PAGESIZE].sum())

    def release_rows(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Advise the kernel that rows [start, stop) of ``name`` are not needed soon.

        Drops their page-cache pages from this process's mapping (``MADV_DONTNEED`` on a
        read-only map: the file is untouched and re-read on the next access), so streaming
        over a model larger than memory keeps resident memory bounded.
        """
        info = self._info(name)
        mm = self._mmaps.get(info.path)
        if mm is None or not hasattr(mm, "madvise"):
            return
        stop = info.n_rows if stop is None else stop
        # the kernel maps up to 64 KiB of cached pages around each fault ("fault-around"), so the
        # pages next to the rows read are mapped too: released with them, or a stream of row
        # blocks leaves ~64 KiB per read mapped (measured: 12-22 MB per GLM-5-dims layer)
        begin = max(0, info.offset + start * info.row_bytes - FAULT_AROUND_BYTES)
        end = min(len(mm), info.offset + stop * info.row_bytes + FAULT_AROUND_BYTES)
        begin -= begin % mmap.PAGESIZE
        if end > begin:
            try:
                mm.madvise(mmap.MADV_DONTNEED, begin, end - begin)
            except (OSError, ValueError):
                pass  # advice only

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.path}") from None

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    # -- lifecycle --------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return all(p.mm is None for p in self._parts) if self._parts else True

    def close(self) -> None:
        if self._borrowed:  # a view of a lent model (lend): its owner closes it
            return
        for part in self._parts:
            if part.mm is not None:
                try:
                    part.mm.close()
                except BufferError:
                    pass  # a numpy view is still alive; the map closes when it goes
                part.mm = None
            part.file.close()
        self._mmaps = {p.path: None for p in self._parts}

    def __enter__(self) -> "GGUFModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFModel({str(self.path)!r}, arch={self.architecture!r}, tensors={len(self.tensors)})"


def split_parts(path: Path) -> list[Path] | None:
    """All part paths of a split model named like ``NAME-00001-of-0000N.gguf``, else None."""
    m = SPLIT_PATTERN.match(path.name)
    if not m:
        return None
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


# Models lent for the length of a run (:func:`lend`): an open of the same path during it
# borrows the lent model instead of parsing the file again.
_LENT: dict[Path, GGUFModel] = {}


@contextlib.contextmanager
def lend(model: GGUFModel):
    """While the block runs, :func:`open_gguf` of ``model``'s path (from the engines, the
    reference, the checks) returns a borrowed view of ``model``: the file is parsed and
    mapped once per run (``diagnose``'s session lends the model it opened), and a
    borrower's ``close`` leaves it open for the others. The owner closes it."""
    key = Path(model.path).resolve()
    before = _LENT.get(key)
    _LENT[key] = model
    try:
        yield model
    finally:
        if before is None:
            _LENT.pop(key, None)
        else:
            _LENT[key] = before


def _borrowed(model: GGUFModel) -> GGUFModel:
    view = copy.copy(model)  # the same parts, tables and maps; its close() does not close them
    view._borrowed = True
    return view


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open and validate a GGUF model (any part of a split model opens the whole model); a
    model lent for this run (:func:`lend`) is borrowed instead."""
    path = Path(path)
    if _LENT:
        lent = _LENT.get(path.resolve())
        if lent is not None and not lent.closed:
            return _borrowed(lent)
    part_paths = split_parts(path)
    if part_paths is None or len(part_paths) == 1:
        part = _parse_part(path)
        if part_paths is None and "split.count" in part.metadata and part.metadata["split.count"] not in (0, 1):
            count = part.metadata["split.count"]
            part.file.close()
            raise BadFileError(
                path, f"file declares split.count = {count} but its name is not NAME-0000K-of-{count:05d}.gguf",
                field="split.count", tip="keep the parts' original names so every part can be found",
            )
        return GGUFModel([part])
    return GGUFModel(_open_split(part_paths))


def _open_split(part_paths: list[Path]) -> list[_Part]:
    missing = [str(p) for p in part_paths if not p.exists()]
    if missing:
        raise BadFileError(
            part_paths[0], f"split model is missing {len(missing)} of {len(part_paths)} parts: {', '.join(missing)}",
            field="split parts",
        )
    parts: list[_Part] = []
    try:
        names: dict[str, Path] = {}
        for i, p in enumerate(part_paths):
            part = _parse_part(p)
            parts.append(part)
            _check_split_keys(part, i, len(part_paths))
            for name in part.tensors:
                if name in names:
                    raise BadFileError(p, f"tensor {name!r} is also in {names[name]}", field=f"tensor {name!r}")
                names[name] = p
        declared = parts[0].metadata.get("split.tensors.count")
        if declared is not None and declared != len(names):
            raise BadFileError(
                part_paths[0], f"split.tensors.count = {declared} but the parts hold {len(names)} tensors",
                field="split.tensors.count",
            )
        return parts
    except BaseException:
        for part in parts:
            if part.mm is not None:
                part.mm.close()
            part.file.close()
        raise


def _check_split_keys(part: _Part, index: int, count: int) -> None:
    md = part.metadata
    for key in ("split.no", "split.count"):
        if key not in md:
            raise BadFileError(part.path, f"split part lacks the {key} key", field=key)
        if not isinstance(md[key], int) or isinstance(md[key], bool):
            raise BadFileError(part.path, f"{key} must be an integer", field=key, offset=part.fields[key].offset)
    if md["split.count"] != count:
        raise BadFileError(
            part.path, f"split.count = {md['split.count']} but the file name says {count} parts",
            field="split.count", offset=part.fields["split.count"].offset,
        )
    if md["split.no"] != index:
        raise BadFileError(
            part.path, f"split.no = {md['split.no']} but the file name says part {index + 1} (split.no {index})",
            field="split.no", offset=part.fields["split.no"].offset,
        )
