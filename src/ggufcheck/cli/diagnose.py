"""``ggufcheck diagnose MODEL.gguf --engine SPEC``: every stage in order, and the verdict."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rich.console import Console

from ggufcheck.diagnose.plan import DiagnoseOptions, Diagnosis, diagnose
from ggufcheck.engines.spec import SPEC_HELP
from ggufcheck.errors import ExitStatus, UsageError
from ggufcheck.report.diagnosis import render_diagnosis
from ggufcheck.report.header import run_header
from ggufcheck.report.html import render_html, write_html
from ggufcheck.report.json import report_json, write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose",
        help="run every applicable stage in dependency order and name the first failing component",
        description="Diagnose a deployment: environment and kernels (with --python/--device), the file, "
                    "sharding (with --tp), loaded weights, per-layer comparison, served distributions and "
                    "execution paths; the verdict names the first component that fails, with evidence.",
    )
    p.add_argument("model", type=Path, help="the GGUF file the deployment serves")
    p.add_argument("--engine", metavar="SPEC", help=f"the engine under test (required): {SPEC_HELP}")
    p.add_argument("--python", metavar="PATH", help="the engine's Python interpreter (runs the env/kernel probes)")
    p.add_argument("--device", type=int, metavar="N", help="GPU index for the probes")
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size to verify")
    p.add_argument("--prompts", type=Path, help="prompt file: one per line, or JSONL with \"text\"")
    p.add_argument("--max-prompts", type=int, default=4, help="prompts to use (default 4)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    p.add_argument("--decode-to", type=int, default=272, metavar="POS",
                   help="decode the first prompt up to this position, past the usual KV-cache block sizes "
                        "(default 272; 0: short decodes only)")
    p.add_argument("--sweep-to", type=int, default=520, metavar="LEN",
                   help="score prompts whose lengths straddle each landmark (DSA top_k, the engine's "
                        "micro-batch, cache block sizes) up to LEN tokens (default 520; 0: no sweep)")
    p.add_argument("--top-k", type=int, default=20, help="top-k requested from engines without full logits (default 20)")
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP engines: seconds per request (default 60)")
    p.add_argument("--reference", default="reference", metavar="SPEC",
                   help="the trusted implementation: ggufcheck's fp64 reference (default) or another engine "
                        "(e.g. hf:fp32, llama-cpp:type_k=0,type_v=0); two independent implementations agreeing is "
                        "the evidence, and where they disagree the verdict says so, not which is wrong")
    p.add_argument("--baseline", default="reference:fp32", metavar="SPEC",
                   help="low-precision reference run giving a correct engine's expected error (or 'none')")
    p.add_argument("--no-health", dest="health", action="store_false", help="skip the dequantization health scan")
    p.add_argument("--no-kernels", dest="kernels", action="store_false", help="probe the environment only")
    p.add_argument("--no-sanity", dest="sanity", action="store_false",
                   help="skip output sanity (random-weight test models are near-flat by nature)")
    p.add_argument("--plan-only", dest="shard_numeric", action="store_false",
                   help="with --tp: check the shard plan and kv_b slices, not the sharded arithmetic")
    p.add_argument("--layers", metavar="LIST", help="check only these layers, e.g. 0,1,40 or 0-3,40: their weights "
                   "alone are read, each replayed on the engine's own input; the served stage needs every layer and "
                   "is skipped (the report says what was not checked)")
    p.add_argument("--experts", metavar="LIST", help="audit only these routed experts of each MoE layer, e.g. 0-7 "
                   "or 0,5,255: only their weights are read from the engine and the file (a 256-expert model audits "
                   "in 1/32 of the time with 0-7); the layers and served stages still run every expert the tokens "
                   "route to")
    p.add_argument("--switches", choices=("auto", "always", "never"), default="auto",
                   help="after a served failure (auto), rerun the served comparison with one engine setting flipped "
                        "at a time (flash_attn=0, an F16 KV cache, n_gpu_layers=0, ...) and name the setting whose "
                        "flip makes the failure go away; 'always' flips them on a healthy run too")
    p.add_argument("--switch-budget", type=float, default=600.0, metavar="SECONDS",
                   help="time the switch stage may spend (each flip reruns the served comparison; default 600)")
    p.add_argument("--max-memory", metavar="SIZE", help="memory ggufcheck may hold, e.g. 6G or 6000M (default: "
                   "80%% of what is available); a stage estimated to need more is refused before the run starts")
    p.add_argument("--reference-device", default="auto", metavar="DEV",
                   help="where the fp64 reference runs: auto (a GPU with room, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--save-run", type=Path, metavar="DIR",
                   help="save every answer the engine gives in DIR (its arrays, as they come), so that "
                        "`ggufcheck rejudge DIR` judges the run again without the engine")
    p.add_argument("--json", type=Path, help="write every stage, check and the verdict to this JSON file "
                   "(\"-\": standard output, the rest on standard error)")
    p.add_argument("--html", type=Path, help="write a self-contained HTML report with plots")
    p.add_argument("-v", "--verbose", action="store_true", help="list every check of every stage")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line while running")


def options_from(args: argparse.Namespace) -> DiagnoseOptions:
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, not {args.timeout}")
    for name in ("tp", "max_prompts", "max_tokens", "top_k"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, not {value}")
    if args.device is not None and args.device < 0:
        raise UsageError(f"--device must be >= 0, not {args.device}")
    for name in ("decode_to", "sweep_to"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, not {getattr(args, name)}")
    if args.switch_budget < 0:
        raise UsageError(f"--switch-budget must be >= 0, not {args.switch_budget}")
    device = reference_device(args.reference_device)
    return DiagnoseOptions(
        layers=parse_layers(args.layers) if args.layers else None,
        experts=parse_indices(args.experts, "--experts", "expert") if args.experts else None,
        max_memory=parse_size(args.max_memory, "--max-memory") if args.max_memory else None,
        reference_device=device,
        model=args.model, engine=args.engine, python=args.python, device=args.device, tp=args.tp,
        prompts=args.prompts, max_prompts=args.max_prompts, max_tokens=args.max_tokens, health=args.health,
        kernels=args.kernels, sanity=args.sanity, shard_numeric=args.shard_numeric, baseline=args.baseline,
        top_k=args.top_k, timeout=args.timeout, decode_to=args.decode_to, sweep_to=args.sweep_to,
        reference=args.reference, switches=args.switches, switch_budget=args.switch_budget,
        save_run=save_run_dir(args.save_run) if args.save_run else None,
    )


def reference_device(device: str) -> str:
    """--reference-device: auto, cpu, cuda or cuda:N (a usage error otherwise)."""
    if not (device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise UsageError(f"--reference-device must be auto, cpu, cuda or cuda:N, not {device!r}")
    return device


def save_run_dir(path: Path) -> Path:
    """--save-run DIR: a new or empty directory, or one holding an earlier saved run (replaced);
    never a folder of other files, which a run would litter."""
    from ggufcheck.engines.recorded import MANIFEST

    if path.exists() and not path.is_dir():
        raise UsageError(f"--save-run {path}: is a file, not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST).is_file():
        raise UsageError(f"--save-run {path}: the directory holds other files (not a saved run)",
                         tip="name a new or empty directory")
    parent = path if path.is_dir() else path.parent
    if parent.is_dir() and not os.access(parent, os.W_OK):
        raise UsageError(f"--save-run {path}: not writable")
    return path


def parse_layers(text: str) -> tuple[int, ...]:
    """``0,1,40`` or ``0-3,40`` -> sorted layer indices."""
    return parse_indices(text, "--layers", "layer")


def parse_indices(text: str, flag: str, what: str) -> tuple[int, ...]:
    """``0,1,40`` or ``0-3,40`` -> sorted indices (``--layers``, ``--experts``)."""
    out: set[int] = set()
    for part in filter(None, text.replace(" ", "").split(",")):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise UsageError(f"{flag} {text!r}: {part!r} is not {'an' if what[0] in 'aeiou' else 'a'} {what} or a "
                             "range", tip="e.g. 0,1,40 or 0-3,40")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise UsageError(f"{flag} {text!r}: the range {part!r} runs backwards")
        out.update(range(lo, hi + 1))
    if not out:
        raise UsageError(f"{flag} is empty")
    return tuple(sorted(out))


def parse_size(text: str, flag: str) -> int:
    """``6G``, ``6GiB``, ``6000M``, ``512MB``, ``7e9`` -> bytes (K/M/G/T are powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = body[-1:] if body[-1:] in units and body[-1:] != "" else ""
    number = body[: len(body) - len(unit)]
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: not a size", tip="e.g. 6G, 6000M or 7e9 (bytes)") from None
    if value <= 0:
        raise UsageError(f"{flag} must be positive, not {text!r}")
    return int(value)


def exit_status(diagnosis: Diagnosis) -> int:
    verdict = diagnosis.verdict
    if verdict.healthy:
        return int(ExitStatus.HEALTHY)
    return int(ExitStatus.UNVERIFIED if verdict.unverified else ExitStatus.FINDINGS)


def write_reports(diagnosis: Diagnosis, json_path: Path | None, html_path: Path | None, console: Console,
                  header: dict[str, str] | None = None) -> None:
    header = header or run_header(diagnosis)
    if json_path:
        doc = report_json("diagnose", diagnosis.stages, run=header, model=str(diagnosis.options.model),
                          engine=diagnosis.engine, verdict=diagnosis.verdict.to_json(),
                          elapsed_s=diagnosis.elapsed_s, timings=diagnosis.timings,
                          resources=diagnosis.resources.to_json() if diagnosis.resources is not None else None)
        write_json(json_path, doc)
        console.print(f"JSON report: {json_path}")
    if html_path:
        write_html(html_path, render_html(f"ggufcheck diagnose {diagnosis.options.model.name}",
                                          diagnosis.stages, diagnosis.verdict,
                                          {**header, "elapsed (s)": f"{diagnosis.elapsed_s:.1f}"}))
        console.print(f"HTML report: {html_path}")


def run(args: argparse.Namespace) -> int:
    options = options_from(args)
    if not options.model.is_file():
        raise UsageError(f"{options.model}: no such file")
    console = Console()

    def show_plan(plan) -> None:
        if plan is not None and not args.quiet:
            from ggufcheck.diagnose.resources import format_plan

            for line in format_plan(plan):
                console.print(line, markup=False, highlight=False, soft_wrap=True)

    if args.quiet:
        diagnosis = diagnose(options, on_plan=show_plan)
    else:
        started = time.perf_counter()
        # on stderr, so a piped report stays clean (rich shows nothing there when it is not a terminal)
        with Console(stderr=True).status("diagnosing") as status:
            diagnosis = diagnose(options, progress=lambda msg: status.update(
                f"{msg} [dim]({time.perf_counter() - started:.0f} s)[/]"), on_plan=show_plan)
    header = run_header(diagnosis, getattr(args, "argv", None))
    render_diagnosis(console, diagnosis, verbose=args.verbose, header=header)
    write_reports(diagnosis, args.json, args.html, console, header)
    return exit_status(diagnosis)
