"""``--experts``: the weights audit reads and compares only the chosen routed experts.

A fault in a chosen expert is named with the expert; a fault outside the chosen ones is not
seen, and the report says which experts it did not check. The file's stacked expert tensors
are read one expert (checkpoint layout: experts.{e}.*) or one block of chosen experts
(transformers' fused layout) at a time; both paths are held to the whole-tensor audit.
"""

from __future__ import annotations

import pytest
import torch

from ggufcheck.checks import weights as audit
from ggufcheck.cli import main
from ggufcheck.diagnose.session import DiagnoseOptions, Session


def _weights_report(path, engine, **options):
    session = Session(DiagnoseOptions(model=path, **options), lambda _m: None, engine)
    try:
        (report,) = audit.run(session)
    finally:
        session.close()
    return report


def _spy_exps_reads(monkeypatch):
    """Records, per read of a stacked expert tensor, how many experts' rows were read."""
    import ggufcheck.gguf.dequant as dequant

    reads: list[tuple[str, int | None]] = []
    original = dequant.dequantize_tensor

    def spy(model, name, *a, rows=None, **k):
        if "_exps." in name:
            per_expert = model.tensors[name].shape[1]
            reads.append((name, None if rows is None else (rows.stop - rows.start) // per_expert))
        return original(model, name, *a, rows=rows, **k)

    monkeypatch.setattr(dequant, "dequantize_tensor", spy)
    return reads


def test_the_checkpoint_layout_audits_chosen_experts_one_at_a_time(tiny_gguf, monkeypatch):
    from ggufcheck.testing.faults import make_faulty_engine

    path = tiny_gguf("glm-dsa", qtypes="Q8_0", n_layer=4).path
    reads = _spy_exps_reads(monkeypatch)
    with make_faulty_engine("experts-permuted", path, layer=3) as engine:  # experts rolled by one slot
        every = _weights_report(path, engine)
        chosen = _weights_report(path, engine, experts=(0, 1))
    bad = [r for r in chosen.results if r.failed]
    assert bad and all(r.layer == 3 and r.component == "moe-experts" for r in bad), [r.message for r in bad]
    assert {audit.expert_of(r.tensor) for r in bad} <= {0, 1}
    assert chosen.info["parameters"] < every.info["parameters"]
    assert "routed experts other than 0-1" in chosen.info["not_checked"]
    # the audit read one expert's rows at a time, never a whole stack
    assert reads and all(n == 1 for _, n in reads), reads[:5]
    # the same wrong parameters as the whole-tensor audit found, restricted to experts 0 and 1
    everywhere = {r.tensor for r in every.results if r.failed and audit.expert_of(r.tensor or "") in (0, 1)}
    assert {r.tensor for r in bad} == everywhere
    assert not [r for r in chosen.results if r.status.name == "SKIP" and "could not compare" in r.message]


def test_the_fused_layout_reads_only_the_chosen_experts_and_names_the_wrong_one(tiny_gguf, monkeypatch):
    pytest.importorskip("transformers")
    from ggufcheck.engines.hf import HFEngine

    path = tiny_gguf("glm-dsa", qtypes="Q8_0").path
    engine = HFEngine.from_gguf(path, dtype="fp32")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    with torch.no_grad():
        dict(engine.module.named_parameters())[name][5] *= -1  # expert 5 loaded wrong
    asked = []
    original = engine.weight_tensor  # the audit takes expert blocks as held, where held
    monkeypatch.setattr(engine, "weight_tensor",
                        lambda *a, **k: (len(a) > 1 and asked.append(a[1])) or original(*a, **k))
    outside = _weights_report(path, engine, experts=(0, 1, 2, 3))
    assert not [r for r in outside.results if r.failed], [r.message for r in outside.results if r.failed]
    assert asked and all(s.stop <= 4 for s in asked)
    assert "routed experts other than 0-3" in outside.info["not_checked"]
    inside = _weights_report(path, engine, experts=(2, 5))
    bad = [r for r in inside.results if r.failed]
    assert len(bad) == 1 and bad[0].tensor == name and "experts 5..5" in bad[0].message, [r.message for r in bad]


def test_expert_blocks_cover_the_chosen_experts_in_runs():
    assert list(audit.expert_blocks([0, 1, 2, 5, 7, 8], 2)) == [(0, 2), (2, 3), (5, 6), (7, 9)]
    assert list(audit.expert_blocks(range(5), 10)) == [(0, 5)]


def test_experts_out_of_range_or_on_a_dense_model_are_usage_errors(tiny_gguf, capsys):
    moe = tiny_gguf("glm-dsa", qtypes="Q8_0").path
    assert main(["diagnose", str(moe), "--engine", "reference", "--experts", "999"]) == 2
    assert "experts 0.." in capsys.readouterr().err
    dense = tiny_gguf("llama", qtypes="Q8_0").path
    assert main(["diagnose", str(dense), "--engine", "reference", "--experts", "0"]) == 2
    assert "dense model" in capsys.readouterr().err
    assert main(["diagnose", str(moe), "--engine", "reference", "--experts", "3-1"]) == 2
    assert "runs backwards" in capsys.readouterr().err
