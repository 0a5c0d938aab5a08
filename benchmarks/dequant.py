"""Dequantization throughput, side by side in one run: gguf-py vs transformers' torch vs ours.

    python benchmarks/dequant.py                 # CPU table (all types)
    python benchmarks/dequant.py --types Q4_K,Q6_K --mb 16
    python benchmarks/dequant.py --device cuda   # GPU table, with the device copy bandwidth

MB/s are megabytes of *quantized input* per second (wall clock, median of the repeats,
measured interleaved so that background load hits every implementation alike). The
bit-exact column compares our float32 output with gguf-py's, block by block (NaN == NaN).
On CUDA, GB/s count bytes read plus bytes written, like the copy bandwidth they are set
against; correctness there is checked on fuzz blocks (NaN/Inf scales included) and on a
slice of the benchmark data against gguf-py on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import gguf
import numpy as np

from ggufcheck.gguf.quants import compare, cpu_path, dequantize, samples, tables
from ggufcheck.gguf.quants.host import KERNELS

Q = gguf.GGMLQuantizationType


def _transformers_dequant():
    """transformers' torch dequantize(data, ggml_type, dtype) and its type ids, or (None, why)."""
    try:
        from transformers.integrations.gguf import dequant as hf
    except Exception as err:
        return None, f"unavailable: {type(err).__name__}: {err}"
    return hf, ""


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


ROW_ELEMENTS = 4096  # a typical hidden size: the benchmark tensors are (n_rows, 4096) values


def _tensor(qtype: Q, mb: float, seed: int = 0) -> np.ndarray:
    """(n_rows, row_bytes) uint8 of about ``mb`` MB: how a GGUF tensor reaches dequantize."""
    block, size = tables.block_geometry(qtype)
    row_bytes = ROW_ELEMENTS // block * size
    n_rows = max(1, int(mb * 2**20) // row_bytes)
    return samples.realistic_blocks(qtype, n_rows * ROW_ELEMENTS // block, seed=seed + int(qtype)).reshape(n_rows, row_bytes)


def cpu_table(types: list[Q], mb: float, repeats: int) -> int:
    import torch

    hf, why = _transformers_dequant()
    print(f"CPU: {torch.get_num_threads()} torch threads; transformers {why or 'integrations.gguf.dequant'}")
    print(f"{'type':8} {'gguf-py':>9} {'transf.':>9} {'ours':>9} {'x gguf-py':>10} {'x transf.':>10}  "
          f"{'bit-exact':10} {'tf exact':9} path")
    failures = 0
    for qtype in types:
        block, size = tables.block_geometry(qtype)
        raw = _tensor(qtype, mb)
        with np.errstate(all="ignore"):
            ref = gguf.quants.dequantize(raw, qtype)
        ours = dequantize(raw, qtype)  # warm-up (JIT / cache load) outside the timings
        exact = compare.compare_blocks(ours, ref, block, qtype.name)
        failures += not exact
        hf_ok = hf is not None and int(qtype) in hf.GGML_BLOCK
        traw = torch.from_numpy(raw.reshape(-1)) if hf_ok else None
        tf_exact = "-"
        if hf_ok:
            tf_out = hf.dequantize(traw, int(qtype), torch.float32).numpy()
            tf_exact = "yes" if compare.compare_blocks(tf_out, ref, block) else "no"
        t_ref, t_hf, t_ours = [], [], []
        for r in range(repeats):
            if r < 2:
                with np.errstate(all="ignore"):
                    t_ref.append(_timed(gguf.quants.dequantize, raw, qtype))
            if hf_ok:
                t_hf.append(_timed(hf.dequantize, traw, int(qtype), torch.float32))
            t_ours.append(_timed(dequantize, raw, qtype))
        rate = lambda ts: raw.nbytes / statistics.median(ts) / 1e6 if ts else float("nan")  # noqa: E731
        r_ref, r_hf, r_ours = rate(t_ref), rate(t_hf), rate(t_ours)
        x_hf = f"{r_ours / r_hf:9.1f}x" if t_hf else f"{'-':>10}"
        print(f"{qtype.name:8} {r_ref:9.1f} {r_hf if t_hf else float('nan'):9.1f} {r_ours:9.1f} "
              f"{r_ours / r_ref:9.1f}x {x_hf}  {'yes' if exact else 'NO':10} {tf_exact:9} {cpu_path(qtype)}")
        if not exact:
            print(f"         {exact}")
    print(f"({mb:g} MB of quantized input per type as ({ROW_ELEMENTS}-value rows); random quants with "
          "weight-like scales; gguf-py called as the reader calls it, on the 2-D rows)")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--types", default="", help="comma-separated type names (default: all)")
    parser.add_argument("--mb", type=float, default=0, help="MB of quantized input per type")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.types:
        types = [Q[name.strip().upper()] for name in args.types.split(",")]
    else:
        types = list(KERNELS)
    if args.device == "cuda":
        from ggufcheck.gguf.quants import gpu_bench

        return gpu_bench.gpu_table(types if args.types else None, args.mb or 256, args.repeats)
    return cpu_table(types, args.mb or 8, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
