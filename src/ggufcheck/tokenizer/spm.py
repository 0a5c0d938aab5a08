"""SentencePiece-style vocabularies (``tokenizer.ggml.model = "llama"``): Llama 1/2, Gemma.

Spaces become U+2581 (``▁``); with ``add_space_prefix`` a space is put in front of text
that starts the input or follows a special token. There is no pre-tokenizer: adjacent
symbols (characters at first) are merged when their concatenation is a vocabulary entry,
highest ``tokenizer.ggml.scores`` first (leftmost pair on a tie). A final symbol that is not
an entry (a character outside the vocabulary) falls back to its UTF-8 bytes as ``<0xXX>``
byte tokens. This is the merge order of llama.cpp's ``llm_tokenizer_spm_session``.
"""

from __future__ import annotations

import heapq
from typing import Any, Mapping

from ggufcheck.errors import GGUFCheckError
from ggufcheck.tokenizer.vocab import KEY, Tokenizer, TokenType, Vocab

SPACE = "\u2581"


class SPMTokenizer(Tokenizer):
    """Score-driven SentencePiece merging with byte fallback."""

    def __init__(self, meta: Mapping[str, Any], source: str | None):
        vocab = Vocab.from_metadata(
            meta,
            source=source,
            default_ids=(1, 2, 0),  # llama.cpp's SPM defaults: <s>, </s>, <unk>
            default_add_bos=True,
            default_add_space_prefix=True,
        )
        super().__init__(vocab)
        self.scores = vocab.scores if vocab.scores is not None else [0.0] * vocab.size
        self.byte_ids = self._byte_tokens()

    def _byte_tokens(self) -> list[int | None]:
        """Token id of each byte value: ``<0xXX>``, else the one-character text."""
        ids: list[int | None] = []
        for b in range(256):
            token_id = self.vocab.token_to_id.get(f"<0x{b:02X}>")
            if token_id is None and b < 128:
                token_id = self.vocab.token_to_id.get(chr(b))
            ids.append(token_id)
        return ids

    # -- encoding -------------------------------------------------------------------------
    def _encode_text(self, text: str, after_special: bool, out: list[int]) -> None:
        if self.vocab.add_space_prefix and after_special:
            text = " " + text
        text = text.replace(" ", SPACE)
        token_to_id = self.vocab.token_to_id
        for symbol in self._merge(text):
            token_id = token_to_id.get(symbol)
            if token_id is not None:
                out.append(token_id)
                continue
            for b in symbol.encode("utf-8"):
                byte_id = self.byte_ids[b]
                if byte_id is None:
                    raise GGUFCheckError(
                        f"{KEY}tokens has no byte token <0x{b:02X}> for character {symbol!r} "
                        "(the vocabulary cannot represent this text)"
                    )
                out.append(byte_id)

    def _merge(self, text: str) -> list[str]:
        """Merge adjacent symbols into vocabulary entries, best score first."""
        symbols = list(text)
        n = len(symbols)
        if n < 2:
            return symbols
        token_to_id = self.vocab.token_to_id
        scores = self.scores
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int]] = []  # (-score, left slot, merged length)

        def push(left: int, right: int) -> None:
            if left < 0 or right >= n:
                return
            merged = symbols[left] + symbols[right]
            token_id = token_to_id.get(merged)
            if token_id is not None:
                heapq.heappush(heap, (-scores[token_id], left, len(merged)))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, size = heapq.heappop(heap)
            right = nxt[left]
            if right >= n or not symbols[left] or len(symbols[left]) + len(symbols[right]) != size:
                continue  # stale: a side was merged into something else meanwhile
            symbols[left] += symbols[right]
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] < n:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        return [s for s in symbols if s]

    # -- decoding -------------------------------------------------------------------------
    def _piece(self, token_id: int) -> bytes:
        text = self.vocab.tokens[token_id]
        kind = self.vocab.types[token_id]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if kind == TokenType.NORMAL:
            return text.replace(SPACE, " ").encode("utf-8", "surrogateescape")
        if kind == TokenType.BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined types render as nothing (llama.cpp)
