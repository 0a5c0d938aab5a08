"""How vLLM splits each tensor under tensor parallelism, and the slice each rank gets.

A :class:`ShardRule` is data (style.md principle 6): the kind of split, the numpy dim it
cuts, the indivisible unit along that dim (one head's rows), whether the dim counts kv heads
(vLLM replicates kv heads when TP > n_kv_heads), and fused parts (a fused gate_up is two
blocks, each split on its own). :func:`shard` is the one function that cuts a full tensor
into rank ``r``'s piece; the sharded layers, the weights audit and the fault injections
all go through it (or through a replacement loader with the same signature).

The facts (docs/architectures.md sec 7, read from vLLM's linear.py / vocab_parallel_embedding.py)
live in the arch tables (``ggufcheck.arch.tables``: every row carries a ``Shard``);
:func:`rules_from_table` turns them into :class:`ShardRule` values with the units resolved
for one model. What this module adds is the vLLM behaviour the table rows only name:

- kv heads: a split over ``Hkv`` rows replicates each kv head on ``tp / Hkv`` ranks when
  TP exceeds the kv-head count (vLLM QKVParallelLinear);
- fused parts: a ``2*Fe`` dim (``ffn_gate_up_exps``) is two blocks, each split on its own;
- vocabulary: padded to a multiple of 64 (``pad_vocab_size``), then divided evenly by TP
  (``divide`` asserts it); rank r holds rows ``[r * per, (r + 1) * per)`` and rows past the
  real vocabulary are padding, filled with zeros by the loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.arch.spec import ArchSpec
    from ggufcheck.arch.table import Shard, TensorTable

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class ShardRule:
    """How one tensor is split across TP ranks, resolved for one model."""

    kind: str  # "column" | "row" | "replicated" | "vocab"
    dim: int = 0  # numpy dim that is cut (negative: from the end; -1 is ggml's ne0)
    unit: int = 1  # the indivisible run along dim (one head's rows), in elements
    kv_heads: bool = False  # the dim counts kv heads: replicated (one head per rank group) when tp > n_kv
    parts: int = 1  # fused blocks along dim, each split on its own (gate_up: 2)

    @property
    def is_split(self) -> bool:
        return self.kind != "replicated"


REPLICATED = ShardRule("replicated")


def rule_from_shard(shard: "Shard", shape_expr: tuple[str, ...], spec: "ArchSpec") -> ShardRule:
    """A table row's ``Shard`` (and its shape expressions) -> a resolved :class:`ShardRule`."""
    if shard.kind.value == "replicated" or shard.dim is None:
        return REPLICATED
    expr = shape_expr[shard.dim].replace(" ", "")
    return ShardRule(kind=shard.kind.value, dim=shard.dim, unit=shard.unit_size(spec),
                     kv_heads="Hkv" in expr, parts=2 if expr.startswith("2*") else 1)


def short_template(gguf_template: str) -> str:
    """``blk.{i}.attn_q.weight`` -> ``attn_q.weight``."""
    return gguf_template.removeprefix("blk.{i}.")


def rules_from_table(spec: "ArchSpec", table: "TensorTable") -> dict[str, ShardRule]:
    """Short GGUF name -> shard rule, for every row of the architecture's table."""
    return {short_template(r.gguf): rule_from_shard(r.shard, r.shape, spec) for r in table.rows}


def short_name(name: str) -> tuple[int | None, str]:
    """``blk.3.attn_q.weight`` -> (3, ``attn_q.weight``); ``output.weight`` -> (None, same)."""
    if name.startswith("blk."):
        layer, _, rest = name[4:].partition(".")
        if layer.isdigit():
            return int(layer), rest
    return None, name


def rule_for(name: str, rules: dict[str, ShardRule]) -> ShardRule:
    """The rule of a GGUF tensor (full or short name); tensors without a row are replicated."""
    return rules.get(short_name(name)[1], REPLICATED)


# --- vocabulary ------------------------------------------------------------------------


