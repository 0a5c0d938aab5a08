"""The NextN / MTP draft head (reference/mtp.py) against llama.cpp's MTP context
(engines/llama_cpp_mtp.py), on tiny files from our own writer with one NextN block.

Two independent implementations: the reference runs the block with its own layer code in
fp64 from the file's dequantized weights; llama.cpp runs its ``graph_mtp`` in a context
of type LLAMA_CONTEXT_TYPE_MTP, fed the way its draft-mtp driver feeds it. Measured on
this machine (F32 weights and KV cache, flash attention off): per-row KL <= 1e-12, max
|d log p| ~5e-6, for glm4moe, deepseek2 and glm-dsa; llama.cpp's trunk states and the
reference's agree to ~3e-6. A corrupted NextN tensor in the engine's copy of the file
(eh_proj's halves swapped, enorm doubled) moves every row by KL 0.06..1.4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ggufcheck.reference import KVCache, ReferenceModel
from ggufcheck.reference.mtp import MTPHead, llama_cpp_pairing, mtp_logprobs, trunk_states

ARCHS = ("glm4moe", "deepseek2", "glm-dsa")
NEXTN_LAYER = 3  # the tiny models have 3 trunk layers; the NextN block is blk.3


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def _tokens(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 511, (n,), generator=g).tolist()  # 511: the vocabulary's control token


def _n_tokens(arch: str) -> int:
    return 7 if arch == "glm-dsa" else 24  # glm-dsa: below top_k (8), the trunk's DSA == dense


@pytest.fixture(scope="module")
def nextn_file(tiny_gguf):
    """nextn_file(arch, qtypes="F32") -> path of a tiny model with one NextN block."""
    built: dict = {}

    def get(arch: str, qtypes: str = "F32"):
        if (arch, qtypes) not in built:
            built[arch, qtypes] = tiny_gguf(arch, qtypes=qtypes, n_nextn=1).path
        return built[arch, qtypes]

    return get


@pytest.fixture(scope="module")
def mtp_run():
    pytest.importorskip("llama_cpp")
    from ggufcheck.engines.llama_cpp_mtp import run_mtp

    return run_mtp


def _logprobs(logits: np.ndarray) -> torch.Tensor:
    return torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)


# -- the reference alone --------------------------------------------------------------


def test_row_by_row_through_the_heads_cache_equals_one_batch(nextn_file):
    path = nextn_file("deepseek2")
    tokens = _tokens(12)
    with ReferenceModel(path) as ref:
        head = MTPHead(ref)
        assert head.layer == NEXTN_LAYER
        states = llama_cpp_pairing(trunk_states(ref, tokens))
        whole = head.forward(tokens, states).logits
        cache = KVCache()
        rows = torch.cat([head.forward([t], states[p:p + 1], cache=cache).logits for p, t in enumerate(tokens)])
    assert (whole - rows).abs().max() < 1e-10


def test_a_file_without_nextn_layers_has_no_head(tiny_gguf):
    from ggufcheck.errors import Unavailable

    with ReferenceModel(tiny_gguf("glm4moe").path) as ref, pytest.raises(Unavailable):
        MTPHead(ref)


# -- against llama.cpp ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_head_agrees_with_llama_cpp(arch, nextn_file, mtp_run):
    path = nextn_file(arch)
    tokens = _tokens(_n_tokens(arch))
    run = mtp_run(path, tokens)
    theirs = _logprobs(run.mtp_logits)
    engine_states = torch.from_numpy(run.trunk_states).double()
    with ReferenceModel(path) as ref:
        states = trunk_states(ref, tokens)
        ours = mtp_logprobs(ref, tokens, states)  # end to end: the reference's own trunk states
        head_alone = mtp_logprobs(ref, tokens, engine_states)  # the head on llama.cpp's states
    kl, diff = _kl(ours, theirs), (ours - theirs).abs().max()
    print(f"{arch} MTP vs llama.cpp over {len(tokens)} rows: KL max {kl.max():.1e}, max |d log p| {diff:.1e}; "
          f"on llama.cpp's states KL max {_kl(head_alone, theirs).max():.1e}; "
          f"trunk states max |d| {(states - engine_states).abs().max():.1e}")
    # the state llama.cpp feeds is its embeddings output (h after output_norm), bit for bit
    assert run.nextn_is_embeddings is True
    assert (states - engine_states).abs().max() < 1e-4
    assert kl.max() < 1e-9 and diff < 1e-4
    assert _kl(head_alone, theirs).max() < 1e-9
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_fed_state_is_the_normed_trunk_output_of_the_previous_row(arch, nextn_file, mtp_run):
    """Other plausible feeds (the same row's state, the state before output_norm) are far
    from what llama.cpp computes (healthy: KL <= 1e-9): the comparison pins down which state
    it feeds. Before vs after output_norm is the subtler one: hnorm re-normalizes the scale,
    so only output_norm's weights (1 + 0.1 N(0, 1) here) tell them apart (measured KL mean
    6e-3..5e-2); the same row instead of the previous one gives ~0.5."""
    path = nextn_file(arch)
    tokens = _tokens(_n_tokens(arch))
    theirs = _logprobs(mtp_run(path, tokens).mtp_logits)
    with ReferenceModel(path) as ref:
        normed = trunk_states(ref, tokens)
        _, outputs, _ = ref.forward(tokens, keep_layers=True)
        head = MTPHead(ref)
        same_row = head.forward(tokens, normed).logprobs
        pre_norm = head.forward(tokens, llama_cpp_pairing(outputs[-1].hidden)).logprobs
    for name, wrong, floor in (("same row", same_row, 0.1), ("before output_norm", pre_norm, 1e-4)):
        kl = _kl(wrong, theirs)[1:]  # row 0 carries zeros in every variant
        print(f"{arch} fed {name}: KL mean {kl.mean():.2e}")
        assert kl.mean() > floor


def test_f16_and_q8_0_weights_agree(nextn_file, mtp_run):
    """llama.cpp rounds a matmul's activations to the weights' vec_dot type: f16 for F16
    (end to end, measured KL max 2e-6), 8-bit blocks for Q8_0. With Q8_0 the tiny random
    trunk's rounding alone moves its own logits by KL up to ~0.2, so the head is judged on
    llama.cpp's trunk states (measured KL max 2e-4)."""
    tokens = _tokens(24)
    path = nextn_file("deepseek2", "F16")
    run = mtp_run(path, tokens)
    with ReferenceModel(path) as ref:
        ours = mtp_logprobs(ref, tokens)
    kl = _kl(ours, _logprobs(run.mtp_logits))
    path = nextn_file("deepseek2", "Q8_0")
    run = mtp_run(path, tokens)
    with ReferenceModel(path) as ref:
        head_alone = mtp_logprobs(ref, tokens, torch.from_numpy(run.trunk_states).double())
    kl_q8 = _kl(head_alone, _logprobs(run.mtp_logits))
    print(f"deepseek2 MTP vs llama.cpp: F16 KL max {kl.max():.1e}; Q8_0 on llama.cpp's states KL max {kl_q8.max():.1e}")
    assert kl.max() < 1e-4
    assert kl_q8.max() < 3e-3


