"""The NextN / MTP draft head (GLM-4.5+, GLM-5, DeepSeek-V3), run like any layer.

Why this file exists: the MTP layer(s) that GLM-5 and DeepSeek-V3 ship after the trunk
(``blk.{n_layer}``, counted in ``block_count``) are not on the path of the model's own
logits, so the reference's :meth:`~ggufcheck.reference.model.ReferenceModel.forward` skips
them (docs/architectures.md sec 1) and nothing checked them. Engines run them for
speculative decoding, where a broken head is silent: the output stays right (the trunk
verifies every draft), only the draft acceptance rate drops. This module computes what the
head should give, in the reference's working dtype, from the file's own weights and the
reference's own decoder-layer code (the family module's ``forward_layer``), so an engine's
MTP logits can be compared position by position.

What llama.cpp computes (src/models/deepseek2.cpp, glm4-moe.cpp, glm-dsa.cpp ``graph_mtp``)
and this module repeats, for one MTP row with token ``x`` at position ``p`` and a carried
hidden state ``h`` [D]::

    e   = RMSNorm(embed(x), nextn.enorm)       # nextn.embed_tokens if present, else token_embd
    h'  = RMSNorm(h, nextn.hnorm)
    u   = nextn.eh_proj @ [e ; h']             # concat order: token half FIRST, state half second
    u   = decoder block blk.{n_layer}(u)       # attention over the MTP rows' own positions
                                               # (its own KV cache), then MoE / dense FFN
    out = RMSNorm(u, nextn.shared_head_norm)   # else output_norm
    logits = (nextn.shared_head_head or output, which is token_embd when tied) @ out

The state ``h`` is the trunk's ``h_nextn``: its last residual stream AFTER the final
``output_norm`` (the same tensor as llama.cpp's ``result_norm`` / embeddings output), see
:func:`trunk_states`. llama.cpp's draft-mtp driver (common/speculative.cpp) pairs MTP row
``p`` (token ``x_p``, rope position ``p``) with the trunk state of position ``p - 1`` and
the first row of a sequence with a zero state (``pending_h`` starts zeroed): row ``p``
then predicts ``x_{p+1}``, the same target as the trunk's row ``p``
(:func:`llama_cpp_pairing`). In the notation (h_t, x_{t+1}) -> x_{t+2}: t = p - 1.

Drafting K > 1 tokens chains the one block (:func:`chained_drafts`, as llama.cpp's driver
``draft()`` does): step k + 1 is fed step k's greedy draft and the head's own ``hidden``,
through the head's KV cache holding the sequence's MTP rows before the start row;
:func:`greedy_continuation` and :func:`acceptance_by_position` replay speculative decoding at
temperature 0 teacher-forced, for acceptance by draft position.

glm-dsa: llama.cpp's MTP block runs dense MLA, without the DSA indexer (llama-model.cpp:
"The NextN/MTP draft head runs dense MLA (no DSA indexer)"); that is the default here
(``indexer=False``). Whether the trained GLM-5 head uses its indexer tensors is
unconfirmed; below ``indexer_top_k`` MTP rows the two are identical anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ggufcheck.errors import Unavailable, UsageError
from ggufcheck.reference.cache import KVCache, LayerCache, LayerOutput
from ggufcheck.reference.layers import linear, rms_norm
from ggufcheck.reference.model import ReferenceModel
from ggufcheck.reference.precision import emulating

NEXTN = "nextn."


@dataclass
class MTPOutput:
    """One MTP pass over T rows."""

    logits: Tensor  # [T, V] the head's logits (predicting the token after each row's token)
    hidden: Tensor  # [T, D] after shared_head_norm: llama.cpp's MTP ``h_nextn`` (seeds a chained step)
    layer: LayerOutput  # the decoder block's states (input is eh_proj's output)
    eh_proj: Tensor  # [T, D] the decoder block's input

    @property
    def logprobs(self) -> Tensor:
        return torch.log_softmax(self.logits, dim=-1)


def n_nextn(ref: ReferenceModel) -> int:
    """The file's NextN / MTP layer count (``{arch}.nextn_predict_layers``; 0 if absent)."""
    return int(ref.gguf.metadata.get(f"{ref.cfg.arch}.nextn_predict_layers", 0) or 0)


