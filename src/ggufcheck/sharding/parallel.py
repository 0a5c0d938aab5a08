"""The sharded side of the TP-invariance check: each layer kind run the way vLLM runs it.

Each function runs on one rank (inside :func:`ggufcheck.sharding.dist.run_ranks`), takes the
FULL weights of one layer by GGUF short name, cuts its own piece with a ``loader`` (normally
:func:`ggufcheck.sharding.rules.shard`; a fault injection passes a wrong one), computes its
part and joins the others through the collective vLLM uses at that point:

- attention (GQA): q / k / v column-parallel by head (kv heads replicated when TP > n_kv),
  attention on the rank's heads, o_proj row-parallel, all-reduce, bias added once;
- MLA: q_a / kv_a replicated, q_b and kv_b column-parallel by head, W_UK / W_UV split per
  rank (absorbed attention, as vLLM runs it), o_proj row-parallel, all-reduce;
- dense FFN: merged gate_up column-parallel (rank r holds [gate_r ; up_r]), down
  row-parallel, all-reduce;
- MoE: router replicated; every expert's gate / up cut on its FF dim and down on its input
  dim (TP, not expert parallelism); shared expert like the dense FFN; one all-reduce;
- embedding: vocab-parallel: out-of-range ids masked to zero, all-reduce;
- lm_head: vocab-parallel logits, all-gather, padding columns dropped;
- indexer: replicated (vLLM does not shard the DSA indexer): every rank computes the whole.

The math of one head (rope, softmax attention, absorbed MLA, SwiGLU, the router) is the
reference's (``ggufcheck.reference.layers`` / ``mla`` / ``dsa``), so a difference between the
two sides can only come from sharding. Everything runs in fp64.

Dimension letters: T tokens, D hidden, H / Hl heads (all / this rank's), G / Gl kv heads,
d head dim, P nope, R rope, V value, L latent, E experts, F / Fl FF width (all / this rank's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from ggufcheck.reference import dsa
from ggufcheck.reference import mla as ref_mla
from ggufcheck.reference.config import ReferenceConfig
from ggufcheck.reference.cache import LayerCache
from ggufcheck.reference.layers import (apply_rope, attention, causal_mask, linear, rms_norm, rope_cos_sin,
                                        rope_inv_freq, route, swiglu_oai)
from ggufcheck.sharding.dist import RankContext
from ggufcheck.sharding.mla import KV_B_RULE, VLLM_LAYOUT, KvBLayout
from ggufcheck.sharding.rules import Loader, ShardRule, rule_for, shard, vocab_range

Weights = dict[str, Tensor]


@dataclass
class LayerJob:
    """One layer kind to run sharded: its full weights, its inputs, and what it is."""

    kind: str  # "attention" | "mla" | "dense_ffn" | "moe" | "embedding" | "lm_head" | "indexer"
    layer: int | None
    weights: Weights  # FULL tensors by GGUF short name, fp64
    inputs: dict[str, Tensor]  # "x" [T, D], "pos" [T], "ids" [N]
    tensor: str = ""  # the main tensor's GGUF name, for the report
    scope: str = ""  # what part of the tensor the job holds, when not all of it (the report says)


class ExpertSubset:
    """Some experts of a stacked [E, A, B] tensor, for a MoE layer too big to load whole.

    Only the experts the router picks for the test input are read from the file; indexing
    ``[e]`` gives expert e's [A, B] (as for the full tensor), ``shape`` the full shape, so the
    reference's expert loop and the plan checks see no difference.
    """

    def __init__(self, shape: tuple[int, ...], experts: dict[int, Tensor]):
        self.shape = tuple(shape)
        self.experts = experts

    def __getitem__(self, e: int) -> Tensor:
        return self.experts[int(e)]

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return sum(t.numel() for t in self.experts.values())


@dataclass
class RunPayload:
    """Everything the ranks need for one run (every layer kind, then the collectives test)."""

    cfg: ReferenceConfig
    rules: dict[str, ShardRule]  # short GGUF name -> rule (from the arch table)
    jobs: list[LayerJob]
    loader: Loader = shard
    kv_layout: KvBLayout = VLLM_LAYOUT
    collectives: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


class _Rank:
    """A rank's view of one job: its slices (through the loader) and the collectives."""

    def __init__(self, ctx: RankContext, payload: RunPayload, job: LayerJob):
        self.ctx, self.cfg, self.job, self.loader = ctx, payload.cfg, job, payload.loader
        self.rules = payload.rules

    def piece(self, name: str) -> Tensor | None:
        full = self.job.weights.get(name)
        if full is None:
            return None
        n_kv = self.cfg.n_head_kv if not self.cfg.is_mla else 0
        return self.ctx.to(self.loader(full, rule_for(name, self.rules), self.ctx.rank, self.ctx.world_size, n_kv))

    def qkv_section(self, index: int) -> Tensor:
        """This rank's rows of section ``index`` (0 q, 1 k, 2 v) of phi3's fused attn_qkv: vLLM's
        QKVParallelLinear splits q by query heads and k, v by kv heads (replicated when TP
        exceeds them), each section by itself, never the fused whole."""
        cfg = self.cfg
        sizes = [cfg.n_head * cfg.head_dim_k, cfg.n_head_kv * cfg.head_dim_k, cfg.n_head_kv * cfg.head_dim_v]
        full = self.job.weights["attn_qkv.weight"].split(sizes, dim=0)[index]
        rule = ShardRule("column", 0, unit=cfg.head_dim_v if index == 2 else cfg.head_dim_k, kv_heads=index > 0)
        return self.ctx.to(self.loader(full, rule, self.ctx.rank, self.ctx.world_size, cfg.n_head_kv))

    def input(self, name: str) -> Tensor:
        return self.ctx.to(self.job.inputs[name])

    def rope(self) -> tuple[Tensor, Tensor]:
        cos, sin = rope_tables(self.cfg, self.job.weights, self.job.inputs["pos"])
        return self.ctx.to(cos), self.ctx.to(sin)


