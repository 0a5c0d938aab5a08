"""Replays of one reference layer on the engine's own input to it: the whole layer through the
family code, or its FFN / MoE block on the engine's post-attention residual.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor


def ffn_parts(cfg, w: dict[str, Tensor], after_attn: Tensor, layer: int):
    """The FFN / MoE block on ``after_attn`` [T, D], through the reference's own ffn_block:
    (out, routed, shared, ids, routing gap [T])."""
    from ggufcheck.reference.layers import ffn_block, rms_norm

    norm = w["ffn_norm.weight"] if "ffn_norm.weight" in w else w["post_attention_norm.weight"]
    parts = ffn_block(cfg, w, rms_norm(after_attn, norm, cfg.rms_eps), cfg.is_moe_layer(layer))
    return parts.out, parts.routed, parts.shared, parts.ids, parts.gap


class Replayer:
    """Replays of one reference layer (fp64, and fp32 for baselines) on given inputs."""

    def __init__(self, ref, layer: int):
        self.ref, self.layer = ref, layer
        self.w = ref.weights.layer(layer)

    def attention(self, h_in: Tensor, shared_topk: Tensor | None, cfg=None,
                  weights: Callable | None = None):
        """Run the whole layer (family code) on h_in; the LayerOutput (attn_out, topk, ...)."""
        from ggufcheck.reference.cache import LayerCache

        ref = self.ref
        cfg = ref.cfg if cfg is None else cfg
        w = self.w if weights is None else weights(cfg, self.layer, self.w)
        h = h_in.to(dtype=ref.dtype, device=ref.device)
        pos = torch.arange(h.shape[0], device=ref.device)
        shared = {} if shared_topk is None else {"topk": shared_topk.to(ref.device)}
        with torch.no_grad():  # compared with the engine's tensors on the CPU
            return ref.family.forward_layer(cfg, self.layer, w, h, ref.rope(pos, self.layer, cfg), pos, pos,
                                            LayerCache(), shared).to("cpu")

    def ffn(self, after_attn: Tensor, cfg=None, weights: Callable | None = None):
        ref = self.ref
        cfg = ref.cfg if cfg is None else cfg
        w = self.w if weights is None else weights(cfg, self.layer, self.w)
        with torch.no_grad():  # compared with the engine's tensors on the CPU
            parts = ffn_parts(cfg, w, after_attn.to(dtype=ref.dtype, device=ref.device), self.layer)
        return tuple(p.cpu() if isinstance(p, Tensor) else p for p in parts)

    def close(self) -> None:
        self.ref.weights.release(self.layer)


class ReplayedTrace:
    """A trace of some layers only, each replayed on the engine's own input to it (``--layers``):
    only those layers' weights are read. ``layers[i]`` is the replayed output of a chosen
    layer, an empty placeholder for any other (nothing to compare there)."""

    def __init__(self, reference, eng, tokens, chosen):
        from ggufcheck.reference.cache import LayerOutput

        self.embeddings = reference.embed(list(tokens)).cpu()
        empty = LayerOutput(hidden=None, after_attn=None, attn_out=None, ffn_out=None)  # type: ignore[arg-type]
        self.layers = [empty] * reference.cfg.n_layer

        def inputs(j):
            return engine_input(j, eng, self)

        for i in sorted(chosen):
            self.layers[i] = Replayer(reference, i).attention(inputs(i), shared_topk(i, reference.cfg, eng, reference,
                                                                                      inputs))


def engine_input(i: int, eng, ref_trace) -> Tensor:
    if i == 0:
        return ref_trace.embeddings  # engines do not expose embeddings: layer 0 reads the reference's
    return torch.as_tensor(np.asarray(eng.tensors[("residual", i - 1)]))


def shared_topk(i: int, cfg, eng, ref_rep, inputs) -> Tensor | None:
    """A glm-dsa shared layer's top-k: the engine's own from its latest full layer when it
    reports one, else the reference's latest full layer replayed on the engine's input."""
    if not cfg.has_indexer or cfg.indexer_full[i]:
        return None
    for j in range(i - 1, -1, -1):
        if cfg.indexer_full[j]:
            got = eng.tensors.get(("indexer", j))
            if got is not None:
                return torch.as_tensor(np.asarray(got)).to(torch.int64)
            return Replayer(ref_rep, j).attention(inputs(j), shared_topk(j, cfg, eng, ref_rep, inputs)).topk
    return None
