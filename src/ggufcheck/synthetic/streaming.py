"""Test models of any size, written one row block at a time: memory independent of the file.

:func:`ggufcheck.synthetic.tiny.build_tiny_gguf` holds every weight in float32 plus its
encoding (~21 GB for a 5.6 GB file), which is right for the tiny models of the tests and
impossible for the models ggufcheck exists for (a GLM-5 layer with 256 experts is 9.9e9
weights). :func:`build_streaming_gguf` writes the same file (same layout, metadata, values:
``tiny.random_tensor``'s generator drawn in consecutive row blocks gives the same numbers as
one draw) with every tensor generated, encoded and written in row blocks of ``block_bytes`` (float32),
``workers`` tensors at a time on a thread pool (numpy releases the GIL), each block written at
its place in the file. Peak memory: ``workers`` blocks, for any size.

Every type gguf-py can quantize (F32, F16, BF16, Q4_0..Q8_0, TQ1_0, TQ2_0, MXFP4) gives the
same bytes as ``build_tiny_gguf`` (a test); other types are written as random valid blocks of
each block's spread (``tiny.encode``), not byte-equal to the in-memory builder.

:func:`scale_dims` gives the real per-layer dimensions of GLM-5, DeepSeek-V3 and Kimi-K2
(``arch/known.py``) with any number of layers, experts and vocabulary.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from ggufcheck.errors import GGUFCheckError
from ggufcheck.synthetic import qblocks, tiny


@dataclass(frozen=True)
class StreamedGGUF:
    """A file written by :func:`build_streaming_gguf`."""

    path: Path
    dims: tiny.TinyDims
    qtypes: dict[str, Q]
    fallbacks: tuple[str, ...]
    n_weights: int
    file_bytes: int


def build_streaming_gguf(dims: tiny.TinyDims, path: str | Path, *, qtypes: str | Q | dict[str, str | Q] = "Q8_0",
                         seed: int = 0, block_bytes: int = 32 << 20, workers: int = 2) -> StreamedGGUF:
    """Write the random model of ``dims`` to ``path`` one row block at a time.

    ``qtypes`` as :func:`ggufcheck.synthetic.tiny.resolve_qtypes`; split k_b / v_b only (a
    fused legacy ``attn_kv_b`` is built from both, which needs them whole: use
    ``build_tiny_gguf`` for those small files).
    """
    if dims.kv_b != "split":
        raise GGUFCheckError("the streaming builder writes split attn_k_b / attn_v_b only (kv_b='split')")
    shapes = tiny.tensor_shapes(dims)
    chosen, fallbacks = tiny.resolve_qtypes(shapes, qtypes)
    kv = tiny.metadata(dims, tiny._file_type(chosen)) | tiny.tokenizer_metadata(dims.n_vocab)
    out = Path(path)
    writer = gguf.GGUFWriter(out, dims.arch)
    writer.kv_data[0].clear()  # kv says it all (as tiny._write)
    for key, (value, vtype) in kv.items():
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    for name, shape in shapes.items():
        writer.add_tensor_info(name, _byte_shape(shape, chosen[name]), np.dtype(np.uint8),
                               _nbytes(shape, chosen[name]), raw_dtype=chosen[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())  # the data section starts aligned
    fout.flush()
    data_start = fout.tell()
    offsets, at = {}, 0
    for name, shape in shapes.items():  # where GGUFWriter put each tensor: aligned, in order
        offsets[name] = data_start + at
        at += writer.ggml_pad(_nbytes(shape, chosen[name]), writer.data_alignment)
    fd = fout.fileno()
    os.ftruncate(fd, data_start + at)  # the padding between tensors stays zero
    order = sorted(shapes, key=lambda n: -int(np.prod(shapes[n])))  # the largest first
    with ThreadPoolExecutor(max(1, workers)) as pool:  # tensors in parallel, each written at its offset
        for done in [pool.submit(_write_tensor, fd, offsets[n], n, shapes[n], chosen[n], seed, block_bytes)
                     for n in order]:
            done.result()
    writer.close()
    n_weights = sum(int(np.prod(s)) for s in shapes.values())
    return StreamedGGUF(out, dims, chosen, tuple(fallbacks), n_weights, out.stat().st_size)


def _write_tensor(fd: int, offset: int, name: str, shape: tuple[int, ...], qt: Q, seed: int,
                  block_bytes: int) -> int:
    """Generate ``tiny.random_tensor(name, shape, seed)`` in row blocks, encode each and write
    it at its place in the file (``os.pwrite``); returns the bytes written."""
    row = shape[-1]
    n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    rows_per_block = max(1, block_bytes // (4 * row))
    scale = _scale(name, shape)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    blocks_rng = np.random.default_rng([seed, zlib.crc32(name.encode()), 1])  # tiny.encode's, for random blocks
    random_blocks = qt not in qblocks.FLOAT_TYPES and tiny._needs_random(qt)
    written = 0
    for start in range(0, n_rows, rows_per_block):
        n = min(rows_per_block, n_rows - start)
        x = rng.standard_normal((n, row), dtype=np.float32)  # the same stream as one draw of the whole
        data = np.ascontiguousarray(_encode(x, scale, qt, blocks_rng if random_blocks else None))
        view = memoryview(data).cast("B")
        while view:
            k = os.pwrite(fd, view, offset + written)
            written += k
            view = view[k:]
    return written


def _scale(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(multiplier, offset) that tiny.random_tensor applies to its standard normal draws."""
    if name.endswith(".bias"):
        return 0.1, 0.0
    if len(shape) == 1:
        return 0.1, 1.0
    fan_in = shape[1] if name.endswith("attn_k_b.weight") else shape[-1]
    return float(np.float32(1.0 / np.sqrt(fan_in))), 0.0


