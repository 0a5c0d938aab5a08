"""Numeric TP invariance, judged: each layer kind sharded over N ranks == the same layer unsharded.

:func:`ggufcheck.sharding.invariance.run_invariance` runs the sharded and unsharded sides (see
its docstring for the tolerance, ``RTOL * max(1, max|unsharded|)`` in fp64); this module turns
its run record into Results: per kind the worst rank and element (a :class:`Comparison`), and
when the all-reduced output is wrong, which rank's partial result made it; the vocab padding
rows; the indexer's top-k as sets per query; and the collectives' exact answers.
"""

from __future__ import annotations

from typing import Any

import torch

from ggufcheck.comparison import Comparison, exact, max_abs, to_result
from ggufcheck.reference.config import ReferenceConfig
from ggufcheck.results import Result, errored, failed, passed, skipped
from ggufcheck.sharding import collectives
from ggufcheck.sharding.invariance import RTOL, InvarianceRun, partial_diffs
from ggufcheck.sharding.parallel import LayerJob
from ggufcheck.sharding.rules import ShardRule, pad_vocab

COMPONENT = "sharding"


def judge_invariance(cfg: ReferenceConfig, rules: dict[str, ShardRule], run: InvarianceRun) -> list[Result]:
    """The Results of one sharded run: what did not run, each job's comparison, the collectives."""
    results = [skipped(f"sharding.tp.{kind}", COMPONENT, why, tensor=(job.tensor or None) if job else None, layer=layer)
               for job, kind, layer, why in run.not_run]
    if run.failure is not None:
        return results + [errored("sharding.tp.run", COMPONENT, f"the sharded run failed: {run.failure.message}",
                                  stats={"tp": run.tp, "backend": run.backend, "detail": run.failure.detail[-2000:]})]
    for job, want, per_rank in zip(run.jobs, run.want, run.per_rank):
        results.extend(compare(cfg, rules, job, want, per_rank, run.tp, run.backend))
    if run.collectives is not None:
        results.extend(check_collectives(run.collectives, run.backend))
    return results


def compare(cfg: ReferenceConfig, rules: dict[str, ShardRule], job: LayerJob, want: dict[str, torch.Tensor],
            per_rank: list[dict[str, Any]], tp: int, backend: str) -> list[Result]:
    """Sharded vs unsharded for one job: worst rank and element; padding and top-k extras."""
    kind = job.kind
    check = f"sharding.tp.{kind}"
    where = dict(tensor=job.tensor or None, layer=job.layer)
    errors = [(r, o["error"]) for r, o in enumerate(per_rank) if "error" in o]
    if errors:
        rank, msg = errors[0]
        return [errored(check, COMPONENT, f"rank {rank} raised while running {kind} at TP {tp}: {msg}",
                        stats={"tp": tp, "traceback": per_rank[rank].get("traceback", "")[-2000:]}, **where)]
    ref = want["out"]
    finite = torch.isfinite(ref)
    scale = max(1.0, float(ref[finite].abs().max())) if bool(finite.any()) else 1.0
    tol = RTOL * scale
    what = f"{kind} sharded over {tp} rank(s) vs unsharded" + (f" on {job.scope}" if job.scope else "")
    by_rank: list[Comparison] = []
    for r, o in enumerate(per_rank):
        if o["out"].shape != ref.shape:
            return [failed(check, COMPONENT, f"rank {r} output shape {tuple(o['out'].shape)} != unsharded "
                                             f"{tuple(ref.shape)}", stats={"tp": tp}, worst={"rank": r}, **where)]
        by_rank.append(max_abs(o["out"], ref, tol, what))  # -inf on both sides (masked scores) is equal
    worst_rank = max(range(len(by_rank)), key=lambda r: by_rank[r].value)
    cmp = by_rank[worst_rank]
    worst: dict[str, Any] = {"rank": worst_rank}
    if cmp.worst is not None:
        worst.update(sharded=cmp.worst.got, unsharded=cmp.worst.want)
    stats = {"tp": tp, "backend": backend, "max_abs_diff": cmp.value, "tolerance": tol, "scale": scale,
             "shape": list(ref.shape)}
    if cmp:
        results = [to_result(cmp, check, COMPONENT, stats=stats, worst=worst, **where)]
    else:  # after an all-reduce every rank holds the same wrong sum: find who made it
        partial = partial_diffs(cfg, rules, job, per_rank, tp)
        bad_ranks = [r for r, d in enumerate(partial) if d > tol]
        worst.update(partial_max_abs_diff_by_rank=partial, ranks_with_wrong_partials=bad_ranks)
        if bad_ranks:
            worst["rank"] = max(bad_ranks, key=lambda r: partial[r])
        blame = (f"wrong partial results on rank(s) {bad_ranks}, worst rank {worst['rank']}" if bad_ranks else
                 "every rank's partial is right: the collective or the combination is wrong")
        results = [to_result(cmp, check, COMPONENT, message=f"{cmp.text()} (rank {worst_rank}); {blame}",
                             stats=stats, worst=worst, **where)]
    if "padding_max" in per_rank[0]:
        rows = next(iter(job.weights.values())).shape[0]
        n_pad = pad_vocab(rows) - rows
        pad = [float(o["padding_max"].max()) for o in per_rank]
        bad = [r for r, p in enumerate(pad) if p != 0]
        c = f"sharding.vocab.padding_zero.{kind}"
        if bad:
            results.append(failed(c, COMPONENT, f"{kind}: vocab padding rows are not zero on rank(s) {bad}",
                                  stats={"tp": tp, "padding_max_by_rank": pad}, **where))
        else:
            results.append(passed(c, COMPONENT, f"{kind}: the {n_pad} vocab padding row(s) are zero on every rank"
                                  if n_pad else f"{kind}: vocabulary needs no padding rows at TP {tp}",
                                  stats={"tp": tp, "padding_rows": n_pad}, **where))
    if "topk" in want:
        results.append(_compare_topk(want["topk"], per_rank, tp, **where))
    return results


