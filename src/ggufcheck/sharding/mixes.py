"""Assumed quant mixes, to plan a real model's sharding without its 400 GB file.

A plan needs every tensor's type (block alignment, bytes per rank). Without the file we
state an assumption: an ordered list of (regex on the GGUF short name, type); the first
match wins. These approximate common llama.cpp recipes; they are assumptions, printed in
every plan made from them, not facts about any published file.

- ``q4_k_m``: K-quants like llama.cpp's Q4_K_M: Q4_K for 2-D weights, Q6_K for every
  ``ffn_down*`` and ``output`` (Q4_K_M uses Q6_K for some of them), Q8_0 for MLA's k_b /
  v_b (rows of P = 128 / 192 cannot be 256-blocks) and the DSA indexer, F32 for norms,
  biases, the router (llama.cpp never quantizes ``ffn_gate_inp``) and ``indexer.proj``.
- ``q8_0``: Q8_0 for every 2-D weight, the same F32 exceptions.
- ``bf16``: BF16 for every 2-D weight, the same F32 exceptions.
"""

from __future__ import annotations

import re

import gguf

from ggufcheck.arch.spec import ArchSpec
from ggufcheck.arch.table import TensorTable, expected_tensors
from ggufcheck.errors import UsageError
from ggufcheck.sharding.plan import PlannedTensor
from ggufcheck.sharding.rules import short_name

Q = gguf.GGMLQuantizationType
_F32_ALWAYS = [(r"(norm|bias)", Q.F32), (r"^ffn_gate_inp\.", Q.F32), (r"^indexer\.proj\.", Q.F32)]

MIXES: dict[str, list[tuple[str, Q]]] = {
    "q4_k_m": _F32_ALWAYS + [(r"^attn_[kv]_b\.", Q.Q8_0), (r"^indexer\.", Q.Q8_0),
                             (r"^ffn_down", Q.Q6_K), (r"^output\.", Q.Q6_K), (r".", Q.Q4_K)],
    "q8_0": _F32_ALWAYS + [(r".", Q.Q8_0)],
    "bf16": _F32_ALWAYS + [(r".", Q.BF16)],
}


def mix_type(mix: str, name: str, ndim: int) -> Q:
    """The assumed type of tensor ``name`` (1-D tensors are always F32)."""
    if ndim == 1:
        return Q.F32
    short = short_name(name)[1]
    for pattern, qtype in MIXES[mix]:
        if re.search(pattern, short):
            return qtype
    raise AssertionError("every mix ends with a catch-all")


def planned_tensors(spec: ArchSpec, table: TensorTable, mix: str) -> dict[str, PlannedTensor]:
    """Every tensor the spec calls for (NextN layers included, as the file has them)."""
    if mix not in MIXES:
        raise UsageError(f"unknown quant mix {mix!r}; known: {', '.join(MIXES)}")
    out = {}
    for name, exp in expected_tensors(spec, table).items():
        if not exp.required and exp.row.gguf in ("output.weight",):
            pass  # untied output is the common case for these models: keep it
        elif not exp.required:
            continue
        out[name] = PlannedTensor(name, exp.shape, mix_type(mix, name, len(exp.shape)))
    return out
