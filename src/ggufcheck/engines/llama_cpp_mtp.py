"""llama.cpp's NextN / MTP draft head, driven through llama-cpp-python's low-level bindings.

Why this file exists: the in-process engine (engines/llama_cpp.py) scores the trunk; the
MTP head that llama.cpp runs for speculative decoding (``--spec-type draft-mtp``) is a
second context over the same model and is invisible there. This module runs it the way
llama.cpp's own driver does (common/speculative.cpp, ``common_speculative_impl_draft_mtp``),
so its logits can be judged against the reference's (reference/mtp.py):

1. the model is loaded with ``llama_model_params.load_mtp = true`` (otherwise the NextN
   tensors are skipped: ``TENSOR_SKIP`` in each ``load_arch_tensors``);
2. a normal context runs the trunk over the prompt with ``llama_set_embeddings_nextn(ctx,
   true, masked=false)`` and every row an output; ``llama_get_embeddings_nextn`` then holds
   the trunk's ``h_nextn`` per row: the last residual after ``output_norm`` (each trunk
   graph's ``res->t_h_nextn``, the same tensor as the embeddings output ``result_norm``);
3. a second context with ``ctx_type = LLAMA_CONTEXT_TYPE_MTP`` (its graph is the model's
   ``graph_mtp``, its KV cache holds the NextN layer only) gets one ``llama_batch_ext``
   entry per prompt token: token ``x_p`` at position ``p``, its embedding slot carrying the
   trunk state of row ``p - 1`` (row 0: zeros, the driver's fresh ``pending_h``), output
   logits on. ``llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)`` runs it.

The state goes in through ``llama_batch_ext_set_embd_token`` (common_batch::set_embd does
exactly that), not ``llama_batch_ext_set_embd_state``: in this llama.cpp the latter is a stub
that returns false (src/llama-batch.cpp, "// TODO"); an MTP context sizes the embedding
slot as ``n_embd_out`` (``llama_batch_ext_select_n_embd_inp``) and ``llm_graph_input_embd_h``
copies a row that has both a token and an embedding into the head's ``mtp_h_input``.

``llama_set_embeddings_nextn`` / ``llama_get_embeddings_nextn`` are declared in llama.cpp's
staging header (src/llama-ext.h) with C++ linkage: llama-cpp-python has no binding, and the
library exports them under their mangled names, which are called here. Without them the
embeddings output (``llama_get_embeddings_ith``) is the same tensor (checked when both are
available: :attr:`MTPRun.nextn_is_embeddings`).

Drafting more than one token (:func:`draft_mtp`) chains the one NextN block as the driver's
``draft()`` does (common/speculative.cpp, the ``else`` branch of its step loop): step k + 1 is
step k's greedy draft at position ``pos0 + k`` carrying the head's own output state of step k
(``llama_get_embeddings_nextn_ith(ctx_dft, i_last)``, the MTP graph's ``h_nextn`` after
shared_head_norm, read with ``llama_set_embeddings_nextn(ctx_dft, true, masked=true)``),
through the MTP context's KV cache, which holds the ``process()`` catch-up rows before
``pos0`` and the earlier steps.

llama_cpp is imported only when a function here is called.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ggufcheck.errors import Unavailable

LLAMA_CONTEXT_TYPE_MTP = 1
LLAMA_PROCESS_TYPE_DECODE = 1
GGML_TYPE_F32 = 0
# llama-ext.h (C++ linkage): void llama_set_embeddings_nextn(llama_context *, bool, bool);
# float * llama_get_embeddings_nextn(llama_context *)
_SET_NEXTN = "_Z26llama_set_embeddings_nextnP13llama_contextbb"
_GET_NEXTN = "_Z26llama_get_embeddings_nextnP13llama_context"
# float * llama_get_embeddings_nextn_ith(llama_context *, int32_t): the head's own state (a chained step's input)
_GET_NEXTN_ITH = "_Z30llama_get_embeddings_nextn_ithP13llama_contexti"


@dataclass
class MTPRun:
    """What llama.cpp computed for one prompt (all float32 numpy arrays)."""

    trunk_states: np.ndarray  # [T, D] the trunk's h_nextn per row (what the head is fed, shifted)
    trunk_logits: np.ndarray  # [T, V]
    states_fed: np.ndarray  # [T, D] the state each MTP row carried
    mtp_logits: np.ndarray  # [T, V] the MTP head's logits per row (row p predicts x_{p+1})
    nextn_is_embeddings: bool | None  # h_nextn == the embeddings output, bit for bit (None: not checked)


def _nextn_functions(llama_cpp: Any) -> tuple[Any, Any] | None:
    lib = llama_cpp.llama_cpp._lib
    try:
        set_fn, get_fn = getattr(lib, _SET_NEXTN), getattr(lib, _GET_NEXTN)
    except AttributeError:
        return None
    set_fn.argtypes, set_fn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
    get_fn.argtypes, get_fn.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)
    return set_fn, get_fn


def _rows(ptr: Any, n_rows: int, width: int) -> np.ndarray:
    if not ptr:
        raise Unavailable("llama.cpp returned no output rows")
    return np.ctypeslib.as_array(ptr, shape=(n_rows * width,)).reshape(n_rows, width).copy()


class _Loaded:
    """One model loaded with its NextN layers, and the contexts made over it (freed on exit)."""

    def __init__(self, model_path: str | Path, n_tok: int, *, n_threads: int, f32_cache: bool,
                 flash_attn: int | None, verbose: bool, n_gpu_layers: int, type_k: int | None,
                 type_v: int | None):
        try:
            import llama_cpp
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise Unavailable(f"llama-cpp-python is not installed: {err}") from err
        from ggufcheck.engines.llama_cpp_logs import silence_llama_logs

        self.L = L = llama_cpp
        if not verbose:
            silence_llama_logs(L)
        self.model_path, self.n_tok = model_path, n_tok
        self.settings = dict(n_threads=n_threads, f32_cache=f32_cache, flash_attn=flash_attn, type_k=type_k,
                             type_v=type_v)
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.load_mtp = True
        mparams.n_gpu_layers = int(n_gpu_layers)
        self.model = L.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise Unavailable(f"llama.cpp could not load {model_path} with load_mtp")
        self.ctxs: list[Any] = []
        self.batches: list[Any] = []

    def __enter__(self) -> "_Loaded":
        L = self.L
        if L.llama_model_n_layer_nextn(self.model) < 1:
            self.__exit__()
            raise Unavailable(f"{self.model_path}: llama.cpp sees no NextN / MTP layers")
        self.n_embd = L.llama_model_n_embd_out(self.model)  # the MTP input row width (common/speculative.cpp)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.nextn = _nextn_functions(L)
        return self

    def __exit__(self, *exc: Any) -> None:
        for b in self.batches:
            self.L.llama_batch_ext_free(b)
        for ctx in reversed(self.ctxs):
            self.L.llama_free(ctx)
        self.batches, self.ctxs = [], []
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None

    def context(self, ctx_type: int, embeddings: bool, n_ctx: int | None = None) -> Any:
        L, s, n_tok = self.L, self.settings, self.n_tok
        cp = L.llama_context_default_params()
        cp.n_ctx = max(64, n_ctx or n_tok + 8)
        cp.n_batch = cp.n_ubatch = max(64, n_tok)
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = s["n_threads"]
        cp.embeddings = embeddings
        cp.ctx_type = ctx_type
        if s["f32_cache"]:
            cp.type_k = cp.type_v = GGML_TYPE_F32
        if s["type_k"] is not None:
            cp.type_k = int(s["type_k"])
        if s["type_v"] is not None:
            cp.type_v = int(s["type_v"])
        if s["flash_attn"] is not None:
            cp.flash_attn_type = s["flash_attn"]
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise Unavailable(f"llama.cpp could not create a {'MTP' if ctx_type else 'trunk'} context")
        self.ctxs.append(ctx)
        return ctx

    def trunk(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray, bool | None]:
        """The trunk over ``tokens``, every row an output, h_nextn unmasked (as the driver sets
        ctx_tgt): (h_nextn [T, D], logits [T, V], whether h_nextn == the embeddings output)."""
        L, n_tok, n_embd = self.L, len(tokens), self.n_embd
        tctx = self.context(0, True)
        if self.nextn is not None:
            self.nextn[0](tctx, True, False)
        batch = L.llama_batch_init(n_tok, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = n_tok
            rc = L.llama_decode(tctx, batch)
        finally:
            L.llama_batch_free(batch)
        if rc != 0:
            raise Unavailable(f"llama_decode (trunk) returned {rc}")
        embd = np.stack([_rows(L.llama_get_embeddings_ith(tctx, i), 1, n_embd)[0] for i in range(n_tok)])
        logits = np.stack([_rows(L.llama_get_logits_ith(tctx, i), 1, self.n_vocab)[0] for i in range(n_tok)])
        if self.nextn is None:
            return embd, logits, None
        trunk = _rows(self.nextn[1](tctx), n_tok, n_embd)  # unmasked: row i = batch entry i
        return trunk, logits, bool(np.array_equal(trunk, embd))

    def fed(self, trunk: np.ndarray, states: np.ndarray | None) -> np.ndarray:
        """The state each MTP row carries: ``states`` [T, D], or the driver's pairing of the
        trunk's (row p: the trunk state of row p - 1; row 0: zeros)."""
        if states is None:
            fed = np.zeros_like(trunk)
            fed[1:] = trunk[:-1]
        else:
            fed = np.asarray(states, dtype=np.float32)
            if fed.shape != trunk.shape:
                raise ValueError(f"states must be {list(trunk.shape)}, got {list(fed.shape)}")
        return np.ascontiguousarray(fed, dtype=np.float32)

    def add_rows(self, batch: Any, tokens: Sequence[int], positions: Sequence[int], states: np.ndarray,
                 output: bool) -> None:
        """Append MTP rows to ``batch``: token, position, the carried state in the embedding
        slot (common_batch::set_embd), output logits on or off."""
        L, n_embd = self.L, self.n_embd
        for t, p, h in zip(tokens, positions, states):
            idx = L.llama_batch_ext_add_token(batch, 0, int(t))
            if idx < 0:
                raise Unavailable(f"llama_batch_ext_add_token returned {idx}")
            pos = L.llama_pos(int(p))
            h = np.ascontiguousarray(h, dtype=np.float32)
            row = L.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
            if not (L.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos))
                    and L.llama_batch_ext_set_embd_token(batch, idx, row)
                    and L.llama_batch_ext_set_output_logits(batch, idx, bool(output))):
                raise Unavailable(f"llama_batch_ext refused the MTP row at position {p}")


