"""Our tokenizer against llama.cpp's (llama-cpp-python, vocab only): exact id equality.

Real vocabularies: SmolLM2 (gpt2 BPE, pre "smollm") and Gemma 3 (SentencePiece "llama").
Every pre-tokenizer row of our table: a vocab-only copy of SmolLM2 with
``tokenizer.ggml.pre`` changed, so llama.cpp splits with its own code for that name. The
copy gets extra merges for every pair of ASCII symbols, so that a different pre-token
boundary (say digits in threes rather than one by one) changes the ids and cannot hide.
"""

from __future__ import annotations

import ctypes
import zlib

import pytest

from ggufcheck.checks.prompts import builtin_prompts
from ggufcheck.tokenizer import load_tokenizer
from ggufcheck.tokenizer.pretokenizers import _ROWS

pytestmark = pytest.mark.llama
llama_cpp = pytest.importorskip("llama_cpp")

FLAGS = [(True, False), (False, False), (True, True), (False, True)]  # (add_special, parse_special)


def _mismatches(tok, ll, texts, flags):
    bad = []
    for text in texts:
        for add, special in flags:
            ours = tok.encode(text, add_special=add, parse_special=special)
            theirs = ll.tokenize(text.encode("utf-8"), add_bos=add, special=special)
            if ours != theirs:
                bad.append((text, add, special, ours, theirs))
    return bad


def _describe(tok, bad):
    text, add, special, ours, theirs = bad[0]
    return (
        f"{len(bad)} mismatches; first: {text!r} add_special={add} parse_special={special}\n"
        f"  ours:      {[tok.token_str(i) for i in ours]}\n  llama.cpp: {[tok.token_str(i) for i in theirs]}"
    )


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_special_ids_and_size_match_llamacpp(model, ours, llamacpp):
    tok, ll = ours[model], llamacpp[model]
    assert tok.vocab_size == ll.n_vocab()
    assert tok.bos_id == ll.token_bos()
    assert tok.eos_id == ll.token_eos()


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_corpus_matches_llamacpp(model, ours, llamacpp, corpus):
    bad = _mismatches(ours[model], llamacpp[model], corpus, FLAGS)
    assert not bad, _describe(ours[model], bad)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_builtin_prompts_match_llamacpp(model, ours, llamacpp):
    texts = [p.text for p in builtin_prompts()]
    bad = _mismatches(ours[model], llamacpp[model], texts, [(True, False)])
    assert not bad, _describe(ours[model], bad)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_fuzz_matches_llamacpp(model, ours, llamacpp, fuzz):
    texts = fuzz(seed=1234, n=600)
    bad = _mismatches(ours[model], llamacpp[model], texts, [(True, False), (False, True)])
    assert not bad, _describe(ours[model], bad)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_piece_bytes_match_llamacpp(model, ours, llamacpp, fuzz):
    """Per-token bytes equal llama.cpp's token_to_piece (special tokens rendered)."""
    tok, ll = ours[model], llamacpp[model]
    ids = sorted({i for t in fuzz(seed=99, n=100) for i in tok.encode(t, parse_special=True)})
    ids += list(range(0, tok.vocab_size, max(1, tok.vocab_size // 500)))
    buf = ctypes.create_string_buffer(1024)
    for i in ids:
        for special in (True, False):
            n = llama_cpp.llama_token_to_piece(ll._model.vocab, i, buf, len(buf), 0, special)
            assert 0 <= n <= len(buf)
            assert tok.piece_bytes(i, special) == buf.raw[:n], (i, special, tok.vocab.tokens[i])


@pytest.mark.parametrize("row", [r for r in _ROWS], ids=[r.kind for r in _ROWS])
def test_every_pre_tokenizer_matches_llamacpp(row, metadata, probe_metadata, vocab_writer, corpus, fuzz, tmp_path):
    pre = row.names[0]
    meta = {**probe_metadata, "tokenizer.ggml.pre": pre}
    del meta["tokenizer.ggml.add_bos_token"]  # so each name's own BOS default applies
    path = vocab_writer(tmp_path / f"vocab-{row.kind}.gguf", meta, metadata["smollm2"]["fields"])
    ll = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    tok = load_tokenizer(meta)
    assert tok.bos_id == ll.token_bos() and tok.eos_id == ll.token_eos()
    texts = corpus + fuzz(seed=zlib.crc32(row.kind.encode()), n=100)
    bad = _mismatches(tok, ll, texts, [(True, False)])
    assert not bad, _describe(tok, bad)


def test_spm_space_prefix_and_eos_flags_match_llamacpp(metadata, vocab_writer, corpus, fuzz, tmp_path):
    """Gemma's vocabulary with Llama-2-style flags: a space before text that starts the
    input or follows a special token, and EOS appended."""
    base = metadata["gemma3"]
    meta = {**base["meta"], "tokenizer.ggml.add_space_prefix": True, "tokenizer.ggml.add_eos_token": True}
    path = vocab_writer(tmp_path / "gemma-prefix.gguf", meta, base["fields"])
    ll = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    tok = load_tokenizer(meta)
    bad = _mismatches(tok, ll, corpus + fuzz(seed=21, n=100), FLAGS)
    assert not bad, _describe(tok, bad)
