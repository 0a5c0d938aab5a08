"""vLLM and llama-server dialects: the parsers against each server's documented answer format.

No vLLM or llama-server runs on this machine, so a stdlib server answers in their
documented formats (vLLM: ``prompt_logprobs`` as ``[null, {id: {logprob, rank,
decoded_token}}, ...]`` and ``token_id:N`` keys with ``return_tokens_as_token_ids``;
llama-server: ``completion_probabilities`` with ``top_logprobs: [{id, token, logprob}]``)
filled with REAL distributions from llama.cpp in process. The test is that the adapter puts
every number at the right position: teacher-forced tables equal llama.cpp's own top-k.
This checks the protocol handling only; live vLLM / llama-server runs are not covered here.
"""

from __future__ import annotations

import http.server
import json
import threading

import numpy as np
import pytest

from ggufcheck.checks.logits import collect
from ggufcheck.engines.http import HttpEngine, HttpOptions

pytestmark = pytest.mark.llama
K = 5


def _top(table_row: np.ndarray, k: int = K) -> list[tuple[int, float]]:
    ids = np.argsort(-table_row)[:k]
    return [(int(i), float(table_row[i])) for i in ids]


def _vllm_answer(llama, body: dict) -> dict:
    prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
    choices = []
    for index, prompt in enumerate(prompts):
        lp = llama.score(prompt).logprobs
        plp = [None]
        for i in range(1, len(prompt)):  # entry i: the distribution that predicts prompt[i]
            entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": "?"} for r, (t, v) in enumerate(_top(lp[i - 1]))}
            entry.setdefault(str(prompt[i]), {"logprob": float(lp[i - 1, prompt[i]]), "rank": 99, "decoded_token": "?"})
            plp.append(entry)
        nxt = _top(lp[-1])
        choices.append({"index": index, "text": "?", "prompt_logprobs": plp,
                        "logprobs": {"tokens": [f"token_id:{nxt[0][0]}"], "token_logprobs": [nxt[0][1]],
                                     "top_logprobs": [{f"token_id:{t}": v for t, v in nxt}]}})
    return {"object": "text_completion", "choices": choices}


def _llama_server_answer(llama, body: dict, partial=frozenset(), drafted: int = 0) -> dict:
    """As llama-server answers /completion: ``partial`` ids play tokens whose piece ends in an
    incomplete UTF-8 sequence, which it samples but leaves out of completion_probabilities;
    ``logit_bias`` [[id, false]] bans ids from sampling, not from the reported (raw) top-k.
    ``drafted`` > 0 plays speculative decoding (llama-cpp-python 0.3.36's llama-server with
    --spec-type draft-mtp, measured): every generated token after the first is "accepted from a
    draft" and reported with logprob 0 and an empty top list, and ``timings`` carry the counts."""
    prompt = list(body["prompt"])
    banned = {int(t) for t, allowed in body.get("logit_bias", []) if allowed is False}
    steps, tokens = [], []
    for _ in range(body.get("n_predict", 1)):
        row = llama.score(prompt).logprobs[-1]
        top = _top(row, body.get("n_probs", 0))
        pick = next(int(i) for i in np.argsort(-row) if int(i) not in banned)
        if drafted and tokens:
            steps.append({"id": pick, "token": "?", "logprob": 0.0, "top_logprobs": []})
        elif pick not in partial:
            steps.append({"id": pick, "token": "?", "logprob": float(row[pick]),
                          "top_logprobs": [{"id": t, "token": "?", "logprob": v} for t, v in top]})
        tokens.append(pick)
        prompt.append(pick)
    answer = {"content": "?", "completion_probabilities": steps}
    if drafted:
        answer["timings"] = {"draft_n": drafted, "draft_n_accepted": max(0, len(tokens) - 1)}
    if body.get("return_tokens"):
        answer["tokens"] = tokens
    return answer


