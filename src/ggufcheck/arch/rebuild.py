"""HF-layout weights rebuilt from a GGUF, through the tensor table, and the inverse.

``iter_hf_tensors`` walks the table's groups (the GGUF tensors feeding one HF parameter:
one, or ``attn_k_b`` + ``attn_v_b`` for ``kv_b_proj``, or gate + up for transformers'
fused experts), dequantizes each GGUF tensor in float32 (before any transpose: a
transpose crosses quant blocks), applies the row's transform and yields HF tensors one
group at a time, so memory stays bounded by the largest group. ``hf_state_dict`` collects
them. ``gguf_tensors_from_hf`` is the inverse, for round-trip tests and test builders.

Tied embeddings: a file without ``output.weight`` yields no ``lm_head.weight`` (as HF
checkpoints saved with ``tie_word_embeddings``), unless ``tied_lm_head=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Mapping

import torch

from ggufcheck.arch.spec import ArchSpec
from ggufcheck.arch.table import LAYOUTS, Expected, TensorTable, expected_tensors, hf_name
from ggufcheck.arch.transforms import TRANSFORMS
from ggufcheck.errors import GGUFCheckError

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.gguf.reader import GGUFModel


class RebuildError(GGUFCheckError):
    """A required GGUF tensor is missing, so an HF parameter cannot be rebuilt."""


@dataclass
class Group:
    """The GGUF tensors (by role) that make one HF parameter (or one expert family)."""

    hf_name: str  # template with {i} resolved; {e} / {proj} left to the transform
    transform: str
    layer: int | None
    inputs: dict[str, Expected] = field(default_factory=dict)  # role -> expected GGUF tensor


def groups(spec: ArchSpec, table: TensorTable, names=None, layout: str = "checkpoint",
           include_nextn: bool | None = None) -> list[Group]:
    """The table's groups for this model, in table order.

    NextN layers are included by default in the checkpoint layout only (transformers'
    modules do not build MTP layers).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown HF layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if include_nextn is None:
        include_nextn = layout == "checkpoint"
    out: dict[tuple[str, str], Group] = {}
    for exp in expected_tensors(spec, table, names).values():
        hf = exp.row.hf_for(layout)
        if hf is None or (not include_nextn and exp.layer is not None and spec.is_nextn_layer(exp.layer)):
            continue
        name = hf_name(exp.row, exp.layer, layout)
        assert name is not None
        group = out.setdefault((name, hf.transform), Group(name, hf.transform, exp.layer))
        group.inputs[hf.role] = exp
    return list(out.values())


