"""Block-wise bit comparison of two dequantizations (ours vs the gguf-py oracle).

Why: "max abs diff" hides what matters for a quantizer: *which blocks* differ. A mismatch
is reported as the number and share of bad blocks and the worst block (its index, first bad
element, both values), which points straight at a scale-unpacking or op-order bug.
Equality is on float32 bit patterns, except that any NaN equals any NaN (NaN payloads and
signs differ between CPUs and GPUs and carry no meaning); a NaN on one side only is a
mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockComparison:
    """Result of :func:`compare_blocks`; truthy when every block matches."""

    label: str
    n_blocks: int
    n_bad_blocks: int
    n_bad_values: int
    worst_block: int | None = None  # block with the most mismatching values
    worst_detail: str = ""

    def __bool__(self) -> bool:
        return self.n_bad_blocks == 0

    @property
    def bad_share(self) -> float:
        return self.n_bad_blocks / self.n_blocks if self.n_blocks else 0.0

    def __str__(self) -> str:
        if self:
            return f"{self.label}: bit-exact ({self.n_blocks} blocks)"
        return (f"{self.label}: {self.n_bad_blocks}/{self.n_blocks} blocks differ "
                f"({self.bad_share:.2%}, {self.n_bad_values} values); worst block "
                f"{self.worst_block}: {self.worst_detail}")


def compare_blocks(ours: np.ndarray, ref: np.ndarray, block_size: int, label: str = "") -> BlockComparison:
    """Compare float32 arrays of equal size, grouped into blocks of ``block_size`` values."""
    a = np.ascontiguousarray(ours, dtype=np.float32).reshape(-1)
    b = np.ascontiguousarray(ref, dtype=np.float32).reshape(-1)
    if a.size != b.size:
        raise ValueError(f"{label}: sizes differ: {a.size} vs {b.size}")
    a_nan, b_nan = np.isnan(a), np.isnan(b)
    bad = (a.view(np.uint32) != b.view(np.uint32)) & ~(a_nan & b_nan)  # (n_values,)
    n_blocks = a.size // block_size if block_size else 0
    per_block = bad[: n_blocks * block_size].reshape(n_blocks, block_size).sum(axis=1)  # (n_blocks,)
    n_bad_blocks = int((per_block > 0).sum())
    if not n_bad_blocks:
        return BlockComparison(label, n_blocks, 0, 0)
    worst = int(per_block.argmax())
    first = worst * block_size + int(bad[worst * block_size:(worst + 1) * block_size].argmax())
    detail = (f"{int(per_block[worst])}/{block_size} values differ; first at element {first}: "
              f"ours {a[first]!r} (0x{a.view(np.uint32)[first]:08x}) vs ref {b[first]!r} "
              f"(0x{b.view(np.uint32)[first]:08x})")
    return BlockComparison(label, n_blocks, n_bad_blocks, int(bad.sum()), worst, detail)
