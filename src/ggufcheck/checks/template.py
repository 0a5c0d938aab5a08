"""The chat template: does a chat request reach the model the way the model was trained to read it?

Chat template, BOS and special tokens are the most reported cause of "garbage" in public bug
threads (a BOS doubled or missing, an end-of-turn marker the engine does not stop on, a
template the engine renders differently), and none of it shows in logits scored on token ids:
every layer can be exact while every chat answer is wrong. So it is a verdict of its own
(component ``chat-template``), judged before any logits:

- ``template.render``: the GGUF's ``tokenizer.chat_template`` renders a fixed conversation in
  jinja's immutable sandbox (the template is untrusted input: no file access, no unsafe
  attribute, no mutation; ``range`` bounded), with the options transformers'
  ``apply_chat_template`` uses (trim_blocks, lstrip_blocks, loop controls, ``tojson``,
  ``raise_exception``, ``strftime_now``);
- ``template.bos``: the rendered prompt, tokenized as transformers does for a chat
  (``add_special_tokens=False``, special-token text parsed), starts with one BOS at most; a
  template without BOS on a vocabulary that asks for one is a WARN (engines disagree: llama.cpp's
  server adds it, llama-cpp-python's chat handler and transformers do not);
- ``template.end_of_turn``: the marker the template closes an assistant turn with is one
  token the engines stop on: the file's EOS / EOT / EOM id (PASS); only by llama.cpp's
  end-of-generation names (WARN: engines that stop on the ids alone run past it); neither
  (FAIL: generation runs on into a new turn);
- ``template.engine``: the tokens the engine feeds the model for the same chat request
  (``Engine.chat_tokens``) equal the ones above, or the first difference is named (BOS
  doubled, BOS missing, a token that differs).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

from ggufcheck.results import Result, StageReport, failed, passed, skipped, warned
from ggufcheck.tokenizer.vocab import TokenType

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.diagnose.session import Session

COMPONENT = "chat-template"
TEMPLATE_KEY = "tokenizer.chat_template"
# the conversation every check renders (a system turn, a user turn, then the generation prompt)
CONVERSATION = ({"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "What is the capital of France?"})
REPLY = {"role": "assistant", "content": "Paris."}
# llama.cpp's end-of-generation token names (llama-vocab.cpp marks these EOG by their text)
LLAMA_CPP_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                       "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


class TemplateError(Exception):
    """The template did not render (its own raise_exception, a syntax error, a sandbox refusal)."""


def render(template: str, messages: Sequence[dict], *, bos_token: str, eos_token: str,
           add_generation_prompt: bool) -> str:
    """``template`` rendered in jinja's immutable sandbox as transformers' apply_chat_template does."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(f"the template raised: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                  ensure_ascii=ensure_ascii)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(messages=[dict(m) for m in messages], bos_token=bos_token,
                                                eos_token=eos_token, add_generation_prompt=add_generation_prompt)
    except TemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            OverflowError, RecursionError) as err:
        raise TemplateError(f"{type(err).__name__}: {err}") from None


def expected_tokens(tokenizer, text: str) -> list[int]:
    """A rendered chat as transformers tokenizes it: special-token text parsed, nothing added."""
    return tokenizer.encode(text, add_special=False, parse_special=True)


def check_template(metadata: dict, tokenizer, engine: Any = None) -> list[Result]:
    """The template checks (module docstring) for one file, and for ``engine`` where given."""
    template = metadata.get(TEMPLATE_KEY)
    if not isinstance(template, str) or not template.strip():
        return [skipped("template.render", COMPONENT, f"the file has no {TEMPLATE_KEY}: chat requests use "
                                                      "whatever template each engine falls back to")]
    vocab = tokenizer.vocab
    bos = vocab.tokens[vocab.bos_id] if vocab.bos_id is not None else ""
    eos = vocab.tokens[vocab.eos_id] if vocab.eos_id is not None else ""
    try:
        prompt = render(template, CONVERSATION, bos_token=bos, eos_token=eos, add_generation_prompt=True)
    except TemplateError as err:
        try:  # a template that refuses a system turn is a choice, not a defect
            prompt = render(template, CONVERSATION[1:], bos_token=bos, eos_token=eos, add_generation_prompt=True)
        except TemplateError:
            return [failed("template.render", COMPONENT, f"{TEMPLATE_KEY} does not render a system + user "
                                                         f"conversation in jinja's sandbox: {err}")]
    ids = expected_tokens(tokenizer, prompt)
    out = [passed("template.render", COMPONENT, f"{TEMPLATE_KEY} renders a chat in jinja's sandbox: "
                                                f"{len(prompt)} characters, {len(ids)} tokens",
                  stats={"prompt": prompt, "tokens": ids})]
    out.append(_bos(ids, vocab))
    out.append(_end_of_turn(template, metadata, tokenizer, bos, eos))
    if engine is not None:
        out.append(_engine(engine, ids, tokenizer))
    return out


