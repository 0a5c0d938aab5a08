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
    try:
        import llama_cpp
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise Unavailable(f"llama-cpp-python is not installed: {err}") from err
    from ggufcheck.engines.llama_cpp_logs import silence_llama_logs

    L = llama_cpp
    if not verbose:
        silence_llama_logs(L)
    tokens = [int(t) for t in tokens]
    n_tok = len(tokens)
    if n_tok == 0:
        raise Unavailable("no tokens to run")
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.load_mtp = True
    mparams.n_gpu_layers = int(n_gpu_layers)
    model = L.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise Unavailable(f"llama.cpp could not load {model_path} with load_mtp")
    ctxs: list[Any] = []
    batches: list[Any] = []
    try:
        if L.llama_model_n_layer_nextn(model) < 1:
            raise Unavailable(f"{model_path}: llama.cpp sees no NextN / MTP layers")
        n_embd = L.llama_model_n_embd_out(model)  # the MTP input row width (common/speculative.cpp)
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

        def context(ctx_type: int, embeddings: bool) -> Any:
            cp = L.llama_context_default_params()
            cp.n_ctx = max(64, n_tok + 8)
            cp.n_batch = cp.n_ubatch = max(64, n_tok)
            cp.n_seq_max = 1
            cp.n_threads = cp.n_threads_batch = n_threads
            cp.embeddings = embeddings
            cp.ctx_type = ctx_type
            if f32_cache:
                cp.type_k = cp.type_v = GGML_TYPE_F32
            if type_k is not None:
                cp.type_k = int(type_k)
            if type_v is not None:
                cp.type_v = int(type_v)
            if flash_attn is not None:
                cp.flash_attn_type = flash_attn
            ctx = L.llama_init_from_model(model, cp)
            if not ctx:
                raise Unavailable(f"llama.cpp could not create a {'MTP' if ctx_type else 'trunk'} context")
            ctxs.append(ctx)
            return ctx

        # the trunk: every row an output, h_nextn unmasked (as the driver sets ctx_tgt)
        tctx = context(0, True)
        nextn = _nextn_functions(L)
        if nextn is not None:
            nextn[0](tctx, True, False)
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
        trunk_logits = np.stack([_rows(L.llama_get_logits_ith(tctx, i), 1, n_vocab)[0] for i in range(n_tok)])
        same = None
        if nextn is not None:
            trunk = _rows(nextn[1](tctx), n_tok, n_embd)  # unmasked: row i = batch entry i
            same = bool(np.array_equal(trunk, embd))
        else:
            trunk = embd

        if states is None:
            fed = np.zeros_like(trunk)
            fed[1:] = trunk[:-1]
        else:
            fed = np.asarray(states, dtype=np.float32)
            if fed.shape != (n_tok, n_embd):
                raise ValueError(f"states must be [{n_tok}, {n_embd}], got {fed.shape}")
        fed = np.ascontiguousarray(fed, dtype=np.float32)

        mctx = context(LLAMA_CONTEXT_TYPE_MTP, False)
        mbatch = L.llama_batch_ext_init(mctx)
        batches.append(mbatch)
        step = chunk or n_tok
        logits = []
        for start in range(0, n_tok, step):
            L.llama_batch_ext_clear(mbatch)
            stop = min(start + step, n_tok)
            for p in range(start, stop):
                idx = L.llama_batch_ext_add_token(mbatch, 0, tokens[p])
                if idx < 0:
                    raise Unavailable(f"llama_batch_ext_add_token returned {idx}")
                pos = L.llama_pos(p)
                row = L.llama_embd(fed[p].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
                if not (L.llama_batch_ext_set_pos(mbatch, idx, ctypes.byref(pos))
                        and L.llama_batch_ext_set_embd_token(mbatch, idx, row)
                        and L.llama_batch_ext_set_output_logits(mbatch, idx, True)):
                    raise Unavailable(f"llama_batch_ext refused MTP row {p}")
            rc = L.llama_process(mctx, LLAMA_PROCESS_TYPE_DECODE, mbatch)
            if rc != 0:
                raise Unavailable(f"llama_process (MTP context) returned {rc} for rows {start}..{stop - 1}")
            logits += [_rows(L.llama_get_logits_ith(mctx, i), 1, n_vocab)[0] for i in range(stop - start)]
        return MTPRun(trunk_states=trunk, trunk_logits=trunk_logits, states_fed=fed, mtp_logits=np.stack(logits),
                      nextn_is_embeddings=same)
    finally:
        for b in batches:
            L.llama_batch_ext_free(b)
        for ctx in reversed(ctxs):
            L.llama_free(ctx)
        L.llama_model_free(model)
