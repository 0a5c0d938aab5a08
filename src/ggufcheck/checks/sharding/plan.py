"""The TP plan's checks: what the file alone says about sharding it N ways (no weights read).

Checks, each a Result (component "sharding"):

- ``heads``: attention heads divide by TP (vLLM requires it); ``kv_heads``: GQA kv heads
  divide by TP, or TP is a multiple of them (then vLLM replicates each kv head);
- ``ffn`` / ``expert_ffn`` / ``shared_ffn``: FF widths divide by TP;
- ``vocab``: the vocabulary padded to a multiple of 64 divides by TP; rows per rank and
  how many are padding (which the loader must zero);
- ``split``: every split tensor's dim cuts into TP whole units (heads), grouped by name;
- ``block_alignment``: a row-parallel split of QUANTIZED bytes (the split dim is ggml's ne0,
  the quant block dim) must start every rank on a block boundary, for the tensor's ACTUAL
  type: ``(K_in / tp) % block_size == 0`` (GLM-4.5 355B experts, 1536 / 8 = 192: not a
  multiple of 256, so a Q4_K file cannot be row-split 8 ways);
- ``memory``: per-rank weight bytes (split tensors 1/TP, replicated ones whole, vocab rows
  padded) against a GPU's memory times vLLM's default ``gpu_memory_utilization`` 0.9.

Tensors are described by anything with ``name``, ``qtype``, ``shape`` (numpy order) and
``nbytes``: a file's :class:`ggufcheck.gguf.reader.TensorInfo`, or a planned tensor of a model
without a file (see :mod:`ggufcheck.sharding.mixes`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from ggufcheck.arch.spec import ArchSpec
from ggufcheck.results import Result, failed, passed, skipped
from ggufcheck.sharding.plan import GIB, GPU_MEMORY_UTILIZATION, TensorLike, block_size, n_kv_split, rank_bytes
from ggufcheck.sharding.plan import pattern as name_pattern
from ggufcheck.sharding.rules import ShardRule, pad_vocab, rule_for, short_name, split_problem

COMPONENT = "sharding"


def _dim_check(check: str, what: str, size: int, tp: int, **stats: Any) -> Result:
    if size <= 0:
        return skipped(check, COMPONENT, f"the model has no {what}")
    stats = {"size": size, "tp": tp, **stats}
    if size % tp:
        return failed(check, COMPONENT, f"{what} {size} is not divisible by TP {tp}", stats=stats)
    return passed(check, COMPONENT, f"{what} {size} / TP {tp} = {size // tp} per rank", stats=stats)


def check_dims(spec: ArchSpec, tensors: dict[str, TensorLike], tp: int) -> list[Result]:
    """Heads, kv heads, FF widths and vocabulary against TP."""
    out = [_dim_check("sharding.plan.heads", "attention heads", spec.n_head, tp)]
    if spec.mla is not None:
        out.append(passed("sharding.plan.kv_heads", COMPONENT,
                          "MLA: the latent kv (kv_a_mqa) is replicated; kv_b splits with the heads",
                          stats={"tp": tp}))
    elif tp <= spec.n_head_kv:
        out.append(_dim_check("sharding.plan.kv_heads", "kv heads", spec.n_head_kv, tp))
    elif tp % spec.n_head_kv:
        out.append(failed("sharding.plan.kv_heads", COMPONENT,
                          f"TP {tp} exceeds the {spec.n_head_kv} kv heads and is not a multiple of them",
                          stats={"size": spec.n_head_kv, "tp": tp}))
    else:
        out.append(passed("sharding.plan.kv_heads", COMPONENT,
                          f"TP {tp} > {spec.n_head_kv} kv heads: each kv head replicated on {tp // spec.n_head_kv} ranks",
                          stats={"size": spec.n_head_kv, "tp": tp, "replicas": tp // spec.n_head_kv}))
    dense_ff = _rows_of(tensors, "ffn_gate.weight") or (spec.n_ff if spec.moe is None or spec.moe.leading_dense else 0)
    out.append(_dim_check("sharding.plan.ffn", "dense FF width", dense_ff, tp))
    if spec.moe is not None:
        out.append(_dim_check("sharding.plan.expert_ffn", "expert FF width", spec.moe.expert_ff, tp))
        shared = _rows_of(tensors, "ffn_gate_shexp.weight")
        if shared:
            out.append(_dim_check("sharding.plan.shared_ffn", "shared-expert FF width", shared, tp))
    if spec.indexer is not None:
        out.append(passed("sharding.plan.indexer", COMPONENT,
                          f"DSA indexer ({spec.indexer.n_head} heads) is replicated on every rank (vLLM)",
                          stats={"tp": tp}))
    out.append(check_vocab(_vocab_rows(spec, tensors), tp))
    return out


def _rows_of(tensors: dict[str, TensorLike], short: str) -> int:
    for name, t in tensors.items():
        if short_name(name)[1] == short:
            return int(t.shape[0])
    return 0


def _vocab_rows(spec: ArchSpec, tensors: dict[str, TensorLike]) -> int:
    t = tensors.get("token_embd.weight")
    return int(t.shape[0]) if t is not None else spec.n_vocab


def check_vocab(vocab: int, tp: int) -> Result:
    """vLLM's vocab padding: pad to 64, divide by TP; rows per rank and padding rows."""
    padded = pad_vocab(vocab)
    stats: dict[str, Any] = {"vocab": vocab, "padded": padded, "tp": tp}
    if padded % tp:
        return failed("sharding.plan.vocab", COMPONENT,
                      f"vocabulary {vocab} padded to {padded} is not divisible by TP {tp}", stats=stats)
    per = padded // tp
    padding = {r: max(0, min(per, (r + 1) * per - vocab)) for r in range(tp) if (r + 1) * per > vocab}
    stats.update(per_rank=per, padding_rows_by_rank=padding)
    pad_note = ("; padding rows (must be zero): " + ", ".join(f"rank {r}: {n}" for r, n in padding.items())
                if padding else "; no padding rows")
    return passed("sharding.plan.vocab", COMPONENT,
                  f"vocabulary {vocab} -> padded {padded} = {tp} x {per} rows{pad_note}", stats=stats)


