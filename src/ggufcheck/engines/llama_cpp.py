"""``--engine llama-cpp``: llama.cpp in process through llama-cpp-python.

Full-vocabulary logits at every position (``logits_all=True``), greedy decoding one token
per ``llama_decode`` (the decode path, distinct from the batched prefill), chunked prefill
by limiting how many tokens each ``eval`` call submits, and per-layer tensors through
llama.cpp's scheduler evaluation callback (``cb_eval``) set on a second context of the
same loaded model. llama_cpp is imported only when this engine is opened.

llama.cpp on CPU quantizes activations to 8-bit blocks before a matmul with quantized
weights, so for quantized files its numerical class is "q8" (``activation_class``; see
``checks.logits`` for that allowance); F32 / F16 / BF16 files are fp32 / fp16 / bf16. The
context adds its own rounding (``context_class``): the KV cache types (F16 by default) and
flash attention; the coarser of the two classes is the engine's. The layer trace runs on a
context with the scoring context's parameters.

On a GPU (``n_gpu_layers`` > 0, a llama.cpp library built with CUDA: ``LLAMA_CPP_LIB_PATH``
names its folder) the quantized matmuls quantize activations to Q8_1 blocks of 32 values
(mmq / mmvq) whatever the weight type, and cuBLAS multiplies F16 weights in f16
(``gpu_rounding``). A library without a GPU backend makes a GPU request Unavailable.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ggufcheck.engines.base import (
    LAYER_KINDS,
    Capabilities,
    Engine,
    Generation,
    LayerTrace,
    MTPDrafts,
    MTPTrace,
    Switch,
    TokenLogprobs,
    Unsupported,
    coarsest,
    log_softmax,
    reasons,
)
from ggufcheck.engines.llama_cpp_logs import silence_llama_logs
from ggufcheck.errors import Unavailable

# llama.cpp graph node names (``cb(cur, "<name>", il)`` in src/models/*.cpp) per layer kind.
NODE_KINDS = {
    "l_out": "residual",  # the residual stream after the layer
    "ffn_inp": "after_attention",  # the residual stream after attention (MLA models name no attn_out)
    "attn_out": "attention",
    "ffn_out": "ffn",
    "ffn_moe_out": "moe",
    "ffn_moe_topk": "router",  # int32 expert ids chosen per token (a view: derived instead, see _trace)
    "ffn_moe_argsort": "router_order",  # int32 [T, n_expert] experts by selection score, best first
    "ffn_moe_probs": "router_probs",  # [T, n_expert] after the gating function
    "ffn_moe_probs_biased": "router_biased",  # + exp_probs_b: what the top-k is taken over
}
# gemma3.cpp names the blocks' outputs after their post-norms (what is added to the
# residual, as the reference's attn_out / ffn_out); its "ffn_out" is BEFORE the post-norm
NODE_KINDS_BY_ARCH = {
    "gemma3": {"l_out": "residual", "attn_post_norm": "attention", "ffn_post_norm": "ffn"},
}


def node_kinds(arch: str | None) -> dict[str, str]:
    """The graph nodes to capture per layer kind for a GGUF architecture."""
    return NODE_KINDS_BY_ARCH.get(arch or "", NODE_KINDS)




GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26


def dominant_weight_type(model_path: str | Path) -> str:
    """The most common ggml type among the file's 2-D ``blk.*`` weights ("F32" if none):
    the type whose kernels set llama.cpp's rounding (activation_class, rounding)."""
    from collections import Counter

    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(model_path) as model:
        types = Counter(t.qtype.name for t in model.tensors.values() if t.name.startswith("blk.") and len(t.ne) >= 2)
    return types.most_common(1)[0][0] if types else "F32"


def activation_class(model_path: str | Path) -> str:
    """The numerical class of llama.cpp's CPU matmuls for this file's weights.

    ggml converts a matmul's activations to the weight type's ``vec_dot_type``: F32 stays
    f32, F16 / BF16 weights round activations to f16 / bf16, and quantized weights quantize
    activations to 8-bit blocks (Q8_0 / Q8_1 / Q8_K). The most common type among the 2-D
    ``blk.*`` weights decides.
    """
    dominant = dominant_weight_type(model_path)
    return {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}.get(dominant, "q8")


