"""Reference forward pass vs transformers: same model, same weights, same dtype, CPU, one run.

Builds random transformers models of a moderate size (a llama and a GLM-5-style glm-dsa:
MLA + DSA indexer + MoE), converts each to an F32 GGUF with llama.cpp's own converter,
then times a prefill of the same prompt with transformers' modeling code (its default
attention; eager experts in fp64, which transformers needs) and with ggufcheck's reference
(weights resident, loaded before timing; the load is reported apart). Both run with the
same torch thread count. Prints seconds per prefill and the ratio reference / transformers
(< 1: the reference is faster). Files go to a temp dir that is deleted at the end.

Usage: python benchmarks/reference.py [--tokens 128] [--repeat 3] [--threads N] [--dtypes fp32,fp64]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

MODELS = {
    # ~60M parameters without the embedding: big enough that matmuls dominate
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)),
    "glm-dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=128,
        q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, index_topk=32,
        index_head_dim=64, index_n_heads=8, max_position_embeddings=2048)),
}


def build(name: str, root: Path) -> tuple[Path, Path]:
    import transformers

    from ggufcheck.testing.convert import convert_to_gguf

    config_name, model_name, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
    hf_dir = root / f"{name}-hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    return hf_dir, convert_to_gguf(hf_dir, root / f"{name}.gguf", "f32")


def best_of_interleaved(fns: list, repeat: int) -> list[float]:
    """Best time of each function, run in turns (A B C A B C ...) so that a change in the
    machine's load hits all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, bucket in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - t0)
    return [min(bucket) for bucket in times]


def bench(name: str, hf_dir: Path, gguf_path: Path, dtype: str, tokens: list[int], repeat: int) -> None:
    import transformers

    from ggufcheck.reference import ReferenceModel

    torch_dtype = torch.float64 if dtype == "fp64" else torch.float32
    kwargs = {"experts_implementation": "eager"} if "glm" in name else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype, **kwargs).eval()
    ids = torch.tensor([tokens])
    t0 = time.perf_counter()
    ref = ReferenceModel(gguf_path, dtype=dtype, streaming=False)
    for i in range(ref.cfg.n_layer):
        ref.weights.layer(i)
    load = time.perf_counter() - t0
    with torch.no_grad():
        hf_logits = hf(ids).logits[0].double()
        ref_logits = ref.prefill(tokens, trace=False).double()
        t_hf, t_ref, t_trace = best_of_interleaved(
            [lambda: hf(ids), lambda: ref.prefill(tokens, trace=False), lambda: ref.prefill(tokens, trace=True)],
            repeat)
    diff = (hf_logits.log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max().item()
    print(f"{name:8s} {dtype}  transformers {t_hf:7.3f} s   reference {t_ref:7.3f} s   "
          f"ratio {t_ref / t_hf:5.2f}   (with trace {t_trace:6.3f} s; weight load {load:5.2f} s; "
          f"max |d log p| {diff:.1e})")
    ref.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtypes", default="fp32,fp64")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tokens = torch.randint(0, 49152, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"prefill of {args.tokens} tokens, best of {args.repeat} (interleaved), {args.threads} torch threads, CPU")
    root = Path(tempfile.mkdtemp(prefix="ggufcheck-bench-ref-"))
    try:
        for name in args.models.split(","):
            hf_dir, gguf_path = build(name, root)
            for dtype in args.dtypes.split(","):
                bench(name, hf_dir, gguf_path, dtype, tokens, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
