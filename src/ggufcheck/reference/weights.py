"""The reference's weights: the file's own dequantized values, by GGUF tensor name.

Weights are read straight from the GGUF layout (split k_b / v_b, stacked experts), never
from an HF rebuild, so the reference and the rebuild can check each other.

Two modes:
- resident: each layer's tensors are dequantized once and kept (small models, decode).
- streaming: a layer's tensors are dequantized when it runs and dropped after, and the
  mmap pages they came from are released (``madvise(MADV_DONTNEED)``), so peak memory is
  about one layer plus activations plus the embedding rows and an output-head chunk,
  whatever the file size. The embedding is read row by row for the prompt's tokens only,
  and the output head in row chunks.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from torch import Tensor

from ggufcheck.gguf.dequant import dequantize, dequantize_tensor
from ggufcheck.gguf.reader import GGUFModel, TensorInfo



class WeightStore:
    """Dequantized tensors of one GGUF model in a working dtype on a device."""

    def __init__(self, model: GGUFModel, dtype: torch.dtype, device: str | torch.device, streaming: bool):
        self.model = model
        self.dtype = dtype
        self.device = torch.device(device)
        self.streaming = streaming
        self._layers: dict[int, dict[str, Tensor]] = {}
        self._globals: dict[str, Tensor] = {}
        self._head: list[tuple[int, Tensor]] | None = None  # resident mode: chunks kept
        self._layer_names: dict[int, list[str]] = {}
        for name in model.tensors:
            if name.startswith("blk."):
                layer = int(name.split(".", 2)[1])
                self._layer_names.setdefault(layer, []).append(name)

    # -- tensors ---------------------------------------------------------------------
    def tensor(self, name: str, rows: slice | None = None) -> Tensor:
        """One tensor (or rows of its 2-D view) dequantized to the working dtype and device."""
        with warnings.catch_warnings():  # F32 data comes back as a read-only view of the mmap
            warnings.filterwarnings("ignore", message=".*not writable.*")
            t = dequantize_tensor(self.model, name, rows=rows)
        t = t.to(dtype=self.dtype, device=self.device)  # a copy unless fp32 on cpu
        # the stored type, read where an emulated engine rounds by weight type
        # (precision.unrounded_sums_error: only weights with a per-block offset)
        t.ggml_type = self.model.tensors[name].qtype.name
        return t

    def has(self, name: str) -> bool:
        return name in self.model.tensors

    def global_tensor(self, name: str) -> Tensor:
        """A small non-layer tensor (output_norm, rope_freqs), kept once read."""
        if name not in self._globals:
            self._globals[name] = self.tensor(name)
        return self._globals[name]

    def layer(self, i: int) -> dict[str, Tensor]:
        """Layer i's tensors by short name ("attn_q.weight"); kept unless streaming."""
        if i in self._layers:
            return self._layers[i]
        prefix = f"blk.{i}."
        weights = {name[len(prefix):]: self.tensor(name) for name in self._layer_names.get(i, [])}
        if not self.streaming:
            self._layers[i] = weights
        return weights

    def release(self, i: int) -> None:
        """Streaming: forget layer i and give its mmap pages back to the OS."""
        if self.streaming:
            self._layers.pop(i, None)
            for name in self._layer_names.get(i, []):
                self._release_pages(self.model.tensors[name])

    def layer_bytes(self, i: int) -> int:
        """Bytes of layer i in the file (quantized)."""
        return sum(self.model.tensors[n].nbytes for n in self._layer_names.get(i, []))

    # -- embedding and output head ---------------------------------------------------
    def embed_rows(self, tokens: list[int]) -> Tensor:
        """token_embd rows for the given tokens [T, D], reading only those rows."""
        info = self.model.tensors["token_embd.weight"]
        unique = sorted(set(tokens))
        raw = self.model.raw(info.name).reshape(info.n_rows, -1)[unique]  # [U, row_bytes]: a copy of those rows
        rows = torch.from_numpy(dequantize(raw, info.qtype)).to(dtype=self.dtype, device=self.device)  # [U, D]
        if self.streaming:
            self._release_pages(info)
        where = {t: i for i, t in enumerate(unique)}
        return rows[torch.tensor([where[t] for t in tokens], device=self.device)]  # [T, D]

    def head_chunks(self, chunk_rows: int) -> Iterator[tuple[int, Tensor]]:
        """The output head (or tied token_embd) as (first row, [rows, D]) chunks; kept once
        read unless streaming."""
        if self._head is not None:
            yield from self._head
            return
        name = "output.weight" if self.has("output.weight") else "token_embd.weight"
        info = self.model.tensors[name]
        if not self.streaming:
            self._head = [(0, self.tensor(name))]
            yield from self._head
            return
        for start in range(0, info.n_rows, chunk_rows):
            yield start, self.tensor(name, rows=slice(start, min(start + chunk_rows, info.n_rows)))
            if self.streaming:
                self._release_pages(info, start, min(start + chunk_rows, info.n_rows))

    def _release_pages(self, info: TensorInfo, row_start: int = 0, row_stop: int | None = None) -> None:
        self.model.release_rows(info.name, row_start, row_stop)
