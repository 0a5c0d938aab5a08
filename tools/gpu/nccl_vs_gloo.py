"""Sharded layer outputs over NCCL (GPU) vs gloo (CPU) on the same inputs, elementwise.

usage: python nccl_vs_gloo.py OUT.json MODEL.gguf [MODEL.gguf ...]   (TP 1: one GPU)
The same jobs as ``ggufcheck shard`` (make_jobs on the file's weights, same seed), run once
per backend with run_ranks; per job: max |nccl - gloo|, and each side's max |diff| against
the unsharded reference (CPU fp64).
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main() -> None:
    from ggufcheck.checks.sharding import _spec_and_rules
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.reference.config import config_from_gguf
    from ggufcheck.sharding.dist import DistOptions, run_ranks
    from ggufcheck.sharding.invariance import InvarianceOptions, gguf_layer_weights, make_jobs, unsharded
    from ggufcheck.sharding.parallel import RunPayload, rank_run

    out_path, *models = sys.argv[1:]
    rep = {}
    for path in models:
        with open_gguf(path) as model:
            spec, rules, _ = _spec_and_rules(model)
            cfg = config_from_gguf(model.metadata, model.tensors, str(model.path))
            with torch.no_grad():
                jobs = make_jobs(cfg, gguf_layer_weights(model), InvarianceOptions(tp=1))
            payload = RunPayload(cfg, rules, jobs)
            res, times = {}, {}
            for backend in ("nccl", "gloo"):
                t = time.perf_counter()
                res[backend] = run_ranks(rank_run, payload, DistOptions(1, backend, 60.0, "spawn"))[0]
                times[backend] = time.perf_counter() - t
            r = {"run_s": times, "jobs": {}, "collectives_equal": None}
            for i, job in enumerate(jobs):
                a, b = res["nccl"]["jobs"][i], res["gloo"]["jobs"][i]
                if "error" in a or "error" in b:
                    r["jobs"][job.kind] = {"nccl_error": a.get("error"), "gloo_error": b.get("error")}
                    continue
                want = unsharded(cfg, job)["out"]
                fin = torch.isfinite(want)

                def dmax(x, y):
                    d = (x.double() - y.double()).abs()
                    d = torch.where(fin & torch.isfinite(x), d, torch.zeros_like(d))
                    return float(d.max())

                r["jobs"][job.kind] = {"shape": list(want.shape), "max_abs_nccl_vs_gloo": dmax(a["out"], b["out"]),
                                       "bitwise_equal": bool(torch.equal(a["out"], b["out"])),
                                       "max_abs_nccl_vs_unsharded": dmax(a["out"], want),
                                       "max_abs_gloo_vs_unsharded": dmax(b["out"], want),
                                       "max_abs_unsharded": float(want[fin].abs().max())}
                if "topk" in a:
                    r["jobs"][job.kind]["topk_equal"] = bool(torch.equal(a["topk"], b["topk"]))
            ca, cb = res["nccl"]["collectives"], res["gloo"]["collectives"]
            r["collectives_common_cases_equal"] = all(torch.equal(ca[k], cb[k]) for k in cb)
            r["collectives_cases"] = {"nccl": sorted(ca), "gloo": sorted(cb)}
            rep[path] = r
            print(path, json.dumps(r, indent=1), flush=True)
            with open(out_path, "w") as f:
                json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