def pad_vocab(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    """vLLM's ``pad_vocab_size``: round up to a multiple of ``pad_to``."""
    return -(-vocab // pad_to) * pad_to


def vocab_range(vocab: int, rank: int, tp: int) -> tuple[int, int, int]:
    """(first, last, rows per rank): rank holds real rows [first, last) then zero padding.

    Raises ValueError when the padded vocabulary does not divide by ``tp`` (vLLM asserts).
    """
    padded = pad_vocab(vocab)
    if padded % tp:
        raise ValueError(f"padded vocabulary {padded} is not divisible by TP {tp}")
    per = padded // tp
    return min(rank * per, vocab), min((rank + 1) * per, vocab), per


# --- slicing ---------------------------------------------------------------------------

Loader = Callable[[Tensor, ShardRule, int, int, int], Tensor]


def shard(full: Tensor, rule: ShardRule, rank: int, tp: int, n_kv: int = 0) -> Tensor:
    """Rank ``rank``'s piece of ``full`` under ``rule`` (vLLM's weight loaders, in one place).

    ``n_kv``: the kv-head count of a ``kv_heads`` rule's dim (used only when tp > n_kv).
    """
    if rule.kind == "replicated" or tp == 1 and rule.kind != "vocab":
        return full
    if rule.kind == "vocab":
        first, last, per = vocab_range(full.shape[0], rank, tp)
        piece = full[first:last]
        pad = torch.zeros((per - piece.shape[0], *full.shape[1:]), dtype=full.dtype, device=full.device)
        return torch.cat((piece, pad), dim=0)  # [per, ...]: padding rows are zero
    dim = rule.dim % full.dim()
    size = full.shape[dim]
    if rule.kv_heads and n_kv and tp > n_kv:  # vLLM: each kv head replicated over tp / n_kv ranks
        head = size // n_kv
        replicas = tp // n_kv
        return full.narrow(dim, (rank // replicas) * head, head)
    block = size // rule.parts
    per = block // tp
    pieces = [full.narrow(dim, p * block + rank * per, per) for p in range(rule.parts)]
    return pieces[0] if rule.parts == 1 else torch.cat(pieces, dim=dim)


def split_problem(size: int, rule: ShardRule, tp: int, n_kv: int = 0) -> str | None:
    """Why ``size`` along the rule's dim cannot be split ``tp`` ways (None when it can)."""
    if not rule.is_split or tp == 1:
        return None
    if rule.kind == "vocab":
        padded = pad_vocab(size)
        return None if padded % tp == 0 else f"padded vocabulary {padded} is not divisible by TP {tp}"
    if rule.kv_heads and n_kv and tp > n_kv:
        return None if tp % n_kv == 0 else f"TP {tp} is above the kv-head count {n_kv} and not a multiple of it"
    if size % rule.parts:
        return f"{size} does not split into {rule.parts} fused parts"
    block = size // rule.parts
    if block % tp:
        return f"{block} is not divisible by TP {tp}"
    if rule.unit > 1 and (block // tp) % rule.unit:
        return f"{block} / {tp} = {block // tp} cuts through a unit (head) of {rule.unit}"
    return None


def raw_shard(raw: Tensor, rule: ShardRule, rank: int, tp: int, n_kv: int, block: int,
              type_size: int) -> Tensor | str:
    """Rank ``rank``'s piece of a tensor's QUANTIZED bytes ``raw`` [..., row_bytes] (uint8).

    Splits of leading dims cut whole rows (as :func:`shard`; vocab padding rows are zero
    bytes, which every ggml type dequantizes to 0). A split of the last dim (ggml ne0, the
    quant-block dim) must start every rank on a block boundary; when it cannot, the reason
    is returned instead of a tensor (what a GGUF loader would have to get wrong).
    """
    if not rule.is_split or rule.dim % raw.dim() != raw.dim() - 1:
        return shard(raw, rule, rank, tp, n_kv)
    n_elements = raw.shape[-1] // type_size * block
    if n_elements % tp or (n_elements // tp) % block:
        return (f"{n_elements} / {tp} = {n_elements / tp:g} elements per rank: not a whole number of "
                f"{block}-element quant blocks")
    per_bytes = n_elements // tp // block * type_size
    return raw.narrow(raw.dim() - 1, rank * per_bytes, per_bytes)
