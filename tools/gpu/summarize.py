"""Markdown tables from the device results folder (for docs/gpu-evidence.md). usage: python summarize.py DIR"""

import glob
import json
import os
import sys

d = sys.argv[1]


def g(x):
    return f"{x:.2e}" if isinstance(x, float) else str(x)


p = os.path.join(d, "tiny_reference.json")
if os.path.exists(p):
    rep = json.load(open(p))
    print("## tiny reference\n")
    print("| model | comparison | max abs | rel to max | max elem rel | argmax agree | router rows differ | top-k rows differ |")
    print("|---|---|---|---|---|---|---|---|")
    for path, r in rep["models"].items():
        for k, v in r["diffs"].items():
            er = f"{v['expert_rows_differ']}/{v['expert_rows']}" if "expert_rows" in v else ""
            tr = f"{v['topk_rows_differ']}/{v['topk_rows']}" if "topk_rows" in v else ""
            print(f"| {r['arch']} | {k} | {g(v['max_abs'])} | {g(v['rel_to_max'])} | {g(v['max_elem_rel'])} | "
                  f"{v['argmax_agree']:.3f} | {er} | {tr} |")
    print("\n| model | run | load+first prefill s | warm prefill s | decode s |\n|---|---|---|---|---|")
    for path, r in rep["models"].items():
        for k, v in r["runs"].items():
            print(f"| {r['arch']} | {k} | {v['load_and_first_prefill_s']:.3f} | {v['warm_prefill_s']:.4f} | "
                  f"{v.get('decode_s', float('nan')):.3f} |")

for p in sorted(glob.glob(os.path.join(d, "shard-*.json"))):
    rep = json.load(open(p))
    st = rep["stages"][0]
    counts = {}
    for r in st["results"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"\n## {os.path.basename(p)}: {st['status']} {counts} info={st['info']}\n")
    print("| check | status | max abs diff | tol | message |\n|---|---|---|---|---|")
    for r in st["results"]:
        s = r.get("stats", {})
        if r["check"].startswith(("sharding.tp", "sharding.collectives", "sharding.mla")) or r["status"] != "PASS":
            print(f"| {r['check']} | {r['status']} | {g(s.get('max_abs_diff', ''))} | {g(s.get('tolerance', ''))} | "
                  f"{r['message'][:160]} |")

p = os.path.join(d, "nccl_vs_gloo.json")
if os.path.exists(p):
    rep = json.load(open(p))
    print("\n## nccl vs gloo\n")
    print("| model | kind | shape | max abs nccl-gloo | bitwise | nccl vs unsharded | gloo vs unsharded | max abs |")
    print("|---|---|---|---|---|---|---|---|")
    for path, r in rep.items():
        for k, v in r["jobs"].items():
            if "shape" not in v:
                print(f"| {os.path.basename(path)} | {k} | error | {v} |")
                continue
            print(f"| {os.path.basename(path)} | {k} | {v['shape']} | {g(v['max_abs_nccl_vs_gloo'])} | "
                  f"{v['bitwise_equal']} | {g(v['max_abs_nccl_vs_unsharded'])} | {g(v['max_abs_gloo_vs_unsharded'])} | "
                  f"{v['max_abs_unsharded']:.3g} |")
        print(f"| {os.path.basename(path)} | run s | {r['run_s']} | collectives common cases equal: "
              f"{r['collectives_common_cases_equal']} |")

p = os.path.join(d, "reference_glm5.json")
if os.path.exists(p):
    rep = json.load(open(p))
    print("\n## GLM-5 dims reference\n")
    for k, v in rep["steps"].items():
        print(f"- {k}: {v}")
    for k, v in rep["diffs"].items():
        print(f"- {k}: " + ", ".join(f"{a}={g(b)}" for a, b in v.items()))
    print("- long_topk:", rep.get("long_topk"))
for p in ("build_glm5.json",):
    if os.path.exists(os.path.join(d, p)):
        print("\n", open(os.path.join(d, p)).read()[:3000])
