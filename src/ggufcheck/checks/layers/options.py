"""Thresholds of the layers stage (the package docstring says how each is used).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ggufcheck.checks.logits import INDEXER_TIE_MARGINS, ROUTER_TIE_MARGINS

STAGE = "layers"


# RMS eps values tried as the "norm" hypothesis: the ones real configs use (1e-5, 1e-6) and
# the powers of ten around them; a match needs the block to agree to fp32 noise, so a wider
# grid does not make an unrelated bug look like a norm one.
EPS_CANDIDATES = (1e-5, 1e-6, 1e-4, 1e-3, 1e-2, 1e-8, 1e-12)


@dataclass(frozen=True)
class LayerOptions:
    """Thresholds of the layers stage (module docstring says how each is used)."""

    multiple: float = 10.0  # engine error may be this many times the fp32 baseline error
    # ... or this many times the error of a baseline run that emulates the engine's precision
    # class (reference.precision): that one is already the size of a correct engine's error
    emulated_multiple: float = 3.0
    floor: float = 2e-6  # relative error always accepted (about 16 fp32 roundings)
    # Activation classes whose rounding a reference run cannot reproduce: relative error
    # accepted regardless of the baseline. ``allowances``: one block replayed on the engine's
    # own input (local); ``residual_allowances``: the residual stream, which accumulates over
    # depth. q8 measured: SmolLM2-135M Q4_1 on llama.cpp CPU (30 layers, the 4 built-in prompts,
    # tools/measure_allowances.py --engines llama-cpp): local attention up to 0.092 and FFN 0.047
    # over all layers (0.0096 / 0.011 at layer 0), residual up to 0.070.
    # bf16 / fp16 measured (tools/measure_allowances.py, transformers 5.2 on this CPU and 5.17
    # on the H200, CPU and CUDA; 4 prompts; docs/thresholds.md): SmolLM2 local attention up to
    # 0.043 / 0.0061, FFN 0.012 / 0.0018, residual up to 0.137 / 0.017 (bf16 on CUDA, layer 10);
    # tiny deepseek2 and glm-dsa below those. The limits are 2-3x the worst.
    allowances: dict[str, float] = field(default_factory=lambda: {"bf16": 1e-1, "fp16": 1.5e-2, "q8": 2e-1})
    residual_allowances: dict[str, float] = field(default_factory=lambda: {"bf16": 3e-1, "fp16": 4e-2,
                                                                           "q8": 1.5e-1})
    # with another engine as the reference (checks/layers/versus.py): two fp32 implementations,
    # each rounding its own way over a model's depth, where no replay gives a baseline
    fp32_versus_allowance: float = 1e-4
    # DSA top-k boundaries closer than this (relative gap, reference.dsa.boundary_gap) may flip
    # in a correct engine of that class: those positions are left out like exact ties.
    indexer_tie_margins: dict[str, float] = field(default_factory=lambda: dict(INDEXER_TIE_MARGINS))
    router_min_jaccard: float = 0.95  # mean expert-set Jaccard over untied positions
    router_tie_margin: float = 1e-5  # selection scores closer than this are a tie (fp32 / fp64 engines)
    # the same for engines whose rounding moves the selection scores (O(1) sigmoid values) more
    router_tie_margins: dict[str, float] = field(default_factory=lambda: dict(ROUTER_TIE_MARGINS))
    indexer_min_overlap: float = 0.95  # mean top-k set overlap over untied positions
    scale_fit_tolerance: float = 1e-3  # |alpha - 1| below this is no scale error
    max_replays: int = 3  # layers replayed after the first diverging one when it localizes nothing
