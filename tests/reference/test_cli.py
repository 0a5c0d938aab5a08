"""``ggufcheck reference``: output, trace file, and clear errors (exit 2) for bad input."""

import argparse

import pytest

from ggufcheck.cli import reference as cli
from ggufcheck.errors import GGUFCheckError
from ggufcheck.reference import Trace


def _run(argv):
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    try:
        return cli.run(parser.parse_args(["reference", *argv]))
    except GGUFCheckError as err:  # what ggufcheck.cli.main turns into one line + exit status
        return int(err.exit_status), err.message


def test_tokens_run_prints_and_writes_trace(tiny, tmp_path, capsys):
    path = tiny("glm-dsa").gguf_path
    assert _run([str(path), "--tokens", "5,17,300,4000,12", "--top", "2", "--out", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "top predictions" in out and "per-layer summary" in out and "full, k=" in out
    trace = Trace.load(tmp_path / "t")
    assert trace.tokens == [5, 17, 300, 4000, 12] and len(trace.layers) == 3


def test_prompt_uses_the_gguf_tokenizer(tiny, capsys):
    pytest.importorskip("ggufcheck.tokenizer")
    assert _run([str(tiny("llama").gguf_path), "--prompt", "Hello world", "--dtype", "fp32"]) == 0
    assert "Hello" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1,x"], "comma-separated integers"),
    (["--tokens", "99999999"], "out of range"),
    (["--tokens", "1", "--top", "0"], "--top"),
])
def test_bad_input_is_a_usage_error(tiny, argv, message):
    status, text = _run([str(tiny("llama").gguf_path), *argv])
    assert status == 2 and message in text


def test_missing_file_is_a_usage_error(tmp_path):
    status, text = _run([str(tmp_path / "nope.gguf"), "--tokens", "1"])
    assert status == 2 and "not found" in text


def test_unsupported_architecture_is_reported(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    status, text = _run([str(path), "--tokens", "1"])
    assert status == 2 and "mamba" in text