def trunk_states(ref: ReferenceModel, tokens: list[int]) -> Tensor:
    """The trunk's ``h_nextn`` for every position [T, D]: RMSNorm(last layer's output,
    output_norm), the state llama.cpp hands the MTP head (``res->t_h_nextn`` after
    ``build_norm(cur, model.output_norm, ...)`` in each trunk graph). Runs the trunk layer
    by layer (``run_layer``), keeping one layer's states at a time."""
    if not tokens:
        raise UsageError("no tokens to run")
    positions = torch.arange(len(tokens), dtype=torch.int64, device=ref.device)
    h, topk = ref.embed(list(tokens)), None
    for i in range(ref.cfg.n_layer):
        out = ref.run_layer(i, h, positions, shared_topk=topk)
        if out.topk_full:  # glm-dsa: shared indexer layers reuse the latest full layer's choice
            topk = out.topk
        h = out.hidden
        del out
    return rms_norm(h, ref.weights.global_tensor("output_norm.weight"), ref.cfg.rms_eps)


def llama_cpp_pairing(states: Tensor, first: Tensor | None = None) -> Tensor:
    """The state each MTP row carries in llama.cpp's draft-mtp driver: row p gets the trunk's
    state of position p - 1, row 0 ``first`` (zeros: a fresh sequence's ``pending_h``).
    ``states`` [T, D] -> [T, D]."""
    out = torch.zeros_like(states)
    out[1:] = states[:-1]
    if first is not None:
        out[0] = first
    return out


