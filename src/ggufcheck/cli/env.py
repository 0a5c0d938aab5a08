"""``ggufcheck env [--python PATH] [--device N] [--json FILE]``: the target environment."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from ggufcheck.checks.environment import EnvOptions, run_environment_stage
from ggufcheck.errors import ExitStatus
from ggufcheck.probe.runner import ProbeTarget
from ggufcheck.report.json import report_json, write_json
from ggufcheck.report.text import render_stage, render_totals


@dataclass(frozen=True)
class EnvCliOptions:
    python: str
    device: int
    json: Path | None
    verbose: bool
    scan: bool
    cuobjdump_budget: float
    cuobjdump_all: bool = False


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """--python and --device, shared with ``ggufcheck kernels``."""
    p.add_argument("--python", default=sys.executable, metavar="PATH",
                   help="the engine's Python interpreter to probe (default: this one)")
    p.add_argument("--device", type=int, default=0, metavar="N",
                   help="GPU index among the visible devices; the probe sees only it (default 0)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env", help="probe the engine's Python: torch, CUDA, GPU, engine packages, GPU code in their binaries",
        description="Run a probe inside the target interpreter (a subprocess of that exact Python, "
        "CUDA_VISIBLE_DEVICES set to one device) and report Python, torch, CUDA runtime and driver, "
        "the GPU, each engine package's version and import path, and whether their compiled "
        "extensions carry machine code (SASS) for this GPU, only PTX, or neither.")
    add_target_arguments(p)
    p.add_argument("--json", type=Path, help="write every result to this JSON file "
                   "(\"-\": standard output, the rest on standard error)")
    p.add_argument("--no-scan", dest="scan", action="store_false",
                   help="skip reading the fatbinaries of compiled extensions")
    p.add_argument("--cuobjdump-budget", type=float, default=120.0, metavar="S",
                   help="seconds of cuobjdump cross-checks at most (default 120; 0: none)")
    p.add_argument("--cuobjdump-all", action="store_true",
                   help="cross-check the fatbinary parse with cuobjdump on every file with GPU code (default: each "
                        "package's smallest; on torch the largest alone takes ~13 s)")
    p.add_argument("-v", "--verbose", action="store_true", help="list passing checks too")


def run(args: argparse.Namespace) -> int:
    options = EnvCliOptions(args.python, args.device, args.json, args.verbose, args.scan,
                            args.cuobjdump_budget, args.cuobjdump_all)
    console = Console()
    stage = run_environment_stage(EnvOptions(target=ProbeTarget(options.python, options.device),
                                             scan_extensions=options.scan,
                                             cuobjdump_budget_s=options.cuobjdump_budget,
                                             cuobjdump_all=options.cuobjdump_all))
    if options.json:  # first: a report that fails to render must not lose the results
        write_json(options.json, report_json("env", [stage], python=options.python,
                                             device=options.device))
    render_stage(console, stage, verbose=options.verbose)
    render_totals(console, [stage])
    if options.json:
        console.print(f"JSON report: {options.json}")
    return int(ExitStatus.FINDINGS if stage.failures else ExitStatus.HEALTHY)
