"""The vocabulary read from GGUF metadata, and what every tokenizer model shares.

:class:`Vocab` validates the ``tokenizer.ggml.*`` keys once (lengths, types, ids in range)
and holds token texts, types, scores and the special ids. :class:`Tokenizer` is the base of
the two tokenizer models (byte-level BPE in ``bpe.py``, SentencePiece in ``spm.py``): it
splits special-token text out first, adds BOS/EOS, and decodes, the way llama.cpp's
``llama_vocab::impl::tokenize`` / ``token_to_piece`` do; the models only encode plain text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ggufcheck.errors import BadFileError, GGUFCheckError

KEY = "tokenizer.ggml."


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (gguf-py ``TokenType``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Texts llama.cpp forces to CONTROL whatever the file says (llama-vocab.cpp, load():
# the end-of-generation and FIM auto-detection lists). It matters for parse_special=False:
# control tokens are then left as text, user-defined ones are still split out.
LLAMA_CPP_CONTROL_TEXTS = frozenset(
    {
        # end of generation / end of turn
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
        "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
        # fill-in-the-middle
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
        "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>",
        "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
        "<|middle|>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
    }
)
# ... and the gpt-oss tokens it always renders as USER_DEFINED
LLAMA_CPP_USER_DEFINED_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


def _fail(source: str | None, key: str, problem: str) -> GGUFCheckError:
    if source is not None:
        return BadFileError(source, problem, field=key)
    return GGUFCheckError(f"{key}: {problem}")


def _list(meta: Mapping[str, Any], key: str, source: str | None, item: type, required: bool) -> list | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise _fail(source, key, "missing: the file carries no vocabulary")
        return None
    if not isinstance(value, (list, tuple)):
        raise _fail(source, key, f"expected an array, found {type(value).__name__}")
    ok = (int, float) if item is float else item
    for i, v in enumerate(value):
        if not isinstance(v, ok) or isinstance(v, bool) and item is not bool:
            raise _fail(source, key, f"element {i} is {type(v).__name__}, expected {item.__name__}")
    return list(value)


def _flag(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key)
    return bool(value) if isinstance(value, (bool, int)) else default


@dataclass
class Vocab:
    """Token texts, types and scores plus the special ids, validated from metadata."""

    model: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre ("" when absent)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    token_to_id: dict[str, int]  # a later duplicate text wins, as in llama.cpp
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_metadata(
        cls,
        meta: Mapping[str, Any],
        *,
        source: str | None,
        default_ids: tuple[int | None, int | None, int | None],
        default_add_bos: bool,
        default_add_space_prefix: bool,
    ) -> "Vocab":
        model = meta.get(KEY + "model")
        pre = meta.get(KEY + "pre", "")
        if not isinstance(pre, str):
            raise _fail(source, KEY + "pre", f"expected a string, found {type(pre).__name__}")
        tokens = _list(meta, KEY + "tokens", source, str, required=True)
        assert tokens is not None
        if not tokens:
            raise _fail(source, KEY + "tokens", "empty vocabulary")
        n = len(tokens)
        types = _list(meta, KEY + "token_type", source, int, required=False)
        if types is None:
            types = [TokenType.NORMAL] * n
        elif len(types) < n:
            raise _fail(source, KEY + "token_type", f"{len(types)} types for {n} tokens")
        scores = _list(meta, KEY + "scores", source, float, required=False)
        if scores is not None and len(scores) < n:
            raise _fail(source, KEY + "scores", f"{len(scores)} scores for {n} tokens")

        # empty texts get a placeholder, as llama.cpp does (they can never match text)
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = [int(t) for t in types[:n]]
        for i, text in enumerate(tokens):
            if text in LLAMA_CPP_CONTROL_TEXTS and types[i] != TokenType.CONTROL:
                types[i] = TokenType.CONTROL
            elif text in LLAMA_CPP_USER_DEFINED_TEXTS:
                types[i] = TokenType.USER_DEFINED
        token_to_id = {text: i for i, text in enumerate(tokens)}

        def special(name: str, default: int | None) -> int | None:
            key = f"{KEY}{name}_token_id"
            value = meta.get(key)
            if value is None:
                return default if default is not None and 0 <= default < n else None
            if not isinstance(value, int) or isinstance(value, bool):
                raise _fail(source, key, f"expected an integer, found {type(value).__name__}")
            if not 0 <= value < n:  # llama.cpp warns and keeps its default
                return default if default is not None and 0 <= default < n else None
            return value

        bos_default, eos_default, unk_default = default_ids
        return cls(
            model=str(model),
            pre=pre,
            tokens=tokens,
            types=types,
            scores=[float(s) for s in scores[:n]] if scores is not None else None,
            token_to_id=token_to_id,
            bos_id=special("bos", bos_default),
            eos_id=special("eos", eos_default),
            unk_id=special("unknown", unk_default),
            add_bos=_flag(meta, KEY + "add_bos_token", default_add_bos),
            add_eos=_flag(meta, KEY + "add_eos_token", False),
            add_space_prefix=_flag(meta, KEY + "add_space_prefix", default_add_space_prefix),
        )


class Tokenizer:
    """Text <-> token ids from a GGUF's own vocabulary (base of the BPE and SPM models).

    ``encode(text, add_special=True, parse_special=False)`` follows llama.cpp's
    ``llama_tokenize``: ``add_special`` adds BOS/EOS where the vocabulary asks for them;
    ``parse_special`` turns control-token text (``<|im_end|>``) into its id; user-defined
    tokens are always split out.
    """

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        # special-token candidates, longest text first (llama.cpp cache_special_tokens)
        special = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        ids = [i for i, t in enumerate(vocab.types) if t in special]
        ids.sort(key=lambda i: (-len(vocab.tokens[i].encode("utf-8", "surrogateescape")), i))
        self._special_ids = ids
        self._plain_special_ids = [i for i in ids if vocab.types[i] == TokenType.USER_DEFINED]
        self._pieces: list[bytes] | None = None

    # -- what the models implement ----------------------------------------------------
    def _encode_text(self, text: str, after_special: bool, out: list[int]) -> None:
        raise NotImplementedError

    def _piece(self, token_id: int) -> bytes:
        raise NotImplementedError

    # -- public ---------------------------------------------------------------------------
    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def model(self) -> str:
        return self.vocab.model

    @property
    def pre(self) -> str:
        return self.vocab.pre

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (see the class docstring for the two flags)."""
        if not isinstance(text, str):
            raise GGUFCheckError(f"tokenizer input must be str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise GGUFCheckError(f"text is not valid Unicode at character {e.start} (unpaired surrogate)") from None
        out: list[int] = []
        if add_special and self.vocab.add_bos:
            if self.vocab.bos_id is None:
                raise GGUFCheckError(f"{KEY}add_bos_token is set but the vocabulary has no BOS token")
            out.append(self.vocab.bos_id)
        after_special = True
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                out.append(fragment)
                after_special = True
            else:
                self._encode_text(fragment, after_special, out)
                after_special = False
        if add_special and self.vocab.add_eos:
            if self.vocab.eos_id is None:
                raise GGUFCheckError(f"{KEY}add_eos_token is set but the vocabulary has no EOS token")
            out.append(self.vocab.eos_id)
        return out

    def decode(self, ids: Sequence[int], special: bool = True) -> str:
        """The text of ``ids``: pieces concatenated, invalid UTF-8 replaced by U+FFFD.

        ``special=False`` drops control and unknown tokens. No space clean-up is done, so
        ``decode(encode(text, add_special=False))`` gives ``text`` back for plain text.
        """
        return b"".join(self.piece_bytes(i, special) for i in ids).decode("utf-8", errors="replace")

    def piece_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token stands for (llama.cpp ``token_to_piece``)."""
        self._check_id(token_id)
        if not special and self.vocab.types[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN):
            return b""
        return self._piece(token_id)

    def token_str(self, token_id: int) -> str:
        """A readable form of one token: its text, or its vocabulary entry when the bytes
        are not valid UTF-8 on their own (a byte token, half of a character)."""
        piece = self.piece_bytes(token_id)
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError:
            return self.vocab.tokens[token_id]

    # -- shared machinery -----------------------------------------------------------------
    def _check_id(self, token_id: int) -> None:
        if not isinstance(token_id, int) or not 0 <= token_id < self.vocab.size:
            raise GGUFCheckError(f"token id {token_id!r} is outside the vocabulary (0..{self.vocab.size - 1})")

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split special-token text out of ``text``: str fragments and int token ids.

        Same order as llama.cpp's ``tokenizer_st_partition``: for each special token,
        longest text first, every remaining text fragment is split at each occurrence.
        """
        fragments: list[str | int] = [text] if text else []
        candidates = self._special_ids if parse_special else self._plain_special_ids
        tokens = self.vocab.tokens
        for token_id in candidates:
            needle = tokens[token_id]
            if needle not in text:  # cheap filter: a fragment is a substring of text
                continue
            out: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or needle not in fragment:
                    out.append(fragment)
                    continue
                start = 0
                while (hit := fragment.find(needle, start)) >= 0:
                    if hit > start:
                        out.append(fragment[start:hit])
                    out.append(token_id)
                    start = hit + len(needle)
                if start < len(fragment):
                    out.append(fragment[start:])
            fragments = out
        return fragments
