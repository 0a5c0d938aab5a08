"""``ggufcheck compare`` end to end on a tiny converted deepseek2: healthy, corrupted, unreachable."""

from __future__ import annotations

import argparse
import json
import socket
import sys

import pytest

from ggufcheck.cli import compare
from ggufcheck.errors import EngineUnreachable, ExitStatus, UsageError
from ggufcheck.results import Status

pytestmark = pytest.mark.llama

PLUGIN = '''
from ggufcheck.engines.faults import ShuffledLogits
from ggufcheck.engines.llama_cpp import LlamaCppEngine


def healthy(model_path):
    return LlamaCppEngine(model_path, n_ctx=64, n_threads=2)


def shuffled(model_path):
    return ShuffledLogits(healthy(model_path))


def not_an_engine(model_path):
    return object()
'''


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["compare", *argv])


@pytest.fixture(scope="module")
def setup(tiny_converted, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    model = tiny_converted("deepseek2", "f32").gguf_path
    root = tmp_path_factory.mktemp("compare")
    (root / "prompts.txt").write_text("The capital of France is Paris.\ndef f(x):\n1, 2, 3, 5, 8, 13\n")
    (root / "my_engines.py").write_text(PLUGIN)
    sys.path.insert(0, str(root))
    yield model, root
    sys.path.remove(str(root))


def _run(model, root, engine, name):
    out = root / f"{name}.json"
    code = compare.run(_args(str(model), "--engine", engine, "--prompts", str(root / "prompts.txt"),
                             "--no-sanity", "--new-tokens", "3", "--json", str(out)))
    return code, json.loads(out.read_text())


def test_healthy_llama_cpp_exits_0_with_every_stage(setup):
    model, root = setup
    code, doc = _run(model, root, "llama-cpp:n_ctx=64,n_threads=2", "healthy")
    stages = {s["stage"]: s for s in doc["stages"]}
    assert code == ExitStatus.HEALTHY, [r["message"] for s in doc["stages"] for r in s["results"]
                                        if r["status"] == "FAIL"]
    assert stages["logits"]["status"] == "PASS" and stages["paths"]["status"] == "PASS"
    # F32 weights, llama.cpp's default f16 KV cache: the baseline run rounds its cache the same way
    assert "measured reference fp32 emulating KV cache f16 vs reference fp64" in stages["logits"]["info"]["baseline"]
    assert stages["logits"]["info"]["positions"] > 10


def test_shuffled_plugin_engine_fails_the_logits_stage(setup):
    model, root = setup
    code, doc = _run(model, root, "python:my_engines:shuffled", "shuffled")
    stages = {s["stage"]: s for s in doc["stages"]}
    assert code == ExitStatus.FINDINGS
    assert stages["logits"]["status"] == "FAIL"
    failed = {r["check"] for r in stages["logits"]["results"] if r["status"] == "FAIL"}
    assert {"logits.kl_mean", "logits.argmax"} <= failed


def test_plugin_returning_something_else_is_a_usage_error(setup):
    model, root = setup
    with pytest.raises(UsageError, match="lacks"):
        compare.run(_args(str(model), "--engine", "python:my_engines:not_an_engine"))


def test_unreachable_server_exits_3(setup):
    model, _ = setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EngineUnreachable) as err:
        compare.run(_args(str(model), "--engine", f"http://127.0.0.1:{port}/v1", "--timeout", "0.5"))
    assert err.value.exit_status == ExitStatus.ENGINE_UNREACHABLE


def test_bad_options_are_usage_errors(setup):
    model, _ = setup
    with pytest.raises(UsageError, match="--max-tokens"):
        compare.run(_args(str(model), "--engine", "llama-cpp", "--max-tokens", "0"))
    with pytest.raises(UsageError, match="unknown engine"):
        compare.run(_args(str(model), "--engine", "tgi"))
    with pytest.raises(UsageError, match="unknown option"):
        compare.run(_args(str(model), "--engine", "llama-cpp:gpu_layers=3"))


