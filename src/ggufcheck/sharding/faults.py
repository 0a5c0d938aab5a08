"""Known-wrong loaders, to show the sharding checks catch them (fault catalog #1, #21).

Public on purpose: a user can run the checks with these and see them fail, which is the
evidence that a PASS means something.

- :data:`KV_B_ALL_K_THEN_V`: kv_b rebuilt as [all K ; all V] with the split patched to
  ``w[:Hl*P], w[Hl*P:]``. Exactly right at TP 1; at TP > 1 rank 0 holds only key rows.
- :func:`every_rank_gets_shard0`: a merged-column loader that reads the rank from a default
  of 0, so every rank loads shard 0 (silent at TP 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ggufcheck.sharding.mla import KvBLayout
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
