"""Where the time goes on a long prompt: ``diagnose`` of SmolLM2-135M Q4_1 through llama.cpp
with one ~2,300-token prompt (issue 22: it took 469 s on 2 cores, 9 min user and 4 min
system CPU, where an fp64 forward of a 135M model over 2,300 tokens is ~a minute of arithmetic).

The prompt is this repository's own documentation (no download). Prints each stage's wall
time, the process's user / system CPU and peak memory, and the run profiled (cProfile): the
cumulative time of each entry point (the reference's forward passes, each llama.cpp path,
the logits metrics, the paths stage, the length sweep) and the top functions.

Usage: python benchmarks/long_prompt.py [--tokens 2300] [--top 12]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import tempfile
import time
from pathlib import Path

from diagnose import smollm2  # benchmarks/diagnose.py: the installed SmolLM2 file

from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose

ROOT = Path(__file__).resolve().parent.parent

# what runs, by the profiled entry points (cumulative: a row includes what it calls, so rows
# overlap where one calls another, e.g. the paths stage calls the engine)
ENTRY_POINTS = (
    ("the reference's forward passes (fp64 judge, fp32 baseline)", "reference/model.py", "forward"),
    ("llama.cpp: one prefill (score)", "engines/llama_cpp.py", "score"),
    ("llama.cpp: chunked prefill (score_chunked)", "engines/llama_cpp.py", "score_chunked"),
    ("llama.cpp: step-by-step decode (generate)", "engines/llama_cpp.py", "generate"),
    ("llama.cpp: per-layer trace (layer_outputs)", "engines/llama_cpp.py", "layer_outputs"),
    ("logits metrics (collect)", "checks/logits.py", "collect"),
    ("the paths stage (run_paths)", "checks/paths.py", "run_paths"),
    ("the length sweep (check_prefill_lengths)", "checks/lengths.py", "check_prefill_lengths"),
)


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


def entry_points(stats: pstats.Stats) -> list[tuple[str, int, float]]:
    """(label, calls, cumulative seconds) of each ENTRY_POINTS function."""
    out = []
    for label, path_end, name in ENTRY_POINTS:
        calls, seconds = 0, 0.0
        for (path, _line, func), (_cc, nc, _own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            if func == name and path.endswith(path_end):
                calls, seconds = calls + nc, seconds + cum
        out.append((label, calls, seconds))
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
    print("\nwhere the time goes (cumulative seconds of each entry point; rows overlap where one calls "
          "another; the profiler adds its own overhead):")
    for label, calls, seconds in entry_points(stats):
        print(f"  {label:60} {calls:5d} calls {seconds:7.1f} s  {100 * seconds / total:5.1f}% of the run")
    print(f"\nthe {args.top} functions with the most cumulative time:")
    stats.sort_stats("cumulative").print_stats(args.top)
    v = d.verdict
    print("verdict:", "healthy" if v.healthy else f"{v.component} layer {v.layer}: {v.message}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
