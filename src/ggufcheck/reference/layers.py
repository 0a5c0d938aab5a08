"""Shared primitives of the reference forward pass: norms, RoPE, attention, SwiGLU, MoE.

Deliberately naive (docs/architectures.md sec 1-3, style.md principle 3): every function is a
few lines of einsum / matmul in the caller's working dtype (fp32 or fp64), with no fused
kernels and no in-place tricks, so a reader can check it against the spec line by line.

Dimension letters: T query tokens, S key tokens, H query heads, G kv heads (Hkv),
d head dim, D hidden, E experts, K experts per token, F ffn width.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import torch
from torch import Tensor

from ggufcheck.reference.config import ReferenceConfig, YarnConfig
from ggufcheck.reference.precision import current as current_emulation
from ggufcheck.reference.precision import (gelu_tanh, linear_f16_sums, linear_f16_vector_sums, round_as,
                                          round_tf32, truncate_tf32, unrounded_sums_error)
from ggufcheck.reference.weights import ExpertStack, RowBlocked

# --- norms ---------------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last dim, in x's dtype (fp32 or fp64)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim (biased variance, like torch and ggml)."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps) * weight
    return y + bias if bias is not None else y


# --- RoPE ----------------------------------------------------------------------------


def rope_inv_freq(
    n_rot: int, base: float, yarn: YarnConfig | None = None, freq_factors: Tensor | None = None
) -> Tensor:
    """theta_i / p for i < n_rot/2, in float64 (docs/architectures.md sec 2, YaRN included)."""
    i = torch.arange(n_rot // 2, dtype=torch.float64)
    inv_freq = base ** (-2.0 * i / n_rot)  # [n_rot/2]
    if freq_factors is not None:  # llama-3 style rope_freqs.weight: theta_i /= rope_freqs[i]
        inv_freq = inv_freq / freq_factors.to(torch.float64).cpu()
    if yarn is not None:

        def corr(n_rotations: float) -> float:
            return n_rot * math.log(yarn.original_context / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(0.0, math.floor(corr(yarn.beta_fast)))
        high = min(n_rot - 1.0, math.ceil(corr(yarn.beta_slow)))
        ramp = ((i - low) / max(0.001, high - low)).clamp(0, 1)
        mix = 1 - ramp  # 1: keep the base frequency (extrapolate), 0: interpolate by 1/F
        inv_freq = inv_freq * ((1 / yarn.factor) * (1 - mix) + mix)
    return inv_freq


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of p * theta_i: [T, n_rot/2] each, angles computed in float64."""
    angles = positions.to(torch.float64).cpu()[:, None] * inv_freq[None, :]  # [T, n_rot/2]
    device = positions.device
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, mode: str) -> Tensor:
    """Rotate the first n_rot = 2 * cos.shape[-1] dims of x [T, H, d]; the rest pass through.

    ``mode`` "norm" pairs (x[2i], x[2i+1]) (ggml mode 0, interleaved); "neox" pairs
    (x[i], x[i + n_rot/2]). Each pair (a, b) -> (a cos - b sin, a sin + b cos).
    """
    half = cos.shape[-1]
    n_rot = 2 * half
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, n_rot/2]
    if mode == "norm":
        a, b = rot[..., 0::2], rot[..., 1::2]  # [T, H, n_rot/2] each
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)  # [T, H, n_rot]
    elif mode == "neox":
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)  # [T, H, n_rot]
    else:
        raise ValueError(f"unknown rope mode {mode!r}")
    return torch.cat((out, rest), dim=-1)


# --- attention -----------------------------------------------------------------------

SCORES_BYTES = 256 << 20  # attention scores above this are computed a block at a time


