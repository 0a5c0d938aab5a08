"""Where a failing chunked prefill (or decode) parts from one prefill, and which is wrong.

The same comparison serves the decode path (:func:`localize_decode`): the prompt prefilled,
then one token per step (:meth:`Engine.decode_layer_outputs`: the matrix-vector kernels and
the cache the decode steps write) against the prefill of the same tokens; a failing
``paths.prefill_vs_decode`` and the decode verdict name the layer, the block and the decode
step where they part.

``paths.chunked_prefill`` runs one engine two ways and can only say that they differ. When it
fails, this looks inside, with two computations the check did not use:

- which path: each path's KL from the reference's log-probs at the worst position (the one
  farther than the pair's per-position limit is wrong; both may be);
- where: both paths traced layer by layer (:meth:`Engine.layer_outputs` and
  :meth:`Engine.chunked_layer_outputs`). The first layer whose residual stream differs by more
  than the engine class's residual allowance, at any position up to the worst one, is where
  they part; there, the attention output differing beyond that allowance while the layer's
  input agreed at every earlier position names the attention (it reads the KV cache the
  chunks wrote), otherwise the FFN / MoE block. The position's place in its chunk is given:
  a first token of a chunk is the fingerprint of a chunk-boundary (context merge) bug.

Engines that cannot trace a chunked prefill get the first part alone.

Before any of that, MoE routing: where the two paths choose different experts for a token
while the engine's own selection scores are a near-tie there (:func:`routing_near_tie_flips`,
the engine class's margin of checks.logits.ROUTER_TIE_MARGINS), two correct paths may break
the tie differently, and every later row reads that token through the KV cache. The reference's
ties are already left out of the pair, but an engine whose inputs differ from the reference's
(earlier tokens routed otherwise, in both paths alike) has near-ties of its own: measured on
the H100, a tiny deepseek2 Q4_K through llama.cpp's CUDA backend. Those rows are left out and
the pair judged again (checks.paths).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ggufcheck.checks.layers.metrics import rel_errors
from ggufcheck.checks.layers.options import LayerOptions
from ggufcheck.engines.base import Engine, TokenLogprobs, Unsupported

KINDS = ("residual", "after_attention", "attention", "ffn", "router", "router_probs", "router_biased")


def allowance_for(activation_class: str, options: LayerOptions = LayerOptions()) -> float:
    """How far two correct paths' residual streams may be apart at one position: the layers
    stage's residual allowance of the engine's class (fp32 / fp64: two fp32 roundings)."""
    return options.residual_allowances.get(activation_class, options.fp32_versus_allowance)


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-position ||a - b|| / ||b|| of [T, D] arrays (the layers stage's metric)."""
    return rel_errors(torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))).numpy()


def _selection_scores(trace: dict, layer: int) -> np.ndarray | None:
    """[T, n_expert] the scores a layer's experts were chosen by (with the selection bias
    where the model has one), or None when the engine does not expose them."""
    return trace.get(("router_biased", layer), trace.get(("router_probs", layer)))


def which_path(whole: TokenLogprobs, chunked: TokenLogprobs, reference: TokenLogprobs, position: int,
               limit: float) -> dict:
    """Each path's KL from the reference at ``position``, and which of them is beyond ``limit``."""
    from ggufcheck.checks.logits import collect

    kl = {}
    for name, table in (("one prefill", whole), ("chunks", chunked)):
        m = collect([(reference, table)])
        at = np.flatnonzero(m.position == position)
        kl[name] = float(m.kl[at[0]]) if len(at) else None
    wrong = [name for name, v in kl.items() if v is not None and not v <= limit]
    if not wrong:
        text = (f"the reference agrees with both paths there (KL {kl['one prefill']:.3g} / {kl['chunks']:.3g}, "
                f"limit {limit:.3g})" if None not in kl.values() else "the reference did not score that position")
    elif len(wrong) == 2:
        text = f"both paths are far from the reference there (KL {kl['one prefill']:.3g} / {kl['chunks']:.3g})"
    else:
        right = next(n for n in kl if n not in wrong)
        text = (f"the {wrong[0]} path is the wrong one: KL {kl[wrong[0]]:.3g} from the reference there, the "
                f"{right} {kl[right]:.3g} (limit {limit:.3g})")
    return {"kl_from_reference": kl, "wrong": wrong, "text": text}


