"""One tensor table per supported architecture (rows in the family modules beside this)."""

from __future__ import annotations

from ggufcheck.arch.spec import ArchSpec, GenericSpec
from ggufcheck.arch.table import TensorTable
from ggufcheck.arch.tables.dense import LLAMA, QWEN2, QWEN3
from ggufcheck.arch.tables.glm4moe import GLM4MOE
from ggufcheck.arch.tables.mla import DEEPSEEK2, GLM_DSA

TABLES: dict[str, TensorTable] = {t.arch: t for t in (LLAMA, QWEN2, QWEN3, GLM4MOE, DEEPSEEK2, GLM_DSA)}


def table_for(spec: ArchSpec | GenericSpec | str) -> TensorTable | None:
    """The table of an architecture, or None when ggufcheck has none (the mapping check SKIPs)."""
    arch = spec if isinstance(spec, str) else spec.arch
    return TABLES.get(arch)
