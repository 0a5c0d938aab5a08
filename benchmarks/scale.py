"""Issue 35: ggufcheck at GLM-5's real layer dimensions, measured side by side, then projected.

    python benchmarks/scale.py [--dir DIR] [--big] [--diagnose-full] [--gpu-results benchmarks/results]

1. Builds glm-dsa files with GLM-5's real per-layer dims (``synthetic.streaming.scale_dims``:
   n_embd 6144, 64 heads, MLA 2048/512, DSA 32 x 128 top-k 2048, expert FF 2048, Q8_0,
   vocabulary 900) of growing size, one tensor at a time; ``--big`` adds one larger than this
   machine's RAM (32 layers x 16 experts, 27 GB).
2. Runs each command in a fresh process and prints its wall time and peak RSS side by side:
   ``reference --tokens`` (8 tokens), ``inspect``, ``diagnose --engine reference --layers``
   (first verdict: the first two layers), ``shard --tp 8`` on the smallest file (8 rank
   processes; their memory is not in the peak printed, which is ggufcheck's main process),
   and with ``--diagnose-full`` the whole diagnosis on
   the files that are small enough (its served stage decodes hundreds of tokens through the
   reference engine, every step a pass over the model).
3. Fits the growth laws (peak RSS against the largest layer and the file; pass time against
   the weights a pass reads) and projects the full GLM-5 (78 trunk layers, 256 experts,
   vocabulary 154880): on this CPU from the fit and the plan's formulas (diagnose/resources.py,
   calibrated here), and on one node of GPUs from the H100 measurements in
   ``benchmarks/results/scale_h100_*.json`` (tools/gpu/scale_glm5.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

RUN = ("import resource, sys, time; from ggufcheck.cli import main; t = time.perf_counter(); rc = main(sys.argv[1:]); "
       "print('@@', rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
FILES = [  # (name, layers, experts)
    ("glm5-2L-16E", 2, 16),
    ("glm5-2L-64E", 2, 64),
    ("glm5-1L-256E", 1, 256),
]
BIG = ("glm5-32L-16E", 32, 16)


def build(directory: Path, name: str, layers: int, experts: int) -> Path:
    from ggufcheck.synthetic.streaming import build_streaming_gguf, scale_dims

    path = directory / f"{name}.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        m = build_streaming_gguf(scale_dims("glm-5", n_layer=layers, n_expert=experts, n_vocab=900), path,
                                 workers=os.cpu_count() or 2)
        print(f"built {path.name}: {m.n_weights / 1e9:.2f}e9 weights, {m.file_bytes / 1e9:.2f} GB in "
              f"{time.perf_counter() - t0:.0f} s")
    return path


def run(args: list[str], timeout: float) -> dict:
    """One ggufcheck command in a fresh process: exit status, wall seconds, peak RSS bytes."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "wall": time.perf_counter() - t0, "peak": None, "tail": ""}
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@")), None)
    if line is None:
        return {"rc": out.returncode, "wall": time.perf_counter() - t0, "peak": None,
                "tail": (out.stdout + out.stderr)[-400:]}
    _, rc, wall, peak = line.split()
    return {"rc": int(rc), "wall": float(wall), "peak": int(peak), "tail": out.stdout[-2000:]}


def facts(path: Path):
    from ggufcheck.diagnose.resources import model_facts
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.reference.config import config_from_gguf

    with open_gguf(path) as g:
        return model_facts(g, config_from_gguf(g.metadata, g.tensors, str(path)))


