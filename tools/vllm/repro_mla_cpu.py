"""Reproducer, independent of ggufcheck's checks: vLLM-CPU's MLA (CPU_MLA decode backend,
CPU_SDPA_MLA prefill) against transformers' DeepseekV3 on the same HF checkpoint.

    python repro_mla_cpu.py CHECKPOINT_DIR [float32|bfloat16] [native-rope]

CHECKPOINT_DIR: a DeepseekV3 checkpoint whose kv_lora_rank + qk_rope_head_dim is 576 (the only
latent size vLLM-CPU's MLA compiles), e.g. `ggufcheck export tiny-deepseek2.gguf DIR`.
Prints vLLM's prompt log-probs (prefill path) and its decode-step log-probs for greedy tokens,
each against transformers (float64, eager experts) on the same token ids. With
``native-rope``, vLLM's rotary embeddings run its own torch path (forward_native) instead of
the CPU op (the cause: tools/vllm/repro_rope_cpu_3d.py); everything else stays vLLM's.
"""
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main():
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path = sys.argv[1]
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    if "native-rope" in sys.argv[3:]:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_native
    ids = list(range(300, 340))
    llm = LLM(model=path, dtype=dtype, enforce_eager=True, max_model_len=256, enable_prefix_caching=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                       SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0, logprobs=0, ignore_eos=True),
                       use_tqdm=False)[0]
    prefill = np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    gen = list(out.outputs[0].token_ids)
    decode = np.array([d[t].logprob for d, t in zip(out.outputs[0].logprobs, gen)])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    seq = ids + gen
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1).numpy()
    ref = lp[np.arange(len(seq) - 1), seq[1:]]
    p, d = ref[:len(ids) - 1], ref[len(ids) - 1:]
    dtype = dtype + (" (rope: forward_native)" if "native-rope" in sys.argv[3:] else "")
    print(f"vLLM {dtype}: prefill  max |vLLM - transformers| per-token logprob {np.abs(prefill - p).max():.4f}")
    print(f"vLLM {dtype}: decode   max |vLLM - transformers| per-token logprob {np.abs(decode - d).max():.4f}")
    hf_greedy = []
    cur = list(ids)
    with torch.no_grad():
        for _ in range(len(gen)):
            nxt = int(hf(torch.tensor([cur])).logits[0, -1].argmax())
            hf_greedy.append(nxt)
            cur.append(nxt)
    print(f"greedy tokens: vLLM {gen}, transformers {hf_greedy}")


if __name__ == "__main__":
    main()
    os._exit(0)