def iter_hf_tensors(model: "GGUFModel", spec: ArchSpec, table: TensorTable,
                    dtype: torch.dtype = torch.float32, layout: str = "checkpoint",
                    include_nextn: bool | None = None, tied_lm_head: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every HF parameter the file provides.

    Optional tensors that are absent are skipped; a missing required one raises
    :class:`RebuildError` naming it (the mapping check reports it as a finding first).
    """
    from ggufcheck.gguf.dequant import dequantize_tensor

    present = model.tensors
    for group in groups(spec, table, present, layout, include_nextn):
        transform = TRANSFORMS[group.transform]
        missing = [e for e in group.inputs.values() if e.name not in present]
        if missing:
            if any(e.required for e in missing):
                raise RebuildError(f"{model.path}: cannot rebuild {group.hf_name}: "
                                   f"tensor {missing[0].name} is missing")
            continue
        if set(group.inputs) != set(transform.roles):
            raise RebuildError(f"{model.path}: {group.hf_name} needs {transform.roles}, "
                               f"the table gives {tuple(group.inputs)}")
        values = {role: dequantize_tensor(model, e.name) for role, e in group.inputs.items()}
        for name, tensor in transform.to_hf(values, spec, group.hf_name).items():
            yield name, tensor.to(dtype) if dtype != torch.float32 else tensor
    if tied_lm_head and "output.weight" not in present and "token_embd.weight" in present:
        yield "lm_head.weight", dequantize_tensor(model, "token_embd.weight").to(dtype)


# transforms whose outputs keep the inputs' expert axis first: a stacked expert parameter can be
# built a block of experts at a time (the rest make per-expert names or need the whole stack)
EXPERT_AXIS_FIRST = frozenset({"identity", "fuse_gate_up", "transpose_experts", "oai_gate_up"})


def iter_hf_parts(model: "GGUFModel", spec: ArchSpec, table: TensorTable, layout: str = "checkpoint",
                  include_nextn: bool | None = None, block_bytes: int = 256 << 20
                  ) -> Iterator[tuple[str, torch.Tensor, slice | None]]:
    """:func:`iter_hf_tensors` in bounded memory: ``(hf_name, float32 tensor, experts)``, where a
    stacked expert parameter ([E, ...], from stacked GGUF tensors) comes as blocks of experts
    (``experts`` the slice of its first axis the block fills) of about ``block_bytes`` each, so
    a GLM-5 layer's 256 experts (25.8 GB of float32 in one fused gate_up) never sit in memory at
    once; every other parameter whole (``experts`` None)."""
    from ggufcheck.gguf.dequant import dequantize_tensor

    present = model.tensors
    for group in groups(spec, table, present, layout, include_nextn):
        transform = TRANSFORMS[group.transform]
        missing = [e for e in group.inputs.values() if e.name not in present]
        if missing:
            if any(e.required for e in missing):
                raise RebuildError(f"{model.path}: cannot rebuild {group.hf_name}: tensor {missing[0].name} is missing")
            continue
        infos = {role: present[e.name] for role, e in group.inputs.items()}
        stacked = all(len(i.shape) == 3 and "_exps." in i.name for i in infos.values())
        if not (stacked and group.transform in EXPERT_AXIS_FIRST):
            values = {role: dequantize_tensor(model, info.name) for role, info in infos.items()}
            for name, tensor in transform.to_hf(values, spec, group.hf_name).items():
                yield name, tensor, None
            continue
        n_expert = next(iter(infos.values())).shape[0]
        per_expert = sum(i.n_elements // n_expert for i in infos.values()) * 4
        step = max(1, block_bytes // max(1, per_expert))
        for e0 in range(0, n_expert, step):
            e1 = min(e0 + step, n_expert)
            values = {}
            for role, info in infos.items():
                rows = info.shape[1]
                values[role] = dequantize_tensor(model, info.name, rows=slice(e0 * rows, e1 * rows)) \
                    .reshape(e1 - e0, rows, info.shape[2])
            for name, tensor in transform.to_hf(values, spec, group.hf_name).items():
                yield name, tensor, slice(e0, e1)


def hf_state_dict(model: "GGUFModel", spec: ArchSpec, table: TensorTable,
                  dtype: torch.dtype = torch.float32, layout: str = "checkpoint",
                  include_nextn: bool | None = None, tied_lm_head: bool = False) -> dict[str, torch.Tensor]:
    """The whole HF state dict (see :func:`iter_hf_tensors`; use that for big models)."""
    return dict(iter_hf_tensors(model, spec, table, dtype, layout, include_nextn, tied_lm_head))


def gguf_tensors_from_hf(hf: Mapping[str, torch.Tensor], spec: ArchSpec, table: TensorTable,
                         names=None, layout: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The inverse: GGUF tensors (numpy layout, by GGUF name) from HF parameters.

    ``names`` picks per-file variants as in :func:`expected_tensors`. Groups whose HF
    parameters are absent from ``hf`` are skipped.
    """
    out: dict[str, torch.Tensor] = {}
    for group in groups(spec, table, names, layout):
        transform = TRANSFORMS[group.transform]
        if not all(n in hf for n in transform.hf_names(spec, group.hf_name)):
            continue
        for role, tensor in transform.to_gguf(hf, spec, group.hf_name).items():
            out[group.inputs[role].name] = tensor
    return out