def _encode(x: np.ndarray, scale: tuple[float, float], qt: Q, rng: np.random.Generator | None) -> np.ndarray:
    mul, add = scale
    if add:  # norm weights: 1 + 0.1 x (float32 arithmetic, as random_tensor)
        x = np.float32(add) + np.float32(mul) * x
    else:
        x *= np.float32(mul)
    return tiny.encode(x, qt, rng if rng is not None else np.random.default_rng(0))


def _nbytes(shape: tuple[int, ...], qt: Q) -> int:
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // bs) * ts


def _byte_shape(shape: tuple[int, ...], qt: Q) -> tuple[int, ...]:
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    return (*shape[:-1], shape[-1] // bs * ts)


# ---------------------------------------------------------------------------------------
# real models' per-layer dimensions


def scale_dims(model: str = "glm-5", **overrides: Any) -> tiny.TinyDims:
    """The per-layer dimensions of a known large model (``glm-5``, ``deepseek-v3``,
    ``kimi-k2``: ``arch/known.py``) as :class:`~ggufcheck.synthetic.tiny.TinyDims`, with
    ``overrides`` (``n_layer``, ``n_expert``, ``n_vocab``, ``n_dense_lead``, ...).

    Defaults: the real model's layer count, experts, vocabulary and leading dense layers,
    no NextN layer (the trunk only); GLM-5's DSA indexer on every layer."""
    from ggufcheck.arch.known import KNOWN

    if model not in KNOWN:
        raise GGUFCheckError(f"unknown model {model!r}; known: {', '.join(sorted(KNOWN))}")
    m = KNOWN[model]()
    a = m["general.architecture"]

    def key(k: str, default: Any = None) -> Any:
        return m.get(f"{a}.{k}", default)

    rope = key("rope.dimension_count")
    d: dict[str, Any] = dict(
        n_layer=key("block_count") - key("nextn_predict_layers", 0), n_embd=key("embedding_length"),
        n_head=key("attention.head_count"), n_head_kv=1, n_ff=key("feed_forward_length"), n_vocab=key("vocab_size"),
        rope_base=key("rope.freq_base"), rms_eps=key("attention.layer_norm_rms_epsilon"),
        context_length=key("context_length"), n_expert=key("expert_count"), n_expert_used=key("expert_used_count"),
        n_expert_shared=key("expert_shared_count"), n_ff_exp=key("expert_feed_forward_length"),
        n_dense_lead=key("leading_dense_block_count"), n_group=key("expert_group_count"),
        n_group_used=key("expert_group_used_count"), expert_weights_scale=key("expert_weights_scale"),
        expert_weights_norm=key("expert_weights_norm"), gating_func=key("expert_gating_func"),
        q_lora_rank=key("attention.q_lora_rank"), kv_lora_rank=key("attention.kv_lora_rank"),
        qk_nope=key("attention.key_length_mla") - rope, qk_rope=rope, v_head_dim=key("attention.value_length_mla"),
    )
    if key("rope.scaling.type") == "yarn":
        d.update(yarn_factor=key("rope.scaling.factor"), yarn_orig_ctx=key("rope.scaling.original_context_length"),
                 yarn_log_mul=key("rope.scaling.yarn_log_multiplier", 0.0))
    if a == "glm-dsa":
        d.update(indexer_heads=key("attention.indexer.head_count"), indexer_dim=key("attention.indexer.key_length"),
                 indexer_top_k=key("attention.indexer.top_k"))
    d.update(overrides)
    if "n_dense_lead" not in overrides:
        d["n_dense_lead"] = min(d["n_dense_lead"], max(d["n_layer"] - 1, 0))  # keep one MoE layer when few
    if d.get("indexer_top_k") and "indexer_types" not in overrides:
        d["indexer_types"] = None
    base = tiny.DEFAULT_DIMS[a]
    return dataclasses.replace(base, **d)