@pytest.mark.parametrize("fault, blamed", [("DecodeDrift", "decode"), ("ShuffledLogits", "output")])
def test_the_reference_names_the_broken_path(setup, fault, blamed):
    """Prefill and decode each compared with the reference: the path that disagrees is named."""
    from ggufcheck.checks.compare import CompareOptions, run_compare
    from ggufcheck.engines import faults
    from ggufcheck.engines.spec import open_engine

    model, _ = setup
    with open_engine("llama-cpp:n_ctx=64,n_threads=2", model) as llama, open_engine("reference", model) as ref:
        engine = getattr(faults, fault)(llama)
        seqs = [llama.tokenize(t) for t in ("The capital of France is Paris.", "1, 2, 3, 5, 8, 13, 21")]
        stages = run_compare(engine, seqs, reference=ref,
                             options=CompareOptions(max_new_tokens=4, run_sanity=False, chunk_sizes=()))
    logits = {r.check: r for r in stages[1].results}
    blame = logits["logits.path_blame"]
    assert blame.failed and blame.component == blamed, blame.message


def test_flat_output_blames_output_not_decode(setup):
    """Both paths wrong (a flat head): no result may name the decode path."""
    from ggufcheck.checks.compare import CompareOptions, run_compare
    from ggufcheck.engines.faults import FlatDistribution
    from ggufcheck.engines.spec import open_engine

    model, _ = setup
    with open_engine("llama-cpp:n_ctx=64,n_threads=2", model) as llama, open_engine("reference", model) as ref:
        seqs = [llama.tokenize("The capital of France is Paris.")]
        stages = run_compare(FlatDistribution(llama, temperature=1e3), seqs, reference=ref,
                             options=CompareOptions(max_new_tokens=3, run_sanity=False, chunk_sizes=(),
                                                    decode_prompts=1))
    failed = [r for r in stages[1].results if r.failed]
    assert failed and {r.component for r in failed} == {"output"}, [(r.check, r.component) for r in failed]


def test_prompt_longer_than_the_engine_context_is_left_out_with_a_skip(setup):
    """An engine declining a prompt (llama.cpp past n_ctx) SKIPs that prompt; the rest is judged."""
    from ggufcheck.checks.compare import CompareOptions, run_compare
    from ggufcheck.engines.spec import open_engine

    model, _ = setup
    with open_engine("llama-cpp:n_ctx=16,n_threads=2", model) as llama, open_engine("reference", model) as ref:
        short = llama.tokenize("The capital of France is Paris.")
        long = llama.tokenize(" ".join(["one two three four five six"] * 6))
        assert len(short) <= 16 < len(long)
        options = CompareOptions(max_new_tokens=2, run_sanity=False, chunk_sizes=())
        sanity, logits, paths = run_compare(llama, [long, short], reference=ref, options=options)
        only_long = run_compare(llama, [long], reference=ref, options=options)
    declined = [r for r in logits.results if r.check == "logits.prompt_declined"]
    assert len(declined) == 1 and declined[0].status == Status.SKIP and "prompt 0" in declined[0].message
    assert "n_ctx=16" in declined[0].message
    assert logits.info["positions"] == len(short)  # judged on the short prompt alone
    assert not logits.failures and any(r.status == Status.PASS for r in logits.results)
    assert all(r.status == Status.SKIP and "no prompt was scored" in r.message
               for stage in only_long for r in stage.results)


def test_prompt_logprobs_shifted_by_one_row_are_named_and_the_realigned_rows_judged(setup):
    """A server that reports each prompt distribution one row early (llama-cpp-python's echo
    dialect) made a healthy model look random; the offset is named as the API's, and every
    other check judges the realigned rows and passes (sanity: the test model is random)."""
    from ggufcheck.checks.compare import CompareOptions, run_compare
    from ggufcheck.engines import faults
    from ggufcheck.engines.spec import open_engine

    model, _ = setup
    with open_engine("llama-cpp:n_ctx=64,n_threads=2", model) as llama, open_engine("reference", model) as ref:
        seqs = [llama.tokenize(t) for t in ("The capital of France is Paris.", "1, 2, 3, 5, 8, 13, 21")]
        stages = run_compare(faults.ShiftedPrefill(llama), seqs, reference=ref,
                             options=CompareOptions(max_new_tokens=4, chunk_sizes=(), run_sanity=False))
        healthy = run_compare(llama, seqs, reference=ref, options=CompareOptions(max_new_tokens=4, chunk_sizes=(), run_sanity=False))
    failures = [r for st in stages for r in st.results if r.failed]
    assert [(r.check, r.component) for r in failures] == [("logits.alignment", "api")], [r.message for r in failures]
    assert failures[0].stats["offset"] == 1 and "shifted by 1 position" in failures[0].message
    assert failures[0].stats["kl_realigned"] * 20 < failures[0].stats["kl_as_reported"]
    assert not [r for st in healthy for r in st.results if r.check == "logits.alignment"]  # no false alarm


