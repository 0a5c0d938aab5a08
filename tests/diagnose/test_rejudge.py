"""Run, then judge: ``diagnose --save-run DIR`` keeps the engine's answers, ``rejudge DIR`` judges
them again without the engine (engines/recorded.py, diagnose/rejudge.py)."""

from __future__ import annotations

import json
from types import MappingProxyType

import numpy as np
import pytest

from ggufcheck.cli import main
from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
from ggufcheck.diagnose.rejudge import rejudge
from ggufcheck.engines.base import Capabilities, Generation, LayerTrace, Switch, TokenLogprobs, Unsupported
from ggufcheck.engines.recorded import (RecordingEngine, ReplayEngine, RunRecorder, capabilities_from,
                                        capabilities_json, decode, encode, engine_manifest)
from ggufcheck.errors import UsageError
from ggufcheck.synthetic.tiny import build_tiny_gguf


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_gguf("llama", tmp_path_factory.mktemp("m") / "tiny-llama.gguf", qtypes="Q8_0").path


def _results(d) -> list[tuple]:
    return [(s.stage, r.check, r.status, r.component, r.layer, r.tensor, r.message,
             json.dumps(r.to_json().get("stats"), sort_keys=True, default=str))
            for s in d.stages for r in s.results]


def _options(model, run_dir, **kw) -> DiagnoseOptions:
    return DiagnoseOptions(model=model, sanity=False, kernels=False, max_prompts=3, max_tokens=40,
                           save_run=run_dir, **kw)


@pytest.mark.parametrize("arch,fault", [("llama", "kv-cache-corrupt-decode"), ("deepseek2", "kv-b-all-k-then-v"),
                                        ("llama", None)])
def test_a_saved_run_rejudged_gives_every_result_again(tiny_gguf, tmp_path, arch, fault):
    """Every check's status, component, layer, message and numbers, the same from the saved answers
    as from the engine; the stages that need the engine itself are carried over as they were."""
    from ggufcheck.testing.faults import make_faulty_engine

    model = tiny_gguf(arch, qtypes="Q8_0").path
    engine = make_faulty_engine(fault, model) if fault else None
    try:
        ran = diagnose(_options(model, tmp_path / "run", engine=None if fault else "reference"), engine=engine)
    finally:
        if engine is not None:
            engine.close()
    again, replay = rejudge(tmp_path / "run")
    assert _results(again) == _results(ran)
    assert again.verdict.to_json() == ran.verdict.to_json()
    assert ran.verdict.healthy is (fault is None)
    assert replay.calls > 20 and replay.unused == 0
    carried = {s.stage for s in again.stages if s.info.get("carried")}
    assert carried == {"environment", "weights", "switches"}
    assert replay.manifest["verdict"] == ran.verdict.to_json()


def test_the_replay_judges_the_saved_answers_not_the_reference_again(tiny_llama, tmp_path):
    """A saved answer changed on disk (one prompt's table: a row's top two tokens swapped)
    changes the re-judged verdict: the replay reads what the engine said."""
    ran = diagnose(_options(tiny_llama, tmp_path / "run", engine="reference"))
    assert ran.verdict.healthy
    lines = (tmp_path / "run" / "calls.jsonl").read_text().splitlines()
    entry = next(json.loads(line) for line in lines if json.loads(line)["key"].startswith('["score"'))
    path = tmp_path / "run" / entry["arrays"]
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    rows = arrays["logprobs"].copy()
    for t in range(len(rows)):  # each row's two most likely tokens trade places
        a, b = np.argsort(-rows[t])[:2]
        rows[t, [a, b]] = rows[t, [b, a]]
    arrays["logprobs"] = rows
    arrays.pop("next_logprob")
    np.savez(path, **arrays)
    again, _ = rejudge(tmp_path / "run")
    assert not again.verdict.healthy


