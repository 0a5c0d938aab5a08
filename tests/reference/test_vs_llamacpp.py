"""The reference against llama.cpp (llama-cpp-python) on the same GGUF files.

- Real SmolLM2-135M Q4_1, 300 teacher-forced positions. llama.cpp quantizes activations
  to Q8_1 for Q4_1 dot products, so agreement is statistical (measured on this machine:
  argmax 95%, mean KL 4e-3). The same model with its weights dequantized to F32 removes
  that step: then the two agree to ~1e-5 (measured max |d log p| 5.7e-5, KL 7e-12).
- Every tiny converted file (llama, llama-3 rope_freqs, qwen2/3, glm4moe, deepseek2 plain and
  YaRN, glm-dsa), F32 KV cache: max |d log p| ~2e-7 over 40 positions.
  glm-dsa past top_k: positions agree except where the indexer's top-k boundary is an
  exact tie (ReLU zeros), which each implementation breaks its own way; the reference
  flags those (``topk_ties``) and every disagreement must be at a flagged position.
- gemma3 (6 layers, sliding window 8, 40 tokens): layer by layer on llama.cpp's own inputs,
  attention agrees to ~2e-7; the FFN differs by ~3e-4 because ggml's CPU GELU is a table
  over f16 inputs with f16 values, and with that rounding emulated (``gelu="f16"``) by
  ~1e-7..3e-6 (the rest: tanhf vs tanh at f16 rounding boundaries).
"""

import pytest
import torch

from ggufcheck.reference import ReferenceModel

TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "as his father had taught him. Two hundred and twelve, always two hundred and twelve, "
    "though on stormy nights he would swear the tower had grown. At the top he trimmed the "
    "wick, polished the great lens until it shone like a second moon, and wrote in the log: "
    "wind from the north-east, sea rising, one ship seen at dusk heading for the harbour. "
    "Nobody had read the log in thirty years. The shipping company that owned the light had "
    "been sold, and sold again, and the new owners sent a letter each spring asking whether "
    "the light was still necessary, now that every vessel carried satellite navigation. He "
    "always answered the same way: that machines fail, that storms do not care about "
    "satellites, and that a light which has burned for a hundred and forty years should not "
    "be put out by a man in an office who has never seen the sea at night. The letters kept "
    "coming, and he kept answering them, and the light kept turning, sweeping its long white "
    "arm across the water, once every ten seconds, as it always had. One winter a trawler "
    "lost its engine off the point, and the crew, drifting toward the rocks in the dark, "
    "found their way into the bay by the beam alone."
)


def _kl(p_log, q_log):
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def _tokens(path, n):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    tokens = llm.tokenize((TEXT + "\n\n" + TEXT).encode(), add_bos=True)[:n]  # the repeat: easy positions too
    llm.close()
    return tokens


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    """(tokens, reference log-probs [300, vocab]) for SmolLM2, computed once: the F32 copy
    holds the same dequantized values, so the reference's answer is the same for both."""
    tokens = _tokens(smollm2, 300)
    with ReferenceModel(smollm2, dtype="fp32") as ref:
        return tokens, ref.prefill(tokens, trace=False).double().log_softmax(-1)


@pytest.mark.slow
def test_smollm2_q4_1_statistical_agreement(smollm2, smollm2_reference, llama_cpp_run):
    tokens, ours = smollm2_reference
    assert len(tokens) == 300
    theirs = llama_cpp_run(smollm2, tokens, f32_cache=False)  # llama.cpp defaults
    agree = (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()
    kl = _kl(ours, theirs)
    print(f"SmolLM2 Q4_1 vs llama.cpp over {len(tokens)} positions: argmax agreement {agree:.3f}, "
          f"KL mean {kl.mean():.2e} max {kl.max():.2e}")
    assert agree >= 0.90
    assert kl.mean() < 0.02 and kl.max() < 0.2


@pytest.mark.slow
def test_smollm2_dequantized_f32_agrees_tightly(smollm2, smollm2_f32, smollm2_reference, llama_cpp_run):
    tokens, ours = smollm2_reference
    with ReferenceModel(smollm2, dtype="fp32") as q, ReferenceModel(smollm2_f32, dtype="fp32") as f:
        for name in ("token_embd.weight", "blk.7.attn_q.weight", "blk.29.ffn_down.weight"):
            assert torch.equal(q.weights.tensor(name), f.weights.tensor(name))  # the same values
    theirs = llama_cpp_run(smollm2_f32, tokens)
    diff, kl = (ours - theirs).abs().max(), _kl(ours, theirs)
    print(f"SmolLM2 dequantized to F32 vs llama.cpp: max |d log p| {diff:.2e}, KL mean {kl.mean():.2e}")
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert diff < 1e-3 and kl.mean() < 1e-8


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "phi3", "qwen3moe", "gpt-oss", "glm4moe", "deepseek2", "deepseek2-yarn",
                                  "glm-dsa"])