@pytest.fixture
def dialect_server(llama_engine):
    servers = []

    def start(kind: str, partial=frozenset(), metrics: bool = False, drafted: int = 0) -> str:
        hits = [0.0]  # vllm:prefix_cache_hits: counted for requests without prompt log-probs (vLLM reads its cache then)

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, doc, code=200):
                raw = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send({"data": [{"id": "tiny"}]})
                elif self.path == "/props" and kind == "llama-server":
                    self._send({"default_generation_settings": {}, "n_ctx": 128})
                elif self.path == "/openapi.json" and kind == "vllm":
                    self._send({"paths": {"/tokenize": {}, "/v1/completions": {}}})
                elif self.path == "/metrics" and metrics:
                    raw = (f'# TYPE vllm:prefix_cache_hits_total counter\n'
                           f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {hits[0]}\n'
                           f'vllm:prefix_cache_hits_created{{engine="0",model_name="tiny"}} 1.7e9\n').encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                else:
                    self._send({"error": "not found"}, 404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/completions" and kind == "vllm":
                    if body.get("prompt_logprobs") is None:
                        hits[0] += 16
                    self._send(_vllm_answer(llama_engine, body))
                elif self.path == "/completion" and kind == "llama-server":
                    self._send(_llama_server_answer(llama_engine, body, partial, drafted))
                elif self.path == "/tokenize":
                    text = body.get("prompt", body.get("content"))
                    self._send({"tokens": llama_engine.tokenize(text)})
                else:
                    self._send({"error": "not found"}, 404)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("kind", ["vllm", "llama-server"])
def test_dialect_tables_line_up_with_the_real_distributions(dialect_server, llama_engine, prompts, kind):
    url = dialect_server(kind)
    engine = HttpEngine(url, vocab_size=llama_engine.vocab_size, options=HttpOptions(timeout_s=30, top_k=K))
    assert engine.kind == kind  # detected, not forced
    tokens = engine.tokenize(prompts[0])[:8]
    local = llama_engine.score(tokens)
    remote = engine.score(tokens)
    m = collect([(local, remote)])
    # every row: vLLM's prompt_logprobs give rows 0..T-2 and its first sampled token row T-1;
    # llama-server answers one request per prefix
    assert m.n == len(tokens) and m.agree.all() and m.kl.max() < 1e-6
    gen = engine.generate(tokens, 3)
    assert list(gen.generated[:1]) == [int(local.argmax()[-1])]


def test_vllm_batch_scores_each_prompt_in_its_own_choice(dialect_server, llama_engine, prompts):
    engine = HttpEngine(dialect_server("vllm"), vocab_size=llama_engine.vocab_size, options=HttpOptions(top_k=K))
    seqs = [engine.tokenize(p)[:6] for p in prompts]
    batch = engine.score_batch(seqs)
    for seq, table in zip(seqs, batch):
        m = collect([(llama_engine.score(seq), table)])
        assert m.agree.all() and m.kl.max() < 1e-6


def test_llama_server_partial_utf8_pieces_are_asked_again_not_reported_unreachable(dialect_server, llama_engine,
                                                                                   prompts):
    """A greedy token whose piece is an incomplete UTF-8 sequence comes back from llama-server
    without probabilities (seen on the CUDA server, issue 20). Teacher-forced rows must still
    hold the true distribution (asked again with the piece banned), and a generation must
    leave such a piece's row out rather than shift the next token's row onto it."""
    tokens = llama_engine.tokenize(prompts[0])[:8]
    local = llama_engine.score(tokens)
    greedy = [int(t) for t in local.argmax()]
    # the greedy choice at three prefixes, and the first generated token, are "partial"
    partial = frozenset(greedy[2:5] + greedy[-1:])
    engine = HttpEngine(dialect_server("llama-server", partial), vocab_size=llama_engine.vocab_size,
                        options=HttpOptions(timeout_s=30, top_k=K))
    remote = engine.score(tokens)
    m = collect([(local, remote)])
    assert m.n == len(tokens) and m.agree.all() and m.kl.max() < 1e-6
    gen = engine.generate(tokens, 4)
    decoded = llama_engine.generate(tokens, 4)
    assert list(gen.generated) == list(decoded.generated)  # every id, partial pieces included
    rows = np.flatnonzero(gen.steps.present)
    expected = [len(tokens) - 1 + s for s, t in enumerate(decoded.generated) if int(t) not in partial]
    assert list(rows) == expected and len(rows) < 4  # the first generated piece has no row
    for r in rows:  # each reported row is the distribution at that position
        ref = decoded.steps.logprobs[r] if decoded.steps.logprobs is not None else None
        if ref is not None:
            top = int(np.argmax(ref))
            assert int(gen.steps.topk_ids[r, 0]) == top


def test_vllm_prefix_cache_rows_are_one_token_generations_after_the_prefix(dialect_server, llama_engine, prompts):
    """vLLM reads its prefix cache only for requests without prompt log-probs: each warm row is
    the next-token distribution of its own one-token generation, at the rows cached_rows picks,
    in place; the server's hit counter must move (a server without it cannot be judged)."""
    from ggufcheck.engines.base import Unsupported
    from ggufcheck.engines.http import cached_rows

    seq = llama_engine.tokenize(prompts[0])
    with HttpEngine(dialect_server("vllm", metrics=True), vocab_size=llama_engine.vocab_size,
                    options=HttpOptions(top_k=K)) as engine:
        warm = engine.score_cached(seq, len(seq) // 2, top_k=K)
    rows = cached_rows(len(seq), len(seq) // 2)
    assert list(np.flatnonzero(warm.present)) == rows and len(rows) <= 8 and rows[-1] == len(seq) - 1
    truth = llama_engine.score(seq).logprobs
    for r in rows:
        assert [int(t) for t in warm.topk_ids[r, :K]] == [t for t, _ in _top(truth[r])]
        assert np.allclose(warm.topk_logprobs[r, :K], [v for _, v in _top(truth[r])])
    with HttpEngine(dialect_server("vllm"), vocab_size=llama_engine.vocab_size, options=HttpOptions(top_k=K)) as engine:
        with pytest.raises(Unsupported, match="prefix_cache_hits"):
            engine.score_cached(seq, len(seq) // 2, top_k=K)


def test_llama_server_tokens_accepted_from_drafts_have_no_row_and_the_counts_are_read(dialect_server, llama_engine,
                                                                                        prompts):
    """With speculative decoding on, llama-server reports each token it accepted from a draft
    with logprob 0 and an empty top list. Read as a row, that was a distribution with nothing
    in it and every decode check failed on a healthy server (seen with --spec-type draft-mtp);
    such tokens have no row, the first (sampled, not drafted) keeps its row, and the draft
    counts come back through speculative_generate. Without them: Unsupported."""
    from ggufcheck.engines.base import Unsupported

    tokens = llama_engine.tokenize(prompts[0])[:8]
    engine = HttpEngine(dialect_server("llama-server", drafted=6), vocab_size=llama_engine.vocab_size,
                        options=HttpOptions(timeout_s=30, top_k=K))
    gen = engine.generate(tokens, 4)
    decoded = llama_engine.generate(tokens, 4)
    assert list(gen.generated) == list(decoded.generated)
    assert list(np.flatnonzero(gen.steps.present)) == [len(tokens) - 1]
    run = engine.speculative_generate(tokens, 4)
    assert run.generated == tuple(int(t) for t in decoded.generated) and (run.drafted, run.accepted) == (6, 3)
    assert run.draft_max == 3 and run.rate == 0.5
    plain = HttpEngine(dialect_server("llama-server"), vocab_size=llama_engine.vocab_size,
                       options=HttpOptions(timeout_s=30, top_k=K))
    with pytest.raises(Unsupported, match="speculative decoding is off"):
        plain.speculative_generate(tokens, 4)
