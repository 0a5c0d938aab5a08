"""The tiny deepseek2 Q4_K's row 79 on CUDA (docs/gpu-evidence.md section 9): the CUDA
llama-server's one-token step after 80 tokens answered a flat distribution (top -4.54) where
the fp64 reference, llama.cpp on the CPU (one prefill and one token at a time) and the CUDA
in-process prefill all put 0.5 on token 468. Which path, and is it the server or ggml?

Usage (device, the CUDA build's bin in LLAMA_CPP_LIB_PATH): python row79.py MODEL TOKENS.json SERVER_BIN
"""

import json
import math
import subprocess
import sys
import time
import urllib.request

import llama_cpp  # first: a CUDA libllama next to numpy imported before it dies at load (engines/isolated.py)
import numpy as np

model, tokens_path, server_bin = sys.argv[1:4]
toks = json.load(open(tokens_path))
ROWS = (78, 79, 80)


def top(row, k=4):
    lp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
    ids = np.argsort(-lp)[:k]
    return [(int(i), round(float(lp[i]), 3)) for i in ids]


for n_batch in (512, 1, 5, 8, 9, 16):
    llm = llama_cpp.Llama(model, n_gpu_layers=99, n_ctx=512, n_batch=n_batch, n_ubatch=n_batch, logits_all=True,
                          verbose=False)
    llm.eval(toks)
    scores = np.array(llm.scores[: len(toks)], dtype=np.float64)
    print(f"in process, n_batch={n_batch}:", {r: top(scores[r]) for r in ROWS}, flush=True)
    del llm


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def step(port, n, cache=True):
    a = post(port, {"prompt": toks[:n], "n_predict": 1, "n_probs": 4, "temperature": 0.0, "cache_prompt": cache,
                    "samplers": ["top_k"], "top_k": 1, "return_tokens": True})
    probs = a["completion_probabilities"][0]["top_logprobs"]
    return [(e["id"], round(e["logprob"], 3)) for e in probs]


port = 8097
server = subprocess.Popen([server_bin, "-m", model, "-ngl", "99", "--host", "127.0.0.1", "--port", str(port), "-c", "4096",
                           "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    stepwise = {}
    for n in range(1, len(toks) + 1):  # as ggufcheck asks: each prefix after the previous one (prompt cache)
        got = step(port, n)
        if n - 1 in ROWS:
            stepwise[n - 1] = got
    print("server stepwise:", stepwise, flush=True)
    print("server row 79 asked again (whole prompt cached):", step(port, 80), flush=True)
    print("server row 79 cold (cache_prompt false):", step(port, 80, cache=False), flush=True)
    print("server row 79 right after row 77 (one new token... two):", step(port, 78), step(port, 80), flush=True)
    for start in (70, 75, 79):
        step(port, start, cache=False)
        print(f"server row 79 after a cold prefix of {start}:", step(port, 80), flush=True)
finally:
    server.kill()