def _bos(ids: list[int], vocab) -> Result:
    check = "template.bos"
    if vocab.bos_id is None:
        return skipped(check, COMPONENT, "the vocabulary has no BOS token")
    lead = next((i for i, t in enumerate(ids) if t != vocab.bos_id), len(ids))
    if lead >= 2:
        text = vocab.tokens[vocab.bos_id]
        return failed(check, COMPONENT, f"the rendered chat starts with {lead} BOS tokens ({text!r} id {vocab.bos_id}): "
                                        "the template emits BOS more than once", stats={"leading_bos": lead})
    if lead == 0 and vocab.add_bos:
        return warned(check, COMPONENT, "the template emits no BOS while the vocabulary asks for one "
                                        "(tokenizer.ggml.add_bos_token): engines disagree on adding it (llama.cpp's "
                                        "server adds it; llama-cpp-python's chat handler and transformers' "
                                        "apply_chat_template do not)", stats={"leading_bos": 0})
    how = "from the template" if lead else "none, and the vocabulary asks for none"
    return passed(check, COMPONENT, f"one BOS at most: {how}", stats={"leading_bos": lead})


def _end_of_turn(template: str, metadata: dict, tokenizer, bos: str, eos: str) -> Result:
    """The token right after the assistant's reply in a rendered conversation, and whether the
    engines stop on it."""
    check = "template.end_of_turn"
    vocab = tokenizer.vocab
    try:
        turn = render(template, [*CONVERSATION[1:], REPLY], bos_token=bos, eos_token=eos, add_generation_prompt=False)
    except TemplateError as err:
        return skipped(check, COMPONENT, f"the template does not render a finished assistant turn: {err}")
    at = turn.rfind(REPLY["content"])
    if at < 0:
        return skipped(check, COMPONENT, "the rendered conversation does not contain the assistant's reply")
    after = expected_tokens(tokenizer, turn[at + len(REPLY["content"]):])
    marker = next((t for t in after if vocab.types[t] in (TokenType.CONTROL, TokenType.USER_DEFINED)), None)
    if marker is None:
        return skipped(check, COMPONENT, "no special token closes the assistant's turn in the template")
    text = vocab.tokens[marker]
    stop_ids = {k: metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")}
    named = [k.upper() for k, v in stop_ids.items() if v == marker]
    if named:
        return passed(check, COMPONENT, f"the assistant's turn ends with {text!r} (id {marker}), the file's "
                                        f"{'/'.join(named)} token: engines stop there", stats={"marker": marker})
    if text in LLAMA_CPP_EOG_TEXTS:
        return warned(check, COMPONENT, f"the assistant's turn ends with {text!r} (id {marker}), which is not the "
                                        f"file's EOS ({stop_ids['eos']}) nor an EOT id: llama.cpp stops on it by "
                                        "its name, engines that stop on the file's ids alone run past it (set "
                                        "tokenizer.ggml.eot_token_id)", stats={"marker": marker})
    return failed(check, COMPONENT, f"the assistant's turn ends with {text!r} (id {marker}), which no engine "
                                    f"stops on: not the file's EOS ({stop_ids['eos']}), EOT or EOM, nor an "
                                    "end-of-generation name llama.cpp knows: generation runs on into a new turn",
                  stats={"marker": marker})


def _engine(engine, want: list[int], tokenizer) -> Result:
    check = "template.engine"
    from ggufcheck.engines.base import Unsupported

    chat_tokens = getattr(engine, "chat_tokens", None)
    if chat_tokens is None:
        return skipped(check, COMPONENT, f"{engine.name} does not say which tokens it feeds for a chat request")
    try:
        got = [int(t) for t in chat_tokens(list(CONVERSATION))]
    except Unsupported as why:
        return skipped(check, COMPONENT, f"{engine.name}: {why}")
    if got == want:
        return passed(check, COMPONENT, f"{engine.name} feeds the same {len(got)} tokens for the chat request")
    bos = tokenizer.vocab.bos_id
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if bos is not None and got[:1] == [bos] and got[1:] == want:
        what = ("the BOS doubled (the template's, and one the engine adds)" if want[:1] == [bos] else
                "a BOS the template does not emit, added in front")
    elif bos is not None and want[:1] == [bos] and got == want[1:]:
        what = "no BOS (the template's BOS dropped)"
    else:
        show = lambda ids: repr(tokenizer.decode(ids[i:i + 6]))  # noqa: E731
        what = f"a different token at position {i}: {show(got)} where the template gives {show(want)}"
    return failed(check, COMPONENT, f"{engine.name} feeds the chat request with {what} ({len(got)} tokens against "
                                    f"{len(want)})", stats={"engine_tokens": got[:64], "expected_tokens": want[:64],
                                                             "first_difference": i})


def template_report(model, engine: Any = None) -> StageReport:
    """The template stage's report for an open model (``inspect`` runs it without an engine)."""
    from ggufcheck.errors import GGUFCheckError
    from ggufcheck.tokenizer import load_tokenizer

    report = StageReport("template")
    try:
        tokenizer = load_tokenizer(model)
    except GGUFCheckError as err:
        report.add(skipped("template.render", COMPONENT, f"no tokenizer for this file: {err.message}"))
        return report
    report.add(check_template(dict(model.metadata), tokenizer, engine))
    return report


def run(session: "Session") -> list[StageReport]:
    """The template stage: the file's template, and the engine's rendering of it where it says."""
    return [template_report(session.open_model(), session.engine() if session.has_engine else None)]
