"""A CPU reproduction of the SmolLM2-on-CUDA lead: how llama.cpp's CPU and CUDA backends compute
a Q4_1 x q8_1 product, emulated in numpy from the file's raw blocks, against exact fp64.

Both backends round the activations to q8_1 (32-value blocks, d = max|x| / 127, q = round(x / d))
and compute, per block, ``sumi * d_w * d_a + m_w * s_a`` (Q4_1 weights are d_w * q_w + m_w). They
differ in s_a, the block sum the min term multiplies:

- the CPU (``quantize_row_q8_1``) keeps ``s = d_a * sum(q_a)``, the sum of the ROUNDED values, so
  the block is exactly ``sum((d_w q_w + m_w) * x_rounded)``: its rounding error is weighted by
  the weights themselves;
- CUDA (``quantize_q8_1`` and ``quantize_mmq_q8_1``, ggml-cuda/quantize.cu) keeps the sum of the
  UNROUNDED values, so the error is ``d_w * sum(q_w * (x_rounded - x))``: weighted by d_w q_w,
  which for Q4_1 sits a whole min |m_w| away from the weight, a common-mode error the CPU's
  form cancels. (On sm_70 and later it also multiplies the two f16 scales in f16,
  ``__hmul2(dm4, ds8)`` in vecdotq.cuh; emulated too, it turns out negligible.)

The script captures layer 0's inputs with llama.cpp's CPU backend (``attn_norm-0``,
``ffn_norm-0``), computes each Q4_1 product exactly, the CPU's way and CUDA's way, and prints
each one's relative error against exact (row 0 / the median of the rest). The CPU emulation
reproduces llama.cpp's CPU engine to three digits (``op_lead.py --spec ""``: attn_v 0.0155 /
0.0105); the CUDA one is 3-4.5x further from exact on the attention products, the size of the
error measured on the H100 (docs/gpu-evidence.md section 6). The device run that compares the
H100's own products with it is ``op_lead.py`` (``llama_cpp_cuda.sh oplead``).

Run: python tools/gpu/q8_1_emulation.py MODEL [--layer 0] [--tokens 96]
"""

from __future__ import annotations

import argparse
import sys

import llama_cpp  # noqa: F401  (before numpy, as for a CUDA libllama)
import numpy as np
from leadlib import emulated_forms, q4_1_blocks, q8_1, rel_rows

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()

    import gguf

    from ggufcheck.checks.prompts import builtin_prompts
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine(args.model)
    engine._node_kinds.update({"attn_norm": "op:attn_norm", "ffn_norm": "op:ffn_norm"})
    tokens = engine.tokenize(builtin_prompts()[3].text)[: args.tokens]
    trace = engine._trace(tokens, ["op:attn_norm", "op:ffn_norm"], None).tensors
    engine.close()
    inputs = {"attn_norm": np.asarray(trace[("op:attn_norm", args.layer)], np.float64),
              "ffn_norm": np.asarray(trace[("op:ffn_norm", args.layer)], np.float64)}
    reader = gguf.GGUFReader(args.model)
    print(f"layer {args.layer}, {len(tokens)} tokens of built-in prompt 3; relative error against exact fp64, "
          "row 0 / median of the rest")
    for t in reader.tensors:
        short = t.name.split(".", 2)[-1] if t.name.startswith(f"blk.{args.layer}.") else None
        source = {"attn_q.weight": "attn_norm", "attn_k.weight": "attn_norm", "attn_v.weight": "attn_norm",
                  "ffn_up.weight": "ffn_norm", "ffn_gate.weight": "ffn_norm"}.get(short or "")
        if source is None or t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        n_out, n_in = int(t.shape[1]), int(t.shape[0])
        x = inputs[source]
        W = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        exact = x @ W.T
        forms = emulated_forms(t.data, n_out, n_in, x)
        cpu, f32, f16 = forms["cpu"], forms["cuda_f32_products"], forms["cuda"]
        dw, _, _ = q4_1_blocks(np.asarray(t.data, np.uint8).reshape(-1), n_out, n_in)
        da, _, _ = q8_1(x)
        dd = dw.astype(np.float32)[None] * da.astype(np.float16).astype(np.float32)[:, None]
        sub = np.abs(dd) < 6.1e-5
        e32, e16, ecpu = rel_rows(f32, exact), rel_rows(f16, exact), rel_rows(cpu, exact)
        print(f"  {short} ({n_in} -> {n_out}): CPU's q8_1 (s from rounded values, f32 products) {ecpu[0]:.3g} / "
              f"{np.median(ecpu[1:]):.3g}; CUDA's (s from unrounded values) with f32 products {e32[0]:.3g} / "
              f"{np.median(e32[1:]):.3g}, with f16 products as on sm_70+ {e16[0]:.3g} / {np.median(e16[1:]):.3g}; "
              f"scale products below f16's smallest normal: row 0 {sub[0].mean():.0%}, the rest {sub[1:].mean():.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
