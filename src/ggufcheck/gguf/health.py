"""Health scan of tensor data: NaN/Inf in values and block scales, zero rows, magnitudes.

Streams every tensor in row chunks through the dequantize entry point, so memory stays
bounded whatever the model size. Block scales are read straight from the raw blocks for
the common quant types, so a corrupted scale is reported with its block index (a NaN scale
turns a whole block NaN; an Inf one, NaN or Inf), not only as "some values are NaN".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import gguf
import numpy as np

from ggufcheck.gguf.dequant import dequantize_into
from ggufcheck.gguf.reader import GGUFModel, TensorInfo
from ggufcheck.gguf.stats import chunk_stats

Q = gguf.GGMLQuantizationType

# byte offsets of the f16 scale fields inside one block (from gguf-py's block layouts)
SCALE_FIELDS: dict[gguf.GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}

# A weight this large overflows fp16 (65504) and is far outside any trained model's range.
ABSURD_MAGNITUDE = 65504.0
CHUNK_ELEMENTS = 1 << 18  # 1 MB of float32 per chunk: stays in cache between dequant and stats


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


def scan_tensor(model: GGUFModel, info: TensorInfo) -> TensorHealth:
    """Dequantize one tensor chunk by chunk and collect its health statistics."""
    h = TensorHealth(info.name, info.qtype.name, info.n_elements, n_rows=info.n_rows)
    if info.n_elements == 0:
        h.problems.append("tensor has no elements")
        return h
    _scan_scales(model, info, h)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, info.row_elements))
    # one reused buffer: a fresh 1 MB array per chunk costs more in page faults than the work
    buffer = np.empty(rows_per_chunk * info.row_elements, dtype=np.float32)
    total = 0.0
    total_sq = 0.0
    for start in range(0, info.n_rows, rows_per_chunk):
        stop = min(info.n_rows, start + rows_per_chunk)
        values = buffer[: (stop - start) * info.row_elements].reshape(stop - start, info.row_elements)
        dequantize_into(model.raw_rows(info.name, start, stop), info.qtype, values)
        c = chunk_stats(values)
        if c.first_bad >= 0 and h.first_bad_value is None:
            h.first_bad_value = start * info.row_elements + c.first_bad
        h.nan += c.nan
        h.inf += c.inf
        h.zero_rows += c.zero_rows
        h.absmax = max(h.absmax, c.absmax)
        total += c.total
        total_sq += c.total_sq
    finite_count = info.n_elements - h.nan - h.inf
    if finite_count:
        h.mean = total / finite_count
        h.std = float(np.sqrt(max(0.0, total_sq / finite_count - h.mean**2)))
    if h.bad_scales:
        h.problems.append(f"{h.bad_scales} block scale(s) NaN/Inf, first in block {h.first_bad_block}")
    if h.nan or h.inf:
        h.problems.append(f"{h.nan} NaN and {h.inf} Inf values, first at element {h.first_bad_value}")
    if h.zero_rows == h.n_rows:
        h.problems.append("every row is all zeros")
    if h.absmax > ABSURD_MAGNITUDE:
        h.problems.append(f"max |value| {h.absmax:.4g} exceeds {ABSURD_MAGNITUDE:g} (fp16 range)")
    return h


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
) -> list[TensorHealth]:
    """Scan every tensor (or the given ones); ``progress`` is called after each."""
    out = []
    for info in tensors if tensors is not None else model.tensors.values():
        out.append(scan_tensor(model, info))
        if progress is not None:
            progress(info)
    return out
