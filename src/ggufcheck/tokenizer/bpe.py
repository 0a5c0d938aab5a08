"""Byte-level BPE (``tokenizer.ggml.model = "gpt2"``): GPT-2's byte alphabet plus ranked merges.

Text is pre-tokenized by the regexes the file's ``tokenizer.ggml.pre`` names
(``pretokenizers.py``); each pre-token's UTF-8 bytes are written in GPT-2's printable
byte alphabet; then adjacent symbols are merged, lowest merge rank first (leftmost pair on
a tie), until no ranked pair is left. The symbols are the token texts.
"""

from __future__ import annotations

import heapq
from typing import Any, Mapping

from ggufcheck.errors import Unavailable
from ggufcheck.tokenizer.pretokenizers import PRE_TOKENIZERS, UNSUPPORTED, PreTokenizer, split
from ggufcheck.tokenizer.vocab import KEY, Tokenizer, TokenType, Vocab, _fail


def _byte_alphabet() -> list[str]:
    """GPT-2's map of the 256 byte values to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def pre_tokenizer_for(pre: str, source: str | None) -> PreTokenizer:
    row = PRE_TOKENIZERS.get(pre)
    if row is not None:
        return row
    why = UNSUPPORTED.get(pre)
    detail = f" ({why})" if why else " (not a name llama.cpp knows either)"
    where = f"{source}: " if source else ""
    raise Unavailable(
        f"{where}{KEY}pre = {pre!r}: ggufcheck has no pre-tokenizer for it{detail}",
        tip="pass token ids directly (--tokens 1,2,3)",
    )


class BPETokenizer(Tokenizer):
    """GPT-2-style byte-level BPE with a named pre-tokenizer."""

    def __init__(self, meta: Mapping[str, Any], source: str | None):
        pre = meta.get(KEY + "pre", "")
        self.pre_tokenizer = pre_tokenizer_for(pre if isinstance(pre, str) else "", source)
        bos_default = None if self.pre_tokenizer.bos_absent else 11  # llama.cpp's BPE defaults
        vocab = Vocab.from_metadata(
            meta,
            source=source,
            default_ids=(bos_default, 11, None),
            default_add_bos=self.pre_tokenizer.add_bos,
            default_add_space_prefix=False,
        )
        super().__init__(vocab)
        self.ranks = self._read_merges(meta, source)
        self._cache: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def _read_merges(meta: Mapping[str, Any], source: str | None) -> dict[tuple[str, str], int]:
        key = KEY + "merges"
        merges = meta.get(key)
        if merges is None:
            raise _fail(source, key, "missing: a gpt2 (BPE) vocabulary needs its merges")
        if not isinstance(merges, (list, tuple)):
            raise _fail(source, key, f"expected an array of strings, found {type(merges).__name__}")
        ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            if not isinstance(merge, str):
                raise _fail(source, key, f"element {rank} is {type(merge).__name__}, expected a string")
            cut = merge.find(" ", 1)  # the first space after the first character
            if cut < 0:
                raise _fail(source, key, f"element {rank} {merge!r} is not 'left right'")
            ranks.setdefault((merge[:cut], merge[cut + 1 :]), rank)  # the first rank wins
        return ranks

    # -- encoding -------------------------------------------------------------------------
    def _encode_text(self, text: str, after_special: bool, out: list[int]) -> None:
        for word in split(text, self.pre_tokenizer.regexes):
            ids = self._cache.get(word)
            if ids is None:
                ids = self._encode_word(word)
                if len(self._cache) < 100_000:
                    self._cache[word] = ids
            out.extend(ids)

    def _encode_word(self, word: str) -> tuple[int, ...]:
        token_to_id = self.vocab.token_to_id
        encoded = "".join(BYTE_TO_CHAR[b] for b in word.encode("utf-8"))
        if self.pre_tokenizer.ignore_merges and encoded in token_to_id:
            return (token_to_id[encoded],)
        symbols = self._merge(encoded)
        ids: list[int] = []
        for symbol in symbols:
            token_id = token_to_id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
                continue
            # not in the vocabulary: llama.cpp falls back to single-byte texts; with a
            # byte-level vocabulary only ASCII ones can exist, the rest are dropped
            ids.extend(token_to_id[c] for c in symbol if ord(c) < 128 and c in token_to_id)
        return tuple(ids)

    def _merge(self, encoded: str) -> list[str]:
        """Merge adjacent symbols of ``encoded``, lowest rank first, leftmost on a tie."""
        symbols = list(encoded)
        n = len(symbols)
        if n < 2:
            return symbols
        ranks = self.ranks
        nxt = list(range(1, n + 1))  # linked list over symbol slots; n = end
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int, str]] = []  # (rank, left slot, merged text)

        def push(left: int, right: int) -> None:
            if left < 0 or right >= n:
                return
            rank = ranks.get((symbols[left], symbols[right]))
            if rank is not None:
                heapq.heappush(heap, (rank, left, symbols[left] + symbols[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = nxt[left]
            if right >= n or not symbols[left] or symbols[left] + symbols[right] != merged:
                continue  # stale: one side changed since this pair was queued
            symbols[left] = merged
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
            out = bytearray()
            for c in text:
                b = CHAR_TO_BYTE.get(c)
                if b is None:  # not a byte-alphabet character: keep it as UTF-8
                    out += c.encode("utf-8", "surrogateescape")
                else:
                    out.append(b)
            return bytes(out)
        if kind == TokenType.BYTE and len(text) == 6 and text.startswith("<0x"):
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined types render as nothing (llama.cpp)
