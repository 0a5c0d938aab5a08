"""The sharding stage: does the file shard N ways, and does sharded arithmetic equal unsharded?

In dependency order, all from the GGUF file and CPUs (or GPUs with NCCL when present):

1. the plan (:mod:`ggufcheck.checks.sharding.plan`): divisibility, quant-block alignment of
   row-parallel splits for each tensor's actual type, vocab padding, per-rank memory;
2. MLA kv_b (:mod:`ggufcheck.sharding.mla`): every rank's W_UK / W_UV are the k_b / v_b of
   that rank's heads, exactly;
3. numeric TP invariance (run by :mod:`ggufcheck.sharding.invariance`, judged by
   :mod:`ggufcheck.checks.sharding.invariance`): every layer kind sharded over N ranks equals
   the reference unsharded, in fp64; plus the collectives self-test.

Entry points: :func:`run_sharding_stage` (the ``shard`` command), :func:`plan_results`
(the plan alone, for ``inspect --tp``), :func:`plan_known` (real GLM-5 / DeepSeek-V3
dimensions without the file, with a stated quant mix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ggufcheck.arch.spec import ArchSpec, spec_for_model
from ggufcheck.arch.tables import table_for
from ggufcheck.checks.mapping import spec_results
from ggufcheck.errors import GGUFCheckError
from ggufcheck.gguf.reader import GGUFModel
from ggufcheck.results import Result, StageReport, errored, failed, passed, skipped
from ggufcheck.sharding import mla as shard_mla
from ggufcheck.checks.sharding.plan import plan
from ggufcheck.sharding.rules import rules_from_table

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.diagnose.session import Session

STAGE = "sharding"
COMPONENT = "sharding"
MLA_COMPONENT = "mla-kv-b"
MLA_CHECK_ELEMENT_BUDGET = 200_000_000  # k_b + v_b elements checked in all layers below this


@dataclass(frozen=True)
class ShardOptions:
    """What ``ggufcheck shard`` was asked to do."""

    tp: int
    gpu_memory_gib: float | None = None
    backend: str = "auto"  # "gloo" | "nccl" | "auto"
    timeout_s: float = 180.0
    numeric: bool = True  # run the sharded layers (False: plan and kv_b only)
    kinds: tuple[str, ...] | None = None
    tokens: int = 6
    seed: int = 0


def _spec_and_rules(model: GGUFModel) -> tuple[ArchSpec | None, dict | None, list[Result]]:
    spec, findings = spec_for_model(model)
    if findings or spec is None:
        return None, None, spec_results(spec, findings)
    if not isinstance(spec, ArchSpec):
        return None, None, [skipped("sharding.plan", COMPONENT,
                                    f"no spec for architecture {spec.arch!r}: cannot plan its sharding")]
    table = table_for(spec)
    if table is None:
        return None, None, [skipped("sharding.plan", COMPONENT, f"no tensor table for {spec.arch!r}")]
    return spec, rules_from_table(spec, table), []


def plan_results(model: GGUFModel, tp: int, gpu_memory_gib: float | None = None) -> list[Result]:
    """The plan checks alone (no weights read): for ``inspect --tp`` and the shard stage."""
    spec, rules, problems = _spec_and_rules(model)
    if spec is None:
        return problems
    return plan(spec, rules, model.tensors, tp, gpu_memory_gib)


def mla_results(model: GGUFModel, spec: ArchSpec, tp: int) -> list[Result]:
    """Per-rank W_UK / W_UV invariants for the file's k_b / v_b (every layer when small,
    else the first and the last run layer)."""
    from ggufcheck.gguf.dequant import dequantize_tensor

    if spec.mla is None:
        return []
    if not spec.mla.split_kv_b:
        return [skipped("sharding.mla.kv_b_ranks", MLA_COMPONENT,
                        "legacy attn_kv_b file: kv_b is not rebuilt, its column split is checked numerically")]
    if spec.n_head % tp:
        return [skipped("sharding.mla.kv_b_ranks", MLA_COMPONENT,
                        f"{spec.n_head} heads do not divide by TP {tp} (the plan reports it)")]
    per_layer = sum(model.tensors[f"blk.0.{n}"].n_elements for n in ("attn_k_b.weight", "attn_v_b.weight"))
    layers = list(range(spec.n_layer))
    if per_layer * len(layers) > MLA_CHECK_ELEMENT_BUDGET:
        layers = sorted({0, spec.n_layer - 1})
    out = []
    for i in layers:
        k_b = dequantize_tensor(model, f"blk.{i}.attn_k_b.weight")
        v_b = dequantize_tensor(model, f"blk.{i}.attn_v_b.weight")
        out.extend(check_kv_b_ranks(k_b, v_b, tp, layer=i))
    return out


def run_sharding_stage(model: GGUFModel, opts: ShardOptions, **invariance_overrides: Any) -> StageReport:
    """Plan, MLA kv_b and numeric TP invariance for ``opts.tp`` ranks.

    ``invariance_overrides`` go to :class:`InvarianceOptions` (tests pass fault loaders).
    """
    from ggufcheck.reference.config import config_from_gguf
    from ggufcheck.sharding.dist import resolve_backend
    from ggufcheck.sharding.invariance import InvarianceOptions, gguf_layer_weights, iter_jobs

    report = StageReport(STAGE, info={"tp": opts.tp, "model": str(model.path)})
    spec, rules, problems = _spec_and_rules(model)
    if spec is None:
        report.add(problems)
        return report
    report.info.update(arch=spec.arch, heads=spec.n_head, kv_heads=spec.n_head_kv, vocab=spec.n_vocab)
    report.add(plan(spec, rules, model.tensors, opts.tp, opts.gpu_memory_gib))
    try:
        report.add(mla_results(model, spec, opts.tp))
    except GGUFCheckError as err:
        report.add(errored("sharding.mla.kv_b_ranks", MLA_COMPONENT, err.message))
    if not opts.numeric:
        report.add(skipped("sharding.tp", COMPONENT, "numeric TP invariance not requested (--plan-only)"))
        return report
    backend = resolve_backend(opts.backend, opts.tp)
    report.info["backend"] = backend
    try:
        cfg = config_from_gguf(model.metadata, model.tensors, str(model.path))
    except GGUFCheckError as err:
        report.add(skipped("sharding.tp", COMPONENT, f"no reference for this model: {err.message}"))
        return report
    iopts = InvarianceOptions(tp=opts.tp, backend=backend, timeout_s=opts.timeout_s, tokens=opts.tokens,
                              seed=opts.seed, kinds=opts.kinds, **invariance_overrides)
    with torch.no_grad():
        report.add(_one_kind_at_a_time(cfg, rules, iter_jobs(cfg, gguf_layer_weights(
            model, max_elements=iopts.max_layer_elements), iopts), iopts))
    return report


def _one_kind_at_a_time(cfg, rules, jobs, iopts) -> list:
    """Each layer kind read, run on its ranks, judged and released before the next is read
    (the ranks are started per kind: a run holds one kind's fp64 weights, not every kind's),
    then the collectives; what was not run first, as in one run."""
    from dataclasses import replace

    from ggufcheck.checks.sharding.invariance import judge_invariance
    from ggufcheck.sharding.invariance import run_invariance

    results = []
    for job in jobs:
        run = run_invariance(cfg, rules, [job], replace(iopts, collectives=False, not_run=[]))
        results += judge_invariance(cfg, rules, run)
        if run.failure is not None:
            break  # the ranks could not run at all: the next kind would fail the same way
        del run, job
    else:
        if iopts.collectives:
            results += judge_invariance(cfg, rules, run_invariance(cfg, rules, [], replace(iopts, not_run=[])))
    not_run = judge_invariance(cfg, rules, _nothing_ran(iopts))
    return not_run + results


def _nothing_ran(iopts):
    from ggufcheck.sharding.invariance import InvarianceRun

    return InvarianceRun(iopts.tp, iopts.backend, [(None, kind, layer, why) for kind, layer, why in iopts.not_run])


def plan_known(name: str, tp: int, mix: str = "q4_k_m", gpu_memory_gib: float | None = None) -> StageReport:
    """The plan for a known model's real dimensions (``arch.known``), with an assumed quant mix."""
    from ggufcheck.arch.known import KNOWN, known_spec
    from ggufcheck.errors import UsageError
    from ggufcheck.sharding.mixes import planned_tensors

    if name not in KNOWN:
        raise UsageError(f"unknown model {name!r}; known: {', '.join(KNOWN)}")
    spec = known_spec(name)
    table = table_for(spec)
    tensors = planned_tensors(spec, table, mix)
    report = StageReport(STAGE, info={"tp": tp, "model": f"known:{name}", "arch": spec.arch,
                                      "quant_mix_assumed": mix, "tensors": len(tensors)})
    report.add(plan(spec, rules_from_table(spec, table), tensors, tp, gpu_memory_gib))
    report.add(skipped("sharding.tp", COMPONENT, "numeric TP invariance needs the model file"))
    return report


