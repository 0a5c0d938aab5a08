"""Tensor tables: the types, and the expansion of a table into the tensors a model must have.

A :class:`TensorTable` is data (the rows live in ``arch/tables/<family>.py``): one
:class:`Row` per GGUF tensor kind, carrying its expected numpy shape as expressions over
:meth:`ArchSpec.dims`, its HF parameter name and the transform between the layouts, and
its tensor-parallel :class:`Shard` rule, with a comment citing the source. The mapping
check, the HF rebuild and the sharding plans all read the same rows.

Two HF layouts exist for the same weights:

- ``checkpoint``: names in HF safetensors on the Hub (and what ``save_pretrained`` writes):
  experts one by one, ``mlp.experts.{e}.gate_proj.weight``; NextN layers present.
- ``transformers``: transformers 5.x modules' ``state_dict()``: experts fused,
  ``mlp.experts.gate_up_proj [E, 2Fe, D]`` and ``mlp.experts.down_proj [E, D, Fe]``
  (modeling_deepseek_v3.py DeepseekV3Experts; conversion_mapping.py "qwen2_moe");
  NextN / MTP layers are not part of the modules.
"""

from __future__ import annotations

import ast
import enum
import functools
import operator
from dataclasses import dataclass
from typing import Callable, Iterable

from ggufcheck.arch.spec import ArchSpec

LAYOUTS = ("checkpoint", "transformers")
# layer parts: which rows apply to which layer (see :func:`layer_parts`)
PARTS = ("global", "attn", "dense_ffn", "moe", "indexer", "nextn")


class ShardKind(str, enum.Enum):
    """How vLLM splits a tensor under tensor parallelism (docs/architectures.md sec 7)."""

    COLUMN = "column"  # output rows split; no all-reduce
    ROW = "row"  # input columns split, then all-reduce
    REPLICATED = "replicated"
    VOCAB = "vocab"  # vocabulary rows split, padded to a multiple of 64 per rank


@dataclass(frozen=True)
class Shard:
    """One tensor's TP rule, in the GGUF tensor's numpy dims."""

    kind: ShardKind
    dim: int | None = None  # the numpy dim TP splits
    unit: str = "1"  # the indivisible unit along ``dim`` (expression: "hd" = one head)
    experts: bool = False  # stacked experts: dim 0 is the expert axis (expert parallel)
    note: str = ""

    def splits_rows(self, ndim: int) -> bool:
        """True when the split cuts inside rows (the last numpy dim, ne0): each rank's slice
        must then start on a quant block boundary."""
        return self.dim is not None and self.dim == ndim - 1

    def unit_size(self, spec: ArchSpec) -> int:
        return eval_dim(self.unit, spec.dims())

    @property
    def label(self) -> str:
        return ("expert-" if self.experts else "") + self.kind.value


REPLICATED = Shard(ShardKind.REPLICATED)


@dataclass(frozen=True)
class HF:
    """The HF side of a row: a name template ({i} layer, {e} expert, {proj}) and a transform."""

    name: str
    transform: str = "identity"  # a key of arch.transforms.TRANSFORMS
    role: str = "w"  # this GGUF tensor's input role in a many-to-one transform


@dataclass(frozen=True)
class Row:
    """One GGUF tensor kind of an architecture."""

    gguf: str  # name template, {i} = layer
    shape: tuple[str, ...]  # numpy shape, expressions over ArchSpec.dims()
    shard: Shard
    hf: HF | None  # checkpoint layout; None: no HF tensor (derived data, e.g. rope_freqs)
    part: str  # one of PARTS
    module: HF | None = None  # transformers layout when it differs from ``hf``
    when: str | None = None  # a key of CONDITIONS
    required: bool = True
    source: str = ""

    def hf_for(self, layout: str) -> HF | None:
        if layout == "transformers" and self.part == "nextn":
            return None  # not in transformers' modules
        if layout == "transformers" and self.module is not None:
            return self.module
        return self.hf


@dataclass(frozen=True)
class TensorTable:
    arch: str
    rows: tuple[Row, ...]
    source: str  # the files the facts came from


@dataclass(frozen=True)
class Expected:
    """A tensor the model should have, with everything resolved for one layer."""

    name: str
    row: Row
    layer: int | None
    shape: tuple[int, ...]
    required: bool


