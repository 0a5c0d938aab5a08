"""The built-in prompt set and users' prompt files (``ggufcheck.checks.prompts``)."""

from __future__ import annotations

import json

import pytest

from ggufcheck.checks.prompts import Prompt, builtin_prompts, load_prompts, tokenize_prompts
from ggufcheck.errors import GGUFCheckError, UsageError


def test_builtin_prompts_are_deterministic_and_named_uniquely():
    a, b = builtin_prompts(), builtin_prompts()
    assert a == b
    names = [p.name for p in a]
    assert len(set(names)) == len(names)
    assert all(p.text for p in a)


def test_builtin_set_covers_the_promised_content():
    texts = "\n".join(p.text for p in builtin_prompts())
    for probe in ("def ", "\t", "    ", "#include", "3.14159", "18446744073709551616", "中文", "日本語",
                  "Русский", "العربية", "हिन्दी", "😀", "\n\n\n", "\r\n"):
        assert probe in texts, probe


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_long_prompts_have_the_promised_lengths(model, ours):
    lengths = {p.name: len(ids) for p, ids in zip(builtin_prompts(), tokenize_prompts(builtin_prompts(), ours[model]))}
    assert lengths["long-600"] > 512  # past a DSA indexer top_k of 512
    assert 1350 <= lengths["long-1500"] <= 1700
    assert min(lengths.values()) >= 2  # every prompt has at least one predicted position


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_tokenize_prompts_uses_the_vocab_bos_and_truncates(model, ours):
    tok = ours[model]
    prompts = builtin_prompts()
    full = tokenize_prompts(prompts, tok)
    cut = tokenize_prompts(prompts, tok, max_tokens=16)
    assert all(c == f[:16] for c, f in zip(cut, full))
    for p, ids in zip(prompts, full):
        assert ids == tok.encode(p.text, add_special=True)
        assert (ids[0] == tok.bos_id) == tok.vocab.add_bos
    with pytest.raises(UsageError, match="max_tokens"):
        tokenize_prompts(prompts, tok, max_tokens=0)


def test_a_prompt_giving_no_tokens_is_named(ours):
    tok = ours["smollm2"]  # SmolLM2 adds no BOS, so an empty text gives no ids
    assert not tok.vocab.add_bos
    with pytest.raises(GGUFCheckError, match="'empty-one'"):
        tokenize_prompts([Prompt("empty-one", "")], tok)


def test_load_prompts_one_per_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt\n\n  second, with spaces  \r\nthird\n", encoding="utf-8")
    prompts = load_prompts(path)
    assert [p.text for p in prompts] == ["first prompt", "  second, with spaces  ", "third"]
    assert [p.name for p in prompts] == ["prompts.txt:1", "prompts.txt:3", "prompts.txt:4"]


def test_load_prompts_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"text": "line one\nline two", "name": "multi"}, {"text": "def f():\n\treturn 1\n"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    prompts = load_prompts(path)
    assert prompts == [Prompt("multi", rows[0]["text"]), Prompt("p.jsonl:2", rows[1]["text"])]
    # detected by content too, whatever the suffix
    other = tmp_path / "p.txt"
    other.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    assert [p.text for p in load_prompts(other)] == [r["text"] for r in rows]


@pytest.mark.parametrize(
    "content, line, problem",
    [
        ('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n', 3, "invalid JSON"),
        ('{"text": "ok"}\n{"name": "x"}\n', 2, 'no "text"'),
        ('{"text": 5}\n', 1, '"text" is int'),
        ('{"text": ""}\n', 1, '"text" is empty'),
        ('{"text": "a", "name": 3}\n', 1, '"name" must be a string'),
        ('{"text": "a"}\n[1, 2]\n', 2, "expected a JSON object"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, content, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UsageError, match=problem) as info:
        load_prompts(path)
    assert str(info.value).startswith(f"{path}:{line}:")


def test_bad_text_files_are_clear_errors(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(UsageError, match="cannot read"):
        load_prompts(missing)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(UsageError, match="no prompts"):
        load_prompts(empty)
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("ok\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(UsageError, match=r"latin1\.txt:2: not valid UTF-8"):
        load_prompts(binary)
