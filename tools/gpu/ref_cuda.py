"""Reference on CUDA vs CPU (issue 4): log-softmax differences, decode == prefill, MLA naive vs absorbed.

usage: python ref_cuda.py OUT.json MODEL.gguf [MODEL.gguf ...] [--tokens N] [--devices cpu,cuda]
Every number printed is also written to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ggufcheck.reference.model import ReferenceModel


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """a vs reference b (log-softmax [T, V]): max abs, max abs / max |b|, max elementwise rel, argmax."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    d = (a - b).abs()
    return {"max_abs": float(d.max()), "rel_to_max": float(d.max() / b.abs().max()),
            "max_elem_rel": float((d / b.abs().clamp_min(1e-30)).max()),
            "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).double().mean())}


def discrete(a: list, b: list) -> dict:
    """Per-layer router ids and DSA top-k sets: how many (layer, token) rows differ."""
    out = {"expert_rows": 0, "expert_rows_differ": 0, "topk_rows": 0, "topk_rows_differ": 0}
    for la, lb in zip(a, b):
        if la.expert_ids is not None:
            for x, y in zip(la.expert_ids.cpu().tolist(), lb.expert_ids.cpu().tolist()):
                out["expert_rows"] += 1
                out["expert_rows_differ"] += set(x) != set(y)
        if la.topk is not None and la.topk_full:
            for x, y in zip(la.topk.cpu().tolist(), lb.topk.cpu().tolist()):
                out["topk_rows"] += 1
                out["topk_rows_differ"] += (set(x) - {-1}) != (set(y) - {-1})
    return out


def run(path: str, tokens: list[int], dtype: str, device: str, mla: str | None = None, decode: bool = False):
    t0 = time.perf_counter()
    opts = {"mla_form": mla} if mla else {}
    ref = ReferenceModel(path, dtype=dtype, device=device, streaming=False, **opts)
    logits, outs, _ = ref.forward(tokens, keep_layers=True)  # first pass: dequantizes the weights
    sync()
    t1 = time.perf_counter()
    logits, outs, _ = ref.forward(tokens, keep_layers=True)  # warm pass: compute only
    sync()
    t2 = time.perf_counter()
    rec = {"load_and_first_prefill_s": t1 - t0, "warm_prefill_s": t2 - t1,
           "logits_device": str(logits.device), "logits_dtype": str(logits.dtype)}
    lsm = torch.log_softmax(logits, dim=-1)
    dec = None
    if decode:
        t3 = time.perf_counter()
        dlog = ref.decode(tokens)
        sync()
        rec["decode_s"] = time.perf_counter() - t3
        dec = torch.log_softmax(dlog, dim=-1)
    ref.close()
    return lsm, outs, dec, rec, ref.cfg


def main() -> None:
    out_path, *rest = sys.argv[1:]
    n_tok, devices = 16, ["cpu", "cuda"]
    models = []
    it = iter(rest)
    for a in it:
        if a == "--tokens":
            n_tok = int(next(it))
        elif a == "--devices":
            devices = next(it).split(",")
        else:
            models.append(a)
    report = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "models": {}}
    for path in models:
        from ggufcheck.gguf.reader import open_gguf

        with open_gguf(path) as m:
            vocab = m.tensors["token_embd.weight"].shape[0]
            arch = m.architecture
        gen = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, vocab, (n_tok,), generator=gen).tolist()
        r: dict = {"arch": arch, "tokens": tokens, "runs": {}, "diffs": {}}
        report["models"][path] = r
        res = {}
        for dtype in ("fp64", "fp32"):
            for dev in devices:
                lsm, outs, dec, rec, cfg = run(path, tokens, dtype, dev, decode=(dev == devices[-1]))
                res[(dtype, dev)] = (lsm, outs)
                r["runs"][f"{dtype}/{dev}"] = rec
                if dec is not None:
                    r["diffs"][f"decode_vs_prefill/{dtype}/{dev}"] = diff(dec, lsm)
                if cfg.is_mla and dev == devices[-1]:
                    lsm_a, outs_a, _, rec_a, _ = run(path, tokens, dtype, dev, mla="absorbed")
                    r["runs"][f"{dtype}/{dev}/absorbed"] = rec_a
                    r["diffs"][f"absorbed_vs_naive/{dtype}/{dev}"] = diff(lsm_a, lsm) | discrete(outs_a, outs)
                print(path, dtype, dev, json.dumps(rec), flush=True)
            if "cpu" in devices and "cuda" in devices:
                r["diffs"][f"cuda_vs_cpu/{dtype}"] = diff(res[(dtype, "cuda")][0], res[(dtype, "cpu")][0]) | \
                    discrete(res[(dtype, "cuda")][1], res[(dtype, "cpu")][1])
        for dev in devices:
            r["diffs"][f"fp32_vs_fp64/{dev}"] = diff(res[("fp32", dev)][0], res[("fp64", dev)][0]) | \
                discrete(res[("fp32", dev)][1], res[("fp64", dev)][1])
        for k, v in r["diffs"].items():
            print(f"  {arch:10s} {k:32s} " + " ".join(f"{a}={b:.3g}" if isinstance(b, float) else f"{a}={b}"
                                                     for a, b in v.items()), flush=True)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