def selection_gap(scores: np.ndarray, k: int) -> np.ndarray:
    """[T] the k-th largest selection score minus the (k+1)-th: how close the top-k choice was."""
    top = -np.sort(-np.asarray(scores, np.float64), axis=-1)[:, :k + 1]
    return top[:, k - 1] - top[:, k]


def routing_near_tie_flips(whole: dict, chunked: dict, margin: float) -> list[dict]:
    """Positions where the two paths chose different experts in a layer while the engine's own
    selection scores there were a near-tie (gap below ``margin`` in either path): two correct
    paths of one engine may break such a tie differently (their roundings differ). Sorted by
    position; one entry per position, its first such layer."""
    flips: dict[int, dict] = {}
    for (kind, i), ids_w in whole.items():
        ids_c = chunked.get((kind, i))
        if kind != "router" or ids_c is None:
            continue
        n = min(len(ids_w), len(ids_c))
        differ = np.flatnonzero([set(a) != set(b) for a, b in zip(ids_w[:n].tolist(), ids_c[:n].tolist())])
        if not len(differ):
            continue
        scores_w, scores_c = _selection_scores(whole, i), _selection_scores(chunked, i)
        if scores_w is None or scores_c is None:
            continue
        k = ids_w.shape[-1]
        gap = np.minimum(selection_gap(scores_w[:n], k), selection_gap(scores_c[:n], k))
        for t in differ:
            t = int(t)
            if gap[t] < margin and (t not in flips or i < flips[t]["layer"]):
                flips[t] = {"position": t, "layer": i, "gap": float(gap[t])}
    return [flips[t] for t in sorted(flips)]


def traces(engine: Engine, tokens: Sequence[int], chunk_size: int, *,
           decode_from: int | None = None) -> tuple[dict, dict] | None:
    """(one-prefill, other path) layer tensors: the other path is a chunked prefill, or with
    ``decode_from`` a decode after that many prompt tokens; None when the engine does not
    trace that path."""
    tokens = list(tokens)
    try:
        whole = engine.layer_outputs(tokens, KINDS).tensors
        other = (engine.chunked_layer_outputs(tokens, chunk_size, KINDS) if decode_from is None else
                 engine.decode_layer_outputs(tokens, decode_from, KINDS)).tensors
    except Unsupported:
        return None
    return whole, other


def localize_decode(engine: Engine, tokens: Sequence[int], prompt_length: int, position: int) -> dict | None:
    """Where a decode of ``tokens`` (the first ``prompt_length`` prefilled, then one token per
    step) first leaves the prefill of the same tokens, layer by layer, up to ``position``; None
    when the engine traces no decode steps."""
    tokens = list(tokens)[:position + 1]
    traced = traces(engine, tokens, 1, decode_from=prompt_length)
    if traced is None:
        return None

    def place(t: int) -> str:
        return (f"decode step {t - prompt_length + 1} (position {t}; the prompt is {prompt_length} tokens)"
                if t >= prompt_length else f"inside the prompt's prefill (position {t})")

    return where_paths_part(engine, tokens, 1, position, allowance_for(engine.capabilities.activation_dtype),
                            traced, path="the one-token decode", place=place,
                            reads="it reads the KV cache the decode steps wrote")


