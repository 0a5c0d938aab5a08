"""The SmolLM2-on-CUDA lead, one matrix product at a time (issue 20).

real_lead.py showed llama.cpp's CUDA backend 5x further from fp64 than its CPU backend in
layer 0's attention and FFN blocks of SmolLM2 Q4_1. This script asks each quantized product of
layer 0 the same question on its own: given the input the engine itself fed it (captured with
the eval callback), how far is the engine's output from

- the exact product in fp64 (weights dequantized by gguf-py, an implementation independent of
  both llama.cpp and ggufcheck), and
- for Q4_1 weights, the product as the CPU backend computes it and as the CUDA backend does
  (``leadlib.emulated_forms``, from the file's raw blocks; q8_1_emulation.py says how they
  differ).

An engine lands much closer to its backend's form than to the other (llama.cpp's CPU backend on
SmolLM2's layer 0: 2e-4 to 9e-4 from the CPU form, 4e-3 to 1.3e-2 from CUDA's; not ~1e-6, since
the emulation does not copy every rounding step), and its distance from exact is that form's
rounding. Per product, per row (row 0 alone: the first token).

Run (llama_cpp is imported before numpy: a CUDA libllama dies at load otherwise, see
docs/real-world-cases.md): python tools/gpu/op_lead.py MODEL [--spec n_gpu_layers=99] [--tokens 16]
"""

from __future__ import annotations

import argparse
import sys

import llama_cpp  # noqa: F401  (first: see the docstring)
import numpy as np
from leadlib import emulated_forms, rel_rows, spec_options

# (input node, output node, weight): the products of layer 0 whose input the graph names
PRODUCTS = (("attn_norm", "Vcur", "attn_v"), ("attn_norm", "Kcur", "attn_k"), ("kqv_out", "attn_out", "attn_output"),
            ("ffn_norm", "ffn_up", "ffn_up"), ("ffn_norm", "ffn_gate", "ffn_gate"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--spec", default="n_gpu_layers=99")
    ap.add_argument("--tokens", type=int, action="append", help="batch sizes to trace (default 1 and 16)")
    ap.add_argument("--layer", type=int, default=0)
    args = ap.parse_args()

    import gguf

    from ggufcheck.checks.prompts import builtin_prompts
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine(args.model, **spec_options(args.spec))
    nodes = {name for product in PRODUCTS for name in product[:2]}
    engine._node_kinds.update({name: f"op:{name}" for name in nodes})  # capture these nodes too
    reader = gguf.GGUFReader(args.model)
    weights = {}
    for t in reader.tensors:
        for _, _, w in PRODUCTS:
            if t.name == f"blk.{args.layer}.{w}.weight":
                weights[w] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)  # [out, in]
                weights[w + ":type"] = t.tensor_type.name
                weights[w + ":raw"] = t.data
    tokens = engine.tokenize(builtin_prompts()[3].text)
    print(f"engine: {engine.name} ({args.spec or 'CPU'}); layer {args.layer}; product error per row: "
          "vs exact fp64 | vs the CPU's q8_1 form | vs CUDA's q8_1 form (row 0 / median of the rest; "
          "tools/gpu/q8_1_emulation.py says how the forms differ)")
    for n in args.tokens or [1, 16]:
        trace = engine._trace(tokens[:n], [f"op:{name}" for name in nodes], None).tensors
        print(f"  a batch of {n} token(s):")
        for src, dst, w in PRODUCTS:
            x, y = trace.get((f"op:{src}", args.layer)), trace.get((f"op:{dst}", args.layer))
            if x is None or y is None or w not in weights:
                print(f"    {w}: not captured ({src} -> {dst})")
                continue
            x = np.asarray(x, np.float64).reshape(n, -1)
            y = np.asarray(y, np.float64).reshape(n, -1)
            W = weights[w]
            e1 = rel_rows(y, x @ W.T)
            rest = (lambda e: f"{np.median(e[1:]):.3g}" if n > 1 else "-")
            line = f"    {w} ({weights[w + ':type']}, {W.shape[1]} -> {W.shape[0]}): exact {e1[0]:.3g} / {rest(e1)}"
            if weights[w + ":type"] == "Q4_1":
                forms = emulated_forms(weights[w + ":raw"], W.shape[0], W.shape[1], x)
                e_cpu, e_cuda = rel_rows(y, forms["cpu"]), rel_rows(y, forms["cuda"])
                line += f" | CPU form {e_cpu[0]:.3g} / {rest(e_cpu)} | CUDA form {e_cuda[0]:.3g} / {rest(e_cuda)}"
            print(line + f"; input max|x| row 0 {np.abs(x[0]).max():.4g}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
