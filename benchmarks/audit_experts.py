"""Issue 35 (item 3): ``--experts`` makes the weights audit of a MoE model cost what it reads.

Builds a one-layer GLM-5-dims file (all of the layer's real dims, ``--experts`` routed
experts, vocabulary 900), opens it in transformers (bf16, on this CPU), then runs the weights
stage side by side in one process: every expert, then ``--experts 0-3``, then every expert
again (the machine's noise shows as the difference between the two full runs). Prints each
audit's wall time, the stacked-expert rows it read from the file, and the ratio against the
share of the layer's weights the choice leaves to read.

Usage: python benchmarks/audit_experts.py [--experts 32] [--dir /tmp/ggufcheck-audit]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32, help="routed experts in the built layer (default 32)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ggufcheck-audit"))
    args = ap.parse_args()
    from ggufcheck.checks import weights as audit
    from ggufcheck.diagnose.session import DiagnoseOptions, Session
    from ggufcheck.engines.hf import HFEngine
    import ggufcheck.gguf.dequant as dequant
    from ggufcheck.synthetic.streaming import build_streaming_gguf, scale_dims

    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"glm5-1L-{args.experts}E.gguf"
    if not path.exists():
        build_streaming_gguf(scale_dims("glm-5", n_layer=1, n_dense_lead=0, n_expert=args.experts, n_vocab=900),
                             path, workers=os.cpu_count() or 2)
    t0 = time.perf_counter()
    engine = HFEngine.from_gguf(path, dtype="bf16")
    print(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB; transformers bf16 loaded in "
          f"{time.perf_counter() - t0:.0f} s; {os.cpu_count()} cores")

    read = {"expert_rows": 0}
    original = dequant.dequantize_tensor

    def counting(model, name, *a, rows=None, **k):
        if "_exps." in name:
            info = model.tensors[name]
            read["expert_rows"] += (rows.stop - rows.start) if rows is not None else info.shape[0] * info.shape[1]
        return original(model, name, *a, rows=rows, **k)

    dequant.dequantize_tensor = counting
    runs = []
    for label, chosen in (("every expert", None), ("--experts 0-3", (0, 1, 2, 3)), ("every expert again", None)):
        read["expert_rows"] = 0
        session = Session(DiagnoseOptions(model=path, experts=chosen), lambda _m: None, engine)
        t0 = time.perf_counter()
        (report,) = audit.run(session)
        seconds = time.perf_counter() - t0
        session.close()
        failed = [r for r in report.results if r.failed]
        runs.append((label, seconds, read["expert_rows"]))
        print(f"  {label:20} {seconds:7.1f} s   stacked-expert rows read {read['expert_rows']:>10,}   "
              f"{'healthy' if not failed else 'FAILED: ' + failed[0].message}")
    dequant.dequantize_tensor = original
    full = min(runs[0][1], runs[2][1])
    share = 4 / args.experts
    print(f"ratio (--experts 0-3 / every expert): time {runs[1][1] / full:.3f}, expert rows read "
          f"{runs[1][2] / runs[0][2]:.3f} (4 of {args.experts} experts: {share:.3f}; the attention and router "
          "weights are audited in both)")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
