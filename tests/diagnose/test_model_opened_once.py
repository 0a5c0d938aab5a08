"""One model handle per run (issue 39): `diagnose` parses and maps the GGUF once; the engines,
the reference and the checks borrow it (gguf/reader.py ``lend``) instead of opening it again."""

from __future__ import annotations

import pytest

from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
from ggufcheck.gguf import reader
from ggufcheck.gguf.reader import lend, open_gguf


@pytest.fixture
def parses(monkeypatch):
    seen = []
    real = reader._parse_part

    def counting(path, *a, **k):
        seen.append(str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(reader, "_parse_part", counting)
    return seen


@pytest.mark.parametrize("engine", ["reference", "llama-cpp"])
def test_a_diagnosis_parses_the_file_once(tiny_gguf, parses, engine):
    if engine == "llama-cpp":
        pytest.importorskip("llama_cpp")
    model = tiny_gguf("llama", qtypes="Q8_0").path
    parses.clear()
    d = diagnose(DiagnoseOptions(model=model, engine=engine, kernels=False, sanity=False, max_prompts=2,
                                 max_tokens=24, sweep_to=0, decode_to=0))
    assert d.verdict.healthy, d.verdict.message
    assert parses == [str(model)]  # llama.cpp reads the file itself; ggufcheck's side parses it once


def test_a_borrower_closing_leaves_the_lent_model_open(tiny_gguf):
    model = tiny_gguf("llama", qtypes="Q8_0").path
    with open_gguf(model) as owner, lend(owner):
        name = next(iter(owner.tensors))
        with open_gguf(model) as borrowed:
            assert borrowed is not owner and borrowed.tensors is owner.tensors
        assert not owner.closed and owner.raw(name).size  # still readable after the borrower closed
    assert owner.closed
    again = open_gguf(model)  # the loan ended with the block: a fresh open
    try:
        assert again is not owner and not again.closed
    finally:
        again.close()
