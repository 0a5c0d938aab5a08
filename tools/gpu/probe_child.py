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
}

for name, code in VARIANTS.items():
    body = f"import faulthandler, sys; faulthandler.enable(); M = sys.argv[1]\n{code}\nprint('OK', flush=True)"
    proc = subprocess.run([sys.executable, "-c", body, sys.argv[1]], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if ln.startswith(("OK", "Fatal", "  File", "Current thread")) or "Error" in ln]
    print(f"##### {name}: rc {proc.returncode}")
    print("\n".join(lines[-12:]))
