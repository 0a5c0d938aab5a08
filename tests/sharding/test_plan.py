"""The TP plan from a file's tensor table: divisibility, block alignment, vocab, memory."""

from __future__ import annotations

import gguf
import pytest

from ggufcheck.arch.known import known_spec
from ggufcheck.arch.tables import table_for
from ggufcheck.checks.sharding import plan_known, plan_results
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.results import Status
from ggufcheck.sharding.mixes import planned_tensors
from ggufcheck.checks.sharding.plan import plan
from ggufcheck.sharding.plan import GIB
from ggufcheck.sharding.rules import rules_from_table

ARCHS = ("llama", "glm4moe", "deepseek2", "glm-dsa")


def _by_check(results, check):
    return [r for r in results if r.check == check]


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_models_plan_up_to_tp4_and_fail_heads_at_tp8(tiny_converted, arch):
    with open_gguf(tiny_converted(arch).gguf_path) as m:
        for tp in (1, 2, 4):
            results = plan_results(m, tp)
            assert not [r for r in results if r.failed], (tp, [r.message for r in results if r.failed])
        at8 = plan_results(m, 8)
    heads = _by_check(at8, "sharding.plan.heads")[0]
    assert heads.status is Status.FAIL and "4" in heads.message  # 4 heads over 8 ranks
    assert any(r.check == "sharding.plan.split" and r.failed for r in at8)


def test_glm45_style_experts_unaligned_for_q4_k_at_tp8(tiny_gguf):
    """GLM-4.5 355B: expert FF 1536; 1536 / 8 = 192 is not a multiple of Q4_K's 256."""
    g = tiny_gguf("glm4moe", n_ff_exp=1536, qtypes={"ffn_down_exps": "Q4_K", "default": "F16"})
    assert g.qtypes["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.Q4_K
    with open_gguf(g.path) as m:
        by_tp = {tp: _by_check(plan_results(m, tp), "sharding.plan.block_alignment") for tp in (2, 4, 8)}
    exps = {tp: [r for r in rs if "ffn_down_exps" in r.message] for tp, rs in by_tp.items()}
    assert all(len(v) == 1 for v in exps.values())
    assert exps[2][0].status is Status.PASS  # 768 = 3 * 256
    assert exps[4][0].status is Status.FAIL  # 384
    assert exps[8][0].status is Status.FAIL and "1536 / 8 = 192" in exps[8][0].message
    assert exps[8][0].stats["block"] == 256 and exps[8][0].stats["qtype"] == "Q4_K"


def test_gpt_oss_mxfp4_experts_need_32_aligned_slices(tiny_gguf):
    """gpt-oss-120b: expert FF 2880; in MXFP4 (32-value blocks) 2880 / 8 = 360 does not start
    each rank's slice on a block; the tiny model's 32 / 2 = 16 shows the same rule."""
    g = tiny_gguf("gpt-oss", qtypes={"ffn_down_exps": "MXFP4", "default": "F32"})
    with open_gguf(g.path) as m:
        by_tp = {tp: [r for r in plan_results(m, tp) if r.check == "sharding.plan.block_alignment"
                      and "ffn_down_exps" in r.message] for tp in (1, 2)}
    assert by_tp[1][0].status is Status.PASS
    assert by_tp[2][0].status is Status.FAIL and "32 / 2 = 16" in by_tp[2][0].message
    assert by_tp[2][0].stats["qtype"] == "MXFP4" and by_tp[2][0].stats["block"] == 32


def test_same_experts_in_q8_0_align_at_tp8(tiny_gguf):
    g = tiny_gguf("glm4moe", n_ff_exp=1536, qtypes={"ffn_down_exps": "Q8_0", "default": "F16"})
    with open_gguf(g.path) as m:
        align = [r for r in plan_results(m, 8) if r.check == "sharding.plan.block_alignment"
                 and "ffn_down_exps" in r.message]
    assert align[0].status is Status.PASS  # 192 = 6 * 32


def test_vocab_padding_and_memory(tiny8):
    with open_gguf(tiny8("llama")) as m:
        results = plan_results(m, 8, gpu_memory_gib=1.0)
        file_bytes = sum(t.nbytes for t in m.tensors.values())
        tiny_gpu = plan_results(m, 8, gpu_memory_gib=1e-6)
    vocab = _by_check(results, "sharding.plan.vocab")[0]
    assert vocab.stats["padded"] == 512 and vocab.stats["per_rank"] == 64
    assert vocab.stats["padding_rows_by_rank"] == {7: 12}
    mem = _by_check(results, "sharding.plan.memory")[0]
    assert mem.status is Status.PASS
    assert mem.stats["per_rank_gib"] * GIB < file_bytes  # split tensors are 1/8 per rank
    assert _by_check(tiny_gpu, "sharding.plan.memory")[0].status is Status.FAIL


@pytest.mark.parametrize("name", ["glm-5", "deepseek-v3"])
@pytest.mark.parametrize("tp", [8, 16])
def test_known_models_plan(name, tp):
    """Expectations derived from the spec (not typed in): the plan must agree with them."""
    spec = known_spec(name)
    report = plan_known(name, tp, "q4_k_m", gpu_memory_gib=141)
    results = report.results
    assert _by_check(results, "sharding.plan.heads")[0].status is Status.PASS  # 64 / 128 heads
    fe = spec.moe.expert_ff
    exps = [r for r in _by_check(results, "sharding.plan.block_alignment") if "ffn_down_exps" in r.message][0]
    want_aligned = (fe // tp) % 256 == 0  # Q6_K down_exps in the assumed mix
    assert (exps.status is Status.PASS) == want_aligned
    dense = [r for r in _by_check(results, "sharding.plan.block_alignment") if ".ffn_down.weight" in r.message][0]
    assert (dense.status is Status.PASS) == ((spec.n_ff // tp) % 256 == 0)
    mem = _by_check(results, "sharding.plan.memory")[0]
    table = table_for(spec)
    tensors = planned_tensors(spec, table, "q4_k_m")
    total = sum(t.nbytes for t in tensors.values()) / GIB
    assert mem.stats["model_gib"] == pytest.approx(total)
    assert total / tp < mem.stats["per_rank_gib"] < total / tp + 8  # plus replicated tensors


def test_q8_0_mix_aligns_everything_at_tp16():
    spec = known_spec("deepseek-v3")
    table = table_for(spec)
    results = plan(spec, rules_from_table(spec, table), planned_tensors(spec, table, "q8_0"), 16)
    assert not [r.message for r in results if r.failed]
