"""An engine's error against the arithmetic it states, on the same rows.

A correct kernel differs from the fp64 reference by the rounding its engine says it does; the
reference computing that rounding (reference.precision, a baseline run) differs by as much. So
on the same rows, the engine's KL over the emulation's is ~1 for a correct kernel, and a kernel
two orders of magnitude off its own arithmetic shows here while it still passes a class
allowance. Used by the kernel matrix (its verdict) and the served stage (a warning on the decode
path). Rows from a MoE routing / DSA indexer near-tie of the reference onward are left out on
both sides: a flip is not a kernel's arithmetic.
"""

from __future__ import annotations

import numpy as np

from ggufcheck.checks.logits import LogitTolerance, compare_tables


def row_kls(reference, engine_table, emulated_table, start: int):
    """(KL per row of the engine, of the emulation) against ``reference`` on rows ``start``..,
    both rows present, and no near-tie of the reference at or before them (from ``start``)."""
    n = len(reference.tokens)
    keep = np.zeros(n, dtype=bool)
    keep[start:n - 1] = True
    if reference.ambiguous is not None:
        tied = np.flatnonzero(reference.ambiguous[start:])
        if len(tied):
            keep[start + int(tied[0]):] = False
    for table in (engine_table, emulated_table):
        if table.present is not None:
            keep &= table.present
    if not keep.any():
        return None
    kls = []
    for table in (engine_table, emulated_table):
        part = compare_tables(only_rows(reference, keep), table)
        kls.append(np.asarray(part["kl"], dtype=np.float64))
    return kls


def only_rows(table, rows):
    from dataclasses import replace

    present = rows if table.present is None else (table.present & rows)
    return replace(table, present=present, ambiguous=None)


def means(rows) -> tuple[float, float] | None:
    rows = [r for r in rows if r is not None]
    if not rows:
        return None
    engine = np.concatenate([r[0] for r in rows])
    emulated = np.concatenate([r[1] for r in rows])
    if not len(engine) or not len(emulated):
        return None
    return float(np.mean(engine)), float(np.mean(emulated))


def excess(pair: tuple[float, float] | None, tolerance: LogitTolerance = LogitTolerance()) -> float | None:
    """The ratio engine / emulation where the engine exceeds ``multiple x emulation + floor``
    (the served formula without the class allowance); None within it or without a pair."""
    if pair is None:
        return None
    kl, emulated = pair
    if kl <= tolerance.multiple * emulated + tolerance.kl_floor or emulated <= 0:
        return None
    return kl / emulated