def rounding(model_path: str | Path, params: Any) -> dict[str, str]:
    """Where llama.cpp on CPU rounds (Capabilities.rounding): activations to the dominant
    weight type's vec_dot_type (Q8_0 blocks for Q4_0..Q8_0, Q8_K for K-quants, f16 / bf16 for
    F16 / BF16 weights), the KV cache to type_k / type_v (f16 by default; a quantized cache
    as 8-bit blocks, an approximation)."""
    dominant = dominant_weight_type(model_path)
    out = {}
    if dominant != "F32":
        out["activations"] = {"F16": "f16", "BF16": "bf16"}.get(
            dominant, "q8_0" if dominant in VEC_DOT_Q8_0 else "q8_k")  # K, IQ, TQ types: Q8_K
    kv = {0: None, 1: "f16", 30: "bf16"}.get(int(params.type_k), "q8_0")
    if kv is not None:
        out["kv"] = kv
    if _gelu_family(model_path):  # ggml-cpu vec.h GGML_GELU_FP16: the GELU is an f16 table
        out["gelu"] = "f16"
    return out


def _gelu_family(model_path: str | Path) -> bool:
    """Whether the file's architecture has a GELU FFN (gemma: arch/families.py)."""
    from ggufcheck.arch.families import family
    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(model_path) as model:
        fam = family(str(model.metadata.get("general.architecture", "")))
    return fam is not None and fam.gemma


# ggml's vec_dot_type on CPU per weight type: the block format activations are quantized to
VEC_DOT_Q8_0 = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "IQ4_NL", "MXFP4"})


def gpu_rounding(model_path: str | Path, params: Any) -> dict[str, str]:
    """Where llama.cpp's CUDA backend rounds: the activations of quantized matmuls to Q8_1
    (blocks of 32, emulated as Q8_0) for every quant type, with the group sums of the
    activations taken before rounding where a weight's group offset multiplies them: on a
    prefill the matrix-matrix kernels' form (``block_sums`` ``cuda-mmq``: Q4_1, Q5_1, Q4_K, Q5_K,
    IQ1_S, and Q2_K with sums of 16 and scales of 64), on a decode step the matrix-vector
    kernels' (``decode_block_sums`` ``cuda-mmvq``: Q4_0, Q5_0, Q4_1, Q5_1, IQ1_S); reference/
    precision.py SUMS_FORMS, docs/real-world-cases.md case 4. F32 / F16 / BF16 weights in the
    kernels ggml-cuda picks for them by token count and shape (``float_sums`` ``cuda``:
    precision.Emulation.float_form; ``glu_fusion`` off with GGML_CUDA_DISABLE_FUSION), every
    matmul's result in f32; the KV cache as on CPU."""
    from ggufcheck.gguf.matmuls import matmul_weight_types, routed_expert_types
    from ggufcheck.gguf.reader import open_gguf  # not reference.precision: it imports torch, which a
    # CUDA libllama must never meet in its process (engines/isolated.py)

    out = rounding(model_path, params)
    out.pop("gelu", None)  # CUDA's GELU computes in f32
    out.pop("outputs", None)  # CUDA's matmuls return f32 (but cuBLAS's F16 compute type: float_sums)
    if out.get("activations") in ("q8_0", "q8_k"):
        out["activations"] = "q8_0"
    with open_gguf(model_path) as model:
        types = {t.qtype.name for t in model.tensors.values() if len(t.ne) >= 2}
        expert_types = routed_expert_types(model.tensors)
        matmuls = set(matmul_weight_types(model.tensors))
    if types & (CUDA_MMQ_SUM_TYPES | CUDA_MMVQ_SUM_TYPES):
        out["block_sums"] = "cuda-mmq"
        out["decode_block_sums"] = "cuda-mmvq"
    if "F16" in expert_types:
        out["decode_unemulated"] = CUDA_F16_EXPERTS_DECODE
    if matmuls & {"F32", "F16", "BF16"}:  # the tensor-core and vector paths (precision.Emulation.float_form)
        # the engine's process reads GGML_CUDA_* (engines/spec.py cublas_f32=1 / cuda_fusion=0 set them there)
        forced = os.environ.get("GGML_CUDA_CUBLAS_COMPUTE_TYPE", "").lower()
        out["float_sums"] = "cuda-cublas-f32" if forced in ("f32", "fp32") else "cuda"
        if os.environ.get("GGML_CUDA_DISABLE_FUSION"):
            out["glu_fusion"] = False
    pieces = [int(v) for v in (getattr(params, "n_batch", 0), getattr(params, "n_ubatch", 0)) if v]
    if pieces:  # a prompt reaches the kernels in pieces of at most this many tokens (the kernel choice)
        out["ubatch"] = min(pieces)
    return out


