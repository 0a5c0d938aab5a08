"""Fast, bit-exact GGUF dequantization on CPU (numba) and CUDA (Triton), gguf-py as oracle.

Public API:
- :func:`dequantize` / :func:`dequantize_into`: numpy uint8 blocks -> float32 on the CPU
  (``dequantize_into`` fills a caller's preallocated buffer: row chunks of big tensors);
- :func:`dequantize_torch`: a uint8 torch tensor (CPU or CUDA) -> float32/float16/bfloat16
  on its device; CUDA runs Triton kernels where this package has them;
- :func:`fused_row_stats`: the health scan's one-pass dequantize-and-statistics per row
  (``fused.py``), or None where only the plain path exists;
- :func:`cpu_path` / :func:`gpu_path`: which implementation a type takes and why.

Paths: every type ``gguf.quants.dequantize`` supports has a numba kernel (``kernels/``, one
module per family, ``parallel=True``, ``cache=True``; ``registry.py`` names each type's);
outputs past twice the last-level cache of the 32-element and K-quant types go through twins of
those kernels that write with streaming stores (``kernels/lanes.py``: the same bits, 1.1-1.5x
faster where the write bounds the rate); without numba, or with ``GGUFCHECK_DEQUANT=gguf-py``,
or if a kernel fails to compile, the type falls back to gguf-py (same bits, slower). CUDA:
Triton kernels (``gpu.py``) for every type except F32 (a view); without Triton, types
dequantize on the CPU and are copied over.

First call: compiling one kernel takes about 1-5 s; numba caches it on disk, after which
the first call in a new process costs about 1 s (numba import and thread start) plus ~0.05 s
per further type.
"""

from ggufcheck.gguf.quants.host import (FORCE_ENV, KERNELS, cpu_path, dequantize, dequantize_into, dequantize_into_f64,
                                        fused_row_stats)
from ggufcheck.gguf.quants.device import dequantize_torch, gpu_path

__all__ = ["FORCE_ENV", "KERNELS", "cpu_path", "dequantize", "dequantize_into", "dequantize_torch",
           "fused_row_stats", "gpu_path"]
