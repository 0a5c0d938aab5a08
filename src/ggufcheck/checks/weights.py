"""The ``weights`` stage: the parameters the engine actually holds, against the GGUF.

Before any computation is compared, each parameter the engine loaded (per tensor-parallel
rank, in the engine's own naming: checkpoint names, or transformers' fused experts) is
compared with the slice of the GGUF tensor it should hold, through the architecture's tensor
table and the shard rules (:func:`check_engine_weights`, with the expected slices and the
diagnosis of a wrong one from :mod:`ggufcheck.sharding.weights`). A
wrong expert order, a mis-rebuilt kv_b or a rank holding another rank's slice is named here,
with the tensor, before the layers stage sees its consequences.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping

import torch
from torch import Tensor

from ggufcheck.arch.spec import ArchSpec
from ggufcheck.arch.table import TensorTable
from ggufcheck.checks import index_ranges
from ggufcheck.results import Result, StageReport, failed, passed, skipped
from ggufcheck.sharding.rules import shard
from ggufcheck.sharding.layouts import swap_partners
from ggufcheck.sharding.weights import (HFParam, LazyRankWeights, close_to, diagnose_raw, diagnose_slice, full_tensors,
                                        hf_params)

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.diagnose.session import Session
    from ggufcheck.gguf.reader import GGUFModel

MAX_FAILS_PER_RANK = 20  # wrong parameters listed one by one per rank; the rest are counted


def run(session: "Session") -> list[StageReport]:
    from ggufcheck.arch.spec import spec_for_model
    from ggufcheck.arch.tables import table_for

    report = StageReport("weights")
    engine = session.engine()
    if not engine.capabilities.weights:
        report.add(skipped("weights.loaded", "weights", engine.capabilities.why_not("weights")))
        return [report]
    model = session.open_model()
    spec, findings = spec_for_model(model)
    table = table_for(spec) if isinstance(spec, ArchSpec) and not findings else None
    if table is None:
        report.add(skipped("weights.loaded", "weights", "no spec/table for this architecture: nothing to audit against"))
        return [report]
    caps = engine.capabilities
    params = hf_params(spec, table, model.tensors, caps.weight_layout)
    experts = session.options.experts
    in_layers = [n for n, p in params.items()
                 if all(session.options.tensor_chosen(e.name) for e in p.group.inputs.values())]
    names = sorted(n for n in in_layers if experts is None or expert_of(n) in (None, *experts))
    unchecked = []
    if len(in_layers) < len(params):
        unchecked.append(f"{len(params) - len(in_layers)} parameters of layers outside --layers")
    if experts is not None and spec.moe is not None:
        unchecked.append(f"routed experts other than {index_ranges(experts)} ({spec.moe.n_expert - len(experts)} of "
                         f"{spec.moe.n_expert} per MoE layer): --experts")
        report.info["chosen_experts"] = list(experts)
    if unchecked:
        report.info["not_checked"] = "; ".join(unchecked)
    session.say(f"auditing {len(names)} loaded parameters on {caps.tp_size} rank(s)"
                + (f", experts {index_ranges(experts)}" if experts is not None else ""))
    report.add(check_engine_weights(model, spec, table, engine, names, experts=experts,
                                    not_chosen=set(params) - set(names)))
    report.info.update(tp=caps.tp_size, parameters=len(names), layout=caps.weight_layout)
    return [report]


def expert_of(hf_name: str) -> int | None:
    """The routed expert a per-expert parameter belongs to (``...experts.5.gate_proj.weight``
    -> 5); None for every other parameter, stacked experts included."""
    match = _EXPERT_NAME.search(hf_name)
    return int(match.group(1)) if match else None


_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


def check_loaded_weights(model: "GGUFModel", spec: ArchSpec, table: TensorTable,
                         loaded: Mapping[int, Mapping[str, Tensor]], tp: int,
                         layout: str = "checkpoint", experts: tuple[int, ...] | None = None,
                         expert_parallel: bool = False) -> list[Result]:
    """Every rank's loaded parameters against their expected slices (see module docstring).

    ``experts`` (``--experts``): of the stacked expert parameters, only these experts' rows
    are read and compared. Per-expert parameters (``experts.{e}.*``) are expected one expert
    at a time, so an audit holds one expert's tensor, not the layer's stack."""
    params = hf_params(spec, table, model.tensors, layout)
    if "lm_head.weight" not in params and "token_embd.weight" in model.tensors:  # tied embeddings
        embed = params.get("model.embed_tokens.weight")
        if embed is not None:
            params["lm_head.weight"] = HFParam("lm_head.weight", embed.rule, embed.group, "weights")
    n_kv = 0 if spec.mla is not None else spec.n_head_kv
    wanted = {n for per_rank in loaded.values() for n in per_rank}
    results: list[Result] = []
    unknown = sorted(n for n in wanted if n not in params)
    if unknown:
        results.append(skipped("weights.loaded.unknown", "weights",
                               f"{len(unknown)} loaded parameter(s) have no table row (not audited), e.g. {unknown[0]}",
                               stats={"names": unknown[:50]}))
    blocked = _expert_blocked(model, params, loaded, tp, every_size=experts is not None)
    for per_rank in loaded.values():
        if blocked:  # (only LazyRankWeights read blocks; plain dicts of tensors are audited whole)
            per_rank.by_block = blocked  # type: ignore[attr-defined]
    work: dict[int, list[tuple[int, str, Tensor, HFParam]]] = {}  # group -> its (rank, name) items
    for rank in sorted(loaded):
        for name, got in loaded[rank].items():
            if name in params:
                key = (id(params[name].group), expert_of(name) if params[name].group.transform == "unstack_experts"
                       else None)
                work.setdefault(key, []).append((rank, name, got, params[name]))
    n_ok = dict.fromkeys(sorted(loaded), 0)
    n_fail = dict.fromkeys(sorted(loaded), 0)
    unlisted: dict[int, dict[str, int]] = {r: {} for r in sorted(loaded)}  # rank -> component -> count
    unlisted_layers: dict[int, list[int]] = {r: [] for r in sorted(loaded)}
    for (_, expert), items in work.items():  # one group (or expert) dequantized at a time, for every rank
        full_by_name = expected_tensors(model, spec, items[0][3], expert)
        for rank, name, got, param in items:
            if got.dtype == torch.uint8:
                problem = diagnose_raw(model, spec, got, param, rank, tp, n_kv)
                if problem is None:
                    n_ok[rank] += 1
                else:
                    n_fail[rank] += 1
                    message, component, stats = problem
                    if n_fail[rank] <= MAX_FAILS_PER_RANK:
                        results.append(failed("weights.loaded.raw_slice", component, f"rank {rank}: {name}: {message}",
                                              tensor=name, layer=param.group.layer,
                                              stats={"rank": rank, "tp": tp, **stats}, worst={"rank": rank}))
                    else:
                        unlisted[rank][component] = unlisted[rank].get(component, 0) + 1
                        if param.group.layer is not None:
                            unlisted_layers[rank].append(param.group.layer)
                continue
            full = full_by_name[name] if name in full_by_name else next(iter(full_by_name.values()))
            if expert_parallel and expert is not None:  # a whole expert on the rank that holds it
                want = expected_slice(full, param, 0, 1, n_kv, layout)
            else:
                want = expected_slice(full, param, rank, tp, n_kv, layout)
            problem = diagnose_slice(got, want, full, param, rank, tp, n_kv, spec)
            if problem is None:
                n_ok[rank] += 1
                continue
            if "layout" not in problem[2]:
                problem = _swapped(model, spec, params, full_by_name, name, got, rank, tp, n_kv, layout) or problem
            n_fail[rank] += 1
            message, component, stats = problem
            if n_fail[rank] > MAX_FAILS_PER_RANK:
                unlisted[rank][component] = unlisted[rank].get(component, 0) + 1
                if param.group.layer is not None:
                    unlisted_layers[rank].append(param.group.layer)
            else:
                results.append(failed("weights.loaded.slice", component, f"rank {rank}: {name}: {message}",
                                      tensor=name, layer=param.group.layer, stats={"rank": rank, "tp": tp, **stats},
                                      worst={"rank": rank}))
    for name in sorted(blocked):
        for rank in sorted(loaded):
            problem = _audit_blocks(model, spec, params[name], loaded[rank], rank, tp, n_kv, experts)
            if problem is None:
                n_ok[rank] += 1
                continue
            n_fail[rank] += 1
            message, component, stats = problem
            results.append(failed("weights.loaded.slice", component, f"rank {rank}: {name}: {message}", tensor=name,
                                  layer=params[name].group.layer, stats={"rank": rank, "tp": tp, **stats},
                                  worst={"rank": rank}))
    for rank in sorted(loaded):
        if n_fail[rank] > MAX_FAILS_PER_RANK:
            counts = unlisted[rank]
            main = max(counts, key=counts.get)
            kinds = ", ".join(f"{n} {c}" for c, n in sorted(counts.items(), key=lambda kv: -kv[1]))
            results.append(failed("weights.loaded.slice", main,
                                  f"rank {rank}: {n_fail[rank] - MAX_FAILS_PER_RANK} more wrong parameter(s) not listed "
                                  f"({kinds})", stats={"rank": rank, "wrong": n_fail[rank], "unlisted": counts},
                                  layer=min(unlisted_layers[rank], default=None)))
        if n_ok[rank]:
            results.append(passed("weights.loaded.slice", "weights",
                                  f"rank {rank}: {n_ok[rank]} parameter(s) equal their expected TP {tp} slices",
                                  stats={"rank": rank, "tp": tp, "parameters": n_ok[rank]}))
    return results


def _swapped(model: "GGUFModel", spec: ArchSpec, params, full_by_name, name: str, got: Tensor, rank: int,
             tp: int, n_kv: int, layout: str) -> tuple[str, str, dict] | None:
    """A wrong parameter that holds the expected slice of the one a mixed-up loader swapped it
    with (gate <-> up, K <-> V: sharding.layouts.swap_partners), named; else None."""
    for partner in swap_partners(name):
        if partner not in params:
            continue
        if partner in full_by_name:  # made by the same group (a fused GGUF tensor split in two)
            theirs = full_by_name[partner]
        else:
            p = params[partner]
            made = expected_tensors(model, spec, p, expert_of(partner) if p.group.transform == "unstack_experts"
                                    else None)
            theirs = made[partner] if partner in made else next(iter(made.values()))
        want = expected_slice(theirs, params[partner], rank, tp, n_kv, layout)
        if tuple(want.shape) == tuple(got.shape) and close_to(got.detach(), want)[0]:
            return (f"holds {partner}'s values (a loader that mixed up the two names)", params[name].component,
                    {"layout": "swapped", "holds": partner})
    return None


EXPERT_BLOCK_BYTES = 512 << 20  # float32 bytes of one block of a stacked expert parameter in the audit


def expert_blocks(experts, step: int):
    """(e0, e1) ranges covering ``experts`` (sorted indices): runs of consecutive experts, each
    at most ``step`` long."""
    run: list[int] = []
    for e in sorted(experts):
        if run and (e != run[-1] + 1 or len(run) == step):
            yield run[0], run[-1] + 1
            run = []
        run.append(e)
    if run:
        yield run[0], run[-1] + 1


def expected_slice(full: Tensor, param: HFParam, rank: int, tp: int, n_kv: int, layout: str) -> Tensor:
    """Rank ``rank``'s piece of ``full`` as the engine's layout holds it: vLLM's loaders
    (:func:`~ggufcheck.sharding.rules.shard`, the vocabulary padded to a multiple of 64 with
    zero rows); transformers holds its one rank unpadded (a vocabulary of 900 is 900 rows)."""
    if layout == "transformers" and tp == 1:
        return full
    return shard(full, param.rule, rank, tp, n_kv)


def expected_tensors(model: "GGUFModel", spec: ArchSpec, param: HFParam, expert: int | None) -> dict[str, Tensor]:
    """What the file says ``param``'s group holds; for a per-expert parameter of a stacked GGUF
    tensor (``expert`` given), only that expert's rows are read and dequantized."""
    if expert is None:
        return full_tensors(model, spec, param)
    from ggufcheck.gguf.dequant import dequantize_tensor

    (role, entry), = param.group.inputs.items()
    info = model.tensors[entry.name]
    rows = dequantize_tensor(model, info.name, rows=slice(expert * info.shape[1], (expert + 1) * info.shape[1]))
    return {param.name: rows.reshape(info.shape[1], info.shape[2])}


