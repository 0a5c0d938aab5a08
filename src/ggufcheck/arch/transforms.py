"""Layout transforms between GGUF tensors and HF parameters, each with its exact inverse.

A tensor table row names its transform by key (:data:`TRANSFORMS`). Every transform maps
the GGUF tensors of one group (by role, e.g. ``k_b`` and ``v_b``) to HF tensors (by full
HF name) and back; both directions are pure reshapes, permutations, stacks and
concatenations, so GGUF -> HF -> GGUF is bit-exact; Gemma's norm offset (``1 + w``) is
exact for stored values >= 0.5 (subtracting 1 rounds nowhere there).
Transforms run on dequantized values: a transpose crosses quant blocks (docs/architectures.md
sec 3: dequantize k_b and v_b first).

Dims: H heads, hd head dim, L kv_lora_rank, P qk_nope, V v_head, E experts, Fe expert FFN,
D hidden. Name templates may hold ``{e}`` (expert) and ``{proj}`` (gate_proj / up_proj).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.arch.spec import ArchSpec

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Transform:
    """GGUF tensors by role <-> HF tensors by name (``hf_name`` is the row's template)."""

    name: str
    roles: tuple[str, ...]  # the GGUF inputs, in order; ("w",) for one-to-one transforms
    to_hf: Callable[[Tensors, "ArchSpec", str], dict[str, torch.Tensor]]
    to_gguf: Callable[[Tensors, "ArchSpec", str], dict[str, torch.Tensor]]
    doc: str

    def hf_names(self, spec: "ArchSpec", hf_name: str) -> list[str]:
        """The HF names this transform produces from ``hf_name`` (experts expanded)."""
        names = [hf_name]
        if "{proj}" in hf_name:
            names = [n.replace("{proj}", p) for n in names for p in ("gate_proj", "up_proj")]
        if "{e}" in hf_name:
            assert spec.moe is not None
            names = [n.replace("{e}", str(e)) for e in range(spec.moe.n_expert) for n in names]
        return names


# --- one to one ---------------------------------------------------------------------------


def _identity_to_hf(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {hf: g["w"]}


def _identity_to_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {"w": h[hf]}


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF q/k rows -> the order llama.cpp's converter writes (conversion/llama.py
    LlamaModel.permute): inside each head, the two rotary halves are interleaved, so that
    NORM rope on the stored rows equals NEOX (HF's rotate_half) on the original ones."""
    out = w.shape[0]
    # (n, 2, hd/2, ...) -> (n, hd/2, 2, ...)
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of :func:`llama_permute`: stored GGUF rows -> HF rows."""
    out = w.shape[0]
    # (n, hd/2, 2, ...) -> (n, 2, hd/2, ...)
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute(n_heads: Callable[["ArchSpec"], int]):
    def to_hf(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
        return {hf: llama_unpermute(g["w"], n_heads(spec))}

    def to_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
        return {"w": llama_permute(h[hf], n_heads(spec))}

    return to_hf, to_gguf


# --- MLA kv_b -----------------------------------------------------------------------------


def kv_b_from_split(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """``attn_k_b [H, L, P]`` + ``attn_v_b [H, V, L]`` -> HF ``kv_b_proj [H*(P+V), L]``,
    per head P key rows then V value rows (the inverse of conversion/deepseek.py's split)."""
    h, l, p = k_b.shape
    v = v_b.shape[1]
    kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # (H, P+V, L)
    return kv.reshape(h * (p + v), l)


def split_kv_b(kv_b: torch.Tensor, n_head: int, qk_nope: int, v_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``kv_b_proj [H*(P+V), L]`` -> ``(k_b [H, L, P], v_b [H, V, L])`` as the converter does."""
    kv = kv_b.reshape(n_head, qk_nope + v_head, kv_b.shape[-1])  # (H, P+V, L)
    k_b, v_b = torch.split(kv, [qk_nope, v_head], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def _kv_b_to_hf(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {hf: kv_b_from_split(g["k_b"], g["v_b"])}


def _kv_b_to_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    assert spec.mla is not None
    k_b, v_b = split_kv_b(h[hf], spec.n_head, spec.mla.qk_nope, spec.mla.v_head)
    return {"k_b": k_b, "v_b": v_b}


# --- experts ------------------------------------------------------------------------------


def _unstack_to_hf(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    """``[E, out, in]`` -> per expert ``[out, in]`` (HF checkpoints: experts.{e}.*)."""
    return {hf.replace("{e}", str(e)): w for e, w in enumerate(g["w"].unbind(0))}


def _stack_to_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    assert spec.moe is not None
    return {"w": torch.stack([h[hf.replace("{e}", str(e))] for e in range(spec.moe.n_expert)])}


def _fuse_gate_up_to_hf(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    """``gate [E, Fe, D]`` + ``up [E, Fe, D]`` -> transformers 5.x ``gate_up_proj [E, 2Fe, D]``
    (gate rows first: conversion_mapping.py qwen2_moe Concatenate(dim=1); the experts'
    forward chunks the output in two, gate then up)."""
    return {hf: torch.cat([g["gate"], g["up"]], dim=1)}


def _split_gate_up_to_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    gate, up = h[hf].chunk(2, dim=1)
    return {"gate": gate.contiguous(), "up": up.contiguous()}


def _fused_gguf_to_experts(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    """GGUF ``ffn_gate_up_exps [E, 2Fe, D]`` -> per expert gate_proj / up_proj ``[Fe, D]``."""
    gate, up = g["w"].chunk(2, dim=1)
    out = {}
    for e in range(g["w"].shape[0]):
        out[hf.replace("{proj}", "gate_proj").replace("{e}", str(e))] = gate[e]
        out[hf.replace("{proj}", "up_proj").replace("{e}", str(e))] = up[e]
    return out


def _experts_to_fused_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    assert spec.moe is not None
    rows = []
    for e in range(spec.moe.n_expert):
        rows.append(torch.cat([h[hf.replace("{proj}", "gate_proj").replace("{e}", str(e))],
                               h[hf.replace("{proj}", "up_proj").replace("{e}", str(e))]], dim=0))
    return {"w": torch.stack(rows)}  # (E, 2Fe, D)


def _gemma_norm_to_hf(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {hf: g["w"] - 1}


def _gemma_norm_to_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {"w": h[hf] + 1}


def _interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., n] and [..., n] -> [..., 2n] with a at the even and b at the odd positions."""
    return torch.stack((a, b), dim=-1).flatten(-2)


def _oai_gate_up_to_hf(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {hf: _interleave(g["gate"].transpose(1, 2), g["up"].transpose(1, 2))}  # [E, D, 2Fe]


def _oai_gate_up_to_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    w = h[hf]
    return {"gate": w[..., 0::2].transpose(1, 2).contiguous(), "up": w[..., 1::2].transpose(1, 2).contiguous()}


def _oai_bias_to_hf(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {hf: _interleave(g["gate"], g["up"])}  # [E, 2Fe]


def _oai_bias_to_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {"gate": h[hf][..., 0::2].contiguous(), "up": h[hf][..., 1::2].contiguous()}


def _transpose_to_hf(g: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {hf: g["w"].transpose(1, 2).contiguous()}


def _transpose_to_gguf(h: Tensors, spec: "ArchSpec", hf: str) -> dict[str, torch.Tensor]:
    return {"w": h[hf].transpose(1, 2).contiguous()}


_Q = _permute(lambda s: s.n_head)
_K = _permute(lambda s: s.n_head_kv)

TRANSFORMS: dict[str, Transform] = {t.name: t for t in (
    Transform("identity", ("w",), _identity_to_hf, _identity_to_gguf, "same layout"),
    Transform("llama_q", ("w",), *_Q, "undo the converter's q row permutation (n = H)"),
    Transform("llama_k", ("w",), *_K, "undo the converter's k row permutation (n = Hkv)"),
    Transform("gemma_norm", ("w",), _gemma_norm_to_hf, _gemma_norm_to_gguf,
              "GGUF 1 + w <-> HF w (Gemma's RMSNorm multiplies by 1 + weight; conversion/gemma.py "
              "norm_shift); exact for stored values >= 0.5"),
    Transform("oai_gate_up", ("gate", "up"), _oai_gate_up_to_hf, _oai_gate_up_to_gguf,
              "gpt-oss: ffn_gate_exps + ffn_up_exps [E, Fe, D] <-> experts.gate_up_proj [E, D, 2Fe], gate at "
              "the even and up at the odd columns (conversion/gpt_oss.py [:, ::2] / [:, 1::2])"),
    Transform("oai_gate_up_bias", ("gate", "up"), _oai_bias_to_hf, _oai_bias_to_gguf,
              "gpt-oss: ffn_gate_exps.bias + ffn_up_exps.bias [E, Fe] <-> gate_up_proj_bias [E, 2Fe], interleaved"),
    Transform("transpose_experts", ("w",), _transpose_to_hf, _transpose_to_gguf,
              "stacked [E, out, in] <-> [E, in, out] (gpt-oss's experts.down_proj)"),
    Transform("kv_b", ("k_b", "v_b"), _kv_b_to_hf, _kv_b_to_gguf,
              "kv_b_proj [H*(P+V), L] from attn_k_b [H, L, P] and attn_v_b [H, V, L]"),
    Transform("unstack_experts", ("w",), _unstack_to_hf, _stack_to_gguf,
              "stacked [E, out, in] <-> experts.{e} [out, in]"),
    Transform("fuse_gate_up", ("gate", "up"), _fuse_gate_up_to_hf, _split_gate_up_to_gguf,
              "gate_exps + up_exps <-> transformers' fused gate_up_proj [E, 2Fe, D]"),
    Transform("split_fused_gate_up", ("w",), _fused_gguf_to_experts, _experts_to_fused_gguf,
              "GGUF ffn_gate_up_exps [E, 2Fe, D] <-> experts.{e}.gate_proj / up_proj"),
)}
