"""Issue 20's SmolLM2-on-CUDA lead, looked into by computations independent of the check.

`diagnose` of SmolLM2-135M Q4_1 through llama.cpp's CUDA backend (H100, n_gpu_layers=99)
failed `logits.prefill_lengths` (prompts of 16-33 tokens: mean KL 0.018-0.022 against a limit of
0.0151) with a prefill KL 5.8x that of llama.cpp's CPU backend on the same file (0.0102 vs
0.0018), the first rows worst (position 0: KL 0.065 vs 0.001), while decode agreed (0.0039).
This script, per built-in prompt:

1. the KL of each row from the fp64 reference, for the whole prompt in one batch, and for
   row 0 scored alone (a one-token batch takes the matrix-vector kernels, a longer one the
   matrix-matrix ones): does the batch change row 0?
2. both traced layer by layer (cb_eval), each kind's relative error against the reference at
   row 0 and over the other rows, and the reference's largest |value| per row (outliers);
3. each block's own error: the reference's attention / FFN replayed on the engine's input to it.

Run: python tools/gpu/real_lead.py MODEL [--spec n_gpu_layers=99] [--prompt N] [--layers 0,1,2,29]
(``--spec ""``: llama.cpp's CPU backend, for the same numbers side by side).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from leadlib import kl_rows, open_engines, rel_rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--spec", default="n_gpu_layers=99")
    ap.add_argument("--prompt", type=int, action="append", help="built-in prompts (0-based); default 2, 3")
    ap.add_argument("--layers", default="0,1,2,3,15,29")
    args = ap.parse_args()

    from ggufcheck.checks.prompts import builtin_prompts

    engine, reference = open_engines(args.model, args.spec)
    kinds = ("residual", "after_attention", "attention", "ffn")
    layers = [int(x) for x in args.layers.split(",")]
    for n, prompt in enumerate(builtin_prompts()):
        if n not in (args.prompt or [2, 3]):
            continue
        tokens = engine.tokenize(prompt.text)[:96]
        ref = reference.score(tokens).logprobs
        whole = engine.score(tokens).logprobs.astype(np.float64)
        k = kl_rows(ref, whole)
        alone = {m: kl_rows(reference.score(tokens[:m]).logprobs, engine.score(tokens[:m]).logprobs.astype(np.float64))
                 for m in (1, 2, 8, 9, 16, 33)}
        print(f"\nprompt {n} ({len(tokens)} tokens): KL vs reference, one batch of {len(tokens)}: mean {k.mean():.4f}, "
              f"rows 0..7 {np.round(k[:8], 4).tolist()}")
        for m, km in alone.items():
            print(f"  the first {m} tokens as their own batch: rows 0..{min(m, 8) - 1} {np.round(km[:8], 4).tolist()} "
                  f"(mean {km.mean():.4f}; the same rows in the long batch: mean {k[:m].mean():.4f})")
        rt = reference.layer_outputs(tokens, kinds).tensors
        et = engine.layer_outputs(tokens, kinds).tensors
        print("  relative error vs the fp64 reference: row 0 / median of rows 1.. / max of rows 1.. ; "
              "reference max|x| row 0 / median of rows 1..")
        for i in layers:
            row = []
            for kind in kinds:
                r, e = rt.get((kind, i)), et.get((kind, i))
                if r is None or e is None:
                    continue
                err = rel_rows(np.asarray(e, np.float64), np.asarray(r, np.float64))
                row.append(f"{kind} {err[0]:.3g} / {np.median(err[1:]):.3g} / {err[1:].max():.3g}")
            r = rt.get(("residual", i))
            if r is not None:
                big = np.abs(np.asarray(r)).max(axis=-1)
                row.append(f"max|x| {big[0]:.4g} / {np.median(big[1:]):.4g}")
            print(f"    layer {i}: " + "; ".join(row))
        # each block's own error: the reference block replayed on the engine's input to it
        import torch

        from ggufcheck.checks.layers.replay import Replayer

        model = reference.model
        ref_trace = model.prefill(list(tokens), trace=True)
        print("  each block on the engine's own input (reference replay): relative error row 0 / median rows 1..")
        for i in layers:
            h_in = ref_trace.embeddings if i == 0 else torch.as_tensor(np.asarray(et[("residual", i - 1)]))
            rep = Replayer(model, i)
            out = rep.attention(h_in, None)
            a_ref = np.asarray(out.attn_out.double().cpu())
            e_att = et.get(("attention", i))
            e_after = et.get(("after_attention", i))
            row = []
            if e_att is not None:
                err = rel_rows(np.asarray(e_att, np.float64), a_ref)
                row.append(f"attention {err[0]:.3g} / {np.median(err[1:]):.3g}")
            if e_after is not None:
                f_out = rep.ffn(torch.as_tensor(np.asarray(e_after)))[0]
                err = rel_rows(np.asarray(et[("ffn", i)], np.float64), np.asarray(f_out.double().cpu()))
                row.append(f"ffn {err[0]:.3g} / {np.median(err[1:]):.3g}")
            rep.close()
            print(f"    layer {i}: " + "; ".join(row))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
