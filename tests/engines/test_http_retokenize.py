"""llama-cpp-python's server gives generated tokens as text: pieces that re-tokenize differently
must make generation decline (SKIP), not feed prefill another sequence (a false alarm).

A stdlib server speaks the llama-cpp-python dialect over a toy vocabulary in which "ab" is one
token: generating the pieces "a", "b" yields text that the server itself tokenizes as "ab".
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from ggufcheck.engines.base import Unsupported
from ggufcheck.engines.http import HttpEngine, HttpOptions

VOCAB = ["<s>", "a", "b", "ab", "x"]


def toy_tokenize(text: str) -> list[int]:
    ids, i = [0], 0
    while i < len(text):
        piece = max((p for p in VOCAB[1:] if text.startswith(p, i)), key=len)
        ids.append(VOCAB.index(piece))
        i += len(piece)
    return ids


def serve(pieces: list[str]):
    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, doc):
            raw = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._send({"data": [{"id": "toy"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/extras/tokenize":
                self._send({"tokens": toy_tokenize(body["input"])})
            elif self.path == "/extras/detokenize":
                self._send({"text": "".join(VOCAB[t] for t in body["tokens"] if t)})
            else:  # /v1/completions: greedy "generation" of the scripted pieces
                self._send({"choices": [{"text": "".join(pieces), "logprobs": {
                    "tokens": pieces, "top_logprobs": [{p: -0.1, "x": -3.0} for p in pieces]}}]})

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def engine_for():
    servers = []

    def make(pieces: list[str]) -> HttpEngine:
        server = serve(pieces)
        servers.append(server)
        url = f"http://127.0.0.1:{server.server_address[1]}/v1?kind=llama-cpp-python"
        return HttpEngine(url, vocab_size=len(VOCAB), options=HttpOptions(timeout_s=5, retries=0, top_k=2))

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


def test_pieces_that_merge_on_retokenization_decline_the_generation(engine_for):
    engine = engine_for(["a", "b"])  # "x" + "a" + "b" tokenizes as x, ab: 3 ids, not 4
    prompt = engine.tokenize("x")
    with pytest.raises(Unsupported, match="tokenizes to 3 ids where its pieces gave 4"):
        engine.generate(prompt, 2)


def test_pieces_that_round_trip_are_kept_with_their_text(engine_for):
    engine = engine_for(["a", "x"])
    prompt = engine.tokenize("x")
    generation = engine.generate(prompt, 2)
    assert list(generation.generated) == [VOCAB.index("a"), VOCAB.index("x")]
    assert engine.detokenize(prompt + list(generation.generated)) == "xax"


@pytest.mark.parametrize("qtypes, expected, rounding", [
    (None, "q8", {}), ("F32", "fp16", {"kv": "f16"}), ("F16", "fp16", {"activations": "f16", "kv": "f16"}),
    ("Q8_0", "q8", {"activations": "q8_0", "kv": "f16"})])
def test_llama_cpp_dialects_take_the_activation_class_from_the_file(tmp_path, qtypes, expected, rounding):
    """The baseline allowance of a llama.cpp server follows the served file's weight types and
    the servers' default f16 KV cache (a server does not report its cache type), and so does
    the baseline run's emulation (Capabilities.rounding)."""
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    server = serve([])
    try:
        path = build_tiny_gguf("llama", tmp_path / "m.gguf", qtypes=qtypes).path if qtypes else None
        url = f"http://127.0.0.1:{server.server_address[1]}/v1?kind=llama-cpp-python"
        engine = HttpEngine(url, vocab_size=len(VOCAB), model_path=path, options=HttpOptions(timeout_s=5, retries=0))
        assert engine.capabilities.activation_dtype == expected
        assert dict(engine.capabilities.rounding) == rounding
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("backend, rounding", [
    ("", {"activations": "q8_0", "kv": "f16"}),
    ("&backend=cpu", {"activations": "q8_0", "kv": "f16"}),
    ("&backend=cuda", {"activations": "q8_0", "kv": "f16", "block_sums": "cuda-mmq", "decode_block_sums": "cuda-mmvq"})])
def test_a_llama_cpp_server_on_cuda_rounds_as_cuda_does(tmp_path, backend, rounding):
    """A server does not say where its matmuls run: ``backend=cuda`` says they run on CUDA, so
    a Q4_1 file's baseline takes CUDA's q8_1 block sums (docs/real-world-cases.md case 4)."""
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    server = serve([])
    try:
        path = build_tiny_gguf("llama", tmp_path / "m.gguf", qtypes="Q4_1", n_embd=256, head_dim=64, n_ff=512).path
        url = f"http://127.0.0.1:{server.server_address[1]}/v1?kind=llama-cpp-python{backend}"
        engine = HttpEngine(url, vocab_size=len(VOCAB), model_path=path, options=HttpOptions(timeout_s=5, retries=0))
        assert dict(engine.capabilities.rounding) == rounding
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("spec, says", [("http://127.0.0.1:9?backend=rocm", "unknown backend 'rocm'"),
                                        ("http://127.0.0.1:9?gpu=1", "unknown option 'gpu'")])
def test_a_bad_server_option_is_named(spec, says):
    with pytest.raises(ValueError, match=says):
        HttpEngine(spec, model_path=None, options=HttpOptions(timeout_s=1, retries=0))