def _expert_blocked(model: "GGUFModel", params, loaded, tp: int, every_size: bool = False) -> set[str]:
    """The stacked expert parameters audited a block of experts at a time: [E, ...] built
    from stacked GGUF tensors by a transform that keeps the expert axis first, not split by TP
    on that axis, larger than one block (``every_size``: any size, as ``--experts`` reads only
    the chosen experts' blocks), held by an engine that hands over expert blocks."""
    from ggufcheck.arch.rebuild import EXPERT_AXIS_FIRST

    if not all(hasattr(per_rank, "block") for per_rank in loaded.values()):
        return set()
    wanted = {n for per_rank in loaded.values() for n in per_rank}
    out = set()
    for name in wanted:
        param = params.get(name)
        if param is None or param.group.transform not in EXPERT_AXIS_FIRST or param.rule.dim == 0:
            continue
        infos = [model.tensors.get(e.name) for e in param.group.inputs.values()]
        if any(i is None or len(i.shape) != 3 or "_exps." not in i.name for i in infos):
            continue
        if every_size or sum(i.n_elements for i in infos) * 4 > EXPERT_BLOCK_BYTES:
            out.add(name)
    return out


def _audit_blocks(model: "GGUFModel", spec: ArchSpec, param: HFParam, per_rank, rank: int, tp: int,
                  n_kv: int, experts: tuple[int, ...] | None = None) -> tuple[str, str, dict] | None:
    """One stacked expert parameter of one rank, compared a block of experts at a time (the
    expected block rebuilt from the GGUF tensors' rows of those experts; ``experts``: only
    these); the first block that differs is diagnosed, its experts named."""
    from ggufcheck.arch.rebuild import TRANSFORMS
    from ggufcheck.gguf.dequant import dequantize_tensor
    from ggufcheck.engines.base import Unsupported

    infos = {role: model.tensors[e.name] for role, e in param.group.inputs.items()}
    n_expert = next(iter(infos.values())).shape[0]
    per_expert = sum(i.n_elements // n_expert for i in infos.values()) * 4
    step = max(1, EXPERT_BLOCK_BYTES // per_expert)
    for e0, e1 in expert_blocks(experts if experts is not None else range(n_expert), step):
        values = {role: dequantize_tensor(model, i.name, rows=slice(e0 * i.shape[1], e1 * i.shape[1]))
                  .reshape(e1 - e0, i.shape[1], i.shape[2]) for role, i in infos.items()}
        full = TRANSFORMS[param.group.transform].to_hf(values, spec, param.group.hf_name)[param.name]
        try:
            got = per_rank.block(param.name, slice(e0, e1))
        except Unsupported as err:
            return (f"the engine did not hand over experts {e0}..{e1 - 1}: {err}", "weights", {})
        problem = diagnose_slice(got, shard(full, param.rule, rank, tp, n_kv), full, param, rank, tp, n_kv, spec)
        if problem is not None:
            message, component, stats = problem
            return (f"experts {e0}..{e1 - 1}: {message}", component, {**stats, "experts": [e0, e1 - 1]})
    return None


def check_engine_weights(model: "GGUFModel", spec: ArchSpec, table: TensorTable, engine,
                         names: list[str] | None = None, experts: tuple[int, ...] | None = None,
                         not_chosen: set[str] = frozenset()) -> list[Result]:
    """THE weights audit through the Engine interface (``engine.weight(hf_name, rank=r)``).

    Asks in the layout the engine declares (``Capabilities.weight_layout``), for every HF
    parameter the file provides (or ``names``), one rank and one parameter at a time. A
    parameter the engine does not expose is counted in one SKIP; parameters the engine holds
    (``held_weight_names``) that no expected name covers are listed in another, so nothing an
    engine holds is skipped silently (``not_chosen``: parameters left out on request, by
    ``--layers`` or ``--experts``, which the report counts as not checked).
    """
    caps = engine.capabilities
    if not caps.weights:
        return [skipped("weights.loaded.slice", "weights", caps.why_not("weights"))]
    tp = int(caps.tp_size)
    layout = caps.weight_layout
    wanted = names if names is not None else sorted(hf_params(spec, table, model.tensors, layout))
    placed: list[Result] = []
    if caps.expert_parallel:  # each rank is asked for the experts it holds, by global id
        loaded, placed = _expert_parallel_ranks(engine, wanted, tp)
    else:
        loaded = {rank: LazyRankWeights(engine, wanted, rank) for rank in range(tp)}
    results = placed + check_loaded_weights(model, spec, table, loaded, tp, layout, experts,
                                            expert_parallel=caps.expert_parallel)
    missing = [f"{name}@{rank}" for rank, per_rank in loaded.items() for name in per_rank.missing]
    if missing:
        results.append(skipped("weights.loaded.exposed", "weights",
                               f"the engine did not expose {len(missing)} parameter(s), e.g. {missing[0]}",
                               stats={"missing": missing[:50]}))
    unaudited = _unaudited(engine, set(wanted) | set(not_chosen), tp, spec)
    if unaudited:
        results.append(skipped("weights.loaded.unaudited", "weights",
                               f"the engine holds {len(unaudited)} parameter(s) the audit could not compare with "
                               f"the file, e.g. {unaudited[0]}", stats={"names": unaudited[:50]}))
    return results


def _expert_parallel_ranks(engine, wanted: list[str], tp: int):
    """Under expert parallelism: per rank, the parameters to audit (every non-expert one, and the
    routed experts that rank holds by its own account), and where each expert is: every expert
    the file has must be on exactly one rank."""
    from ggufcheck.engines.base import Unsupported

    held = {}
    for rank in range(tp):
        try:
            held[rank] = set(engine.held_weight_names(rank=rank))
        except Unsupported:
            held[rank] = None
    loaded = {rank: LazyRankWeights(engine, [n for n in wanted if expert_of(n) is None or held[rank] is None
                                             or n in held[rank]], rank) for rank in range(tp)}
    where: dict[tuple[str, int], list[int]] = {}  # (MoE module, expert) -> ranks holding it
    for name in wanted:
        e = expert_of(name)
        if e is not None:
            module = name[:name.index(f".experts.{e}.")]
            where.setdefault((module, e), [])
            where[(module, e)] += [r for r in range(tp) if held[r] is not None and name in held[r]
                                   and r not in where[(module, e)]]
    if not where or any(h is None for h in held.values()):
        return loaded, []
    wrong = {k: v for k, v in where.items() if len(v) != 1}
    by_rank = {r: sorted({e for (_m, e), ranks in where.items() if ranks == [r]}) for r in range(tp)}
    text = "; ".join(f"rank {r}: experts {index_ranges(tuple(es)) if es else 'none'}" for r, es in by_rank.items())
    if wrong:
        (module, e), ranks = next(iter(wrong.items()))
        return loaded, [failed("weights.loaded.expert_placement", "moe-experts",
                               f"expert parallelism: {len(wrong)} routed expert(s) on no rank or on several, e.g. "
                               f"{module} expert {e} on {ranks or 'no rank'} ({text})",
                               stats={"placement": {str(r): es for r, es in by_rank.items()}})]
    return loaded, [passed("weights.loaded.expert_placement", "moe-experts",
                           f"expert parallelism: every routed expert on exactly one rank, audited by its global id "
                           f"({text})", stats={"placement": {str(r): es for r, es in by_rank.items()}})]


def _unaudited(engine, audited: set[str], tp: int, spec: ArchSpec) -> list[str]:
    """Parameters the engine holds (by its own account) that no expected name covers."""
    from ggufcheck.engines.base import Unsupported

    out = []
    tied = "lm_head.weight" if getattr(spec, "tied_output", False) else None
    for rank in range(tp):
        try:
            held = engine.held_weight_names(rank=rank)
        except Unsupported:
            return []
        out += [f"{name}@{rank}" for name in held if name not in audited and name != tied]
    return out