def run_mtp(model_path: str | Path, tokens: Sequence[int], *, states: np.ndarray | None = None,
            chunk: int | None = None, n_threads: int = 2, f32_cache: bool = True,
            flash_attn: int | None = 0, verbose: bool = False, n_gpu_layers: int = 0,
            type_k: int | None = None, type_v: int | None = None) -> MTPRun:
    """Run llama.cpp's trunk and its MTP head over ``tokens`` (a fresh sequence).

    ``states``: the state each MTP row carries [T, D] (default: llama.cpp's own trunk states
    paired as its draft-mtp driver pairs them). ``chunk``: submit the MTP rows in batches of
    this many (1: row by row through the head's KV cache, as drafting does); default all at
    once, as the driver's ``process()`` hook does for a prompt. ``f32_cache``: F32 KV caches
    (llama.cpp's default is F16). ``flash_attn``: llama_flash_attn_type (-1 auto, 0 off, 1
    on, None llama.cpp's default: auto); off by default, as llama-cpp-python's ``Llama``:
    ggml's CPU flash attention rounds to f16 (measured on the tiny models: trunk states
    ~3e-3 apart from the fp64 reference with it, ~1e-6 without). ``n_gpu_layers``,
    ``type_k`` / ``type_v`` (ggml type ids, over ``f32_cache``): a deployment's settings.
    """
    tokens = [int(t) for t in tokens]
    n_tok = len(tokens)
    if n_tok == 0:
        raise Unavailable("no tokens to run")
    with _Loaded(model_path, n_tok, n_threads=n_threads, f32_cache=f32_cache, flash_attn=flash_attn,
                 verbose=verbose, n_gpu_layers=n_gpu_layers, type_k=type_k, type_v=type_v) as m:
        L = m.L
        trunk, trunk_logits, same = m.trunk(tokens)
        fed = m.fed(trunk, states)
        mctx = m.context(LLAMA_CONTEXT_TYPE_MTP, False)
        mbatch = L.llama_batch_ext_init(mctx)
        m.batches.append(mbatch)
        step = chunk or n_tok
        logits = []
        for start in range(0, n_tok, step):
            L.llama_batch_ext_clear(mbatch)
            stop = min(start + step, n_tok)
            m.add_rows(mbatch, tokens[start:stop], range(start, stop), fed[start:stop], True)
            rc = L.llama_process(mctx, LLAMA_PROCESS_TYPE_DECODE, mbatch)
            if rc != 0:
                raise Unavailable(f"llama_process (MTP context) returned {rc} for rows {start}..{stop - 1}")
            logits += [_rows(L.llama_get_logits_ith(mctx, i), 1, m.n_vocab)[0] for i in range(stop - start)]
        return MTPRun(trunk_states=trunk, trunk_logits=trunk_logits, states_fed=fed, mtp_logits=np.stack(logits),
                      nextn_is_embeddings=same)


