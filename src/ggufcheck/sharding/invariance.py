"""Numeric TP invariance: each layer kind sharded over N ranks == the same layer unsharded.

On the file's real dequantized weights (fp64) and one fixed random input per kind, the
unsharded side is the reference (``ggufcheck.reference``: dense / mla / dsa / layers), the
sharded side :mod:`ggufcheck.sharding.parallel` run by N processes
(:mod:`ggufcheck.sharding.dist`). All kinds and the collectives self-test share ONE run
(process start-up is the cost). The checks (:mod:`ggufcheck.checks.sharding.invariance`)
name per kind the worst rank and element.

Tolerance (declared here, style principle 8): in fp64 the two sides differ only by the
order of summation (partial sums per rank, then the all-reduce), so
``max|sharded - unsharded| <= RTOL * max(1, max|unsharded|)`` with RTOL = 1e-9: a
thousand times the worst rounding of a 10^4-term fp64 sum, and a billion times smaller than
any real sharding error (those are O(1) relative). The indexer's top-k must be identical
as sets per query.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor

from ggufcheck.reference import dense, dsa
from ggufcheck.reference import mla as ref_mla
from ggufcheck.reference.cache import LayerCache
from ggufcheck.reference.config import ReferenceConfig
from ggufcheck.reference.layers import causal_mask, linear, moe_block, rms_norm, route, swiglu
from ggufcheck.sharding.dist import DistOptions, LocalContext, RanksFailed, resolve_backend, run_ranks
from ggufcheck.sharding.mla import VLLM_LAYOUT, KvBLayout
from ggufcheck.sharding.parallel import ExpertSubset, LayerJob, RunPayload, rank_run, rope_tables, run_job
from ggufcheck.sharding.plan import kind_problems
from ggufcheck.sharding.rules import Loader, ShardRule, pad_vocab, shard

RTOL = 1e-9
START_POS = 37  # positions far from 0: at position 0 every rope is the identity


@dataclass
class InvarianceOptions:
    tp: int
    backend: str = "auto"
    timeout_s: float = 180.0
    tokens: int = 6  # more for the indexer: top_k + 4
    seed: int = 0
    loader: Loader = shard
    kv_layout: KvBLayout = VLLM_LAYOUT
    kinds: tuple[str, ...] | None = None  # None: every kind the model has
    collectives: bool = True
    start_method: str | None = None  # None: fork for gloo on Linux, spawn for NCCL (dist.py)
    max_layer_elements: int = 400_000_000  # skip a kind whose fp64 weights would exceed ~3 GiB
    vocab_columns: int = 256  # an embedding / lm_head over that budget: every row's first columns
    # kinds left out while building the jobs, as (kind, layer, why): facts the checks report
    not_run: list[tuple[str, int | None, str]] = field(default_factory=list)


# --- building the jobs ----------------------------------------------------------------------


def make_jobs(cfg: ReferenceConfig, layer_weights: Any, opts: InvarianceOptions) -> list[LayerJob]:
    """Every job of :func:`iter_jobs` at once (small models and tests)."""
    return list(iter_jobs(cfg, layer_weights, opts))


def iter_jobs(cfg: ReferenceConfig, layer_weights: Any, opts: InvarianceOptions) -> Iterator[LayerJob]:
    """One job per layer kind the model has, each read when the previous one is done with
    (a run holds one kind's weights at a time). ``layer_weights(layer | None, prefixes)``
    returns fp64 full tensors by short name (layer None: the global tensors)."""
    gen = torch.Generator().manual_seed(opts.seed)
    # the indexer's top-k needs more keys than top_k (GLM-5: 2048 + 4); every other kind runs
    # on the first ``opts.tokens`` of the same rows (its math has no threshold in T, and at
    # GLM-5's dims 2052 tokens cost each rank ~1 GiB of MLA scores for nothing)
    n_index = max(opts.tokens, cfg.indexer_top_k + 4 if cfg.has_indexer else 0)
    pos_index = torch.arange(START_POS, START_POS + n_index)
    x_index = torch.randn(n_index, cfg.n_embd, generator=gen, dtype=torch.float64)
    x, pos = x_index[: opts.tokens], pos_index[: opts.tokens]
    wanted = opts.kinds

    def want(kind: str) -> bool:
        return wanted is None or kind in wanted

    def vocab_weights(kind: str, prefixes: tuple[str, ...]) -> tuple[dict[str, Tensor], str] | None:
        return _vocab_weights(layer_weights, opts, kind, prefixes)

    def weights(kind: str, layer: int | None, prefixes: tuple[str, ...]) -> dict[str, Tensor] | None:
        try:
            return layer_weights(layer, prefixes)
        except LayerTooLarge as err:
            opts.not_run.append((kind, layer, f"not run: {err}"))
            return None

    attn_names = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "rope_freqs") if not cfg.is_mla \
        else ("attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_q.", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b",
              "attn_v_b", "attn_kv_b", "attn_output")
    kind = "mla" if cfg.is_mla else "attention"
    if want(kind) and (w := weights(kind, 0, attn_names)) is not None:
        yield LayerJob(kind, 0, w, {"x": x, "pos": pos}, tensor="blk.0.attn_output.weight")
        w = None  # released before the next kind is read
    dense_layer = 0 if (not cfg.n_expert or cfg.n_dense_lead > 0) else None
    if want("dense_ffn") and dense_layer is not None:
        w = weights("dense_ffn", dense_layer, ("ffn_gate.", "ffn_up.", "ffn_down."))
        if w:
            yield LayerJob("dense_ffn", dense_layer, w, {"x": x, "pos": pos},
                           tensor=f"blk.{dense_layer}.ffn_down.weight")
            w = None  # released before the next kind is read
    if want("moe") and cfg.n_expert and cfg.n_dense_lead < cfg.n_layer:
        moe_layer = cfg.n_dense_lead
        try:
            w = layer_weights(moe_layer, ("ffn_gate_inp", "exp_probs_b", "ffn_gate_exps", "ffn_up_exps",
                                          "ffn_gate_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp",
                                          "ffn_down_shexp"))
        except LayerTooLarge as err:  # too big whole: the router's choices for x decide what is read
            w, x_moe = None, x
            if hasattr(layer_weights, "experts"):
                w, x_moe = _routed_expert_weights(cfg, layer_weights, moe_layer, x, opts.max_layer_elements)
            if w is None:
                why = f"{err}, and so do the experts routed for a single token" if hasattr(layer_weights, "experts") \
                    else str(err)
                opts.not_run.append(("moe", moe_layer, f"not run: {why}"))
        else:
            x_moe = x
        if w is not None:
            yield LayerJob("moe", moe_layer, w, {"x": x_moe, "pos": pos[: x_moe.shape[0]]},
                           tensor=f"blk.{moe_layer}.ffn_down_exps.weight")
            w = None  # released before the next kind is read
    if want("indexer") and cfg.has_indexer:
        w = weights("indexer", 0, ("indexer.", "attn_q_a", "rope_freqs"))
        if w is not None and "indexer.attn_k.weight" in w:
            qr = rms_norm(linear(x_index, w.pop("attn_q_a.weight")), w.pop("attn_q_a_norm.weight"),
                          cfg.lora_norm_eps)
            yield LayerJob("indexer", 0, w, {"x": x_index, "qr": qr, "pos": pos_index},
                           tensor="blk.0.indexer.attn_k.weight")
            w = None  # released before the next kind is read
    if want("embedding") and (got := vocab_weights("embedding", ("token_embd",))) is not None:
        w, scope = got
        ids = _vocab_probe_ids(w["token_embd.weight"].shape[0], opts.tp, gen)
        yield LayerJob("embedding", None, w, {"ids": ids, "pos": pos}, tensor="token_embd.weight", scope=scope)
        got = w = None  # released before the next kind is read
    if want("lm_head") and (got := vocab_weights("lm_head", ("output.",))) is not None:
        w, scope = got
        if not w:  # tied embeddings: the lm_head is token_embd
            w, scope = vocab_weights("lm_head", ("token_embd",)) or (None, "")
        if w is not None:
            (name,) = w
            cols = w[name].shape[1]
            yield LayerJob("lm_head", None, w, {"x": x[:, :cols], "pos": pos}, tensor=name, scope=scope)
            got = w = None  # released before the next kind is read


def _vocab_weights(layer_weights: Any, opts: InvarianceOptions, kind: str,
                   prefixes: tuple[str, ...]) -> tuple[dict[str, Tensor], str] | None:
    """The embedding's or lm_head's tensor, and what part of it the job holds.

    Whole when it fits the budget. Else (GLM-5: 154880 x 6144, 7.6 GB in fp64) every row's
    first ``opts.vocab_columns`` columns, read in row blocks: the vocab-parallel split cuts
    rows only (each rank a row range, padding rows past the vocabulary), so a rank holding
    the wrong rows, an off-by-one range or non-zero padding shows in any column; what the
    columns cannot show (a fault inside a row) is the weights audit's to find. None (with a
    not-run fact) when even that does not fit or the weights cannot be read in columns."""
    try:
        return layer_weights(None, prefixes), ""
    except LayerTooLarge as err:
        names = layer_weights.names(None, prefixes) if hasattr(layer_weights, "columns") else []
        if len(names) == 1:
            short, info = names[0]
            rows, width = info.shape[0], info.shape[-1]
            cols = min(width, opts.vocab_columns)
            if rows * cols <= opts.max_layer_elements:
                scope = (f"the first {cols} of {width} columns of all {rows:,} rows: the vocab split cuts rows "
                         f"only, and the whole tensor ({err.n_elements:,} weights in fp64) exceeds the CPU budget")
                return {short: layer_weights.columns(info.name, cols)}, scope
        opts.not_run.append((kind, None, f"not run: {err}"))
        return None


def _routed_expert_weights(cfg: ReferenceConfig, layer_weights: Any, layer: int, x: Tensor,
                           budget: int) -> tuple[dict[str, Any] | None, Tensor]:
    """A MoE layer's router and shared expert whole, routed experts only where ``x`` goes.

    Uses the longest prefix of ``x`` whose chosen experts fit ``budget`` elements (at least
    one token); returns (weights, that prefix), or (None, x) when one token is too many.
    """
    w: dict[str, Any] = layer_weights(layer, ("ffn_gate_inp", "exp_probs_b", "ffn_gate_shexp", "ffn_up_shexp",
                                              "ffn_down_shexp"))
    ids, _ = route(x, w["ffn_gate_inp.weight"], w.get("exp_probs_b.bias"), cfg)  # [T, K]
    names = [n for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_up_exps.weight",
                         "ffn_down_exps.weight") if layer_weights.expert_elements(layer, n)]
    per_expert = sum(layer_weights.expert_elements(layer, n) for n in names)
    n_tok = x.shape[0]
    while n_tok > 0 and len(set(ids[:n_tok].flatten().tolist())) * per_expert + sum(t.numel() for t in w.values()) > budget:
        n_tok -= 1
    if n_tok == 0:
        return None, x
    used = sorted(set(ids[:n_tok].flatten().tolist()))
    for name in names:
        w[name] = layer_weights.experts(layer, name, used)
    return w, x[:n_tok]


def _vocab_probe_ids(vocab: int, tp: int, gen: torch.Generator) -> Tensor:
    """Ids at both edges of every rank's vocab range, plus a few random ones: [N] int64."""
    per = pad_vocab(vocab) // tp if pad_vocab(vocab) % tp == 0 else max(1, vocab // tp)
    edges = {0, vocab - 1}
    for r in range(1, tp):
        edges.update(i for i in (r * per - 1, r * per) if 0 <= i < vocab)
    edges.update(torch.randint(0, vocab, (8,), generator=gen).tolist())
    return torch.tensor(sorted(edges), dtype=torch.int64)


