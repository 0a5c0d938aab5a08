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
- ``block_sums``: llama.cpp's CUDA q8_1 forms for weights with a group offset
  (``w = u*q + o``, gguf/quants/offsets.py). Its quantizers (``quantize_q8_1``,
  ``quantize_mmq_q8_1``) keep each group's sum of the activations BEFORE rounding (in f16),
  where the CPU's keep the sum of the rounded ones; the offset term ``o * sum`` then no longer
  cancels the rounding's common mode (~5x the CPU's KL on Q4_1 / Q5_1, docs/real-world-cases.md).
  Which types read which sums depends on the kernel (:data:`SUMS_FORMS`, from ggml-cuda's
  sources): ``cuda-mmq`` (the matrix-matrix kernels of a prefill: Q4_1, Q5_1, Q4_K, Q5_K, IQ1_S,
  and Q2_K with sums per 16 values and activation scales per 64), ``cuda-mmvq`` (the
  matrix-vector kernels of a decode step: Q4_0, Q5_0, Q4_1, Q5_1, IQ1_S), ``unrounded`` (Q4_1 /
  Q5_1 only: the form both share). ``decode_block_sums`` names the decode path's form where
  it differs from the prefill's (:meth:`Emulation.on_decode`);
- ``float_sums`` ``cuda``: how llama.cpp's CUDA backend multiplies unquantized weights on
  NVIDIA GPUs with tensor cores (Ampere and later), by the forward's token count
  (:meth:`Emulation.float_form`, from ggml-cuda's dispatch): F32 weights in a forward of more
  than 3 tokens on TF32 tensor cores (operands with 10-bit mantissas: the mmf kernels' tf32
  mma, and cuBLAS, whose every handle ggml-cuda creates with ``CUBLAS_TF32_TENSOR_OP_MATH``);
  F16 weights in a forward of more than 16 tokens in cuBLAS with an F16 compute type
  (``CUBLAS_COMPUTE_16F``: half-precision sums, each 16-product step of the tensor cores
  rounded to f16, and an f16 result). Fewer tokens take ggml's own kernels with f32 sums.
  Routed experts (``mul_mat_id``) take the mmf kernels up to 512 tokens: TF32 for F32 at any
  count. ``cuda-cublas-f32``: the same with ``GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32``, where cuBLAS
  multiplies F16 weights as F32 in TF32 math.

It is an emulation of the rounding's size, not of the engine's exact arithmetic, so the
diagnosis only ever widens a stated allowance with it (checks.compare.combined_baseline),
never narrows one.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Iterator

import torch
from torch import Tensor

# weight types by ggml name: the K-quants' matmuls take Q8_K (256-value blocks) activations
K_QUANTS = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
UNQUANTIZED = frozenset({"F32", "F16", "BF16", "F64"})
# the types whose blocks carry an offset next to the scale (w = d*q + m): where block sums of
# the activations enter a product (block_sums "unrounded")
OFFSET_TYPES = frozenset({"Q4_1", "Q5_1"})


@dataclass(frozen=True)
class SumsForm:
    """How one weight type's integer kernel multiplies its group offsets with activation sums:
    ``group`` values per offset and per kept (unrounded, f16) sum; ``scale_block`` activations
    per 8-bit scale; ``rounded_tail``: in each 128 values, the last this many take the sum of
    the rounded values instead (Q2_K's mmq: its q8_1 layout D2S6 keeps six sums of 16)."""

    group: int = 32
    scale_block: int = 32
    rounded_tail: int = 0


_LEGACY = SumsForm()
# ggml-cuda's column limits for unquantized weights on NVIDIA Ampere and later (mmvf.cu
# ggml_cuda_should_use_mmvf: F32 ``ne11 <= 3``; mmf.cu ggml_cuda_should_use_mmf: ``src1_ncols > 16``
# goes to cuBLAS) and the K of one f16 tensor-core step (mma m16n8k16), after which cuBLAS's
# F16 compute type rounds its running sum
CUDA_F32_VECTOR_MAX = 3
CUDA_MMF_MAX = 16
CUDA_MMF_EXPERTS_MAX = 512  # mul_mat_id (expert matrices of at most 1024 rows; wider ones: 128)
CUDA_MMF_EXPERTS_MAX_WIDE = 128
CUDA_MMF_EXPERTS_ROWS = 1024
# mmvf.cu ggml_cuda_should_use_mmvf on a 3-D F16 / BF16 stack: at most 512 rows (the fused
# one-token gate / up of routed experts); F32 stacks take it whatever their rows
CUDA_MMVF_STACK_ROWS = 512
F16_SUM_STEP = 16
# from ggml-cuda (llama.cpp, ggml 0.25): vecdotq.cuh's vec_dot_*_q8_1 for the matrix-vector
# kernels (q4_0: ``d4 * (sumi * ds8.x - 8 * ds8.y)``; the K-quants' mmvq forms sum the rounded
# values with dp4a), mmq.cuh's layouts (mmq_get_q8_1_ds_layout: DS4 for Q4_1 / Q5_1 / Q4_K /
# Q5_K / IQ1_S, D2S6 for Q2_K) and quantize.cu's quantize_mmq_q8_1 for the matrix-matrix ones
# (Q4_0 / Q5_0 load their quants centred there: no sums)
SUMS_FORMS: dict[str, dict[str, SumsForm]] = {
    "unrounded": {"Q4_1": _LEGACY, "Q5_1": _LEGACY},
    "cuda-mmq": {"Q4_1": _LEGACY, "Q5_1": _LEGACY, "Q4_K": _LEGACY, "Q5_K": _LEGACY, "IQ1_S": _LEGACY,
                 "Q2_K": SumsForm(group=16, scale_block=64, rounded_tail=32)},
    "cuda-mmvq": {"Q4_0": _LEGACY, "Q5_0": _LEGACY, "Q4_1": _LEGACY, "Q5_1": _LEGACY, "IQ1_S": _LEGACY},
}


@dataclass(frozen=True)
class Emulation:
    """How the reference rounds while emulating an engine's class. Kinds: "q8_0" / "q8_k"
    (8-bit blocks of 32 / 256 values), "f16", "bf16"; None: unchanged."""

    activations: str | None = None  # a matmul's input
    outputs: str | None = None  # a matmul's result
    kv: str | None = None  # what the KV cache stores
    gelu: str | None = None  # the GELU's input and value ("f16": ggml's CPU table)
    # a key of SUMS_FORMS: which weight types' offsets multiply the activations' sums before
    # rounding (llama.cpp CUDA's q8_1 forms); other weights are unchanged
    block_sums: str | None = None
    # the decode path's form where it differs (None: the same as block_sums): a forward of at
    # most ``decode_batch_max`` tokens takes it (llama.cpp CUDA: MMVQ_MAX_BATCH_SIZE, 8)
    decode_block_sums: str | None = None
    decode_batch_max: int = 8
    # a rounding of the decode path the engine states but the reference does not compute
    # (llama.cpp CUDA: F16 routed experts' one-token products in cuBLAS with an F16 compute
    # type): the decode is then judged by its class allowance alone, and says why
    decode_unemulated: str | None = None
    # "cuda" / "cuda-cublas-f32": unquantized weights as ggml-cuda multiplies them (float_form); None: exact
    float_sums: str | None = None
    # the token count of the forward being emulated (for_batch), which picks ggml-cuda's kernel
    tokens: int | None = None
    # the most tokens the engine puts in one forward (llama.cpp: min(n_batch, n_ubatch)): a longer
    # prompt reaches its kernels in pieces of this size
    ubatch: int | None = None
    # ggml-cuda fuses a one-token gate / up / GLU into one matrix-vector kernel (off with
    # GGML_CUDA_DISABLE_FUSION): routed experts' gate and up then take f32 sums of unrounded values
    glu_fusion: bool = True

    def describe(self) -> str:
        parts = [f"{what} {kind}" for what, kind in (("activations", self.activations),
                                                       ("matmul outputs", self.outputs),
                                                       ("KV cache", self.kv),
                                                       ("GELU", self.gelu),
                                                       ("block sums", self.block_sums),
                                                       ("decode block sums", self.decode_block_sums),
                                                       ("float matmuls", self.float_sums)) if kind]
        return ", ".join(parts) or "nothing"

    def on_decode(self) -> "Emulation":
        """The emulation of the decode path (one-token steps: the matrix-vector kernels)."""
        if self.decode_block_sums is None:
            return self
        return replace(self, block_sums=self.decode_block_sums, decode_block_sums=None)

    def for_batch(self, tokens: int) -> "Emulation":
        """The emulation of a forward over ``tokens`` tokens at once: a small batch computes
        as a decode step does (the matrix-vector kernels)."""
        if self.ubatch:
            tokens = min(tokens, self.ubatch)
        return replace(self.on_decode() if tokens <= self.decode_batch_max else self, tokens=tokens)

    def float_form(self, weight) -> str | None:
        """How ``weight`` (tagged ``ggml_type``; ``ggml_expert`` for a routed expert's, and
        ``ggml_glu`` for its gate / up) is multiplied in this forward, where ggml-cuda's kernel
        for it rounds otherwise than the class (``activations`` / ``outputs``) says: "tf32"
        (operands rounded to TF32, to nearest: cuBLAS's TF32 math), "tf32-rz" (operands cut to
        TF32: ggml's own mma kernels hand raw f32 bits to the tf32 instruction, which ignores the
        low 13), "f16-sums" (cuBLAS's F16 compute type), "vector" (f32 activations, sums and
        result), "f16-vector-sums" (the F16 vector kernel's half sums: linear_f16_vector_sums),
        "mma" (f16 / bf16 activations, f32 sums and result); None: as the class says.

        ggml-cuda (llama.cpp, ggml 0.25) on NVIDIA Ampere and later (ggml-cuda.cu
        ggml_cuda_mul_mat / ggml_cuda_mul_mat_id, mmvf.cu, mmf.cu / mmf.cuh, mma.cuh):
        dense F32 weights in the f32 vector kernel for at most 3 columns, ggml's mma kernel (mmf)
        up to 16 where the shape fits it, else cuBLAS with TF32 math; F16 / BF16 in the vector
        kernel for one column (F16 with half sums unless the node asks f32 ones: a fused GLU's
        gate / up, ``ggml_f32_sums``), mmf up to 16 (f16 / bf16 activations, f32 sums), else cuBLAS
        (F16: ``CUBLAS_COMPUTE_16F`` with an f16 result; BF16: bf16 operands, f32 sums and result;
        ``GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32``: F16 as TF32). Routed experts (``mul_mat_id``):
        mmf up to 512 tokens (128 for experts of over 1024 rows), except a one-token gate / up,
        fused with the GLU into the vector kernel (f32 sums of unrounded values; F16 / BF16
        stacks of at most 512 rows)."""
        if self.float_sums not in ("cuda", "cuda-cublas-f32") or self.tokens is None:
            return None
        kind = getattr(weight, "ggml_type", None)
        if kind not in ("F32", "F16", "BF16"):
            return None
        if getattr(weight, "ggml_expert", False):
            rows = weight.shape[0]
            if self.tokens == 1 and self.glu_fusion and getattr(weight, "ggml_glu", False) \
                    and (kind == "F32" or rows <= CUDA_MMVF_STACK_ROWS):
                return "vector"
            limit = CUDA_MMF_EXPERTS_MAX if rows <= CUDA_MMF_EXPERTS_ROWS else CUDA_MMF_EXPERTS_MAX_WIDE
            if self.tokens <= limit:
                return "tf32-rz" if kind == "F32" else "mma"
            return self._cublas(kind, weight)  # ggml multiplies each expert's gathered rows as a dense matmul
        if kind == "F32" and self.tokens <= CUDA_F32_VECTOR_MAX or kind == "BF16" and self.tokens == 1:
            return "vector"
        if self.tokens == 1:  # F16: half sums, but where the GLU fusion hands the kernel f32 sums
            fused = self.glu_fusion and getattr(weight, "ggml_glu", False)
            return "vector" if fused or getattr(weight, "ggml_f32_sums", False) else "f16-vector-sums"
        if self.tokens <= CUDA_MMF_MAX and _mmf_fits(weight, kind):
            return "tf32-rz" if kind == "F32" else "mma"
        return self._cublas(kind, weight)

    def _cublas(self, kind: str, weight) -> str:
        if kind == "F32":
            return "tf32"
        if kind == "BF16":  # bf16 operands, f32 compute type and result (prefer_f32_output on NVIDIA)
            return "mma"
        # GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32, or a node asking f32 sums: an F32 gemm in TF32 math (f16
        # values are exact in TF32)
        f32 = self.float_sums == "cuda-cublas-f32" or getattr(weight, "ggml_f32_sums", False)
        return "tf32" if f32 else "f16-sums"

    def sums_form(self, weight) -> SumsForm | None:
        """How ``weight`` (tagged ``ggml_type`` by the WeightStore) multiplies activation sums here."""
        forms = SUMS_FORMS.get(self.block_sums or "", {})
        return forms.get(getattr(weight, "ggml_type", None) or "")


def round_as(x: Tensor, kind: str | None) -> Tensor:
    """``x`` rounded the way ``kind`` stores it, back in x's dtype."""
    if kind is None:
        return x
    if kind in ("f16", "bf16"):
        return x.to(torch.float16 if kind == "f16" else torch.bfloat16).to(x.dtype)
    block = {"q8_0": 32, "q8_64": 64, "q8_k": 256}[kind]
    n = x.shape[-1]
    if n % block:  # ggml requires whole blocks; a ragged row is left as it is
        return x
    blocks = x.reshape(*x.shape[:-1], n // block, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe).clamp(-127, 127)
    if kind in ("q8_0", "q8_64"):  # ggml keeps the Q8_0 scale (and CUDA's D2S6 one) in f16
        safe = safe.to(torch.float16).to(x.dtype)
    return (q * safe).reshape(x.shape)


def round_tf32(x: Tensor) -> Tensor:
    """``x`` with its float32 mantissa rounded to TF32's 10 bits (to nearest, ties away from
    zero), back in x's dtype: a tensor core's view of an F32 operand."""
    bits = x.to(torch.float32).view(torch.int32)
    rounded = torch.bitwise_and(bits + 0x1000, ~0x1FFF)  # + half of the dropped 13 bits, then cut
    finite = torch.isfinite(x)
    return torch.where(finite, rounded.view(torch.float32).to(x.dtype), x)


def truncate_tf32(x: Tensor) -> Tensor:
    """``x`` with its float32 mantissa cut to TF32's 10 bits (the low 13 bits dropped), back in
    x's dtype: what a tf32 ``mma`` instruction makes of raw f32 bits (ggml-cuda's mmf kernels
    pass them unconverted: mmf.cuh, mma.cuh ``mma.sync ... .tf32.tf32``)."""
    bits = x.to(torch.float32).view(torch.int32)
    cut = torch.bitwise_and(bits, ~0x1FFF)
    return torch.where(torch.isfinite(x), cut.view(torch.float32).to(x.dtype), x)


def _mmf_fits(weight, kind: str) -> bool:
    """ggml_cuda_should_use_mmf's shape rule (mmf.cu): a row length that is a multiple of 32 F32
    or 64 F16 / BF16 values, and a multiple of 32 rows (a router of 8 experts goes to cuBLAS)."""
    rows, row_len = weight.shape[0], weight.shape[-1]
    per_row = 32 if kind == "F32" else 64
    return row_len % per_row == 0 and rows % 32 == 0


def mmvf_block_size(n: int, warp: int = 32, largest: int = 256) -> int:
    """The thread count ggml-cuda's vector kernel (mmvf.cu launch_mul_mat_vec_f_cuda) runs a row
    of ``n`` values with: the smallest multiple of the warp, up to 256, that needs the fewest
    iterations over the row's pairs."""
    best, fewest = warp, -(-n // (2 * warp))
    for size in range(2 * warp, largest + 1, warp):
        iterations = -(-n // (2 * size))
        if iterations < fewest:
            best, fewest = size, iterations
    return best


def linear_f16_vector_sums(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T`` as ggml-cuda's vector kernel for F16 weights gives it at its default
    precision (mmvf.cu, ``type_acc`` half): activations in f16; each thread keeps a half2 running
    sum (one fused multiply-add, one rounding, per step) over the column pairs ``t, t + B, ...``
    (B threads, :func:`mmvf_block_size`), its two halves then added in f32, and the threads'
    sums added in f32 (here exactly: a far smaller error than the f16 steps'). The result is f32."""
    n = x.shape[-1]
    size = mmvf_block_size(n)
    steps = -(-n // (2 * size))
    pad = steps * size * 2 - n
    xs = torch.nn.functional.pad(round_as(x, "f16"), (0, pad)).reshape(*x.shape[:-1], 1, steps, size, 2)
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    for start in range(0, weight.shape[0], 2048):  # [.., rows, B, 2] sums: a row block at a time
        w = torch.nn.functional.pad(weight[start:start + 2048].to(x.dtype), (0, pad))
        w = w.reshape(w.shape[0], steps, size, 2)
        acc = torch.zeros((*x.shape[:-1], w.shape[0], size, 2), dtype=x.dtype, device=x.device)
        for k in range(steps):
            acc = round_as(acc + xs[..., k, :, :] * w[:, k], "f16")
        out[..., start:start + w.shape[0]] = acc.sum(dim=(-1, -2))
    return out if bias is None else out + bias


def linear_f16_sums(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T`` as cuBLAS's F16 compute type gives it: operands in f16, the running sum
    kept in f16 (rounded after every ``F16_SUM_STEP`` products, one tensor-core step), the
    result in f16. (The bias, added by ggml afterwards in f32, is exact.)"""
    n = x.shape[-1]
    xs, ws = round_as(x, "f16"), round_as(weight, "f16")
    acc = torch.zeros((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    for start in range(0, n, F16_SUM_STEP):
        stop = min(n, start + F16_SUM_STEP)
        acc = round_as(acc + xs[..., start:stop] @ ws[:, start:stop].T, "f16")
    return acc if bias is None else acc + bias


def unrounded_sums_error(x: Tensor, rounded: Tensor, weight: Tensor, form: SumsForm = _LEGACY) -> Tensor | None:
    """What llama.cpp's CUDA q8_1 form takes from ``linear(rounded, weight)`` for a weight
    [out, in] with group offsets ``o``: each group's offset times the difference of the rounded
    activations' group sum and the kept one (the unrounded sum, stored in f16). CUDA computes
    ``sum((w - o) * rounded) + o * f16(sum(x))`` per group; the CPU's form ``sum(w * rounded)``
    is ``linear(rounded, weight)``. The offsets come from the weight's own blocks
    (:func:`weight_offsets`). None for a ragged row, and for a weight without offsets."""
    n = x.shape[-1]
    g = form.group
    if n % g or weight.shape[-1] != n or (form.rounded_tail and n % 128):
        return None
    offsets = weight_offsets(weight, g)
    if offsets is None:
        return None
    ng = n // g
    rounded_sum = rounded.reshape(*rounded.shape[:-1], ng, g).sum(-1)  # [.., ng]
    kept_sum = x.reshape(*x.shape[:-1], ng, g).sum(-1).to(torch.float16).to(x.dtype)  # [.., ng]
    if form.rounded_tail:  # these groups' sums come from the rounded values
        tail = (torch.arange(ng, device=x.device) * g) % 128 >= 128 - form.rounded_tail
        kept_sum = torch.where(tail, rounded_sum, kept_sum)
    return (rounded_sum - kept_sum) @ offsets.to(device=x.device, dtype=x.dtype).T  # [.., out]


def weight_offsets(weight: Tensor, group: int) -> Tensor | None:
    """A weight's group offsets [out, in / group]: read from its blocks where the WeightStore
    said where they are (``ggml_offsets``, computed once and kept on the weight); for a weight
    tagged Q4_1 / Q5_1 without its blocks (built by hand), the group's smallest value (ggml's
    and gguf-py's quantizers give the minimum the quant 0). None where neither applies."""
    cached = getattr(weight, "ggml_offsets_value", None)
    if cached is not None:
        return cached
    source = getattr(weight, "ggml_offsets", None)  # the WeightStore's reader (it keeps what it read)
    if source is not None:
        value = torch.from_numpy(source())
        return value if tuple(value.shape) == (weight.shape[0], weight.shape[-1] // group) else None
    if getattr(weight, "ggml_type", None) in OFFSET_TYPES:
        value = weight.reshape(weight.shape[0], -1, group).amin(-1)
    else:
        return None
    if tuple(value.shape) != (weight.shape[0], weight.shape[-1] // group):
        return None
    weight.ggml_offsets_value = value
    return value


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
