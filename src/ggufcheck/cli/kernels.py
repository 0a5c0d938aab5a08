"""``ggufcheck kernels [--python PATH] [--device N] [--model MODEL.gguf] [--json FILE]``.

Every kernel the engine would use, run inside the engine's own interpreter on one GPU, in
three tiers: imports, runs (output poisoned first), agrees with fp64 within a tolerance
derived from the dtype and an honest low-precision baseline.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ggufcheck.checks.kernels import KernelOptions, run_kernel_stage
from ggufcheck.cli.env import add_target_arguments
from ggufcheck.errors import ExitStatus, UsageError
from ggufcheck.probe.runner import ProbeTarget
from ggufcheck.report.json import report_json, write_json
from ggufcheck.report.text import render_stage, render_totals, status_text
from ggufcheck.results import StageReport, Status

KINDS = ("sdpa", "varlen", "rmsnorm", "rope", "router", "indexer", "linear", "dequant", "ggml_matmul",
         "fused_moe")


@dataclass(frozen=True)
class KernelsCliOptions:
    python: str
    device: int
    model: Path | None
    json: Path | None
    only: tuple[str, ...]
    verbose: bool
    case_timeout: float


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kernels", help="check attention, GGUF and building-block kernels on the target GPU against fp64",
        description="Run each kernel the engine would use inside the target interpreter on one GPU: "
        "torch SDPA per forced backend (flash, efficient, cudnn, math) at MLA prefill/decode and GQA "
        "shapes, flash_attn_varlen_func, GGUF dequantization and vLLM's ggml ops, RMSNorm, both RoPE "
        "pairings, router and indexer top-k, linear. Each case: imports -> runs (output poisoned "
        "first) -> agrees with fp64. Without a GPU the CPU versions run and GPU-only cases SKIP.")
    add_target_arguments(p)
    p.add_argument("--model", type=Path, help="use this GGUF's shapes, weight rows and quant types")
    p.add_argument("--json", type=Path, help="write every result to this JSON file "
                   "(\"-\": standard output, the rest on standard error)")
    p.add_argument("--only", action="append", choices=KINDS, metavar="KIND",
                   help=f"run only these kinds (repeatable): {', '.join(KINDS)}")
    p.add_argument("--case-timeout", type=float, default=180.0, metavar="S",
                   help="kill the probe if one case runs longer than this (default 180 s)")
    p.add_argument("-v", "--verbose", action="store_true", help="list passing checks too")


def run(args: argparse.Namespace) -> int:
    options = KernelsCliOptions(args.python, args.device, args.model, args.json,
                                tuple(args.only or ()), args.verbose, args.case_timeout)
    if options.model is not None and not options.model.is_file():
        raise UsageError(f"--model {options.model}: no such file")
    console = Console()
    stage = run_kernel_stage(KernelOptions(target=ProbeTarget(options.python, options.device),
                                           model=options.model, only=options.only,
                                           case_timeout_s=options.case_timeout))
    if options.json:  # first: a report that fails to render must not lose the results
        write_json(options.json, report_json("kernels", [stage], python=options.python,
                                             device=options.device,
                                             model=str(options.model) if options.model else None))
    for key, note in (stage.info.get("data") or {}).items():
        console.print(f"[dim]data {key}: {note}[/]")
    if options.verbose:
        render_stage(console, stage, verbose=True)
    else:
        render_compact(console, stage)
    render_totals(console, [stage])
    if options.json:
        console.print(f"JSON report: {options.json}")
    return int(ExitStatus.FINDINGS if stage.failures else ExitStatus.HEALTHY)


def render_compact(console: Console, stage: StageReport) -> None:
    """Failures in full; passes counted per kind with the worst error; skips grouped by reason."""
    table = Table(title=f"stage: {stage.stage}  {status_text(stage.status)}", title_justify="left")
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("message", overflow="fold")
    for r in stage.results:
        if r.status in (Status.FAIL, Status.ERROR):
            table.add_row(status_text(r.status), r.check, escape(r.message))
    by_kind: dict[str, list] = {}
    for r in stage.results:
        by_kind.setdefault(r.check, []).append(r)
    for check, results in by_kind.items():
        passes = [r for r in results if r.status == Status.PASS]
        if passes:
            rated = [r for r in passes if isinstance(r.stats.get("rel_l2"), float)
                     and isinstance(r.stats.get("tol"), float)]  # JSON turns NaN into "nan"
            worst = max(rated, key=lambda r: r.stats["rel_l2"] / max(r.stats["tol"], 1e-300), default=None)
            note = (f"; closest to its tolerance: {worst.message.split(' | ')[0]} "
                    f"(rel err {worst.stats['rel_l2']:.3g}, tol {worst.stats['tol']:.3g})") if worst else ""
            table.add_row(status_text(Status.PASS), check, f"{len(passes)} cases{note}")
        reasons: dict[str, int] = {}
        for r in results:
            if r.status == Status.SKIP:
                reason = r.message.split(" | ", 1)[-1]
                reasons[reason] = reasons.get(reason, 0) + 1
        for reason, n in reasons.items():
            table.add_row(status_text(Status.SKIP), check, escape(f"{n} case(s): {reason}"))
    console.print(table)
