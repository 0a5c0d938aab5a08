"""What the file alone says about sharding a model N ways (no weights read): the facts.

The tensors a plan is made of (anything with ``name``, ``qtype``, ``shape`` in numpy order
and ``nbytes``: a file's :class:`ggufcheck.gguf.reader.TensorInfo`, or a :class:`PlannedTensor`
of a model without a file, see :mod:`ggufcheck.sharding.mixes`), the quant block a row-parallel
split must respect, the bytes one rank holds, and why a layer cannot run sharded. The plan's
checks (divisibility, block alignment, memory per rank) judge these in
:mod:`ggufcheck.checks.sharding.plan`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import gguf

from ggufcheck.arch.spec import ArchSpec
from ggufcheck.sharding.rules import ShardRule, pad_vocab, rule_for, split_problem

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default fraction of GPU memory it may use
GIB = 1 << 30


class TensorLike(Protocol):
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor of a model described without a file (name, numpy shape, type)."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        n = 1
        for d in self.shape:
            n *= d
        return n // block * size


def block_size(qtype: gguf.GGMLQuantizationType) -> int:
    """Elements per quant block along ne0 (1 for plain float types)."""
    return gguf.GGML_QUANT_SIZES[qtype][0]


def pattern(name: str) -> str:
    """A tensor name with its layer number as ``*`` (tensors grouped across layers)."""
    return re.sub(r"^blk\.\d+\.", "blk.*.", name)


def n_kv_split(spec: ArchSpec) -> int:
    """The kv-head count a ``kv_heads`` rule splits over (0 for MLA: no k / v rows)."""
    return 0 if spec.mla is not None else spec.n_head_kv


def rank_bytes(t: TensorLike, rule: ShardRule, tp: int, n_kv: int) -> int:
    """Bytes of ``t`` one rank holds (in the file's own type: GGUF engines keep it quantized)."""
    if not rule.is_split or tp == 1:
        return int(t.nbytes)
    if rule.kind == "vocab":
        rows = pad_vocab(int(t.shape[0])) // tp if pad_vocab(int(t.shape[0])) % tp == 0 else -(-int(t.shape[0]) // tp)
        return int(t.nbytes) // int(t.shape[0]) * rows
    if rule.kv_heads and n_kv and tp > n_kv:
        return int(t.nbytes) // n_kv
    return -(-int(t.nbytes) // tp)


def kind_problems(rules: dict[str, ShardRule], shapes: dict[str, tuple[int, ...]], tp: int, n_head: int,
                  n_kv: int) -> list[str]:
    """Why a layer's tensors (short name -> numpy shape) cannot run sharded ``tp`` ways."""
    problems = []
    if any(n.startswith(("attn_q", "attn_k_b", "attn_kv_b")) for n in shapes) and n_head % tp:
        problems.append(f"{n_head} attention heads are not divisible by TP {tp}")
    for name, shape in shapes.items():
        rule = rule_for(name, rules)
        if rule.is_split:
            p = split_problem(int(shape[rule.dim % len(shape)]), rule, tp, n_kv)
            if p:
                problems.append(f"{name}: {p}")
    return problems
