"""Which setting makes llama-cpp-python's CUDA libllama segfault without torch? (issue 20)

Runs, each in a fresh interpreter with faulthandler: llama_cpp.Llama with ggufcheck's exact
arguments quiet (verbose=False) and verbose, and LlamaCppEngine itself quiet and verbose.

    python3 tools/gpu/probe_child.py MODEL.gguf
"""

import subprocess
import sys

VARIANTS = {
    "numpy-first": "import numpy; import llama_cpp; llama_cpp.Llama(model_path=M, n_ctx=2048, n_gpu_layers=99, "
                   "logits_all=True, verbose=False)",
    "llama-first-engine": "import llama_cpp; from ggufcheck.engines.llama_cpp import LlamaCppEngine as E; "
                          "E(M, n_gpu_layers=99).score([1, 2, 3])",
    "llama-quiet": "import llama_cpp; llama_cpp.Llama(model_path=M, n_ctx=2048, n_batch=512, n_threads=8, "
                   "n_threads_batch=8, logits_all=True, seed=0, verbose=False, n_gpu_layers=99)",
    "llama-verbose": "import llama_cpp; llama_cpp.Llama(model_path=M, n_ctx=2048, n_batch=512, n_threads=8, "
                     "n_threads_batch=8, logits_all=True, seed=0, verbose=True, n_gpu_layers=99)",
    "engine-quiet": "from ggufcheck.engines.llama_cpp import LlamaCppEngine as E; E(M, n_gpu_layers=99).score([1, 2, 3])",
    "engine-verbose": "from ggufcheck.engines.llama_cpp import LlamaCppEngine as E; E(M, n_gpu_layers=99, verbose=1).score([1, 2, 3])",
    # 2026-12-07: every first score of a CUDA build of the 0.3.36 sdist died (SIGSEGV); which part?
    "llama-eval": "import llama_cpp; l = llama_cpp.Llama(model_path=M, n_ctx=512, n_gpu_layers=99, logits_all=True, "
                  "verbose=False); l.eval([1, 2, 3]); print(l.scores[2][:3])",
    "llama-eval-last-logits": "import llama_cpp; l = llama_cpp.Llama(model_path=M, n_ctx=512, n_gpu_layers=99, "
                              "verbose=False); l.eval([1, 2, 3]); print(l.scores[2][:3])",
    "llama-eval-cpu-layers": "import llama_cpp; l = llama_cpp.Llama(model_path=M, n_ctx=512, n_gpu_layers=0, "
                             "logits_all=True, verbose=False); l.eval([1, 2, 3]); print(l.scores[2][:3])",
    "engine-no-graphs": "import os; os.environ['GGML_CUDA_DISABLE_GRAPHS'] = '1'; import llama_cpp; "
                        "from ggufcheck.engines.llama_cpp import LlamaCppEngine as E; E(M, n_gpu_layers=99).score([1, 2, 3])",
    "engine-no-fusion": "import os; os.environ['GGML_CUDA_DISABLE_FUSION'] = '1'; import llama_cpp; "
                        "from ggufcheck.engines.llama_cpp import LlamaCppEngine as E; E(M, n_gpu_layers=99).score([1, 2, 3])",
    "engine-fa-off": "import llama_cpp; from ggufcheck.engines.llama_cpp import LlamaCppEngine as E; "
                     "E(M, n_gpu_layers=99, flash_attn=0).score([1, 2, 3])",
}

only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
for name, code in ((n, VARIANTS[n]) for n in only):
    body = f"import faulthandler, sys; faulthandler.enable(); M = sys.argv[1]\n{code}\nprint('OK', flush=True)"
    proc = subprocess.run([sys.executable, "-c", body, sys.argv[1]], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if ln.startswith(("OK", "Fatal", "  File", "Current thread")) or "Error" in ln]
    print(f"##### {name}: rc {proc.returncode}")
    print("\n".join(lines[-12:]))
    print("  stderr tail: " + " | ".join(proc.stderr.strip().splitlines()[-4:])[:600])
