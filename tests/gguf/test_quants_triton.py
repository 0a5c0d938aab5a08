"""The Triton kernels' arithmetic vs gguf-py, run on the CPU by Triton's interpreter.

Real GPU runs (benchmarks/dequant.py --device cuda) check the compiled kernels; this test
keeps their indexing honest in CI-like places without a GPU. (bfloat16 output is checked
only on the GPU: the interpreter's bf16 cast truncates where CUDA rounds to nearest even.) Needs triton installed;
runs in a subprocess because TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import numpy as np, torch, gguf.quants
    from ggufcheck.gguf.quants import compare, gpu, samples, tables
    bad = []
    for qtype in gpu.KERNELS:
        block, _ = tables.block_geometry(qtype)
        raw = samples.fuzz_blocks(qtype, 24, seed=int(qtype))
        with np.errstate(all="ignore"):
            ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
        for dtype in (torch.float32, torch.float16):  # the interpreter truncates bf16 casts

            out = gpu.dequantize(torch.from_numpy(raw), qtype, dtype).float().numpy()
            result = compare.compare_blocks(out, ref.to(dtype).float().numpy(), block, f"{qtype.name} {dtype}")
            if not result:
                bad.append(str(result))
    print("\\n".join(bad) or "ALL OK")
""")


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ALL OK"), proc.stdout[-2000:]