# --- shape expressions --------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv}


@functools.lru_cache(maxsize=None)
def _parse(expr: str) -> ast.Expression:
    return ast.parse(expr, mode="eval")


def eval_dim(expr: str, dims: dict[str, int]) -> int:
    """Evaluate ``"H*(P+R)"``-style expressions: names, integers, + - * //."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Name):
            if node.id not in dims:
                raise KeyError(f"shape expression {expr!r}: no dim {node.id!r} in this spec")
            return dims[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unsupported shape expression {expr!r}")

    return walk(_parse(expr))


def shape_of(row: Row, spec: ArchSpec) -> tuple[int, ...]:
    dims = spec.dims()
    return tuple(eval_dim(e, dims) for e in row.shape)


# --- when a row applies -------------------------------------------------------------------


def _fused_gate_up(spec: ArchSpec, i: int | None, names: set[str] | None) -> bool:
    return names is not None and f"blk.{i}.ffn_gate_up_exps.weight" in names


CONDITIONS: dict[str, Callable[[ArchSpec, int | None, set[str] | None], bool]] = {
    "q_lora": lambda s, i, n: s.mla is not None and s.mla.q_lora_rank is not None,
    "no_q_lora": lambda s, i, n: s.mla is not None and s.mla.q_lora_rank is None,
    "split_kv_b": lambda s, i, n: s.mla is not None and s.mla.split_kv_b,
    "legacy_kv_b": lambda s, i, n: s.mla is not None and not s.mla.split_kv_b,
    "shared_experts": lambda s, i, n: s.moe is not None and s.moe.n_shared > 0,
    # llama.cpp create_tensor_gate_up_exps: the fused tensor if present, else gate + up
    "fused_gate_up": _fused_gate_up,
    "split_gate_up": lambda s, i, n: not _fused_gate_up(s, i, n),
}


def layer_parts(spec: ArchSpec, i: int) -> set[str]:
    """Which parts of the table apply to layer ``i`` (NextN layers are full blocks + nextn)."""
    parts = {"attn", "moe" if spec.is_moe_layer(i) else "dense_ffn"}
    if spec.indexer is not None and spec.indexer.is_full(i):
        parts.add("indexer")
    if spec.is_nextn_layer(i):
        parts.add("nextn")
    return parts


def expected_tensors(spec: ArchSpec, table: TensorTable,
                     names: Iterable[str] | None = None) -> dict[str, Expected]:
    """Every tensor ``spec`` calls for, by GGUF name, in table order per layer.

    ``names`` (the file's tensor names) resolves per-file variants (a fused
    ``ffn_gate_up_exps``) and llama.cpp's trunk-only rule: NextN layers whose
    ``nextn.eh_proj`` is absent have only optional tensors.
    """
    present = set(names) if names is not None else None
    out: dict[str, Expected] = {}
    for row in table.rows:
        if row.part == "global":
            _add(out, row, spec, None, present, row.required)
    for i in range(spec.n_block):
        parts = layer_parts(spec, i)
        trunk_only = (spec.is_nextn_layer(i) and present is not None
                      and f"blk.{i}.nextn.eh_proj.weight" not in present)
        for row in table.rows:
            if row.part in parts:
                # the NextN layer's indexer: llama.cpp loads it TENSOR_NOT_REQUIRED
                optional = trunk_only or (row.part == "indexer" and spec.is_nextn_layer(i))
                _add(out, row, spec, i, present, row.required and not optional)
    return out


def _add(out: dict[str, Expected], row: Row, spec: ArchSpec, i: int | None,
         present: set[str] | None, required: bool) -> None:
    if row.when is not None and not CONDITIONS[row.when](spec, i, present):
        return
    name = row.gguf.format(i=i)
    out[name] = Expected(name=name, row=row, layer=i, shape=shape_of(row, spec), required=required)


def hf_name(row: Row, layer: int | None, layout: str = "checkpoint") -> str | None:
    """The row's HF name template for ``layer`` ({e} / {proj} left for the transform)."""
    hf = row.hf_for(layout)
    if hf is None:
        return None
    return hf.name.replace("{i}", str(layer)) if layer is not None else hf.name
