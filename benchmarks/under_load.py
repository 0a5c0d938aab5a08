"""Steady under load: the same diagnosis with and without a competing CPU load, side by side.

Runs ``ggufcheck diagnose`` on SmolLM2-135M Q4_1 through llama.cpp (the README's model) in a
child process, on a quiet machine and while ``--load`` busy processes (default: one per
core) compete for the cores, each with ggufcheck's thread sizing (``ggufcheck.runtime``) and
without it (``GGUFCHECK_THREADS=off``: every pool at its default), and prints each run's wall
time, its CPU time (user + system of the child), CPU / wall, and the loaded / quiet ratios.
Thread pools that spin (OpenMP, ggml) show as CPU time that buys nothing under load; the goal
is a loaded run of at most ~2x the quiet one on 2 cores (issue 22). Each line also prints
the bound a fair scheduler sets for that run (its serial and parallel parts, from the quiet
run's wall and CPU time): the part of the ratio that no thread sizing can remove.

Usage: python benchmarks/under_load.py [--load N] [--out benchmarks/results/under_load_cpu.txt]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path


def _burn(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _run(model: str, sized: bool = True) -> tuple[float, float, int]:
    env = dict(os.environ)
    env.pop("GGUFCHECK_THREADS", None)
    if not sized:
        env["GGUFCHECK_THREADS"] = "off"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ggufcheck", "diagnose", model, "--engine", "llama-cpp", "-q"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def fair_share_wall(wall: float, cpu: float, cores: int, load: int) -> float:
    """The loaded wall time a fair scheduler allows a run whose quiet ``wall`` and ``cpu``
    split into a serial part S (one thread) and a parallel part P (every core):
    S + P / cores = wall, S + P = cpu. Under ``load`` busy processes, one thread gets
    cores / (1 + load) of the machine (at most a core), ``cores`` threads cores * cores /
    (cores + load) (at most all cores): what no thread sizing can beat."""
    if cores < 2:
        return wall * (1 + load)
    parallel = max(0.0, (cpu - wall) * cores / (cores - 1))
    serial = max(0.0, cpu - parallel)
    one = min(1.0, cores / (1 + load))
    every = min(float(cores), cores * cores / (cores + load))
    return serial / one + parallel / every


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=int, default=len(os.sched_getaffinity(0)), help="competing busy processes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from ggufcheck.testing.models import smollm2_path

    model = str(smollm2_path())
    lines = [f"# diagnose under load on {platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
             f"python {platform.python_version()}", "| run | wall s | CPU s | CPU / wall | exit |", "|---|---|---|---|---|"]
    _run(model)  # warm the caches (numba, page cache) so every run starts alike
    quiet = {sized: _run(model, sized) for sized in (False, True)}
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    try:
        loaded = {sized: _run(model, sized) for sized in (False, True)}
    finally:
        stop.set()
        for b in burners:
            b.join(5)
    for sized in (False, True):
        how = "ggufcheck's sizing" if sized else "pools at their defaults"
        for name, (wall, cpu, code) in (("quiet", quiet[sized]), (f"{args.load} busy processes", loaded[sized])):
            lines.append(f"| {how}, {name} | {wall:.1f} | {cpu:.1f} | {cpu / wall:.2f} | {code} |")
    cores = len(os.sched_getaffinity(0))
    for sized in (False, True):
        how = "ggufcheck's sizing" if sized else "pools at their defaults"
        wall, cpu, _ = quiet[sized]
        bound = fair_share_wall(wall, cpu, cores, args.load)
        lines.append(f"\n{how}: loaded / quiet wall time {loaded[sized][0] / wall:.2f}x (goal: <= ~2x); a fair "
                     f"scheduler's bound for this run's serial / parallel split: {bound:.1f} s, {bound / wall:.2f}x")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
