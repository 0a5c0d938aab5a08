"""The verdict vocabulary: the fixed set of components a diagnosis can name.

Every Result carries one of these as its ``component``. The order here is the dependency
order of the stack (environment first, served output last), which is also the order in
which a diagnosis blames: the first failing component wins. Each entry says what the
component is and what to look at next when it is named.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    name: str
    what: str
    next_steps: str


COMPONENTS: tuple[Component, ...] = (
    Component("environment", "Python, torch, CUDA, driver and engine packages of the target interpreter",
              "check the package versions and the GPU architecture the compiled extensions were built for"),
    Component("kernel", "an attention, dequantization, norm, rope or routing kernel on the target GPU",
              "run `ggufcheck kernels` with --model to reproduce at the model's real shapes and dtype"),
    Component("gguf-file", "the GGUF container: header, tensor table, data regions, split parts",
              "re-download or re-convert the file; compare its size and hash with the source"),
    Component("metadata", "architecture hyper-parameters read from the GGUF metadata",
              "compare the named key with the original config.json; re-convert with a current converter"),
    Component("chat-template", "the chat template, BOS / EOS / end-of-turn tokens, and how the engine renders a chat",
              "render tokenizer.chat_template and tokenize it as the engine does; compare the tokens with the "
              "original model's apply_chat_template"),
    Component("mapping", "which GGUF tensor becomes which model parameter, and its shape",
              "check the loader's name map for the named tensor; look for silently skipped tensors"),
    Component("dequant", "quantized bytes -> values (block scales, the dequantization kernel)",
              "dequantize the named tensor with gguf-py and with the engine's kernel and diff them"),
    Component("weights", "the parameters the engine actually holds after loading",
              "diff the named parameter on the named rank against its expected slice of the GGUF tensor"),
    Component("sharding", "tensor-parallel split of weights and the collectives joining them",
              "run `ggufcheck shard --tp N`; compare TP=1 with TP=N on the named layer"),
    Component("embedding", "token embedding lookup (and vocab-parallel padding)",
              "compare the embedding rows for the prompt's tokens; check vocab padding rows are zero"),
    Component("attention", "the attention block: q/k/v projections, scores, softmax, output projection",
              "replay the reference attention on the engine's layer input; check scale and masking"),
    Component("mla-kv-b", "MLA's kv_b_proj rebuilt from attn_k_b / attn_v_b and its per-head K/V split",
              "check W_UK / W_UV per head (and per TP rank) against attn_k_b / attn_v_b"),
    Component("rope", "rotary position embedding: pairing (NORM/NEOX), base, partial dims, YaRN",
              "compare positions far from 0; check the pairing and the q/k permutation"),
    Component("norm", "RMSNorm / LayerNorm weights and epsilon",
              "check the eps key and the norm weight of the named layer"),
    Component("indexer", "the DeepSeek Sparse Attention indexer (top-k key selection)",
              "compare top-k sets with the reference on prompts longer than top_k; check indexer rope pairing"),
    Component("moe-router", "the MoE router: scores, selection bias, groups, top-k, weight normalisation and scale",
              "compare selected expert sets and weights with the reference on the named layer"),
    Component("moe-experts", "the routed and shared expert FFNs (expert order, stacking)",
              "run each selected expert on its own against the reference; check expert order"),
    Component("ffn", "the dense SwiGLU feed-forward block",
              "replay the reference FFN on the engine's layer input"),
    Component("lm-head", "the final norm and output projection (tied or not)",
              "compare final hidden state and logits; check tied embeddings"),
    Component("mtp", "the NextN / MTP draft head of speculative decoding: eh_proj, enorm / hnorm, its decoder block, "
                     "its shared head, and the trunk state the engine feeds it",
              "run the engine's draft head on its own trunk states next to the reference's head (the mtp stage's "
              "rows); check the NextN tensors' loading and which state is fed (post output_norm, the row before)"),
    Component("api", "how the server reports log-probs: row alignment of echoed prompt entries, raw vs "
                     "processed values, top-k renormalisation",
              "request the prompt log-probs of a short known text and check which position each entry scores"),
    Component("prefill", "the prompt-processing path (chunked prefill, batching of the prompt)",
              "compare logprobs under different chunk sizes and prompt lengths"),
    Component("decode", "the token-by-token generation path",
              "compare step-by-step decode logprobs with teacher-forced prefill logprobs"),
    Component("kv-cache", "the KV cache (layout, dtype, reuse across steps)",
              "A/B the KV-cache dtype; find the step at which decode starts to drift"),
    Component("batching", "batch invariance: a prompt alone vs inside a batch",
              "compare a prompt alone against the same prompt padded into a batch"),
    Component("sampling", "temperature-0 determinism and sampling parameters",
              "repeat the same request at temperature 0; check sampler settings"),
    Component("output", "garbage output with no finer localization",
              "expose per-layer outputs or loaded weights so the diagnosis can localize further"),
)

BY_NAME = {c.name: c for c in COMPONENTS}
ORDER = {c.name: i for i, c in enumerate(COMPONENTS)}

# Where a check knows more than its component, its own next step (by check name).
CHECK_NEXT_STEPS = {
    "logits.alignment": "the server reports prompt log-probs one row off (llama-cpp-python's server 0.3.x does so "
                        "when the prompt does not start with the model's BOS): every later check judged the "
                        "realigned rows; for a run that passes, give prompts that start with the BOS (--prompts "
                        "FILE, one per line, e.g. '<|im_start|>user ...' for SmolLM2), or report the shift upstream",
    "layers.rope": "call the engine's rope op on the worst row's q / k, with the shapes and strides the model "
                   "passes, next to a plain-torch rotation (the engine's own reference path if it has one)",
}


def component(name: str) -> Component:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"{name!r} is not in the verdict vocabulary") from None
