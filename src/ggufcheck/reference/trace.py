"""Traces: what the reference computed, saved as golden states for later comparison.

A trace holds, for one token sequence, the input embeddings, per layer the residual after
attention and after the FFN / MoE, the attention and FFN / MoE outputs, the router's
choices (expert ids and final weights) and the DSA indexer's top-k, and the final
log-softmax over the full vocabulary. On disk it is two files side by side:

- ``NAME.safetensors``: the tensors, named ``embeddings``, ``logprobs`` and
  ``layers.<i>.<field>`` (fields as in :class:`TracedLayer`);
- ``NAME.json``: metadata: model file fingerprint, tokens, dtype, architecture, the
  reference options, the ggufcheck version.

Stages that compare or bisect read a trace and replay one layer::

    trace = Trace.load("golden")
    out = trace.replay(ReferenceModel(path), i)      # == trace.layers[i] up to rounding
    x = trace.layer_input(i)                          # [T, D], what layer i was given
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ggufcheck import __version__
from ggufcheck.errors import BadFileError

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.reference.cache import LayerOutput
    from ggufcheck.reference.model import ReferenceModel

TRACE_FORMAT = 1
FULL_HASH_LIMIT = 2 << 30  # files up to 2 GiB are hashed whole; larger ones fingerprinted
_SAMPLE = 1 << 20
_N_SAMPLES = 64


@dataclass
class TracedLayer:
    """One layer's recorded states (all [T, D] unless noted)."""

    after_attn: Tensor  # residual after attention
    hidden: Tensor  # residual after FFN / MoE: the layer's output
    attn_out: Tensor
    ffn_out: Tensor
    expert_ids: Tensor | None = None  # [T, K]
    expert_weights: Tensor | None = None  # [T, K]
    topk: Tensor | None = None  # [T, k] DSA key indices, -1 = none
    topk_ties: Tensor | None = None  # [T] bool: k-th and (k+1)-th indexer scores equal
    topk_full: bool = False  # the layer ran its own indexer
    topk_gap: Tensor | None = None  # [T] relative k-th / (k+1)-th score gap (reference.dsa.boundary_gap)
    router_gap: Tensor | None = None  # [T] MoE routing margin (reference.layers.router_gap)

    @classmethod
    def from_output(cls, out: "LayerOutput") -> "TracedLayer":
        return cls(out.after_attn, out.hidden, out.attn_out, out.ffn_out, out.expert_ids,
                   out.expert_weights, out.topk, out.topk_ties, out.topk_full,
                   out.topk_gap, out.router_gap)


