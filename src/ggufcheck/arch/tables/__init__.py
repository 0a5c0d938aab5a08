"""One tensor table per supported architecture (rows in the family modules beside this);
which table an architecture uses is declared with its family (arch/families.py)."""

from __future__ import annotations

import importlib

from ggufcheck.arch.families import FAMILIES
from ggufcheck.arch.spec import ArchSpec, GenericSpec
from ggufcheck.arch.table import TensorTable


def _load(where: str) -> TensorTable:
    module, name = where.split(":")
    return getattr(importlib.import_module(f"ggufcheck.arch.tables.{module}"), name)


TABLES: dict[str, TensorTable] = {arch: _load(f.table) for arch, f in FAMILIES.items()}


def table_for(spec: ArchSpec | GenericSpec | str) -> TensorTable | None:
    """The table of an architecture, or None when ggufcheck has none (the mapping check SKIPs)."""
    arch = spec if isinstance(spec, str) else spec.arch
    return TABLES.get(arch)
