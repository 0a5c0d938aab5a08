"""``--engine SPEC``: parsed once into its kind (engines/spec.py's registry), its options and TP size."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufcheck.engines.spec import KINDS, SPEC_HELP, parse_spec
from ggufcheck.errors import UsageError


@pytest.mark.parametrize("text,kind,rest,tp", [
    ("reference:fp32", "reference", "fp32", None), ("hf@cuda", "hf", "@cuda", None),
    ("hf-gguf@cuda:0", "hf-gguf", "@cuda:0", None), ("hf:bf16@cuda", "hf", "bf16@cuda", None),
    ("llama-cpp:n_ctx=8", "llama-cpp", "n_ctx=8", None), ("vllm", "vllm", "", 1), ("vllm:tp=4", "vllm", "tp=4", 4),
    ("http://127.0.0.1:8080/v1", "http", "http://127.0.0.1:8080/v1", None),
    ("python:pkg.mod:make", "python", "pkg.mod:make", None),
])
def test_each_kind_parses(text, kind, rest, tp):
    spec = parse_spec(text)
    assert (spec.name, spec.rest, spec.tp) == (kind, rest, tp)


def test_the_help_and_the_errors_come_from_the_registry():
    assert SPEC_HELP == ", ".join(k.usage for k in KINDS.values())
    with pytest.raises(UsageError, match="unknown engine") as err:
        parse_spec("sglang:tp=2")
    assert SPEC_HELP in err.value.tip
    with pytest.raises(UsageError, match="needs the model file"):
        parse_spec("reference").open(None)
    with pytest.raises(UsageError, match="positive integer"):
        _ = parse_spec("vllm:tp=0").tp  # the TP size is read with the engine's own option rules


def test_a_run_parses_its_engine_once():
    from ggufcheck.diagnose.session import DiagnoseOptions

    options = DiagnoseOptions(model=Path("m.gguf"), engine="vllm:tp=2")
    assert options.engine_spec is options.engine_spec and options.engine_spec.tp == 2
    assert DiagnoseOptions(model=Path("m.gguf")).engine_spec is None
