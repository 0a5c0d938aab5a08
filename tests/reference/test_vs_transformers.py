"""The reference against transformers' own modeling code, on tiny random models that
llama.cpp's converter turned into F32 GGUFs: two independent implementations (and the
converter in between) must agree to ~1e-9 relative in fp64, layer by layer.

Prompts are 20 tokens: far from position 0 (where every rope pairing is the identity) and
longer than the glm-dsa indexer's top_k (8; 6 for glm-dsa-shared), so the sparse mask
matters, including exact ties of indexer scores (transformers runs with a lowest-index-first
``topk``, the reference's rule; see conftest.everything_fp64). For glm-dsa the MLA q_a / kv_a norms use transformers' hard-coded eps 1e-6 instead
of the file's eps (the reference's default, which llama.cpp also uses; see
docs/reference-verification.md).
"""

import pytest
import torch

from ggufcheck.reference import ReferenceModel
from ggufcheck.reference.layers import rms_norm



def rel_err(a, b):
    a, b = a.to(torch.float64), b.to(torch.float64)
    return float((a - b).norm() / b.norm())


TOL = 1e-9  # relative, fp64; measured ~1e-13..1e-10 (llama3: the file's fp32 rope_freqs)

CASES = {  # arch -> reference options that state transformers' conventions
    "llama": {},
    "llama3": {},
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    "gemma3": {},
    "qwen3moe": {},
    "gpt-oss": {},
    "glm4moe": {},
    "deepseek2": {},
    "deepseek2-yarn": {},
    "glm-dsa": {"lora_norm_eps": 1e-6},
    "glm-dsa-shared": {"lora_norm_eps": 1e-6},
}


@pytest.mark.parametrize("arch", list(CASES))
def test_hidden_states_and_logits_match_transformers(arch, tiny, hf_run, prompt):
    model = tiny(arch)
    tokens = prompt(20)
    hf = hf_run(model.hf_dir, tokens)
    with ReferenceModel(model.gguf_path, dtype="fp64", **CASES[arch]) as ref:
        trace = ref.prefill(tokens)
        final = rms_norm(trace.layers[-1].hidden, ref.weights.global_tensor("output_norm.weight"), ref.cfg.rms_eps)
    n = len(trace.layers)
    assert len(hf.hidden) == n + 1
    assert rel_err(trace.embeddings, hf.hidden[0]) < TOL
    for i in range(n - 1):  # transformers' last hidden state is after the final norm
        assert rel_err(trace.layers[i].hidden, hf.hidden[i + 1]) < TOL, f"layer {i}"
    assert rel_err(final, hf.hidden[n]) < TOL
    assert (trace.logprobs - hf.logprobs).abs().max() < 1e-8


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "glm4moe", "deepseek2", "glm-dsa-shared"])
def test_router_choices_match_transformers(arch, tiny, hf_run, prompt):
    model = tiny(arch)
    tokens = prompt(20)
    hf = hf_run(model.hf_dir, tokens)
    with ReferenceModel(model.gguf_path, dtype="fp64", **CASES[arch]) as ref:
        trace = ref.prefill(tokens)
    assert hf.routers, "no router outputs captured from transformers"
    for i, (ids, weights) in hf.routers.items():
        ours_ids, ours_w = trace.layers[i].expert_ids, trace.layers[i].expert_weights
        order_hf, order_ours = ids.sort(-1).indices, ours_ids.sort(-1).indices
        assert torch.equal(ids.gather(1, order_hf), ours_ids.gather(1, order_ours)), f"layer {i} experts"
        assert rel_err(ours_w.gather(1, order_ours), weights.gather(1, order_hf)) < TOL


@pytest.mark.parametrize("arch", ["glm-dsa", "glm-dsa-shared"])
def test_indexer_top_k_matches_transformers(arch, tiny, hf_run, prompt):
    model = tiny(arch)
    tokens = prompt(20)
    hf = hf_run(model.hf_dir, tokens)
    with ReferenceModel(model.gguf_path, dtype="fp64", **CASES[arch]) as ref:
        trace, top_k = ref.prefill(tokens), ref.cfg.indexer_top_k
    full_layers = [i for i, layer in enumerate(trace.layers) if layer.topk_full]
    assert sorted(hf.indexers) == full_layers  # transformers runs indexers on the same layers
    for i in full_layers:
        for t in range(top_k, len(tokens)):  # rows that see more than top_k keys, ties included
            assert set(hf.indexers[i][t].tolist()) == set(trace.layers[i].topk[t].tolist()), (i, t)
    # the prompt exercises exact ties too (both sides break them by the lower key index) where
    # the indexer has 4 heads (glm-dsa-shared); the 16-head glm-dsa has none (synthetic.tiny)
    if arch == "glm-dsa-shared":
        assert any(bool(trace.layers[i].topk_ties.any()) for i in full_layers)
    shared = [i for i, layer in enumerate(trace.layers) if not layer.topk_full]
    for i in shared:
        assert torch.equal(trace.layers[i].topk, trace.layers[trace_full_before(trace, i)].topk)


def trace_full_before(trace, i):
    return max(j for j in range(i) if trace.layers[j].topk_full)
