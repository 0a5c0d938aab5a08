"""The ``layers`` stage: which layer first computes something wrong, and which part of it.

1. Per layer, the engine's residual stream (layer output) against the fp64 reference on the
   same tokens: relative error ``||a - b|| / ||b||`` per position, max over positions and
   prompts. Its limit is the honest baseline: the fp32 reference's error against fp64 for
   the same layer, times :attr:`LayerOptions.multiple`, never below
   :attr:`LayerOptions.floor`, and for engines whose activations are bf16 / fp16 / q8 never
   below the stated allowance of that class (a reference run cannot reproduce their
   rounding). glm-dsa: positions where the reference marks an indexer top-k boundary TIE
   (either set is correct) are left out from that layer on, and the later positions that
   read their keys from the next layer on. The first layer over its limit is where the
   bisection looks.
2. Inside that layer, errors must not carry over: the reference layer is REPLAYED on the
   engine's own input to it (``ReferenceModel`` family code, fp64; fp32 replay for the
   baseline), and the attention block and the FFN / MoE block are compared separately (the
   FFN replay reads the engine's own post-attention residual). Then:
   - MoE: router agreement (expert-set Jaccard vs the replay, positions whose K-th and
     (K+1)-th selection scores are within a tie margin left out) -> "moe-router"; a routed
     output that is the reference's times a constant (a routed-scale bug) -> "moe-router";
     otherwise "moe-experts" (the router agrees or is not exposed). Dense: "ffn".
   - glm-dsa: indexer top-k overlap as SETS, positions the reference marks as boundary ties
     left out -> "indexer".
   - Attention: where the engine exposes its rope call, the rope kernel is checked on the
     engine's own q / k against the reference angles (``checks/rope.py``) -> "rope".
   - Finer attribution only by positive identification: the engine's block equals, within
     the same baseline, the reference block with ONE named change: rope pairing swapped ->
     "rope"; another RMS eps (a grid of powers of ten) -> "norm"; kv_b under a known wrong TP layout ->
     "mla-kv-b"; dense instead of sparse attention -> "indexer"; bias-free routing ->
     "moe-router"; the block's output times an integer >= 2 (the TP size: a doubled
     all-reduce) -> "sharding". Nothing matched -> the block ("attention", "ffn", "moe-experts").
   When every block of the first diverging layer replays within its baseline (the layer
   itself is right and only amplifies an earlier near-limit error), the next layers are
   examined the same way (up to :attr:`LayerOptions.max_replays`); if none localizes, the
   residual divergence is accumulated drift (a PASS saying so) unless the engine's own
   tensors show a layer's output is not its input plus its blocks (a broken residual
   connection: "output").

Shapes: residuals, attention and FFN outputs [T, D]; router ids [T, K]; top-k [T, k].
"""

from ggufcheck.checks.layers.metrics import near_ties, rel_errors
from ggufcheck.checks.layers.options import EPS_CANDIDATES, STAGE, LayerOptions
from ggufcheck.checks.layers.stage import replay_errors, run, run_layers_stage

__all__ = ["EPS_CANDIDATES", "STAGE", "LayerOptions", "near_ties", "rel_errors", "replay_errors", "run", "run_layers_stage"]
