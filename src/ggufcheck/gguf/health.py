"""Health scan of tensor data: NaN/Inf in values and block scales, zero rows, magnitudes.

Streams every tensor in row chunks, so memory stays bounded whatever the model size. The fast
path is one fused pass per chunk (``quants.fused_row_stats``: decode each row in cache, take
its statistics and check its blocks' f16 scales, without writing the values out), so a
400 GB file is scanned near the disk's read rate; rows holding NaN/Inf are then redone
exactly. Without numba (or with ``GGUFCHECK_DEQUANT=gguf-py``) the plain path dequantizes
1 MB chunks through the dequantize entry point and reads the scales with numpy. Both give
the same counts, max |x| and first bad block/element; mean and std agree to float64
rounding (summation order). A corrupted scale is reported with its block index (a NaN
scale turns a whole block NaN; an Inf one, NaN or Inf), not only as "some values are NaN".
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

import gguf
import numpy as np

from ggufcheck.gguf import quants
from ggufcheck.gguf.dequant import dequantize_into
from ggufcheck.gguf.quants.tables import F16_SCALE_FIELDS as SCALE_FIELDS
from ggufcheck.gguf.reader import GGUFModel, TensorInfo
from ggufcheck.gguf.stats import chunk_stats

Q = gguf.GGMLQuantizationType

# A weight this large overflows fp16 (65504) and is far outside any trained model's range.
ABSURD_MAGNITUDE = 65504.0
CHUNK_ELEMENTS = 1 << 18  # plain path: 1 MB of float32 per chunk, stays in cache between dequant and stats
FUSED_CHUNK_BYTES = 64 << 20  # fused path: raw bytes per call (the pages are released after each)
FUSED_MAX_ROW_ELEMENTS = 1 << 24  # the fused pass decodes a whole row into scratch; longer rows take the plain path


@dataclass
class TensorHealth:
    """Statistics of one tensor's dequantized values."""

    name: str
    qtype: str
    n_elements: int
    nan: int = 0
    inf: int = 0
    zero_rows: int = 0
    n_rows: int = 0
    absmax: float = 0.0
    mean: float = 0.0
    std: float = 0.0
    bad_scales: int = 0
    first_bad_block: int | None = None
    first_bad_value: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.problems

    def stats(self) -> dict:
        return {
            "type": self.qtype, "elements": self.n_elements, "rows": self.n_rows,
            "nan": self.nan, "inf": self.inf, "zero_rows": self.zero_rows,
            "absmax": self.absmax, "mean": self.mean, "std": self.std,
            "bad_block_scales": self.bad_scales,
        }


def scan_tensor(model: GGUFModel, info: TensorInfo, fused: bool = True) -> TensorHealth:
    """Dequantize one tensor chunk by chunk and collect its health statistics.

    ``fused=False`` forces the plain path (the fused path's tests and benchmark compare both).
    """
    h = TensorHealth(info.name, info.qtype.name, info.n_elements, n_rows=info.n_rows)
    if info.n_elements == 0:
        h.problems.append("tensor has no elements")
        return h
    sums = np.zeros(2)  # float64 sum and sum of squares of the finite values
    if not (fused and info.row_elements <= FUSED_MAX_ROW_ELEMENTS and _scan_fused(model, info, h, sums)):
        h = TensorHealth(info.name, info.qtype.name, info.n_elements, n_rows=info.n_rows)
        sums[:] = 0.0
        _scan_scales(model, info, h)
        _scan_plain(model, info, h, sums)
        model.release_rows(info.name)
    _finish(info, h, sums)
    return h


def _finish(info: TensorInfo, h: TensorHealth, sums: np.ndarray) -> None:
    finite_count = info.n_elements - h.nan - h.inf
    if finite_count:
        h.mean = float(sums[0] / finite_count)
        h.std = float(np.sqrt(max(0.0, sums[1] / finite_count - h.mean**2)))
    if h.bad_scales:
        h.problems.append(f"{h.bad_scales} block scale(s) NaN/Inf, first in block {h.first_bad_block}")
    if h.nan or h.inf:
        h.problems.append(f"{h.nan} NaN and {h.inf} Inf values, first at element {h.first_bad_value}")
    if h.zero_rows == h.n_rows:
        h.problems.append("every row is all zeros")
    if h.absmax > ABSURD_MAGNITUDE:
        h.problems.append(f"max |value| {h.absmax:.4g} exceeds {ABSURD_MAGNITUDE:g} (fp16 range)")


