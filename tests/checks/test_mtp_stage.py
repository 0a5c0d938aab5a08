"""The mtp stage (checks/mtp.py): llama.cpp's NextN / MTP draft head judged in `diagnose`
against the reference's head fed the same states. Healthy through the real llama.cpp; a head
that llama.cpp loads from a copy of the file with one NextN tensor changed, or that is fed
the wrong state, is named ``mtp`` while every trunk stage passes (the silent fault: the served
output is right, only the draft acceptance drops). Chained drafts (3 steps from 4 start rows)
are judged at positions 2..3 and acceptance by draft position is reported; a driver that
feeds a chained step the trunk's state instead of the head's own is named ``mtp.chain_state``."""

from __future__ import annotations

import numpy as np
import pytest

from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
from ggufcheck.results import Status

pytest.importorskip("llama_cpp")

NEXTN = 3  # the tiny models' 3 trunk layers: the NextN block is blk.3


@pytest.fixture(scope="module")
def nextn_model(tmp_path_factory):
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    return build_tiny_gguf("deepseek2", tmp_path_factory.mktemp("mtp") / "ds2-nextn.gguf", qtypes="Q8_0",
                           n_nextn=1).path


def _diagnose(model, engine, **kw):
    options = DiagnoseOptions(model=model, kernels=False, max_prompts=2, max_tokens=24, sweep_to=0, decode_to=0,
                              sanity=False, **kw)  # random weights: near-flat by nature
    try:
        return diagnose(options, engine=engine)
    finally:
        engine.close()


def _stage(d, name):
    return next(s for s in d.stages if s.stage == name)


def test_a_healthy_llama_cpp_head_passes(nextn_model):
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    d = _diagnose(nextn_model, LlamaCppEngine(nextn_model))
    mtp = _stage(d, "mtp")
    statuses = {r.check: r.status for r in mtp.results}
    assert statuses["mtp.kl_mean"] is Status.PASS, [r.message for r in mtp.results]
    assert "draft acceptance at position 1" in next(r.message for r in mtp.results if r.check == "mtp.kl_mean")
    assert mtp.info["acceptance"]["rows"] > 10
    for check in ("mtp.chain_state", "mtp.chain_kl_mean", "mtp.chain_kl_p99", "mtp.chain_argmax"):
        assert statuses[check] is Status.PASS, [r.message for r in mtp.results]
    chain = next(r.message for r in mtp.results if r.check == "mtp.chain_kl_mean")
    assert "draft positions 2..3" in chain and "acceptance by draft position 1..3" in chain
    accepted = mtp.info["acceptance_by_position"]
    assert accepted["rounds"] == 4 and all(len(accepted[k]) == 3 for k in ("engine", "reference_head", "reference"))
    assert accepted["engine"] == sorted(accepted["engine"], reverse=True)  # position k needs 1..k - 1 accepted
    assert len(mtp.info["chain_kl_by_position"]) == 3
    assert d.verdict.healthy, d.verdict.message


def _double_enorm(contents):
    rec = contents.tensors[f"blk.{NEXTN}.nextn.enorm.weight"]
    rec.raw = np.ascontiguousarray(rec.raw.view(np.float32) * 2).view(np.uint8).reshape(rec.raw.shape)


def test_a_head_loaded_wrong_is_named_mtp_while_the_trunk_passes(nextn_model, tmp_path):
    """llama.cpp serves a copy whose NextN enorm is doubled (a loader that mangles one NextN
    tensor); the reference reads the intact file."""
    from ggufcheck.engines.llama_cpp import LlamaCppEngine
    from ggufcheck.testing.filefaults import rewrite

    broken = rewrite(nextn_model, tmp_path / "broken.gguf", _double_enorm)
    d = _diagnose(nextn_model, LlamaCppEngine(broken))
    assert not any(r.failed for s in d.stages if s.stage in ("layers", "logits", "paths") for r in s.results)
    assert d.verdict.component == "mtp" and d.verdict.stage == "mtp", d.verdict.message


