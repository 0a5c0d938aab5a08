"""Terminal rendering of a diagnosis: the stage ladder, the failures, and the verdict.

The ladder shows every stage in the order it ran with what it eliminates and its counts,
so a reader sees at a glance which variables are cleared; then every failing check in full;
then the verdict with its evidence and what to look at next.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from ggufcheck.report.text import render_stage, status_text
from ggufcheck.results import Status

MAX_FAILURES_SHOWN = 12


def render_diagnosis(console: Console, diagnosis: Any, verbose: bool = False,
                     header: dict[str, str] | None = None) -> None:
    if header:  # what was tested, with which, when and where (report/header.py)
        width = max(len(k) for k in header)
        for key, value in header.items():
            console.print(f"[bold]{key:<{width}}[/] {escape(value)}", highlight=False, soft_wrap=True)
    ladder = Table(title="diagnosis, in dependency order", title_justify="left", expand=True)
    ladder.add_column("stage", no_wrap=True)
    ladder.add_column("status", no_wrap=True)
    ladder.add_column("eliminates", ratio=1, overflow="fold")
    ladder.add_column("pass/fail/skip/error", no_wrap=True)
    for stage in diagnosis.stages:
        counts = {s: 0 for s in Status}
        for r in stage.results:
            counts[r.status] += 1
        note = stage.info.get("eliminates", "")
        if stage.status == Status.SKIP and stage.results:
            note = f"{note} [yellow](skipped: {escape(stage.results[0].message)})[/]"
        ladder.add_row(stage.stage, status_text(stage.status), note,
                       "/".join(str(counts[s]) for s in (Status.PASS, Status.FAIL, Status.SKIP, Status.ERROR)))
    console.print(ladder)
    timings = getattr(diagnosis, "timings", None) or {}
    if timings:  # where the time went, per stage of the plan (the served stage: sanity, logits, paths)
        console.print("[dim]time: " + ", ".join(f"{name} {t:.1f} s" for name, t in timings.items()) + "[/dim]")
    if verbose:
        for stage in diagnosis.stages:
            render_stage(console, stage, verbose=True)
    else:
        failing = [(s.stage, r) for s in diagnosis.stages for r in s.results
                   if r.status in (Status.FAIL, Status.ERROR, Status.WARN)]
        if failing:
            title = "failing checks" + (" and warnings" if any(r.status == Status.WARN for _, r in failing) else "")
            table = Table(title=title, title_justify="left", expand=True)
            table.add_column("stage", no_wrap=True)
            table.add_column("status", no_wrap=True)
            table.add_column("component", no_wrap=True)
            table.add_column("where: message", ratio=1, overflow="fold")
            for stage, r in failing[:MAX_FAILURES_SHOWN]:
                where = r.tensor or (f"layer {r.layer}" if r.layer is not None else "")
                table.add_row(stage, status_text(r.status), r.component,
                              (f"[cyan]{escape(where)}[/]: " if where else "") + escape(r.message))
            if len(failing) > MAX_FAILURES_SHOWN:
                table.add_row("", "", "", f"... {len(failing) - MAX_FAILURES_SHOWN} more (--json or --verbose)")
            console.print(table)
    render_verdict(console, diagnosis.verdict, diagnosis.elapsed_s)


def render_verdict(console: Console, verdict: Any, elapsed_s: float | None = None) -> None:
    if verdict.healthy:
        title, style = "verdict: healthy", "green"
        body = escape(verdict.message)
    elif getattr(verdict, "unverified", False):
        title, style = "verdict: not verified", "yellow"
        body = escape(verdict.message) + (f"\n[bold]look next at:[/] {escape(verdict.next_steps)}"
                                          if verdict.next_steps else "")
    elif verdict.component is None:
        title, style = "verdict: inconclusive", "magenta"
        body = escape(verdict.message) + "".join(f"\n  - {escape(e)}" for e in verdict.errors[:5])
    else:
        where = f" at layer {verdict.layer}" if verdict.layer is not None else ""
        title, style = f"verdict: {verdict.component}{where}", "red"
        lines = [f"[bold]first failing component:[/] {verdict.component}{where} "
                 f"(stage {verdict.stage}, check {verdict.check})",
                 f"[bold]evidence:[/] {escape(verdict.message)}"]
        if verdict.evidence.get("tensor"):
            lines.append(f"[bold]tensor:[/] {escape(str(verdict.evidence['tensor']))}")
        if verdict.evidence.get("worst"):
            lines.append(f"[bold]worst:[/] {escape(plain(verdict.evidence['worst']))}")
        if verdict.next_steps:
            lines.append(f"[bold]look next at:[/] {escape(verdict.next_steps)}")
        body = "\n".join(lines)
    if elapsed_s is not None:
        body += f"\n[dim]{elapsed_s:.1f} s[/]"
    console.print(Panel(body, title=title, border_style=style, title_align="left"))


def plain(value) -> str:
    """``{'rank': 1, 'position': 81}`` -> ``rank 1, position 81`` (no Python syntax on a terminal)."""
    if isinstance(value, dict):
        return ", ".join(f"{str(k).replace('_', ' ')} {plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(plain(v) for v in value)
    if isinstance(value, float):
        return f"{value:.3g}"  # a KL of 10.058613658112662 reads as 10.1
    return str(value)
