"""Helpers of scale_glm5.sh (issue 35 on the GPU): build, time reference passes, diagnose.

usage: scale_gpu.py build OUT.gguf | reference FILE OUT.json | diagnose FILE OUT.json [diagnose options]
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def build(path: str) -> None:
    from ggufcheck.synthetic.streaming import build_streaming_gguf, scale_dims

    t0 = time.perf_counter()
    d = scale_dims("glm-5", n_layer=3, n_dense_lead=1)  # all 256 experts, vocabulary 154880
    m = build_streaming_gguf(d, path, qtypes="Q8_0", workers=os.cpu_count() or 8)
    print(f"built {path}: {m.n_weights / 1e9:.2f}e9 weights, {m.file_bytes / 1e9:.2f} GB in "
          f"{time.perf_counter() - t0:.0f} s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


def reference(path: str, out: str) -> None:
    """Reference passes on the GPU (fp64, streaming: every weight read from the file per pass),
    per layer: the cost of one GLM-5 MoE layer and of the dense layer at 8, 96 and 2080 tokens."""
    import torch

    from ggufcheck.reference.model import ReferenceModel
    from ggufcheck.runtime import keep_freed_memory

    keep_freed_memory()
    rows = []
    with ReferenceModel(path, device="cuda", streaming=True) as ref:
        for n in (8, 96, 2080):
            tokens = [(7 * i) % 900 + 1 for i in range(n)]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            h = ref.embed(tokens)
            pos = torch.arange(n, device=ref.device)
            from ggufcheck.reference.cache import KVCache
            cache = KVCache()
            cache.positions = pos
            shared: dict = {}
            for i in range(ref.cfg.n_layer):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = ref._layer(i, h, pos, pos, cache, shared).hidden
                torch.cuda.synchronize()
                rows.append({"tokens": n, "layer": i, "moe": ref.cfg.is_moe_layer(i), "seconds": time.perf_counter() - t0})
            t0 = time.perf_counter()
            ref.head(h)
            torch.cuda.synchronize()
            rows.append({"tokens": n, "layer": "head", "seconds": time.perf_counter() - t0,
                         "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30})
            for r in rows[-4:]:
                print(r)
    doc = {"rows": rows, "host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    print("host peak RSS", doc["host_peak_rss_gb"])
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


def diagnose(path: str, out: str, *extra: str) -> None:
    """``ggufcheck diagnose`` through the library with every progress line timestamped (the CLI
    shows progress only on a terminal), then the JSON report."""
    from ggufcheck.cli.diagnose import add_parser, options_from, write_reports
    from ggufcheck.diagnose.plan import diagnose as run_diagnosis
    from ggufcheck.diagnose.resources import format_plan
    from ggufcheck.runtime import configure, keep_freed_memory
    import argparse
    from rich.console import Console

    configure()
    keep_freed_memory()
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["diagnose", path, "--engine", "hf:bf16@cuda", "--reference-device", "cuda",
                              "--no-sanity", *extra])
    t0 = time.perf_counter()
    say = lambda msg: print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)  # noqa: E731
    d = run_diagnosis(options_from(args), progress=say, on_plan=lambda p: [print(x) for x in format_plan(p)])
    print(f"diagnose: {d.verdict.message[:300]}; wall {d.elapsed_s:.0f} s; stages "
          f"{ {k: round(v, 1) for k, v in d.timings.items()} }; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
    write_reports(d, __import__("pathlib").Path(out), None, Console())


if __name__ == "__main__":
    {"build": build, "reference": reference, "diagnose": diagnose}[sys.argv[1]](*sys.argv[2:])
