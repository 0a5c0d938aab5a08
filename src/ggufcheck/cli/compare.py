"""``ggufcheck compare MODEL.gguf --engine SPEC``: an engine, position by position, vs the reference.

Tokenizes the prompts once (with the engine's tokenizer when it has one, else the GGUF's
own), scores them on the engine, the fp64 reference and the baseline run, and prints the
sanity, logits and paths stages. Exit 0 healthy, 1 findings, 2 usage, 3 engine unreachable.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from ggufcheck.engines.spec import SPEC_HELP
from ggufcheck.errors import ExitStatus, UsageError
from ggufcheck.report.json import report_json, write_json
from ggufcheck.report.text import render_stage, render_totals


@dataclass(frozen=True)
class CompareCliOptions:
    model: Path
    engine: str
    reference: str
    baseline: str
    prompts: Path | None
    json: Path | None
    max_prompts: int | None
    max_tokens: int
    new_tokens: int
    top_k: int
    timeout: float
    paths: bool
    sanity: bool
    verbose: bool
    decode_to: int = 272
    sweep_to: int = 520
    html: Path | None = None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="compare an engine's next-token distributions with the reference, teacher-forced",
        description="Teacher-forced comparison of an engine with ggufcheck's fp64 reference on the same "
                    "tokens (KL, argmax agreement, delta-p, NMSE), sanity of its distributions, and "
                    "execution-path invariance (prefill vs decode, batch, determinism, chunked prefill).",
    )
    p.add_argument("model", type=Path, help="the GGUF file the engine serves")
    p.add_argument("--engine", required=True, metavar="SPEC", help=f"the engine under test: {SPEC_HELP}")
    p.add_argument("--reference", default="reference", metavar="SPEC",
                   help="the trusted engine (default: reference, fp64); 'none' skips the logits stage")
    p.add_argument("--baseline", default="auto", metavar="SPEC",
                   help="low-precision run of the reference giving the expected error of a correct engine "
                        "(default auto: reference:fp32; 'none': stated allowances only)")
    p.add_argument("--prompts", type=Path, help="prompt file: one per line, or JSONL with \"text\"")
    p.add_argument("--json", type=Path, help="write every result to this JSON file "
                   "(\"-\": standard output, the rest on standard error)")
    p.add_argument("--html", type=Path, help="write a self-contained HTML report with the KL plots")
    p.add_argument("--max-prompts", type=int, help="use only the first N prompts")
    p.add_argument("--max-tokens", type=int, default=512, help="truncate each prompt to N tokens (default 512)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy decode steps per path check (default 8)")
    p.add_argument("--decode-to", type=int, default=272, metavar="POS",
                   help="decode the first prompt up to this position, past the usual KV-cache block sizes "
                        "(default 272; 0: --new-tokens only)")
    p.add_argument("--sweep-to", type=int, default=520, metavar="LEN",
                   help="score prompts whose lengths straddle each landmark (DSA top_k, the engine's "
                        "micro-batch, cache block sizes) up to LEN tokens (default 520; 0: no sweep)")
    p.add_argument("--top-k", type=int, default=20, help="top-k requested from engines without full logits")
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP engines: seconds per request (default 60)")
    p.add_argument("--no-paths", dest="paths", action="store_false", help="skip the execution-path checks")
    p.add_argument("--no-sanity", dest="sanity", action="store_false",
                   help="skip the sanity checks (for random-weight test models)")
    p.add_argument("-v", "--verbose", action="store_true", help="list passing checks too")


def _options(args: argparse.Namespace) -> CompareCliOptions:
    for name in ("max_prompts", "max_tokens", "new_tokens", "top_k"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, not {value}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, not {args.timeout}")
    for name in ("decode_to", "sweep_to"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, not {getattr(args, name)}")
    if not args.model.is_file():
        raise UsageError(f"{args.model}: no such file")
    return CompareCliOptions(args.model, args.engine, args.reference, args.baseline, args.prompts, args.json,
                             args.max_prompts, args.max_tokens, args.new_tokens, args.top_k, args.timeout,
                             args.paths, args.sanity, args.verbose, args.decode_to, args.sweep_to,
                             getattr(args, "html", None))


def run(args: argparse.Namespace) -> int:
    """The served stage of the diagnosis plan (checks.compare.run) on a session of its own:
    the same prompts, tokenization, reference, baseline and defaults as ``diagnose``."""
    from ggufcheck.checks.compare import run as run_served
    from ggufcheck.diagnose.session import DiagnoseOptions, Session

    options = _options(args)
    console = Console(stderr=False)
    say = (lambda msg: console.print(f"[dim]{msg}[/dim]"))
    started = time.perf_counter()
    baseline = options.baseline
    if baseline == "auto":  # a fp32 reference is its own fp32 baseline
        baseline = "none" if options.reference in ("none", "reference:fp32") else "reference:fp32"
    session = Session(DiagnoseOptions(
        model=options.model, engine=options.engine, prompts=options.prompts, max_prompts=options.max_prompts,
        max_tokens=options.max_tokens, new_tokens=options.new_tokens, decode_to=options.decode_to,
        sweep_to=options.sweep_to, sanity=options.sanity, top_k=options.top_k, timeout=options.timeout,
        reference=options.reference, baseline=baseline, paths=options.paths), say)
    try:
        stages = run_served(session)
        tokenizer_used, prompts = session.tokenizer_used, len(session.tokens())
    finally:
        session.close()
    for stage in stages:
        render_stage(console, stage, verbose=options.verbose)
    render_totals(console, stages)
    elapsed = time.perf_counter() - started
    if options.json:
        write_json(options.json, report_json("compare", stages, model=str(options.model), engine=options.engine,
                                             tokenizer=tokenizer_used, prompts=prompts, elapsed_s=elapsed))
    if options.html:
        from ggufcheck.report.html import render_html, write_html

        summary = {"model": str(options.model), "engine": options.engine, "tokenizer": tokenizer_used,
                   "prompts": prompts, "elapsed (s)": f"{elapsed:.1f}"}
        write_html(options.html, render_html(f"ggufcheck compare {options.model.name}", stages, None, summary))
        console.print(f"HTML report: {options.html}")
    failed = any(s.failures for s in stages)
    return int(ExitStatus.FINDINGS if failed else ExitStatus.HEALTHY)