def check_splits(spec: ArchSpec, rules: dict[str, ShardRule], tensors: Iterable[TensorLike],
                 tp: int) -> list[Result]:
    """Every split tensor cuts into whole units, and row-parallel quantized splits align."""
    split_groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    align_groups: dict[tuple[str, str, str | None], list[str]] = defaultdict(list)
    align_stats: dict[tuple[str, str, str | None], dict[str, Any]] = {}
    n_split = 0
    for t in tensors:
        rule = rule_for(t.name, rules)
        if not rule.is_split:
            continue
        n_split += 1
        dim = rule.dim % len(t.shape)
        problem = split_problem(int(t.shape[dim]), rule, tp, n_kv_split(spec))
        if problem:
            split_groups[(name_pattern(t.name), problem)].append(t.name)
        if rule.kind == "row" and dim == len(t.shape) - 1:  # cutting ne0: the quant block dim
            block = block_size(t.qtype)
            per = t.shape[dim] // rule.parts // tp
            bad = None if (t.shape[dim] // rule.parts) % tp == 0 and per % block == 0 else (
                f"{t.shape[dim]} / {tp} = {t.shape[dim] / tp:g} is not a multiple of the "
                f"{t.qtype.name} block of {block}")
            key = (name_pattern(t.name), t.qtype.name, bad)
            align_groups[key].append(t.name)
            align_stats[key] = {"k_in": int(t.shape[dim]), "per_rank": t.shape[dim] / tp, "block": block,
                                "qtype": t.qtype.name, "tp": tp}
    out = []
    for (pattern, problem), names in split_groups.items():
        out.append(failed("sharding.plan.split", COMPONENT, f"{pattern}: {problem} ({len(names)} tensor(s))",
                          tensor=names[0], stats={"tensors": len(names), "tp": tp}))
    if not split_groups:
        out.append(passed("sharding.plan.split", COMPONENT,
                          f"all {n_split} split tensors cut into whole units at TP {tp}", stats={"tp": tp}))
    for (pattern, qtype, bad), names in sorted(align_groups.items(), key=lambda kv: (kv[0][2] is None, kv[0][0])):
        stats = {**align_stats[(pattern, qtype, bad)], "tensors": len(names)}
        if bad:
            out.append(failed("sharding.plan.block_alignment", COMPONENT,
                              f"{pattern} ({qtype}, row-parallel): {bad} ({len(names)} tensor(s))",
                              tensor=names[0], stats=stats))
        else:
            out.append(passed("sharding.plan.block_alignment", COMPONENT,
                              f"{pattern} ({qtype}, row-parallel): {stats['k_in']} / {tp} = {int(stats['per_rank'])} "
                              f"starts every rank on a block of {stats['block']} ({len(names)} tensor(s))",
                              tensor=names[0], stats=stats))
    return out


def check_memory(spec: ArchSpec, rules: dict[str, ShardRule], tensors: Iterable[TensorLike], tp: int,
                 gpu_memory_gib: float | None) -> Result:
    """Per-rank weight memory, against ``gpu_memory_gib`` x 0.9 when given."""
    tensors = list(tensors)
    split = replicated = 0
    for t in tensors:
        rule = rule_for(t.name, rules)
        b = rank_bytes(t, rule, tp, n_kv_split(spec))
        if rule.is_split and tp > 1:
            split += b
        else:
            replicated += b
    total = split + replicated
    file_bytes = sum(int(t.nbytes) for t in tensors)
    stats: dict[str, Any] = {"tp": tp, "per_rank_gib": total / GIB, "split_gib": split / GIB,
                             "replicated_gib": replicated / GIB, "model_gib": file_bytes / GIB}
    what = (f"weights per rank {total / GIB:.2f} GiB at TP {tp} ({split / GIB:.2f} split + "
            f"{replicated / GIB:.2f} replicated; whole model {file_bytes / GIB:.2f} GiB)")
    if gpu_memory_gib is None:
        return passed("sharding.plan.memory", COMPONENT, what + "; no --gpu-memory given to compare", stats=stats)
    budget = gpu_memory_gib * GPU_MEMORY_UTILIZATION * GIB
    stats.update(gpu_memory_gib=gpu_memory_gib, budget_gib=budget / GIB, headroom_gib=(budget - total) / GIB)
    if total > budget:
        return failed("sharding.plan.memory", COMPONENT,
                      f"{what} exceed {gpu_memory_gib:g} GiB x {GPU_MEMORY_UTILIZATION} = {budget / GIB:.1f} GiB",
                      stats=stats)
    return passed("sharding.plan.memory", COMPONENT,
                  f"{what} fit {gpu_memory_gib:g} GiB x {GPU_MEMORY_UTILIZATION}; {(budget - total) / GIB:.1f} GiB "
                  "left per rank for KV cache and activations", stats=stats)


def plan(spec: ArchSpec, rules: dict[str, ShardRule], tensors: dict[str, TensorLike], tp: int,
         gpu_memory_gib: float | None = None) -> list[Result]:
    """All plan checks for ``tp`` ranks."""
    return [*check_dims(spec, tensors, tp), *check_splits(spec, rules, tensors.values(), tp),
            check_memory(spec, rules, tensors.values(), tp, gpu_memory_gib)]
