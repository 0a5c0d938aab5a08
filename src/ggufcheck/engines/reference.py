"""``--engine reference``: ggufcheck's own readable model (ggufcheck.reference) as an Engine.

The reference computes in fp64 (the trusted comparison point) or fp32; the compare stage
runs it at fp64 for the distribution every engine is compared with, and at fp32 (or the
engine's dtype when it can) for the baseline: how far a correct low-precision run lands
from fp64. Prefill is one forward pass; ``generate`` is the reference's own token-by-token
decode through its KV cache; ``layer_outputs`` comes from its recorded trace.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ggufcheck.engines.base import LAYER_KINDS, Capabilities, Engine, GGUFVocabTokenizer, Generation, LayerTrace, TokenLogprobs, reasons


# traced passes' tables kept for score() (remember): a few prompts' [T, V], not a long sequence's
REMEMBER_BYTES = 256 << 20


class ReferenceEngine(GGUFVocabTokenizer, Engine):
    """The reference model over a GGUF file, ``dtype`` "fp64" (default) or "fp32"."""

    def __init__(self, model_path: str | Path, *, dtype: str = "fp64", device: str = "cpu", **options: Any):
        import torch

        from ggufcheck.reference.model import ReferenceModel

        self._torch = torch
        self.model = ReferenceModel(model_path, dtype=dtype, device=device, **options)
        self.dtype = dtype
        self.tie_margin = 0.0  # DSA: rows whose top-k boundary gap is within this are ambiguous (score)
        self.router_margin = 0.0  # MoE: rows whose routing gap is below this in any layer are ambiguous
        # as the judging reference: after an EXACT top-k tie at position t (the reference itself
        # is undetermined, e.g. ReLU'd indexer scores equal at 0) every later row reads t's keys
        # through attention, so those rows are ambiguous too
        self.exact_ties_onward = False
        self.vocab_size = int(self.model.gguf.tensors["token_embd.weight"].shape[0])
        emulation = self.model.emulation
        self.name = (f"reference {dtype} emulating {emulation.describe()} ({Path(model_path).name})"
                     if emulation is not None else f"reference {dtype} ({Path(model_path).name})")
        self._tokenizer = None
        self._remembered: dict[tuple[int, ...], tuple[Any, list]] = {}  # tokens -> (log-probs, marks)
        self._remembered_bytes = 0
        tokenizer_ok, why = self._load_tokenizer()
        self.capabilities = Capabilities(
            tokenize=tokenizer_ok, score=True, full_vocab=True, max_top_k=self.vocab_size, generate=True,
            batch=False, chunked_prefill=True, layer_outputs=frozenset({"residual", "after_attention", "attention",
                                                                        "ffn", "router", "indexer"}),
            activation_dtype=dtype,
            reasons=reasons(tokenize=why or "", batch="the reference runs one sequence at a time (it is the oracle)",
                            weights="use ggufcheck.reference.weights for the reference's own weights"),
        )

    def _load_tokenizer(self) -> tuple[bool, str | None]:
        try:
            from ggufcheck.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model.gguf)
            return True, None
        except Exception as err:  # noqa: BLE001 - any tokenizer problem just removes the capability
            return False, f"the GGUF's tokenizer is unavailable here: {err}"

    def remember(self, tokens: Sequence[int], trace: Any) -> None:
        """A traced prefill of ``tokens`` on this engine's own model (the layers stage runs one
        per prompt): its log-probs (and per-layer marks) serve :meth:`score` of the same tokens
        once, instead of running the same pass again; at most REMEMBER_BYTES of tables held."""
        logprobs = trace.logprobs
        size = logprobs.numel() * 8
        if self._remembered_bytes + size > REMEMBER_BYTES:
            return
        from types import SimpleNamespace

        marks = ([SimpleNamespace(topk_gap=layer.topk_gap, topk_ties=layer.topk_ties, router_gap=layer.router_gap)
                  for layer in trace.layers] if self._needs_marks() else [])  # what score() reads of a layer
        self._remembered[tuple(int(t) for t in tokens)] = (logprobs.detach().cpu(), marks)
        self._remembered_bytes += size

    def _needs_marks(self) -> bool:
        return bool(self.model.cfg.has_indexer or self.model.cfg.n_expert > 0)

    def _table(self, tokens: list[int], logits: Any) -> TokenLogprobs:
        return TokenLogprobs(tokens, self.vocab_size, log_softmax_rows(logits))

    def judge_ties(self, *, indexer_margin: float, router_margin: float) -> None:
        self.tie_margin, self.router_margin, self.exact_ties_onward = indexer_margin, router_margin, True

    def score(self, tokens: Sequence[int], *, top_k: int = 20) -> TokenLogprobs:
        """Prefill log-probs; with a DSA indexer, rows where any layer's top-k has a boundary tie
        are marked ambiguous (an engine may legitimately choose the other key there); with
        ``tie_margin`` > 0 also rows where a boundary is that close to a tie (the compared
        engine's class, checks.logits.INDEXER_TIE_MARGINS); with ``router_margin`` > 0, MoE
        rows whose routing gap is below it in any layer (checks.logits.ROUTER_TIE_MARGINS)."""
        tokens = [int(t) for t in tokens]
        routed = self.model.cfg.n_expert > 0 and self.router_margin > 0
        remembered = self._remembered.pop(tuple(tokens), None)  # the same pass, already run (remember)
        if remembered is not None:
            self._remembered_bytes -= remembered[0].numel() * 8
        with self._torch.no_grad():
            if not self.model.cfg.has_indexer and not routed:
                logits = remembered[0] if remembered is not None else self.model.prefill(tokens, trace=False)
                return self._table(tokens, logits)  # [T, V]
            logits, layers = remembered if remembered is not None else self.model.prefill_marks(tokens)
        ties = np.zeros(len(tokens), dtype=bool)
        for layer in layers:
            if layer.topk_gap is not None:
                ties |= layer.topk_gap.cpu().numpy() <= self.tie_margin
            elif layer.topk_ties is not None:
                ties |= layer.topk_ties.cpu().numpy().astype(bool)
            if routed and layer.router_gap is not None:
                ties |= layer.router_gap.cpu().numpy() < self.router_margin
            if self.exact_ties_onward:
                exact = (layer.topk_gap.cpu().numpy() <= 0.0 if layer.topk_gap is not None else
                         layer.topk_ties.cpu().numpy().astype(bool) if layer.topk_ties is not None else None)
                if exact is not None and exact.any():
                    ties[int(np.flatnonzero(exact)[0]):] = True
        return TokenLogprobs(tokens, self.vocab_size, log_softmax_rows(logits), ambiguous=ties)

    def score_chunked(self, tokens: Sequence[int], chunk_size: int, *, top_k: int = 20) -> TokenLogprobs:
        tokens = [int(t) for t in tokens]
        cache = self._chunk_cache()
        with self._torch.no_grad():
            parts = [self.model.forward(tokens[i:i + chunk_size], cache)[0] for i in range(0, len(tokens), chunk_size)]
        return self._table(tokens, self._torch.cat(parts, dim=0))

    def score_decoded(self, tokens: Sequence[int], prompt_length: int, *, top_k: int = 20) -> TokenLogprobs:
        """Teacher-forced as a decode computes it: the first ``prompt_length`` tokens in one
        forward, then one token per forward through the cache (each row as ``generate`` would
        compute it, for given tokens); the rows before the last prompt token are not reported."""
        tokens = [int(t) for t in tokens]
        cache = self._decode_cache(prompt_length)
        with self._torch.no_grad():
            parts = [self.model.forward(tokens[:prompt_length], cache)[0]]
            parts += [self.model.forward([t], cache)[0] for t in tokens[prompt_length:]]
        table = self._table(tokens, self._torch.cat(parts, dim=0))
        present = np.zeros(len(tokens), dtype=bool)
        present[prompt_length - 1:] = True
        return replace(table, present=present)

    def _chunk_cache(self):
        """The KV cache a chunked prefill runs through (fault engines substitute a broken one)."""
        from ggufcheck.reference.cache import KVCache

        return KVCache()

    def _decode_cache(self, prompt_length: int):
        """The KV cache ``generate`` decodes through (fault engines substitute a broken one)."""
        from ggufcheck.reference.cache import KVCache

        return KVCache()

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, top_k: int = 20) -> Generation:
        prompt = [int(t) for t in prompt]
        cache = self._decode_cache(len(prompt))
        n = len(prompt) + max_new_tokens
        table = np.zeros((n, self.vocab_size), dtype=np.float64)  # [T, V]
        generated: list[int] = []
        with self._torch.no_grad():
            logits = self.model.forward(prompt, cache)[0][-1]
            for step in range(max_new_tokens):
                row = self._torch.log_softmax(logits.to(self._torch.float64), dim=-1).cpu().numpy()
                table[len(prompt) - 1 + step] = row
                token = int(np.argmax(row))
                generated.append(token)
                if step + 1 < max_new_tokens:
                    logits = self.model.forward([token], cache)[0][-1]
        present = np.zeros(n, dtype=bool)
        present[len(prompt) - 1:len(prompt) - 1 + max_new_tokens] = True
        steps = TokenLogprobs(prompt + generated, self.vocab_size, table, present=present)
        return Generation(np.array(prompt), np.array(generated), steps)

    def layer_outputs(self, tokens: Sequence[int], kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        tokens = [int(t) for t in tokens]
        with self._torch.no_grad():
            trace = self.model.prefill(tokens, trace=True)
        fields = {"residual": "hidden", "after_attention": "after_attn", "attention": "attn_out", "ffn": "ffn_out", "router": "expert_ids",
                  "indexer": "topk"}
        out: dict[tuple[str, int], np.ndarray] = {}
        for i, layer in enumerate(trace.layers):
            for kind in kinds:
                value = getattr(layer, fields.get(kind, ""), None)
                if value is not None:
                    out[(kind, i)] = value.detach().cpu().numpy()
        return LayerTrace(np.array(tokens), out)

    def chunked_layer_outputs(self, tokens: Sequence[int], chunk_size: int,
                              kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """The residual stream and block outputs with the prompt run in chunks through the KV
        cache (as :meth:`score_chunked` runs it)."""
        tokens = [int(t) for t in tokens]
        return self._traced_pieces(tokens, range(0, len(tokens), chunk_size), chunk_size, self._chunk_cache(), kinds)

    def decode_layer_outputs(self, tokens: Sequence[int], prompt_length: int,
                             kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """The prompt in one prefill, then one token per step through the cache ``generate``
        decodes with."""
        tokens = [int(t) for t in tokens]
        prompt_length = max(1, min(int(prompt_length), len(tokens)))
        starts = [0, *range(prompt_length, len(tokens))]
        sizes = [prompt_length] + [1] * (len(tokens) - prompt_length)
        return self._traced_pieces(tokens, starts, sizes, self._decode_cache(prompt_length), kinds)

    def _traced_pieces(self, tokens: list[int], starts, sizes, cache, kinds: Sequence[str]) -> LayerTrace:
        """The layer tensors of ``tokens`` run piece by piece (``starts``; ``sizes``: one size
        or one per piece) through ``cache``, concatenated over the tokens."""
        fields = {"residual": "hidden", "after_attention": "after_attn", "attention": "attn_out", "ffn": "ffn_out"}
        parts: dict[tuple[str, int], list[np.ndarray]] = {}
        sizes = list(sizes) if not isinstance(sizes, int) else [sizes] * len(list(starts))
        with self._torch.no_grad():
            for start, size in zip(starts, sizes):
                _, layers, _ = self.model.forward(tokens[start:start + size], cache, keep_layers=True)
                for i, layer in enumerate(layers):
                    for kind in kinds:
                        if kind in fields:
                            parts.setdefault((kind, i), []).append(getattr(layer, fields[kind]).detach().cpu().numpy())
        return LayerTrace(np.array(tokens), {k: np.concatenate(v, axis=0) for k, v in parts.items()})

    def close(self) -> None:
        model = getattr(self, "model", None)
        if model is not None:
            model.close()
            self.model = None


def log_softmax_rows(logits: Any) -> np.ndarray:
    """Row-wise log-softmax of a [T, V] torch tensor as float64 numpy, in place in its float64
    CPU copy (no copy when already fp64 on the CPU), one fused pass per row, rows in parallel
    (engines/rowwise.py; torch's log_softmax / logsumexp held [T, V] temporaries, and on
    SmolLM2's 49k vocabulary took 1.6 s of a diagnosis)."""
    import torch

    from ggufcheck.engines.rowwise import log_softmax_rows as rows

    out = logits.detach().to("cpu", torch.float64).numpy()
    return rows(out, np.float64, out=out)