def where_paths_part(engine: Engine, tokens: Sequence[int], chunk_size: int, position: int,
                     allowance: float, traced: tuple[dict, dict] | None = None, *,
                     path: str = "the chunked prefill", place: Callable[[int], str] | None = None,
                     reads: str = "it reads the KV cache the earlier chunks wrote") -> dict | None:
    """The first layer (and block) where the second trace (``path``: a chunked prefill, or a
    decode) leaves the one-prefill trace, or None when the engine traces no such path."""
    # a causal model's rows up to ``position`` do not depend on later tokens: trace no further
    if traced is not None and not all(len(v) > position for v in traced[0].values()):
        traced = None  # a trace taken for other rows, too short for this one
    traced = traced or traces(engine, list(tokens)[:position + 1], chunk_size)
    if traced is None:
        return None
    whole, chunked = traced
    layers = sorted(i for kind, i in whole if kind == "residual" and ("residual", i) in chunked)
    if not layers:
        return None
    upto = position + 1
    rows = []
    for i in layers:
        d = _rel(chunked[("residual", i)][:upto], whole[("residual", i)][:upto])
        rows.append({"layer": i, "max": float(d.max()), "at": int(d.argmax()),
                     "at_position": float(d[position])})
    first = next((r for r in rows if not r["max"] <= allowance), None)
    found = {"allowance": allowance, "per_layer": rows, "chunk_size": chunk_size}
    if first is None:
        top = max(rows, key=lambda r: r["max"])
        found["text"] = (f"traced layer by layer, no layer's residual differs between {path} and one prefill "
                         f"by more than the class allowance {allowance:.3g} up to position {position} (largest "
                         f"{top['max']:.3g}, layer {top['layer']}; {rows[-1]['at_position']:.3g} at the last layer "
                         "there): the "
                         "logits differ more than the layers do (the output norm and head, or a position where "
                         "small differences decide)")
        found["layer"], found["block"] = None, "output"
        return found
    i, t = first["layer"], first["at"]
    ids_w, ids_c = whole.get(("router", i)), chunked.get(("router", i))
    scores_w, scores_c = _selection_scores(whole, i), _selection_scores(chunked, i)
    if ids_w is not None and ids_c is not None and set(ids_w[t].tolist()) != set(ids_c[t].tolist()):
        gap = None if scores_w is None or scores_c is None else float(min(
            selection_gap(scores_w[t:t + 1], ids_w.shape[-1])[0], selection_gap(scores_c[t:t + 1], ids_c.shape[-1])[0]))
        found.update(layer=i, block="routing", position=t, routing_gap=gap)
        found["text"] = (f"traced layer by layer, {path} first leaves the one prefill at layer {i}, where "
                         f"the two paths route position {t} to different experts ({sorted(ids_w[t].tolist())} vs "
                         f"{sorted(ids_c[t].tolist())}"
                         + (f"; the engine's own selection scores there are {gap:.3g} apart at the top-k boundary)"
                            if gap is not None else ")"))
        return found
    block = "ffn"
    attn_w, attn_c = whole.get(("attention", i)), chunked.get(("attention", i))
    mid_w, mid_c = whole.get(("after_attention", i)), chunked.get(("after_attention", i))
    if mid_w is not None and mid_c is not None:
        # the residual between the blocks: the layer's input (agreeing up to here) plus attention
        moved = float(_rel(mid_c[t:t + 1], mid_w[t:t + 1])[0])
        found["after_attention_difference"] = moved
        if moved > allowance / 2:
            block = "attention"
    elif attn_w is not None and attn_c is not None:
        attn = float(_rel(attn_c[t:t + 1], attn_w[t:t + 1])[0])
        found["attention_difference"] = attn
        # the attention output is a sum over positions: measured against the layer's residual
        # scale (the block's own norm can be tiny where it barely contributes)
        scale = float(np.linalg.norm(whole[("residual", i)][t]))
        moved = float(np.linalg.norm(np.asarray(attn_c[t], np.float64) - attn_w[t])) / max(scale, 1e-30)
        found["attention_moved"] = moved
        if moved > allowance / 2:
            block = "attention"
    else:
        block = "layer"
    found.update(layer=i, block=block, position=t)
    offset = t % chunk_size
    where = place(t) if place is not None else (
        f"{'the first token' if offset == 0 else f'token {offset + 1}'} of chunk {t // chunk_size + 1} "
        f"(chunks of {chunk_size})")
    what = {"attention": f"in the attention ({reads})",
            "ffn": "in the FFN / MoE block (the attention output still agrees)",
            "layer": "inside it (the engine exposes no block outputs)"}[block]
    if block == "ffn" and ids_w is not None and ids_c is not None and scores_w is not None and scores_c is not None:
        # the same experts: a MoE output still moves with its routing weights (a flat router
        # turns the paths' rounding into a large step there)
        apart = float(np.abs(np.asarray(scores_c[t], np.float64) - np.asarray(scores_w[t], np.float64)).max())
        found["router_scores_difference"] = apart
        what += f", with the same experts chosen and their router scores up to {apart:.3g} apart"
    found["text"] = (f"traced layer by layer, {path} first leaves the one prefill at layer {i}, "
                     f"{what}: residual difference {first['max']:.3g} > {allowance:.3g} at position {t}, "
                     f"{where}")
    matrices = block_matrices(engine, i, block)
    if matrices:
        found["matrices"] = matrices
        kernels = " (in the matrix-vector kernels on a one-token step)" if chunk_size == 1 else ""
        found["text"] += "; the block's matrices" + kernels + ": " + "; ".join(
            f"{', '.join(names)} {qtype}" for qtype, names in matrices.items())
    return found


