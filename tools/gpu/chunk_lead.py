"""Issue 20's chunked-prefill lead on the GPU, settled by computations independent of the check.

`paths.chunked_prefill[5]` failed on the tiny deepseek2 Q4_K through llama.cpp's CUDA backend
with GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 (one position at KL 10). This script, for each
prompt ggufcheck's diagnose uses:

1. scores one prefill and chunks of N on the engine (a process of its own: a CUDA libllama
   cannot share a process with torch) and the fp64 reference, and prints, at every position
   where the two paths differ most, each path's KL from the reference: which side is wrong;
2. traces both paths layer by layer (cb_eval; the chunked trace feeds one llama_decode per
   chunk) and the reference, and prints each path's relative residual / attention / FFN error
   against the reference at that position, per layer: where it starts.

Run: python tools/gpu/chunk_lead.py MODEL [--chunk 5] [--spec n_gpu_layers=99] [--runs 2] [--prompt N]
(``--spec ""``: llama.cpp's CPU backend, e.g. the Gemma 3 lead of docs/real-world-cases.md)
(the environment, e.g. GGML_CUDA_CUBLAS_COMPUTE_TYPE, reaches the engine's process).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from leadlib import kl_rows, open_engines



def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--chunk", type=int, default=5)
    ap.add_argument("--spec", default="n_gpu_layers=99")
    ap.add_argument("--runs", type=int, default=2, help="repeat the chunked score: is it deterministic?")
    ap.add_argument("--worst", type=int, default=2, help="positions printed per prompt")
    ap.add_argument("--prompt", type=int, action="append", help="only these built-in prompts (0-based)")
    ap.add_argument("--trace-above", type=float, default=0.05, help="trace a prompt whose worst KL is above this")
    args = ap.parse_args()

    from ggufcheck.checks.prompts import builtin_prompts

    engine, reference = open_engines(args.model, args.spec)
    kinds = ("residual", "attention", "ffn")
    moe_kinds = (*kinds, "router", "router_probs", "router_biased")
    for n, prompt in enumerate(builtin_prompts()):
        if args.prompt and n not in args.prompt:
            continue
        tokens = engine.tokenize(prompt.text)
        if not args.chunk < len(tokens) <= 2048:  # the engine's n_ctx
            continue
        ref = reference.score(tokens).logprobs
        whole = engine.score(tokens).logprobs.astype(np.float64)
        chunked = [engine.score_chunked(tokens, args.chunk).logprobs.astype(np.float64) for _ in range(args.runs)]
        same = all(np.array_equal(chunked[0], c) for c in chunked[1:])
        kw, kc = kl_rows(ref, whole), kl_rows(ref, chunked[0])
        kp = kl_rows(whole, chunked[0])
        print(f"\nsequence {n} ({len(tokens)} tokens): chunked runs identical: {same}; "
              f"KL vs reference mean whole {kw.mean():.3g} chunked {kc.mean():.3g}; "
              f"whole vs chunked mean {kp.mean():.3g} max {kp.max():.3g} at position {int(kp.argmax())}")
        for pos in np.argsort(-kp)[:args.worst]:
            pos = int(pos)
            print(f"  position {pos} (chunk {pos // args.chunk}, offset {pos % args.chunk}): KL whole-vs-chunked "
                  f"{kp[pos]:.3g}; vs reference: whole {kw[pos]:.3g}, chunked {kc[pos]:.3g}; argmax ref "
                  f"{int(ref[pos].argmax())} whole {int(whole[pos].argmax())} chunked {int(chunked[0][pos].argmax())}")
        pos = int(kp.argmax())
        if kp[pos] < args.trace_above:
            continue
        rt = reference.layer_outputs(tokens, kinds).tensors
        wt = engine.layer_outputs(tokens, moe_kinds).tensors
        ct = engine.chunked_layer_outputs(tokens, args.chunk, moe_kinds).tensors
        for (kind, i), ids_w in sorted(wt.items(), key=lambda kv: kv[0][1]):
            if kind != "router":  # the experts each path chose for the worst row (and the row before)
                continue
            ids_c = ct.get(("router", i))
            scores_w = wt.get(("router_biased", i), wt.get(("router_probs", i)))
            scores_c = ct.get(("router_biased", i), ct.get(("router_probs", i)))
            for t in (pos - 1, pos):
                a, b = sorted(np.asarray(ids_w)[t].tolist()), (sorted(np.asarray(ids_c)[t].tolist()) if ids_c is not None else None)
                gap = ""
                if scores_w is not None:
                    sw = np.sort(np.asarray(scores_w, np.float64)[t])[::-1]
                    k = len(a)
                    gap = f", whole's own gap (k-th minus (k+1)-th score) {sw[k - 1] - sw[k]:.3g}"
                if scores_c is not None and scores_w is not None:
                    gap += f", scores differ by max {np.abs(np.asarray(scores_c, np.float64)[t] - np.asarray(scores_w, np.float64)[t]).max():.3g}"
                print(f"  layer {i} row {t}: experts whole {a} chunked {b} ({'same' if a == b else 'DIFFERENT'}){gap}")
        layers = sorted({i for _, i in rt})
        print(f"  traced at position {pos}: relative error vs the fp64 reference, whole / chunked "
              "[chunked vs whole]")
        for i in layers:
            row = []
            for kind in kinds:
                r, w, c = rt.get((kind, i)), wt.get((kind, i)), ct.get((kind, i))
                if r is None or w is None or c is None:
                    continue
                row.append(f"{kind} {rel(w[pos], r[pos]):.3g} / {rel(c[pos], r[pos]):.3g} [{rel(c[pos], w[pos]):.3g}]")
            print(f"    layer {i}: " + "; ".join(row))
        # over all positions of the chunked trace: which positions are off at the first bad layer
        for i in layers:
            r, c = rt[("residual", i)], ct[("residual", i)]
            errs = np.linalg.norm(c - r, axis=-1) / np.linalg.norm(r, axis=-1)
            bad = np.flatnonzero(errs > 0.1)
            if len(bad):
                print(f"  first layer with chunked residual error > 0.1: {i}, at positions {bad[:20].tolist()}")
                break
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