class LayerTooLarge(Exception):
    """A layer kind's weights would not fit the CPU budget in fp64: the kind is skipped."""

    def __init__(self, n_elements: int, budget: int):
        self.n_elements, self.budget = n_elements, budget
        super().__init__(f"{n_elements:,} weights in fp64 exceed the CPU budget of {budget:,} elements")


class GGUFLayerWeights:
    """``weights(layer, prefixes)`` over an open GGUF: dequantized full tensors by short name
    (``blk.{layer}.`` removed; layer None = global tensors; ``rope_freqs`` is global). Raises
    :class:`LayerTooLarge` BEFORE reading anything when the selection is too big; stacked
    experts are read one expert at a time (:meth:`experts`)."""

    def __init__(self, model: Any, dtype: torch.dtype = torch.float64, max_elements: int = 400_000_000):
        self.model, self.dtype, self.max_elements = model, dtype, max_elements

    def names(self, layer: int | None, prefixes: tuple[str, ...]) -> list[tuple[str, Any]]:
        """(short name, tensor info) of every tensor ``prefixes`` select in ``layer``."""
        chosen = []
        head = f"blk.{layer}." if layer is not None else ""
        for name, info in self.model.tensors.items():
            if layer is not None and name.startswith("rope_freqs") and "rope_freqs" in prefixes:
                chosen.append((name, info))
            elif (layer is None) == (not name.startswith("blk.")) and name.startswith(head) \
                    and name[len(head):].startswith(prefixes):
                chosen.append((name[len(head):], info))
        return chosen

    def __call__(self, layer: int | None, prefixes: tuple[str, ...]) -> dict[str, Tensor]:
        from ggufcheck.gguf.dequant import dequantize_tensor

        chosen = self.names(layer, prefixes)
        n_el = sum(info.n_elements for _, info in chosen)
        if n_el > self.max_elements:
            raise LayerTooLarge(n_el, self.max_elements)
        return {short: dequantize_tensor(self.model, info.name, dtype=self.dtype) for short, info in chosen}

    def columns(self, name: str, cols: int) -> Tensor:
        """The first ``cols`` columns of every row of 2-D ``name`` [rows, cols], read in row
        blocks of ~2^24 weights (peak: the result plus one block)."""
        from ggufcheck.gguf.dequant import dequantize_tensor

        rows, width = self.model.tensors[name].shape
        out = torch.empty(rows, cols, dtype=self.dtype)
        step = max(1, (1 << 24) // width)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            block = dequantize_tensor(self.model, name, rows=slice(start, stop), dtype=self.dtype)
            out[start:stop] = block.reshape(stop - start, width)[:, :cols]
        return out

    def experts(self, layer: int, short: str, used: list[int]) -> ExpertSubset | None:
        """Experts ``used`` of stacked ``blk.{layer}.{short}`` [E, A, B], read row-wise."""
        from ggufcheck.gguf.dequant import dequantize_tensor

        name = f"blk.{layer}.{short}"
        info = self.model.tensors.get(name)
        if info is None:
            return None
        _, a, b = info.shape
        parts = {e: dequantize_tensor(self.model, name, rows=slice(e * a, (e + 1) * a), dtype=self.dtype)
                 .reshape(a, b) for e in used}  # [A, B] each
        return ExpertSubset(info.shape, parts)

    def expert_elements(self, layer: int, short: str) -> int:
        """Elements of ONE expert of ``blk.{layer}.{short}`` (0 when absent)."""
        info = self.model.tensors.get(f"blk.{layer}.{short}")
        return 0 if info is None else info.n_elements // info.shape[0]


def gguf_layer_weights(model: Any, dtype: torch.dtype = torch.float64,
                       max_elements: int = 400_000_000) -> GGUFLayerWeights:
    """The layer weights of an open GGUF (:class:`GGUFLayerWeights`)."""
    return GGUFLayerWeights(model, dtype, max_elements)


# --- the unsharded side ---------------------------------------------------------------------


def unsharded(cfg: ReferenceConfig, job: LayerJob) -> dict[str, Tensor]:
    """The reference's output of ``job`` on the full weights."""
    w, inp = job.weights, job.inputs
    pos = inp["pos"]
    if job.kind in ("attention", "mla", "indexer"):
        rope = rope_tables(cfg, w, pos)
    if job.kind == "attention":
        return {"out": dense.self_attention(cfg, w, inp["x"], rope, pos, pos, LayerCache())}
    if job.kind == "mla":
        _, q_nope, q_pe = ref_mla.project_q(cfg, w, inp["x"])
        return {"out": ref_mla.mla_attention(cfg, w, inp["x"], q_nope, q_pe, rope, causal_mask(pos, pos), LayerCache())}
    if job.kind == "dense_ffn":
        # phi3 keeps [gate; up] in ffn_up
        gate, up = (w["ffn_gate.weight"], w["ffn_up.weight"]) if "ffn_gate.weight" in w else w["ffn_up.weight"].chunk(2)
        return {"out": swiglu(inp["x"], gate, up, w["ffn_down.weight"])}
    if job.kind == "moe":
        return {"out": moe_block(cfg, w, inp["x"])[0]}
    if job.kind == "embedding":
        return {"out": w["token_embd.weight"][inp["ids"]]}
    if job.kind == "lm_head":
        (weight,) = w.values()
        return {"out": linear(inp["x"], weight)}
    if job.kind == "indexer":
        scores = dsa.index_scores(cfg, w, inp["x"], inp["qr"], rope, pos, pos, LayerCache())
        return {"out": scores, "topk": dsa.select_top_k(scores, cfg.indexer_top_k)}
    raise ValueError(f"unknown layer kind {job.kind!r}")


# --- comparing ------------------------------------------------------------------------------


def partial_diffs(cfg: ReferenceConfig, rules: dict[str, ShardRule], job: LayerJob, per_rank: list[dict[str, Any]], tp: int) -> list[float]:
    """Per rank: how far its collective inputs are from those of a known-good loader."""
    good = RunPayload(cfg, rules, [job], shard, VLLM_LAYOUT, collectives=False)
    out = []
    for r, got in enumerate(per_rank):
        want = run_job(LocalContext(r, tp, "local", torch.device("cpu")), good, job)["partials"]
        diffs = [float((a - b).abs().max()) if a.shape == b.shape else float("inf")
                 for a, b in zip(got.get("partials", []), want)]
        out.append(max(diffs, default=0.0) if len(want) == len(got.get("partials", [])) else float("inf"))
    return out


@dataclass
class InvarianceRun:
    """What one sharded run produced: per runnable job the unsharded answer and every rank's
    output, the collectives' per-rank results, and what did not run (with why)."""

    tp: int
    backend: str
    not_run: list[tuple[LayerJob | None, str, int | None, str]]  # (job, kind, layer, why)
    jobs: list[LayerJob] = field(default_factory=list)
    want: list[dict[str, Tensor]] = field(default_factory=list)  # per job: the unsharded side
    per_rank: list[list[dict[str, Any]]] = field(default_factory=list)  # per job: each rank's output
    collectives: list[dict[str, Tensor]] | None = None  # per rank, when they ran
    failure: RanksFailed | None = None  # the whole run failed (nothing else is filled)


def run_invariance(cfg: ReferenceConfig, rules: dict[str, ShardRule], jobs: list[LayerJob],
                   opts: InvarianceOptions) -> InvarianceRun:
    """Run every runnable job sharded (one process group) and the unsharded reference of each;
    the judging is :mod:`ggufcheck.checks.sharding.invariance`'s."""
    backend = resolve_backend(opts.backend, opts.tp)
    out = InvarianceRun(opts.tp, backend, [(None, kind, layer, why) for kind, layer, why in opts.not_run])
    runnable = []
    for job in jobs:
        problems = kind_problems(rules, {n: tuple(t.shape) for n, t in job.weights.items()}, opts.tp,
                                 cfg.n_head, 0 if cfg.is_mla else cfg.n_head_kv)
        n_el = sum(t.numel() for t in job.weights.values())
        if problems:
            out.not_run.append((job, job.kind, job.layer, f"not run at TP {opts.tp}: {problems[0]} (the plan reports it)"))
        elif n_el > opts.max_layer_elements:
            out.not_run.append((job, job.kind, job.layer, f"not run: {n_el:,} weights in fp64 exceed the CPU budget of "
                                                          f"{opts.max_layer_elements:,} elements"))
        else:
            runnable.append(job)
    payload = RunPayload(cfg, rules, runnable, opts.loader, opts.kv_layout, opts.collectives)
    try:
        per_rank = run_ranks(rank_run, payload, DistOptions(opts.tp, backend, opts.timeout_s, opts.start_method))
    except RanksFailed as err:
        out.failure = err
        return out
    for i, job in enumerate(runnable):
        out.jobs.append(job)
        out.want.append(unsharded(cfg, job))
        out.per_rank.append([o["jobs"][i] for o in per_rank])
    if opts.collectives:
        out.collectives = [o["collectives"] for o in per_rank]
    return out
