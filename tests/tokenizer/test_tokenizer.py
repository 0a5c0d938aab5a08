"""The tokenizer on its own: clear errors, lossless round trips, and the fast merge loops
checked against naive re-implementations of the same merge rule."""

from __future__ import annotations

import random

import pytest

from ggufcheck.errors import BadFileError, GGUFCheckError, Unavailable
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.tokenizer import load_tokenizer
from ggufcheck.tokenizer.bpe import BYTE_TO_CHAR
from ggufcheck.tokenizer.pretokenizers import _ROWS, PRE_TOKENIZERS, UNSUPPORTED, split
from ggufcheck.tokenizer.spm import SPACE


# -- errors -------------------------------------------------------------------------------
def test_unknown_model_is_unavailable_naming_key_and_value(metadata):
    meta = {**metadata["smollm2"]["meta"], "tokenizer.ggml.model": "t5-ish"}
    with pytest.raises(Unavailable, match=r"tokenizer\.ggml\.model = 't5-ish'"):
        load_tokenizer(meta)


def test_missing_model_is_unavailable():
    with pytest.raises(Unavailable, match=r"tokenizer\.ggml\.model is missing"):
        load_tokenizer({"general.architecture": "llama"})


@pytest.mark.parametrize("pre", ["no-such-pre", "kimi-k2"])
def test_unknown_pre_is_unavailable_naming_key_and_value(metadata, pre):
    meta = {**metadata["smollm2"]["meta"], "tokenizer.ggml.pre": pre}
    with pytest.raises(Unavailable, match=rf"tokenizer\.ggml\.pre = '{pre}'") as info:
        load_tokenizer(meta, source="model.gguf")
    assert "model.gguf" in str(info.value)
    if pre in UNSUPPORTED:
        assert UNSUPPORTED[pre] in str(info.value)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": "abc"}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": ["a b", "nospace"]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": ["a b", 7]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.bos_token_id": "one"}, "tokenizer.ggml.bos_token_id"),
    ],
)
def test_malformed_vocabulary_names_the_key(metadata, change, key):
    meta = {**metadata["smollm2"]["meta"], **change}
    meta = {k: v for k, v in meta.items() if v is not None}
    with pytest.raises(BadFileError) as info:
        load_tokenizer(meta, source="bad.gguf")
    assert info.value.field == key and info.value.path == "bad.gguf"


def test_malformed_scores_name_the_key(metadata):
    meta = {**metadata["gemma3"]["meta"], "tokenizer.ggml.scores": [0.0] * 10}
    with pytest.raises(GGUFCheckError, match=r"tokenizer\.ggml\.scores"):
        load_tokenizer(meta)


def test_bad_ids_and_inputs_are_clear_errors(ours):
    tok = ours["smollm2"]
    with pytest.raises(GGUFCheckError, match="outside the vocabulary"):
        tok.decode([0, tok.vocab_size])
    with pytest.raises(GGUFCheckError, match="outside the vocabulary"):
        tok.token_str(-1)
    with pytest.raises(GGUFCheckError, match="must be str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(GGUFCheckError, match="surrogate"):
        tok.encode("a\ud800b")


def test_accepts_a_gguf_model_and_names_its_file(model_paths):
    with open_gguf(model_paths["smollm2"]) as model:
        tok = load_tokenizer(model)
        assert tok.vocab_size == len(model.metadata["tokenizer.ggml.tokens"])
        broken = {**model.metadata, "tokenizer.ggml.pre": "nope"}
    with pytest.raises(Unavailable, match=str(model_paths["smollm2"].name)):
        load_tokenizer(type("M", (), {"metadata": broken, "path": model_paths["smollm2"]})())


# -- round trips ----------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_decode_inverts_encode(model, ours, corpus, fuzz):
    tok = ours[model]
    for text in corpus + fuzz(seed=7, n=200):
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text, (text, ids)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_special_flag_drops_control_tokens_in_decode(model, ours):
    tok = ours[model]
    ids = tok.encode("hello", add_special=True)
    if tok.vocab.add_bos:
        assert ids[0] == tok.bos_id
        assert tok.decode(ids, special=False) == "hello"
        assert tok.decode(ids, special=True) == tok.vocab.tokens[tok.bos_id] + "hello"
    assert tok.encode("hello", add_special=False) == [i for i in ids if i != tok.bos_id]


@pytest.mark.parametrize("row", _ROWS, ids=[r.kind for r in _ROWS])
def test_pre_tokenizer_split_is_lossless(row, corpus, fuzz):
    for text in corpus + fuzz(seed=3, n=100):
        pieces = split(text, row.regexes)
        assert "".join(pieces) == text and all(pieces)


def test_every_table_name_resolves_to_its_row():
    for row in _ROWS:
        for name in row.names:
            assert PRE_TOKENIZERS[name] is row
    assert not set(PRE_TOKENIZERS) & set(UNSUPPORTED)


# -- the merge loops against naive implementations --------------------------------------------
def _naive_bpe(symbols: list[str], ranks: dict) -> list[str]:
    """Repeatedly merge the adjacent pair with the lowest rank (leftmost on a tie)."""
    symbols = list(symbols)
    while True:
        best = None
        for i in range(len(symbols) - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return symbols
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]


def _naive_spm(symbols: list[str], vocab: dict, scores: list[float]) -> list[str]:
    """Repeatedly merge the adjacent pair forming the best-scored entry (leftmost on a tie)."""
    symbols = list(symbols)
    while True:
        best = None
        for i in range(len(symbols) - 1):
            t = vocab.get(symbols[i] + symbols[i + 1])
            if t is not None and (best is None or scores[t] > best[0]):
                best = (scores[t], i)
        if best is None:
            return symbols
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]


def test_bpe_merge_loop_equals_naive(ours, fuzz):
    tok = ours["smollm2"]
    rng = random.Random(11)
    words = [w for t in fuzz(seed=5, n=150) for w in split(t, tok.pre_tokenizer.regexes)]
    words += ["".join(rng.choice("aeiou lnrst") for _ in range(rng.randint(2, 30))) for _ in range(200)]
    for word in words:
        encoded = "".join(BYTE_TO_CHAR[b] for b in word.encode("utf-8"))
        assert tok._merge(encoded) == _naive_bpe(list(encoded), tok.ranks), word


def test_spm_merge_loop_equals_naive(ours, fuzz):
    tok = ours["gemma3"]
    for text in fuzz(seed=6, n=150):
        escaped = text.replace(" ", SPACE)
        assert tok._merge(escaped) == _naive_spm(list(escaped), tok.vocab.token_to_id, tok.scores), text
