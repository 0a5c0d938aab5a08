"""Which CPU kernel serves each GGUF type: one row per type, read by every path that runs one.

Why a registry: the plain kernels, their streaming-store variants and the health scan's fused
pass are three ways to run one definition; the routing (``host.py``), the fused scan
(``fused.py``), the tests and ``benchmarks/dequant.py`` all find a type's kernels here, so a new
type is one row plus its kernel in the family module (``kernels/``). This module imports no
numba: the routing works (through gguf-py) without it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from ggufcheck.gguf.quants import tables

Q = gguf.GGMLQuantizationType

KERNELS_PACKAGE = "ggufcheck.gguf.quants.kernels"


def _f16() -> tuple[np.ndarray, ...]:
    return (tables.f16_to_f32(),)


@dataclass(frozen=True)
class Kernel:
    """One type's CPU kernels: ``kernels/<family>.py`` defines ``name`` (and ``name_streaming``).

    ``tables`` builds the lookup tables the kernels take after ``(src, out)``; ``out_bits``: the
    kernel writes the float32 output's bits as uint32 (BF16).
    """

    family: str
    name: str
    streaming: bool = False
    tables: Callable[[], tuple[np.ndarray, ...]] = _f16
    out_bits: bool = False

    def module(self):
        return importlib.import_module(f"{KERNELS_PACKAGE}.{self.family}")

    def plain(self):
        """The plain kernel ``(src, out, *tables)`` (imports numba)."""
        return getattr(self.module(), self.name)

    def streamer(self):
        """The streaming-store kernel ``(src, out, *tables, n_tasks)`` (imports numba)."""
        if not self.streaming:
            raise LookupError(f"{self.name} has no streaming-store kernel")
        return getattr(self.module(), f"{self.name}_streaming")


def _f16_and(*extra: Callable[[], np.ndarray]) -> Callable[[], tuple[np.ndarray, ...]]:
    return lambda: (tables.f16_to_f32(), *(make() for make in extra))


def _iq4() -> np.ndarray:
    return tables.IQ4_LEVELS.astype(np.float32)


def _fp4() -> np.ndarray:
    return tables.FP4_LEVELS.astype(np.float32)


def _grid(qtype: Q) -> Callable[[], np.ndarray]:
    return lambda: tables.grid(qtype)


def _pow3() -> np.ndarray:
    return np.array([1, 3, 9, 27, 81], dtype=np.int32)


# qtype -> kernels; one row per type gguf-py dequantizes (F32 is a plain copy, not here)
KERNELS: dict[Q, Kernel] = {
    Q.F16: Kernel("floats", "f16"),
    Q.BF16: Kernel("floats", "bf16", tables=lambda: (), out_bits=True),
    Q.Q4_0: Kernel("legacy", "q4_0", streaming=True),
    Q.Q4_1: Kernel("legacy", "q4_1", streaming=True),
    Q.Q5_0: Kernel("legacy", "q5_0", streaming=True),
    Q.Q5_1: Kernel("legacy", "q5_1", streaming=True),
    Q.Q8_0: Kernel("legacy", "q8_0", streaming=True),
    Q.Q2_K: Kernel("kquants", "q2_k", streaming=True),
    # Q3_K streams no faster: its streaming variant measured 0.6-0.8x the plain kernel at 24-48 MB
    Q.Q3_K: Kernel("kquants", "q3_k"),
    Q.Q4_K: Kernel("kquants", "q4_k", streaming=True),
    Q.Q5_K: Kernel("kquants", "q5_k", streaming=True),
    Q.Q6_K: Kernel("kquants", "q6_k", streaming=True),
    Q.TQ1_0: Kernel("ternary", "tq1_0", tables=_f16_and(_pow3)),
    Q.TQ2_0: Kernel("ternary", "tq2_0"),
    Q.MXFP4: Kernel("levels", "mxfp4", tables=lambda: (tables.e8m0_half_to_f32(), _fp4())),
    Q.NVFP4: Kernel("levels", "nvfp4", tables=lambda: (tables.ue4m3_half_to_f32(), _fp4())),
    Q.IQ4_NL: Kernel("levels", "iq4_nl", tables=_f16_and(_iq4)),
    Q.IQ4_XS: Kernel("levels", "iq4_xs", tables=_f16_and(_iq4)),
    Q.IQ2_XXS: Kernel("grids", "iq2_xxs", tables=_f16_and(_grid(Q.IQ2_XXS), tables.ksigns)),
    Q.IQ2_XS: Kernel("grids", "iq2_xs", tables=_f16_and(_grid(Q.IQ2_XS), tables.ksigns)),
    Q.IQ2_S: Kernel("grids", "iq2_s", tables=_f16_and(_grid(Q.IQ2_S))),
    Q.IQ3_XXS: Kernel("grids", "iq3_xxs", tables=_f16_and(_grid(Q.IQ3_XXS), tables.ksigns)),
    Q.IQ3_S: Kernel("grids", "iq3_s", tables=_f16_and(_grid(Q.IQ3_S))),
    Q.IQ1_S: Kernel("grids", "iq1_s", tables=_f16_and(_grid(Q.IQ1_S))),
    Q.IQ1_M: Kernel("grids", "iq1_m", tables=_f16_and(_grid(Q.IQ1_M))),
}

STREAMED: tuple[Q, ...] = tuple(q for q, k in KERNELS.items() if k.streaming)


def _last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """Size of CPU 0's largest cache, from sysfs (Linux); ``default`` where it cannot be read."""
    best = 0
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        try:
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best or default


# Outputs this large and larger stream: twice the last-level cache (32 MiB on the CI machine),
# where an ordinary-store kernel no longer gains from lines that stay cached. Measured there
# (streaming / plain kernel, same buffer): 0.5-0.9x at 4 MB of input (14-28 MB out, cached),
# 0.7-1.3x at 16 MB; at 24-48 MB (84-228 MB out) 1.13-1.53x in 24 of the 27 measurements of the
# streamed types, 0.84-0.89x in 3 (a shared, noisy machine).
STREAM_MIN_BYTES = 2 * _last_level_cache_bytes()
STREAM_ALIGN = 16  # the output must start on a 16-byte boundary (every later lane group then does)


def streams(qtype: Q, out: np.ndarray) -> bool:
    """Whether ``out`` (flat float32) is large and aligned enough to stream ``qtype`` into."""
    kernel = KERNELS.get(qtype)
    return (kernel is not None and kernel.streaming and out.nbytes >= STREAM_MIN_BYTES
            and out.ctypes.data % STREAM_ALIGN == 0)


def source_digest() -> str:
    """A hash of every kernel source file: the fused scan's cache names carry it (numba does not
    notice when a callee in another file changes)."""
    import hashlib

    package = Path(__file__).with_name("kernels")
    digest = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]
