"""Where a failing chunked prefill parts from one prefill, and which of the two is wrong.

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
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ggufcheck.checks.layers.options import LayerOptions
from ggufcheck.engines.base import Engine, TokenLogprobs, Unsupported

KINDS = ("residual", "attention", "ffn")


def allowance_for(activation_class: str, options: LayerOptions = LayerOptions()) -> float:
    """How far two correct paths' residual streams may be apart at one position: the layers
    stage's residual allowance of the engine's class (fp32 / fp64: two fp32 roundings)."""
    return options.residual_allowances.get(activation_class, options.fp32_versus_allowance)


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-position ||a - b|| / ||b|| of [T, D] arrays (inf where a is not finite)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    num = np.linalg.norm(a - b, axis=-1)
    den = np.maximum(np.linalg.norm(b, axis=-1), 1e-30)
    return np.where(np.isfinite(a).all(axis=-1), num / den, np.inf)


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


def where_paths_part(engine: Engine, tokens: Sequence[int], chunk_size: int, position: int,
                     allowance: float) -> dict | None:
    """The first layer (and block) where the chunked trace leaves the one-prefill trace, or
    None when the engine traces no chunked prefill."""
    try:
        whole = engine.layer_outputs(list(tokens), KINDS).tensors
        chunked = engine.chunked_layer_outputs(list(tokens), chunk_size, KINDS).tensors
    except Unsupported:
        return None
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
        found["text"] = (f"traced layer by layer, no layer's residual differs between the two paths by more than "
                         f"the class allowance {allowance:.3g} up to position {position} (largest {top['max']:.3g}, "
                         f"layer {top['layer']}; {rows[-1]['at_position']:.3g} at the last layer there): the "
                         "logits differ more than the layers do (the output norm and head, or a position where "
                         "small differences decide)")
        found["layer"], found["block"] = None, "output"
        return found
    i, t = first["layer"], first["at"]
    block = "ffn"
    attn_w, attn_c = whole.get(("attention", i)), chunked.get(("attention", i))
    if attn_w is not None and attn_c is not None:
        attn = float(_rel(attn_c[t:t + 1], attn_w[t:t + 1])[0])
        found["attention_difference"] = attn
        # the attention output is a sum over positions: measured against the layer's residual
        # scale (the block's own norm can be tiny where it barely contributes)
        scale = float(np.linalg.norm(whole[("residual", i)][t]))
        moved = float(np.linalg.norm(np.asarray(attn_c[t], np.float64) - attn_w[t])) / max(scale, 1e-30)
        found["attention_moved"] = moved
        if moved > allowance / 2:
            block = "attention"
    elif attn_w is None:
        block = "layer"
    found.update(layer=i, block=block, position=t)
    offset = t % chunk_size
    place = (f"{'the first token' if offset == 0 else f'token {offset + 1}'} of chunk {t // chunk_size + 1} "
             f"(chunks of {chunk_size})")
    what = {"attention": "in the attention (it reads the KV cache the earlier chunks wrote)",
            "ffn": "in the FFN / MoE block (the attention output still agrees)",
            "layer": "inside it (the engine exposes no block outputs)"}[block]
    found["text"] = (f"traced layer by layer, the chunked prefill first leaves the one prefill at layer {i}, "
                     f"{what}: residual difference {first['max']:.3g} > {allowance:.3g} at position {t}, "
                     f"{place}")
    return found


def localize_chunked(engine: Engine, tokens: Sequence[int], chunk_size: int, position: int,
                     whole: TokenLogprobs, chunked: TokenLogprobs, limit: float,
                     reference_score: Callable[[Sequence[int]], TokenLogprobs] | None = None) -> dict:
    """Both parts for a failed chunked pair; ``text`` is the sentence added to the check."""
    found: dict = {}
    texts = []
    if reference_score is not None:
        side = which_path(whole, chunked, reference_score(list(tokens)), position, limit)
        found["which_path"] = side
        texts.append(side["text"])
    part = where_paths_part(engine, tokens, chunk_size, position,
                            allowance_for(engine.capabilities.activation_dtype))
    if part is not None:
        found["where"] = part
        texts.append(part["text"])
    found["text"] = "; ".join(texts)
    return found
