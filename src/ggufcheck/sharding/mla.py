"""MLA's kv_b under TP: rebuilt from attn_k_b / attn_v_b, cut per rank, split into W_UK / W_UV.

vLLM loads HF's ``kv_b_proj`` [H*(P+V), L] (head-major; inside each head P key rows then V
value rows), column-parallel: rank r takes rows ``[r*Hl*(P+V), (r+1)*Hl*(P+V))`` with
``Hl = H / tp``, and splits ``W.T.view(L, Hl, P+V)`` into W_UK [L, Hl, P] and W_UV [L, Hl, V]
(docs/architectures.md sec 7). A GGUF stores k_b [H, L, P] and v_b [H, V, L] instead; a loader
rebuilds kv_b from them. The invariants after loading, for every rank and local head h of
global head g = r*Hl + h:

    W_UK[:, h, :] == k_b[g]        ([L, P])
    W_UV[:, h, :] == v_b[g].T      ([L, V])

The classic silent failure (fault catalog #21): rebuilding kv_b as [all K ; all V] and
patching the split to ``w[:H*P], w[H*P:]``: exact at TP 1, wrong at TP > 1 (rank 0 holds only
key rows). A :class:`KvBLayout` is the (rebuild, split) pair a loader uses, so the correct
one and that fault run through the same checks.

Dimension letters: H heads, Hl heads per rank, P nope dims, V value dims, L kv_lora_rank.
The check that holds every rank to these invariants is ``checks.sharding.check_kv_b_ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from ggufcheck.arch.transforms import kv_b_from_split
from ggufcheck.sharding.rules import ShardRule, shard

KV_B_RULE = ShardRule("column", 0)  # whole rows of [H*(P+V), L]: heads stay whole when H % tp == 0


def rebuild_kv_b(k_b: Tensor, v_b: Tensor) -> Tensor:
    """HF kv_b_proj from the GGUF pair: k_b [H, L, P], v_b [H, V, L] -> [H*(P+V), L].

    The exact inverse of llama.cpp's converter split (docs/architectures.md sec 3): the arch
    transform the HF rebuild uses, so the weights audit and this check share one definition.
    """
    return kv_b_from_split(k_b, v_b)


def split_uk_uv(w_local: Tensor, n_local: int, nope: int, v_dim: int) -> tuple[Tensor, Tensor]:
    """vLLM's split of one rank's kv_b rows [Hl*(P+V), L] -> (W_UK [L, Hl, P], W_UV [L, Hl, V])."""
    lora = w_local.shape[1]
    per_head = w_local.T.reshape(lora, n_local, nope + v_dim)  # [L, Hl, P+V]
    return per_head[..., :nope], per_head[..., nope:]


@dataclass(frozen=True)
class KvBLayout:
    """How a loader builds kv_b from (k_b, v_b) and splits a rank's rows into W_UK / W_UV."""

    name: str
    rebuild: Callable[[Tensor, Tensor], Tensor]
    split: Callable[[Tensor, int, int, int], tuple[Tensor, Tensor]]


VLLM_LAYOUT = KvBLayout("head-major [K_h; V_h] per head (vLLM)", rebuild_kv_b, split_uk_uv)


def rank_uk_uv(k_b: Tensor, v_b: Tensor, rank: int, tp: int,
               layout: KvBLayout = VLLM_LAYOUT) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s W_UK [L, Hl, P] and W_UV [L, Hl, V], as a loader with ``layout`` builds them."""
    n_head, _, nope = k_b.shape
    v_dim = v_b.shape[1]
    w_local = shard(layout.rebuild(k_b, v_b), KV_B_RULE, rank, tp)  # [Hl*(P+V), L]
    return layout.split(w_local, n_head // tp, nope, v_dim)