class MTPHead:
    """The NextN block ``blk.{n_layer + index}`` of a reference model, as a draft head.

    Args:
        ref: the reference model (its weights, dtype, device, rope).
        index: which NextN block (0: the first, llama.cpp's ``nextn_layer_offset``).
        indexer: glm-dsa only: run the DSA indexer in the MTP block (llama.cpp does not).
    """

    def __init__(self, ref: ReferenceModel, index: int = 0, indexer: bool = False):
        count = n_nextn(ref)
        if count == 0:
            raise Unavailable(f"{ref.path}: no NextN / MTP layers (nextn_predict_layers is 0 or absent)")
        if not 0 <= index < count:
            raise UsageError(f"NextN block {index} out of range 0..{count - 1}")
        self.ref = ref
        self.layer = ref.cfg.n_layer + index
        names = ref.weights.layer_names(self.layer)
        missing = [n for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight") if NEXTN + n not in names]
        if missing:
            raise Unavailable(f"{ref.path}: NextN block {self.layer} lacks {', '.join(NEXTN + m for m in missing)} "
                              f"(a trunk-only file?)")
        cfg = ref.cfg
        if cfg.has_indexer:
            cfg = (cfg.with_options(indexer_full=cfg.indexer_full + (True,) * (self.layer + 1 - len(cfg.indexer_full)))
                   if indexer else cfg.with_options(indexer_heads=0))
        self.cfg = cfg

    def embed(self, tokens: list[int]) -> Tensor:
        """The block's token embeddings [T, D]: ``nextn.embed_tokens`` rows if the file has
        them, else ``token_embd`` rows (llama.cpp's fallback), unscaled (the MTP graphs apply
        no embedding scale)."""
        name = f"blk.{self.layer}.{NEXTN}embed_tokens.weight"
        if not self.ref.weights.has(name):
            return self.ref.weights.embed_rows(list(tokens))
        rows = {t: self.ref.weights.tensor(name, rows=slice(t, t + 1))[0] for t in sorted(set(tokens))}
        return torch.stack([rows[t] for t in tokens])

    @torch.no_grad()
    def forward(self, tokens: list[int], states: Tensor, positions: Tensor | list[int] | None = None,
                cache: KVCache | None = None) -> MTPOutput:
        """T MTP rows: ``tokens`` [T] with their carried ``states`` [T, D] at ``positions``
        (default: continuing after ``cache``). ``cache``: the head's own KV cache (never the
        trunk's), for row-by-row drafting; without one the rows attend over each other only."""
        ref = self.ref
        if len(tokens) != states.shape[0]:
            raise UsageError(f"{len(tokens)} tokens but {states.shape[0]} states")
        with emulating(ref._emulation_for(len(tokens))):  # a baseline model rounds as its engine's class
            return self._forward(tokens, states, positions, KVCache() if cache is None else cache)

    def _forward(self, tokens: list[int], states: Tensor, positions: Tensor | list[int] | None,
                 cache: KVCache) -> MTPOutput:
        ref, cfg, il = self.ref, self.cfg, self.layer
        start = cache.length
        q_pos = (torch.arange(start, start + len(tokens), dtype=torch.int64) if positions is None
                 else torch.as_tensor(positions, dtype=torch.int64)).to(ref.device)
        k_pos = q_pos if cache.positions is None else torch.cat((cache.positions, q_pos))
        cache.positions = k_pos
        w = ref.weights.layer(il)
        h = states.to(dtype=ref.dtype, device=ref.device)
        e = rms_norm(self.embed(tokens), w[NEXTN + "enorm.weight"], cfg.rms_eps)  # [T, D]
        hn = rms_norm(h, w[NEXTN + "hnorm.weight"], cfg.rms_eps)  # [T, D]
        u = linear(torch.cat((e, hn), dim=-1), w[NEXTN + "eh_proj.weight"])  # [T, 2D] -> [T, D]
        out = ref.family.forward_layer(cfg, il, w, u, ref.rope(q_pos, il), q_pos, k_pos, cache.layer(il), {})
        norm = w[NEXTN + "shared_head_norm.weight"] if NEXTN + "shared_head_norm.weight" in w \
            else ref.weights.global_tensor("output_norm.weight")
        hidden = rms_norm(out.hidden, norm, cfg.rms_eps)  # [T, D]
        if NEXTN + "shared_head_head.weight" in w:
            logits = linear(hidden, w[NEXTN + "shared_head_head.weight"])
        else:  # model.output: output.weight, or token_embd when tied
            logits = torch.empty((hidden.shape[0], cfg.n_vocab), dtype=hidden.dtype, device=hidden.device)
            for first, rows in ref.weights.head_chunks(16384):
                logits[:, first:first + rows.shape[0]] = linear(hidden, rows)
        return MTPOutput(logits=logits, hidden=hidden, layer=out, eh_proj=u)


def mtp_logprobs(ref: ReferenceModel, tokens: list[int], states: Tensor | None = None, index: int = 0,
                 indexer: bool = False) -> Tensor:
    """The MTP head's log-probabilities [T, V] over a prompt, paired as llama.cpp's draft-mtp
    driver pairs a fresh sequence (:func:`llama_cpp_pairing`): row p (token x_p, state of
    position p - 1, zeros for p = 0) predicts x_{p+1}. ``states``: the trunk states [T, D]
    to carry (default: the reference's own, :func:`trunk_states`; an engine's, to judge its
    head alone)."""
    trunk = trunk_states(ref, tokens) if states is None else states
    head = MTPHead(ref, index, indexer)
    return head.forward(list(tokens), llama_cpp_pairing(trunk.to(dtype=ref.dtype, device=ref.device))).logprobs


# -- chained drafts: n_draft > 1 from one NextN block ----------------------------------------


@dataclass
class DraftChain:
    """``K`` chained draft steps of the head from one start row ``p`` of a sequence."""

    start: int  # p: step 1 is the sequence's token at p (llama.cpp's ``id_last`` at ``pos0`` = p)
    tokens: list[int]  # [K] the token each step was fed (step 1: tokens[p]; step k: draft k - 1)
    states: Tensor  # [K, D] the state each step was fed (step 1: trunk state of row p - 1; then the head's own)
    logits: Tensor  # [K, V] step k's logits: the draft of tokens[p + k]
    hidden: Tensor  # [K, D] the head's own h_nextn at each step (what the next step is fed)
    router_gap: Tensor | None  # [K] the block's MoE router gaps (None for a dense block)

    @property
    def logprobs(self) -> Tensor:
        return torch.log_softmax(self.logits, dim=-1)

    @property
    def drafts(self) -> list[int]:
        """The greedy draft of each step (the top-1 of llama.cpp's top-k draft sampler)."""
        return self.logits.argmax(-1).tolist()


def _cache_prefix(cache: KVCache, n: int) -> KVCache:
    """A new cache holding the first ``n`` rows of ``cache`` (its tensors are not changed)."""
    if n == 0 or cache.positions is None:
        return KVCache()
    return KVCache(layers={i: LayerCache({k: v[:n] for k, v in lc.tensors.items()}) for i, lc in cache.layers.items()},
                   positions=cache.positions[:n])


@torch.no_grad()
def chained_drafts(ref: ReferenceModel, tokens: list[int], start_rows: list[int], n_draft: int,
                   states: Tensor | None = None, *, row_states: Tensor | None = None,
                   feed: tuple | None = None, index: int = 0, indexer: bool = False) -> list[DraftChain]:
    """The head drafting ``n_draft`` tokens from each start row p of ``tokens``, chained as
    llama.cpp's draft-mtp driver chains one NextN block (common/speculative.cpp
    ``common_speculative_impl_draft_mtp::draft``, its ``else`` branch: neither shared memory
    nor one head per step):

    - the head's own KV cache holds the sequence's MTP rows before p (row r: token x_r at
      position r with the trunk state of row r - 1, :func:`llama_cpp_pairing`), as the
      driver's ``process()`` hook left it after the target decoded x_0..x_{p-1}; nothing
      from p on (the server drops ctx_dft's positions past the target's after each draft);
    - step 1: x_p at position p with the trunk state of row p - 1 (``id_last`` with
      ``pending_h``): the same row as :func:`mtp_logprobs`'s row p;
    - step k + 1: the step-k greedy draft at position p + k with the head's own output state
      of step k (``h_nextn`` of the MTP graph, after shared_head_norm: :attr:`MTPOutput.hidden`),
      appended to the same cache (step k + 1 attends over the rows before p and steps 1..k).

    ``states``: the trunk states [T, D] (default: the reference's own, :func:`trunk_states`);
    ``row_states``: the state each row of ``tokens`` carries [T, D] instead of their pairing
    (an engine's). ``feed``: (tokens [S][K], states [S][K][D]) fed at each step instead of
    the chain's own (the steps an engine fed, to judge its head alone; a negative control).
    One :class:`DraftChain` per start row, in the order given."""
    tokens = [int(t) for t in tokens]
    if not tokens or not start_rows or n_draft < 1:
        raise UsageError("no tokens, start rows or draft steps")
    if min(start_rows) < 0 or max(start_rows) >= len(tokens):
        raise UsageError(f"start rows must lie in 0..{len(tokens) - 1}")
    if row_states is None:
        trunk = trunk_states(ref, tokens) if states is None else states
        row_states = llama_cpp_pairing(trunk.to(dtype=ref.dtype, device=ref.device))
    row_states = torch.as_tensor(row_states).to(dtype=ref.dtype, device=ref.device)
    head = MTPHead(ref, index, indexer)
    last = max(start_rows)
    prompt = KVCache()
    if last > 0:  # the process() hook's rows before the latest start, once; each start takes its prefix
        head.forward(tokens[:last], row_states[:last], cache=prompt)
    chains = []
    for s, p in enumerate(start_rows):
        cache = _cache_prefix(prompt, p)
        token, state = tokens[p], row_states[p]
        fed_tokens, fed_states, logits, hidden, gaps = [], [], [], [], []
        for k in range(n_draft):
            if feed is not None:
                token = int(feed[0][s][k])
                state = torch.as_tensor(feed[1][s][k]).to(dtype=ref.dtype, device=ref.device)
            out = head.forward([token], state[None], positions=[p + k], cache=cache)
            fed_tokens.append(token)
            fed_states.append(state)
            logits.append(out.logits[0])
            hidden.append(out.hidden[0])
            gaps.append(out.layer.router_gap)
            token, state = int(out.logits[0].argmax()), out.hidden[0]
        chains.append(DraftChain(p, fed_tokens, torch.stack(fed_states), torch.stack(logits), torch.stack(hidden),
                                 None if gaps[0] is None else torch.cat(gaps)))
    return chains


@torch.no_grad()
def greedy_continuation(ref: ReferenceModel, prompt: list[int], n_new: int) -> list[int]:
    """``prompt`` followed by ``n_new`` tokens the trunk chooses greedily (its argmax, fed back
    one at a time through its KV cache): a sequence on which the trunk's argmax at every row
    from ``len(prompt) - 1`` on is the sequence's next token, so that speculative decoding at
    temperature 0 can be replayed teacher-forced over it (:func:`acceptance_by_position`)."""
    if not prompt:
        raise UsageError("no prompt to continue")
    cache, seq = KVCache(), [int(t) for t in prompt]
    logits = ref.forward(seq, cache)[0]
    for _ in range(n_new):
        seq.append(int(logits[-1].argmax()))
        if len(seq) - len(prompt) < n_new:
            logits = ref.forward(seq[-1:], cache)[0]
    return seq


def acceptance_by_position(drafts, tokens: list[int], start_rows: list[int]) -> list[int]:
    """How many start rows had their draft at position k accepted, k = 1..K.

    Speculative decoding at temperature 0 replayed over ``tokens``, a sequence that is the
    trunk's own greedy continuation from each start row on (:func:`greedy_continuation`: the
    trunk's argmax at row r is tokens[r + 1] for every row r >= p). From start row p (the
    trunk's last choice x_p is ``id_last``), draft k (predicting the token at p + k) is
    accepted iff drafts 1..k all equal tokens[p + 1..p + k]: the trunk verifies the drafts in
    order and keeps the longest agreeing prefix. Because the sequence is the trunk's greedy
    one, its argmax after an accepted prefix is the sequence's next token, so no further
    trunk pass is needed. ``drafts``: [S][K] per start row; every p + K must lie in the
    sequence. The rate at position k is count[k - 1] / S; the mean accepted length per
    round is sum(count) / S."""
    n_draft = len(drafts[0]) if len(drafts) else 0
    counts = [0] * n_draft
    for row, p in zip(drafts, start_rows):
        if p + n_draft >= len(tokens):
            raise UsageError(f"start row {p} + {n_draft} drafts runs past the sequence ({len(tokens)} tokens)")
        for k in range(n_draft):
            if int(row[k]) != int(tokens[p + k + 1]):
                break
            counts[k] += 1
    return counts
