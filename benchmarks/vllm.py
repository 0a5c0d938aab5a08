"""Time to verdict through the real vLLM at TP 1 and TP 2, split into engine start-up and
ggufcheck's own time, measured side by side in one run.

The model is a tiny qwen2 (``ggufcheck.synthetic.tiny``: 2 layers, hidden 256, 4 heads / 2 KV
heads of 64, F32, so vLLM loads it healthy at both sizes). For each TP size the engine is
started once (``startup``), then ``diagnose`` runs every stage against it (``weights``,
``layers``, ``served``: ggufcheck's side, including vLLM's forward passes it asks for).

Usage: python benchmarks/vllm.py [--python .venv-vllm/bin/python] [--qtype F32] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
from ggufcheck.engines.vllm import VllmEngine, VllmOptions
from ggufcheck.synthetic.tiny import build_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--qtype", default="F32")
    ap.add_argument("--rounds", type=int, default=1, help="TP 1 / TP 2 pairs, interleaved")
    args = ap.parse_args()
    if not os.path.isfile(args.python):
        sys.exit(f"no vLLM interpreter at {args.python}: run tools/vllm/setup.sh")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_gguf("qwen2", Path(tmp) / f"qwen2-{args.qtype}.gguf", qtypes=args.qtype, seed=1,
                                n_embd=256, head_dim=64, n_head=4, n_head_kv=2, n_ff=512).path
        rows = []
        for _ in range(args.rounds):
            for tp in (1, 2):
                t0 = time.perf_counter()
                engine = VllmEngine(model, VllmOptions(tp=tp, python=args.python))
                startup = time.perf_counter() - t0
                t1 = time.perf_counter()
                d = diagnose(DiagnoseOptions(model=model, engine="vllm", health=False, sanity=False), engine=engine)
                own = time.perf_counter() - t1
                engine.close()
                verdict = "healthy" if d.verdict.healthy else f"{d.verdict.component}: {d.verdict.message[:60]}"
                rows.append((tp, startup, own, d.timings, verdict))
    print(f"model: tiny qwen2 {args.qtype}; cores: {os.cpu_count()}; load average: {os.getloadavg()[0]:.1f}")
    print(f"{'tp':>3} {'startup s':>10} {'diagnose s':>11} {'total s':>8}   stages (s)   verdict")
    for tp, startup, own, timings, verdict in rows:
        stages = " ".join(f"{k}={v:.1f}" for k, v in timings.items())
        print(f"{tp:>3} {startup:10.1f} {own:11.1f} {startup + own:8.1f}   {stages}   {verdict}")
    by_tp = {tp: [r for r in rows if r[0] == tp] for tp in (1, 2)}
    mean = {tp: sum(r[1] + r[2] for r in rs) / len(rs) for tp, rs in by_tp.items()}
    print(f"TP 2 / TP 1 time to verdict: {mean[2] / mean[1]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