def test_a_call_the_run_did_not_make_is_refused_by_name(tiny_llama, tmp_path):
    from ggufcheck.engines.reference import ReferenceEngine

    with ReferenceEngine(tiny_llama, dtype="fp32") as inner:
        recorder = RunRecorder(tmp_path / "r")
        recorder.write_manifest({"engine": engine_manifest(inner)})
        rec = RecordingEngine(inner, recorder)
        first = rec.score([1, 2, 3])
        with pytest.raises(Unsupported):
            rec.score_cached([1, 2, 3], 2)  # the reference has no prefix cache: the refusal is saved too
    replay = ReplayEngine(tmp_path / "r")
    again = replay.score([1, 2, 3])
    assert np.array_equal(again.logprobs, first.logprobs) and again.vocab_size == first.vocab_size
    with pytest.raises(Unsupported, match="made once in the run"):
        replay.score([1, 2, 3])  # asked once, answered once
    with pytest.raises(Unsupported, match="not made in the run"):
        replay.score([1, 2])
    with pytest.raises(Unsupported, match="no prefix cache"):
        replay.score_cached([1, 2, 3], 2)
    assert not replay.capabilities.weights and "saved run" in replay.capabilities.why_not("weights")


def test_answers_and_capabilities_round_trip():
    table = TokenLogprobs(np.array([1, 2, 3]), 5, topk_ids=np.array([[1, 2], [0, 3], [4, -1]]),
                          topk_logprobs=np.array([[-0.1, -2.0], [-0.5, -1.0], [-0.2, -np.inf]]),
                          ambiguous=np.array([False, True, False]))
    gen = Generation(np.array([1, 2]), np.array([3]), table)
    trace = LayerTrace(np.array([1, 2]), {("residual", 0): np.ones((2, 4), np.float32)}, {("residual", 0): "l_out-0"},
                       {1: {("residual", 0): np.zeros((2, 4), np.float32)}})
    for value in (table, gen, trace, [table, table], [5, 6], "text"):
        meta, arrays = encode(value)
        back = decode(json.loads(json.dumps(meta)), arrays)
        assert type(back) is type(value)
    back = decode(*encode(trace))
    assert back.names == trace.names and np.array_equal(back.per_rank[1][("residual", 0)], np.zeros((2, 4)))
    back = decode(*encode(gen))
    assert np.array_equal(back.steps.ambiguous, table.ambiguous) and list(back.generated) == [3]
    caps = Capabilities(score=True, layer_outputs=frozenset({"residual", "ffn"}), tp_size=2,
                        switches=(Switch({"flash_attn": 0}, {"flash_attn": 1}, "the flash-attention path", "attention"),),
                        reasons=MappingProxyType({"batch": "no"}), rounding=MappingProxyType({"kv": "f16"}))
    assert capabilities_from(json.loads(json.dumps(capabilities_json(caps)))) == caps


def test_the_cli_saves_and_rejudges_and_refuses_what_it_cannot_use(tiny_llama, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert main(["diagnose", str(tiny_llama), "--engine", "reference:fp64", "--no-sanity", "--max-prompts",
                 "2", "--max-tokens", "20", "--save-run", str(run), "-q"]) == 0
    capsys.readouterr()
    import ggufcheck.engines.spec as spec

    opened, really_open = [], spec.EngineSpec.open

    def open_(self, *a, **k):  # the baseline run (reference:fp32) opens; the engine under test must not
        opened.append(self.text)
        return really_open(self, *a, **k)

    monkeypatch.setattr(spec.EngineSpec, "open", open_)
    assert main(["rejudge", str(run), "-q", "--json", str(tmp_path / "r.json")]) == 0
    assert "reference:fp64" not in opened
    out = capsys.readouterr().out
    assert "re-judged from" in out and "the saved run's verdict: healthy" in out
    assert json.loads((tmp_path / "r.json").read_text())["verdict"]["healthy"] is True
    # not a saved run; a folder of other files; a different model file
    assert main(["rejudge", str(tmp_path), "-q"]) == 2
    assert "not a saved run" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["diagnose", str(tiny_llama), "--engine", "reference", "--save-run", str(tmp_path / "other")]) == 2
    assert "holds other files" in capsys.readouterr().err
    other = build_tiny_gguf("llama", tmp_path / "other.gguf", qtypes="Q8_0", seed=9).path
    with pytest.raises(UsageError, match="not the file the run"):
        rejudge(run, model=other)
