"""Longer mutation fuzzing of ggufcheck's validated GGUF reader.

Usage: python tools/fuzz_reader.py [--cases N] [--seed S] [--timeout SECONDS]
Prints cases run, outcomes (parsed / rejected with ggufcheck's own error / crash) and hangs
(a case taking longer than --timeout). Exit status 1 if any crash or hang was found; the
first few crashing inputs are saved to ./fuzz-crashes/ for reproduction.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from ggufcheck.testing.fuzz import check_bytes, mutations, write_seed_file


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    counts = {"parsed": 0, "rejected": 0, "crash": 0, "hang": 0}
    saved = 0
    signal.signal(signal.SIGALRM, _alarm)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ggufcheck-fuzz-") as tmp:
        work = Path(tmp)
        seed = write_seed_file(work / "seed.gguf", args.seed).read_bytes()
        gen = mutations(seed, rng)
        for i in range(args.cases):
            desc, data = next(gen)
            signal.setitimer(signal.ITIMER_REAL, args.timeout)
            try:
                outcome = check_bytes(data, work)
                kind, detail = outcome.kind, outcome.detail
            except Hang:
                kind, detail = "hang", f"took longer than {args.timeout}s"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            counts[kind] += 1
            if kind in ("crash", "hang"):
                print(f"case {i}: {kind}: {desc}: {detail}", file=sys.stderr)
                if saved < 10:
                    out = Path("fuzz-crashes")
                    out.mkdir(exist_ok=True)
                    (out / f"case{i}.gguf").write_bytes(data)
                    saved += 1
    elapsed = time.perf_counter() - started
    print(f"cases run: {args.cases} in {elapsed:.1f}s")
    print("  ".join(f"{k}: {v}" for k, v in counts.items()))
    return 1 if counts["crash"] or counts["hang"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
