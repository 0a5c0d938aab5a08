"""``--engine http://HOST:PORT[/v1]``: any OpenAI-compatible server, standard library only.

Three server dialects, detected from what the server answers (or forced with
``?kind=vllm|llama-cpp-python|llama-server`` on the spec):

- vLLM: ``/v1/completions`` with token-id prompts, ``prompt_logprobs`` (teacher-forced
  top-k at every prompt position, keyed by token id), ``logprobs`` with
  ``return_tokens_as_token_ids`` for decode steps, list prompts for batches, ``/tokenize``.
- llama-cpp-python's server: text prompts only; ``echo`` + ``logprobs`` on
  ``/v1/completions`` (keys are token TEXTS, mapped back to ids through the server's own
  ``/extras/tokenize``; texts that do not map to one id go to the tail bucket).
- llama-server: ``/completion`` with ``n_probs`` returns ids but no prompt log-probs, so
  teacher forcing is one ``n_predict: 1`` request per prefix (with ``cache_prompt``).

A llama.cpp server does not say where its matmuls run; ``?backend=cuda`` says they run on a
CUDA GPU (``llama-server -ngl 99``), so the baseline rounds as llama.cpp's CUDA backend does
(``engines.llama_cpp.gpu_rounding``: Q4_1 / Q5_1 products take CUDA's q8_1 block sums, ~5x
the CPU's rounding on those types; docs/real-world-cases.md case 4). The default is the CPU's.

Results follow the OpenAI semantics (entry i of an echoed prompt is the distribution that
predicts token i); a server that shifts them is reported by the checks, not corrected here.
Every request has a timeout and bounded retries with exponential backoff; a server that is
down, too slow or answers malformed JSON raises :class:`EngineUnreachable` (exit 3).
"""

from __future__ import annotations

from contextlib import contextmanager

import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ggufcheck.engines.base import (Capabilities, Engine, Generation, SpeculativeRun, TokenLogprobs, Unsupported,
                                    coarsest, reasons)
from ggufcheck.errors import EngineUnreachable

DIALECTS = ("vllm", "llama-cpp-python", "llama-server")
_UNKNOWN = object()


@dataclass(frozen=True)
class HttpOptions:
    timeout_s: float = 60.0  # per request
    retries: int = 2  # extra attempts after the first, for connection errors / 5xx / timeouts
    backoff_s: float = 0.5  # first retry delay; doubles each attempt
    top_k: int = 20


class Client:
    """JSON over HTTP with timeouts, bounded retries and one clear error."""

    def __init__(self, base_url: str, options: HttpOptions):
        self.base_url = base_url.rstrip("/")
        self.options = options

    def request(self, method: str, path: str, body: dict | None = None, *, retry: bool = True) -> Any:
        url = self.base_url + path
        data = json.dumps(body).encode("utf-8") if body is not None else None
        attempts = 1 + (self.options.retries if retry else 0)
        delay = self.options.backoff_s
        last = ""
        for attempt in range(attempts):
            req = urllib.request.Request(url, data=data, method=method,
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.options.timeout_s) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as err:
                detail = _snippet(err.read() if err.fp else b"")
                if err.code < 500:  # the request itself is wrong: retrying will not help
                    raise HttpStatusError(err.code, f"{method} {url} answered HTTP {err.code}: {detail}") from err
                last = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError) as err:
                reason = getattr(err, "reason", err)
                last = f"timed out after {self.options.timeout_s:g} s" if _is_timeout(reason) else f"{reason}"
            else:
                try:
                    return json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise EngineUnreachable(
                        f"{method} {url} answered malformed JSON ({err.msg if hasattr(err, 'msg') else err}): "
                        f"{_snippet(raw)}", tip="is this an OpenAI-compatible server? check --engine") from err
            if attempt + 1 < attempts:
                time.sleep(delay)
                delay *= 2
        raise EngineUnreachable(f"{method} {url} failed after {attempts} attempt(s): {last}",
                                tip="is the server running and reachable? (timeouts: see --timeout)")

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def get_text(self, path: str) -> str | None:
        """A plain-text page (Prometheus metrics), once, or None when it cannot be read."""
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=self.options.timeout_s) as resp:
                return resp.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError):
            return None

    def post(self, path: str, body: dict, **kw: Any) -> Any:
        return self.request("POST", path, body, **kw)


