"""The thing under test and its oracle do not share code: product modules never import
``ggufcheck.testing`` (the fault engines import product code, not the reverse). The demo
command is the one place that builds a faulty engine on purpose: the engine it diagnoses, not
an oracle (the diagnosis judges it against the reference like any deployment)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "ggufcheck"
ALLOWED = {SRC / "cli" / "demo.py"}


def _imports(path: Path, typing_only: bool = True) -> set[str]:
    """The modules ``path`` imports; ``typing_only=False`` leaves out ``if TYPE_CHECKING:`` ones."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
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


def test_product_code_does_not_import_the_fault_kit():
    """engines/faults.py corrupts engines on purpose (a public kit to prove checks can fail);
    product code wraps engines through engines/wrapped.py, never through the kit."""
    kit = "ggufcheck.engines.faults"
    offenders = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                       if (SRC / "testing") not in p.parents and p not in ALLOWED | {SRC / "engines" / "faults.py"}
                       and kit in _imports(p))
    assert not offenders, offenders


def test_the_product_holds_no_fault_of_the_real_engines():
    """Faults injected into the real vLLM live in a plug-in of the tests' vLLM venv
    (tools/vllm/faults), not in the worker ggufcheck ships."""
    offenders = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                       if (SRC / "testing") not in p.parents and "GGUFCHECK_VLLM_FAULT" in p.read_text())
    assert not offenders, offenders


def test_no_two_modules_import_each_other():
    """Within the package, imports run one way (the data flow): no module pair imports each
    other, a lazy import inside a function included (type-only imports, and a package's
    ``__init__`` re-exporting its own parts, are not cycles)."""
    modules = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = {m for m in _imports(path, typing_only=False) if m.startswith("ggufcheck")}
    pairs = sorted({tuple(sorted((a, b))) for a, deps in modules.items() for b in deps
                    if b in modules and a in modules[b] and a != b
                    and not (b.startswith(a + ".") or a.startswith(b + "."))})  # a package and its own part
    assert not pairs, pairs