# F16 routed experts on a one-token step, measured on the H200 and the H100 (2026-12-07,
# tools/gpu/llama_cpp_cuda.sh f16moe / floatpaths): KL 1.3e-3 against ~1e-6 for every other
# path of the same file, unchanged with fusion or CUDA graphs off. ggml-cuda's source gives
# that step the fused vector kernel for gate / up (f32 sums) and the mma kernel for down
# (f16 activations, f32 sums), which the reference computes (precision.Emulation.float_form)
# at ~1e-6: the measured KL is not explained by the arithmetic (an earlier reading blamed
# cuBLAS's F16 compute type; that path takes only experts past 512 tokens). Judged by the
# class allowance until it is.
CUDA_F16_EXPERTS_DECODE = ("F16 routed experts' one-token steps round ~1000x more on the H100 / H200 than the "
                           "arithmetic ggml-cuda's source gives them (fused vector gate / up, mma down), not "
                           "explained yet")


# the weight types whose group offsets multiply CUDA's q8_1 sums, per kernel (reference.precision.
# SUMS_FORMS, which this module cannot import: torch; a test keeps the two equal)
CUDA_MMQ_SUM_TYPES = frozenset({"Q4_1", "Q5_1", "Q4_K", "Q5_K", "IQ1_S", "Q2_K"})
CUDA_MMVQ_SUM_TYPES = frozenset({"Q4_0", "Q5_0", "Q4_1", "Q5_1", "IQ1_S"})


def llama_cpp_switches(params: Any, n_gpu_layers: int, n_batch: int) -> tuple[Switch, ...]:
    """The settings of this context a user flips to find a cause (checks.switches), each where
    it is not at its safe value: flash attention, a KV cache of another type than F16, the GPU
    offload, and on a GPU the prompt pieces that take the matrix-matrix kernels."""
    out = []
    if int(getattr(params, "flash_attn_type", 0)) != 0:  # enabled (1) or auto (-1)
        out.append(Switch({"flash_attn": 0}, {"flash_attn": int(params.flash_attn_type)},
                          "the flash-attention path", "attention"))
    kv = {"type_k": int(params.type_k), "type_v": int(params.type_v)}
    if kv != {"type_k": 1, "type_v": 1}:
        out.append(Switch({"type_k": 1, "type_v": 1}, kv, "a KV cache stored in another type than F16", "kv-cache"))
    if n_gpu_layers:
        # isolate=1: the same GPU library, never in a process with torch (engines/isolated.py)
        out.append(Switch({"n_gpu_layers": 0, "isolate": 1}, {"n_gpu_layers": n_gpu_layers},
                          "the GPU backend (every layer on the CPU instead)", "kernel"))
        if n_batch > 8:
            out.append(Switch({"n_batch": 8}, {"n_batch": n_batch}, "the matrix-matrix kernels (a prompt in pieces "
                              "of 8 tokens takes the matrix-vector ones)", "kernel"))
        # the CUDA backend's runtime switches, read from this process's environment when it
        # loaded (engines/spec.py LLAMA_CPP_CUDA_ENV sets them in the engine's own process)
        if not os.environ.get("GGML_CUDA_DISABLE_GRAPHS"):
            out.append(Switch({"cuda_graphs": 0}, {"cuda_graphs": 1}, "CUDA graphs (the decode's kernels replayed "
                              "from a captured graph)", "kernel"))
        if not os.environ.get("GGML_CUDA_DISABLE_FUSION"):
            out.append(Switch({"cuda_fusion": 0}, {"cuda_fusion": 1}, "the CUDA backend's fused kernels", "kernel"))
    return tuple(out)


GGML_TYPE_CLASS = {0: "fp32", 1: "fp16", 30: "bf16"}  # KV cache types; any other (Q8_0, Q4_0, ...) is q8


