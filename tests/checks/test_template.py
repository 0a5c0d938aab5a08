"""The chat-template stage: the GGUF's template rendered in jinja's sandbox, tokenized as
transformers does for a chat, and compared with what the engine feeds for the same request.

Healthy real models pass (SmolLM2 through llama.cpp; Gemma 3 270M, whose file carries no
template, is skipped, not failed); a file whose template doubles the BOS fails; the engine
comparison names what differs."""

from __future__ import annotations

import pytest

from ggufcheck.checks.template import CONVERSATION, check_template, render, TemplateError
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.results import Status
from ggufcheck.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with open_gguf(smollm2_path) as m:
        return dict(m.metadata), load_tokenizer(m)


def _by_check(results):
    return {r.check: r for r in results}


@pytest.fixture(scope="module")
def llama_cpp_engine():
    pytest.importorskip("llama_cpp")
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    engines = []

    def make(path):
        engines.append(LlamaCppEngine(path, n_ctx=256))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def test_smollm2_through_llama_cpp_passes(smollm2_path, smollm2, llama_cpp_engine):
    metadata, tokenizer = smollm2
    results = _by_check(check_template(metadata, tokenizer, llama_cpp_engine(smollm2_path)))
    assert {c: r.status for c, r in results.items()} == {
        "template.render": Status.PASS, "template.bos": Status.PASS, "template.end_of_turn": Status.PASS,
        "template.engine": Status.PASS}, [r.message for r in results.values()]
    assert "'<|im_end|>'" in results["template.end_of_turn"].message


def test_gemma3_without_a_template_is_skipped(gemma3_path):
    with open_gguf(gemma3_path) as m:
        (only,) = check_template(dict(m.metadata), load_tokenizer(m))
    assert only.status is Status.SKIP and "no tokenizer.chat_template" in only.message


def test_a_file_whose_template_doubles_the_bos_fails_diagnose(smollm2_path, smollm2, tmp_path, llama_cpp_engine):
    from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
    from ggufcheck.testing.filefaults import set_key

    metadata, _ = smollm2
    doubled = set_key(smollm2_path, tmp_path / "doubled-bos.gguf", "tokenizer.chat_template",
                      "{{ bos_token }}" + metadata["tokenizer.chat_template"])
    engine = llama_cpp_engine(doubled)
    d = diagnose(DiagnoseOptions(model=doubled, kernels=False, max_prompts=1, max_tokens=16, layers=(0,)),
                 engine=engine)  # one layer: the verdict is the template stage's, before any layer
    assert (d.verdict.component, d.verdict.stage, d.verdict.check) == ("chat-template", "template", "template.bos")
    assert "starts with 2 BOS tokens" in d.verdict.message
    template = next(s for s in d.stages if s.stage == "template")
    assert _by_check(template.results)["template.engine"].status is Status.PASS  # llama.cpp feeds both, as written


def test_end_of_turn_tokens_the_engines_do_not_stop_on(smollm2):
    metadata, tokenizer = smollm2
    wrong_close = metadata["tokenizer.chat_template"].replace("'<|im_end|>'", "'<|im_start|>'")
    result = _by_check(check_template({**metadata, "tokenizer.chat_template": wrong_close}, tokenizer))
    assert result["template.end_of_turn"].status is Status.FAIL and "runs on" in result["template.end_of_turn"].message
    other_eos = _by_check(check_template({**metadata, "tokenizer.ggml.eos_token_id": 0}, tokenizer))
    assert other_eos["template.end_of_turn"].status is Status.WARN  # llama.cpp stops on '<|im_end|>' by name
    eot = _by_check(check_template({**metadata, "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.eot_token_id": 2},
                                   tokenizer))
    assert eot["template.end_of_turn"].status is Status.PASS and "EOT" in eot["template.end_of_turn"].message


class _ChatEngine:
    """An engine that feeds the template's tokens, changed by ``edit``."""

    name = "edited"

    def __init__(self, tokens, edit):
        self.tokens, self.edit = tokens, edit

    def chat_tokens(self, messages):
        return self.edit(list(self.tokens))


def test_the_engine_comparison_names_the_difference(smollm2):
    metadata, tokenizer = smollm2
    want = _by_check(check_template(metadata, tokenizer))["template.render"].stats["tokens"]
    bos = tokenizer.vocab.bos_id
    assert want[0] == bos  # SmolLM2's template starts with its BOS (<|im_start|>)
    cases = {"the BOS doubled": lambda t: [bos, *t], "no BOS": lambda t: t[1:],
             "a different token at position 5": lambda t: t[:5] + [t[5] + 1] + t[6:]}
    for what, edit in cases.items():
        result = _by_check(check_template(metadata, tokenizer, _ChatEngine(want, edit)))["template.engine"]
        assert result.status is Status.FAIL and what in result.message, result.message


def test_the_template_is_rendered_in_a_sandbox():
    """Untrusted input: attribute walks to Python internals, mutation and include are refused."""
    for evil in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.append(1) }}",
                 "{% include '/etc/passwd' %}", "{{ raise_exception('no system role') }}"):
        with pytest.raises(TemplateError):
            render(evil, CONVERSATION, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
