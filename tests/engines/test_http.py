"""OpenAI-compatible HTTP engine: llama-cpp-python's real server on loopback, and error paths.

The main path runs against the real server (no mock). The error-path servers below are tiny
stdlib servers that misbehave on purpose (malformed JSON, hanging, 500s), with short timeouts.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from ggufcheck.checks.logits import collect
from ggufcheck.engines.http import HttpEngine, HttpOptions
from ggufcheck.errors import EngineUnreachable, ExitStatus

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def server_engine(llama_server, smollm2_path):
    return HttpEngine(llama_server + "/v1", model_path=smollm2_path, options=HttpOptions(timeout_s=60, top_k=10))


def test_detects_llama_cpp_python_and_tokenizes_like_in_process(server_engine, llama_engine, prompts):
    assert server_engine.kind == "llama-cpp-python"
    assert server_engine.vocab_size == llama_engine.vocab_size
    for text in prompts:
        assert server_engine.tokenize(text) == llama_engine.tokenize(text)


def test_echo_logprobs_match_in_process_when_the_prompt_starts_with_bos(server_engine, llama_engine, prompts):
    """Same library behind HTTP: top-k + tail KL vs the in-process full logits is ~0."""
    text = "<|im_start|>" + prompts[0]  # SmolLM2's BOS id 1, so the server drops it from the echo
    tokens = server_engine.tokenize(text)
    assert tokens[0] == 1
    remote = server_engine.score(tokens)
    local = llama_engine.score(tokens)
    m = collect([(local, remote)])
    assert m.n == len(tokens) - 1  # every row but the BOS row (OpenAI: the first echo entry is null)
    assert m.kl.max() < 1e-6 and m.agree.all()
    assert not m.full_vocab


def test_server_echo_without_bos_is_shifted_by_one_and_the_comparison_says_so(server_engine, llama_engine, prompts):
    """llama-cpp-python 0.3.36's server pairs echo entry i with the distribution AFTER token i when
    the prompt has no BOS (a real bug): read with OpenAI semantics, every position disagrees."""
    tokens = server_engine.tokenize(prompts[0])
    assert tokens[0] != 1
    m = collect([(llama_engine.score(tokens), server_engine.score(tokens))])
    assert m.n >= 5
    assert m.kl.mean() > 1.0 and m.agree.mean() < 0.5


def test_generation_through_the_server_is_greedy_and_matches_in_process(server_engine, llama_engine, prompts):
    tokens = server_engine.tokenize(prompts[0])
    remote = server_engine.generate(tokens, 4)
    local = llama_engine.generate(tokens, 4)
    assert list(remote.generated) == list(local.generated)
    m = collect([(local.steps, remote.steps)])
    assert m.n == 4 and m.kl.max() < 1e-6


# ---- error paths -------------------------------------------------------------------------

class _Misbehaving(http.server.BaseHTTPRequestHandler):
    mode = "malformed"
    hits = 0

    def _answer(self):
        type(self).hits += 1
        if self.mode == "hang":
            time.sleep(3)
            return
        if self.mode == "error500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"data": [ {"id": "m"} ')  # truncated JSON

    do_GET = do_POST = _answer

    def log_message(self, *args):  # keep test output clean
        pass


@pytest.fixture
def misbehaving():
    servers = []

    def start(mode: str) -> str:
        handler = type("Handler", (_Misbehaving,), {"mode": mode, "hits": 0})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append((server, handler))
        return f"http://127.0.0.1:{server.server_address[1]}/v1", handler

    yield start
    for server, _ in servers:
        server.shutdown()
        server.server_close()


FAST = HttpOptions(timeout_s=0.5, retries=1, backoff_s=0.05)


def test_server_down_is_engine_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    started = time.monotonic()
    with pytest.raises(EngineUnreachable, match="failed after 2 attempt") as err:
        HttpEngine(f"http://127.0.0.1:{port}/v1", vocab_size=10, options=FAST)
    assert err.value.exit_status == ExitStatus.ENGINE_UNREACHABLE
    assert time.monotonic() - started < 5


def test_malformed_json_is_engine_unreachable(misbehaving):
    url, _ = misbehaving("malformed")
    with pytest.raises(EngineUnreachable, match="malformed JSON"):
        HttpEngine(url + "?kind=vllm", vocab_size=10, options=FAST)


def test_hanging_server_times_out_with_bounded_retries(misbehaving):
    url, handler = misbehaving("hang")
    started = time.monotonic()
    with pytest.raises(EngineUnreachable, match="timed out"):
        HttpEngine(url + "?kind=vllm", vocab_size=10, options=FAST)
    assert time.monotonic() - started < 4  # 2 attempts x 0.5 s + backoff, not the 3 s hang each
    assert handler.hits == 2


def test_server_errors_are_retried_then_reported(misbehaving):
    url, handler = misbehaving("error500")
    with pytest.raises(EngineUnreachable, match="HTTP 500"):
        HttpEngine(url + "?kind=vllm", vocab_size=10, options=FAST)
    assert handler.hits == 2


def test_bad_spec_is_a_usage_error():
    from ggufcheck.engines.spec import open_engine
    from ggufcheck.errors import UsageError

    with pytest.raises(UsageError, match="unknown server kind"):
        open_engine("http://127.0.0.1:1/v1?kind=tgi", None)


def test_a_context_refusal_is_unsupported_not_an_unreachable_engine():
    """vLLM answers a prompt that fills max_model_len with HTTP 400 "max_tokens must be at least
    1" (seen on the real server, tests/engines/test_vllm.py): the check that asked skips that
    length; any other 4xx still ends the run as an unreachable / refusing engine."""
    from ggufcheck.engines.base import Unsupported
    from ggufcheck.engines.http import HttpStatusError, _context_refusal_is_unsupported

    with pytest.raises(Unsupported, match="600 tokens"):
        with _context_refusal_is_unsupported(600):
            raise HttpStatusError(400, 'POST /v1/completions answered HTTP 400: {"error": {"message": '
                                       '"max_tokens must be at least 1, got 0."}}')
    with pytest.raises(HttpStatusError):
        with _context_refusal_is_unsupported(6):
            raise HttpStatusError(400, "POST /v1/completions answered HTTP 400: unknown model")
