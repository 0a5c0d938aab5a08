"""The verdict rules: first failing stage, earliest layer, specific before generic."""

from ggufcheck.diagnose.verdict import decide
from ggufcheck.diagnose.vocabulary import COMPONENTS, component
from ggufcheck.results import StageReport, errored, failed, passed, skipped


def stage(name, *results):
    s = StageReport(name)
    s.add(list(results))
    return s


def test_healthy_when_nothing_fails_and_the_deployment_was_judged():
    v = decide([stage("file", passed("a", "gguf-file", "ok")), stage("logits", passed("b", "output", "ok"))])
    assert v.healthy and v.component is None
    v = decide([stage("file", passed("a", "gguf-file", "ok")), stage("logits", skipped("b", "output", "no engine"))])
    assert not v.healthy and v.unverified and "no engine" in v.message  # skipped is not healthy


def test_first_stage_with_a_failure_decides():
    v = decide([
        stage("file", passed("a", "gguf-file", "ok")),
        stage("weights", failed("w", "weights", "rank 1 holds shard 0", tensor="blk.0.attn_q.weight", layer=0)),
        stage("logits", failed("kl", "output", "KL too high")),
    ])
    assert (v.healthy, v.component, v.stage, v.layer) == (False, "weights", "weights", 0)
    assert v.evidence["tensor"] == "blk.0.attn_q.weight"
    assert v.next_steps == component("weights").next_steps


def test_earliest_layer_then_specific_component():
    v = decide([stage(
        "layers",
        failed("l", "output", "diverged", layer=5),
        failed("l", "attention", "attention diverged", layer=3),
        failed("l", "mla-kv-b", "W_UV mismatch", layer=3),
        failed("l", "ffn", "ffn", layer=4),
    )])
    assert (v.component, v.layer) == ("mla-kv-b", 3)


def test_errors_alone_are_inconclusive():
    v = decide([stage("kernels", errored("k", "kernel", "probe crashed"))])
    assert not v.healthy and v.inconclusive and v.errors


def test_vocabulary_is_the_documented_one():
    names = [c.name for c in COMPONENTS]
    assert names == [
        "environment", "kernel", "gguf-file", "metadata", "chat-template", "mapping", "dequant", "weights",
        "sharding", "embedding", "attention", "mla-kv-b", "rope", "norm", "indexer", "moe-router", "moe-experts",
        "ffn", "lm-head", "mtp", "api", "prefill", "decode", "kv-cache", "batching", "sampling", "output",
    ]


def test_docs_list_every_component():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "verdicts.md").read_text()
    for c in COMPONENTS:
        assert f"| `{c.name}` |" in doc, c.name


def test_the_terminal_shows_evidence_in_words_not_python_dicts():
    from ggufcheck.report.diagnosis import plain

    assert plain({"sequence": 2, "position": 81, "element": 260}) == "sequence 2, position 81, element 260"
    assert plain({"rank": 1, "holds_rank": 0}) == "rank 1, holds rank 0"


def test_worst_values_print_without_python_syntax_or_long_floats():
    from ggufcheck.report.diagnosis import plain

    assert plain({"sequence": 2, "position": 79, "kl": 10.058613658112662}) == "sequence 2, position 79, kl 10.1"
    assert plain({"rank": 0, "where": [1, 2.5e-07]}) == "rank 0, where 1, 2.5e-07"


def test_a_shifted_server_says_how_to_get_a_run_that_passes():
    """issue 38 item 8: llama-cpp-python's server shifts prompt rows without a BOS; the `api`
    verdict's next step names the way to a healthy run, not only the fault."""
    from ggufcheck.diagnose.verdict import decide
    from ggufcheck.results import StageReport, failed

    stage = StageReport("logits")
    stage.add(failed("logits.alignment", "api", "the served prompt log-probs are shifted by 1 position"))
    v = decide([stage])
    assert v.component == "api" and "--prompts" in v.next_steps and "BOS" in v.next_steps
