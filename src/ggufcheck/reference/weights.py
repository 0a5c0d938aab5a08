"""The reference's weights: the file's own dequantized values, by GGUF tensor name, when used.

Weights are read straight from the GGUF layout (split k_b / v_b, stacked experts), never
from an HF rebuild, so the reference and the rebuild can check each other.

Memory is bounded by one tensor, not by a layer or the model (a GLM-5 MoE layer is 9.9e9
weights, 79 GB in fp64; 8 tokens touch at most 64 of its 256 experts):

- :meth:`WeightStore.layer` gives a lazy mapping: a tensor is dequantized when the layer code
  reads it, and dropped when the code lets go of it;
- a stacked expert tensor [E, A, B] comes as an :class:`ExpertStack`: ``stack[e]`` reads and
  dequantizes expert e's rows only, so only routed experts are ever converted;
- a matrix larger than :data:`ROW_BLOCK_BYTES` in the working dtype comes as a
  :class:`RowBlocked` matrix, which ``layers.linear`` multiplies a row block at a time
  (each output column is the same dot product either way: the blocks are exact);
- what is read is kept in a :class:`WeightCache` up to its byte budget, one cache per process
  shared by every store over the same file (the fp64 reference, the baseline run, the dense
  DSA variant), filled in first-use order and never evicted, so a model that fits stays
  resident and one that does not streams its remainder on every pass (a least-recently-used
  cache would keep nothing useful on a cyclic layer-by-layer walk); ``streaming=True`` caches
  nothing, ``streaming=False`` caches everything (the fault engines of the tests);
- the mmap pages a tensor came from are released after it is dequantized (``MADV_DONTNEED``),
  so a file larger than memory keeps resident memory bounded;
- on a CUDA device the quantized bytes go to the GPU and are dequantized there (Triton).

The embedding is read row by row for the prompt's tokens only, and the output head in row
chunks.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from ggufcheck.gguf.dequant import dequantize, dequantize_tensor, dequantize_wide
from ggufcheck.gguf.quants.offsets import group_offsets, group_size
from ggufcheck.gguf.reader import GGUFModel, TensorInfo

# a matrix larger than this (working dtype) is multiplied in row blocks of BLOCK_BYTES: small
# enough to stay in cache between dequantization and product (measured on 2 cores, a streaming
# GLM-5-dims decode step: 1.08 s with 32 / 8 MiB, 1.68 s with 256 / 64 MiB)
ROW_BLOCK_BYTES = 32 << 20
BLOCK_BYTES = 8 << 20
MIN_BLOCK_ROWS = 16


# ---------------------------------------------------------------------------------------
# the shared cache


class WeightCache:
    """Dequantized tensors up to ``budget`` bytes, keyed by (file, tensor, rows, dtype, device).

    Filled in first-use order; an entry that would pass the budget is not kept (the caller
    uses it and drops it). Shared by every :class:`WeightStore` of the process: stores over the
    same file at the same dtype reuse each other's tensors."""

    def __init__(self, budget: int, compact: bool = False):
        self.budget = int(budget)
        # compact: keep float32 (the exact dequantized values) and widen on every read, so the
        # budget holds twice the weights and an fp64 and an fp32 copy share one entry
        self.compact = compact
        self.used = 0
        self._items: dict[tuple, Tensor] = {}
        self._users: dict[tuple, int] = {}  # file identity -> open stores
        self.hits = self.misses = 0

    def get(self, key: tuple) -> Tensor | None:
        t = self._items.get(key)
        if t is None:
            self.misses += 1
        else:
            self.hits += 1
        return t

    def offer(self, key: tuple, tensor: Tensor, force: bool = False) -> None:
        size = tensor.numel() * tensor.element_size()
        if force or self.used + size <= self.budget:
            self._items[key] = tensor
            self.used += size

    def attach(self, identity: tuple) -> None:
        self._users[identity] = self._users.get(identity, 0) + 1

    def detach(self, identity: tuple) -> None:
        """A store over ``identity`` closed; the last one drops that file's entries."""
        left = self._users.get(identity, 0) - 1
        if left > 0:
            self._users[identity] = left
            return
        self._users.pop(identity, None)
        for key in [k for k in self._items if k[0] == identity]:
            t = self._items.pop(key)
            self.used -= t.numel() * t.element_size()

    def clear(self) -> None:
        self._items.clear()
        self.used = 0