def test_tiny_models_agree(arch, tiny, llama_cpp_run, prompt):
    path = tiny(arch).gguf_path
    tokens = prompt(7 if arch == "glm-dsa" else 40)  # glm-dsa: shorter than top_k (8), DSA == dense
    with ReferenceModel(path, dtype="fp64") as ref:
        ours = ref.prefill(tokens).logprobs
    assert (ours - llama_cpp_run(path, tokens)).abs().max() < 1e-5


@pytest.mark.parametrize("arch", ["glm-dsa", "glm-dsa-shared"])
def test_glm_dsa_past_top_k_first_disagreement_is_an_indexer_tie(arch, tiny, llama_cpp_run, prompt):
    """Past top_k the two agree up to the first position whose top-k boundary is an exact
    tie; from there a different (equally valid) choice propagates: later tokens attend to
    that token's changed keys and values in later layers."""
    path = tiny(arch).gguf_path
    tokens = prompt(40)
    with ReferenceModel(path, dtype="fp64") as ref:
        trace = ref.prefill(tokens)
        top_k = ref.cfg.indexer_top_k
    diff = (trace.logprobs - llama_cpp_run(path, tokens)).abs().max(-1).values  # [T]
    tied = torch.zeros(len(tokens), dtype=torch.bool)
    for layer in trace.layers:
        if layer.topk_full:
            tied |= layer.topk_ties
    bad = (diff >= 1e-5).nonzero().flatten().tolist()
    ties = tied.nonzero().flatten().tolist()
    print(f"{arch}: first tie at {ties[:1]}, first disagreement at {bad[:1]}, "
          f"{len(bad)} of {len(tokens)} positions disagree (max {diff.max():.2e})")
    first_tie = ties[0] if ties else len(tokens)
    assert first_tie > top_k  # the prompt really exercises the sparse mask before any tie
    assert (diff[:first_tie] < 1e-5).all()
    if bad:
        assert bad[0] in ties, f"first disagreement at {bad[0]} is not at an indexer tie ({ties})"


def test_gemma3_layers_agree_once_ggml_gelu_table_is_emulated(tiny, prompt):
    """gemma3 through llama.cpp (F32 weights and KV cache): each layer replayed on llama.cpp's
    own input. Attention (sliding-window layers 0-4, global layer 5) agrees to fp32 rounding;
    the FFN's difference is ggml's f16 GELU table, and goes once the reference rounds there."""
    import numpy as np

    from ggufcheck.checks.layers.replay import Replayer
    from ggufcheck.engines.llama_cpp import LlamaCppEngine
    from ggufcheck.reference.precision import Emulation, emulating

    path = tiny("gemma3").gguf_path
    tokens = prompt(40)
    engine = LlamaCppEngine(path, n_ctx=128, type_k=0, type_v=0)
    assert engine.capabilities.rounding == {"gelu": "f16"}
    trace = engine.layer_outputs(tokens)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    plain, emulated = Emulation(), Emulation(gelu="f16")
    with ReferenceModel(path, dtype="fp64") as ref:
        assert ref.cfg.swa_window == 8 and ref.cfg.swa_layers == (True,) * 5 + (False,)
        embeddings = ref.prefill(tokens).embeddings
        for i in range(ref.cfg.n_layer):
            h_in = embeddings if i == 0 else torch.as_tensor(np.asarray(trace.tensors[("residual", i - 1)])).double()
            attn = torch.as_tensor(np.asarray(trace.tensors[("attention", i)])).double()
            ffn = torch.as_tensor(np.asarray(trace.tensors[("ffn", i)])).double()
            replay = Replayer(ref, i)
            assert rel(attn, replay.attention(h_in, None).attn_out) < 1e-6, f"layer {i} attention"
            with emulating(plain):
                off = rel(ffn, replay.ffn(h_in + attn)[0])
            with emulating(emulated):
                on = rel(ffn, replay.ffn(h_in + attn)[0])
            assert off > 1e-4 and on < 1e-5 and on < off / 30, f"layer {i} ffn: {off:.2e} plain, {on:.2e} emulated"
