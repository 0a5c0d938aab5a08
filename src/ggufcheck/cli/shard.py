"""``ggufcheck shard MODEL.gguf --tp N``: will this file shard N ways, and does it compute the same?

Thin: arguments -> :class:`ShardOptions` -> :func:`run_sharding_stage` -> text / JSON -> exit
status. ``--known glm-5|glm-5.2|deepseek-v3`` plans the real model's dimensions without a
file (with a stated quant mix); numeric checks need the file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

from ggufcheck.errors import ExitStatus, UsageError
from ggufcheck.report.json import report_json, write_json
from ggufcheck.report.text import render_stage, render_totals
from ggufcheck.sharding import BACKENDS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "shard",
        help="tensor-parallel checks: shard plan, MLA kv_b per rank, sharded == unsharded per layer",
        description="Check that MODEL shards over --tp ranks the way vLLM shards it: divisibility, "
        "quant-block alignment of row-parallel splits, vocab padding, per-rank memory, MLA W_UK/W_UV "
        "per rank, and every layer kind run sharded over N processes (gloo on CPU, NCCL on GPUs) "
        "against the unsharded reference, in fp64. Plus an all-reduce / all-gather self-test.",
    )
    p.add_argument("model", nargs="?", type=Path, help="path to a .gguf file (any part of a split model)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size (number of ranks)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="GPU memory per rank, GiB (plan check)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="torch.distributed backend for the sharded run (auto: NCCL when N GPUs are visible)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds before a hung run is stopped")
    p.add_argument("--plan-only", action="store_true", help="skip the numeric sharded run")
    p.add_argument("--known", choices=("glm-5", "glm-5.2", "deepseek-v3"),
                   help="plan a known model's real dimensions without its file")
    p.add_argument("--mix", default="q4_k_m", help="quant mix assumed with --known: q4_k_m, q8_0, bf16")
    p.add_argument("--json", type=Path, help="write every result to this JSON file "
                   "(\"-\": standard output, the rest on standard error)")
    p.add_argument("-v", "--verbose", action="store_true", help="list passing checks too")


def run(args: argparse.Namespace) -> int:
    from ggufcheck.checks.sharding import ShardOptions, plan_known, run_sharding_stage
    from ggufcheck.gguf.reader import open_gguf

    if args.tp < 1:
        raise UsageError(f"--tp must be a positive integer, not {args.tp}")
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        raise UsageError(f"--gpu-memory must be positive GiB, not {args.gpu_memory}")
    if (args.model is None) == (args.known is None):
        raise UsageError("give either MODEL.gguf or --known NAME", tip="ggufcheck shard model.gguf --tp 8")
    opts = ShardOptions(tp=args.tp, gpu_memory_gib=args.gpu_memory, backend=args.backend,
                        timeout_s=args.timeout, numeric=not args.plan_only)
    console = Console()
    started = time.perf_counter()
    if args.known:
        stage = plan_known(args.known, args.tp, args.mix, args.gpu_memory)
        source = f"known:{args.known}"
    else:
        with open_gguf(args.model) as model:
            stage = run_sharding_stage(model, opts)
        source = str(args.model)
    stage.info["elapsed_s"] = time.perf_counter() - started
    render_stage(console, stage, verbose=args.verbose)
    render_totals(console, [stage])
    if args.json:
        write_json(args.json, report_json("shard", [stage], model=source, tp=args.tp))
        console.print(f"JSON report: {args.json}")
    return int(ExitStatus.FINDINGS if stage.failures else ExitStatus.HEALTHY)