def context_class(params: Any) -> str:
    """The precision a llama.cpp context itself imposes: its KV cache types (K and V are
    stored rounded to them; llama.cpp's default is F16) and flash attention (the CPU kernel
    converts Q to F16 for its dot products)."""
    kv = [GGML_TYPE_CLASS.get(int(t), "q8") for t in (params.type_k, params.type_v)]
    flash = int(getattr(params, "flash_attn_type", 0)) == 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
    return coarsest(*kv, "fp16" if flash else "fp32")


def library_dir(llama_cpp_module: Any) -> Path:
    """The folder llama-cpp-python loaded libllama from (LLAMA_CPP_LIB_PATH, else its own lib/)."""
    base = getattr(getattr(llama_cpp_module, "llama_cpp", None), "_base_path", None)
    return Path(base) if base is not None else Path(llama_cpp_module.__file__).parent / "lib"


class _GGMLTensorHead(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (ggml.h); the rest is read via ggml calls."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


class LlamaCppEngine(Engine):
    """llama.cpp in process. ``n_ctx`` bounds the longest sequence scored."""

    def __init__(self, model_path: str | Path, *, n_ctx: int = 2048, n_threads: int | None = None,
                 n_batch: int = 512, seed: int = 0, n_gpu_layers: int = 0, verbose: int = 0, **kwargs: Any):
        try:
            import llama_cpp
        except (ImportError, OSError, RuntimeError) as err:  # not installed, or its library will not load
            raise Unavailable(f"llama-cpp-python is not usable here ({err})",
                              tip="pip install llama-cpp-python; for a GPU, LLAMA_CPP_LIB_PATH names a "
                                  "folder with a CUDA build's libllama.so") from err
        if n_gpu_layers and not llama_cpp.llama_supports_gpu_offload():
            raise Unavailable(f"the llama.cpp library llama-cpp-python loaded ({library_dir(llama_cpp)}) has no "
                              "GPU backend, so n_gpu_layers cannot offload",
                              tip="build llama.cpp with -DGGML_CUDA=ON and set LLAMA_CPP_LIB_PATH to its "
                                  "build/bin (tools/gpu/llama_cpp_cuda.sh)")
        self.on_gpu = bool(n_gpu_layers)
        self._n_gpu_layers = int(n_gpu_layers)
        self._lib = llama_cpp
        self.model_path = str(model_path)
        from ggufcheck.runtime import threads as runtime_threads

        threads = n_threads or max(1, min(8, runtime_threads()))
        if "flash_attn" in kwargs:
            kwargs["flash_attn"] = bool(kwargs["flash_attn"])
        if not verbose:
            silence_llama_logs(llama_cpp)
        try:
            self._llm = llama_cpp.Llama(
                model_path=self.model_path, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                n_threads_batch=threads, logits_all=True, seed=seed, verbose=bool(verbose),
                n_gpu_layers=n_gpu_layers, **kwargs,
            )
        except ValueError as err:  # llama.cpp refused the model or the context settings
            from ggufcheck.errors import UsageError

            hint = ("a quantized V cache needs flash attention (flash_attn=1)"
                    if kwargs.get("type_v") not in (None, 0, 1, 30) and not kwargs.get("flash_attn") else
                    "check the options against the model (verbose=1 shows llama.cpp's log)")
            raise UsageError(f"--engine llama-cpp: llama.cpp refused {Path(self.model_path).name} with "
                             f"{kwargs or 'these settings'}: {err}", tip=hint) from None
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.vocab_size = int(self._llm.n_vocab())
        self.name = f"llama-cpp ({Path(self.model_path).name}{', GPU' if self.on_gpu else ''})"
        self.version = f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, library {library_dir(llama_cpp)}"
        params = self._llm.context_params
        self._arch = (self._llm.metadata or {}).get("general.architecture")
        self._node_kinds = node_kinds(self._arch)
        round_at = (gpu_rounding if self.on_gpu else rounding)(self.model_path, params)
        self.capabilities = Capabilities(
            tokenize=True, score=True, full_vocab=True, max_top_k=self.vocab_size, generate=True,
            batch=False, chunked_prefill=True,
            layer_outputs=frozenset(self._node_kinds.values()),
            activation_dtype=coarsest(activation_class(self.model_path), context_class(params)),
            max_sequence=n_ctx, rounding=round_at,
            # llama-cpp-python feeds a prompt in pieces of n_batch; llama.cpp splits each into
            # micro-batches of n_ubatch
            prefill_micro_batch=min(n_batch, int(self._llm.context_params.n_ubatch) or n_batch),
            reasons=reasons(
                batch="llama-cpp-python's Llama object decodes one sequence at a time",
                weights="llama-cpp-python exposes no loaded-tensor access by HF name",
            ),
            switches=llama_cpp_switches(params, n_gpu_layers, n_batch),
        )

    # ---- tokenization ---------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._llm.detokenize([int(t) for t in tokens]).decode("utf-8", errors="replace")

    # ---- scoring ------------------------------------------------------------------------
    def _check_length(self, n: int) -> None:
        if n > self.n_ctx:
            raise Unsupported(f"sequence of {n} tokens exceeds this engine's n_ctx={self.n_ctx}")
        if n == 0:
            raise ValueError("cannot score an empty token sequence")

    def _table(self, tokens: Sequence[int]) -> TokenLogprobs:
        n = len(tokens)
        return TokenLogprobs(tokens, self.vocab_size, log_softmax(self._llm.scores[:n], np.float32))  # [T, V]

    def score(self, tokens: Sequence[int], *, top_k: int = 20) -> TokenLogprobs:
        tokens = [int(t) for t in tokens]
        self._check_length(len(tokens))
        self._llm.reset()
        self._llm.eval(tokens)
        return self._table(tokens)

    def score_chunked(self, tokens: Sequence[int], chunk_size: int, *, top_k: int = 20) -> TokenLogprobs:
        tokens = [int(t) for t in tokens]
        self._check_length(len(tokens))
        if not 1 <= chunk_size <= self.n_batch:
            raise Unsupported(f"chunk size {chunk_size} outside 1..n_batch={self.n_batch}")
        self._llm.reset()
        for start in range(0, len(tokens), chunk_size):
            self._llm.eval(tokens[start:start + chunk_size])  # one llama_decode per chunk
        return self._table(tokens)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, top_k: int = 20) -> Generation:
        prompt = [int(t) for t in prompt]
        self._check_length(len(prompt) + max_new_tokens)
        self._llm.reset()
        self._llm.eval(prompt)
        n_total = len(prompt) + max_new_tokens
        table = np.zeros((n_total, self.vocab_size), dtype=np.float32)  # [T, V]
        generated: list[int] = []
        for step in range(max_new_tokens):
            row = len(prompt) + step - 1
            logits = np.array(self._llm.scores[self._llm.n_tokens - 1], dtype=np.float32)
            table[row] = log_softmax(logits[None])[0]
            token = int(np.argmax(logits))
            generated.append(token)
            if step + 1 < max_new_tokens:
                self._llm.eval([token])  # one-token decode step
        present = np.zeros(n_total, dtype=bool)
        present[len(prompt) - 1:len(prompt) - 1 + max_new_tokens] = True
        seq = prompt + generated
        steps = TokenLogprobs(seq, self.vocab_size, table, present=present)
        return Generation(np.array(prompt), np.array(generated), steps)

    def chat_tokens(self, messages: Sequence[dict]) -> list[int]:
        """The tokens llama-cpp-python's chat completion feeds the model for ``messages``: its
        own handler (the file's template, or the format it guessed from it) runs as for a
        request, and its prompt is captured where it reaches ``create_completion``, before any
        decoding."""
        class Captured(Exception):
            pass

        seen: dict = {}

        def capture(prompt, *args, **kwargs):
            seen["prompt"] = prompt
            raise Captured

        self._llm.create_completion = capture  # an instance attribute: the method is untouched
        try:
            self._llm.create_chat_completion(messages=[dict(m) for m in messages], max_tokens=1)
        except Captured:
            pass
        finally:
            del self._llm.create_completion
        prompt = seen.get("prompt")
        if prompt is None:
            raise Unsupported("llama-cpp-python's chat handler did not reach create_completion")
        if isinstance(prompt, str):  # a handler that passes text: the completion tokenizes it as below
            prompt = self._llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        return [int(t) for t in prompt]

    # ---- per-layer tensors through cb_eval ---------------------------------------------
    def layer_outputs(self, tokens: Sequence[int], kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """Capture named graph nodes of one prefill through ``cb_eval`` on a fresh context."""
        return self._trace([int(t) for t in tokens], kinds, None)

    def chunked_layer_outputs(self, tokens: Sequence[int], chunk_size: int,
                              kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """The same nodes with the prompt fed as one ``llama_decode`` per chunk of ``chunk_size``
        tokens, as :meth:`score_chunked` feeds it."""
        if not 1 <= chunk_size <= self.n_batch:
            raise Unsupported(f"chunk size {chunk_size} outside 1..n_batch={self.n_batch}")
        tokens = [int(t) for t in tokens]
        return self._trace(tokens, kinds, [int(chunk_size)] * -(-len(tokens) // int(chunk_size)))

    def decode_layer_outputs(self, tokens: Sequence[int], prompt_length: int,
                             kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """The same nodes with the prompt in one ``llama_decode`` and every later token in one
        of its own, as :meth:`generate` feeds them."""
        tokens = [int(t) for t in tokens]
        prompt_length = max(1, min(int(prompt_length), len(tokens)))
        return self._trace(tokens, kinds, [prompt_length] + [1] * (len(tokens) - prompt_length))

    def _trace(self, tokens: list[int], kinds: Sequence[str], pieces: list[int] | None) -> LayerTrace:
        """The named nodes of ``tokens`` fed as one ``llama_decode`` per piece (``pieces``: their
        sizes; None: one prefill)."""
        lib = self._lib
        self._check_length(len(tokens))
        node_kinds_ = self._node_kinds
        wanted = {name for name, kind in node_kinds_.items()
                  if (kind in kinds and kind != "router") or (kind == "router_order" and "router" in kinds)}
        ggml = ctypes.CDLL(str(library_dir(lib) / "libggml-base.so"))
        ggml.ggml_get_name.restype = ctypes.c_char_p
        ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
        ggml.ggml_nbytes.restype = ctypes.c_size_t
        ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        ggml.ggml_is_contiguous.restype = ctypes.c_bool
        ggml.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
        captured: dict[tuple[str, int], list[np.ndarray]] = {}
        names: dict[tuple[str, int], str] = {}
        seen: set[tuple[str, int]] = set()  # this llama_decode's nodes: a reshape may reuse a node's name

        def key_of(name: str) -> tuple[str, int] | None:
            base, _, layer = name.rpartition("-")
            if base in wanted and layer.isdigit():
                return node_kinds_[base], int(layer)
            return None

        @lib.ggml_backend_sched_eval_callback
        def callback(tensor: int, ask: bool, _user: int) -> bool:
            name = ggml.ggml_get_name(tensor).decode("utf-8", "replace")
            key = key_of(name)
            if ask:
                return key is not None
            if key is None or key in seen:
                return True
            head = _GGMLTensorHead.from_address(tensor)
            if head.type not in (GGML_TYPE_F32, GGML_TYPE_I32) or not ggml.ggml_is_contiguous(tensor):
                return True
            nbytes = ggml.ggml_nbytes(tensor)
            dtype = np.float32 if head.type == GGML_TYPE_F32 else np.int32
            buf = np.empty(nbytes // 4, dtype=dtype)
            ggml.ggml_backend_tensor_get(tensor, buf.ctypes.data, 0, nbytes)
            ne = [int(head.ne[i]) for i in range(4)]
            # ggml ne0 is fastest: numpy order is [ne3, ne2, ne1, ne0]; tokens are ne1 here
            arr = buf.reshape(ne[1], ne[0]) if ne[2] * ne[3] == 1 else buf.reshape(ne[::-1])  # [T, D]
            captured.setdefault(key, []).append(arr.astype(np.float32))
            names[key] = name
            seen.add(key)
            return True

        # the scoring context's own parameters (KV cache types, flash attention, offload...):
        # a trace under other settings would judge another precision than the one served
        params = lib.llama_context_params.from_buffer_copy(self._llm.context_params)
        params.n_ctx = self.n_ctx
        params.n_batch = params.n_ubatch = max(len(tokens), 1)
        params.n_threads = params.n_threads_batch = self._llm.n_threads
        params.cb_eval = callback
        params.cb_eval_user_data = None
        ctx = lib.llama_init_from_model(self._llm._model.model, params)
        if not ctx:
            raise Unsupported("llama.cpp refused a second context for the trace")
        sizes = pieces or [len(tokens)]
        try:
            batch = lib.llama_batch_init(max(sizes), 0, 1)
            try:
                start = 0
                for size in sizes:  # one llama_decode per piece
                    piece = tokens[start:start + size]
                    batch.n_tokens = len(piece)
                    for j, tok in enumerate(piece):
                        batch.token[j] = tok
                        batch.pos[j] = start + j
                        batch.n_seq_id[j] = 1
                        batch.seq_id[j][0] = 0
                        batch.logits[j] = True
                    seen.clear()
                    if lib.llama_decode(ctx, batch) != 0:
                        raise Unsupported("llama_decode failed during the layer trace")
                    start += size
            finally:
                lib.llama_batch_free(batch)
        finally:
            lib.llama_free(ctx)
        if not captured:
            raise Unsupported("llama.cpp's eval callback produced none of the named layer nodes")
        tensors = {k: np.concatenate(v, axis=0) if len(v) > 1 else v[0] for k, v in captured.items()}
        # ffn_moe_topk is a view of the argsort, contiguous (so read by the callback) only for a
        # one-token batch: a prompt fed in chunks would yield its last one-token chunk's ids
        # alone. The chosen experts are always the argsort's first expert_used_count columns.
        used = int((self._llm.metadata or {}).get(f"{self._arch}.expert_used_count", 0) or 0)
        for (kind, i), order in list(tensors.items()):
            if kind == "router_order" and used and "router" in kinds:
                tensors[("router", i)] = np.ascontiguousarray(order[:, :used])
        return LayerTrace(np.array(tokens), tensors, names)

    def mtp_outputs(self, tokens: Sequence[int]) -> MTPTrace:
        """llama.cpp's NextN / MTP head over ``tokens``, run as its draft-mtp driver runs it
        (engines/llama_cpp_mtp.py): the model loaded again with its NextN layers, this
        engine's GPU offload, threads, flash attention and KV cache types."""
        from ggufcheck.engines.llama_cpp_mtp import run_mtp

        tokens = [int(t) for t in tokens]
        self._check_length(len(tokens))
        p = self._llm.context_params
        run = run_mtp(self.model_path, tokens, n_threads=int(p.n_threads), f32_cache=False,
                      flash_attn=int(p.flash_attn_type), n_gpu_layers=self._n_gpu_layers,
                      type_k=int(p.type_k), type_v=int(p.type_v))
        table = TokenLogprobs(tokens, self.vocab_size, log_softmax(run.mtp_logits, np.float32))
        return MTPTrace(np.asarray(tokens), run.states_fed, table, np.argmax(run.trunk_logits, axis=-1),
                        run.trunk_states)

    def mtp_drafts(self, tokens: Sequence[int], start_rows: Sequence[int], n_draft: int) -> MTPDrafts:
        """llama.cpp's NextN / MTP head drafting ``n_draft`` tokens from each start row, chained
        as its draft-mtp driver chains them (engines/llama_cpp_mtp.py ``draft_mtp``), with this
        engine's GPU offload, threads, flash attention and KV cache types."""
        from ggufcheck.engines.llama_cpp_mtp import draft_mtp

        tokens = [int(t) for t in tokens]
        self._check_length(len(tokens) + int(n_draft))
        p = self._llm.context_params
        run = draft_mtp(self.model_path, tokens, [int(r) for r in start_rows], int(n_draft), n_threads=int(p.n_threads),
                        f32_cache=False, flash_attn=int(p.flash_attn_type), n_gpu_layers=self._n_gpu_layers,
                        type_k=int(p.type_k), type_v=int(p.type_v))
        n_start, n_draft = run.fed_tokens.shape
        logprobs = log_softmax(run.logits.reshape(n_start * n_draft, -1), np.float32).reshape(run.logits.shape)
        return MTPDrafts(np.asarray(tokens), run.states_fed, np.asarray(run.start_rows), run.fed_tokens,
                         run.fed_states, logprobs, np.argmax(run.trunk_logits, axis=-1), run.trunk_states)

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.close()
            self._llm = None