def test_llama_cpp_row_by_row_equals_its_batch(nextn_file, mtp_run):
    """Drafting feeds the head one row at a time through its own KV cache."""
    path = nextn_file("glm4moe")
    tokens = _tokens(12)
    batch, rows = mtp_run(path, tokens), mtp_run(path, tokens, chunk=1)
    assert np.abs(batch.mtp_logits - rows.mtp_logits).max() < 1e-4
    with ReferenceModel(path) as ref:
        ours = mtp_logprobs(ref, tokens)
    assert _kl(ours, _logprobs(rows.mtp_logits)).max() < 1e-9


def test_glm_dsa_head_runs_dense_mla_past_top_k(nextn_file, mtp_run):
    """llama.cpp's glm-dsa MTP block has no DSA indexer: on llama.cpp's own trunk states, the
    reference without the indexer agrees at every row; with it, only up to top_k rows."""
    path = nextn_file("glm-dsa")
    tokens = _tokens(20)
    run = mtp_run(path, tokens)
    theirs = _logprobs(run.mtp_logits)
    states = torch.from_numpy(run.trunk_states).double()
    with ReferenceModel(path) as ref:
        top_k = ref.cfg.indexer_top_k
        dense = mtp_logprobs(ref, tokens, states)
        sparse = mtp_logprobs(ref, tokens, states, indexer=True)
    assert len(tokens) > top_k + 4
    assert _kl(dense, theirs).max() < 1e-9
    kl_sparse = _kl(sparse, theirs)
    assert kl_sparse[:top_k].max() < 1e-9 and kl_sparse[top_k:].max() > 1e-2


# -- negative controls: a broken head in the engine's copy of the file ------------------


def _swap_eh_proj_halves(contents):
    """The token and state halves of eh_proj exchanged (a concat-order bug)."""
    rec = contents.tensors[f"blk.{NEXTN_LAYER}.nextn.eh_proj.weight"]
    x = rec.raw.view(np.float32).reshape(rec.shape)  # [D, 2D]
    d = rec.shape[0]
    rec.raw = np.ascontiguousarray(np.concatenate([x[:, d:], x[:, :d]], axis=1)).view(np.uint8).reshape(rec.raw.shape)


def _double_enorm(contents):
    rec = contents.tensors[f"blk.{NEXTN_LAYER}.nextn.enorm.weight"]
    rec.raw = np.ascontiguousarray(rec.raw.view(np.float32) * 2).view(np.uint8).reshape(rec.raw.shape)


@pytest.mark.parametrize("fault", [_swap_eh_proj_halves, _double_enorm], ids=["eh_proj-halves", "enorm-x2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_corrupted_nextn_tensor_fails_by_a_wide_margin(arch, fault, nextn_file, mtp_run, tmp_path):
    from ggufcheck.testing.filefaults import rewrite

    path = nextn_file(arch)
    broken = rewrite(path, tmp_path / "broken.gguf", fault)
    tokens = _tokens(_n_tokens(arch))
    run = mtp_run(broken, tokens)
    with ReferenceModel(path) as ref:  # the reference reads the intact file
        ours = mtp_logprobs(ref, tokens)
        trunk = ref.prefill(tokens, trace=False).log_softmax(-1)
    kl = _kl(ours, _logprobs(run.mtp_logits))
    print(f"{arch} {fault.__name__}: MTP KL mean {kl.mean():.2e}, min {kl.min():.2e}")
    assert _kl(trunk, _logprobs(run.trunk_logits)).max() < 1e-9  # the trunk is untouched: silent
    assert kl.min() > 1e-3 and kl.mean() > 3e-2  # the healthy head: KL <= 1e-9 at every row