def run(session: "Session") -> list[StageReport]:
    """The stage entry point: the session's model split ``--tp`` ways."""
    o = session.options
    session.say(f"checking tensor-parallel sharding at TP {o.tp}")
    return [run_sharding_stage(session.open_model(), ShardOptions(tp=o.tp, numeric=o.shard_numeric))]


def check_kv_b_ranks(k_b: Tensor, v_b: Tensor, tp: int, layer: int | None = None,
                     layout: shard_mla.KvBLayout = shard_mla.VLLM_LAYOUT) -> list[Result]:
    """One Result per rank: W_UK / W_UV equal k_b / v_b of that rank's heads, exactly.

    k_b [H, L, P], v_b [H, V, L] as dequantized from the file (data movement only, so any
    difference at all is a layout error).
    """
    n_head = k_b.shape[0]
    check = "sharding.mla.kv_b_ranks"
    if n_head % tp:
        return [failed(check, MLA_COMPONENT, f"{n_head} MLA heads do not divide over TP {tp}", layer=layer,
                       stats={"heads": n_head, "tp": tp})]
    n_local = n_head // tp
    results = []
    for rank in range(tp):
        uk, uv = shard_mla.rank_uk_uv(k_b, v_b, rank, tp, layout)
        worst = None
        worst_diff = 0.0
        wrong_heads = []
        for h in range(n_local):
            g = rank * n_local + h
            for what, got, want in (("W_UK", uk[:, h, :], k_b[g]), ("W_UV", uv[:, h, :], v_b[g].T)):
                diff = (got - want).abs()
                if bool((diff != 0).any()):
                    wrong_heads.append(f"{what}[{h}]")
                    d = float(diff.max())
                    if d >= worst_diff:
                        idx = divmod(int(diff.argmax()), diff.shape[1])
                        worst_diff = d
                        worst = {"rank": rank, "local_head": h, "global_head": g, "matrix": what,
                                 "element": list(idx), "got": float(got[idx]), "expected": float(want[idx]),
                                 "abs_diff": d}
        stats = {"rank": rank, "heads": [rank * n_local, (rank + 1) * n_local], "max_abs_diff": worst_diff}
        where = f"rank {rank}/{tp} heads {rank * n_local}..{(rank + 1) * n_local - 1}"
        if wrong_heads:
            results.append(failed(check, MLA_COMPONENT,
                                  f"{where}: {len(wrong_heads)} of {2 * n_local} W_UK/W_UV head blocks are not "
                                  f"k_b/v_b of those heads ({layout.name})",
                                  layer=layer, stats=stats, worst=worst))
        else:
            results.append(passed(check, MLA_COMPONENT, f"{where}: W_UK == k_b, W_UV == v_b^T exactly",
                                  layer=layer, stats=stats))
    return results