def blocks_of(n: int, bytes_each: int) -> list[slice]:
    """Slices of ``n`` heads (or query rows) such that each block's scores stay under
    SCORES_BYTES; one slice when all fit. Per head, a block computes the same matrix products
    as the whole, so the values are exactly the same (blocks of query rows are too, except
    blocks of very few rows, where BLAS may take another kernel: only the DSA indexer, whose
    scores are summed over heads, is blocked by rows)."""
    per_block = max(1, SCORES_BYTES // max(1, bytes_each))
    if per_block >= n:
        return [slice(0, n)]
    return [slice(s, min(s + per_block, n)) for s in range(0, n, per_block)]



def causal_mask(q_pos: Tensor, k_pos: Tensor, window: int = 0) -> Tensor:
    """[T, S] bool, True where query t may see key s (k_pos[s] <= q_pos[t]); with a sliding
    ``window`` > 0 only the keys with q_pos[t] - k_pos[s] < window (llama.cpp
    LLAMA_SWA_TYPE_STANDARD, transformers' sliding_window mask)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
    return allowed


def attention(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, sinks: Tensor | None = None
) -> Tensor:
    """Softmax attention: q [T, H, d], k [S, G, d], v [S, G, dv], allowed [T, S] -> [T, H, dv].

    GQA: query head h reads kv head h // (H / G). Softmax in the working dtype (>= fp32).
    ``sinks`` [H] (gpt-oss): one more logit per head in every row's softmax, with no value
    (it only takes probability mass away from the keys).
    """
    n_head, n_kv = q.shape[1], k.shape[1]
    group = n_head // n_kv
    k = k.repeat_interleave(group, dim=1)  # [S, H, d]
    v = v.repeat_interleave(group, dim=1)  # [S, H, dv]
    blocks = blocks_of(n_head, q.shape[0] * k.shape[0] * q.element_size())  # [Hb, T, S] scores per block
    if len(blocks) > 1:
        return torch.cat([_attend(q[:, b], k[:, b], v[:, b], allowed, scale, None if sinks is None else sinks[b])
                          for b in blocks], dim=1)
    return _attend(q, k, v, allowed, scale, sinks)


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, sinks: Tensor | None) -> Tensor:
    """:func:`attention` after the kv heads are expanded: k, v [S, H, d]."""
    # in place: the same products and the same masking, one [H, T, S] tensor alive instead of three
    scores = torch.einsum("thd,shd->hts", q, k).mul_(scale)  # [H, T, S]
    scores.masked_fill_(~allowed[None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)  # [H, T, 1]
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)  # [T, H, dv]


# --- feed-forward --------------------------------------------------------------------


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [.., in] @ W[out, in].T (+ b): the GGUF [out, in] layout is torch's Linear layout.
    (Rounded as an engine's class would, while the reference emulates one: precision.py.)"""
    if isinstance(weight, RowBlocked):  # too big to hold whole: a row block at a time (exact per column)
        out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        for start, block in weight.blocks():
            stop = start + block.shape[0]
            out[..., start:stop] = linear(x, block, None if bias is None else bias[start:stop])
        return out
    emulation = current_emulation()
    if emulation is None:
        return torch.nn.functional.linear(x, weight, bias)
    float_form = emulation.float_form(weight)  # ggml-cuda's tensor-core paths for F32 / F16 weights
    if float_form == "tf32":
        return torch.nn.functional.linear(round_tf32(x), round_tf32(weight), bias)
    if float_form == "tf32-rz":
        return torch.nn.functional.linear(truncate_tf32(x), truncate_tf32(weight), bias)
    if float_form == "f16-sums":
        return linear_f16_sums(x, weight, bias)
    if float_form == "f16-vector-sums":
        return linear_f16_vector_sums(x, weight, bias)
    if float_form == "vector":  # ggml's f32 vector kernel: the weights' own values, nothing else rounds
        return torch.nn.functional.linear(x, weight, bias)
    if float_form == "mma":  # f16 / bf16 operands on the tensor cores, f32 sums and result
        kind = "bf16" if getattr(weight, "ggml_type", None) == "BF16" else "f16"
        return torch.nn.functional.linear(round_as(x, kind), weight, bias)
    form = emulation.sums_form(weight)  # a CUDA q8_1 form that reads this weight's group offsets
    kind = emulation.activations
    if form is not None and form.scale_block == 64 and kind in ("q8_0", "q8_k"):
        kind = "q8_64"  # Q2_K's matrix-matrix kernels: one 8-bit scale per 64 activations
    rounded = round_as(x, kind)
    y = torch.nn.functional.linear(rounded, weight, bias)
    if form is not None and kind is not None:
        error = unrounded_sums_error(x, rounded, weight, form)
        if error is not None:
            y = y - error
    return round_as(y, emulation.outputs)


def _glu(gate: Tensor, up: Tensor) -> None:
    """Tag ``gate`` and ``up`` as multiplied with a GLU: a CUDA engine fuses the three on one
    token (precision.Emulation.float_form)."""
    for w in (gate, up):
        if isinstance(w, Tensor):
            w.ggml_glu = True


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """``down(silu(gate(x)) * up(x))``; gate/up [F, D], down [D, F]."""
    _glu(gate, up)
    return linear(torch.nn.functional.silu(linear(x, gate)) * linear(x, up), down)


def geglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """``down(gelu_tanh(gate(x)) * up(x))`` (gemma's FFN: transformers gelu_pytorch_tanh,
    llama.cpp LLM_FFN_GELU + LLM_FFN_PAR); gate/up [F, D], down [D, F]."""
    _glu(gate, up)
    return linear(gelu_tanh(linear(x, gate)) * linear(x, up), down)


def _selection(x: Tensor, gate_inp: Tensor, bias: Tensor | None,
               cfg: ReferenceConfig, gate_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The router's scores: (probs [T, E], selection scores [T, E] with the experts of dropped
    groups at -inf, group gap [T] or None). Probabilities from softmax or sigmoid; the bias
    only steers SELECTION; groups keep their top ``n_group_used`` by the sum of their top-2
    biased scores; the group gap is the weakest kept group's score minus the best dropped one's."""
    logits = linear(x, gate_inp, gate_bias)  # [T, E] (gpt-oss's router linear has a bias)
    probs = torch.softmax(logits, dim=-1) if cfg.gating == "softmax" else torch.sigmoid(logits)
    select = probs + bias if bias is not None else probs  # [T, E]
    group_gap = None
    if cfg.n_group > 1:
        n_tok = select.shape[0]
        grouped = select.view(n_tok, cfg.n_group, cfg.n_expert // cfg.n_group)  # [T, G, E/G]
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = group_score.topk(cfg.n_group_used, dim=-1).indices  # [T, Gu]
        group_ok = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, keep, True)  # [T, G]
        if cfg.n_group_used < cfg.n_group:  # a tie there flips a whole group
            group_gap = (group_score.gather(1, keep).min(-1).values
                         - group_score.masked_fill(group_ok, float("-inf")).max(-1).values)
        expert_ok = group_ok[:, :, None].expand_as(grouped).reshape(n_tok, cfg.n_expert)  # [T, E]
        select = select.masked_fill(~expert_ok, float("-inf"))
    return probs, select, group_gap


def route(x: Tensor, gate_inp: Tensor, bias: Tensor | None, cfg: ReferenceConfig,
          gate_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The MoE router (docs/architectures.md sec 3): x [T, D] -> (expert ids [T, K], weights [T, K]).

    Experts chosen by their selection scores (:func:`_selection`); weights are gathered from
    the UNBIASED probabilities, optionally normalized, scaled once.
    """
    probs, select, _ = _selection(x, gate_inp, bias, cfg, gate_bias)
    ids = select.topk(cfg.n_expert_used, dim=-1).indices  # [T, K]
    weights = probs.gather(1, ids)  # [T, K]
    if cfg.expert_weights_norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
    return ids, weights * cfg.expert_weights_scale


def router_gap(x: Tensor, gate_inp: Tensor, bias: Tensor | None, cfg: ReferenceConfig, ids: Tensor,
               gate_bias: Tensor | None = None) -> Tensor:
    """[T] the routing's margin: the weakest chosen expert's selection score minus the best
    unchosen eligible one's, or the group gap where that is smaller."""
    _, select, group_gap = _selection(x, gate_inp, bias, cfg, gate_bias)
    chosen = select.gather(1, ids).min(dim=-1).values
    rest = select.scatter(1, ids, float("-inf")).max(dim=-1).values
    gap = chosen - rest
    if group_gap is not None:
        gap = torch.minimum(gap, group_gap)
    return gap.to(torch.float64)


# gpt-oss's clamped SwiGLU (llama.cpp ggml_swiglu_oai in build_moe_ffn, transformers
# GptOssExperts._apply_gate): its alpha and limit are constants of the model, not GGUF keys
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai(gate: Tensor, up: Tensor) -> Tensor:
    """gpt-oss's clamped SwiGLU on the gate / up projections (elementwise: a TP slice of the FF
    dim gives the same values as the whole): ``(clamp(up, +-L) + 1) * g * sigmoid(alpha g)``,
    ``g = min(gate, L)``."""
    g = gate.clamp(max=SWIGLU_OAI_LIMIT)
    return g * torch.sigmoid(SWIGLU_OAI_ALPHA * g) * (up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1)


def moe(x: Tensor, ids: Tensor, weights: Tensor, gate_exps: Tensor, up_exps: Tensor, down_exps: Tensor,
        biases: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None), act: str = "silu") -> Tensor:
    """sum_k w_k * expert_{ids_k}(x): an explicit loop over the experts that were chosen.

    x [T, D]; ids, weights [T, K]; gate/up_exps [E, F, D]; down_exps [E, D, F] -> [T, D].
    ``biases`` (gate [E, F], up [E, F], down [E, D]) and ``act`` "swiglu_oai": gpt-oss's
    experts, ``(clamp(up, +-L) + 1) * g * sigmoid(alpha g)`` with ``g = min(gate, L)``.
    """
    out = torch.zeros_like(x)
    b_gate, b_up, b_down = biases
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)  # tokens that chose e, and where
        gate, up, down = (_expert(stack, e) for stack in (gate_exps, up_exps, down_exps))
        if act == "swiglu_oai":
            _glu(gate, up)
            xe = x[tok]
            g = linear(xe, gate, None if b_gate is None else b_gate[e])
            u = linear(xe, up, None if b_up is None else b_up[e])
            y = linear(swiglu_oai(g, u), down, None if b_down is None else b_down[e])  # [n, D]
        else:
            y = swiglu(x[tok], gate, up, down)  # [n, D]
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def _expert(stack, e: int) -> Tensor:
    """Expert ``e``'s matrix of a stacked expert tensor, tagged as a routed expert's (an
    emulated engine multiplies those with its mul_mat_id kernels: precision.Emulation.float_form)
    and with the stack's stored type (a slice of a resident stack does not carry it)."""
    w = stack[e]
    kind = getattr(w, "ggml_type", None) or getattr(stack, "ggml_type", None)
    if kind is not None:
        w.ggml_type = kind
    w.ggml_expert = True
    return w


