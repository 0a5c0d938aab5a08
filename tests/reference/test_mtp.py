"""The NextN / MTP draft head (reference/mtp.py) against llama.cpp's MTP context
(engines/llama_cpp_mtp.py), on tiny files from our own writer with one NextN block.

Two independent implementations: the reference runs the block with its own layer code in
fp64 from the file's dequantized weights; llama.cpp runs its ``graph_mtp`` in a context
of type LLAMA_CONTEXT_TYPE_MTP, fed the way its draft-mtp driver feeds it. Measured on
this machine (F32 weights and KV cache, flash attention off): per-row KL <= 1e-12, max
|d log p| ~5e-6, for glm4moe, deepseek2 and glm-dsa; llama.cpp's trunk states and the
reference's agree to ~3e-6. A corrupted NextN tensor in the engine's copy of the file
(eh_proj's halves swapped, enorm doubled) moves every row by KL 0.06..1.4.

Chained drafts (reference/mtp.py ``chained_drafts`` against engines/llama_cpp_mtp.py
``draft_mtp``, 3 draft steps from 3-4 start rows): per draft position KL max <= 3e-13 end to
end (the same drafts at every step), <= 5e-14 on llama.cpp's own fed tokens and states; the
head's output state (what the next step is fed) within ~2e-6. Negative controls, KL mean at
positions 2..3 against llama.cpp: the trunk's state fed instead of the head's own 0.4-0.8,
the head's cache without the sequence's MTP rows before the start 0.1-0.5 (position 1
included).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ggufcheck.reference import KVCache, ReferenceModel
from ggufcheck.reference.mtp import (MTPHead, acceptance_by_position, chained_drafts, greedy_continuation,
                                     llama_cpp_pairing, mtp_logprobs, trunk_states)

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


# -- chained drafts: n_draft > 1 from one NextN block ----------------------------------------

CHAIN_ARCHS = ("deepseek2", "glm4moe", "glm-dsa")
N_DRAFT = 3


def _chain_setup(arch: str) -> tuple[list[int], list[int]]:
    if arch == "glm-dsa":  # the trunk below top_k (8) tokens; the MTP block runs dense MLA at any length
        return _tokens(7), [1, 3, 5]
    return _tokens(16), [1, 5, 9, 14]


@pytest.fixture(scope="module")
def draft_run():
    pytest.importorskip("llama_cpp")
    from ggufcheck.engines.llama_cpp_mtp import draft_mtp

    return draft_mtp


def _stack(chains) -> torch.Tensor:
    return torch.stack([c.logprobs for c in chains])  # [S, K, V]


@pytest.mark.parametrize("arch", CHAIN_ARCHS)
def test_chained_drafts_agree_with_llama_cpp(arch, nextn_file, draft_run):
    """The reference's chain (own trunk states, own drafts, own output states) against
    llama.cpp's draft-mtp driver, position by position; and the reference's head on exactly
    what llama.cpp fed each step."""
    path = nextn_file(arch)
    tokens, starts = _chain_setup(arch)
    run = draft_run(path, tokens, starts, N_DRAFT)
    theirs = _logprobs(run.logits)
    with ReferenceModel(path) as ref:
        own = chained_drafts(ref, tokens, starts, N_DRAFT)
        fed = chained_drafts(ref, tokens, starts, N_DRAFT, row_states=torch.from_numpy(run.states_fed),
                             feed=(run.fed_tokens, run.fed_states))
        first = mtp_logprobs(ref, tokens)  # the per-row head: a chain's first step
    kl_own, kl_fed = _kl(_stack(own), theirs).max(0).values, _kl(_stack(fed), theirs).max(0).values
    hidden = max((c.hidden - torch.from_numpy(run.hidden[i]).double()).abs().max().item() for i, c in enumerate(own))
    print(f"{arch} chained drafts vs llama.cpp, KL max by draft position: end to end "
          f"{', '.join(f'{v:.1e}' for v in kl_own)}; on llama.cpp's feed {', '.join(f'{v:.1e}' for v in kl_fed)}; "
          f"head output state max |d| {hidden:.1e}")
    assert [c.drafts for c in own] == run.drafts.tolist()  # the same chain: step k + 1 is fed the same draft
    assert kl_own.max() < 1e-9 and kl_fed.max() < 1e-9
    assert hidden < 1e-4
    assert torch.allclose(_stack(own)[:, 0], first[starts], atol=1e-10)


@pytest.mark.parametrize("arch", CHAIN_ARCHS)
def test_a_chained_step_is_fed_the_heads_own_state_through_a_cache_holding_the_prompt(arch, nextn_file, draft_run):
    """Negative controls: plausible other chainings are far from what llama.cpp computes
    (healthy: KL <= 1e-9 at every position): step k + 1 fed the trunk's state of row
    p + k - 1 (the row before its position) instead of the head's own output of step k;
    the head's KV cache holding the draft steps only (not the sequence's MTP rows before p)."""
    path = nextn_file(arch)
    tokens, starts = _chain_setup(arch)
    run = draft_run(path, tokens, starts, N_DRAFT)
    theirs = _logprobs(run.logits)
    with ReferenceModel(path) as ref:
        trunk = trunk_states(ref, tokens)
        states = run.fed_states.copy()
        for s, p in enumerate(starts):
            for k in range(1, N_DRAFT):
                states[s, k] = trunk[min(p + k - 1, len(tokens) - 1)].numpy()
        trunk_fed = _stack(chained_drafts(ref, tokens, starts, N_DRAFT, trunk, feed=(run.fed_tokens, states)))
        head = MTPHead(ref)
        no_prefix = []
        for s, p in enumerate(starts):
            cache = KVCache()  # the draft steps alone
            no_prefix.append(torch.cat([head.forward([int(run.fed_tokens[s, k])],
                                                     torch.from_numpy(run.fed_states[s, k:k + 1]).double(),
                                                     positions=[p + k], cache=cache).logprobs
                                        for k in range(N_DRAFT)]))
    kl_trunk, kl_cache = _kl(trunk_fed, theirs).mean(0), _kl(torch.stack(no_prefix), theirs).mean(0)
    print(f"{arch} KL mean by draft position: trunk state fed at steps 2..: {', '.join(f'{v:.2e}' for v in kl_trunk)}; "
          f"no prompt rows in the head's cache: {', '.join(f'{v:.2e}' for v in kl_cache)}")
    assert kl_trunk[0] < 1e-9  # step 1 is fed the same either way
    assert kl_trunk[1:].min() > 0.1
    assert kl_cache.min() > 0.03


def test_acceptance_by_position_on_a_greedy_sequence(nextn_file, draft_run):
    """The reference trunk's greedy continuation is llama.cpp's trunk's too (its argmax at each
    generated row is the next token: an independent check of ``greedy_continuation``); the
    acceptance of llama.cpp's chains equals the reference's on it; and the definition: drafts
    equal to the sequence are accepted at every position, a wrong draft at position k stops
    the chain there."""
    path = nextn_file("deepseek2")
    prompt = _tokens(10)
    with ReferenceModel(path) as ref:
        seq = greedy_continuation(ref, prompt, 6)
        starts = list(range(len(prompt) - 1, len(prompt) + 3))
        ours = [c.drafts for c in chained_drafts(ref, seq, starts, N_DRAFT)]
    run = draft_run(path, seq, starts, N_DRAFT)
    assert seq[:len(prompt)] == prompt and len(seq) == len(prompt) + 6
    assert np.argmax(run.trunk_logits, axis=-1)[len(prompt) - 1:-1].tolist() == seq[len(prompt):]
    theirs = acceptance_by_position(run.drafts.tolist(), seq, starts)
    print(f"deepseek2 (random weights) acceptance by draft position over {len(starts)} rounds: "
          f"llama.cpp {theirs}, reference {acceptance_by_position(ours, seq, starts)}")
    assert theirs == acceptance_by_position(ours, seq, starts)
    perfect = [[seq[p + k + 1] for k in range(N_DRAFT)] for p in starts]
    assert acceptance_by_position(perfect, seq, starts) == [len(starts)] * N_DRAFT
    for wrong in range(N_DRAFT):
        drafts = [list(row) for row in perfect]
        drafts[0][wrong] = (drafts[0][wrong] + 1) % 511
        counts = acceptance_by_position(drafts, seq, starts)
        assert counts == [len(starts)] * wrong + [len(starts) - 1] * (N_DRAFT - wrong)


@pytest.mark.parametrize("arch", ["deepseek2", "glm4moe", "glm-dsa"])
def test_a_draftable_model_accepts_every_draft_and_a_random_one_none(arch, tiny_gguf):
    """synthetic.tiny.draftable_nextn: the head drafts what the trunk chooses, so the reference's
    own speculative decoding replayed over its greedy sequence accepts every draft at every
    position (the served acceptance check can tell a broken head there); on random weights it
    accepts none (why that check does not judge them)."""
    from ggufcheck.synthetic.tiny import draftable_nextn

    for patch, want in ((draftable_nextn, 1.0), (None, 0.0)):
        with ReferenceModel(tiny_gguf(arch, n_nextn=1, patch=patch, seed=1).path) as ref:
            seq = greedy_continuation(ref, [1, 5, 9, 13], 12)
            starts = list(range(3, 12))
            chains = chained_drafts(ref, seq, starts, 3)
            counts = acceptance_by_position([c.drafts for c in chains], seq, starts)
        assert sum(counts) / (3 * len(starts)) == want, (arch, patch, counts)
    with pytest.raises(Exception, match="NextN"):
        tiny_gguf(arch, patch=draftable_nextn)
