"""The Engine interface: how ggufcheck talks to any deployment.

This is a public, stable interface. Users plug in their own deployment by writing a small
class with these methods (or by pointing ``--engine python:module:factory`` at a function
returning one). Every adapter declares what it can do in a frozen :class:`Capabilities`;
a check that needs a missing capability is SKIPPED with the reason the adapter gives, never
failed and never silently dropped.

Position convention (used by every return type here). For a token sequence ``tokens[0..T)``
row ``t`` of a log-probability table is the engine's next-token distribution after the
prefix ``tokens[:t+1]``, i.e. the distribution that should predict ``tokens[t+1]``. So a
table has T rows; the last row predicts the token after the sequence. Rows an engine
cannot report (OpenAI-style servers never return the distribution before the first echoed
token) are marked absent in ``present``.

Dimension letters: T sequence length, V vocabulary size, K top-k width, D hidden size.

A minimal plug-in (``ggufcheck compare MODEL.gguf --engine python:my_mod:make``)::

    from ggufcheck.engines.base import Capabilities, Engine, TokenLogprobs, log_softmax

    class MyEngine(Engine):
        name = "my deployment"
        capabilities = Capabilities(score=True, full_vocab=True, activation_dtype="bf16")
        vocab_size = 151552

        def score(self, tokens, *, top_k=20):
            logits = my_client.forward(tokens)            # [T, V] next-token logits
            return TokenLogprobs(tokens, self.vocab_size, log_softmax(logits, np.float32))

    def make(model_path):
        return MyEngine()
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from ggufcheck.engines import rowwise
from ggufcheck.errors import Unavailable

# Per-layer tensor kinds an engine may expose through ``layer_outputs``.
# "rope": the rope call's query / key heads in and out [T, 2, N, R] (with "ropepos" [T] and
# "ropeqheads" [T] alongside), see checks/rope.py.
# "router": [T, k] chosen expert ids; "router_probs" [T, n_expert]: the gating function's
# output, "router_biased" the same plus the selection bias where the model has one (the
# scores experts are chosen by: how close a choice was, checks/path_layers.py).
# "after_attention" [T, D]: the residual stream between the two blocks (input + attention).
LAYER_KINDS = ("residual", "after_attention", "attention", "ffn", "moe", "router", "router_order", "router_probs",
               "router_biased", "indexer", "rope")


class Unsupported(Unavailable):
    """The engine does not offer this capability; checks needing it are skipped."""


# numerical classes (Capabilities.activation_dtype) from finest to coarsest
CLASS_ORDER = ("fp64", "fp32", "fp16", "bf16", "q8")


def coarsest(*classes: str) -> str:
    """The coarsest of numerical classes (the allowance of the coarsest applies; an unknown
    class counts as the finest)."""
    return max(classes, key=lambda c: CLASS_ORDER.index(c) if c in CLASS_ORDER else 0)


@dataclass(frozen=True)
class Switch:
    """One engine setting a user flips to see the output change (issue 37's most common way a
    cause was found): the spec options that set its safe value (``safe``, e.g. {"flash_attn":
    0}), what they are now (``current``), the path the flip avoids (``what``: "the
    flash-attention path") and the component named when the flip makes a failure go away."""

    safe: Mapping[str, Any]
    current: Mapping[str, Any]
    what: str
    component: str

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.safe.items())