@dataclass
class MTPDraftRun:
    """llama.cpp's head drafting ``n_draft`` tokens from each start row (float32 numpy arrays;
    S start rows, K draft steps)."""

    trunk_states: np.ndarray  # [T, D]
    trunk_logits: np.ndarray  # [T, V]
    states_fed: np.ndarray  # [T, D] the state each MTP row of the sequence carried (the head's cache rows)
    start_rows: list[int]  # [S]
    fed_tokens: np.ndarray  # [S, K] the token each draft step was fed (step 1: tokens[p]; then the draft before)
    fed_states: np.ndarray  # [S, K, D] the state each draft step was fed (step 1: the trunk's of row p - 1;
    #                         then the head's own h_nextn of the step before)
    logits: np.ndarray  # [S, K, V] the head's logits at each step (step k: the draft of tokens[p + k])
    hidden: np.ndarray  # [S, K, D] the head's own h_nextn at each step (llama_get_embeddings_nextn_ith)

    @property
    def drafts(self) -> np.ndarray:
        """[S, K] the greedy draft at each step (the top-1 of the driver's top-k sampler)."""
        return np.argmax(self.logits, axis=-1)


def draft_mtp(model_path: str | Path, tokens: Sequence[int], start_rows: Sequence[int], n_draft: int, *,
              states: np.ndarray | None = None, feed: tuple[np.ndarray, np.ndarray] | None = None,
              n_threads: int = 2, f32_cache: bool = True, flash_attn: int | None = 0, verbose: bool = False,
              n_gpu_layers: int = 0, type_k: int | None = None, type_v: int | None = None) -> MTPDraftRun:
    """Draft ``n_draft`` tokens from each start row p, as llama.cpp's draft-mtp driver does
    with one NextN block (common/speculative.cpp ``common_speculative_impl_draft_mtp``):

    - ``process()`` has run the head over the sequence's rows before p (token x_r at
      position r with the trunk state of row r - 1; output off): the MTP context's KV cache
      holds those rows, and nothing from p on (the server removes ctx_dft's positions past
      the target's with ``llama_memory_seq_rm`` after each draft, server-context.cpp);
    - ``draft()`` step 1 decodes ``id_last`` = x_p at ``pos0`` = p carrying ``pending_h``
      (the trunk state of row p - 1); step i + 1 decodes the step-i draft (the greedy top-1
      of its top-k sampler) at position p + i carrying the head's own output state of step i
      (``llama_get_embeddings_nextn_ith(ctx_dft, i_last)``: the MTP graph's ``h_nextn``, after
      shared_head_norm), through the same KV cache, which now holds the earlier steps too.

    Start rows are drafted in decreasing order over one MTP context: before each,
    ``llama_memory_seq_rm(p, -1)`` leaves exactly the rows before p (as the server does).
    ``states``: the state each row of the sequence carries [T, D] (default: the driver's
    pairing of llama.cpp's own trunk states). ``feed``: (tokens [S, K], states [S, K, D]) to
    feed each step instead of the chain's own (a teacher-forced chain; a negative control).
    Other arguments as :func:`run_mtp`. The driver's ``p_min`` cut (default 0) is not applied:
    every step is drafted."""
    tokens = [int(t) for t in tokens]
    starts = [int(p) for p in start_rows]
    n_tok, n_draft = len(tokens), int(n_draft)
    if n_tok == 0 or not starts or n_draft < 1:
        raise Unavailable("no tokens, start rows or draft steps to run")
    if min(starts) < 0 or max(starts) >= n_tok:
        raise ValueError(f"start rows must lie in 0..{n_tok - 1}, got {starts}")
    with _Loaded(model_path, n_tok, n_threads=n_threads, f32_cache=f32_cache, flash_attn=flash_attn,
                 verbose=verbose, n_gpu_layers=n_gpu_layers, type_k=type_k, type_v=type_v) as m:
        L, n_embd = m.L, m.n_embd
        trunk, trunk_logits, _ = m.trunk(tokens)
        fed = m.fed(trunk, states)
        mctx = m.context(LLAMA_CONTEXT_TYPE_MTP, False, n_ctx=max(starts) + n_draft + 8)
        if m.nextn is None:
            raise Unavailable("llama.cpp exports no llama_set_embeddings_nextn: the head's own state, which a "
                              "chained draft step is fed, cannot be read")
        m.nextn[0](mctx, True, True)  # masked, as the driver sets ctx_dft
        get_ith = getattr(L.llama_cpp._lib, _GET_NEXTN_ITH, None)
        if get_ith is None:
            raise Unavailable("llama.cpp exports no llama_get_embeddings_nextn_ith")
        get_ith.argtypes, get_ith.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)
        mem = L.llama_get_memory(mctx)
        batch = L.llama_batch_ext_init(mctx)
        m.batches.append(batch)

        def process(rows_tokens, positions, rows_states, output) -> None:
            L.llama_batch_ext_clear(batch)
            m.add_rows(batch, rows_tokens, positions, rows_states, output)
            rc = L.llama_process(mctx, LLAMA_PROCESS_TYPE_DECODE, batch)
            if rc != 0:
                raise Unavailable(f"llama_process (MTP context) returned {rc} at positions {list(positions)}")

        last = max(starts)
        if last > 0:  # the process() hook's catch-up over the rows before the latest start
            process(tokens[:last], range(last), fed[:last], False)
        n_start = len(starts)
        out_tokens = np.zeros((n_start, n_draft), dtype=np.int64)
        out_states = np.zeros((n_start, n_draft, n_embd), dtype=np.float32)
        out_logits = np.zeros((n_start, n_draft, m.n_vocab), dtype=np.float32)
        out_hidden = np.zeros((n_start, n_draft, n_embd), dtype=np.float32)
        for s in sorted(range(n_start), key=lambda i: -starts[i]):
            p = starts[s]
            if not L.llama_memory_seq_rm(mem, 0, p, -1):
                raise Unavailable(f"llama.cpp could not remove the MTP cache's positions from {p}")
            token, state = tokens[p], fed[p]
            for k in range(n_draft):
                if feed is not None:
                    token, state = int(feed[0][s][k]), np.asarray(feed[1][s][k], dtype=np.float32)
                process([token], [p + k], state[None], True)
                out_tokens[s, k], out_states[s, k] = token, state
                out_logits[s, k] = _rows(L.llama_get_logits_ith(mctx, 0), 1, m.n_vocab)[0]
                out_hidden[s, k] = _rows(get_ith(mctx, 0), 1, n_embd)[0]
                token, state = int(np.argmax(out_logits[s, k])), out_hidden[s, k]
        return MTPDraftRun(trunk_states=trunk, trunk_logits=trunk_logits, states_fed=fed, start_rows=starts,
                           fed_tokens=out_tokens, fed_states=out_states, logits=out_logits, hidden=out_hidden)