def rope_tables(cfg: ReferenceConfig, w: Weights, pos: Tensor) -> tuple[Tensor, Tensor]:
    """cos / sin [T, n_rot/2] for positions ``pos``, fp64, with the reference's rope rules."""
    freqs = w.get("rope_freqs.weight")
    inv = rope_inv_freq(cfg.n_rot, cfg.rope_base, cfg.yarn, freqs)
    return rope_cos_sin(pos, inv, torch.float64)


# --- layer kinds, sharded ---------------------------------------------------------------


def attention_tp(r: _Rank) -> Tensor:
    """GQA attention: column-parallel q/k/v by head, row-parallel o_proj + all-reduce -> [T, D]."""
    cfg, x = r.cfg, r.input("x")
    n_tok, tp = x.shape[0], r.ctx.world_size
    if "attn_qkv.weight" in r.job.weights:  # phi3: [q; k; v] fused, each section split by heads
        q, k, v = (linear(x, r.qkv_section(j)) for j in range(3))
    else:
        q = linear(x, r.piece("attn_q.weight"), r.piece("attn_q.bias"))  # [T, Hl*d]
        k = linear(x, r.piece("attn_k.weight"), r.piece("attn_k.bias"))  # [T, Gl*d]
        v = linear(x, r.piece("attn_v.weight"), r.piece("attn_v.bias"))  # [T, Gl*dv]
    q = q.view(n_tok, cfg.n_head // tp, cfg.head_dim_k)  # [T, Hl, d]
    k = k.view(n_tok, -1, cfg.head_dim_k)  # [T, Gl, d]
    v = v.view(n_tok, -1, cfg.head_dim_v)  # [T, Gl, dv]
    if "attn_q_norm.weight" in r.job.weights:  # per-head norms: replicated
        q = rms_norm(q, r.piece("attn_q_norm.weight"), cfg.rms_eps)
        k = rms_norm(k, r.piece("attn_k_norm.weight"), cfg.rms_eps)
    cos, sin = r.rope()
    q, k = apply_rope(q, cos, sin, cfg.rope_mode), apply_rope(k, cos, sin, cfg.rope_mode)
    pos = r.input("pos")
    o = attention(q, k, v, causal_mask(pos, pos), cfg.kq_scale, r.piece("attn_sinks.weight"))  # [T, Hl, dv]
    partial = linear(o.reshape(n_tok, -1), r.piece("attn_output.weight"))  # row-parallel: [T, D]
    out = r.ctx.all_reduce(partial)
    bias = r.job.weights.get("attn_output.bias")
    return out + r.ctx.to(bias) if bias is not None else out


def mla_tp(r: _Rank, layout: KvBLayout) -> Tensor:
    """MLA: replicated q_a / kv_a, column-parallel q_b and kv_b by head, absorbed attention
    on the rank's heads with its W_UK / W_UV, row-parallel o_proj + all-reduce -> [T, D]."""
    cfg, x = r.cfg, r.input("x")
    n_tok, tp = x.shape[0], r.ctx.world_size
    n_local = cfg.n_head // tp
    if cfg.q_lora_rank:
        qr = rms_norm(linear(x, r.piece("attn_q_a.weight")), r.piece("attn_q_a_norm.weight"), cfg.lora_norm_eps)
        q = linear(qr, r.piece("attn_q_b.weight"))  # column-parallel: [T, Hl*(P+R)]
    else:
        q = linear(x, r.piece("attn_q.weight"))
    q = q.view(n_tok, n_local, cfg.qk_nope + cfg.qk_rope)  # [T, Hl, P+R]
    q_nope, q_pe = q[..., : cfg.qk_nope], q[..., cfg.qk_nope:]
    replicated = {n: r.piece(n) for n in ("attn_kv_a_mqa.weight", "attn_kv_a_norm.weight")}
    c, k_pe = ref_mla.project_kv(cfg, replicated, x)  # [T, L], [T, 1, R]
    cos, sin = r.rope()
    q_pe = apply_rope(q_pe, cos, sin, cfg.rope_mode)
    k_pe = apply_rope(k_pe, cos, sin, cfg.rope_mode)[:, 0]  # [T, R]
    w = r.job.weights
    if "attn_k_b.weight" in w:
        kv_b = layout.rebuild(w["attn_k_b.weight"], w["attn_v_b.weight"])  # [H*(P+V), L]
    else:  # legacy file: kv_b as HF has it
        kv_b = w["attn_kv_b.weight"]
    local = r.ctx.to(r.loader(kv_b, KV_B_RULE, r.ctx.rank, tp, 0))  # [Hl*(P+V), L]
    w_uk, w_uv = layout.split(local, n_local, cfg.qk_nope, cfg.v_head)  # [L, Hl, P], [L, Hl, V]
    k_b = w_uk.permute(1, 0, 2)  # [Hl, L, P]
    v_b = w_uv.permute(1, 2, 0)  # [Hl, V, L]
    pos = r.input("pos")
    o = ref_mla.attend_absorbed(q_nope, q_pe, c, k_pe, k_b, v_b, causal_mask(pos, pos), cfg.kq_scale)  # [T, Hl, V]
    partial = linear(o.reshape(n_tok, n_local * cfg.v_head), r.piece("attn_output.weight"))  # [T, D]
    return r.ctx.all_reduce(partial)


def _merged_gate_up(r: _Rank, gate: str, up: str) -> Tensor:
    """vLLM's MergedColumnParallelLinear: this rank's [gate_r ; up_r] rows -> [2*Fl, D]."""
    return torch.cat((r.piece(gate), r.piece(up)), dim=0)


def _swiglu_partial(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """silu(gate_r x) * (up_r x) through down_r: this rank's partial sum [T, D]."""
    y = linear(x, gate_up)  # [T, 2*Fl]
    half = y.shape[-1] // 2
    return linear(torch.nn.functional.silu(y[..., :half]) * y[..., half:], down)


def dense_ffn_tp(r: _Rank) -> Tensor:
    """Dense SwiGLU: merged gate_up column-parallel, down row-parallel, all-reduce -> [T, D]."""
    x = r.input("x")
    if "ffn_gate.weight" in r.job.weights:
        gate_up = _merged_gate_up(r, "ffn_gate.weight", "ffn_up.weight")
    else:  # phi3: ffn_up is [gate; up]; its rule has two parts, each split on its own: [gate_r; up_r]
        gate_up = r.piece("ffn_up.weight")
    partial = _swiglu_partial(x, gate_up, r.piece("ffn_down.weight"))
    return r.ctx.all_reduce(partial)


def _expert_piece(r: _Rank, name: str, e: int) -> Tensor:
    """This rank's piece of expert ``e`` of a stacked tensor (the rule's dims are [E, ...])."""
    one = r.job.weights[name][e][None]  # [1, A, B]
    return r.ctx.to(r.loader(one, rule_for(name, r.rules), r.ctx.rank, r.ctx.world_size, 0)[0])


def moe_tp(r: _Rank) -> Tensor:
    """Routed experts + shared expert under TP: one all-reduce of all partials -> [T, D]."""
    cfg, x = r.cfg, r.input("x")
    gate_inp, bias = r.piece("ffn_gate_inp.weight"), r.piece("exp_probs_b.bias")
    ids, weights = route(x, gate_inp, bias, cfg, r.piece("ffn_gate_inp.bias"))  # replicated: the same on every rank
    fused = "ffn_gate_up_exps.weight" in r.job.weights
    partial = torch.zeros_like(x)
    if cfg.ffn_act == "swiglu_oai":  # gpt-oss: biased experts, the clamped SwiGLU
        return r.ctx.all_reduce(_oai_experts_partial(r, x, ids, weights))
    for e in torch.unique(ids).tolist():
        if fused:
            gate_up = _expert_piece(r, "ffn_gate_up_exps.weight", e)  # [2*Fl, D]: [gate_r ; up_r]
        else:
            gate_up = torch.cat((_expert_piece(r, "ffn_gate_exps.weight", e),
                                 _expert_piece(r, "ffn_up_exps.weight", e)))  # [2*Fl, D]
        down = _expert_piece(r, "ffn_down_exps.weight", e)  # [D, Fl]
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        y = _swiglu_partial(x[tok], gate_up, down)  # [n, D]
        partial.index_add_(0, tok, y * weights[tok, slot, None])
    if "ffn_gate_shexp.weight" in r.job.weights:
        shared = _merged_gate_up(r, "ffn_gate_shexp.weight", "ffn_up_shexp.weight")
        partial = partial + _swiglu_partial(x, shared, r.piece("ffn_down_shexp.weight"))
    return r.ctx.all_reduce(partial)


def _oai_experts_partial(r: _Rank, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """gpt-oss's experts on this rank's FF slice: gate / up rows and their biases
    column-parallel, down row-parallel; the down bias is added by rank 0 only (once after the
    all-reduce). The clamped SwiGLU is elementwise, so it runs on the slice as on the whole."""
    partial = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = x[tok]
        g = linear(xe, _expert_piece(r, "ffn_gate_exps.weight", e), _expert_piece(r, "ffn_gate_exps.bias", e))
        u = linear(xe, _expert_piece(r, "ffn_up_exps.weight", e), _expert_piece(r, "ffn_up_exps.bias", e))
        y = linear(swiglu_oai(g, u), _expert_piece(r, "ffn_down_exps.weight", e))
        if r.ctx.rank == 0:
            y = y + r.ctx.to(r.job.weights["ffn_down_exps.bias"][e])
        partial.index_add_(0, tok, y * weights[tok, slot, None])
    return partial


def embedding_tp(r: _Rank) -> dict[str, Tensor]:
    """Vocab-parallel lookup: ids outside this rank's range give zeros; all-reduce -> [N, D].

    Also returns this rank's padding rows' largest magnitude (they must be exactly zero).
    """
    name = "token_embd.weight"
    full = r.job.weights[name]
    ids = r.input("ids")
    local = r.piece(name)  # [per, D]
    first, last, _ = vocab_range(full.shape[0], r.ctx.rank, r.ctx.world_size)
    mine = (ids >= first) & (ids < last)
    rows = local[torch.where(mine, ids - first, 0)]  # [N, D]
    rows = rows * mine[:, None].to(rows.dtype)
    return {"out": r.ctx.all_reduce(rows), "padding_max": local[last - first:].abs().amax().reshape(1)
            if local.shape[0] > last - first else torch.zeros(1, dtype=local.dtype)}


def lm_head_tp(r: _Rank) -> dict[str, Tensor]:
    """Vocab-parallel logits: each rank's [T, per], all-gathered, padding dropped -> [T, vocab]."""
    name = "output.weight" if "output.weight" in r.job.weights else "token_embd.weight"
    vocab = r.job.weights[name].shape[0]
    x = r.input("x")
    logits = r.ctx.all_gather(linear(x, r.piece(name)), dim=-1)  # [T, padded]
    return {"out": logits[:, :vocab], "padding_max": logits[:, vocab:].abs().amax().reshape(1)
            if logits.shape[1] > vocab else torch.zeros(1, dtype=logits.dtype)}


def indexer_tp(r: _Rank) -> dict[str, Tensor]:
    """The DSA indexer, replicated: every rank computes all scores and the top-k itself."""
    cfg = r.cfg
    names = [n for n in r.job.weights if n.startswith("indexer.")]
    w = {n: r.piece(n) for n in names}
    x, qr, pos = r.input("x"), r.input("qr"), r.input("pos")
    scores = dsa.index_scores(cfg, w, x, qr, r.rope(), pos, pos, LayerCache())  # [T, T]
    return {"out": scores, "topk": dsa.select_top_k(scores, cfg.indexer_top_k)}


KINDS: dict[str, Callable[..., Any]] = {
    "attention": attention_tp,
    "mla": mla_tp,
    "dense_ffn": dense_ffn_tp,
    "moe": moe_tp,
    "embedding": embedding_tp,
    "lm_head": lm_head_tp,
    "indexer": indexer_tp,
}


def run_job(ctx: RankContext, payload: RunPayload, job: LayerJob) -> dict[str, Any]:
    """One job on one rank: its outputs and ``partials``, the local inputs of its collectives."""
    ctx.record = []
    try:
        r = _Rank(ctx, payload, job)
        value = mla_tp(r, payload.kv_layout) if job.kind == "mla" else KINDS[job.kind](r)
        if isinstance(value, Tensor):
            value = {"out": value}
        value["partials"] = ctx.record
        return value
    finally:
        ctx.record = None


def rank_run(ctx: RankContext, payload: RunPayload) -> dict[str, Any]:
    """Everything one rank does in a run: every job, in order, then the collectives test.

    A job that raises (on every rank alike: shapes come from the same file) is reported as
    that job's error; the run goes on with the next one.
    """
    import traceback

    out: dict[str, Any] = {"jobs": []}
    for job in payload.jobs:
        try:
            out["jobs"].append(run_job(ctx, payload, job))
        except Exception as err:  # noqa: BLE001 - becomes an ERROR result naming the job
            out["jobs"].append({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
    if payload.collectives:
        from ggufcheck.sharding.collectives import rank_collectives

        out["collectives"] = rank_collectives(ctx)
    return out
