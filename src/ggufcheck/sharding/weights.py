"""Each rank's loaded parameters vs their expected slices of the GGUF: the expected values and
what a wrong one holds instead (judged in :mod:`ggufcheck.checks.weights`).

An engine adapter that can see its workers' parameters hands over
``loaded: {rank: {hf_name: tensor}}`` (HF names; checkpoint layout by default). For every
parameter the expected value is the GGUF tensor(s) dequantized, put in HF layout by the
arch table's transform (``arch.transforms``), then cut by the shard rule for that rank
(:func:`ggufcheck.sharding.rules.shard`). One Result per failing (tensor, rank), one PASS
per rank summing up the rest. When a wrong parameter equals ANOTHER rank's slice, the
verdict names it (fault catalog #1: every rank loaded shard 0); when it is the whole
unsharded tensor, sharding was not applied. kv_b_proj results are component "mla-kv-b", the
router's "moe-router"; a wrong value is named by its layout where it is a known one
(:mod:`ggufcheck.sharding.layouts`).

Engines that keep GGUF weights quantized (vLLM's GGUF path) can hand over ``uint8`` bytes
instead: those are compared, exactly, with the rank's slice of the file's raw bytes (one-to-one
tensors only), and a row-parallel split that would start inside a quant block is reported.

Tolerance: the engine may hold a parameter in a lower precision than the fp32 dequantized
value: ``|loaded - expected| <= eps(dtype) * |expected|`` elementwise (one rounding of that
dtype); fp32 and fp64 parameters must match to fp32 rounding.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch
from torch import Tensor

from ggufcheck.arch.rebuild import groups
from ggufcheck.arch.spec import ArchSpec
from ggufcheck.arch.table import TensorTable
from ggufcheck.arch.transforms import TRANSFORMS
from ggufcheck.comparison import within_rtol
from ggufcheck.sharding.layouts import name_layout, name_reshaped, row_order
from ggufcheck.sharding.mla import KV_B_RULE
from ggufcheck.sharding.rules import REPLICATED, ShardRule, raw_shard, rule_from_shard, shard

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.gguf.reader import GGUFModel

ROUTER_TENSORS = ("ffn_gate_inp", "exp_probs_b")  # GGUF names of the router's parameters
_EPS = {torch.float64: 1.2e-7, torch.float32: 1.2e-7, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@dataclass(frozen=True)
class HFParam:
    """One HF parameter the file provides: its rule, the group that makes it, its component."""

    name: str
    rule: ShardRule
    group: object  # arch.rebuild.Group
    component: str


def hf_params(spec: ArchSpec, table: TensorTable, names, layout: str = "checkpoint") -> dict[str, HFParam]:
    """HF name -> how it is made and how vLLM shards it (the rule in HF layout)."""
    out = {}
    for g in groups(spec, table, names, layout):
        if names is not None and any(e.name not in names for e in g.inputs.values()):
            continue  # an optional tensor this file does not have (e.g. llama's q/k/v biases)
        transform = TRANSFORMS[g.transform]
        first = next(iter(g.inputs.values()))
        base = rule_from_shard(first.row.shard, first.row.shape, spec)
        component = "weights"
        if g.transform == "kv_b":
            rule, component = KV_B_RULE, "mla-kv-b"
        elif g.transform == "unstack_experts" and base.is_split:  # [E, out, in] -> [out, in]
            rule = ShardRule(base.kind, base.dim - 1, base.unit, base.kv_heads, base.parts)
        elif g.transform == "fuse_gate_up":  # [E, 2Fe, D]: gate half and up half split apart
            rule = ShardRule("column", 1, 1, False, 2)
        elif g.transform == "split_fused_gate_up":  # per expert [Fe, D]
            rule = ShardRule("column", 0)
        else:
            rule = base
        # gpt-oss's fused experts (oai_*, transpose_experts): the component, and the GGUF row's rule
        # as is (a TP audit of its HF [E, D, 2Fe] layout is not modeled)
        if g.transform in ("unstack_experts", "fuse_gate_up", "split_fused_gate_up", "oai_gate_up",
                           "oai_gate_up_bias", "transpose_experts"):
            component = "moe-experts"  # a wrong routed-expert parameter (e.g. experts in the wrong order)
        if any(r in e.name for e in g.inputs.values() for r in ROUTER_TENSORS):
            component = "moe-router"  # the router's weight or its selection bias: which experts run
        for name in transform.hf_names(spec, g.hf_name):
            out[name] = HFParam(name, rule, g, component)
    return out


def full_tensors(model: "GGUFModel", spec: ArchSpec, param: HFParam) -> dict[str, Tensor]:
    from ggufcheck.gguf.dequant import dequantize_tensor

    values = {role: dequantize_tensor(model, e.name) for role, e in param.group.inputs.items()}
    return TRANSFORMS[param.group.transform].to_hf(values, spec, param.group.hf_name)


def close_to(got: Tensor, want: Tensor) -> tuple[bool, float]:
    """Within one rounding of ``got``'s dtype of ``want``, elementwise; and the max |diff|.

    ``comparison.within_rtol``'s test (|got - want| <= rtol |want| + atol, NaN never within),
    in torch, a block of elements at a time: numpy's single thread took ~8 minutes for the
    19e9 expert weights of two GLM-5 MoE layers on a 16-core host (a test holds the two to the
    same answers)."""
    rtol, atol = _EPS.get(got.dtype, 1.2e-7), 1e-30
    g, w = got.reshape(-1), want.reshape(-1)
    if g.shape != w.shape:
        cmp = within_rtol(got.cpu(), want.cpu(), rtol)  # different shapes: never close (no difference to give)
        return cmp.ok, float(cmp.extra.get("max_abs_diff", math.inf))
    ok, worst = True, 0.0
    step = 1 << 24
    for start in range(0, g.numel(), step):
        a = g[start:start + step].to(torch.float64)
        b = w[start:start + step].to(device=a.device, dtype=torch.float64)
        diff = (a - b).abs()
        ok = ok and bool((diff <= rtol * b.abs() + atol).all())
        if diff.numel():
            worst = max(worst, float(torch.nan_to_num(diff, nan=float("inf"), posinf=float("inf")).max()))
    return ok, worst


def diagnose_raw(model: "GGUFModel", spec: ArchSpec, got: Tensor, param: HFParam, rank: int, tp: int,
                  n_kv: int) -> tuple[str, str, dict] | None:
    """None when quantized bytes ``got`` are rank's slice of the GGUF tensor's bytes."""
    import warnings

    import gguf

    (exp,) = param.group.inputs.values() if len(param.group.inputs) == 1 else (None,)
    if exp is None or param.group.transform not in ("identity", "llama_q", "llama_k"):
        return ("raw bytes can be compared only for one-to-one tensors", "weights", {})
    info = model.tensors[exp.name]
    block, type_size = gguf.GGML_QUANT_SIZES[info.qtype]
    rule = rule_from_shard(exp.row.shard, exp.row.shape, spec)
    with warnings.catch_warnings():  # a read-only view of the map: never written
        warnings.simplefilter("ignore")
        stored = torch.from_numpy(model.raw(exp.name))
    # llama q/k: the file keeps llama.cpp's rope-permuted row order; the HF module (NEOX
    # rope) needs the rows back in checkpoint order. Rows are whole quant blocks, so the
    # expected bytes are the stored rows, reordered.
    raw = stored[row_order(param.group.transform, spec, stored.shape[0])]
    want = raw_shard(raw, rule, rank, tp, n_kv, block, type_size)
    if isinstance(want, str):
        return (f"{info.qtype.name} row-parallel split: {want}", "sharding", {"qtype": info.qtype.name})
    got = got.detach().cpu()
    if tuple(got.shape) == tuple(want.shape) and torch.equal(got, want):
        return None
    if param.group.transform != "identity":
        as_stored = raw_shard(stored, rule, rank, tp, n_kv, block, type_size)
        if not isinstance(as_stored, str) and tuple(as_stored.shape) == tuple(got.shape) \
                and torch.equal(got, as_stored):
            return (f"rows are in the GGUF's rope-permuted order ({exp.name} as stored): the loader did not undo "
                    "llama.cpp's q/k permutation, so NEOX rope pairs the wrong dimensions", "rope",
                    {"qtype": info.qtype.name, "gguf_tensor": exp.name})
    for other in range(tp):
        theirs = raw_shard(raw, rule, other, tp, n_kv, block, type_size)
        if other != rank and not isinstance(theirs, str) and tuple(theirs.shape) == tuple(got.shape) \
                and torch.equal(got, theirs):
            return (f"holds rank {other}'s bytes instead of its own", "sharding", {"holds_rank": other})
    return (f"bytes differ from the expected {info.qtype.name} slice (shape {tuple(got.shape)}, "
            f"expected {tuple(want.shape)})", "weights", {"qtype": info.qtype.name})


def diagnose_slice(got: Tensor, want: Tensor, full: Tensor, param: HFParam, rank: int, tp: int,
              n_kv: int, spec: ArchSpec | None = None) -> tuple[str, str, dict] | None:
    """None when ``got`` is rank's expected slice; else (message, component, stats)."""
    rule, component = param.rule, param.component
    got = got.detach()  # compared where the engine holds it (close_to moves the expected values there)
    if tuple(got.shape) == tuple(want.shape):
        ok, diff = close_to(got, want)
        if ok:
            return None
        named = name_layout(got, want, full, param, rank, tp, n_kv, spec, close_to)
        if named is not None:
            return named[0], named[1], {**named[2], "max_abs_diff": diff}
        return (f"values differ from the expected slice (max |diff| {diff:.3g})", component,
                {"max_abs_diff": diff})
    if tp > 1 and rule is not REPLICATED and tuple(got.shape) == tuple(full.shape):
        return ("holds the whole unsharded tensor (sharding not applied)", "sharding", {"shape": list(got.shape)})
    transposed = name_reshaped(got, want, close_to)
    if transposed is not None:
        return transposed[0], component, transposed[1]
    return (f"shape {tuple(got.shape)} != expected slice {tuple(want.shape)}",
            "sharding" if rule.is_split else component, {"shape": list(got.shape), "expected": list(want.shape)})


