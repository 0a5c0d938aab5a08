"""Reference prefill on the synthetic GLM-5-dimension model: CUDA fp64 / fp32, decode, absorbed, CPU.

usage: python ref_glm5.py OUT.json MODEL.gguf [--device cuda] [--long N] [--short N] [--cpu]
Writes OUT.json after every step (a timeout keeps what was measured).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ggufcheck.reference.model import ReferenceModel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ref_cuda import diff, discrete  # noqa: E402


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    out_path, path, *rest = sys.argv[1:]
    args = dict(zip(rest[::2], rest[1::2]))
    dev = args.get("--device", "cuda")
    n_short, n_long = int(args.get("--short", 8)), int(args.get("--long", 2080))
    cpu = args.get("--cpu", "1") == "1"
    rep: dict = {"model": path, "device": dev, "steps": {}, "diffs": {}}

    def save():
        with open(out_path, "w") as f:
            json.dump(rep, f, indent=1)

    def timed(name, fn):
        sync(dev)
        t = time.perf_counter()
        val = fn()
        sync(dev)
        rep["steps"][name] = {"s": time.perf_counter() - t}
        if dev.startswith("cuda"):
            rep["steps"][name]["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"{name}: {rep['steps'][name]}", flush=True)
        save()
        return val

    gen = torch.Generator().manual_seed(5)
    ref = timed("fp64/init", lambda: ReferenceModel(path, dtype="fp64", device=dev, streaming=False))
    vocab = ref.gguf.tensors["token_embd.weight"].shape[0]
    short = torch.randint(0, vocab, (n_short,), generator=gen).tolist()
    long = torch.randint(0, vocab, (n_long,), generator=gen).tolist()
    rep.update(tokens_short=short, n_long=n_long, top_k=ref.cfg.indexer_top_k)
    timed("fp64/first_prefill_short(dequant+compute)", lambda: ref.forward(short))
    lg, outs, _ = timed("fp64/prefill_short", lambda: ref.forward(short, keep_layers=True))
    lsm64 = torch.log_softmax(lg, -1)
    dec = timed("fp64/decode_short", lambda: ref.decode(short))
    rep["diffs"]["decode_vs_prefill/fp64"] = diff(torch.log_softmax(dec, -1), lsm64)
    naive_cfg = ref.cfg
    ref.cfg = naive_cfg.with_options(mla_form="absorbed")
    lga, outs_a, _ = timed("fp64/prefill_short_absorbed", lambda: ref.forward(short, keep_layers=True))
    rep["diffs"]["absorbed_vs_naive/fp64/short"] = diff(torch.log_softmax(lga, -1), lsm64) | discrete(outs_a, outs)
    ref.cfg = naive_cfg
    save()
    print(rep["diffs"], flush=True)
    if n_long:
        lgl, outs_l, _ = timed(f"fp64/prefill_long_{n_long}", lambda: ref.forward(long, keep_layers=True))
        full = [o for o in outs_l if o.topk is not None and o.topk_full]
        if full:
            tk = full[0].topk
            rep["long_topk"] = {"shape": list(tk.shape), "queries_with_at_least_k_keys": int((tk[:, -1] >= 0).sum())
                                if tk.shape[1] else 0,
                                "ties": int(full[0].topk_ties.sum()) if full[0].topk_ties is not None else None}
        ref.cfg = naive_cfg.with_options(mla_form="absorbed")
        lgla, outs_la, _ = timed(f"fp64/prefill_long_{n_long}_absorbed", lambda: ref.forward(long, keep_layers=True))
        ref.cfg = naive_cfg
        rep["diffs"]["absorbed_vs_naive/fp64/long"] = diff(torch.log_softmax(lgla, -1), torch.log_softmax(lgl, -1)) \
            | discrete(outs_la, outs_l)
        del lgl, outs_l, lgla, outs_la
        save()
        print(rep["diffs"], flush=True)
    ref.close()
    del ref
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ref32 = timed("fp32/init", lambda: ReferenceModel(path, dtype="fp32", device=dev, streaming=False))
    timed("fp32/first_prefill_short(dequant+compute)", lambda: ref32.forward(short))
    lg32, outs32, _ = timed("fp32/prefill_short", lambda: ref32.forward(short, keep_layers=True))
    rep["diffs"]["fp32_vs_fp64/short"] = diff(torch.log_softmax(lg32, -1), lsm64) | discrete(outs32, outs)
    ref32.close()
    del ref32
    save()
    print(rep["diffs"], flush=True)
    if cpu and dev.startswith("cuda"):
        t = time.perf_counter()
        refc = ReferenceModel(path, dtype="fp64", device="cpu", streaming=False)
        lgc, outsc, _ = refc.forward(short, keep_layers=True)
        rep["steps"]["fp64/cpu_init_and_prefill_short"] = {"s": time.perf_counter() - t}
        rep["diffs"]["cuda_vs_cpu/fp64/short"] = diff(lsm64, torch.log_softmax(lgc, -1)) | discrete(outs, outsc)
        save()
        print(rep["diffs"]["cuda_vs_cpu/fp64/short"], rep["steps"]["fp64/cpu_init_and_prefill_short"], flush=True)


if __name__ == "__main__":
    main()