def block_matrices(engine: Engine, layer: int, block: str) -> dict[str, list[str]]:
    """The stored matrices of ``block`` ("attention" / "ffn") in ``layer`` of the engine's GGUF,
    by quant type ({"Q5_K": ["ffn_gate", "ffn_up"], ...}); empty where the file is unknown."""
    prefix = {"attention": "attn_", "ffn": "ffn_"}.get(block)
    path = getattr(engine, "model_path", None) or getattr(getattr(getattr(engine, "model", None), "gguf", None),
                                                          "path", None)
    if prefix is None or path is None:
        return {}
    from ggufcheck.gguf.reader import open_gguf

    try:
        with open_gguf(path) as model:
            found: dict[str, list[str]] = {}
            for name, info in model.tensors.items():
                short = name[len(f"blk.{layer}."):] if name.startswith(f"blk.{layer}.") else ""
                if short.startswith(prefix) and short.endswith(".weight") and len(info.shape) >= 2:
                    found.setdefault(info.qtype.name, []).append(short[:-len(".weight")])
            return found
    except (OSError, ValueError):
        return {}


def localize_chunked(engine: Engine, tokens: Sequence[int], chunk_size: int, position: int,
                     whole: TokenLogprobs, chunked: TokenLogprobs, limit: float,
                     reference_score: Callable[[Sequence[int]], TokenLogprobs] | None = None,
                     traced: tuple[dict, dict] | None = None) -> dict:
    """Both parts for a failed chunked pair; ``text`` is the sentence added to the check."""
    found: dict = {}
    texts = []
    if reference_score is not None:
        side = which_path(whole, chunked, reference_score(list(tokens)), position, limit)
        found["which_path"] = side
        texts.append(side["text"])
    part = where_paths_part(engine, tokens, chunk_size, position,
                            allowance_for(engine.capabilities.activation_dtype), traced)
    if part is not None:
        found["where"] = part
        texts.append(part["text"])
    found["text"] = "; ".join(texts)
    return found


# at most this many sequences of a failing pair are traced to look for routing near-ties
MAX_TRACED = 4


def routing_tie_rows(engine: Engine, prompts: Sequence[Sequence[int]], pairs: Sequence[tuple[TokenLogprobs, TokenLogprobs]],
                     chunk_size: int, limit: float, margin: float) -> tuple[list[np.ndarray | None], dict, dict]:
    """For each pair whose rows exceed ``limit``: the rows from the first routing near-tie that
    the two paths broke differently (:func:`routing_near_tie_flips`) onward (later rows read
    that token's keys through the cache), as [T] bool marks (None: nothing to leave out);
    the flips found, per sequence; and the traces taken, by sequence (reused to localize)."""
    from ggufcheck.checks.logits import collect

    marks: list[np.ndarray | None] = [None] * len(pairs)
    found: dict[int, list[dict]] = {}
    taken: dict[int, tuple[dict, dict]] = {}
    over: dict[int, int] = {}  # sequence -> its last row over the limit
    for s, pair in enumerate(pairs):
        m = collect([pair])
        rows = m.position[np.nan_to_num(m.kl, nan=np.inf) > limit] if m.n else []
        if len(rows):
            over[s] = int(np.max(rows))
    for s in list(over)[:MAX_TRACED]:
        # rows after the last one over the limit need no trace (a causal model): on a large
        # model a whole trace of every layer, twice, is gigabytes
        traced = traces(engine, list(prompts[s])[:over[s] + 1], chunk_size)
        if traced is None:
            break
        taken[s] = traced
        flips = routing_near_tie_flips(*traced, margin)
        if flips:
            found[s] = flips
            rows = np.zeros(len(pairs[s][0].tokens), dtype=bool)
            rows[flips[0]["position"]:] = True
            marks[s] = rows
    return marks, found, taken