class LazyRankWeights(Mapping):
    """One rank's parameters, fetched from the engine only when the audit reaches them, so a
    400 GB model is audited one parameter at a time. Parameters the engine does not expose
    are left out of ``items()`` and listed in ``missing``."""

    def __init__(self, engine, names: list[str], rank: int):
        self.engine, self.names, self.rank = engine, names, rank
        self.missing: list[str] = []
        self.by_block: set[str] = set()  # stacked expert parameters the audit reads in expert blocks

    def __getitem__(self, name: str) -> Tensor:
        if hasattr(self.engine, "weight_tensor"):  # held as is, where it is (engines/hf.py)
            return self.engine.weight_tensor(name, rank=self.rank)
        return self._narrowed(torch.as_tensor(self.engine.weight(name, rank=self.rank)))

    def block(self, name: str, experts: slice) -> Tensor:
        """Experts ``experts`` of a stacked expert parameter (``Engine.weight_experts``)."""
        if hasattr(self.engine, "weight_tensor"):
            return self.engine.weight_tensor(name, experts, rank=self.rank)
        return self._narrowed(torch.as_tensor(self.engine.weight_experts(name, experts, rank=self.rank)))

    def _narrowed(self, value: Tensor) -> Tensor:
        # numpy has no bfloat16: an engine holding bf16/fp16 parameters hands them over
        # widened to fp32. Narrowing back is exact for such values and lets the audit apply
        # that dtype's rounding tolerance; a genuinely fp32 weight that was wrong stays wrong.
        held = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.engine.capabilities.activation_dtype)
        if held is not None and value.dtype == torch.float32:
            narrowed = value.to(held)
            if torch.equal(narrowed.float(), value):
                value = narrowed
        return value

    def items(self):
        from ggufcheck.engines.base import Unsupported

        for name in self.names:
            if name in self.by_block:
                continue  # the audit reads it block by block (checks/weights.py)
            try:
                value = self[name]
            except Unsupported:
                self.missing.append(name)
                continue
            yield name, value

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
