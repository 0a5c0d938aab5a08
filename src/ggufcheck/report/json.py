"""JSON report: every stage and every check, with a schema version.

The layout is stable for machines: ``{"schema_version", "tool", "command", "model",
"stages": [...], "verdict"?}``; each stage carries its results as written by
:meth:`ggufcheck.results.Result.to_json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from ggufcheck import __version__
from ggufcheck.errors import UsageError
from ggufcheck.results import SCHEMA_VERSION, StageReport, _jsonable


def report_json(command: str, stages: Iterable[StageReport], **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "ggufcheck", "version": __version__},
        "command": command,
    }
    doc.update(_jsonable(extra))
    doc["stages"] = [s.to_json() for s in stages]
    return doc


STDOUT: Any = None  # where ``--json -`` writes: the real stdout (cli.main sends the rest to stderr)


def write_json(path: str | os.PathLike, doc: dict[str, Any]) -> None:
    """Write atomically (temp file + rename) so a reader never sees half a report; ``-``:
    to standard output (the human report then goes to standard error)."""
    if str(path) == "-":
        import sys

        out = STDOUT or sys.stdout
        out.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        out.flush()
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise UsageError(f"cannot write JSON report to {path}: {err.strerror or err}") from None