class HttpStatusError(EngineUnreachable):
    """A 4xx answer: the server is up but rejected the request."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


# what servers say when a request is longer than their context (vLLM: "max_tokens must be at
# least 1" when the prompt fills max_model_len, "maximum context length"; llama-server:
# "exceeds the available context size"; llama-cpp-python: "Requested tokens ... exceed context")
_CONTEXT_REFUSALS = ("max_tokens must be at least 1", "maximum context length", "context size",
                     "exceed context", "context window", "too long")


@contextmanager
def _context_refusal_is_unsupported(n_tokens: int):
    """A 400 that says the request does not fit the server's context is :class:`Unsupported`
    (the check that asked says which length and why), not an unreachable engine."""
    try:
        yield
    except HttpStatusError as err:
        if err.code == 400 and any(s in str(err).lower() for s in _CONTEXT_REFUSALS):
            raise Unsupported(f"the server refused {n_tokens} tokens as longer than its context: "
                              f"{str(err)[-160:]}") from None
        raise


def _is_timeout(reason: object) -> bool:
    return isinstance(reason, (socket.timeout, TimeoutError)) or "timed out" in str(reason)


def _snippet(raw: bytes, limit: int = 200) -> str:
    text = raw.decode("utf-8", errors="replace").strip().replace("\n", " ")
    return text[:limit] + ("..." if len(text) > limit else "") if text else "(empty body)"


def _field(doc: Any, *path: Any) -> Any:
    """doc[path...] or EngineUnreachable naming the missing field (malformed answers)."""
    cur = doc
    for key in path:
        try:
            cur = cur[key]
        except (KeyError, IndexError, TypeError) as err:
            where = "".join(f"[{k!r}]" for k in path)
            raise EngineUnreachable(f"the server's answer lacks {where} (got {_snippet(json.dumps(doc).encode())})",
                                    tip="the server does not speak the expected API; force it with ?kind=") from err
    return cur


# where a llama.cpp server's matmuls run (``?backend=``): its rounding follows
BACKENDS = ("cpu", "cuda")


def parse_spec(spec: str) -> tuple[str, str | None, str]:
    """``http://h:p[/v1][?kind=K][&backend=B]`` -> (server root URL without /v1, forced dialect
    or None, backend: "cpu" unless given)."""
    parsed = urllib.parse.urlsplit(spec)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"not an http(s) URL: {spec!r}")
    query = urllib.parse.parse_qs(parsed.query)
    unknown = sorted(set(query) - {"kind", "backend"})
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} (choose from kind=, backend=)")
    kind = query.get("kind", [None])[0]
    if kind is not None and kind not in DIALECTS:
        raise ValueError(f"unknown server kind {kind!r} (choose from {', '.join(DIALECTS)})")
    backend = query.get("backend", ["cpu"])[0]
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    path = parsed.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", "")), kind, backend


class HttpEngine(Engine):
    """An OpenAI-compatible server under test."""

    def __init__(self, spec: str, *, vocab_size: int | None = None, model_path: str | Path | None = None,
                 options: HttpOptions = HttpOptions()):
        root, kind, self.backend = parse_spec(spec)
        self.client = Client(root, options)
        self.options = options
        self.kind = kind or self._detect()
        self.model_id = self._model_id()
        meta_vocab, meta_bos = _vocab_from(model_path)
        self.vocab_size = int(vocab_size or meta_vocab or 0)
        self._bos_id: int | None | object = meta_bos if model_path is not None else _UNKNOWN
        if not self.vocab_size:
            raise Unsupported("the vocabulary size is unknown: pass the GGUF model path")
        self.name = f"{self.kind} at {root}"
        self._texts: dict[tuple[int, ...], str] = {}  # token ids -> the text they came from
        self._key_ids: dict[str, int | None] = {}  # token text (llama-cpp-python keys) -> id
        self._model_path = model_path
        self.draft_max = 3  # llama-server's --spec-draft-n-max default (its /props do not say)
        self.capabilities = self._capabilities()

    # ---- discovery ------------------------------------------------------------------------
    def _detect(self) -> str:
        try:
            props = self.client.get("/props", retry=False)
            if isinstance(props, dict) and ("default_generation_settings" in props or "n_ctx" in props):
                return "llama-server"
        except EngineUnreachable as err:
            if not isinstance(err, HttpStatusError):
                self.client.get("/v1/models")  # down or malformed: raise the clear error from here
        try:
            spec = self.client.get("/openapi.json", retry=False)
            paths = spec.get("paths", {}) if isinstance(spec, dict) else {}
        except HttpStatusError:
            paths = {}
        if "/extras/tokenize" in paths:
            return "llama-cpp-python"
        if "/tokenize" in paths or "/v1/completions" in paths:
            return "vllm"
        raise EngineUnreachable(f"{self.client.base_url} is not a recognized OpenAI-compatible server",
                                tip="force the dialect with ?kind=vllm|llama-cpp-python|llama-server")

    def _model_id(self) -> str | None:
        if self.kind == "llama-server":
            return None
        models = self.client.get("/v1/models")
        data = _field(models, "data")
        return str(_field(data, 0, "id")) if data else None

    def _capabilities(self) -> Capabilities:
        k = self.options.top_k
        common = dict(tokenize=True, score=True, full_vocab=False, max_top_k=k, generate=True,
                      activation_dtype=self._activation_class(), rounding=self._rounding())
        no_internals = dict(layer_outputs="an HTTP server exposes no per-layer tensors",
                            weights="an HTTP server exposes no loaded weights")
        if self.kind == "vllm":
            return Capabilities(**common, batch=True, chunked_prefill=False, reasons=reasons(
                chunked_prefill="vLLM sets its chunk size at server start (--max-num-batched-tokens); "
                                "restart it with another size and compare two runs", **no_internals))
        why_batch = ("llama-cpp-python's server scores one prompt per request" if self.kind == "llama-cpp-python"
                     else "llama-server's /completion takes one prompt per request here")
        return Capabilities(**common, batch=False, chunked_prefill=False, stepwise_score=self.kind == "llama-server",
                            reasons=reasons(
            batch=why_batch, chunked_prefill="the prefill chunk size is fixed at server start (n_batch)",
            **no_internals))

    def _activation_class(self) -> str:
        """The numerical class that picks the baseline allowance. vLLM: bf16 (its default dtype;
        the server does not report it). llama.cpp servers: from the file's weight types, as in
        process (f32 / f16 / bf16 weights keep that class, quantized ones quantize activations
        to 8 bits); q8 when the file is not given."""
        if self.kind == "vllm":
            return "bf16"
        if self._model_path is None:
            return "q8"
        from ggufcheck.engines.llama_cpp import activation_class  # reads the GGUF only

        # a server does not report its KV cache type: llama-server's and llama-cpp-python's
        # default, f16, is the finest a served cache is (F32 weights: not the fp32 class)
        return coarsest(activation_class(self._model_path), "fp16")

    def _rounding(self) -> dict[str, str]:
        """Where a llama.cpp server rounds (Capabilities.rounding), as in process with its
        default f16 KV cache, on the CPU or (``?backend=cuda``) on CUDA; vLLM and unknown files:
        from the class."""
        if self.kind == "vllm" or self._model_path is None:
            return {}
        from types import SimpleNamespace

        from ggufcheck.engines.llama_cpp import gpu_rounding, rounding

        where = gpu_rounding if self.backend == "cuda" else rounding
        return where(self._model_path, SimpleNamespace(type_k=1))  # 1: GGML_TYPE_F16

    # ---- tokenization ---------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        if self.kind == "llama-cpp-python":
            ids = [int(t) for t in _field(self.client.post("/extras/tokenize", {"input": text}), "tokens")]
        elif self.kind == "vllm":
            body = {"prompt": text, "add_special_tokens": add_special}
            if self.model_id:
                body["model"] = self.model_id
            ids = [int(t) for t in _field(self.client.post("/tokenize", body), "tokens")]
        else:
            ids = [int(t) for t in _field(self.client.post("/tokenize", {"content": text, "add_special": add_special}),
                                          "tokens")]
        self._texts[tuple(ids)] = text
        return ids

    def chat_tokens(self, messages: Sequence[dict]) -> list[int]:
        """The tokens a chat request feeds the model (checks.template): llama-server renders its
        template (``/apply-template``, as ``/v1/chat/completions`` does) and tokenizes the text
        with its specials parsed and BOS added, as it does a chat prompt; vLLM's ``/tokenize``
        takes the chat itself (``TokenizeChatRequest``) and renders it as its chat endpoint
        does (generation prompt on, no special tokens added beyond the template's: the
        defaults of both requests)."""
        if self.kind == "vllm":
            body: dict = {"messages": [dict(m) for m in messages], "add_generation_prompt": True,
                          "add_special_tokens": False}
            if self.model_id:
                body["model"] = self.model_id
            try:
                return [int(t) for t in _field(self.client.post("/tokenize", body), "tokens")]
            except HttpStatusError as err:  # e.g. no chat template in the served tokenizer
                raise Unsupported(f"vLLM's /tokenize refused the chat: {str(err)[-200:]}") from None
        if self.kind != "llama-server":
            raise Unsupported(f"{self.kind}'s server does not say here which tokens a chat request feeds")
        prompt = _field(self.client.post("/apply-template", {"messages": [dict(m) for m in messages]}), "prompt")
        body = {"content": str(prompt), "add_special": True, "parse_special": True}
        return [int(t) for t in _field(self.client.post("/tokenize", body), "tokens")]

    def detokenize(self, tokens: Sequence[int]) -> str:
        key = tuple(int(t) for t in tokens)
        if key in self._texts:
            return self._texts[key]
        toks = list(key)
        if self.kind == "llama-cpp-python":
            return str(_field(self.client.post("/extras/detokenize", {"tokens": toks}), "text"))
        if self.kind == "vllm":
            body = {"tokens": toks, **({"model": self.model_id} if self.model_id else {})}
            return str(_field(self.client.post("/detokenize", body), "prompt"))
        return str(_field(self.client.post("/detokenize", {"tokens": toks}), "content"))

    def _text_of(self, tokens: Sequence[int]) -> str:
        """The exact text for ``tokens`` (text-only servers): cached, else detokenized and verified."""
        key = tuple(int(t) for t in tokens)
        if key in self._texts:
            return self._texts[key]
        text = self.detokenize(key)
        if tuple(self.tokenize(text)) != key:
            raise Unsupported("this server takes text prompts and these tokens do not survive "
                              "detokenize -> tokenize on it; score sequences it tokenized itself")
        return text

    def _id_of_key(self, key: str) -> int | None:
        """Token id for a llama-cpp-python top_logprobs key (its text), via the server's tokenizer."""
        if key not in self._key_ids:
            ids = [] if key == "" else [int(t) for t in _field(self.client.post("/extras/tokenize", {"input": key}),
                                                              "tokens")]
            bos = self._bos()
            if len(ids) > 1 and bos is not None and ids[0] == bos:
                ids = ids[1:]
            self._key_ids[key] = ids[0] if len(ids) == 1 else None
        return self._key_ids[key]

    def _bos(self) -> int | None:
        """The model's BOS id (from the GGUF metadata; else what the server prepends to "")."""
        if self._bos_id is _UNKNOWN:
            ids = [int(t) for t in _field(self.client.post("/extras/tokenize", {"input": ""}), "tokens")]
            self._bos_id = ids[0] if len(ids) == 1 else None
        return self._bos_id

    # ---- scoring --------------------------------------------------------------------------
    def score(self, tokens: Sequence[int], *, top_k: int | None = None) -> TokenLogprobs:
        tokens = [int(t) for t in tokens]
        k = min(top_k or self.options.top_k, self.options.top_k)
        with _context_refusal_is_unsupported(len(tokens)):
            if self.kind == "vllm":
                return self._score_vllm([tokens], k)[0]
            if self.kind == "llama-cpp-python":
                return self._score_llama_cpp_python(tokens, k)
            return self._score_llama_server(tokens, k)

    def score_batch(self, batch: Sequence[Sequence[int]], *, top_k: int | None = None) -> list[TokenLogprobs]:
        if self.kind != "vllm":
            raise Unsupported(self.capabilities.why_not("batch"))
        with _context_refusal_is_unsupported(max((len(s) for s in batch), default=0)):
            return self._score_vllm([[int(t) for t in s] for s in batch], min(top_k or self.options.top_k,
                                                                             self.options.top_k))

    def _score_llama_cpp_python(self, tokens: list[int], k: int) -> TokenLogprobs:
        body = {"prompt": self._text_of(tokens), "max_tokens": 1, "temperature": 0.0, "echo": True,
                "logprobs": k, "top_k": 1, "seed": 0}
        if self.model_id:
            body["model"] = self.model_id
        answer = self.client.post("/v1/completions", body)
        lp = _field(answer, "choices", 0, "logprobs")
        tops = _field(lp, "top_logprobs")
        n = len(tokens)
        bos = self._bos()
        offset = 1 if bos is not None and tokens and tokens[0] == bos else 0  # the server drops a leading BOS
        if len(tops) < n - offset:
            raise EngineUnreachable(f"the server echoed {len(tops)} positions for a {n}-token prompt")
        rows = [None] * n
        for i, entry in enumerate(tops[: n - offset]):
            target = i + offset  # OpenAI semantics: entry i predicts prompt token i
            if entry is not None and target >= 1:
                rows[target - 1] = entry
        if len(tops) > n - offset and tops[n - offset] is not None:
            rows[n - 1] = tops[n - offset]  # the generated token's entry: the distribution after the prompt
        return self._table_from_text_rows(tokens, rows, k)

    def _table_from_text_rows(self, tokens: list[int], rows: list[dict | None], k: int) -> TokenLogprobs:
        n = len(tokens)
        ids = np.full((n, k + 1), -1, dtype=np.int64)  # +1: the observed token llama-cpp-python adds
        vals = np.full((n, k + 1), -np.inf)
        present = np.zeros(n, dtype=bool)
        for t, entry in enumerate(rows):
            if not isinstance(entry, dict):
                continue
            pairs = []
            for key, value in entry.items():
                tid = self._id_of_key(str(key))
                if tid is not None and value is not None and math.isfinite(float(value)):
                    pairs.append((float(value), tid))
            pairs = sorted(set(pairs), reverse=True)[: k + 1]
            seen: set[int] = set()
            j = 0
            for value, tid in pairs:
                if tid in seen:
                    continue
                seen.add(tid)
                ids[t, j], vals[t, j] = tid, value
                j += 1
            present[t] = True
        return TokenLogprobs(tokens, self.vocab_size, topk_ids=ids, topk_logprobs=vals, present=present)

    def _score_vllm(self, batch: list[list[int]], k: int) -> list[TokenLogprobs]:
        body = {"prompt": batch if len(batch) > 1 else batch[0], "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": k, "logprobs": k, "return_tokens_as_token_ids": True, "seed": 0}
        if self.model_id:
            body["model"] = self.model_id
        answer = self.client.post("/v1/completions", body)
        choices = sorted(_field(answer, "choices"), key=lambda c: c.get("index", 0))
        if len(choices) != len(batch):
            raise EngineUnreachable(f"vLLM returned {len(choices)} choices for {len(batch)} prompts")
        out = []
        for tokens, choice in zip(batch, choices):
            n = len(tokens)
            plp = _field(choice, "prompt_logprobs")
            ids = np.full((n, k + 1), -1, dtype=np.int64)
            vals = np.full((n, k + 1), -np.inf)
            present = np.zeros(n, dtype=bool)
            for i, entry in enumerate(plp[:n]):
                if i == 0 or not isinstance(entry, dict):
                    continue
                pairs = sorted(((float(v["logprob"] if isinstance(v, dict) else v), int(tid))
                                for tid, v in entry.items()), reverse=True)[: k + 1]
                for j, (value, tid) in enumerate(pairs):
                    ids[i - 1, j], vals[i - 1, j] = tid, value
                present[i - 1] = True
            last = _vllm_first_top(choice)
            if last is not None:
                for j, (tid, value) in enumerate(last[: k + 1]):
                    ids[n - 1, j], vals[n - 1, j] = tid, value
                present[n - 1] = True
            out.append(TokenLogprobs(tokens, self.vocab_size, topk_ids=ids, topk_logprobs=vals, present=present))
        return out

    def _score_llama_server(self, tokens: list[int], k: int) -> TokenLogprobs:
        """One n_predict=1 request per prefix: llama-server returns no prompt log-probs."""
        n = len(tokens)
        ids = np.full((n, k), -1, dtype=np.int64)
        vals = np.full((n, k), -np.inf)
        for t in range(n):
            probs = self._llama_server_step(tokens[: t + 1], k)
            for j, (tid, value) in enumerate(probs[:k]):
                ids[t, j], vals[t, j] = tid, value
        return TokenLogprobs(tokens, self.vocab_size, topk_ids=ids, topk_logprobs=vals)

    def score_cached(self, tokens: Sequence[int], cached: int, *, top_k: int = 20) -> TokenLogprobs:
        if self.kind == "llama-server":
            raise Unsupported("every row llama-server scores here is a request whose prefix its prompt cache holds: "
                              "paths.cold_prefill compares them with cold requests")
        if self.kind == "vllm":
            return self._vllm_score_cached([int(t) for t in tokens], int(cached), top_k)
        return super().score_cached(tokens, cached, top_k=top_k)

    def _vllm_score_cached(self, tokens: list[int], cached: int, k: int) -> TokenLogprobs:
        """Rows of ``tokens`` read through vLLM's prefix cache. vLLM reads the cache only for
        requests without prompt log-probs (``SamplingParams.skip_reading_prefix_cache``: the
        teacher-forced :meth:`score` is always cold), so a request for the first ``cached``
        tokens fills it, then each asked row (:func:`cached_rows`) is the next-token
        distribution of a one-token generation of the tokens up to it, whose prefix the cache
        holds. The server's own counters (``vllm:prefix_cache_hits`` on /metrics) must have
        moved: without a hit there is nothing to compare (prefix caching off, or a prefix
        shorter than one block), and the check says so instead of passing."""
        before = self._prefix_cache_hits()
        self._vllm_last_row(tokens[:cached], k)  # fills the prefix cache
        rows = cached_rows(len(tokens), cached)
        ids = np.full((len(tokens), k + 1), -1, dtype=np.int64)
        vals = np.full((len(tokens), k + 1), -np.inf)
        present = np.zeros(len(tokens), dtype=bool)
        for r in rows:
            for j, (tid, value) in enumerate(self._vllm_last_row(tokens[: r + 1], k)[: k + 1]):
                ids[r, j], vals[r, j] = tid, value
            present[r] = True
        after = self._prefix_cache_hits()
        if before is None or after is None:
            raise Unsupported("vLLM's server reports no prefix-cache counters on /metrics (vllm:prefix_cache_hits), "
                              "so a cache hit cannot be told from a cold request")
        if after <= before:
            raise Unsupported(f"vLLM's server counted no prefix-cache hit over {len(rows) + 1} requests sharing a "
                              f"{cached}-token prefix (prefix caching off, or the prefix is shorter than one block)")
        return TokenLogprobs(tokens, self.vocab_size, topk_ids=ids, topk_logprobs=vals, present=present)

    def _vllm_last_row(self, prefix: list[int], k: int) -> list[tuple[int, float]]:
        """[(id, logprob)] of the distribution after ``prefix``: one greedy token, no prompt log-probs."""
        body = {"prompt": prefix, "max_tokens": 1, "temperature": 0.0, "logprobs": k,
                "return_tokens_as_token_ids": True, "seed": 0}
        if self.model_id:
            body["model"] = self.model_id
        top = _vllm_first_top(_field(self.client.post("/v1/completions", body), "choices", 0))
        if top is None:
            raise EngineUnreachable("vLLM returned no log-probs for a one-token generation")
        return top

    def _prefix_cache_hits(self) -> float | None:
        """The sum of vLLM's ``vllm:prefix_cache_hits`` counters (tokens), or None when absent."""
        page = self.client.get_text("/metrics")
        if page is None:
            return None
        values = [float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                  if line.startswith("vllm:prefix_cache_hits") and not line.startswith("vllm:prefix_cache_hits_created")]
        return sum(values) if values else None

    def score_cold(self, tokens: Sequence[int], rows: Sequence[int], *, top_k: int | None = None) -> TokenLogprobs:
        """llama-server: each of ``rows`` from a request for the tokens up to it with
        ``cache_prompt: false``, which makes the slot start again from position 0 (server-
        context.cpp: ``n_past = 0``): the row is the last of one batched prefill of that prefix.
        :meth:`score` reads every row as a one-token step through the prompt cache instead."""
        if self.kind != "llama-server":
            raise Unsupported(f"{self.kind}'s score already prefills each sequence in one request")
        tokens = [int(t) for t in tokens]
        k = min(top_k or self.options.top_k, self.options.top_k)
        n = len(tokens)
        ids = np.full((n, k), -1, dtype=np.int64)
        vals = np.full((n, k), -np.inf)
        present = np.zeros(n, dtype=bool)
        with _context_refusal_is_unsupported(n):
            for t in sorted({int(r) for r in rows}):
                for j, (tid, value) in enumerate(self._llama_server_step(tokens[: t + 1], k, cache=False)[:k]):
                    ids[t, j], vals[t, j] = tid, value
                present[t] = True
        return TokenLogprobs(tokens, self.vocab_size, topk_ids=ids, topk_logprobs=vals, present=present)

    def _llama_server_step(self, prefix: list[int], k: int, *, cache: bool = True) -> list[tuple[int, float]]:
        """The top-k of the distribution after ``prefix`` ([(id, logprob)]), from one token.

        llama-server leaves a sampled token out of ``completion_probabilities`` while the text
        generated so far ends in an incomplete UTF-8 sequence (a byte token of a multi-byte
        character, common with CJK and emoji), so one greedy step can come back without
        probabilities. The probabilities it reports are the raw logits' (before samplers and
        logit bias), so the step is asked again with the partial token banned through
        ``logit_bias``: the same distribution, reported once a complete token is sampled.
        """
        banned: list[int] = []
        for _ in range(PARTIAL_PIECE_RETRIES + 1):
            body = {"prompt": prefix, "n_predict": 1, "n_probs": k, "temperature": 0.0, "cache_prompt": cache,
                    "samplers": ["top_k"], "top_k": 1, "return_tokens": True}
            if banned:
                body["logit_bias"] = [[t, False] for t in banned]
            answer = self.client.post("/completion", body)
            steps = answer.get("completion_probabilities") if isinstance(answer, dict) else None
            if steps:
                return _llama_server_probs(steps[0])
            sampled = answer.get("tokens") if isinstance(answer, dict) else None
            if not sampled:  # neither probabilities nor the sampled id: not this dialect
                _field(answer, "completion_probabilities", 0)
            banned.append(int(sampled[0]))
        raise Unsupported(f"llama-server kept sampling partial UTF-8 pieces after {prefix[-3:]}... "
                          f"(banned {banned}) and reported no probabilities for them")

    def _llama_server_generate(self, prompt: list[int], k: int, n_predict: int) -> tuple[list[int], dict[int, list]]:
        """Greedy ids and, per generated index, its top-k. With ``return_tokens`` the answer
        lists every generated id; ``completion_probabilities`` skips the partial UTF-8 pieces
        (see _llama_server_step), so its entries are matched to the ids in order and a piece
        without an entry has no row (not judged) rather than another token's row. A server
        running speculative decoding reports the tokens it accepted from a draft with an empty
        top list and logprob 0 (llama-cpp-python 0.3.36's llama-server, measured): no row either."""
        answer = self.client.post("/completion", {"prompt": prompt, "n_predict": n_predict, "n_probs": k,
                                                  "temperature": 0.0, "cache_prompt": True, "samplers": ["top_k"],
                                                  "top_k": 1, "return_tokens": True, "ignore_eos": True})
        steps = answer.get("completion_probabilities") if isinstance(answer, dict) else None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not tokens:  # a server without return_tokens: every entry is one generated token
            steps = _field(answer, "completion_probabilities")
            return [int(_field(step, "id")) for step in steps], {s: _llama_server_probs(st) for s, st in enumerate(steps)}
        generated = [int(t) for t in tokens]
        rows: dict[int, list] = {}
        at = 0
        for step in steps or []:
            tid = int(_field(step, "id"))
            while at < len(generated) and generated[at] != tid:
                at += 1  # a partial piece: no probabilities reported for it
            if at == len(generated):
                raise EngineUnreachable(f"llama-server reported probabilities for token {tid}, which is not among "
                                        f"the generated ids {generated}")
            probs = _llama_server_probs(step)
            if probs:  # with speculative decoding on, a token accepted from a draft comes with
                rows[at] = probs  # an empty top list (and logprob 0): no row, not an empty one
            at += 1
        return generated, rows

    def speculative_generate(self, prompt: Sequence[int], max_new_tokens: int) -> SpeculativeRun:
        """llama-server with speculative decoding on (``--spec-type draft-mtp`` ...): one greedy
        ``/completion`` (prompt cache off) and the draft counts its ``timings`` report
        (``draft_n``, ``draft_n_accepted``); K is :attr:`draft_max` (its ``/props`` do not tell
        it: llama-server's default of 3, or the ``spec_draft`` it was started with). Unsupported for other servers, and when the
        answer carries no draft counts (speculative decoding off)."""
        if self.kind != "llama-server":
            raise Unsupported(f"{self.name}: draft counts are read from llama-server's /completion timings only")
        prompt = [int(t) for t in prompt]
        answer = self.client.post("/completion", {"prompt": prompt, "n_predict": int(max_new_tokens),
                                                  "temperature": 0.0, "cache_prompt": False, "samplers": ["top_k"],
                                                  "top_k": 1, "return_tokens": True, "ignore_eos": True})
        timings = answer.get("timings") if isinstance(answer, dict) else None
        if not isinstance(timings, dict) or timings.get("draft_n") is None:
            raise Unsupported(f"{self.name} reports no draft counts: its speculative decoding is off "
                              "(llama-server --spec-type draft-mtp)")
        n_max = self.draft_max
        generated = tuple(int(t) for t in (answer.get("tokens") or []))
        return SpeculativeRun(tuple(prompt), generated, int(timings["draft_n"]), int(timings.get("draft_n_accepted", 0)),
                              int(n_max), "llama-server /completion timings.draft_n / draft_n_accepted")

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, top_k: int | None = None) -> Generation:
        with _context_refusal_is_unsupported(len(prompt) + max_new_tokens):
            return self._generate(prompt, max_new_tokens, top_k=top_k)

    def _generate(self, prompt: Sequence[int], max_new_tokens: int, *, top_k: int | None = None) -> Generation:
        prompt = [int(t) for t in prompt]
        k = min(top_k or self.options.top_k, self.options.top_k)
        n = len(prompt) + max_new_tokens
        ids = np.full((n, k + 1), -1, dtype=np.int64)
        vals = np.full((n, k + 1), -np.inf)
        generated: list[int] = []
        reported: set[int] | None = None  # generated indices with probabilities (None: all)
        if self.kind == "llama-server":
            generated, rows = self._llama_server_generate(prompt, k, max_new_tokens)
            reported = set(rows)
            for s, probs in rows.items():
                for j, (tid, value) in enumerate(probs[:k]):
                    ids[len(prompt) - 1 + s, j], vals[len(prompt) - 1 + s, j] = tid, value
        else:
            body: dict[str, Any] = {"max_tokens": max_new_tokens, "temperature": 0.0, "logprobs": k, "seed": 0}
            if self.model_id:
                body["model"] = self.model_id
            if self.kind == "vllm":
                body.update(prompt=prompt, return_tokens_as_token_ids=True, ignore_eos=True)
            else:
                body.update(prompt=self._text_of(prompt), top_k=1)
            choice = _field(self.client.post("/v1/completions", body), "choices", 0)
            lp = _field(choice, "logprobs")
            for s, (tok, top) in enumerate(zip(_field(lp, "tokens"), _field(lp, "top_logprobs"))):
                tid = _vllm_token_id(tok) if self.kind == "vllm" else self._id_of_key(tok)
                if tid is None:
                    raise Unsupported(f"generated token text {tok!r} does not map back to one token id")
                generated.append(tid)
                pairs = []
                for key, value in (top or {}).items():
                    kid = _vllm_token_id(key) if self.kind == "vllm" else self._id_of_key(key)
                    if kid is not None:
                        pairs.append((float(value), kid))
                for j, (value, kid) in enumerate(sorted(set(pairs), reverse=True)[: k + 1]):
                    ids[len(prompt) - 1 + s, j], vals[len(prompt) - 1 + s, j] = kid, value
            if self.kind == "llama-cpp-python":
                self._check_generated_text(prompt, generated, self._text_of(prompt) + str(choice.get("text", "")))
        m = len(generated)
        seq = prompt + generated
        present = np.zeros(len(seq), dtype=bool)
        present[len(prompt) - 1:len(prompt) - 1 + m] = True
        if reported is not None:
            for s in set(range(m)) - reported:
                present[len(prompt) - 1 + s] = False
        steps = TokenLogprobs(seq, self.vocab_size, topk_ids=ids[: len(seq)], topk_logprobs=vals[: len(seq)],
                              present=present)
        return Generation(np.array(prompt), np.array(generated, dtype=np.int64), steps)

    def _check_generated_text(self, prompt: list[int], generated: list[int], text: str) -> None:
        """llama-cpp-python returns generated tokens as text pieces, mapped back to ids one at a
        time. Where the whole text tokenizes to other ids (two pieces that merge, a piece split
        across UTF-8 bytes), prefill would score another sequence than decode produced, and
        prefill-vs-decode would raise a false alarm: decline the generation instead."""
        expected = prompt + generated
        actual = self.tokenize(text)
        if actual != expected:
            at = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), min(len(actual), len(expected)))
            raise Unsupported(f"this server returns generated tokens as text, and prompt + generated text "
                              f"tokenizes to {len(actual)} ids where its pieces gave {len(expected)} (first "
                              f"difference at position {at}): prefill and decode would see different sequences")
        self._texts[tuple(expected)] = text

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "server": self.client.base_url, "dialect": self.kind, "model": self.model_id}