def _scan_fused(model: GGUFModel, info: TensorInfo, h: TensorHealth, sums: np.ndarray) -> bool:
    """The one-pass scan; False (nothing kept) if the fused path is unavailable for this type.

    A background thread pages in the next 64 MB of the file while the cores decode a chunk.
    """
    offsets = SCALE_FIELDS.get(info.qtype, ())
    blocks_per_row = info.row_bytes // info.type_size
    rows_per_call = max(1, FUSED_CHUNK_BYTES // info.row_bytes)
    pool = _read_ahead_pool()
    ahead = None
    try:
        for start in range(0, info.n_rows, rows_per_call):
            stop = min(info.n_rows, start + rows_per_call)
            if ahead is not None:
                ahead.result()
            # page in the next chunk (or the next tensor's first) while this one is decoded
            ahead = pool.submit(model.touch_pages, info.name, stop, FUSED_CHUNK_BYTES)
            raw = model.raw_rows(info.name, start, stop)
            rows = quants.fused_row_stats(raw, info.qtype, offsets)
            if rows is None:
                return False
            from ggufcheck.gguf.quants import fused as col  # imports numba: only once rows came back

            _add_fused(h, sums, rows, start, blocks_per_row)
            if not (rows[:, col.NONFINITE] == 0).all():  # rare: redo rows with NaN/Inf exactly, plain path
                _rescan_rows(raw, info, start, np.flatnonzero(rows[:, col.NONFINITE] != 0), h, sums)
            model.release_rows(info.name, start, stop)
    finally:
        if ahead is not None:
            ahead.result()
    return True


def _add_fused(h: TensorHealth, sums: np.ndarray, rows: np.ndarray, start: int, blocks_per_row: int) -> None:
    """Fold the fused per-row columns of one chunk (starting at row ``start``) into ``h``."""
    from ggufcheck.gguf.quants import fused as col

    bad_scale_rows = np.flatnonzero(rows[:, col.FIRST_BAD_SCALE] >= 0)
    if bad_scale_rows.size and h.first_bad_block is None:
        r = bad_scale_rows[0]
        h.first_bad_block = int((start + r) * blocks_per_row + rows[r, col.FIRST_BAD_SCALE])
    h.bad_scales += int(rows[:, col.BAD_SCALES].sum())
    clean = rows[rows[:, col.NONFINITE] == 0]  # rows with NaN/Inf are redone on the plain path
    if clean.size:
        absmax_bits = np.array([clean[:, col.ABSMAX_BITS].max()], dtype=np.uint32)
        h.absmax = max(h.absmax, float(absmax_bits.view(np.float32)[0]))
        h.zero_rows += int((clean[:, col.OR_BITS] == 0).sum())
        sums += clean[:, col.SUM].sum(), clean[:, col.SUM_SQ].sum()


_pool: ThreadPoolExecutor | None = None


def _read_ahead_pool() -> ThreadPoolExecutor:
    """The fused scan's one read-ahead thread (created on first use)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ggufcheck-read-ahead")
    return _pool


def _rescan_rows(raw: np.ndarray, info: TensorInfo, start: int, rows: np.ndarray, h: TensorHealth,
                 sums: np.ndarray) -> None:
    """Plain-path statistics of the given rows of a raw chunk (ascending indices)."""
    batch = max(1, CHUNK_ELEMENTS // info.row_elements)
    for i in range(0, rows.size, batch):
        picked = rows[i : i + batch]
        values = dequantize_into(raw[picked], info.qtype, np.empty((picked.size, info.row_elements), np.float32))
        _add_chunk(h, sums, chunk_stats(values), lambda flat: (start + int(picked[flat // info.row_elements]))
                   * info.row_elements + flat % info.row_elements)


def _add_chunk(h: TensorHealth, sums: np.ndarray, c, element_of: Callable[[int], int]) -> None:
    if c.first_bad >= 0 and h.first_bad_value is None:
        h.first_bad_value = element_of(c.first_bad)
    h.nan += c.nan
    h.inf += c.inf
    h.zero_rows += c.zero_rows
    h.absmax = max(h.absmax, c.absmax)
    sums += c.total, c.total_sq


def _scan_plain(model: GGUFModel, info: TensorInfo, h: TensorHealth, sums: np.ndarray) -> None:
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, info.row_elements))
    # one reused buffer: a fresh 1 MB array per chunk costs more in page faults than the work
    buffer = np.empty(rows_per_chunk * info.row_elements, dtype=np.float32)
    for start in range(0, info.n_rows, rows_per_chunk):
        stop = min(info.n_rows, start + rows_per_chunk)
        values = buffer[: (stop - start) * info.row_elements].reshape(stop - start, info.row_elements)
        dequantize_into(model.raw_rows(info.name, start, stop), info.qtype, values)
        _add_chunk(h, sums, chunk_stats(values), lambda flat: start * info.row_elements + flat)


def _scan_scales(model: GGUFModel, info: TensorInfo, h: TensorHealth) -> None:
    offsets = SCALE_FIELDS.get(info.qtype)
    if not offsets:
        return
    raw = model.raw(info.name).reshape(-1, info.type_size)  # (n_blocks, type_size)
    blocks_per_chunk = max(1, (CHUNK_ELEMENTS * 4) // info.type_size)
    for start in range(0, raw.shape[0], blocks_per_chunk):
        chunk = raw[start : start + blocks_per_chunk]
        bad = np.zeros(chunk.shape[0], dtype=bool)
        for off in offsets:
            scale = np.ascontiguousarray(chunk[:, off : off + 2]).view(np.float16)[:, 0]
            bad |= ~np.isfinite(scale)
        n_bad = int(bad.sum())
        if n_bad and h.first_bad_block is None:
            h.first_bad_block = start + int(np.flatnonzero(bad)[0])
        h.bad_scales += n_bad


def scan_model(
    model: GGUFModel,
    tensors: Iterable[TensorInfo] | None = None,
    progress: Callable[[TensorInfo], None] | None = None,
    fused: bool = True,
) -> list[TensorHealth]:
    """Scan every tensor (or the given ones); ``progress`` is called after each."""
    out = []
    for info in tensors if tensors is not None else model.tensors.values():
        out.append(scan_tensor(model, info, fused=fused))
        if progress is not None:
            progress(info)
    return out
