"""The DeepSeek Sparse Attention (DSA) lightning indexer, as glm-dsa uses it (docs/architectures.md sec 5).

A full layer scores every visible key with its own small multi-head projection and keeps
the ``top_k`` best per query; a shared layer reuses the indices of the latest full layer.
The MLA attention then adds -inf outside the chosen keys, on top of the causal mask. While
a query sees at most top_k keys this changes nothing (DSA == dense causal attention
exactly); past that, the choice matters, so tests use prompts longer than top_k.

GLM's indexer uses NORM (interleaved) rope on the FIRST R dims of each head ([rope, nope]),
the same frequencies and positions as the main attention. The official kernels' Hadamard
rotation and fp8 preserve dot products up to precision, so the reference skips them.

Dimension letters: T queries, S keys, Hi indexer heads, Di indexer head dim, Q q_lora_rank.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ggufcheck.reference.cache import LayerCache
from ggufcheck.reference.config import ReferenceConfig
from ggufcheck.reference.layers import apply_rope, causal_mask, layer_norm, linear, blocks_of

Weights = dict[str, Tensor]


def index_scores(
    cfg: ReferenceConfig, w: Weights, x: Tensor, qr: Tensor, rope: tuple[Tensor, Tensor],
    q_pos: Tensor, k_pos: Tensor, cache: LayerCache,
) -> Tensor:
    """Indexer scores [T, S]: sum_h w[t, h] * relu(q[t, h] . k[s]), -inf for future keys.

    x [T, D] is the attention input after attn_norm; qr [T, Q] the MLA's normed q_a.
    """
    n_tok = x.shape[0]
    cos, sin = rope
    q = linear(qr, w["indexer.attn_q_b.weight"]).view(n_tok, cfg.indexer_heads, cfg.indexer_dim)  # [T, Hi, Di]
    k = layer_norm(linear(x, w["indexer.attn_k.weight"]), w["indexer.k_norm.weight"],
                   w.get("indexer.k_norm.bias"), cfg.indexer_norm_eps)  # [T, Di]: one key head for all
    q = apply_rope(q, cos, sin, cfg.rope_mode)  # rope on the first R dims of each head
    k = apply_rope(k[:, None, :], cos, sin, cfg.rope_mode)[:, 0]  # [T, Di]
    k_all = cache.extend("index_k", k)  # [S, Di]
    head_w = linear(x, w["indexer.proj.weight"]) * (cfg.indexer_heads**-0.5 * cfg.indexer_dim**-0.5)  # [T, Hi]
    blocks = blocks_of(n_tok, cfg.indexer_heads * k_all.shape[0] * x.element_size())
    scores = torch.cat([torch.einsum("th,ths->ts", head_w[b], torch.einsum("thd,sd->ths", q[b], k_all).relu_())
                        for b in blocks])  # [T, S], from [Tb, Hi, S] per block (relu in place: same values)
    return scores.masked_fill_(~causal_mask(q_pos, k_pos), float("-inf"))


def select_top_k(scores: Tensor, top_k: int) -> Tensor:
    """Best min(top_k, S) keys per query [T, k], best first; -1 where only masked keys are left.

    Equal scores are broken by the lower key index (a stable sort), so the choice does not
    depend on how many queries are scored at once: prefill and decode pick the same keys
    even at an exact tie (``torch.topk``'s order among equals varies with the shape)."""
    k = min(top_k, scores.shape[-1])
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)  # [T, S]
    values, indices = values[:, :k], indices[:, :k]
    return indices.masked_fill(torch.isinf(values), -1)


def boundary_ties(scores: Tensor, top_k: int) -> Tensor:
    """[T] bool: the k-th and (k+1)-th best finite scores are EQUAL, so the top-k set is
    ambiguous and a correct engine may pick another one (ReLU makes exact-zero ties common
    when few heads are positive; see docs/reference-verification.md)."""
    return boundary_gap(scores, top_k) == 0


def boundary_gap(scores: Tensor, top_k: int) -> Tensor:
    """[T] float64: (k-th - (k+1)-th best score) / the row's largest |finite score|.

    How far the top-k set is from changing: 0 at an exact tie; inf where the row has no
    (k+1)-th candidate. An engine whose scores carry relative rounding ``u`` (bf16: 2^-8)
    may legitimately pick another set wherever the gap is within a few ``u``; the checks
    compare the gap with a margin set by the engine's activation class.
    """
    n = scores.shape[0]
    if scores.shape[-1] <= top_k:
        return torch.full((n,), math.inf, dtype=torch.float64, device=scores.device)
    s = scores.to(torch.float64)
    best = s.topk(top_k + 1, dim=-1).values  # [T, k+1]
    finite = torch.where(torch.isfinite(s), s.abs(), torch.zeros_like(s))
    scale = finite.amax(dim=-1).clamp_min(1e-300)
    gap = (best[:, -2] - best[:, -1]) / scale
    return torch.where(torch.isfinite(best[:, -1]), gap, torch.full_like(gap, math.inf))


def top_k_mask(indices: Tensor, n_keys: int) -> Tensor:
    """[T, k] key indices (-1 = none) -> [T, S] bool, True at the chosen keys."""
    mask = torch.zeros(indices.shape[0], n_keys + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(1, torch.where(indices < 0, n_keys, indices), True)  # -1 lands in a spare column
    return mask[:, :n_keys]


def indexer_top_k(
    cfg: ReferenceConfig, i: int, w: Weights, x: Tensor, qr: Tensor, rope: tuple[Tensor, Tensor],
    q_pos: Tensor, k_pos: Tensor, cache: LayerCache, shared: dict,
) -> tuple[Tensor, bool]:
    """This layer's top-k [T, k] and whether it ran its own indexer (full) or reused one (shared).

    ``shared["topk"]`` carries the latest full layer's indices to the following shared layers,
    ``shared["ties"]`` [T] whether that choice was ambiguous (:func:`boundary_ties`), and
    ``shared["gap"]`` [T] how close it was (:func:`boundary_gap`).
    """
    if cfg.indexer_full[i]:
        if qr is None:
            raise ValueError("the DSA indexer needs q_lora (attn_q_a)")
        scores = index_scores(cfg, w, x, qr, rope, q_pos, k_pos, cache)
        shared["topk"] = select_top_k(scores, cfg.indexer_top_k)
        shared["gap"] = boundary_gap(scores, cfg.indexer_top_k)
        shared["ties"] = shared["gap"] == 0
        return shared["topk"], True
    if "topk" not in shared:
        raise ValueError(f"layer {i} is a shared indexer layer but no earlier full layer ran")
    return shared["topk"], False
