"""What was tested, with which, when and where: the lines at the top of every diagnose report.

A verdict read a week later, or pasted into a bug thread, is worth little without the model,
the engine (its version and how many ranks it ran on), the reference, ggufcheck's version,
the exact command, the date and the machine. The terminal, HTML and JSON reports all start
with this header (JSON: ``run``). Nothing here imports a heavy library: the GPU is named only
where torch is already loaded.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import datetime
from typing import Any

from ggufcheck import __version__


def run_header(diagnosis: Any, argv: list[str] | None = None) -> dict[str, str]:
    """The header's fields, in reading order (every value a short string)."""
    o = diagnosis.options
    engine = diagnosis.engine or {}
    out = {"model": _model(o.model)}
    if engine or o.engine:
        out["engine"] = _engine(engine, o)
    out["reference"] = f"{o.reference}" + (f" on {o.reference_device}" if getattr(o, "reference_device", None) else "")
    out["ggufcheck"] = f"{__version__} (python {platform.python_version()})"
    out["command"] = "ggufcheck " + shlex.join(argv if argv is not None else sys.argv[1:])
    out["date"] = datetime.now().astimezone().isoformat(timespec="seconds")
    out["host"] = _host()
    return out


def _model(path) -> str:
    try:
        size = f", {os.path.getsize(path) / 1e9:.2f} GB"
    except OSError:
        size = ""
    return f"{path}{size}"


def _engine(engine: dict, o: Any) -> str:
    text = engine.get("name") or str(o.engine)
    if engine.get("version"):
        text += f", {engine['version']}"
    ranks = int(engine.get("tp_size") or 1)
    text += f"; {ranks} rank{'s' if ranks > 1 else ''}"
    if o.tp and o.tp != ranks:  # --tp checked a split the engine did not run
        text += f" (--tp {o.tp} checked the {o.tp}-way split on the file only: the engine ran on {ranks})"
    return text


def _host() -> str:
    try:
        ram = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        ram = ""
    text = f"{platform.node()} ({platform.system()} {platform.machine()}, {os.cpu_count()} CPUs{ram})"
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                text += f"; GPU: {', '.join(names)} (CUDA {torch.version.cuda})"
        except Exception:  # noqa: BLE001 - a broken CUDA setup must not break the report
            pass
    return text