@dataclass(frozen=True)
class Capabilities:
    """What an adapter offers. ``reasons`` explains each capability it lacks."""

    tokenize: bool = False
    score: bool = False  # teacher-forced log-probs for a given token sequence
    full_vocab: bool = False  # score returns the whole vocabulary (else top-k + tail)
    max_top_k: int = 0  # widest top-k the engine returns when not full_vocab
    generate: bool = False  # greedy step-by-step generation with per-step log-probs
    batch: bool = False  # several sequences scored together in one engine call
    chunked_prefill: bool = False  # prefill split into chunks of a requested size
    layer_outputs: frozenset[str] = frozenset()  # subset of LAYER_KINDS
    weights: bool = False  # loaded weights by HF name (and TP rank)
    # The names ``weight(hf_name)`` answers to: "checkpoint" (HF checkpoint names and
    # layout, one parameter per expert) or "transformers" (transformers' module names, e.g.
    # fused experts). The weights stage asks in this layout.
    weight_layout: str = "checkpoint"
    # Documented semantics of this engine that differ from the file's literal reading and are
    # not faults (e.g. transformers' DeepSeek-V3 / GLM-DSA hard-code eps 1e-6 in the MLA
    # q_a / kv_a norms): ReferenceModel options the diagnosis builds its reference with, and
    # says so in the report. Empty: the reference reads the file as llama.cpp does.
    reference_options: Mapping[str, Any] = field(default_factory=dict)
    tp_size: int = 1
    # expert parallelism: each rank holds whole routed experts, a share of them, by global id
    # (the weights audit expects an expert whole, on exactly one rank)
    expert_parallel: bool = False
    max_sequence: int | None = None  # the longest sequence the engine takes (its context), if known
    # score() computes each row as a one-token step through the engine's prompt cache, not by a
    # prefill of the sequence in one batch (llama-server's dialect: it returns no prompt
    # log-probs): the batched prefill kernels are then reached only by score_cold
    stepwise_score: bool = False
    # the engine's prompt micro-batch (llama.cpp n_ubatch): a prompt longer than this is
    # processed in pieces, a length landmark of the prefill sweep (checks.lengths)
    prefill_micro_batch: int | None = None
    # Numerical class of the engine's activations, used to pick the honest baseline:
    # "fp64", "fp32", "bf16", "fp16", or "q8" (llama.cpp CPU quantizes activations to
    # 8-bit blocks before quantized matmuls).
    activation_dtype: str = "fp32"
    # Where the engine rounds, when it knows (a baseline run emulates it: reference.precision):
    # "activations" (a matmul's input), "outputs" (its result), "kv" (the cache) -> "q8_0",
    # "q8_k", "f16" or "bf16". Empty: derived from activation_dtype.
    rounding: Mapping[str, str] = field(default_factory=dict)
    reasons: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # the settings of this engine a user would flip to find a cause (checks.switches): each one
    # set now to something other than its safe value
    switches: tuple["Switch", ...] = ()

    def why_not(self, capability: str) -> str:
        """The adapter's reason for lacking ``capability`` (a SKIP message)."""
        return self.reasons.get(capability, f"the engine does not offer {capability}")


