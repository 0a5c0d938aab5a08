"""Shared fixtures: the real models' vocabularies, loaded once per session, ours and llama.cpp's.

Also a writer of vocab-only GGUF copies (metadata only, no tensors) with one key changed,
so llama.cpp can be asked how it splits text for every ``tokenizer.ggml.pre`` in our
table while reusing the SmolLM2 vocabulary and merges.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Any

import pytest

from ggufcheck.errors import Unavailable
from ggufcheck.gguf.format import SCALAR_FORMATS, ValueType
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.testing import models
from ggufcheck.tokenizer import load_tokenizer


def _model_path(which: str) -> Path:
    try:
        return models.smollm2_path() if which == "smollm2" else models.gemma3_path()
    except Unavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def model_paths() -> dict[str, Path]:
    return {"smollm2": _model_path("smollm2"), "gemma3": _model_path("gemma3")}


@pytest.fixture(scope="session")
def metadata(model_paths) -> dict[str, dict[str, Any]]:
    out = {}
    for name, path in model_paths.items():
        with open_gguf(path) as m:
            out[name] = {"meta": dict(m.metadata), "fields": dict(m.fields)}
    return out


@pytest.fixture(scope="session")
def ours(metadata):
    return {name: load_tokenizer(v["meta"], source=name) for name, v in metadata.items()}


@pytest.fixture(scope="session")
def llamacpp(model_paths):
    llama_cpp = pytest.importorskip("llama_cpp")
    return {name: llama_cpp.Llama(str(p), vocab_only=True, verbose=False) for name, p in model_paths.items()}


# -- a vocab-only GGUF writer (independent of gguf-py's writer) ---------------------------
def _pack(vtype: ValueType, value: Any, etype: ValueType | None) -> bytes:
    if vtype == ValueType.STRING:
        raw = value.encode("utf-8", "surrogateescape")
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ValueType.ARRAY:
        assert etype is not None
        head = struct.pack("<IQ", int(etype), len(value))
        if etype == ValueType.STRING:
            return head + b"".join(_pack(etype, v, None) for v in value)
        fmt, _ = SCALAR_FORMATS[etype]
        return head + struct.pack("<" + fmt[1] * len(value), *value)
    return struct.pack(SCALAR_FORMATS[vtype][0], value)


def write_vocab_only(path: Path, meta: dict[str, Any], fields: dict, **changes: Any) -> Path:
    """A GGUF v3 with ``meta`` (keys with dots given as ``__`` in ``changes``) and no tensors."""
    items = dict(meta)
    items.update({k.replace("__", "."): v for k, v in changes.items()})
    body = bytearray()
    for key, value in items.items():
        f = fields[key]
        raw_key = key.encode()
        body += struct.pack("<Q", len(raw_key)) + raw_key + struct.pack("<I", int(f.type))
        body += _pack(f.type, value, f.element_type)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(items)) + bytes(body))
    return path


def with_pair_merges(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with extra tokens and (lowest-priority) merges for every pair of ASCII
    byte-alphabet symbols, so that BPE output reveals where pre-token boundaries fall even
    between characters the original vocabulary never merges (digits, punctuation, spaces)."""
    from ggufcheck.tokenizer.bpe import BYTE_TO_CHAR

    symbols = [BYTE_TO_CHAR[b] for b in range(128)]
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    merges = list(meta["tokenizer.ggml.merges"])
    known = set(tokens)
    for a in symbols:
        for b in symbols:
            merges.append(f"{a} {b}")
            if a + b not in known:
                tokens.append(a + b)
                types.append(1)
    # whole words no merge sequence reaches: only "ignore_merges" pre-tokenizers emit them
    for word in ("zqzqzq", "\u0120zqzqzq"):
        if word not in known:
            tokens.append(word)
            types.append(1)
    return {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges}


# -- the text corpus --------------------------------------------------------------------
CORPUS = [
    "Hello world", " leading space", "   three leading spaces", "trailing   ", "",
    " ", "\n", "\t", "a\n\n\nb\r\nc\rd", "   \n  \n\t \n", "x" * 64,
    "def f(x):\n    return x * 2\n\n\tif x:\n\t\tpass\n", "for (int i = 0; i < n; ++i) { s += a[i]; }",
    "1234567890 3.14159 1e-9 0x1F 100,000,000 -42 2^64=18446744073709551616",
    "00000000000000000000000000000000001", "١٢٣ ²½ Ⅻ 〇",
    "你好，世界！这是一个测试。", "日本語のテキストです。カタカナとひらがな。", "오늘 날씨가 좋네요",
    "Привет, мир! Как дела?", "مرحبا بالعالم", "नमस्ते दुनिया", "Ελληνικά", "ÉCOLE café naïve e\u0301",
    "emoji 😀🎉👍🏽 🇫🇷 👩\u200d💻 ❤️", "don't I'll we've THEY'RE o'clock 's",
    "\u00a0nbsp\u3000ideographic\u2028line\u0085next\x0bvt\x0cff\x1cfs", "\u0378\ue000\U0010fffd",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "<start_of_turn>user\nhello<end_of_turn>\n",
    "<bos><eos></s><unk><pad><0x41><unused0>[multimodal]", "<|im_end|><|im_end|>x<|im_end|>",
    "Mixed: 东京 Tokyo 2024年 ₹100 €5,00 ~/path/to/file.py:42",
    "zqzqzq zqzqzq",
]

_POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list(" \t\n\r      ")
    + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    + list("你好世界日本語テキストカタカナひらがな한국어")
    + list("Привет мир") + list("مرحبا") + list("नमस्ते दुनिया")
    + ["😀", "🎉", "👍🏽", "🇫🇷", "\u200d", "e\u0301", "\u00a0", "\u3000", "\u2028", "\u0085",
       "\x0b", "\x0c", "\x1c", "\u0378", "\ue000", "\U0010fffd", "²", "½", "Ⅻ", "٣", "〇", "ſ",
       "'s", "'S", "'ll", "’", "…", "。", "，", "éÉçñüß"]
    + ["<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<start_of_turn>", "</s>", "<0x41>",
       "\n\n", "    ", "\t\t", "1234567", " 42"]
)


def fuzz_texts(seed: int, n: int, max_pieces: int = 40) -> list[str]:
    """``n`` deterministic random strings mixing scripts, digits, whitespace, special text."""
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, max_pieces))) for _ in range(n)]


# helpers as fixtures (test modules cannot import conftest under --import-mode=importlib)
@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return list(CORPUS)


@pytest.fixture(scope="session")
def fuzz():
    return fuzz_texts


@pytest.fixture(scope="session")
def vocab_writer():
    return write_vocab_only


@pytest.fixture(scope="session")
def probe_metadata(metadata) -> dict[str, Any]:
    """SmolLM2's vocabulary plus ASCII pair merges (see :func:`with_pair_merges`)."""
    return with_pair_merges(metadata["smollm2"]["meta"])
