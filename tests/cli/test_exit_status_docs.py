"""The exit statuses are worded once (errors.EXIT_STATUS_TEXT) and every place a user reads them
carries that wording: ``ggufcheck --help``, the README and docs/index.md. ``ggufcheck`` alone
says where to start and exits 2."""

from __future__ import annotations

import pytest

import re
from pathlib import Path

from ggufcheck.cli import main
from ggufcheck.errors import EXIT_STATUS_TEXT, ExitStatus

ROOT = Path(__file__).resolve().parents[2]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_help_readme_and_docs_word_the_exit_statuses_alike(capsys):
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    for where, text in (("--help", help_text), ("README.md", (ROOT / "README.md").read_text()),
                        ("docs/index.md", (ROOT / "docs" / "index.md").read_text())):
        assert _flat(EXIT_STATUS_TEXT) in _flat(text), where
    assert [s.value for s in ExitStatus] == [0, 1, 2, 3, 4, 5]
    assert all(f"{s.value} " in EXIT_STATUS_TEXT for s in ExitStatus)


def test_no_command_points_to_the_demo_and_the_docs(capsys):
    assert main([]) == ExitStatus.USAGE
    err = capsys.readouterr().err
    assert "ggufcheck demo" in err and "docs/index.md" in err


def test_reference_out_without_safetensors_is_unavailable_before_the_work(tiny_gguf, tmp_path, monkeypatch, capsys):
    """``reference --out`` on a base install (safetensors is in an extra): "unavailable" with the
    install tip, before the forward pass; it used to compute everything and exit 4."""
    import builtins

    import ggufcheck.reference as reference

    real_import = builtins.__import__

    def no_safetensors(name, *args, **kwargs):
        if name == "safetensors" or name.startswith("safetensors."):
            raise ImportError("No module named 'safetensors'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_safetensors)
    monkeypatch.setattr(reference, "ReferenceModel", None)  # the forward pass must not start
    model = tiny_gguf("llama").path
    code = main(["reference", str(model), "--tokens", "1,2,3", "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert code != ExitStatus.INTERNAL and "safetensors" in err and "pip install" in err


def test_report_paths_are_checked_before_any_work(tiny_gguf, tmp_path, capsys, monkeypatch):
    """``--json /nonexistent-dir/x.json`` used to fail after the whole run (99 s on SmolLM2),
    hiding the verdict; now it is a usage error before the first stage."""
    import ggufcheck.diagnose.plan as plan

    ran = []
    monkeypatch.setattr(plan, "diagnose", lambda *a, **k: ran.append(1))
    path = tiny_gguf("llama", qtypes="Q8_0").path
    for flag, target, words in (("--json", tmp_path / "missing" / "x.json", "does not exist"),
                                ("--html", tmp_path / "missing" / "x.html", "does not exist"),
                                ("--json", tmp_path, "is a directory")):
        assert main(["diagnose", str(path), "--engine", "reference", flag, str(target)]) == ExitStatus.USAGE
        err = capsys.readouterr().err
        assert flag in err and words in err, err
    assert main(["inspect", str(path), "--json", str(tmp_path / "missing" / "i.json")]) == ExitStatus.USAGE
    assert not ran


@pytest.mark.parametrize("args,package", [(["--engine", "hf"], "transformers"),
                                          (["--engine", "reference", "--reference", "hf-gguf"], "transformers"),
                                          (["--engine", "llama-cpp"], "llama_cpp")])
def test_a_missing_engine_or_reference_package_fails_at_once(tiny_gguf, monkeypatch, capsys, args, package):
    """Without transformers, ``--reference hf-gguf`` ran 50 s and exited 5 ("not verified");
    a missing llama-cpp-python read as "not verified" too. Now: exit 2 in seconds, naming the
    package, with the line that installs it (when the adapter knows one)."""
    import builtins
    import time

    real_import = builtins.__import__

    def missing(name, *a, **k):
        if name == package or name.startswith(package + "."):
            raise ImportError(f"No module named '{package}'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", missing)
    path = tiny_gguf("llama", qtypes="Q8_0").path
    started = time.perf_counter()
    assert main(["diagnose", str(path), *args, "--no-sanity"]) == ExitStatus.USAGE
    err = capsys.readouterr().err
    assert time.perf_counter() - started < 5
    assert "unavailable" in err and package.replace("_", "-").split("-")[0] in err.replace("_", "-"), err


def test_json_dash_writes_the_json_alone_to_stdout(tiny_gguf, capsys):
    """``--json -`` (as pytest, ruff and pip-audit users expect) used to write a file named
    ``-``; the human report goes to stderr then, so stdout parses as JSON."""
    import json
    import os

    path = tiny_gguf("llama", qtypes="Q8_0").path
    assert main(["inspect", str(path), "--json", "-"]) == ExitStatus.HEALTHY
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["command"] == "inspect" and doc["stages"]
    assert "inspect" in err.lower() or "file" in err.lower()
    assert not os.path.exists("-")


def test_sigterm_unwinds_like_ctrl_c(tmp_path):
    """SIGTERM while waiting on an engine (a server that accepts and never answers): exit 143,
    one line saying so, no traceback (engines closed on the way)."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    from ggufcheck.synthetic.tiny import build_tiny_gguf

    model = build_tiny_gguf("llama", tmp_path / "t.gguf", seed=1).path
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are queued and never answered
    port = silent.getsockname()[1]
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ggufcheck", "diagnose", str(model), "--engine",
                                 f"http://127.0.0.1:{port}", "--no-health", "--timeout", "300"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(5)  # imports done; waiting on the server
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        silent.close()
    assert proc.returncode == 143, err[-1500:]
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
