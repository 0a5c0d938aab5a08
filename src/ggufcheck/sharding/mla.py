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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from ggufcheck.arch.transforms import kv_b_from_split
from ggufcheck.results import Result, failed, passed
from ggufcheck.sharding.rules import ShardRule, shard

COMPONENT = "mla-kv-b"
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


def check_kv_b_ranks(k_b: Tensor, v_b: Tensor, tp: int, layer: int | None = None,
                     layout: KvBLayout = VLLM_LAYOUT) -> list[Result]:
    """One Result per rank: W_UK / W_UV equal k_b / v_b of that rank's heads, exactly.

    k_b [H, L, P], v_b [H, V, L] as dequantized from the file (data movement only, so any
    difference at all is a layout error).
    """
    n_head = k_b.shape[0]
    check = "sharding.mla.kv_b_ranks"
    if n_head % tp:
        return [failed(check, COMPONENT, f"{n_head} MLA heads do not divide over TP {tp}", layer=layer,
                       stats={"heads": n_head, "tp": tp})]
    n_local = n_head // tp
    results = []
    for rank in range(tp):
        uk, uv = rank_uk_uv(k_b, v_b, rank, tp, layout)
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
            results.append(failed(check, COMPONENT,
                                  f"{where}: {len(wrong_heads)} of {2 * n_local} W_UK/W_UV head blocks are not "
                                  f"k_b/v_b of those heads ({layout.name})",
                                  layer=layer, stats=stats, worst=worst))
        else:
            results.append(passed(check, COMPONENT, f"{where}: W_UK == k_b, W_UV == v_b^T exactly",
                                  layer=layer, stats=stats))
    return results