def full_glm5_facts():
    """ModelFacts of the real GLM-5 trunk from its dims (no file): the same formulas as a file's."""
    from ggufcheck.diagnose.resources import model_facts
    from ggufcheck.synthetic.streaming import scale_dims
    from ggufcheck.synthetic.tiny import tensor_shapes

    d = scale_dims("glm-5")
    shapes = tensor_shapes(d)
    tensors = {n: SimpleNamespace(name=n, shape=s, n_elements=int(np.prod(s))) for n, s in shapes.items()}
    n_weights = sum(t.n_elements for t in tensors.values())
    gguf = SimpleNamespace(tensors=tensors, file_size=int(n_weights * 34 / 32), path="GLM-5 (Q8_0, projected)")
    cfg = SimpleNamespace(n_layer=d.n_layer, n_expert=d.n_expert, n_expert_used=d.n_expert_used, n_head=d.n_head,
                          n_embd=d.n_embd, n_vocab=d.n_vocab, is_mla=True, qk_nope=d.qk_nope, qk_rope=d.qk_rope,
                          v_head=d.v_head_dim, head_dim_k=0, head_dim_v=0, has_indexer=True,
                          indexer_top_k=d.indexer_top_k)
    return model_facts(gguf, cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("GGUFCHECK_SCALE_DIR", "/tmp/ggufcheck-scale")))
    ap.add_argument("--big", action="store_true", help="also a file larger than this machine's RAM")
    ap.add_argument("--diagnose-full", action="store_true", help="the whole diagnosis on the 2-layer files")
    ap.add_argument("--timeout", type=float, default=5400)
    ap.add_argument("--gpu-results", type=Path, default=Path(__file__).parent / "results")
    opts = ap.parse_args()
    opts.dir.mkdir(parents=True, exist_ok=True)
    from ggufcheck.diagnose.resources import BASE_BYTES, Rates, pass_peak, pass_seconds, probe_host

    host = probe_host(with_gpus=False)
    print(f"host: {host.describe()}")
    files = FILES + ([BIG] if opts.big else [])
    rows = []
    for name, layers, experts in files:
        path = build(opts.dir, name, layers, experts)
        f = facts(path)
        largest_layer = max(f.layer_fixed[i] + f.n_expert * f.per_expert[i] for i in range(f.n_layer))
        first = "0,1" if layers > 1 else "0"  # a first verdict: the first layers
        commands = [("inspect", ["inspect", str(path)]),
                    ("reference 8 tokens", ["reference", str(path), "--tokens", ",".join(str(i) for i in range(1, 9))]),
                    (f"diagnose --layers {first}", ["diagnose", str(path), "--engine", "reference", "--no-sanity",
                                               "--layers", first, "--max-prompts", "2", "--json",
                                               str(opts.dir / f"{name}-layers.json")])]
        if experts <= 16 and layers <= 2:
            commands.append(("shard --tp 8", ["shard", str(path), "--tp", "8"]))
        if opts.diagnose_full and layers <= 2 and experts <= 64:
            commands.append(("diagnose (full)", ["diagnose", str(path), "--engine", "reference", "--no-sanity",
                                                 "--json", str(opts.dir / f"{name}-full.json")]))
        for label, args in commands:
            r = run(args, opts.timeout)
            rows.append({"file": name, "GB": path.stat().st_size / 1e9, "largest_layer": largest_layer,
                         "touched8": sum(f.touched(i, 8) for i in range(f.n_layer)), "command": label, **r})
            peak = f"{r['peak'] / 2**30:6.2f} GiB" if r["peak"] else "     -    "
            print(f"{name:<14} {path.stat().st_size / 1e9:6.2f} GB  {label:<22} rc {r['rc']!s:<7} "
                  f"{r['wall']:8.1f} s  peak {peak}", flush=True)
            if r["rc"] not in (0, 1) and r["tail"]:
                print("   ", r["tail"][-300:].replace("\n", " | "))

    # growth laws: reference peak against the largest layer (flat is the goal), and time per
    # pass against the weights it reads
    ref = [r for r in rows if r["command"] == "reference 8 tokens" and r["peak"]]
    if len(ref) >= 2:
        x = np.array([r["largest_layer"] for r in ref], dtype=float)
        peak = np.array([r["peak"] for r in ref], dtype=float)
        slope = np.polyfit(x, peak, 1)[0]
        print(f"\nreference peak: {peak.min() / 2**30:.2f} .. {peak.max() / 2**30:.2f} GiB over largest layers "
              f"{x.min() / 1e9:.2f}e9 .. {x.max() / 1e9:.2f}e9 weights: {slope * 1e9 / 2**30:+.3f} GiB per 1e9 "
              "weights of the largest layer (0: flat)")
        touched = np.array([r["touched8"] for r in ref], dtype=float)
        wall = np.array([r["wall"] for r in ref], dtype=float)
        a, b = np.polyfit(touched, wall, 1)
        print(f"reference 8-token pass: {a * 1e9:.2f} s per 1e9 weights read + {b:.1f} s")
    # projection: the real GLM-5 through the plan's formulas, with this CPU's rates
    g = full_glm5_facts()
    probe = next(opts.dir / f"{n}.gguf" for n, *_ in files)
    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(probe) as handle:
        rates = Rates.calibrate(handle)
    print(f"\nprojection, GLM-5 ({g.n_weights / 1e9:.0f}e9 weights, {g.n_layer} layers, 256 experts, vocabulary "
          f"{g.n_vocab}) on this CPU ({rates.dequant_s * 1e9:.2f} s per 1e9 weights dequantized, "
          f"{rates.flops / 1e9:.0f} GFLOP/s fp64):")
    for t in (8, 96, 2080):
        print(f"  one reference pass of {t:>4} tokens: ~{pass_seconds(g, t, rates) / 3600:6.2f} h, peak "
              f"~{(BASE_BYTES + pass_peak(g, t)) / 2**30:.1f} GiB")
    diag_cpu = 14 * pass_seconds(g, 96, rates) + 2 * pass_seconds(g, 2080, rates) + 2 * pass_seconds(g, 520, rates)
    print(f"  diagnose (its 18 reference passes; the engine's own time not counted): ~{diag_cpu / 86400:.1f} days")
    gpu_json = opts.gpu_results / "scale_h100_reference.json"
    diag_json = opts.gpu_results / "scale_h100_diagnose.json"
    if gpu_json.exists() and diag_json.exists():
        rows_gpu = json.loads(gpu_json.read_text())["rows"]
        stages = json.loads(diag_json.read_text())["timings"]
        moe = {t: np.median([r["seconds"] for r in rows_gpu if r["tokens"] == t and r.get("moe")]) for t in (8, 96, 2080)}
        dense = {t: np.median([r["seconds"] for r in rows_gpu if r["tokens"] == t and r.get("moe") is False and
                               t != 8]) for t in (96, 2080)}
        measured_layers, full_moe, full_dense = 2, 75, 3
        print(f"\nprojection from the H100 (one GLM-5 MoE layer with 256 experts, fp64 reference on the GPU: "
              f"{moe[8]:.1f} / {moe[96]:.1f} / {moe[2080]:.1f} s at 8 / 96 / 2080 tokens):")
        for t in (96, 2080):
            one = full_moe * moe[t] + full_dense * dense[t]
            print(f"  one reference pass of {t:>4} tokens over GLM-5: ~{one / 60:.1f} min on one GPU")
        scale = (full_moe + full_dense) / (measured_layers + 1)
        per_stage = {k: v * (scale if k in ("layers", "served") else 402 / 23.44) for k, v in stages.items()}
        total = sum(per_stage.values())
        print("  diagnose through hf:bf16 on one GPU, each stage scaled from the 3-layer run "
              f"({', '.join(f'{k} {v:.0f} s' for k, v in stages.items())}): "
              f"{', '.join(f'{k} ~{v / 60:.0f} min' for k, v in per_stage.items())}; total ~{total / 60:.0f} min")
        spread = per_stage.get("file", 0) + sum(v / 8 for k, v in per_stage.items() if k != "file")
        print(f"  the same with the weights audit and the reference's passes spread over 8 GPUs (not implemented: "
              f"one GPU serves the reference today): ~{spread / 60:.0f} min")
        verdict_s = sum(per_stage.get(k, 0) for k in ("file", "weights", "layers")) * 4 / 78
        print(f"  a first verdict with --layers 0-3 (4 of 78 layers): ~{verdict_s / 60:.1f} min")
    with open(opts.dir / "scale.json", "w") as fh:
        json.dump(rows, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
