"""Plan before running (diagnose/resources.py) and targeted checks (--layers).

The plan's memory estimate is held against a measured peak of the reference it describes;
a stage that cannot fit is refused before anything loads; ``--layers`` reads and replays only
the chosen layers, names a fault inside them, and says what it did not check.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ggufcheck.cli import main
from ggufcheck.cli.diagnose import parse_layers, parse_size
from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
from ggufcheck.errors import UsageError
from ggufcheck.synthetic.streaming import build_streaming_gguf, scale_dims
from ggufcheck.synthetic.tiny import build_tiny_gguf


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    return build_tiny_gguf("glm-dsa", tmp_path_factory.mktemp("m") / "tiny-glm.gguf", qtypes="Q8_0", n_layer=4).path


def test_sizes_and_layer_lists_parse_or_say_why():
    assert parse_size("6G", "--max-memory") == 6 << 30
    assert parse_size("512MiB", "--max-memory") == 512 << 20
    assert parse_size("7e9", "--max-memory") == 7_000_000_000
    assert parse_layers("0-2,40, 5") == (0, 1, 2, 5, 40)
    for bad in ("six", "-1G", "0"):
        with pytest.raises(UsageError):
            parse_size(bad, "--max-memory")
    for bad in ("a", "3-1", "1-", ","):
        with pytest.raises(UsageError):
            parse_layers(bad)


def test_a_stage_over_max_memory_is_refused_before_anything_runs(tiny_glm, capsys):
    status = main(["diagnose", str(tiny_glm), "--engine", "reference", "--max-memory", "100M"])
    err = capsys.readouterr().err
    assert status == 2
    assert "over the 0.1 GiB allowed" in err and "cheaper:" in err and "--max-tokens" in err


def test_the_plan_is_printed_first_and_kept_in_the_json(tiny_glm, tmp_path, capsys):
    js = tmp_path / "d.json"
    main(["diagnose", str(tiny_glm), "--engine", "reference:fp32", "--no-sanity", "--max-prompts", "1",
          "--max-tokens", "12", "--decode-to", "0", "--sweep-to", "0", "--json", str(js)])
    out = capsys.readouterr().out
    assert out.index("plan:") < out.index("diagnosis, in dependency order")
    doc = json.loads(js.read_text())["resources"]
    assert {s["stage"] for s in doc["stages"]} >= {"file", "layers", "served"}
    assert doc["weight_cache"]["budget"] > 0 and doc["reference_device"] == "cpu"


def test_layers_out_of_range_is_a_usage_error(tiny_glm, capsys):
    assert main(["diagnose", str(tiny_glm), "--engine", "reference", "--layers", "9"]) == 2
    assert "layers 0..3" in capsys.readouterr().err


@pytest.mark.parametrize("chosen,named", [((2, 3), True), ((0, 1), False)])
def test_layers_names_a_fault_inside_the_chosen_ones_and_says_what_it_skipped(tiny_glm, chosen, named):
    from ggufcheck.testing.faults import make_faulty_engine

    # the weights hidden: the layers stage, not the weights audit, must find the permuted experts
    with make_faulty_engine("experts-permuted", tiny_glm, layer=3, expose_weights=False) as engine:
        d = diagnose(DiagnoseOptions(model=tiny_glm, max_prompts=2, max_tokens=20, sanity=False, layers=chosen,
                                     decode_to=0, sweep_to=0), engine=engine)
    stages = {s.stage: s for s in d.stages}
    assert stages["served"].results[0].status.name == "SKIP"
    if named:
        assert (d.verdict.component, d.verdict.layer, d.verdict.stage) == ("moe-experts", 3, "layers")
    else:  # the fault is in layer 3, which was not looked at: healthy, and it says how far it looked
        assert d.verdict.healthy and "not checked" in d.verdict.message and "layers other than 0-1" in d.verdict.message
    assert stages["layers"].info["chosen_layers"] == list(chosen)


def test_the_estimate_bounds_the_measured_peak_of_a_glm5_dims_pass(tmp_path):
    """One GLM-5 MoE layer (all 256 experts, 10 GB would be the file: here 16 experts, the
    peak does not depend on them): the plan's per-pass estimate is at least the measured
    peak of a fresh process running that pass, and not 4x above it."""
    d = scale_dims("glm-5", n_layer=1, n_expert=16, n_vocab=1000)
    m = build_streaming_gguf(d, tmp_path / "glm5-layer.gguf")
    # a first short pass compiles the kernels (numba's LLVM takes ~1 GB once, in a fresh cache);
    # the peak is then reset (Linux: 5 > /proc/self/clear_refs) and read after the measured pass
    code = ("import sys; from ggufcheck.runtime import keep_freed_memory; keep_freed_memory(); "
            "from ggufcheck.reference.model import ReferenceModel; "
            "r = ReferenceModel(sys.argv[1], streaming=True); r.prefill([1, 2, 3, 4], trace=False); "
            "open('/proc/self/clear_refs', 'w').write('5'); r.prefill(list(range(1, 65)), trace=False); "
            "print(int(dict(l.split(':', 1) for l in open('/proc/self/status'))['VmHWM'].split()[0]) * 1024)")
    measured = int(subprocess.run([sys.executable, "-c", code, str(m.path)], capture_output=True, text=True,
                                  check=True).stdout.split()[-1])
    from ggufcheck.diagnose.resources import BASE_BYTES, model_facts, pass_peak
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.reference.config import config_from_gguf

    with open_gguf(m.path) as g:
        facts = model_facts(g, config_from_gguf(g.metadata, g.tensors, str(m.path)))
    estimate = BASE_BYTES + pass_peak(facts, 64)
    assert measured <= estimate < 4 * measured, (measured / 2**30, estimate / 2**30)


def test_one_tp_size_per_run(tiny_glm, capsys):
    """The engine's TP drives the sharding stage; a --tp that disagrees is refused, naming
    both (before, ``--tp 4 --engine vllm:tp=2`` checked a split that was not deployed, and
    ``--engine vllm:tp=2`` alone skipped sharding: "no --tp given")."""
    from types import SimpleNamespace

    from ggufcheck.diagnose.plan import one_tp_size

    assert one_tp_size(DiagnoseOptions(model=tiny_glm, engine="vllm:tp=2")).tp == 2
    assert one_tp_size(DiagnoseOptions(model=tiny_glm, engine="vllm:tp=2", tp=2)).tp == 2
    assert one_tp_size(DiagnoseOptions(model=tiny_glm, engine="vllm")).tp is None  # TP 1: nothing to split
    assert one_tp_size(DiagnoseOptions(model=tiny_glm, engine="llama-cpp", tp=3)).tp == 3  # the file's split alone
    opened = SimpleNamespace(capabilities=SimpleNamespace(tp_size=4), name="an engine at TP 4")
    assert one_tp_size(DiagnoseOptions(model=tiny_glm), opened).tp == 4
    with pytest.raises(UsageError, match="--tp 2 disagrees with the engine's tensor-parallel size 4"):
        one_tp_size(DiagnoseOptions(model=tiny_glm, tp=2), opened)
    assert main(["diagnose", str(tiny_glm), "--engine", "vllm:tp=2", "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "--tp 4 disagrees" in err and "size 2" in err and "vllm:tp=2" in err