@dataclass
class Trace:
    """A reference run over ``tokens``; see the module docstring for the file format."""

    tokens: list[int]
    dtype: str  # "fp32" | "fp64"
    meta: dict[str, Any]  # fingerprint, arch, options, version, ...
    embeddings: Tensor  # [T, D]
    layers: list[TracedLayer]
    logprobs: Tensor  # [T, vocab] log-softmax of the logits

    # -- built from a run ------------------------------------------------------------
    @classmethod
    def from_run(cls, ref: "ReferenceModel", tokens: list[int], embeddings: Tensor,
                 outputs: list["LayerOutput"], logits: Tensor) -> "Trace":
        cfg = ref.cfg
        meta = {
            "format": TRACE_FORMAT,
            "ggufcheck_version": __version__,
            "model_path": str(ref.path),
            "model_fingerprint": ref.fingerprint,
            "architecture": cfg.arch,
            "n_layer": cfg.n_layer,
            "device": str(ref.device),
            "options": {"mla_form": cfg.mla_form, "lora_norm_eps": cfg.lora_norm_eps,
                        "indexer_norm_eps": cfg.indexer_norm_eps, "streaming": ref.streaming},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        dtype = "fp64" if ref.dtype == torch.float64 else "fp32"
        return cls(list(tokens), dtype, meta, embeddings, [TracedLayer.from_output(o) for o in outputs],
                   torch.log_softmax(logits, dim=-1))

    # -- reading ---------------------------------------------------------------------
    @property
    def positions(self) -> Tensor:
        return torch.arange(len(self.tokens))

    def layer_input(self, i: int) -> Tensor:
        """What layer i was given: the embeddings for layer 0, else layer i-1's output."""
        return self.embeddings if i == 0 else self.layers[i - 1].hidden

    def shared_topk(self, i: int) -> Tensor | None:
        """For a glm-dsa shared indexer layer: the top-k of the latest full layer before it."""
        for j in range(i - 1, -1, -1):
            if self.layers[j].topk_full:
                return self.layers[j].topk
        return None

    def replay(self, ref: "ReferenceModel", i: int) -> "LayerOutput":
        """Run the reference's layer i on this trace's input to it (no cache, causal)."""
        shared = None if self.layers[i].topk_full else self.shared_topk(i)
        return ref.run_layer(i, self.layer_input(i), self.positions, shared_topk=shared)

    def top_predictions(self, k: int = 5) -> tuple[Tensor, Tensor]:
        """(log-probs [T, k], token ids [T, k]) of the k most likely next tokens per position."""
        best = self.logprobs.topk(k, dim=-1)
        return best.values, best.indices

    # -- files -----------------------------------------------------------------------
    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Write ``NAME.safetensors`` and ``NAME.json`` (``path`` with or without suffix)."""
        from safetensors.torch import save_file

        tensors_path, meta_path = _paths(path)
        tensors: dict[str, Tensor] = {"embeddings": self.embeddings, "logprobs": self.logprobs}
        for i, layer in enumerate(self.layers):
            for f in fields(TracedLayer):
                value = getattr(layer, f.name)
                if isinstance(value, Tensor):
                    tensors[f"layers.{i}.{f.name}"] = value
        save_file({k: v.detach().cpu().clone() for k, v in tensors.items()}, str(tensors_path))  # clone: shared layers alias top-k
        meta = dict(self.meta, tokens=self.tokens, dtype=self.dtype,
                    topk_full=[layer.topk_full for layer in self.layers], n_layer=len(self.layers))
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        return tensors_path, meta_path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Read a trace written by :meth:`save`."""
        from safetensors.torch import load_file

        tensors_path, meta_path = _paths(path)
        for p in (tensors_path, meta_path):
            if not p.exists():
                raise BadFileError(p, "trace file not found", tip="a trace is NAME.safetensors + NAME.json")
        try:
            meta = json.loads(meta_path.read_text())
            tensors = load_file(str(tensors_path))
        except Exception as err:  # json / safetensors errors (SafetensorError is not an OSError)
            raise BadFileError(tensors_path, f"not a readable trace: {err}") from None
        if meta.get("format") != TRACE_FORMAT:
            raise BadFileError(meta_path, f"trace format {meta.get('format')!r}, expected {TRACE_FORMAT}")
        missing = [k for k in ("tokens", "dtype", "n_layer", "topk_full") if k not in meta]
        if missing or "embeddings" not in tensors or "logprobs" not in tensors:
            raise BadFileError(meta_path, f"incomplete trace (missing {missing or 'tensors'})")
        layers = []
        for i in range(meta["n_layer"]):
            parts = {f.name: tensors.get(f"layers.{i}.{f.name}") for f in fields(TracedLayer) if f.name != "topk_full"}
            layers.append(TracedLayer(**parts, topk_full=bool(meta["topk_full"][i])))
        tokens, dtype = meta.pop("tokens"), meta.pop("dtype")
        meta.pop("topk_full")
        return cls(tokens, dtype, meta, tensors["embeddings"], layers, tensors["logprobs"])


def _paths(path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    stem = path.with_suffix("") if path.suffix in (".safetensors", ".json") else path
    return stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")


def model_fingerprint(model: Any) -> dict[str, Any]:
    """Identify the model file(s): sha256 of every byte up to 2 GiB in total, else a
    sha256 of each part's header (metadata + tensor table), its size and 64 1-MiB samples
    spread over its data (method "sampled": cheap, catches any re-quantization or truncation
    but not a single flipped byte between samples)."""
    parts = model.parts  # [(path, size, data_start)]
    total = sum(size for _, size, _ in parts)
    digest = hashlib.sha256()
    method = "sha256" if total <= FULL_HASH_LIMIT else "sampled"
    for path, size, data_start in parts:
        with open(path, "rb") as f:
            if method == "sha256":
                while chunk := f.read(8 << 20):
                    digest.update(chunk)
            else:
                digest.update(size.to_bytes(8, "little"))
                digest.update(f.read(data_start))
                span = max(0, size - data_start - _SAMPLE)
                for k in range(_N_SAMPLES):
                    f.seek(data_start + span * k // (_N_SAMPLES - 1))
                    digest.update(f.read(_SAMPLE))
    return {"method": method, "value": digest.hexdigest(), "size": total}