def _default_budget() -> int:
    """GGUFCHECK_WEIGHT_CACHE (bytes, e.g. ``2e9``), else a quarter of the memory available
    now, at most 2 GiB (a diagnosis's plan, ``diagnose/resources.py``, sets it from the model
    and the host)."""
    env = os.environ.get("GGUFCHECK_WEIGHT_CACHE")
    if env:
        return int(float(env))
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 4 << 30
    return min(avail // 4, 2 << 30)


_SHARED: WeightCache | None = None


def shared_cache() -> WeightCache:
    """The process's weight cache (created with :func:`_default_budget` on first use)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = WeightCache(_default_budget())
    return _SHARED


def set_cache_budget(budget: int, compact: bool = False) -> WeightCache:
    """Set the shared cache's budget in bytes and its storage (entries past a lowered budget,
    or of the other storage, are dropped)."""
    cache = shared_cache()
    if cache.used > budget or cache.compact != compact:
        cache.clear()
    cache.budget, cache.compact = int(budget), compact
    return cache


# ---------------------------------------------------------------------------------------
# lazy views of big tensors


class ExpertStack:
    """A stacked expert tensor [E, A, B] read one expert at a time: ``stack[e]`` is expert e's
    [A, B] (rows ``e*A .. (e+1)*A`` of the flattened view, dequantized alone). ``stack[perm]``
    (a 1-D index of all E experts) is the stack with its slots re-ordered; :meth:`part` the
    rows ``start..stop`` of every expert (the gate / up halves of a fused gate_up)."""

    def __init__(self, store: "WeightStore", name: str, order: Tensor | None = None,
                 part: tuple[int, int] | None = None):
        self.store, self.name = store, name
        info = store.model.tensors[name]
        e, a, b = info.shape
        self._rows = a
        self._part = part or (0, a)
        self._order = order
        self.shape = (e, self._part[1] - self._part[0], b)
        self.dtype = store.dtype

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int,)) or (isinstance(index, Tensor) and index.dim() == 0):
            e = int(index)
            if self._order is not None:
                e = int(self._order[e])
            start = e * self._rows + self._part[0]
            return self.store.matrix(self.name, (start, start + self.shape[1]))
        order = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
        if order.numel() != self.shape[0]:
            raise IndexError(f"{self.name}: an expert stack is indexed by one expert or by all {self.shape[0]}")
        if self._order is not None:
            order = self._order[order]
        return ExpertStack(self.store, self.name, order, self._part)

    def part(self, start: int, stop: int) -> "ExpertStack":
        return ExpertStack(self.store, self.name, self._order, (self._part[0] + start, self._part[0] + stop))

    def dim(self) -> int:
        return 3

    def materialize(self) -> Tensor:
        return torch.stack([self[e] for e in range(self.shape[0])])


class RowBlocked:
    """A matrix [out, in] too big to hold whole in the working dtype: :meth:`blocks` gives its
    rows a block at a time; ``layers.linear`` multiplies it that way."""

    def __init__(self, store: "WeightStore", name: str, rows: tuple[int, int] | None = None):
        self.store, self.name = store, name
        info = store.model.tensors[name]
        self._start, self._stop = rows or (0, info.n_rows)
        self.shape = (self._stop - self._start, info.row_elements)
        self.dtype = store.dtype
        self.ggml_type = info.qtype.name
        item = torch.finfo(store.dtype).bits // 8
        self.block_rows = max(MIN_BLOCK_ROWS, BLOCK_BYTES // (item * info.row_elements))

    def blocks(self) -> Iterator[tuple[int, Tensor]]:
        """(first row, relative to this matrix; [rows, in]) in order: blocks of equal size (to a
        row), never a lone row (a one-row product takes BLAS's matrix-vector kernel, which sums
        in another order: the blocks would not be exact)."""
        n = self._stop - self._start
        n_blocks = -(-n // self.block_rows)
        bounds = [self._start + n * k // n_blocks for k in range(n_blocks + 1)]
        for start, stop in zip(bounds, bounds[1:]):
            yield start - self._start, self.store.tensor(self.name, rows=slice(start, stop))

    def chunk(self, n: int, dim: int = 0) -> tuple["RowBlocked", ...]:
        if dim != 0 or self.shape[0] % n:
            raise ValueError(f"{self.name}: row-blocked matrices split into equal row ranges only")
        size = self.shape[0] // n
        return tuple(RowBlocked(self.store, self.name, (self._start + k * size, self._start + (k + 1) * size))
                     for k in range(n))

    def dim(self) -> int:
        return 2

    def materialize(self) -> Tensor:
        return torch.cat([b for _, b in self.blocks()])


def materialize(t: Any) -> Tensor:
    """A plain tensor of a weight (an expert stack or a row-blocked matrix read whole)."""
    return t.materialize() if isinstance(t, (ExpertStack, RowBlocked)) else t


# ---------------------------------------------------------------------------------------
# one layer's tensors


class LayerWeights(Mapping):
    """Layer i's tensors by short name (``"attn_q.weight"``), each read when looked up."""

    def __init__(self, store: "WeightStore", layer: int, names: dict[str, str],
                 overrides: dict[str, Any] | None = None, dropped: frozenset[str] = frozenset()):
        self.store, self.layer_index = store, layer
        self._names = names  # short -> full GGUF name
        self._overrides = overrides or {}
        self._dropped = dropped

    def __getitem__(self, short: str) -> Any:
        if short in self._dropped:
            raise KeyError(short)
        if short in self._overrides:
            return self._overrides[short]
        return self.store.lazy(self._names[short])

    def __iter__(self) -> Iterator[str]:
        seen = [n for n in self._names if n not in self._dropped]
        return iter(seen + [n for n in self._overrides if n not in self._names and n not in self._dropped])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, short: object) -> bool:
        return short not in self._dropped and (short in self._names or short in self._overrides)

    def replaced(self, **tensors: Any) -> "LayerWeights":
        """The same layer with some tensors replaced (nothing is read)."""
        return LayerWeights(self.store, self.layer_index, self._names, {**self._overrides, **tensors},
                            self._dropped - set(tensors))

    def without(self, *shorts: str) -> "LayerWeights":
        """The same layer without some tensors (nothing is read)."""
        return LayerWeights(self.store, self.layer_index, self._names, self._overrides, self._dropped | set(shorts))


