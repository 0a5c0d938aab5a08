"""A synthetic glm-dsa GGUF with GLM-5's real layer dimensions (random weights), built fast.

usage: python build_glm5.py OUT.gguf [--check-small]

Dimensions come from ggufcheck.arch.known.glm5_metadata(); reduced (and stated): 2 trunk
layers (layer 0 dense, layer 1 MoE; GLM-5 has 3 dense + 75 MoE), no NextN layer, 16 routed
experts instead of 256 (8 used, as GLM-5), vocabulary 900 instead of 154880 (the builder's
byte-level vocab has at most 959 tokens). Every 2-D tensor Q8_0 (where rows allow), 1-D F32.

Same bytes as ggufcheck.synthetic.tiny.build_tiny_gguf(dims, qtypes="Q8_0") (same per-tensor
seeds and code), but the tensors are generated and quantized on a thread pool: numpy's
generators and array kernels release the GIL. ``--check-small`` builds a small config both
ways and compares the bytes.
"""

from __future__ import annotations

import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ggufcheck.arch.known import glm5_metadata
from ggufcheck.synthetic import qblocks, tiny


def glm5_dims(**overrides) -> tiny.TinyDims:
    m = glm5_metadata()
    p = "glm-dsa."
    d = dict(
        n_layer=2, n_embd=m[p + "embedding_length"], n_head=m[p + "attention.head_count"], n_head_kv=1,
        n_ff=m[p + "feed_forward_length"], n_vocab=900, rope_base=m[p + "rope.freq_base"],
        rms_eps=m[p + "attention.layer_norm_rms_epsilon"], context_length=m[p + "context_length"],
        n_expert=16, n_expert_used=m[p + "expert_used_count"], n_expert_shared=m[p + "expert_shared_count"],
        n_ff_exp=m[p + "expert_feed_forward_length"], n_dense_lead=1,
        n_group=m[p + "expert_group_count"], n_group_used=m[p + "expert_group_used_count"],
        expert_weights_scale=m[p + "expert_weights_scale"], expert_weights_norm=m[p + "expert_weights_norm"],
        gating_func=None,  # as GLM-5's converter: no key (llama.cpp default sigmoid)
        q_lora_rank=m[p + "attention.q_lora_rank"], kv_lora_rank=m[p + "attention.kv_lora_rank"],
        qk_nope=m[p + "attention.key_length_mla"] - m[p + "rope.dimension_count"],
        qk_rope=m[p + "rope.dimension_count"], v_head_dim=m[p + "attention.value_length_mla"],
        indexer_heads=m[p + "attention.indexer.head_count"], indexer_dim=m[p + "attention.indexer.key_length"],
        indexer_top_k=m[p + "attention.indexer.top_k"],
    )
    d.update(overrides)
    return tiny.tiny_dims("glm-dsa", **d)


def _one(name: str, shape: tuple[int, ...], qt, seed: int):
    """tiny.random_tensor for one tensor, then encode it."""
    x = tiny.random_tensor(name, shape, seed)
    arr = tiny.encode(x, qt, np.random.default_rng([seed, zlib.crc32(name.encode()), 1]))
    return name, arr


def build_fast(d: tiny.TinyDims, path: str, qtypes="Q8_0", seed: int = 0, workers: int = 16) -> dict:
    assert d.kv_b == "split"
    shapes = tiny.tensor_shapes(d)
    chosen, fallbacks = tiny.resolve_qtypes(shapes, qtypes)
    for qt in set(chosen.values()):
        assert qt in qblocks.FLOAT_TYPES or not tiny._needs_random(qt), qt
    kv = tiny.metadata(d, tiny._file_type(chosen)) | tiny.tokenizer_metadata(d.n_vocab)
    t0 = time.perf_counter()
    order = sorted(shapes, key=lambda n: -int(np.prod(shapes[n])))  # biggest first
    with ThreadPoolExecutor(workers) as pool:
        done = dict(pool.map(lambda n: _one(n, shapes[n], chosen[n], seed), order))
    t1 = time.perf_counter()
    data = {n: (done[n], chosen[n]) for n in shapes}
    tiny._write(tiny.Path(path), d.arch, kv, data, {n: tuple(s) for n, s in shapes.items()}, list(shapes))
    t2 = time.perf_counter()
    n_el = sum(int(np.prod(s)) for s in shapes.values())
    return {"path": path, "elements": n_el, "tensors": len(shapes), "generate_quantize_s": t1 - t0,
            "write_s": t2 - t1, "fallbacks": fallbacks, "qtypes": sorted({q.name for q in chosen.values()})}


if __name__ == "__main__":
    import json
    import os

    out = sys.argv[1]
    if "--check-small" in sys.argv:
        small = glm5_dims(n_embd=256, n_head=4, q_lora_rank=128, n_ff=512, n_ff_exp=64, n_expert=4,
                          n_expert_used=2, indexer_heads=2, indexer_top_k=8)
        build_fast(small, out + ".fast.gguf")
        tiny.build_tiny_gguf(small, out + ".ref.gguf", qtypes="Q8_0")
        same = open(out + ".fast.gguf", "rb").read() == open(out + ".ref.gguf", "rb").read()
        print("fast build == build_tiny_gguf bytes:", same)
        sys.exit(0 if same else 1)
    d = glm5_dims() if "--small" not in sys.argv else glm5_dims(n_embd=512, n_head=4, q_lora_rank=256, n_ff=1024, n_ff_exp=256, n_expert=4, n_expert_used=2, indexer_heads=2, indexer_top_k=24)
    info = build_fast(d, out, workers=int(os.environ.get("BUILD_WORKERS", "16")))
    info["bytes"] = os.path.getsize(out)
    info["dims"] = {k: v for k, v in d.__dict__.items()}
    print(json.dumps(info, default=str))
