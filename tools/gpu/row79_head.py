"""Row 79 (docs/evidence/cuda_ds2_q4k_row79.txt): the output layer or what feeds it?

row79_bisect.py (H100, 2026-12-07): one token per batch with every layer on the GPU gives a flat row
79; with the 3 repeating layers on the GPU but the output layer on the CPU (n_gpu_layers=3) the row is
right. So the output layer is where it goes wrong, or what it is handed. Here the same one-token run
(n_gpu_layers=99 and 3) also returns llama.cpp's embeddings output (``result_norm``: the last hidden
state after output_norm, the head's input) for every row: if row 79's normed state is the same in both
runs, the head's matmul (Q4_K, 512 x 256, the one-token kernel) is what is wrong; if not, the norm or the
hand-over is.

Usage (device; LLAMA_CPP_LIB_PATH at the CUDA build): python row79_head.py MODEL TOKENS.json
"""

import json
import subprocess
import sys


def child(model: str, tokens_path: str, ngl: int, out: str) -> None:
    import llama_cpp  # first: a CUDA libllama after numpy dies at load (engines/isolated.py)
    import numpy as np

    toks = json.load(open(tokens_path))[:80]
    emb = []
    for embedding in (False, True):
        llm = llama_cpp.Llama(model, n_gpu_layers=ngl, n_ctx=512, n_batch=1, n_ubatch=1, logits_all=not embedding,
                              embedding=embedding, pooling_type=0 if embedding else -1, verbose=False)
        if embedding:  # one token per eval: the context holds the last batch's outputs only
            ctx = llm._ctx.ctx
            n = llama_cpp.llama_model_n_embd(llm._model.model)
            rows = []
            for t in toks:
                llm.eval([t])
                ptr = llama_cpp.llama_get_embeddings_ith(ctx, -1)
                rows.append(np.ctypeslib.as_array(ptr, shape=(n,)).copy())
            emb = np.array(rows, dtype=np.float64)
        else:
            llm.eval(toks)
            logits = np.array(llm.scores[: len(toks)], dtype=np.float64)
    np.savez(out, logits=logits, emb=emb)


def main() -> None:
    import numpy as np

    model, tokens_path = sys.argv[1:3]
    got = {}
    for ngl in (99, 3):
        out = f"/tmp/row79_head_{ngl}.npz"
        rc = subprocess.run([sys.executable, __file__, "--child", model, tokens_path, str(ngl), out], timeout=120).returncode
        if rc != 0:
            print(f"n_gpu_layers={ngl}: exit {rc}", flush=True)
            return
        got[ngl] = np.load(out)
    a, b = got[99], got[3]
    for r in (78, 79):
        de = float(np.abs(a["emb"][r] - b["emb"][r]).max())
        la, lb = a["logits"][r], b["logits"][r]
        print(f"row {r}: normed state max |diff| (ngl 99 vs 3) {de:.3g} (|x| max {np.abs(b['emb'][r]).max():.3g}); "
              f"logits argmax {int(la.argmax())} vs {int(lb.argmax())}, max |diff| {np.abs(la - lb).max():.3g}; "
              f"ngl 99 logits finite {bool(np.isfinite(la).all())}, range {la.min():.3g}..{la.max():.3g}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main()
