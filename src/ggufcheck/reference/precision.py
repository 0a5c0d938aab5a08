"""Emulating an engine's precision class on the reference: the honest baseline of each run.

A correct engine differs from the fp64 reference by its own rounding, and how much depends
on everything that sets its precision (weights, activations, KV cache), on the prompt (long
prompts accumulate more; a DSA top-k or MoE routing near-tie flips a whole selection), and
on the model. A stated allowance measured on a few short prompts cannot cover that. So the
baseline run of the reference can round the way the engine's class does, on the very tokens
being judged, and its error against fp64 becomes that run's expected error:

- ``q8``: llama.cpp on CPU quantizes the activations entering a matmul with a quantized
  weight to 8-bit blocks (Q8_0: 32 values per scale for Q4_0..Q8_0 weights; Q8_K: 256 for the
  K-quants), and keeps its KV cache in f16 (its default type_k / type_v);
- ``bf16`` / ``fp16``: every matmul's input and output, and the KV cache, in that type;
- ``gelu`` ``f16``: ggml's CPU GELU is a table over f16 inputs with f16 values
  (``GGML_GELU_FP16`` in ggml-cpu/vec.h), whatever the weights: gemma's GeGLU rounds there;
- ``block_sums`` ``unrounded``: llama.cpp's CUDA q8_1 form for weights with a per-block
  offset (Q4_1 / Q5_1: ``w = d*q + m``). Its quantizers (``quantize_q8_1``,
  ``quantize_mmq_q8_1``) keep each 32-block's sum of the activations BEFORE rounding (in f16),
  where the CPU's keep the sum of the rounded ones; the offset term ``m * sum`` then no longer
  cancels the rounding's common mode, ~5x the CPU's KL on these types (docs/real-world-cases.md).

It is an emulation of the rounding's size, not of the engine's exact arithmetic, so the
diagnosis only ever widens a stated allowance with it (checks.compare.combined_baseline),
never narrows one.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

# weight types by ggml name: the K-quants' matmuls take Q8_K (256-value blocks) activations
K_QUANTS = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
UNQUANTIZED = frozenset({"F32", "F16", "BF16", "F64"})
# the types whose blocks carry an offset next to the scale (w = d*q + m): where block sums of
# the activations enter a product (block_sums)
OFFSET_TYPES = frozenset({"Q4_1", "Q5_1"})


@dataclass(frozen=True)
class Emulation:
    """How the reference rounds while emulating an engine's class. Kinds: "q8_0" / "q8_k"
    (8-bit blocks of 32 / 256 values), "f16", "bf16"; None: unchanged."""

    activations: str | None = None  # a matmul's input
    outputs: str | None = None  # a matmul's result
    kv: str | None = None  # what the KV cache stores
    gelu: str | None = None  # the GELU's input and value ("f16": ggml's CPU table)
    # "unrounded": a Q4_1 / Q5_1 weight's offset multiplies the block sum of the activations
    # before rounding (llama.cpp CUDA's q8_1 form); other weights are unchanged
    block_sums: str | None = None

    def describe(self) -> str:
        parts = [f"{what} {kind}" for what, kind in (("activations", self.activations),
                                                       ("matmul outputs", self.outputs),
                                                       ("KV cache", self.kv),
                                                       ("GELU", self.gelu),
                                                       ("block sums", self.block_sums)) if kind]
        return ", ".join(parts) or "nothing"


def round_as(x: Tensor, kind: str | None) -> Tensor:
    """``x`` rounded the way ``kind`` stores it, back in x's dtype."""
    if kind is None:
        return x
    if kind in ("f16", "bf16"):
        return x.to(torch.float16 if kind == "f16" else torch.bfloat16).to(x.dtype)
    block = {"q8_0": 32, "q8_k": 256}[kind]
    n = x.shape[-1]
    if n % block:  # ggml requires whole blocks; a ragged row is left as it is
        return x
    blocks = x.reshape(*x.shape[:-1], n // block, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe).clamp(-127, 127)
    if kind == "q8_0":  # ggml keeps the Q8_0 scale in f16
        safe = safe.to(torch.float16).to(x.dtype)
    return (q * safe).reshape(x.shape)


def unrounded_sums_error(x: Tensor, rounded: Tensor, weight: Tensor, block: int = 32) -> Tensor | None:
    """What llama.cpp's CUDA q8_1 form takes from ``linear(rounded, weight)`` for a Q4_1 / Q5_1
    weight [out, in]: each 32-block's offset ``m`` (the block's smallest dequantized value: ggml's
    and gguf-py's Q4_1 / Q5_1 quantizers give the minimum the quant 0) times the difference of
    the rounded activations' block sum and the kept one (the unrounded sum, stored in f16).
    CUDA computes ``sum((w - m) * rounded) + m * f16(sum(x))`` per block; the CPU's form
    ``sum(w * rounded)`` is ``linear(rounded, weight)``. None for a ragged row, and for a weight
    of another type (``weight.ggml_type``, set by the reference's WeightStore; a weight without
    it, e.g. one a family rebuilt, is treated as Q4_1 / Q5_1 only when tagged so)."""
    n = x.shape[-1]
    if n % block or weight.shape[-1] != n or getattr(weight, "ggml_type", None) not in OFFSET_TYPES:
        return None
    nb = n // block
    rounded_sum = rounded.reshape(*rounded.shape[:-1], nb, block).sum(-1)  # [.., nb]
    kept_sum = x.reshape(*x.shape[:-1], nb, block).sum(-1).to(torch.float16).to(x.dtype)  # [.., nb]
    offsets = weight.reshape(weight.shape[0], nb, block).amin(-1).to(x.dtype)  # [out, nb]
    return (rounded_sum - kept_sum) @ offsets.T  # [.., out]


def gelu_tanh(x: Tensor) -> Tensor:
    """tanh GELU, rounded as an emulated engine's GELU is (ggml's CPU f16 table: input and
    value in f16, exact outside |x| < 10 where it returns 0 or x)."""
    emulation = current()
    kind = emulation.gelu if emulation is not None else None
    if kind is None:
        return torch.nn.functional.gelu(x, approximate="tanh")
    y = round_as(torch.nn.functional.gelu(round_as(x, kind), approximate="tanh"), kind)
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


_CURRENT: ContextVar[Emulation | None] = ContextVar("ggufcheck_emulation", default=None)


@contextmanager
def emulating(emulation: Emulation | None) -> Iterator[None]:
    """Within the block, the reference's matmuls and caches round as ``emulation`` says."""
    token = _CURRENT.set(emulation)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Emulation | None:
    return _CURRENT.get()


def emulation_of(capabilities, weight_types: list[str]) -> Emulation | None:
    """The emulation of an engine: where it says it rounds (Capabilities.rounding), else its
    numerical class (:func:`emulation_for`)."""
    if capabilities.rounding:
        return Emulation(**dict(capabilities.rounding))
    return emulation_for(capabilities.activation_dtype, weight_types)


def emulation_for(activation_class: str, weight_types: list[str]) -> Emulation | None:
    """The emulation of an engine's numerical class (engines.base.Capabilities.activation_dtype)
    over a model whose matmul weights have the ggml types ``weight_types`` ("Q4_K", ...);
    None for fp32 / fp64."""
    if activation_class in ("bf16", "fp16"):
        kind = "bf16" if activation_class == "bf16" else "f16"
        return Emulation(activations=kind, outputs=kind, kv=kind)
    if activation_class == "q8":
        quantized = [t for t in weight_types if t not in UNQUANTIZED]
        if not quantized:
            return Emulation(kv="f16")
        k_share = sum(t in K_QUANTS for t in quantized) / len(quantized)
        return Emulation(activations="q8_k" if k_share > 0.5 else "q8_0", kv="f16")
    return None


def matmul_weight_types(tensors) -> list[str]:
    """The ggml type names of a GGUF's 2-D+ layer weights and output head (``tensors``: name ->
    TensorInfo), the ones an engine multiplies activations with."""
    return [info.type_name for name, info in tensors.items()
            if len(info.shape) >= 2 and (name.startswith("blk.") or name == "output.weight")]