def replace_weights(w: Mapping, drop: tuple[str, ...] = (), **tensors: Any) -> Mapping:
    """``w`` with ``tensors`` replaced and ``drop`` removed, lazily for :class:`LayerWeights`
    (a weight transform of the layers stage's hypotheses or a fault)."""
    if isinstance(w, LayerWeights):
        return w.without(*drop).replaced(**tensors) if drop else w.replaced(**tensors)
    out = {k: v for k, v in w.items() if k not in drop} if drop else dict(w)
    out.update(tensors)
    return out


# ---------------------------------------------------------------------------------------
# the store


def _identity(model: GGUFModel) -> tuple:
    """What makes two opened files the same weights: path, size and modification time."""
    path = str(model.path)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        mtime = 0
    return (path, model.file_size, mtime)


class _BlockOffsets:
    """A weight's group offsets read from its blocks when an emulation first asks (gguf/quants/
    offsets.py), then kept: what llama.cpp's CUDA q8_1 forms multiply activation sums with."""

    def __init__(self, model, name: str, qtype: str, start: int, stop: int):
        self.model, self.name, self.qtype, self.start, self.stop = model, name, qtype, start, stop
        self._value = None

    def __call__(self):
        if self._value is None:
            self._value = group_offsets(self.qtype, self.model.raw_rows(self.name, self.start, self.stop))
        return self._value


