"""The Triton kernels' arithmetic vs gguf-py, run on the CPU by Triton's interpreter.

Real GPU runs (benchmarks/dequant.py --device cuda) check the compiled kernels; this test
keeps their indexing honest in CI-like places without a GPU: every kernel on fuzz blocks
(NaN/Inf/subnormal float16 scales; MXFP4/NVFP4 scale bytes forced to their edge cases) in
float32 and float16 bit-exact vs gguf-py. bfloat16 rounding is checked only on the GPU: the
interpreter's bf16 cast truncates where CUDA rounds to nearest even, so here bfloat16 output
is compared with the truncated float32 reference (normal values only). Needs triton installed;
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
    Q = gguf.GGMLQuantizationType
    bad, seen = [], []

    def blocks_for(qtype):
        raw = samples.fuzz_blocks(qtype, 24, seed=int(qtype))
        if qtype == Q.MXFP4:  # e8m0 bytes 0, 1 give subnormal scales; 254, 255 the largest; 25 blocks: odd bytes
            raw = np.concatenate([raw, samples.fuzz_blocks(qtype, 1, seed=1)])
            raw[:8, 0] = (0, 1, 2, 126, 127, 128, 254, 255)
        if qtype == Q.NVFP4:  # every ue4m3 scale byte once (0x00 and 0x7F decode to 0; 0xFF does not)
            raw = np.concatenate([raw, samples.fuzz_blocks(qtype, 64, seed=2)])
            raw[24:, :4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
        return raw

    def trunc_bf16(x):  # what the interpreter's float32 -> bfloat16 cast does (CUDA rounds to nearest even)
        bits = x.view(np.uint32)
        keep = np.isnan(x) | ((bits & 0x7F800000) == 0)  # NaN; zero/subnormal: the interpreter differs again
        return np.where(keep, x, (bits & np.uint32(0xFFFF0000)).view(np.float32))

    for qtype in gpu.KERNELS:
        block, _ = tables.block_geometry(qtype)
        raw = blocks_for(qtype)
        with np.errstate(all="ignore"):
            ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
        for dtype in (torch.float32, torch.float16):
            out = gpu.dequantize(torch.from_numpy(raw), qtype, dtype).float().numpy()
            result = compare.compare_blocks(out, ref.to(dtype).float().numpy(), block, f"{qtype.name} {dtype}")
            if not result:
                bad.append(str(result))
        # bfloat16: the store gets the exact float32 value, cast once (checked modulo rounding mode)
        out = gpu.dequantize(torch.from_numpy(raw), qtype, torch.bfloat16).float().numpy()
        ref32 = ref.numpy().reshape(-1)
        skip = ~np.isfinite(ref32) | (np.abs(ref32) < np.float32(2.0 ** -126))
        want = np.where(skip, out, trunc_bf16(ref32))
        result = compare.compare_blocks(out, want, block, f"{qtype.name} bfloat16 (truncating interpreter)")
        if not result:
            bad.append(str(result))
        seen.append(qtype.name)
    # a row slice at an odd byte offset (float16 fields are then read from a realigned copy)
    raw = samples.fuzz_blocks(Q.IQ1_S, 5, seed=5).reshape(-1)
    padded = torch.from_numpy(np.concatenate([np.zeros(1, np.uint8), raw]))[1:]
    out = gpu.dequantize(padded, Q.IQ1_S).numpy()
    result = compare.compare_blocks(out, gguf.quants.dequantize(raw, Q.IQ1_S), 256, "IQ1_S odd offset")
    if not result:
        bad.append(str(result))
    print("types:", " ".join(seen))
    print("\\n".join(bad) or "ALL OK")
""")

# types with a Triton kernel that the interpreter run must cover (every gguf-py type but F32)
EXPECTED = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
            "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "MXFP4", "NVFP4",
            "TQ1_0", "TQ2_0", "F16", "BF16"}


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ALL OK"), proc.stdout[-2000:]
    types = set(next(line for line in proc.stdout.splitlines() if line.startswith("types:")).split()[1:])
    assert EXPECTED <= types, sorted(EXPECTED - types)
