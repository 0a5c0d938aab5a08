"""How vLLM splits each tensor under tensor parallelism, and the slice each rank gets.

A :class:`ShardRule` is data (style.md principle 6): the kind of split, the numpy dim it
cuts, the indivisible unit along that dim (one head's rows), whether the dim counts kv heads
(vLLM replicates kv heads when TP > n_kv_heads), and fused parts (a fused gate_up is two
blocks, each split on its own). :func:`shard` is the one function that cuts a full tensor
into rank ``r``'s piece; the sharded layers, the weights audit and the fault injections
all go through it (or through a replacement loader with the same signature).

The facts (architectures.md sec 7, read from vLLM's linear.py / vocab_parallel_embedding.py):

- column-parallel (split the output rows): q / q_b, k / v (by kv head), kv_b, dense and
  shared gate / up, expert gate / up on their FF dim, lm_head;
- row-parallel (split the input columns, then all-reduce): o_proj, down, expert down;
- replicated: q_a, kv_a_mqa, norms, router, exp_probs_b, the DSA indexer, rope_freqs;
- vocabulary: padded to a multiple of 64 (``pad_vocab_size``), then divided evenly by TP
  (``divide`` asserts it); rank r holds rows ``[r * per, (r + 1) * per)`` and rows past the
  real vocabulary are padding, filled with zeros by the loader.

:data:`GGUF_RULES` is keyed by the GGUF short name (``blk.N.`` removed). It is a stopgap
until the arch tables carry shard rules (requested in team/requests-arch.md); then
:func:`rule_for` reads those instead and this table goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class ShardRule:
    """How one tensor is split across TP ranks."""

    kind: str  # "column" | "row" | "replicated" | "vocab"
    dim: int = 0  # numpy dim that is cut (negative: from the end; -1 is ggml's ne0)
    unit: str = ""  # the indivisible run along dim, named: "head_q", "head_kv", "head_v", "kv_b_head", ""
    kv_heads: bool = False  # the dim counts kv heads: replicated (one head per rank group) when tp > n_kv
    parts: int = 1  # fused blocks along dim, each split on its own (gate_up: 2)

    @property
    def is_split(self) -> bool:
        return self.kind != "replicated"


REPLICATED = ShardRule("replicated")

# GGUF short name -> rule (stopgap, see module docstring). Numpy layouts from architectures.md
# sec 3-6: 2-D weights are [out, in]; stacked experts [E, F, D] / [E, D, F]; k_b [H, L, P],
# v_b [H, V, L].
GGUF_RULES: dict[str, ShardRule] = {
    "token_embd.weight": ShardRule("vocab", 0),
    "output.weight": ShardRule("vocab", 0),  # ParallelLMHead
    # GQA attention (llama, qwen, glm4moe): QKVParallelLinear
    "attn_q.weight": ShardRule("column", 0, "head_q"),
    "attn_q.bias": ShardRule("column", 0, "head_q"),
    "attn_k.weight": ShardRule("column", 0, "head_kv", kv_heads=True),
    "attn_k.bias": ShardRule("column", 0, "head_kv", kv_heads=True),
    "attn_v.weight": ShardRule("column", 0, "head_v", kv_heads=True),
    "attn_v.bias": ShardRule("column", 0, "head_v", kv_heads=True),
    "attn_output.weight": ShardRule("row", -1, "head_v"),  # RowParallelLinear o_proj
    # MLA (deepseek2, glm-dsa)
    "attn_q_b.weight": ShardRule("column", 0, "head_q"),
    "attn_kv_b.weight": ShardRule("column", 0, "kv_b_head"),  # legacy unsplit [H*(P+V), L]
    "attn_k_b.weight": ShardRule("column", 0),  # [H, L, P]: by head
    "attn_v_b.weight": ShardRule("column", 0),  # [H, V, L]: by head
    # dense and shared-expert FFN: MergedColumnParallelLinear gate_up + RowParallelLinear down
    "ffn_gate.weight": ShardRule("column", 0),
    "ffn_up.weight": ShardRule("column", 0),
    "ffn_down.weight": ShardRule("row", -1),
    "ffn_gate_shexp.weight": ShardRule("column", 0),
    "ffn_up_shexp.weight": ShardRule("column", 0),
    "ffn_down_shexp.weight": ShardRule("row", -1),
    # routed experts (FusedMoE under TP, no expert parallelism): w1/w3 on the FF dim, w2 on its input
    "ffn_gate_exps.weight": ShardRule("column", 1),
    "ffn_up_exps.weight": ShardRule("column", 1),
    "ffn_gate_up_exps.weight": ShardRule("column", 1, parts=2),
    "ffn_down_exps.weight": ShardRule("row", -1),
}


def short_name(name: str) -> tuple[int | None, str]:
    """``blk.3.attn_q.weight`` -> (3, ``attn_q.weight``); ``output.weight`` -> (None, same)."""
    if name.startswith("blk."):
        layer, _, rest = name[4:].partition(".")
        if layer.isdigit():
            return int(layer), rest
    return None, name


def rule_for(name: str) -> ShardRule:
    """The shard rule of a GGUF tensor (full or short name); unlisted tensors are replicated."""
    return GGUF_RULES.get(short_name(name)[1], REPLICATED)


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


def split_problem(size: int, rule: ShardRule, tp: int, unit: int = 1, n_kv: int = 0) -> str | None:
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
    if unit > 1 and (block // tp) % unit:
        return f"{block} / {tp} = {block // tp} cuts through a unit of {unit}"
    return None