def moe_block(cfg: ReferenceConfig, w: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Routed experts plus the unweighted shared expert: x [T, D] -> (out [T, D], ids, weights)."""
    parts = ffn_block(cfg, w, x, moe_layer=True)
    return parts.out, parts.ids, parts.weights


@dataclass
class FFNParts:
    """One layer's FFN / MoE block on its normed input: the sum and, for MoE, its parts."""

    out: Tensor  # [T, D]
    routed: Tensor | None = None  # [T, D] the weighted routed experts
    shared: Tensor | None = None  # [T, D] the shared expert
    ids: Tensor | None = None  # [T, k] chosen experts
    weights: Tensor | None = None  # [T, k] their weights
    gap: Tensor | None = None  # [T] router_gap: how close the routing is to another choice


def ffn_block(cfg: ReferenceConfig, w: dict[str, Tensor], x: Tensor, moe_layer: bool) -> FFNParts:
    """The FFN of a layer on normed x [T, D]: SwiGLU (GeGLU and its post-norm for gemma),
    or routed experts plus the unweighted shared expert. The families' forward_layer and the layers stage's replay both call this,
    so a replay computes exactly what the reference does.

    Stacked expert tensors as GGUF stores them: ``ffn_gate_exps`` / ``ffn_up_exps`` [E, F, D]
    (or fused ``ffn_gate_up_exps`` [E, 2F, D]: gate rows first), ``ffn_down_exps`` [E, D, F].
    """
    if not moe_layer:
        act = geglu if cfg.ffn_act == "gelu_tanh" else swiglu
        if "ffn_gate.weight" in w:
            gate, up = w["ffn_gate.weight"], w["ffn_up.weight"]
        else:  # phi3: ffn_up holds [gate rows; up rows] (llama.cpp LLM_FFN_SWIGLU on the fused output)
            gate, up = w["ffn_up.weight"].chunk(2, dim=0)
        out = act(x, gate, up, w["ffn_down.weight"])
        if "post_ffw_norm.weight" in w:  # gemma: the block's output is normed before the residual add
            out = rms_norm(out, w["post_ffw_norm.weight"], cfg.rms_eps)
        return FFNParts(out=out)
    gate_bias = w.get("ffn_gate_inp.bias")
    ids, weights = route(x, w["ffn_gate_inp.weight"], w.get("exp_probs_b.bias"), cfg, gate_bias)
    if "ffn_gate_up_exps.weight" in w:
        gate_up = w["ffn_gate_up_exps.weight"]  # [E, 2F, D]
        if isinstance(gate_up, ExpertStack):  # read per expert: each half's rows only
            gate, up = gate_up.part(0, cfg.n_ff_exp), gate_up.part(cfg.n_ff_exp, 2 * cfg.n_ff_exp)
        else:
            gate, up = gate_up[:, : cfg.n_ff_exp], gate_up[:, cfg.n_ff_exp :]  # [E, F, D] each
    else:
        gate, up = w["ffn_gate_exps.weight"], w["ffn_up_exps.weight"]
    biases = (w.get("ffn_gate_exps.bias"), w.get("ffn_up_exps.bias"), w.get("ffn_down_exps.bias"))
    routed = moe(x, ids, weights, gate, up, w["ffn_down_exps.weight"], biases, cfg.ffn_act)
    shared = None
    if "ffn_gate_shexp.weight" in w:
        shared = swiglu(x, w["ffn_gate_shexp.weight"], w["ffn_up_shexp.weight"], w["ffn_down_shexp.weight"])
    gap = router_gap(x, w["ffn_gate_inp.weight"], w.get("exp_probs_b.bias"), cfg, ids, gate_bias)
    return FFNParts(out=routed if shared is None else routed + shared, routed=routed, shared=shared, ids=ids,
                    weights=weights, gap=gap)
