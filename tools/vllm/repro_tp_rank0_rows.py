"""Minimal reproducer, independent of ggufcheck: at tensor parallelism >= 2, vllm-gguf-plugin
0.0.5 on vLLM 0.32 gives EVERY rank rank 0's rows of quantized merged column-parallel layers
(qkv_proj, gate_up_proj). vLLM's QKVParallelLinear / MergedColumnParallelLinear.weight_loader_v2
call ``param.load_qkv_weight`` / ``load_merged_column_weight`` without a ``tp_rank`` keyword
(vLLM's own parameters carry their rank), and the plug-in's GGUF parameter reads
``kwargs.get("tp_rank", 0)``.

    python repro_tp_rank0_rows.py MODEL.gguf CONFIG_DIR

MODEL.gguf: a quantized GGUF (e.g. Q4_0) whose attention and KV head counts divide by 2.
Prints, for each rank, whether its qkv_proj bytes equal the file's rank-0 or rank-1 half of
attn_q/attn_k/attn_v (cut from the file by gguf-py).
"""
import os
import sys

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def held_qkv(worker):
    model = worker.model_runner.get_model()
    return worker.rank, model.model.layers[0].self_attn.qkv_proj.qweight.detach().cpu().numpy().copy()


def main():
    import gguf
    import numpy as np
    from vllm import LLM

    path, cfg = sys.argv[1], sys.argv[2]
    llm = LLM(model=path, tokenizer=cfg, hf_config_path=cfg, dtype="float32", enforce_eager=True,
              max_model_len=256, tensor_parallel_size=2, distributed_executor_backend="mp")
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}

    def half(rank):
        parts = [raw[f"blk.0.attn_{x}.weight"] for x in "qkv"]
        return np.concatenate([p[rank * (p.shape[0] // 2):(rank + 1) * (p.shape[0] // 2)] for p in parts])

    for rank, held in sorted(llm.collective_rpc(held_qkv), key=lambda x: x[0]):
        print(f"rank {rank}: layer 0 qkv_proj bytes == file's rank-0 half: {np.array_equal(held, half(0))}; "
              f"== file's rank-1 half: {np.array_equal(held, half(1))}")


if __name__ == "__main__":
    main()
    os._exit(0)
