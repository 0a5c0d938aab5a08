"""Which part of llama.cpp's CUDA one-token path makes the tiny deepseek2 Q4_K's row 79 flat?

docs/evidence/cuda_ds2_q4k_row79.txt: in process with n_batch=1 on the H100 the row after 80 tokens
is a flat distribution, where the same build's prefill (n_batch=512), llama.cpp on the CPU and the
fp64 reference put 0.5 on token 468. Here each setting a user (or ggml) can flip is flipped alone, in
a fresh process (ggml reads its GGML_CUDA_* variables once): fusion off, CUDA graphs off, flash
attention on / off, the KV cache in f32, K/Q/V on the CPU, and fewer layers on the GPU. Each line gives
row 79's top ids and how many of the 80 rows part from the same build's n_batch=512 prefill by a KL
over 0.1 (the prefill is the healthy side here).

Usage (device; LLAMA_CPP_LIB_PATH at the CUDA build): python row79_bisect.py MODEL TOKENS.json
"""

import json
import os
import subprocess
import sys

CONFIGS = [  # (label, environment, Llama keyword arguments)
    ("prefill n_batch=512 (the healthy side)", {}, {"n_batch": 512}),
    ("n_batch=1", {}, {"n_batch": 1}),
    ("n_batch=1 GGML_CUDA_DISABLE_FUSION=1", {"GGML_CUDA_DISABLE_FUSION": "1"}, {"n_batch": 1}),
    ("n_batch=1 GGML_CUDA_DISABLE_GRAPHS=1", {"GGML_CUDA_DISABLE_GRAPHS": "1"}, {"n_batch": 1}),
    ("n_batch=1 fusion and graphs off", {"GGML_CUDA_DISABLE_FUSION": "1", "GGML_CUDA_DISABLE_GRAPHS": "1"},
     {"n_batch": 1}),
    ("n_batch=1 flash_attn=True", {}, {"n_batch": 1, "flash_attn": True}),
    ("n_batch=1 flash_attn=False", {}, {"n_batch": 1, "flash_attn": False}),
    ("n_batch=1 offload_kqv=False", {}, {"n_batch": 1, "offload_kqv": False}),
    ("n_batch=1 n_gpu_layers=0", {}, {"n_batch": 1, "n_gpu_layers": 0}),
    ("n_batch=1 n_gpu_layers=1", {}, {"n_batch": 1, "n_gpu_layers": 1}),
    ("n_batch=1 n_gpu_layers=2", {}, {"n_batch": 1, "n_gpu_layers": 2}),
    ("n_batch=1 n_gpu_layers=3", {}, {"n_batch": 1, "n_gpu_layers": 3}),
    ("n_batch=2", {}, {"n_batch": 2}),
]


def child(model: str, tokens_path: str, kwargs: dict, out: str) -> None:
    import llama_cpp  # first: a CUDA libllama after numpy dies at load (engines/isolated.py)
    import numpy as np

    toks = json.load(open(tokens_path))
    args = {"n_gpu_layers": 99, "n_ctx": 512, "logits_all": True, "verbose": False, **kwargs}
    args.setdefault("n_ubatch", args["n_batch"])
    llm = llama_cpp.Llama(model, **args)
    llm.eval(toks)
    np.save(out, np.array(llm.scores[: len(toks)], dtype=np.float64))


def log_softmax(x):
    import numpy as np
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def main() -> None:
    import numpy as np

    model, tokens_path = sys.argv[1:3]
    healthy = None
    for i, (label, env, kwargs) in enumerate(CONFIGS):
        out = f"/tmp/row79_{i}.npy"
        rc = subprocess.run([sys.executable, __file__, "--child", model, tokens_path, json.dumps(kwargs), out],
                            env={**os.environ, **env}, timeout=120).returncode
        if rc != 0:
            print(f"{label}: exit {rc}", flush=True)
            continue
        lp = log_softmax(np.load(out))
        if healthy is None:
            healthy = lp
        p = np.exp(healthy)
        kl = (p * (healthy - lp)).sum(axis=-1)
        bad = [int(r) for r in np.nonzero(kl > 0.1)[0]]
        top = np.argsort(-lp[79])[:4]
        print(f"{label}: row 79 top {[(int(t), round(float(lp[79, t]), 3)) for t in top]}; "
              f"KL vs prefill row 79 {kl[79]:.3g}, max {kl.max():.3g}; rows over 0.1: {bad}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5])
    else:
        main()
