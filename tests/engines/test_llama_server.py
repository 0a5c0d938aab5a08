"""``--engine llama-server``: llama.cpp's own server, started by ggufcheck and judged over HTTP.

The binary is built from the same llama.cpp source as the tests' defect library
(testing/llama_cpp_build.py: ``flash-attn-scale``, ``iq4_nl-gemm-table`` and ``q4_k-gemv-min``,
each reached only by its own path): with flash attention off and a Q8_0 model no defect is
reached and the server must be healthy; with llama-server's default flash attention on, the
flash-attention defect makes the served comparison fail and the switch stage names
``flash_attn=0``; an IQ4_NL model reaches the matrix-matrix defect, which only a batched prefill
takes: the stepwise teacher forcing is healthy and the cold prefill check names it. The chat
template check compares the tokens the server feeds for a chat (``/apply-template`` +
``/tokenize``) with the file's template rendered in the sandbox.
"""

from __future__ import annotations

import pytest

from ggufcheck.errors import Unavailable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server_bin():
    from ggufcheck.testing.llama_cpp_build import TEST_DEFECTS, built_library

    try:
        folder = built_library(TEST_DEFECTS)
    except Unavailable as why:
        pytest.skip(f"llama.cpp cannot be built here: {why}")
    binary = folder / "llama-server"
    if not binary.is_file():
        pytest.skip("this build has no llama-server")
    return binary


def _options(model, **kw):
    from ggufcheck.diagnose.plan import DiagnoseOptions

    return DiagnoseOptions(model=model, kernels=False, sanity=False, max_prompts=2, max_tokens=24, decode_to=0,
                           sweep_to=0, **kw)


def test_a_healthy_server_is_healthy_and_stops_with_the_run(server_bin, tiny_gguf):
    from ggufcheck.diagnose.plan import diagnose

    model = tiny_gguf("llama", qtypes="Q8_0", seed=2).path
    d = diagnose(_options(model, engine=f"llama-server:bin={server_bin},flash_attn=0"))
    assert d.verdict.healthy, d.verdict.message
    cold = _result(d, "paths.cold_prefill")  # the batched prefill, asked with the prompt cache off
    assert cold.status.value == "PASS" and cold.stats["kl"]["n"] >= 4, cold.message
    assert "judged by paths.cold_prefill" in _result(d, "paths.prefill_vs_decode").message
    assert d.engine["process"] == "llama-server" and "-fa off" in d.engine["command"]
    import os

    pid = d.engine["pid"]
    with pytest.raises(ProcessLookupError):  # the server is gone with the run
        os.kill(pid, 0)


def _result(d, check):
    return next(r for s in d.stages for r in s.results if r.check == check)


def test_a_defect_only_a_batched_prefill_reaches_is_named_prefill(server_bin, tiny_gguf):
    """llama-server's teacher forcing steps one token at a time through its prompt cache (the
    matrix-vector kernels, healthy here): the logits stage passes. The rows requested cold
    (one batched prefill each) take the broken IQ4_NL matrix-matrix kernel."""
    from ggufcheck.diagnose.plan import diagnose

    model = tiny_gguf("llama", qtypes="IQ4_NL", seed=2).path
    d = diagnose(_options(model, engine=f"llama-server:bin={server_bin},flash_attn=0"))
    logits = [r for s in d.stages for r in s.results if r.check.startswith("logits.")]
    assert logits and not any(r.failed for r in logits), [r.message for r in logits if r.failed]
    cold = _result(d, "paths.cold_prefill")
    assert cold.failed and cold.component == "prefill", cold.message
    facts = cold.stats["against_reference"]
    assert not facts["the cold prefill"]["ok"] and facts["the one-token steps through the prompt cache"]["ok"]
    assert not d.verdict.healthy and d.verdict.component == "prefill", d.verdict.message


def test_the_flash_attention_defect_is_named_by_flipping_flash_attn(server_bin, tiny_gguf):
    from ggufcheck.diagnose.plan import diagnose

    model = tiny_gguf("llama", qtypes="Q8_0", seed=2).path
    d = diagnose(_options(model, engine=f"llama-server:bin={server_bin},flash_attn=1"))
    assert not d.verdict.healthy
    switches = next(s for s in d.stages if s.stage == "switches")
    flipped = {r.check: r for r in switches.results}
    assert any(r.status.value == "FAIL" and "flash_attn=0" in r.message for r in flipped.values()), \
        [r.message for r in switches.results]
    assert "flash-attention path" in d.verdict.message or "flash_attn=0" in d.verdict.message, d.verdict.message