def _compare_topk(want: torch.Tensor, per_rank: list[dict[str, Any]], tp: int, **where: Any) -> Result:
    check = "sharding.tp.indexer_topk"
    for r, o in enumerate(per_rank):
        for t in range(want.shape[0]):
            a = set(want[t].tolist()) - {-1}
            b = set(o["topk"][t].tolist()) - {-1}
            if a != b:
                return failed(check, COMPONENT, f"indexer top-k differs on rank {r} at query {t}",
                              stats={"tp": tp, "missing": sorted(a - b), "extra": sorted(b - a)},
                              worst={"rank": r, "query": t}, **where)
    return passed(check, COMPONENT, f"indexer top-k identical on all {tp} rank(s) for {want.shape[0]} queries",
                  stats={"tp": tp, "top_k": int(want.shape[1])}, **where)


def check_collectives(per_rank: list[dict[str, torch.Tensor]], backend: str) -> list[Result]:
    """One Result per collective (all dtypes and sizes): every rank must hold exactly the answer."""
    world_size = len(per_rank)
    cases: dict[str, list[str]] = {}
    for key in per_rank[0]:
        cases.setdefault(key.split("/")[0], []).append(key)
    results = []
    for op, keys in cases.items():
        bad: list[dict[str, Any]] = []
        for key in keys:
            _, dtype_name, n = key.split("/")
            want = collectives.expected(op, getattr(torch, dtype_name), int(n), world_size)
            for rank, got in enumerate(per_rank):
                if got[key].shape != want.shape:
                    bad.append({"rank": rank, "case": key,
                                "problem": f"shape {tuple(got[key].shape)} != {tuple(want.shape)}"})
                    continue
                cmp = exact(got[key].double(), want.double(), key)
                if not cmp:
                    bad.append({"rank": rank, "case": key, "index": cmp.worst.index[0], "got": cmp.worst.got,
                                "expected": cmp.worst.want, "n_wrong": int(cmp.value)})
        cases_text = ", ".join(k.split("/", 1)[1].replace("/", " x ") for k in keys)
        what = f"{op} over {world_size} rank(s) ({backend}) of {cases_text}"
        stats = {"world_size": world_size, "cases": [k.split("/", 1)[1] for k in keys]}
        if bad:
            results.append(failed(f"sharding.collectives.{op}", COMPONENT,
                                  f"{op}: {len(bad)} (rank, case) pair(s) hold a wrong result, first rank "
                                  f"{bad[0]['rank']} in {bad[0]['case']}", stats=stats, worst=bad[0]))
        else:
            results.append(passed(f"sharding.collectives.{op}", COMPONENT, f"{what}: exact on every rank",
                                  stats=stats))
    return results
