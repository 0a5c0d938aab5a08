"""``ggufcheck quants --engine SPEC``: the kernel matrix, one row per GGUF quant type.

Answers "does every quant type compute correctly on this engine and GPU?" with tiny models
built on the spot (no model file needed): see ``checks.quant_matrix``. Exit 0 when every
type that ran agrees with the reference, 1 when one does not, 3 when the engine is missing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ggufcheck.errors import ExitStatus, UsageError
from ggufcheck.report.json import report_json, write_json
from ggufcheck.report.text import render_stage, status_text
from ggufcheck.results import StageReport, Status


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ggufcheck.checks.quant_matrix import CUDA_TYPES, QUICK_TYPES

    p = sub.add_parser(
        "quants",
        help="the kernel matrix: every GGUF quant type on an engine vs the reference",
        description="For every GGUF quant type, a tiny model whose weights all use that type is served "
                    "by the engine and compared with the fp64 reference: prefill (matrix-matrix "
                    "kernels), one-token decode (matrix-vector kernels) and chunked prefill. E.g. "
                    "--engine llama-cpp:n_gpu_layers=99 with LLAMA_CPP_LIB_PATH naming a CUDA build.",
    )
    p.add_argument("--engine", required=True, metavar="SPEC",
                   help="an engine that opens a GGUF file: llama-cpp[:n_gpu_layers=99,flash_attn=1], hf..., "
                        "vllm..., reference:fp32, python:MODULE:FACTORY")
    p.add_argument("--types", default="all",
                   help=f"comma-separated ggml types, 'quick' ({','.join(QUICK_TYPES)}) or 'all' "
                        f"(default: {len(CUDA_TYPES)} types)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny models' random weights")
    p.add_argument("--max-tokens", type=int, default=96, help="longest prefill batch (default 96)")
    p.add_argument("--width", type=int, default=256, metavar="N",
                   help="n_embd of the tiny models, a multiple of 256 (default 256; errors grow with width: "
                        "run a second width, e.g. 1024)")
    p.add_argument("--arch", default="llama", choices=("llama", "qwen3moe"),
                   help="llama (dense matmuls, default) or qwen3moe (the type in routed experts: llama.cpp's "
                        "MUL_MAT_ID kernels)")
    p.add_argument("--keep", type=Path, help="write the tiny models to this folder and keep them")
    p.add_argument("--json", type=Path, help="write every row and check to this JSON file "
                   "(\"-\": standard output, the rest on standard error)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each type's checks too")


def _types(text: str) -> tuple[str, ...]:
    from ggufcheck.checks.quant_matrix import BUILDABLE_TYPES, CUDA_TYPES, QUICK_TYPES

    if text == "all":
        return CUDA_TYPES
    if text == "quick":
        return QUICK_TYPES
    known = set(BUILDABLE_TYPES)
    names = tuple(t.strip().upper() for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"--types: unknown quant type(s) {', '.join(unknown) or '(none given)'}",
                         tip=f"known: {', '.join(sorted(known))}")
    return names


def _fmt(value: float | None, spec: str = ".2g") -> str:
    return "-" if value is None else format(value, spec)


def _times(ratio: float | None, over: bool) -> str:
    if ratio is None:
        return ""
    text = f" ({ratio:.1f}x)"
    return f"[yellow]{text}[/yellow]" if over else text


def run(args: argparse.Namespace) -> int:
    from ggufcheck.checks.quant_matrix import MatrixOptions, run_matrix

    if args.max_tokens < 16:
        raise UsageError(f"--max-tokens must be at least 16 (a batch past the matrix-vector kernels), "
                         f"not {args.max_tokens}")
    if args.width < 256 or args.width % 256:
        raise UsageError(f"--width must be a positive multiple of 256 (every type's blocks fit), not {args.width}")
    options = MatrixOptions(engine=args.engine, types=_types(args.types), seed=args.seed,
                            max_tokens=args.max_tokens, workdir=args.keep, width=args.width, arch=args.arch)
    console = Console()
    started = time.perf_counter()

    def show(row) -> None:
        console.print(f"{status_text(row.status)} {row.qtype:8s} prefill KL {_fmt(row.prefill_kl)} "
                      f"(limit {_fmt(row.prefill_limit)}), decode KL {_fmt(row.decode_kl)}"
                      + (f"  failed: {', '.join(row.failed_paths)}" if row.failed_paths else "")
                      + ("" if row.status not in (Status.SKIP, Status.ERROR) else f"  {row.message}"))
        if args.verbose:
            for stage in row.stages:
                render_stage(console, stage)

    rows = run_matrix(options, say=lambda m: console.print(f"[dim]{m}[/dim]"), on_row=show)
    shape = "" if (args.width, args.arch) == (256, "llama") else f" ({args.arch}, width {args.width})"
    table = Table(title=f"kernel matrix: {args.engine} vs the fp64 reference{shape}", title_justify="left")
    for column in ("type", "status", "prefill KL (x emulated)", "limit", "argmax", "decode KL (x emulated)",
                   "prefill vs decode KL", "failed path"):  # the type column never shrinks: it is what the row is about
        table.add_column(column, no_wrap=column in ("type", "status"), min_width=7 if column == "type" else None)
    for row in rows:
        excess = row.rounding_excess()
        table.add_row(row.qtype, status_text(row.status),
                      _fmt(row.prefill_kl) + _times(row.times_emulated("prefill"), "prefill" in excess),
                      _fmt(row.prefill_limit), _fmt(row.argmax, ".3f"),
                      _fmt(row.decode_kl) + _times(row.times_emulated("decode"), "decode" in excess),
                      _fmt(row.prefill_vs_decode_kl),
                      ", ".join(row.failed_paths) if row.status != Status.ERROR else row.message[:80])
    console.print(table)
    off = [row for row in rows if row.rounding_excess()]
    if off:
        console.print("[red]off their stated arithmetic[/red] (a kernel that computes these types less precisely "
                      "than the engine says it rounds):")
        for row in off:
            console.print(f"  {row.rounding_finding()}")
    if any(row.emulation_kl for row in rows):
        console.print("[dim]x emulated: the path's median KL per row over that of the reference computing the "
                      "path's stated arithmetic on the same rows (llama.cpp: 8-bit activation blocks, on CUDA each "
                      "kernel's q8_1 sums, f16 KV cache); a correct kernel lands near 1x, one over 3x + 0.0001 "
                      "fails[/dim]")
    elapsed = time.perf_counter() - started
    counts = {s: sum(r.status == s for r in rows) for s in Status}
    console.print(f"PASS {counts[Status.PASS]}  FAIL {counts[Status.FAIL]}  ERROR {counts[Status.ERROR]}  "
                  f"SKIP {counts[Status.SKIP]}  ({elapsed:.0f} s)")
    if args.json:
        stage = StageReport("quant_matrix", [row.result() for row in rows],
                            info={"engine": args.engine, "seed": args.seed})
        per_type = {row.qtype: [s.to_json() for s in row.stages] for row in rows}
        write_json(args.json, report_json("quants", [stage], engine=args.engine, elapsed_s=elapsed,
                                          checks_per_type=per_type))
    return int(ExitStatus.FINDINGS if counts[Status.FAIL] or counts[Status.ERROR] else ExitStatus.HEALTHY)