def test_a_head_fed_the_wrong_state_is_named_mtp(nextn_model):
    """The driver feeds each row its own trunk state instead of the previous row's (an
    off-by-one in the draft loop): the weights are right, the head's input is not."""
    from ggufcheck.engines.base import MTPTrace, TokenLogprobs, log_softmax
    from ggufcheck.engines.llama_cpp import LlamaCppEngine
    from ggufcheck.engines.llama_cpp_mtp import run_mtp

    class UnshiftedState(LlamaCppEngine):
        def mtp_outputs(self, tokens):
            right = super().mtp_outputs(tokens)
            own = run_mtp(self.model_path, tokens).trunk_states  # row p's own state, not row p - 1's
            run = run_mtp(self.model_path, tokens, states=own)
            table = TokenLogprobs(right.tokens, self.vocab_size, log_softmax(run.mtp_logits, np.float32))
            return MTPTrace(right.tokens, run.states_fed, table, right.trunk_argmax, right.trunk_states)

    d = _diagnose(nextn_model, UnshiftedState(nextn_model))
    assert d.verdict.component == "mtp" and d.verdict.check == "mtp.state", d.verdict.message
    head = next(r for r in _stage(d, "mtp").results if r.check == "mtp.kl_mean")
    assert head.status is Status.PASS  # the head itself computes right on what it is given


def test_a_chain_fed_the_trunk_state_is_named_mtp(nextn_model):
    """The driver feeds draft step k + 1 the trunk's state of the row before its position
    instead of the head's own output state of step k (the per-row head is right)."""
    from ggufcheck.engines.base import MTPDrafts, log_softmax
    from ggufcheck.engines.llama_cpp import LlamaCppEngine
    from ggufcheck.engines.llama_cpp_mtp import draft_mtp

    class TrunkStateChain(LlamaCppEngine):
        def mtp_drafts(self, tokens, start_rows, n_draft):
            right = draft_mtp(self.model_path, tokens, start_rows, n_draft)
            states = right.fed_states.copy()
            for s, p in enumerate(right.start_rows):
                for k in range(1, n_draft):
                    states[s, k] = right.trunk_states[min(p + k - 1, len(tokens) - 1)]
            run = draft_mtp(self.model_path, tokens, start_rows, n_draft, feed=(right.fed_tokens, states))
            logprobs = log_softmax(run.logits.reshape(-1, run.logits.shape[-1]), np.float32).reshape(run.logits.shape)
            return MTPDrafts(np.asarray(tokens), run.states_fed, np.asarray(start_rows), run.fed_tokens,
                             run.fed_states, logprobs, np.argmax(run.trunk_logits, axis=-1), run.trunk_states)

    d = _diagnose(nextn_model, TrunkStateChain(nextn_model), paths=False)
    assert d.verdict.component == "mtp" and d.verdict.check == "mtp.chain_state", d.verdict.message
    statuses = {r.check: r.status for r in _stage(d, "mtp").results}
    assert statuses["mtp.kl_mean"] is Status.PASS and statuses["mtp.chain_kl_mean"] is Status.PASS  # fed the same


def test_a_file_without_nextn_layers_skips_the_stage(tiny_gguf):
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    model = tiny_gguf("deepseek2", qtypes="Q8_0").path
    options = DiagnoseOptions(model=model, kernels=False, max_prompts=1, max_tokens=12, sweep_to=0, decode_to=0,
                              sanity=False, paths=False)
    engine = LlamaCppEngine(model)
    try:
        d = diagnose(options, engine=engine)
    finally:
        engine.close()
    (r,) = _stage(d, "mtp").results
    assert r.status is Status.SKIP and "no NextN" in r.message


def test_a_saved_run_rejudges_the_mtp_stage_from_the_saved_head(nextn_model, tmp_path):
    """--save-run keeps the head's answers (states, table, trunk choices); rejudge gives the
    same mtp results without llama.cpp."""
    import json

    from ggufcheck.diagnose.rejudge import rejudge
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    options = DiagnoseOptions(model=nextn_model, kernels=False, max_prompts=2, max_tokens=24, sweep_to=0,
                              decode_to=0, sanity=False, save_run=tmp_path / "run")
    engine = LlamaCppEngine(nextn_model)
    try:
        ran = diagnose(options, engine=engine)
    finally:
        engine.close()
    again, replay = rejudge(tmp_path / "run")

    def mtp(d):
        return [(r.check, r.status, r.message, json.dumps(r.to_json().get("stats"), sort_keys=True, default=str))
                for r in _stage(d, "mtp").results]

    assert any(r[0] == "mtp.kl_mean" and r[1] is Status.PASS for r in mtp(ran))
    assert mtp(again) == mtp(ran) and replay.unused == 0