# how many partial UTF-8 pieces one llama-server step may ban before giving up
PARTIAL_PIECE_RETRIES = 8


def cached_rows(n: int, cached: int, at_most: int = 8) -> list[int]:
    """At most ``at_most`` rows of an ``n``-token sequence past its first ``cached`` tokens
    (row r: the distribution after tokens[:r + 1]), evenly spread, the last included."""
    if cached >= n:
        return []
    return sorted({int(round(x)) for x in np.linspace(cached, n - 1, min(at_most, n - cached))})


def _vllm_first_top(choice: dict) -> list[tuple[int | None, float]] | None:
    """[(id, logprob)] of a completion choice's first generated token's top log-probs, highest
    first (``token_id:N`` keys), or None when the choice has none."""
    top = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0]
    if not isinstance(top, dict):
        return None
    pairs = sorted(((float(v), _vllm_token_id(key)) for key, v in top.items()), key=lambda e: e[0], reverse=True)
    return [(tid, value) for value, tid in pairs]


def _vllm_token_id(key: str) -> int | None:
    """vLLM's ``return_tokens_as_token_ids`` keys look like ``token_id:123``."""
    key = str(key)
    if key.startswith("token_id:") and key[9:].lstrip("-").isdigit():
        return int(key[9:])
    return None


def _llama_server_probs(step: Any) -> list[tuple[int, float]]:
    """[(id, logprob)] from one llama-server completion_probabilities entry (old and new formats)."""
    if "top_logprobs" in step:
        return [(int(e["id"]), float(e["logprob"])) for e in step["top_logprobs"]]
    return [(int(e["id"]), math.log(max(float(e["prob"]), 1e-45))) for e in _field(step, "probs")]


def _vocab_from(model_path: str | Path | None) -> tuple[int | None, int | None]:
    """(vocabulary size, BOS id) from the GGUF metadata, or (None, None) without a file."""
    if model_path is None:
        return None, None
    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(model_path) as model:
        tokens = model.get("tokenizer.ggml.tokens")
        bos = model.get("tokenizer.ggml.bos_token_id")
        return (len(tokens) if tokens is not None else None), (int(bos) if bos is not None else None)
