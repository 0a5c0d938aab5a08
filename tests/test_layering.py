"""The thing under test and its oracle do not share code: product modules never import
``ggufcheck.testing`` (the fault engines import product code, not the reverse). The demo
command is the one place that builds a faulty engine on purpose: the engine it diagnoses, not
an oracle (the diagnosis judges it against the reference like any deployment)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "ggufcheck"
ALLOWED = {SRC / "cli" / "demo.py"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_product_code_does_not_import_the_testing_package():
    offenders = {}
    for path in SRC.rglob("*.py"):
        if (SRC / "testing") in path.parents or path in ALLOWED:
            continue
        bad = sorted(m for m in _imports(path) if m == "ggufcheck.testing" or m.startswith("ggufcheck.testing."))
        if bad:
            offenders[str(path.relative_to(SRC))] = bad
    assert not offenders, offenders
