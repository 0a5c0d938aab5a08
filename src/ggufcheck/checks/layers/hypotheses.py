"""Positive identification: the engine's block equals the reference block with ONE named change
(rope pairing, an RMS eps, a known-wrong kv_b layout, dense attention, bias-free or other-gated
routing, an integer factor). Each hypothesis is data (component, what changed, config changes,
weight transform); the matchers decide which one, if any, the engine's block is.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ggufcheck.arch.families import FAMILIES
from ggufcheck.checks.layers.metrics import near_ties, rel_errors
from ggufcheck.checks.layers.options import EPS_CANDIDATES
from ggufcheck.checks.layers.replay import Replayer
from ggufcheck.reference.weights import replace_weights


def hypotheses_attention(cfg) -> list[tuple[str, str, dict | None, Callable | None]]:
    """(component, what changed, config changes, weight transform) for the attention block."""
    from ggufcheck.sharding import faults

    out: list[tuple[str, str, dict | None, Callable | None]] = [
        ("rope", f"rope pairing {'NEOX' if cfg.rope_mode == 'norm' else 'NORM'} instead of "
                 f"{cfg.rope_mode.upper()}", {"rope_mode": "neox" if cfg.rope_mode == "norm" else "norm"}, None),
    ]
    for eps in EPS_CANDIDATES:
        if not math.isclose(eps, cfg.rms_eps, rel_tol=1e-3):
            out.append(("norm", f"RMSNorm eps {eps:g} instead of {cfg.rms_eps:.3g}", {"rms_eps": eps}, None))
    if cfg.is_mla:
        for eps in EPS_CANDIDATES:
            if not math.isclose(eps, cfg.lora_norm_eps, rel_tol=1e-3):
                out.append(("norm", f"q_a / kv_a RMSNorm eps {eps:g} instead of {cfg.lora_norm_eps:.3g} (transformers' "
                                    f"DeepSeek-V3 / GLM-DSA code hard-codes 1e-6)", {"lora_norm_eps": eps}, None))
        for tp in (2, 4, 8):
            if cfg.n_head % tp == 0:
                out.append(("mla-kv-b", f"kv_b as [all K; all V] with a patched split under TP {tp}", None,
                            faults.kv_b_layout_patch(faults.KV_B_ALL_K_THEN_V, tp)))
        out.append(("mla-kv-b", "kv_b with V rows before K rows inside each head", None,
                    faults.kv_b_layout_patch(faults.KV_B_V_THEN_K, 1)))
    if cfg.has_indexer:
        out.append(("indexer", "dense causal attention instead of the DSA top-k (indexer ignored)",
                    {"indexer_heads": 0}, None))
    if FAMILIES[cfg.arch].sinks:
        out.append(("attention", "the attention sinks (attn_sinks) left out of the softmax", None,
                    lambda c, i, w: replace_weights(w, drop=("attn_sinks.weight",))))
    if cfg.swa_window:  # gemma3's and gpt-oss's local layers
        out.append(("attention", f"global attention in the sliding-window layers (the window of {cfg.swa_window} "
                                 "positions ignored)", {"swa_window": 0}, None))
        if cfg.rope_base_swa != cfg.rope_base:
            out.append(("rope", f"the sliding-window layers rotate with the global rope base {cfg.rope_base:g} "
                                f"instead of their own {cfg.rope_base_swa:g}", {"rope_base_swa": cfg.rope_base}, None))
            out.append(("rope", f"the global layers rotate with the sliding-window rope base {cfg.rope_base_swa:g} "
                                f"instead of {cfg.rope_base:g}", {"rope_base": cfg.rope_base_swa}, None))
    return out


def hypotheses_ffn(cfg, moe_layer: bool) -> list[tuple[str, str, dict | None, Callable | None]]:
    out: list[tuple[str, str, dict | None, Callable | None]] = []
    for eps in EPS_CANDIDATES:
        if not math.isclose(eps, cfg.rms_eps, rel_tol=1e-3):
            out.append(("norm", f"RMSNorm eps {eps:g} instead of {cfg.rms_eps:.3g}", {"rms_eps": eps}, None))
    if moe_layer:
        out.append(("moe-router", "routing without the selection bias exp_probs_b", None,
                    lambda c, i, w: replace_weights(w, drop=("exp_probs_b.bias",))))
        other = "sigmoid" if cfg.gating == "softmax" else "softmax"
        how = f"{other} router gating instead of {cfg.gating}"
        if not cfg.gating_in_file:
            how += (f" (the file has no expert_gating_func: llama.cpp reads {cfg.gating}, the {cfg.arch} default; "
                    f"a model trained with {other} needs the key written)")
        out.append(("moe-router", how, {"gating": other}, None))
    return out


def integer_factor(pairs, limit: float, block: str, tp: int, bias=None) -> tuple[str | None, str | None]:
    """("sharding", how) when the engine's block output is the reference's times an integer
    factor >= 2 (within the limit after scaling): a tensor-parallel partial sum all-reduced
    twice, or summed without the division; (None, None) otherwise. ``bias`` [D]: the block's
    output bias (gpt-oss's attn_output.bias), added once after the all-reduce, so it is taken
    off both sides before the fit."""
    if not pairs:
        return None, None
    if bias is not None:
        b = bias.to(torch.float64).cpu()
        pairs = [(e - b, r - b) for e, r in pairs]
    num = sum(float((e * r).sum()) for e, r in pairs)
    den = sum(float((r * r).sum()) for _e, r in pairs)
    if den <= 0:
        return None, None
    alpha = num / den
    if not math.isfinite(alpha):
        return None, None
    k = round(alpha)
    if k < 2 or abs(alpha - k) > 1e-3 * k:
        return None, None
    if max(float(rel_errors(e, alpha * r).max()) for e, r in pairs) > limit:
        return None, None
    if k == tp:
        return "sharding", (f"its {block} output multiplied by {alpha:.4g}, the tensor-parallel size ({alpha:.4g}x "
                            f"the reference's, the tensor-parallel size {tp}): partial sums all-reduced twice, or "
                            "summed where they should be averaged")
    return "sharding", (f"its {block} output multiplied by {alpha:.4g} ({alpha:.4g}x the reference's, an integer "
                        f"factor; tensor-parallel size here {tp}): a partial sum counted {k} times")


def match_block(hyp_inputs, rep: Replayer, limit: float, hypotheses, field_name: str, margin: float = 0.0):
    """The first hypothesis under which the reference block equals the engine's (within limit)."""
    for comp, how, changes, weights in hypotheses:
        cfg = rep.ref.cfg.with_options(**changes) if changes else rep.ref.cfg
        worst = 0.0
        for _n, h_in, shared, a_eng, f_eng, h64, h_out in hyp_inputs:
            try:
                alt = rep.attention(h_in, shared, cfg=cfg, weights=weights)
            except (RuntimeError, ValueError, KeyError):  # a hypothesis that cannot run is not a match
                worst = math.inf
                break
            got, want = (h_out, alt.hidden) if field_name == "hidden" else (a_eng, alt.attn_out)
            ties = near_ties(alt, margin)
            keep = None if ties is None else ~ties
            errs = rel_errors(got, want)
            if keep is not None:
                errs = errs[keep]
            worst = max(worst, float(errs.max()) if errs.numel() else 0.0)
        if worst <= limit:
            return comp, how
    return None, None


def match_router(hyp_inputs, runs, rep: Replayer, layer: int, hypotheses, min_jaccard: float) -> str | None:
    """The first routing hypothesis under which the reference selects the engine's experts."""
    for comp, how, changes, weights in hypotheses:
        if comp != "moe-router":
            continue
        cfg = rep.ref.cfg.with_options(**changes) if changes else rep.ref.cfg
        jac, n = 0.0, 0
        for n_seq, _h_in, _shared, a_eng, _f_eng, h64, _h_out in hyp_inputs:
            eng_ids = runs[n_seq][0].tensors.get(("router", layer))
            if a_eng is None or eng_ids is None:
                return None
            ids = rep.ffn(h64 + a_eng, cfg=cfg, weights=weights)[3]
            eng_ids = torch.as_tensor(np.asarray(eng_ids)).to(torch.int64)
            for t in range(len(ids)):
                a, b = set(eng_ids[t].tolist()), set(ids[t].tolist())
                jac += len(a & b) / max(len(a | b), 1)
                n += 1
        if n and jac / n >= min_jaccard:
            return how
    return None


def match_ffn(hyp_inputs, rep: Replayer, limit: float, hypotheses):
    for comp, how, changes, weights in hypotheses:
        cfg = rep.ref.cfg.with_options(**changes) if changes else rep.ref.cfg
        worst = 0.0
        for _n, h_in, shared, a_eng, f_eng, h64, h_out in hyp_inputs:
            if a_eng is None or f_eng is None:
                worst = math.inf
                break
            alt = rep.ffn(h64 + a_eng, cfg=cfg, weights=weights)[0]
            worst = max(worst, float(rel_errors(f_eng, alt).max()))
        if worst <= limit:
            return comp, how
    return None, None
