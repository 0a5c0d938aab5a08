"""Minimal reproducer, independent of ggufcheck: vLLM + vllm-gguf-plugin serve llama GGUF files
with q/k rows in llama.cpp's rope-permuted order while vLLM's llama applies NEOX rope.

Run in vLLM's interpreter (on CPU after tools/vllm/setup.sh, whose compat plug-in makes the
GGUF plug-in runnable there):

    python repro_llama_qk_order.py MODEL.gguf CONFIG_DIR

MODEL.gguf: any llama-architecture GGUF (e.g. SmolLM2-135M-Instruct.Q4_1.gguf);
CONFIG_DIR: config.json + tokenizer, e.g. from AutoConfig/AutoTokenizer.from_pretrained(
dir, gguf_file=name).save_pretrained(CONFIG_DIR).

It compares vLLM's prompt log-probabilities with transformers' own GGUF loader (which undoes
the converter's permutation) on the same tokens, then undoes the permutation inside the live
vLLM engine (collective_rpc) and compares again.
"""
import os
import sys

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def unpermute_qk(worker, n_head, n_kv, head_dim):
    import numpy as np
    import torch

    model = worker.model_runner.get_model()
    for layer in model.model.layers:
        p = layer.self_attn.qkv_proj
        w = p.qweight if hasattr(p, "qweight") else p.weight
        offsets = getattr(w, "shard_offset_map", None) or {
            "q": (0, n_head * head_dim), "k": (n_head * head_dim, (n_head + n_kv) * head_dim)}
        for shard, heads in (("q", n_head), ("k", n_kv)):
            a, b = offsets[shard][:2]
            order = np.arange(heads * head_dim).reshape(heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)
            with torch.inference_mode():
                w.data[a:b] = w.data[a:b][torch.from_numpy(order)].clone()
    try:
        import vllm_gguf_plugin.ops as gops
        getattr(gops, "_ggufcheck_cache", {}).clear()
    except ImportError:
        pass


def main():
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path, cfg = sys.argv[1], sys.argv[2]
    llm = LLM(model=path, tokenizer=cfg, hf_config_path=cfg, dtype="float32", enforce_eager=True,
              max_model_len=256, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def vllm_logprobs():
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    folder, name = os.path.split(os.path.abspath(path))
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    ref = lp[np.arange(len(ids) - 1), ids[1:]]  # log p(token t+1 | prefix)

    got = vllm_logprobs()
    print(f"as loaded:           max |vLLM - transformers| per-token logprob {np.abs(got - ref).max():.4f}, "
          f"mean {np.abs(got - ref).mean():.4f}")
    c = hf.config
    llm.collective_rpc(unpermute_qk, args=(c.num_attention_heads, c.num_key_value_heads,
                                           getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads))
    got = vllm_logprobs()
    print(f"q/k rows un-permuted: max |vLLM - transformers| per-token logprob {np.abs(got - ref).max():.2e}, "
          f"mean {np.abs(got - ref).mean():.2e}")


if __name__ == "__main__":
    main()
    os._exit(0)
