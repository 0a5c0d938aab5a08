"""Tokenize text with a GGUF's own vocabulary, the way llama.cpp does.

ggufcheck compares engines on token ids, so the ids must come from the model file itself
rather than from a separately downloaded tokenizer. ``load_tokenizer(metadata)`` reads the
``tokenizer.ggml.*`` keys and returns a :class:`Tokenizer`:

- ``"gpt2"``: byte-level BPE with the pre-tokenizer named by ``tokenizer.ggml.pre``
  (``bpe.py``, table in ``pretokenizers.py``);
- ``"llama"``: SentencePiece-style scores with byte fallback (Llama 2, Gemma; ``spm.py``).

Other models raise :class:`~ggufcheck.errors.Unavailable` naming the key and value;
callers can always pass token ids directly instead.
"""

from __future__ import annotations

from typing import Any, Mapping

from ggufcheck.errors import Unavailable
from ggufcheck.tokenizer.vocab import KEY, Tokenizer, TokenType, Vocab

__all__ = ["Tokenizer", "TokenType", "Vocab", "load_tokenizer", "SUPPORTED_MODELS"]

SUPPORTED_MODELS = ("gpt2", "llama")


def load_tokenizer(metadata: Mapping[str, Any] | Any, source: str | None = None) -> Tokenizer:
    """A tokenizer for a GGUF's metadata (a mapping, or an object with ``.metadata``).

    ``source`` names the file in error messages (taken from ``.path`` when given a model).
    Raises :class:`Unavailable` for a tokenizer model or pre-tokenizer ggufcheck does not
    implement, and a :class:`~ggufcheck.errors.GGUFCheckError` naming the key for a
    malformed vocabulary.
    """
    if not isinstance(metadata, Mapping):
        if source is None and getattr(metadata, "path", None) is not None:
            source = str(metadata.path)
        metadata = getattr(metadata, "metadata", metadata)
        if not isinstance(metadata, Mapping):
            raise TypeError("load_tokenizer needs a metadata mapping or a GGUFModel")
    model = metadata.get(KEY + "model")
    where = f"{source}: " if source else ""
    if model is None:
        raise Unavailable(f"{where}{KEY}model is missing: the file carries no tokenizer", tip="pass token ids directly")
    if model == "gpt2":
        from ggufcheck.tokenizer.bpe import BPETokenizer

        return BPETokenizer(metadata, source)
    if model == "llama":
        from ggufcheck.tokenizer.spm import SPMTokenizer

        return SPMTokenizer(metadata, source)
    raise Unavailable(
        f"{where}{KEY}model = {model!r}: ggufcheck tokenizes only {', '.join(map(repr, SUPPORTED_MODELS))}",
        tip="pass token ids directly",
    )