def test_an_engine_that_ignores_its_input_is_named_as_such(setup):
    """The same distribution at every position (the prompt's first token repeated): named as
    the input not reaching the model, at the embedding, not as garbage output."""
    from ggufcheck.checks.compare import CompareOptions, run_compare
    from ggufcheck.engines import faults
    from ggufcheck.engines.spec import open_engine

    model, _ = setup
    with open_engine("llama-cpp:n_ctx=64,n_threads=2", model) as llama, open_engine("reference", model) as ref:
        seqs = [llama.tokenize(t) for t in ("The capital of France is Paris.", "1, 2, 3, 5, 8, 13, 21")]
        stages = run_compare(faults.InputIgnored(llama), seqs, reference=ref,
                             options=CompareOptions(max_new_tokens=4, chunk_sizes=(), run_sanity=False))
        healthy = run_compare(llama, seqs, reference=ref,
                              options=CompareOptions(max_new_tokens=4, chunk_sizes=(), run_sanity=False))
    from ggufcheck.diagnose.verdict import decide

    verdict = decide(stages)
    assert (verdict.check, verdict.component) == ("logits.input_ignored", "embedding"), verdict.message
    assert "the input is ignored" in verdict.message
    assert not [r for st in healthy for r in st.results if r.check == "logits.input_ignored"]


def test_a_model_whose_every_position_follows_a_tie_is_still_judged(tiny_gguf):
    """A tiny glm-dsa (MoE + DSA indexer) on llama.cpp: every position follows a routing or
    indexer near-tie of the reference within the q8 class's margin, so leaving those rows out
    left the logits stage nothing to judge (it skipped, and the verdict said healthy; seen on
    CPU and on the H200). Now every position is judged against the baseline run on the same
    positions, and a real fault there still fails."""
    from ggufcheck.checks.compare import CompareOptions, run_compare
    from ggufcheck.engines.faults import ShuffledLogits
    from ggufcheck.engines.llama_cpp import LlamaCppEngine
    from ggufcheck.engines.reference import ReferenceEngine

    model = tiny_gguf("glm-dsa", seed=3, qtypes="Q4_K", n_embd=256, n_ff_exp=256, n_ff=512).path
    reference = ReferenceEngine(model, dtype="fp64")
    baseline = ReferenceEngine(model, dtype="fp32")
    engine = LlamaCppEngine(model, n_ctx=256, n_threads=2)
    try:
        seqs = [list(range(1, 90)), [5, 9, 17, 33, 65, 129] * 10]
        for eng, healthy in ((engine, True), (ShuffledLogits(engine), False)):
            stages = run_compare(eng, seqs, reference=reference, baseline_engine=baseline,
                                 options=CompareOptions(sweep_to=0, long_decode_to=0))
            logits = {r.check: r for s in stages if s.stage == "logits" for r in s.results}
            kl = logits["logits.kl_mean"]  # judged, not skipped
            assert kl.status is (Status.PASS if healthy else Status.FAIL), kl.message
            if healthy:
                assert "every position is judged" in kl.message
    finally:
        engine.close()
        reference.close()
        baseline.close()


def test_compare_writes_the_html_report_with_its_kl_plot(setup):
    model, root = setup
    page = root / "compare.html"
    code = compare.run(_args(str(model), "--engine", "python:my_engines:shuffled", "--prompts",
                             str(root / "prompts.txt"), "--no-sanity", "--new-tokens", "3", "--no-paths",
                             "--sweep-to", "0", "--html", str(page)))
    html = page.read_text()
    assert code == ExitStatus.FINDINGS
    assert "ggufcheck compare" in html and "<svg" in html and "logits.kl_mean" in html