class WeightStore:
    """Dequantized tensors of one GGUF model in a working dtype on a device.

    ``streaming``: True caches nothing, False caches everything, None (default) caches up to
    the shared :class:`WeightCache`'s budget."""

    def __init__(self, model: GGUFModel, dtype: torch.dtype, device: str | torch.device,
                 streaming: bool | None = None, cache: WeightCache | None = None):
        self.model = model
        self.dtype = dtype
        self.device = torch.device(device)
        self.streaming = streaming
        self.cache = WeightCache(0) if streaming else WeightCache(1 << 62) if streaming is False else \
            (cache if cache is not None else shared_cache())
        self.identity = _identity(model)
        self.cache.attach(self.identity)
        self._closed = False
        self._head: list[tuple[int, Tensor]] | None = None  # the output head, when kept whole
        self._layer_names: dict[int, dict[str, str]] = {}
        for name in model.tensors:
            if name.startswith("blk."):
                layer = int(name.split(".", 2)[1])
                self._layer_names.setdefault(layer, {})[name.split(".", 2)[2]] = name
        self._item = torch.finfo(dtype).bits // 8

    # -- tensors ---------------------------------------------------------------------
    def tensor(self, name: str, rows: slice | None = None) -> Tensor:
        """One tensor (or rows of its 2-D view) dequantized to the working dtype and device."""
        stored = torch.float32 if self.cache.compact else self.dtype
        key = (self.identity, name, None if rows is None else (rows.start, rows.stop), stored, str(self.device))
        t = self.cache.get(key)
        if t is None:
            t = self._dequantize(name, rows, stored)
            self.cache.offer(key, t)
        if t.dtype != self.dtype:  # compact storage, widened for this use (exact: the values are float32)
            wide = t.to(self.dtype)
            wide.ggml_type = t.ggml_type
            for tag in ("ggml_offsets", "ggml_f32_sums"):
                if hasattr(t, tag):
                    setattr(wide, tag, getattr(t, tag))
            return wide
        return t

    def _dequantize(self, name: str, rows: slice | None, dtype: torch.dtype | None = None) -> Tensor:
        info = self.model.tensors[name]
        dtype = dtype or self.dtype
        if dtype == torch.float64 and self.device.type == "cpu":  # float32 values widened block by block
            start, stop = (0, info.n_rows) if rows is None else (rows.start or 0, rows.stop)
            t = dequantize_wide(self.model, name, start, stop)
            if rows is None:
                t = t.reshape(info.shape)
        else:
            with warnings.catch_warnings():  # F32 data comes back as a read-only view of the mmap
                warnings.filterwarnings("ignore", message=".*not writable.*")
                t = dequantize_tensor(self.model, name, rows=rows, device=self.device)  # float32 (exact)
            t = t.to(dtype=dtype, device=self.device)  # a copy unless fp32 on the device already
        # the stored type, read where an emulated engine rounds by weight type
        # (precision.unrounded_sums_error: only weights with a per-block offset)
        t.ggml_type = info.qtype.name
        if _asks_f32_sums(self.model, name):
            t.ggml_f32_sums = True
        if group_size(info.qtype.name) is not None and len(info.shape) >= 2:  # read where an emulation needs them
            start, stop = (0, info.n_rows) if rows is None else (rows.start or 0, rows.stop)
            t.ggml_offsets = _BlockOffsets(self.model, name, info.qtype.name, start, stop)
        if rows is None:
            self.model.release_rows(name)
        else:
            self.model.release_rows(name, rows.start or 0, rows.stop)
        return t

    def lazy(self, name: str) -> Any:
        """A tensor as the layer code reads it: a plain tensor, or an :class:`ExpertStack` /
        :class:`RowBlocked` view for those too big to read whole."""
        info = self.model.tensors[name]
        if len(info.shape) == 3 and "_exps." in name and name.endswith(".weight"):
            return ExpertStack(self, name)
        if len(info.shape) == 2:
            return self.matrix(name, (0, info.n_rows))
        return self.tensor(name)

    def matrix(self, name: str, rows: tuple[int, int]) -> Any:
        """Rows of a matrix: a plain tensor, or :class:`RowBlocked` when larger than
        ROW_BLOCK_BYTES (and not kept whole)."""
        info = self.model.tensors[name]
        whole = rows == (0, info.n_rows)
        if (rows[1] - rows[0]) * info.row_elements * self._item > ROW_BLOCK_BYTES and self.streaming is not False:
            return RowBlocked(self, name, rows)
        return self.tensor(name, None if whole else slice(*rows))

    def has(self, name: str) -> bool:
        return name in self.model.tensors

    def global_tensor(self, name: str) -> Tensor:
        """A small non-layer tensor (output_norm, rope_freqs), always kept once read."""
        key = (self.identity, name, None, self.dtype, str(self.device))
        t = self.cache.get(key)
        if t is None:
            t = self._dequantize(name, None)
            self.cache.offer(key, t, force=True)
        return t

    def layer(self, i: int) -> Mapping[str, Any]:
        """Layer i's tensors by short name ("attn_q.weight"), each read when looked up."""
        return LayerWeights(self, i, self._layer_names.get(i, {}))

    def layer_names(self, i: int) -> dict[str, str]:
        """Layer i's tensors: short name -> GGUF name."""
        return dict(self._layer_names.get(i, {}))

    def release(self, i: int) -> None:
        """Kept for callers that mark the end of a layer: pages are released as each tensor is
        read, so nothing is left to do."""

    def layer_bytes(self, i: int) -> int:
        """Bytes of layer i in the file (quantized)."""
        return sum(self.model.tensors[n].nbytes for n in self._layer_names.get(i, {}).values())

    # -- embedding and output head ---------------------------------------------------
    def embed_rows(self, tokens: list[int]) -> Tensor:
        """token_embd rows for the given tokens [T, D], reading only those rows."""
        info = self.model.tensors["token_embd.weight"]
        unique = sorted(set(tokens))
        raw = self.model.raw(info.name).reshape(info.n_rows, -1)[unique]  # [U, row_bytes]: a copy of those rows
        rows = torch.from_numpy(dequantize(raw, info.qtype)).to(dtype=self.dtype, device=self.device)  # [U, D]
        self._release_pages(info)
        where = {t: i for i, t in enumerate(unique)}
        return rows[torch.tensor([where[t] for t in tokens], device=self.device)]  # [T, D]

    def head_chunks(self, chunk_rows: int) -> Iterator[tuple[int, Tensor]]:
        """The output head (or tied token_embd) as (first row, [rows, D]) chunks: one chunk
        when the cache keeps it whole, else ``chunk_rows`` rows at a time."""
        if self._head is not None:
            yield from self._head
            return
        name = "output.weight" if self.has("output.weight") else "token_embd.weight"
        info = self.model.tensors[name]
        size = info.n_elements * self._item
        if self.streaming is False or self.cache.used + size <= self.cache.budget:
            whole = [(0, self.tensor(name))]  # kept by the cache
            if not self.cache.compact:  # (compact: widened anew on each use, not held twice)
                self._head = whole
            yield from whole
            return
        for start in range(0, info.n_rows, chunk_rows):
            yield start, self._dequantize(name, slice(start, min(start + chunk_rows, info.n_rows)))

    def _release_pages(self, info: TensorInfo, row_start: int = 0, row_stop: int | None = None) -> None:
        self.model.release_rows(info.name, row_start, row_stop)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._head = None
            self.cache.detach(self.identity)


# the matmuls llama.cpp asks f32 sums of, per architecture (llama-graph.cpp ggml_prec_set_acc, "numerical
# issues with half-precision accumulators"), which its CUDA kernels follow (precision.Emulation.float_form)
F32_SUMS = {"glm4moe": (".attn_output.weight", ".ffn_down.weight", ".ffn_down_shexp.weight")}


def _asks_f32_sums(model, name: str) -> bool:
    return name.startswith("blk.") and name.endswith(F32_SUMS.get(model.architecture or "", ()))