def test_the_chat_template_the_server_applies_matches_the_file(server_bin, smollm2_path, tmp_path):
    from ggufcheck.checks.template import check_template
    from ggufcheck.engines.llama_server import LlamaServerEngine
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.results import Status
    from ggufcheck.testing.filefaults import set_key
    from ggufcheck.tokenizer import load_tokenizer

    with open_gguf(smollm2_path) as m:
        metadata, tokenizer = dict(m.metadata), load_tokenizer(m)
    with LlamaServerEngine(smollm2_path, {"bin": str(server_bin), "n_ctx": 512}) as engine:
        results = {r.check: r for r in check_template(metadata, tokenizer, engine)}
    assert results["template.engine"].status is Status.PASS, results["template.engine"].message
    # a template that writes a BOS the server's tokenizer also adds: the server feeds two
    doubled = set_key(smollm2_path, tmp_path / "doubled-bos.gguf", "tokenizer.chat_template",
                      "{{ bos_token }}" + metadata["tokenizer.chat_template"])
    with open_gguf(doubled) as m:
        metadata2 = dict(m.metadata)
    with LlamaServerEngine(doubled, {"bin": str(server_bin), "n_ctx": 512}) as engine:
        results = {r.check: r for r in check_template(metadata2, tokenizer, engine)}
    assert results["template.bos"].status is Status.FAIL and "2 BOS" in results["template.bos"].message


def test_a_missing_binary_is_unavailable_with_the_ways_to_name_one(tiny_gguf, monkeypatch):
    from ggufcheck.engines.spec import open_engine

    monkeypatch.delenv("GGUFCHECK_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(Unavailable, match="no llama-server binary found"):
        open_engine("llama-server", tiny_gguf("llama", qtypes="Q8_0", seed=2).path)
    with pytest.raises(Unavailable, match="bin=/nope: no executable"):
        open_engine("llama-server:bin=/nope", tiny_gguf("llama", qtypes="Q8_0", seed=2).path)


def test_served_mtp_acceptance_names_a_broken_draft_head(server_bin, tiny_gguf, monkeypatch):
    """llama-server with speculative decoding on its NextN head (``spec_draft=3``: --spec-type
    draft-mtp) on a tiny deepseek2 whose head drafts what its trunk chooses
    (synthetic.tiny.draftable_nextn): every draft accepted, as the reference's head predicts
    (PASS). The same server with the build's MTP defect switched on (GGUFCHECK_MTP_DEFECT: the
    head's inputs concatenated [state ; token]) still answers right, but its drafts are
    rejected: FAIL, component mtp. On random weights neither side's head predicts its trunk and
    the rate is not judged (SKIP, saying why). The paths checks are off here (time): with drafts on
    they judge only the rows the server sampled itself (tests/engines/test_http_dialects.py)."""
    from ggufcheck.diagnose.plan import diagnose
    from ggufcheck.synthetic.tiny import draftable_nextn

    engine = f"llama-server:bin={server_bin},flash_attn=0,spec_draft=3"
    draftable = tiny_gguf("deepseek2", n_nextn=1, patch=draftable_nextn, seed=1).path
    monkeypatch.delenv("GGUFCHECK_MTP_DEFECT", raising=False)
    healthy = diagnose(_options(draftable, engine=engine, paths=False))
    served = _result(healthy, "mtp.served_acceptance")
    assert served.status.value == "PASS", served.message
    assert served.stats["drafted"] > 0 and served.stats["accepted"] == served.stats["drafted"]
    assert served.stats["reference_rate"] == 1.0
    assert healthy.verdict.healthy, healthy.verdict.message

    monkeypatch.setenv("GGUFCHECK_MTP_DEFECT", "1")  # the server started next inherits it
    broken = diagnose(_options(draftable, engine=engine, paths=False))
    served = _result(broken, "mtp.served_acceptance")
    assert served.status.value == "FAIL" and served.component == "mtp", served.message
    assert served.stats["served_rate"] < 0.5 and served.stats["reference_rate"] == 1.0
    assert not broken.verdict.healthy and broken.verdict.component == "mtp", broken.verdict.message

    monkeypatch.delenv("GGUFCHECK_MTP_DEFECT")
    random_head = tiny_gguf("deepseek2", n_nextn=1, seed=1).path
    served = _result(diagnose(_options(random_head, engine=engine, paths=False)), "mtp.served_acceptance")
    assert served.status.value == "SKIP" and "not judged" in served.message, served.message
