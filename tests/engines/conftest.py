"""Engine fixtures: SmolLM2 Q4_1 through llama.cpp in process and through llama-cpp-python's real server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest



@pytest.fixture(scope="session")
def prompts() -> tuple[str, ...]:
    return ("The capital of France is Paris. The capital of Germany is",
            "def add(a, b):\n    return a + b\n\nprint(add(2,")


@pytest.fixture(scope="session")
def llama_engine(smollm2_path):
    pytest.importorskip("llama_cpp")
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    engine = LlamaCppEngine(smollm2_path, n_ctx=128, n_threads=2)
    yield engine
    engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def llama_server(smollm2_path, tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server on loopback; killed in teardown."""
    pytest.importorskip("llama_cpp")
    for extra in ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings"):
        pytest.importorskip(extra, reason=f"llama-cpp-python's server needs {extra}")
    port = _free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_path), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "128", "--n_threads", "2"]
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    log = open(log_path, "wb")  # a file, not a pipe: llama.cpp's load log would fill a pipe and block
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited {proc.returncode}: {log_path.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("llama_cpp.server did not answer within 90 s")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
