"""Terminal report: a readable summary of stages and their results, through rich.

Failures are always shown in full; long runs of passing per-tensor checks collapse into a
count so a 1,800-tensor model still fits on a screen.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ggufcheck.results import Result, StageReport, Status

STYLE = {Status.PASS: "green", Status.FAIL: "bold red", Status.SKIP: "yellow", Status.ERROR: "bold magenta",
         Status.WARN: "bold yellow"}
MAX_PASS_ROWS_PER_CHECK = 6


def status_text(status: Status) -> str:
    return f"[{STYLE[status]}]{status.value}[/]"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def human_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def render_stage(console: Console, stage: StageReport, verbose: bool = False) -> None:
    table = Table(title=f"stage: {stage.stage}  {status_text(stage.status)}", title_justify="left",
                  show_lines=False, expand=True)
    table.add_column("status", no_wrap=True)
    table.add_column("check", overflow="fold", max_width=30)
    table.add_column("where: message", overflow="fold", ratio=1)
    by_check: dict[str, list[Result]] = defaultdict(list)
    for r in stage.results:
        by_check[r.check].append(r)
    for check, results in by_check.items():
        passes = [r for r in results if r.status == Status.PASS]
        others = [r for r in results if r.status != Status.PASS]
        shown = passes if verbose or len(passes) <= MAX_PASS_ROWS_PER_CHECK else []
        for r in others + shown:
            where = _where(r)
            table.add_row(status_text(r.status), check, f"[cyan]{escape(where)}[/]: {escape(r.message)}"
                          if where else escape(r.message))
        if len(shown) < len(passes):
            table.add_row(status_text(Status.PASS), check, f"all {len(passes)} passed (--verbose lists them)")
    console.print(table)


def _where(r: Result) -> str:
    parts = []
    if r.tensor:
        parts.append(r.tensor)
    if r.layer is not None and not r.tensor:
        parts.append(f"layer {r.layer}")
    return " ".join(parts)


def render_totals(console: Console, stages: Iterable[StageReport]) -> None:
    counts = {s: 0 for s in Status}
    for stage in stages:
        for r in stage.results:
            counts[r.status] += 1
    console.print("  ".join(f"{status_text(s)} {n}" for s, n in counts.items()))
