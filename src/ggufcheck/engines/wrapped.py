"""An engine that delegates to another: the base of every wrapper that changes one path.

Product code wraps an engine to correct what it reports (checks/alignment.py realigns a
server's prompt log-prob rows); the fault kit (engines/faults.py) wraps one to corrupt a path.
Both override :meth:`WrappedEngine.corrupt` (every scored table passes through it) or the
calls they change, and delegate the rest.
"""

from __future__ import annotations

from typing import Sequence

from ggufcheck.engines.base import Engine, Generation, TokenLogprobs


class WrappedEngine(Engine):
    """Delegates everything to ``inner``; subclasses corrupt one path."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.name = f"{type(self).__name__}({inner.name})"
        self.capabilities = inner.capabilities
        self.vocab_size = inner.vocab_size

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.inner.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.inner.detokenize(tokens)

    def score(self, tokens: Sequence[int], *, top_k: int = 20) -> TokenLogprobs:
        return self.corrupt(self.inner.score(tokens, top_k=top_k))

    def score_batch(self, batch, *, top_k: int = 20):
        return [self.corrupt(t) for t in self.inner.score_batch(batch, top_k=top_k)]

    def score_chunked(self, tokens, chunk_size, *, top_k: int = 20):
        return self.corrupt(self.inner.score_chunked(tokens, chunk_size, top_k=top_k))

    def generate(self, prompt, max_new_tokens, *, top_k: int = 20) -> Generation:
        return self.inner.generate(prompt, max_new_tokens, top_k=top_k)

    def corrupt(self, table: TokenLogprobs) -> TokenLogprobs:
        return table

    def close(self) -> None:
        self.inner.close()
