"""Per-layer state carried between calls: the KV cache and what one layer tells the next.

A :class:`KVCache` grows along the token axis; prefill appends a whole prompt, decode one
token at a time, and both read exactly the same tensors (so decode logits can be checked
against prefill logits). What each family stores per layer:

- GQA (llama, qwen, glm4moe): ``k`` [S, G, d] after RoPE, ``v`` [S, G, dv]
- MLA (deepseek2, glm-dsa): the latent ``c`` [S, L] (after kv_a_norm) and ``k_pe`` [S, R]
  after RoPE: the compressed cache engines keep, not expanded keys
- DSA indexer: ``index_k`` [S, Di] after LayerNorm and RoPE
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ggufcheck.reference.precision import current as current_emulation
from ggufcheck.reference.precision import round_as


@dataclass
class LayerCache:
    """One layer's cached tensors, each [S, ...] along the key axis."""

    tensors: dict[str, Tensor] = field(default_factory=dict)

    def extend(self, name: str, new: Tensor) -> Tensor:
        """Append ``new`` [T, ...] to the cached [S, ...] and return all [S + T, ...] (stored
        rounded as an emulated engine's KV cache would be: precision.py)."""
        emulation = current_emulation()
        if emulation is not None:
            new = round_as(new, emulation.kv)
        old = self.tensors.get(name)
        self.tensors[name] = new if old is None else torch.cat((old, new), dim=0)
        return self.tensors[name]


@dataclass
class KVCache:
    """Every layer's cache plus the positions of the cached keys."""

    layers: dict[int, LayerCache] = field(default_factory=dict)
    positions: Tensor | None = None  # [S] int64, advanced once per forward call

    def layer(self, i: int) -> LayerCache:
        return self.layers.setdefault(i, LayerCache())

    @property
    def length(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[0])


@dataclass
class LayerOutput:
    """What one layer computed, as the trace records it. All [T, D] unless noted."""

    hidden: Tensor  # the layer's output: residual after the FFN / MoE
    after_attn: Tensor  # residual after attention (input + attn_out)
    attn_out: Tensor  # attention block output (after attn_output projection)
    ffn_out: Tensor  # FFN / MoE block output (routed + shared experts)
    expert_ids: Tensor | None = None  # [T, K] int64
    expert_weights: Tensor | None = None  # [T, K] final weights (normed, scaled)
    topk: Tensor | None = None  # [T, k] int64 key indices chosen by the DSA indexer; -1 = none
    topk_full: bool = False  # True when this layer ran its own indexer (False: shared)
    topk_ties: Tensor | None = None  # [T] bool: the top-k boundary was a tie (set ambiguous)
    topk_gap: Tensor | None = None  # [T] float64: relative k-th / (k+1)-th score gap (dsa.boundary_gap)
    # [T] MoE: the weakest chosen expert's selection score minus the best unchosen one's (a
    # small gap: an engine's rounding may legitimately choose the other expert)
    router_gap: Tensor | None = None

    def to(self, device: str) -> "LayerOutput":
        """The same output with every tensor on ``device`` (a GPU reference's, for the checks)."""
        from dataclasses import fields, replace

        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})

    def marks(self) -> "LayerOutput":
        """Only the per-token marks (router and indexer gaps, ties): what scoring keeps of a
        layer. The [T, D] states and the [T, k] top-k are dropped (a 2080-token GLM-5 prompt's
        states are 0.4 GB per layer in fp64, its top-k 34 MB)."""
        return LayerOutput(hidden=None, after_attn=None, attn_out=None, ffn_out=None,  # type: ignore[arg-type]
                           topk_full=self.topk_full, topk_ties=self.topk_ties, topk_gap=self.topk_gap,
                           router_gap=self.router_gap)
