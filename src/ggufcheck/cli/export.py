"""``ggufcheck export MODEL.gguf OUT/``: the GGUF as an HF checkpoint an engine can serve.

For engines that cannot load a GGUF of this architecture (vLLM's GGUF plug-in refuses
deepseek2 and glm4moe): the same weights, from the rebuild ggufcheck verifies, with a
config.json and tokenizer (``ggufcheck.arch.export``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

from ggufcheck.cli import status
from ggufcheck.errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write the GGUF as an HF checkpoint (config.json, safetensors, tokenizer) an engine can serve",
        description="Write MODEL.gguf as an HF checkpoint in OUT/: float32 safetensors from ggufcheck's verified "
                    "rebuild, config.json from the architecture spec (with what vLLM's loaders expect, e.g. "
                    "topk_method for a router with a selection bias) and a tokenizer.json from the file's vocabulary.",
    )
    p.add_argument("model", type=Path, help="the GGUF file")
    p.add_argument("out", type=Path, help="output folder (created; existing files are overwritten)")
    p.add_argument("--shard-gb", type=float, default=2.0, help="largest safetensors file, GB (default 2)")
    p.add_argument("--json", type=Path, help='write what was exported to this JSON file ("-": standard output)')


def run(args: argparse.Namespace) -> int:
    from ggufcheck.arch.export import export_checkpoint

    if not args.model.is_file():
        raise UsageError(f"{args.model}: no such file")
    if args.shard_gb <= 0:
        raise UsageError(f"--shard-gb must be positive, not {args.shard_gb}")
    console = Console()
    t0 = time.perf_counter()
    with status(console, args, f"exporting {args.model.name}"):
        summary = export_checkpoint(args.model, args.out, shard_bytes=int(args.shard_gb * (1 << 30)))
    elapsed = time.perf_counter() - t0
    console.print(f"{summary['arch']} -> {summary['model_type']}: {summary['tensors']} tensors in "
                  f"{summary['files']} safetensors file(s), config.json, tokenizer.json -> {summary['out']} "
                  f"({elapsed:.1f} s)")
    if args.json:
        from ggufcheck.report.json import report_json, write_json

        write_json(args.json, report_json("export", [], model=str(args.model), export=summary, elapsed_s=elapsed))
    return 0
