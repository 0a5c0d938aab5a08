"""Why does llama-cpp-python crash with a CUDA libllama on the device? (issue 20)

Each variant runs in its own interpreter with faulthandler on, so a segfault names the Python
line and the variants that survive narrow the cause: without torch, after importing torch,
after torch has initialised CUDA, with GPU offload and without.

    python3 tools/gpu/probe_in_process.py MODEL.gguf
"""

import subprocess
import sys

BODY = r'''
import faulthandler, sys, os
faulthandler.enable()
pre = sys.argv[2]
if pre in ("torch", "torch-cuda"):
    import torch
    if pre == "torch-cuda":
        torch.zeros(1, device="cuda")
import llama_cpp
if pre == "llama-first":  # llama.cpp's CUDA libraries bound first, then torch's
    import torch
    torch.zeros(1, device="cuda")
print("loaded from", llama_cpp.llama_cpp._base_path, "gpu offload", llama_cpp.llama_supports_gpu_offload(), flush=True)
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_gpu_layers=int(sys.argv[3]), logits_all=True,
                      verbose=True)
print("model loaded", flush=True)
llm.eval(list(range(1, 40)))
import numpy as np
print("scored", np.array(llm.scores[:39]).std(), flush=True)
'''


def main() -> None:
    model = sys.argv[1]
    for pre in ("none", "torch", "torch-cuda", "llama-first"):
        for ngl in (0, 99):
            proc = subprocess.run([sys.executable, "-c", BODY, model, pre, str(ngl)], capture_output=True,
                                  text=True, timeout=120)
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            keep = [ln for ln in lines if not ln.startswith(("llama_model_loader: - ", "print_info", "load_tensors:"))]
            print(f"##### import first: {pre:10s} n_gpu_layers={ngl:2d} -> rc {proc.returncode}")
            print("\n".join(keep[-25:]))


if __name__ == "__main__":
    main()
