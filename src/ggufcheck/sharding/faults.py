"""Known-wrong loaders, to show the sharding checks catch them (fault catalog #1, #21).

Public on purpose: a user can run the checks with these and see them fail, which is the
evidence that a PASS means something.

- :data:`KV_B_ALL_K_THEN_V`: kv_b rebuilt as [all K ; all V] with the split patched to
  ``w[:Hl*P], w[Hl*P:]``. Exactly right at TP 1; at TP > 1 rank 0 holds only key rows.
- :func:`every_rank_gets_shard0`: a merged-column loader that reads the rank from a default
  of 0, so every rank loads shard 0 (silent at TP 1).
- :data:`KV_B_V_THEN_K`: each head's V rows before its K rows, split as [K; V].
- :func:`effective_k_b_v_b` / :func:`kv_b_layout_patch`: what a loader with one of these
  layouts computes with, as reference weights (the layers stage's hypotheses and the test
  fault engines both use them; the tests' oracle imports them from here, not the reverse).
"""

from __future__ import annotations

import torch
from torch import Tensor

from typing import Callable

from ggufcheck.errors import UsageError
from ggufcheck.sharding.mla import KvBLayout, rank_uk_uv, split_uk_uv
from ggufcheck.sharding.rules import ShardRule, shard


def rebuild_all_k_then_v(k_b: Tensor, v_b: Tensor) -> Tensor:
    """k_b [H, L, P], v_b [H, V, L] -> [H*P + H*V, L]: every head's K rows, then every head's V."""
    n_head, lora, nope = k_b.shape
    k_rows = k_b.transpose(1, 2).reshape(n_head * nope, lora)  # [H*P, L]
    v_rows = v_b.reshape(-1, lora)  # [H*V, L]
    return torch.cat((k_rows, v_rows), dim=0)


def split_patched(w_local: Tensor, n_local: int, nope: int, v_dim: int) -> tuple[Tensor, Tensor]:
    """The patched split ``w[:Hl*P], w[Hl*P:]`` -> (W_UK [L, Hl, P], W_UV [L, Hl, V])."""
    lora = w_local.shape[1]
    k_rows = w_local[: n_local * nope].reshape(n_local, nope, lora)  # [Hl, P, L]
    v_rows = w_local[n_local * nope:].reshape(n_local, v_dim, lora)  # [Hl, V, L]
    return k_rows.permute(2, 0, 1), v_rows.permute(2, 0, 1)  # [L, Hl, P], [L, Hl, V]


KV_B_ALL_K_THEN_V = KvBLayout("[all K ; all V] with a patched split (fault)", rebuild_all_k_then_v, split_patched)


def every_rank_gets_shard0(full: Tensor, rule: ShardRule, rank: int, tp: int, n_kv: int = 0) -> Tensor:
    """A loader that ignores its rank: every rank gets rank 0's slice."""
    return shard(full, rule, 0, tp, n_kv)


def rebuild_v_then_k(k_b: Tensor, v_b: Tensor) -> Tensor:
    """k_b [H, L, P], v_b [H, V, L] -> [H*(V+P), L] with V rows BEFORE K rows inside each head."""
    n_head, lora, nope = k_b.shape
    kv = torch.cat([v_b, k_b.transpose(1, 2)], dim=1)  # [H, V+P, L]
    return kv.reshape(n_head * (nope + v_b.shape[1]), lora)


KV_B_V_THEN_K = KvBLayout("[V_h; K_h] per head read as [K_h; V_h] (fault)", rebuild_v_then_k, split_uk_uv)


def effective_k_b_v_b(k_b: Tensor, v_b: Tensor, tp: int, layout: KvBLayout) -> tuple[Tensor, Tensor]:
    """The per-head (k_b [H, L, P], v_b [H, V, L]) a TP ``tp`` loader using ``layout`` computes with.

    Rank r's W_UK [L, Hl, P] / W_UV [L, Hl, V] (:func:`ggufcheck.sharding.mla.rank_uk_uv`)
    serve global heads r*Hl .. (r+1)*Hl-1: W_UK[:, h] is that head's k_b, W_UV[:, h].T its
    v_b. For the correct layout this returns (k_b, v_b) exactly, at any TP.
    """
    n_head = k_b.shape[0]
    if n_head % tp:
        raise UsageError(f"{n_head} MLA heads do not divide over TP {tp}")
    ks, vs = [], []
    for rank in range(tp):
        uk, uv = rank_uk_uv(k_b, v_b, rank, tp, layout)  # [L, Hl, P], [L, Hl, V]
        ks.append(uk.permute(1, 0, 2))  # [Hl, L, P]
        vs.append(uv.permute(1, 2, 0))  # [Hl, V, L]
    return torch.cat(ks).contiguous(), torch.cat(vs).contiguous()


def kv_b_layout_patch(layout: KvBLayout, tp: int) -> Callable:
    """A layer-weights transform (cfg, layer, weights) -> weights: the attn_k_b / attn_v_b a TP
    ``tp`` loader using ``layout`` really computes with (the layers stage's "mla-kv-b"
    hypotheses replay the reference with it; the test fault engines compute with it)."""
    def patch(cfg, i: int, w: dict) -> dict:
        from ggufcheck.reference.mla import kv_b_split

        k_b, v_b = kv_b_split(cfg, w)
        k_eff, v_eff = effective_k_b_v_b(k_b, v_b, tp, layout)
        from ggufcheck.reference.weights import replace_weights

        return replace_weights(w, drop=("attn_kv_b.weight",), **{"attn_k_b.weight": k_eff, "attn_v_b.weight": v_eff})

    return patch
