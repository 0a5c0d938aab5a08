"""``ggufcheck rejudge DIR``: a run saved with ``diagnose --save-run DIR`` judged again, without the engine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

from ggufcheck.cli.diagnose import exit_status, reference_device, write_reports
from ggufcheck.errors import UsageError
from ggufcheck.report.diagnosis import render_diagnosis
from ggufcheck.report.header import run_header


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rejudge",
        help="judge a saved run again without its engine (diagnose --save-run DIR)",
        description="Judge a run saved with `ggufcheck diagnose ... --save-run DIR` again: the same stages, the "
                    "engine's saved answers in place of the engine, the reference recomputed from the model file. "
                    "The environment probes, the weights audit and the switch stage need the engine: their reports "
                    "are carried over from the saved run as they were.",
    )
    p.add_argument("run_dir", type=Path, metavar="DIR", help="the directory diagnose --save-run wrote")
    p.add_argument("--model", type=Path, metavar="PATH",
                   help="the GGUF file where it is now (default: where the run read it; it must be the same file)")
    p.add_argument("--reference-device", metavar="DEV",
                   help="where the fp64 reference runs: auto, cpu, cuda or cuda:N (default: as the run said)")
    p.add_argument("--json", type=Path, help="write every stage, check and the verdict to this JSON file "
                   "(\"-\": standard output, the rest on standard error)")
    p.add_argument("--html", type=Path, help="write a self-contained HTML report with plots")
    p.add_argument("-v", "--verbose", action="store_true", help="list every check of every stage")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line while running")


def run(args: argparse.Namespace) -> int:
    from ggufcheck.diagnose.rejudge import describe_replay, rejudge

    device = reference_device(args.reference_device) if args.reference_device is not None else None
    if not args.run_dir.is_dir():
        raise UsageError(f"{args.run_dir}: no such directory", tip="save a run with diagnose --save-run DIR")
    console = Console()
    if args.quiet:
        diagnosis, engine = rejudge(args.run_dir, model=args.model, reference_device=device)
    else:
        started = time.perf_counter()
        with Console(stderr=True).status("re-judging") as status:
            diagnosis, engine = rejudge(args.run_dir, model=args.model, reference_device=device,
                                        progress=lambda msg: status.update(
                                            f"{msg} [dim]({time.perf_counter() - started:.0f} s)[/]"))
    header = run_header(diagnosis, getattr(args, "argv", None))
    render_diagnosis(console, diagnosis, verbose=args.verbose, header=header)
    console.print(describe_replay(engine), markup=False, highlight=False, soft_wrap=True)
    write_reports(diagnosis, args.json, args.html, console, header)
    return exit_status(diagnosis)
