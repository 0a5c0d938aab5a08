"""Fast, bit-exact GGUF dequantization on CPU (numba) and CUDA (Triton), gguf-py as oracle.

Public API:
- :func:`dequantize` / :func:`dequantize_into`: numpy uint8 blocks -> float32 on the CPU
  (``dequantize_into`` fills a caller's preallocated buffer: row chunks of big tensors);
- :func:`dequantize_torch`: a uint8 torch tensor (CPU or CUDA) -> float32/float16/bfloat16
  on its device; CUDA runs Triton kernels where this package has them;
- :func:`cpu_path` / :func:`gpu_path`: which implementation a type takes and why.
"""

from ggufcheck.gguf.quants.host import FORCE_ENV, KERNELS, cpu_path, dequantize, dequantize_into
from ggufcheck.gguf.quants.device import dequantize_torch, gpu_path

__all__ = ["FORCE_ENV", "KERNELS", "cpu_path", "dequantize", "dequantize_into", "dequantize_torch", "gpu_path"]
