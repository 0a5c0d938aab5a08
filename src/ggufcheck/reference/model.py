"""The reference model: what a GGUF file should compute, layer by layer.

``ReferenceModel`` ties the pieces together: the config (config.py), the file's
dequantized weights (weights.py), one family module for the layers (dense.py, gemma3.py,
gqa_moe.py, mla_moe.py) and the KV cache (cache.py). It offers

- :meth:`ReferenceModel.prefill`: a whole prompt at once, optionally recorded as a
  :class:`~ggufcheck.reference.trace.Trace`;
- :meth:`ReferenceModel.decode`: token by token through the KV cache (must equal prefill);
- :meth:`ReferenceModel.run_layer`: ONE layer on given inputs (replay), for stages that
  bisect layers or compare an engine's per-layer states with the reference's.

Arithmetic is fp32 or fp64 on CPU or CUDA; weights are dequantized per tensor (per expert)
when a layer reads them and kept up to a shared budget (weights.py).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ggufcheck.errors import UsageError
from ggufcheck.gguf.reader import GGUFModel, open_gguf
from ggufcheck.reference.cache import KVCache, LayerOutput
from ggufcheck.reference.config import ReferenceConfig, config_from_gguf
from ggufcheck.reference.layers import linear, rms_norm, rope_cos_sin, rope_inv_freq
from ggufcheck.reference.precision import Emulation, emulating
from ggufcheck.reference.weights import WeightStore

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
_ROPE_FIELDS = ("n_rot", "rope_base", "rope_base_swa", "rope_freq_scale", "yarn", "swa_window", "swa_layers",
                "swa_same_rope")
HEAD_CHUNK_ROWS = 16384  # output-head rows dequantized at a time


class ReferenceModel:
    """The reference forward pass over one GGUF model file.

    Args:
        model: a path or an open :class:`GGUFModel` (never written).
        dtype: ``torch.float64`` (default) or ``torch.float32``, or "fp64" / "fp32".
        device: "cpu" or "cuda[:n]".
        streaming: True keeps no dequantized weight once used, False keeps every one, None
            (default) keeps them up to the process's shared weight cache budget
            (``reference/weights.py``), shared with every other copy over the same file.
        options: config overrides, e.g. ``mla_form="absorbed"``, ``lora_norm_eps=1e-6``.
    """

    def __init__(self, model: str | os.PathLike | GGUFModel, dtype: torch.dtype | str = torch.float64,
                 device: str | torch.device = "cpu", streaming: bool | None = None, **options: Any):
        self.gguf = model if isinstance(model, GGUFModel) else open_gguf(model)
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        if self.dtype not in (torch.float32, torch.float64):
            raise UsageError(f"the reference computes in fp32 or fp64, not {self.dtype}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: torch has no CUDA device here", tip="use --device cpu")
        # an engine's precision class to emulate (precision.py): the baseline run's rounding
        self.emulation: Emulation | None = options.pop("emulate", None)
        cfg = config_from_gguf(self.gguf.metadata, self.gguf.tensors, str(self.gguf.path))
        self.cfg: ReferenceConfig = cfg.with_options(**options) if options else cfg
        self.streaming = streaming
        self.weights = WeightStore(self.gguf, self.dtype, self.device, self.streaming)
        self.family = importlib.import_module(f"ggufcheck.reference.{self.cfg.family}")
        freq_factors = self.weights.global_tensor("rope_freqs.weight") if self.cfg.has_rope_freqs else None
        self._fingerprint: dict[str, Any] | None = None
        self.inv_freq = rope_inv_freq(self.cfg.n_rot, self.cfg.rope_base, self.cfg.yarn, freq_factors) \
            * self.cfg.rope_freq_scale
        # sliding-window layers (gemma3): their own base, no scaling (llama.cpp rope_freq_*_train_swa)
        self.inv_freq_swa = (rope_inv_freq(self.cfg.n_rot, self.cfg.rope_base_swa)
                             if any(self.cfg.swa_layers) and not self.cfg.swa_same_rope else self.inv_freq)

    @property
    def path(self) -> Path:
        return Path(self.gguf.path)

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The model file's identity for traces (computed once; see trace.model_fingerprint)."""
        if self._fingerprint is None:
            from ggufcheck.reference.trace import model_fingerprint

            self._fingerprint = model_fingerprint(self.gguf)
        return self._fingerprint

    # -- pieces ----------------------------------------------------------------------
    def embed(self, tokens: list[int]) -> Tensor:
        """Token embeddings [T, D] (the input of layer 0; times sqrt(D) for gemma)."""
        bad = [t for t in tokens if not 0 <= t < self.gguf.tensors["token_embd.weight"].shape[0]]
        if bad:
            raise UsageError(f"token ids out of range for this vocabulary: {bad[:5]}")
        rows = self.weights.embed_rows(tokens)
        return rows * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else rows

    def rope(self, positions: Tensor, layer: int | None = None,
             cfg: ReferenceConfig | None = None) -> tuple[Tensor, Tensor]:
        """cos, sin [T, n_rot/2] for these positions (at ``layer``: a sliding-window layer has
        its own base); ``cfg``: another config's rope (a localization hypothesis)."""
        swa = layer is not None and (cfg or self.cfg).is_swa_layer(layer) and not (cfg or self.cfg).swa_same_rope
        if cfg is not None and any(getattr(cfg, f) != getattr(self.cfg, f) for f in _ROPE_FIELDS):
            freq_factors = self.weights.global_tensor("rope_freqs.weight") if cfg.has_rope_freqs else None
            inv = (rope_inv_freq(cfg.n_rot, cfg.rope_base_swa) if swa else
                   rope_inv_freq(cfg.n_rot, cfg.rope_base, cfg.yarn, freq_factors) * cfg.rope_freq_scale)
            return rope_cos_sin(positions, inv, self.dtype)
        return rope_cos_sin(positions, self.inv_freq_swa if swa else self.inv_freq, self.dtype)

    @torch.no_grad()
    def run_layer(self, i: int, hidden_in: Tensor, positions: Tensor | list[int] | None = None,
                  cache: KVCache | None = None, shared_topk: Tensor | None = None,
                  release: bool = True) -> LayerOutput:
        """Run ONE layer (replay) on ``hidden_in`` [T, D] at ``positions`` [T].

        Without a cache the layer attends over exactly these T tokens (causal), as in
        prefill. With a cache, its cached keys come first (``cache.positions`` must already
        include ``positions``, as :meth:`forward` arranges). ``shared_topk`` [T, k] gives a
        glm-dsa *shared* indexer layer the indices of the latest full layer (from a trace).
        """
        if not 0 <= i < self.cfg.n_layer:
            raise UsageError(f"layer {i} out of range 0..{self.cfg.n_layer - 1}")
        h = hidden_in.to(dtype=self.dtype, device=self.device)
        if positions is None:
            positions = torch.arange(h.shape[0])
        q_pos = torch.as_tensor(positions, dtype=torch.int64, device=self.device)
        if cache is None:
            cache, k_pos = KVCache(), q_pos
        else:
            k_pos = cache.positions
        shared = {} if shared_topk is None else {"topk": shared_topk.to(self.device)}
        return self._layer(i, h, q_pos, k_pos, cache, shared, release)

    def _layer(self, i: int, h: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache, shared: dict,
               release: bool = True) -> LayerOutput:
        w = self.weights.layer(i)
        with emulating(self._emulation_for(h.shape[0])):
            out = self.family.forward_layer(self.cfg, i, w, h, self.rope(q_pos, i), q_pos, k_pos, cache.layer(i), shared)
        del w
        if release:
            self.weights.release(i)
        return out

    def _emulation_for(self, tokens: int) -> Emulation | None:
        """The emulated engine's arithmetic for a forward over ``tokens`` tokens (precision.py:
        small batches take its matrix-vector kernels' form)."""
        return None if self.emulation is None else self.emulation.for_batch(tokens)

    def head(self, hidden: Tensor) -> Tensor:
        """Final norm and output head: residual [T, D] -> logits [T, vocab]."""
        x = rms_norm(hidden, self.weights.global_tensor("output_norm.weight"), self.cfg.rms_eps)
        logits = torch.empty((x.shape[0], self.cfg.n_vocab), dtype=x.dtype, device=x.device)  # filled in place:
        with emulating(self._emulation_for(x.shape[0])):  # a [T, V] concatenation would hold the logits twice
            for start, w in self.weights.head_chunks(HEAD_CHUNK_ROWS):
                logits[:, start:start + w.shape[0]] = linear(x, w)  # [T, rows]
        cap = self.cfg.final_softcap
        if cap > 0:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    # -- whole passes ----------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: list[int], cache: KVCache | None = None,
                keep_layers: bool | str = False) -> tuple[Tensor, list[LayerOutput], Tensor]:
        """New tokens (after whatever the cache holds) -> (logits [T, V], layer outputs, embeddings).

        ``keep_layers``: True keeps every layer's output, "marks" only its per-token marks
        (:meth:`LayerOutput.marks`), False none."""
        cache = KVCache() if cache is None else cache
        start = cache.length
        q_pos = torch.arange(start, start + len(tokens), dtype=torch.int64, device=self.device)
        k_pos = q_pos if cache.positions is None else torch.cat((cache.positions, q_pos))
        cache.positions = k_pos
        emb = self.embed(tokens)
        h, shared, outputs = emb, {}, []
        for i in range(self.cfg.n_layer):
            out = self._layer(i, h, q_pos, k_pos, cache, shared)
            h = out.hidden
            if keep_layers:
                outputs.append(out.marks() if keep_layers == "marks" else out)
            del out
        return self.head(h), outputs, emb

    def prefill(self, tokens: list[int], trace: bool = True):
        """The whole prompt at once. Returns a :class:`Trace` (or logits [T, V] if not trace)."""
        from ggufcheck.reference.trace import Trace

        if not tokens:
            raise UsageError("no tokens to run")
        logits, outputs, emb = self.forward(list(tokens), keep_layers=trace)
        if not trace:
            return logits
        return Trace.from_run(self, list(tokens), emb, outputs, logits)

    def prefill_marks(self, tokens: list[int]) -> tuple[Tensor, list[LayerOutput]]:
        """The whole prompt at once: (logits [T, V], each layer's marks only): scoring with the
        router / indexer near-ties, without holding every layer's states."""
        if not tokens:
            raise UsageError("no tokens to run")
        logits, marks, _ = self.forward(list(tokens), keep_layers="marks")
        return logits, marks

    def decode(self, tokens: list[int], cache: KVCache | None = None) -> Tensor:
        """Feed tokens one at a time through the KV cache; logits [T, V] (row t after token t)."""
        cache = KVCache() if cache is None else cache
        return torch.cat([self.forward([t], cache)[0] for t in tokens], dim=0)

    def close(self) -> None:
        self.weights.close()
        self.gguf.close()

    def __enter__(self) -> "ReferenceModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