@dataclass(frozen=True)
class TokenLogprobs:
    """Next-token log-probabilities at every position of one token sequence.

    Either ``logprobs`` (full vocabulary) or ``topk_ids`` + ``topk_logprobs`` is set. Top-k
    rows are sorted by decreasing log-probability; unused slots have id -1 and -inf. The
    probability mass outside the top-k ("tail") is ``1 - sum(exp(topk_logprobs))``.
    """

    tokens: np.ndarray  # [T] int64: the sequence that was scored
    vocab_size: int
    logprobs: np.ndarray | None = None  # [T, V] float32 log-softmax
    topk_ids: np.ndarray | None = None  # [T, K] int64
    topk_logprobs: np.ndarray | None = None  # [T, K] float64
    next_logprob: np.ndarray | None = None  # [T]: log p(tokens[t+1]) at row t; NaN if unknown
    present: np.ndarray | None = None  # [T] bool: rows the engine reported
    # [T] bool, reference only: rows whose expected distribution is ambiguous (a DSA indexer
    # tie at the top-k boundary: a correct engine may select another key set there)
    ambiguous: np.ndarray | None = None

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        object.__setattr__(self, "tokens", tokens)
        n = len(tokens)
        if self.logprobs is None and self.topk_ids is None:
            raise ValueError("TokenLogprobs needs logprobs or topk_ids/topk_logprobs")
        if self.logprobs is not None and self.logprobs.shape != (n, self.vocab_size):
            raise ValueError(f"logprobs shape {self.logprobs.shape} != ({n}, {self.vocab_size})")
        if self.topk_ids is not None:
            if self.topk_logprobs is None or self.topk_ids.shape != self.topk_logprobs.shape:
                raise ValueError("topk_ids and topk_logprobs must have the same shape")
            if self.topk_ids.shape[0] != n:
                raise ValueError(f"top-k rows {self.topk_ids.shape[0]} != {n} tokens")
        if self.present is None:
            object.__setattr__(self, "present", np.ones(n, dtype=bool))
        if self.next_logprob is None:
            object.__setattr__(self, "next_logprob", self._observed_from_table())

    @property
    def full(self) -> bool:
        return self.logprobs is not None

    def __len__(self) -> int:
        return len(self.tokens)

    def _observed_from_table(self) -> np.ndarray:
        n = len(self.tokens)
        out = np.full(n, np.nan)
        if n < 2:
            return out
        nxt = self.tokens[1:]  # [T-1]
        if self.logprobs is not None:
            out[:-1] = self.logprobs[np.arange(n - 1), nxt]
        else:
            hit = self.topk_ids[:-1] == nxt[:, None]  # [T-1, K]
            rows = hit.any(axis=1)
            out[:-1][rows] = self.topk_logprobs[:-1][hit]
        out[~self.present] = np.nan
        return out

    def top_k(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """([T, k] ids, [T, k] log-probs) sorted by decreasing log-probability (a full table is
        partitioned a block of rows at a time: a [T, V] index array of a 262k vocabulary over
        500 rows would be 1 GB); small k in one pass per row, rows in parallel (engines/rowwise.py)."""
        if self.logprobs is not None:
            k = min(k, self.vocab_size)
            if k <= rowwise.MAX_K:
                return rowwise.top_k(self.logprobs, k)
            ids_parts, val_parts = [], []
            for rows in row_blocks(len(self.logprobs), self.logprobs.shape[1]):
                block = self.logprobs[rows]
                ids = np.argpartition(-block, k - 1, axis=1)[:, :k]  # [rows, k] unsorted
                vals = np.take_along_axis(block, ids, axis=1)
                order = np.argsort(-vals, axis=1, kind="stable")
                ids_parts.append(np.take_along_axis(ids, order, 1))
                val_parts.append(np.take_along_axis(vals, order, 1).astype(np.float64))
            if not ids_parts:
                return np.zeros((0, k), np.int64), np.zeros((0, k))
            return np.concatenate(ids_parts), np.concatenate(val_parts)
        return self.topk_ids[:, :k], self.topk_logprobs[:, :k]

    def argmax(self) -> np.ndarray:
        """[T] the most likely next token at each row (-1 where absent)."""
        if self.logprobs is not None:
            out = self.logprobs.argmax(axis=1).astype(np.int64)
        else:
            out = self.topk_ids[:, 0].copy()
        out[~self.present] = -1
        return out

    def rows(self, start: int, stop: int) -> "TokenLogprobs":
        """Rows [start, stop) only, as a table over the same tokens (others absent)."""
        present = np.zeros(len(self.tokens), dtype=bool)
        present[start:stop] = self.present[start:stop]
        return TokenLogprobs(
            self.tokens, self.vocab_size, self.logprobs, self.topk_ids, self.topk_logprobs,
            np.where(present, self.next_logprob, np.nan), present, self.ambiguous,
        )


BLOCK_VALUES = 1 << 23  # values per block of rows in full-vocabulary arithmetic (64 MB of float64)


def row_blocks(n_rows: int, width: int):
    """Slices of consecutive rows holding about BLOCK_VALUES values each (at least one row)."""
    step = max(1, BLOCK_VALUES // max(int(width), 1))
    for start in range(0, n_rows, step):
        yield slice(start, min(n_rows, start + step))


@dataclass(frozen=True)
class Generation:
    """A greedy generation: the prompt, the generated tokens and per-step log-probs.

    ``steps`` is a :class:`TokenLogprobs` over ``prompt + generated`` whose present rows are
    ``n_prompt - 1 .. n_prompt + len(generated) - 2`` (the distributions each step sampled
    from), so it lines up with a teacher-forced ``score`` of the same sequence.
    """

    prompt: np.ndarray  # [P] int64
    generated: np.ndarray  # [N] int64
    steps: TokenLogprobs

    @property
    def sequence(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.generated])


@dataclass(frozen=True)
class LayerTrace:
    """Per-layer tensors for one sequence: ``tensors[(kind, layer)]`` is [T, ...] float32."""

    tokens: np.ndarray  # [T]
    tensors: Mapping[tuple[str, int], np.ndarray]
    names: Mapping[tuple[str, int], str] = field(default_factory=dict)  # engine's own names
    # tensor-parallel engines: the same tensors as seen by ranks 1.. (``tensors`` is rank 0's);
    # after each all-reduce every rank should hold the same residual stream
    per_rank: Mapping[int, Mapping[tuple[str, int], np.ndarray]] = field(default_factory=dict)


@dataclass(frozen=True)
class MTPTrace:
    """What an engine's NextN / MTP draft head computed over one prompt (reference/mtp.py).

    Row p carries token ``tokens[p]`` and ``states[p]``, the trunk state the engine fed it
    (llama.cpp's draft-mtp driver: the trunk's post-``output_norm`` state of row p - 1, zeros
    for row 0); ``table`` row p is the head's distribution of ``tokens[p + 1]``, the same
    target as the trunk's row p, whose greedy choice is ``trunk_argmax[p]`` (what the trunk
    accepts at temperature 0)."""

    tokens: np.ndarray  # [T]
    states: np.ndarray  # [T, D] float32
    table: TokenLogprobs  # [T, V]
    trunk_argmax: np.ndarray  # [T]
    trunk_states: np.ndarray | None = None  # [T, D] the trunk's own state per row (what ``states`` should shift)


@dataclass(frozen=True)
class MTPDrafts:
    """An engine's NextN / MTP head drafting K tokens from S start rows of one sequence, as its
    speculative decoding chains them (reference/mtp.py ``chained_drafts``; llama.cpp's
    draft-mtp driver: step 1 is ``tokens[p]`` with the trunk state of row p - 1, step k + 1
    the step-k draft with the head's own output state of step k, through the head's KV cache
    holding the sequence's MTP rows before p). Step k's distribution drafts ``tokens[p + k]``."""

    tokens: np.ndarray  # [T] the sequence
    states: np.ndarray  # [T, D] the state each MTP row of the sequence carried (the head's cache rows)
    start_rows: np.ndarray  # [S]
    fed_tokens: np.ndarray  # [S, K] the token each step was fed
    fed_states: np.ndarray  # [S, K, D] float32 the state each step was fed
    logprobs: np.ndarray  # [S, K, V] float32 log-softmax of each step
    trunk_argmax: np.ndarray  # [T] the trunk's greedy choice per row of the sequence
    trunk_states: np.ndarray | None = None  # [T, D] the trunk's own state per row

    @property
    def drafts(self) -> np.ndarray:
        """[S, K] the greedy draft of each step."""
        return np.argmax(self.logprobs, axis=-1)


@dataclass(frozen=True)
class SpeculativeRun:
    """One greedy generation by a server with its own speculative decoding on (llama-server
    ``--spec-type draft-mtp``), and what that reported of its drafts: the acceptance a broken
    draft head lowers while the output stays right (checks.mtp ``mtp.served_acceptance``)."""

    prompt: tuple[int, ...]
    generated: tuple[int, ...]
    drafted: int  # draft tokens proposed over the generation
    accepted: int  # of those, accepted by the trunk
    draft_max: int  # K: tokens drafted per round at most
    source: str  # where the counts were read

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


class Engine(abc.ABC):
    """An engine under test (or the reference). Subclass and override what you offer.

    Required: ``name``, ``capabilities``, ``vocab_size``, and :meth:`score`. Everything
    else raises :class:`Unsupported` unless overridden and declared in ``capabilities``.
    Engines are context managers; :meth:`close` releases processes, sockets and memory.
    """

    name: str = "engine"
    capabilities: Capabilities = Capabilities()
    vocab_size: int = 0

    # ---- tokenization -------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` (with the model's BOS etc. when ``add_special``)."""
        raise Unsupported(self.capabilities.why_not("tokenize"))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (used to show worst positions and to talk to text-only servers)."""
        raise Unsupported(self.capabilities.why_not("tokenize"))

    # ---- teacher-forced scoring -----------------------------------------------------
    @abc.abstractmethod
    def score(self, tokens: Sequence[int], *, top_k: int = 20) -> TokenLogprobs:
        """Teacher-forced next-token log-probs at every position of ``tokens``.

        Full-vocabulary engines ignore ``top_k``; others return their top ``top_k``.
        """

    def score_batch(self, batch: Sequence[Sequence[int]], *, top_k: int = 20) -> list[TokenLogprobs]:
        """Score several sequences in ONE engine call (for batch invariance)."""
        raise Unsupported(self.capabilities.why_not("batch"))

    def score_chunked(self, tokens: Sequence[int], chunk_size: int, *, top_k: int = 20) -> TokenLogprobs:
        """Score ``tokens`` with the prefill split into chunks of ``chunk_size`` tokens."""
        raise Unsupported(self.capabilities.why_not("chunked_prefill"))

    # ---- generation -------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, top_k: int = 20) -> Generation:
        """Greedy (temperature 0) generation, one token per step, with per-step log-probs."""
        raise Unsupported(self.capabilities.why_not("generate"))

    # ---- internals ----------------------------------------------------------------------
    def layer_outputs(self, tokens: Sequence[int], kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """Per-layer tensors (residual stream, attention / FFN / MoE outputs, router choices)."""
        raise Unsupported(self.capabilities.why_not("layer_outputs"))

    def chunked_layer_outputs(self, tokens: Sequence[int], chunk_size: int,
                              kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """:meth:`layer_outputs` with the prefill fed in chunks of ``chunk_size`` tokens (one
        engine call per chunk, through its KV cache): where inside the model a chunked
        prefill parts from one prefill (checks.path_layers)."""
        raise Unsupported(f"{self.name} traces no chunked prefill")

    def score_cached(self, tokens: Sequence[int], cached: int, *, top_k: int = 20) -> TokenLogprobs:
        """``tokens`` scored right after a request for their first ``cached`` tokens, with the
        engine's prefix cache on: rows computed from the cached KV blocks (``present`` marks
        the rows the engine computed; a cache hit leaves the cached ones out)."""
        raise Unsupported(f"{self.name} has no prefix cache ggufcheck can exercise")

    def judge_ties(self, *, indexer_margin: float, router_margin: float) -> None:
        """As the judging reference of an engine whose class may flip near-ties (checks.compare):
        mark as ambiguous the rows a DSA top-k boundary within ``indexer_margin`` or a MoE routing
        within ``router_margin`` of another choice decides, and every row after an exact tie.
        An engine whose scores carry no ambiguity (every one but the reference) ignores it."""

    def score_cold(self, tokens: Sequence[int], rows: Sequence[int], *, top_k: int = 20) -> TokenLogprobs:
        """Rows ``rows`` of ``tokens``, each the last row of a request for the tokens up to it
        with the engine's prompt cache off: one prefill of that prefix in one batch, from
        position 0 (``present`` marks the rows asked). For an engine whose :meth:`score` is
        stepwise (Capabilities.stepwise_score), the path its score does not take."""
        raise Unsupported(f"{self.name} has no cold prefill ggufcheck can request apart from score")

    def decode_layer_outputs(self, tokens: Sequence[int], prompt_length: int,
                             kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """:meth:`layer_outputs` of ``tokens`` fed as a decode feeds them: the first
        ``prompt_length`` in one prefill, then one token per step through the KV cache (the
        matrix-vector kernels and the cache the decode steps write): where inside the model a
        decode parts from the prefill of the same sequence (checks.path_layers)."""
        raise Unsupported(f"{self.name} traces no decode steps")

    def mtp_outputs(self, tokens: Sequence[int]) -> MTPTrace:
        """The engine's NextN / MTP draft head over ``tokens`` (a fresh sequence), fed as the
        engine feeds it when drafting: see :class:`MTPTrace` (checks.mtp)."""
        raise Unsupported(f"{self.name} does not expose its MTP / NextN draft head")

    def speculative_generate(self, prompt: Sequence[int], max_new_tokens: int) -> SpeculativeRun:
        """A greedy generation with the engine's own speculative decoding, and its draft counts:
        see :class:`SpeculativeRun` (checks.mtp)."""
        raise Unsupported(f"{self.name} does not report its own speculative decoding")

    def mtp_drafts(self, tokens: Sequence[int], start_rows: Sequence[int], n_draft: int) -> MTPDrafts:
        """The engine's NextN / MTP head drafting ``n_draft`` tokens from each of ``start_rows``
        of ``tokens`` (a fresh sequence), chained as its speculative decoding chains them: see
        :class:`MTPDrafts` (checks.mtp)."""
        raise Unsupported(f"{self.name} does not expose chained MTP / NextN drafts")

    def weight(self, hf_name: str, *, rank: int = 0) -> np.ndarray:
        """The weight the engine actually loaded under ``hf_name`` on TP rank ``rank``."""
        raise Unsupported(self.capabilities.why_not("weights"))

    def weight_experts(self, hf_name: str, experts: slice, *, rank: int = 0) -> np.ndarray:
        """Experts ``experts`` (a slice of the first axis) of a stacked expert parameter. An
        engine that can hand over part of a parameter overrides this, so the audit of a 256-expert
        layer holds a block of experts, not 26 GB; the default slices :meth:`weight`."""
        return self.weight(hf_name, rank=rank)[experts]

    def held_weight_names(self, *, rank: int = 0) -> list[str]:
        """Every parameter rank ``rank`` holds, by the names :meth:`weight` answers to (so the
        weights stage can say which ones it could not audit)."""
        raise Unsupported(self.capabilities.why_not("weights"))

    # ---- lifecycle ------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """A short JSON-able description for reports."""
        caps = self.capabilities
        out = {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "full_vocab": caps.full_vocab,
            "max_top_k": caps.max_top_k,
            "activation_dtype": caps.activation_dtype,
            "capabilities": [k for k in ("tokenize", "score", "generate", "batch", "chunked_prefill", "weights")
                             if getattr(caps, k)] + sorted(caps.layer_outputs),
        }
        version = getattr(self, "version", None)
        if version:
            out["version"] = version
        out["tp_size"] = caps.tp_size
        if caps.reference_options:  # the reference was built with the engine's documented semantics
            out["reference_adopts"] = dict(caps.reference_options)
        return out

    def close(self) -> None:
        """Release resources. Safe to call twice."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GGUFVocabTokenizer:
    """Mixin: ``tokenize`` / ``detokenize`` through the GGUF's own vocabulary.

    The adapter sets ``self._tokenizer`` (a :class:`ggufcheck.tokenizer.Tokenizer`) or leaves
    it None, in which case the Engine defaults raise :class:`Unsupported` with the reason.
    """

    _tokenizer: Any = None

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        if self._tokenizer is None:
            return super().tokenize(text)  # type: ignore[misc]
        return list(self._tokenizer.encode(text, add_special=add_special, parse_special=True))

    def detokenize(self, tokens: Sequence[int]) -> str:
        if self._tokenizer is None:
            return super().detokenize(tokens)  # type: ignore[misc]
        return self._tokenizer.decode([int(t) for t in tokens])


def log_softmax(logits: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """Row-wise log-softmax (a constant shift of the logits is not an error), computed in float64
    and returned as ``dtype``, one fused pass per row, rows in parallel (engines/rowwise.py: no
    [rows, V] temporaries, which on a 262k vocabulary over a 513-token prompt were 1 GB each)."""
    from ggufcheck.engines.rowwise import log_softmax_rows

    x = np.asarray(logits)
    if x.ndim == 1:
        return log_softmax(x[None], dtype)[0]
    return log_softmax_rows(x.reshape(-1, x.shape[-1]), dtype).reshape(x.shape)


def reasons(**why: str) -> Mapping[str, str]:
    """Read-only reason map for :class:`Capabilities` (``reasons(batch="...")``)."""
    return MappingProxyType(dict(why))
