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

from ggufcheck.checks.compare import CompareOptions, run_compare
from ggufcheck.engines.spec import SPEC_HELP, open_engine
from ggufcheck.errors import ExitStatus, GGUFCheckError, UsageError
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
    p.add_argument("--json", type=Path, help="write every result to this JSON file")
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
                             args.paths, args.sanity, args.verbose, args.decode_to, args.sweep_to)


def _emulation(spec: str, engine, model: Path) -> dict:
    """A reference baseline rounds as the engine's precision class does (reference.precision)."""
    if spec.split(":")[0] != "reference":
        return {}
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.reference.precision import emulation_of, matmul_weight_types

    with open_gguf(model) as gguf:
        emulation = emulation_of(engine.capabilities, matmul_weight_types(gguf.tensors))
    return {"emulate": emulation} if emulation is not None else {}


def _prompt_texts(options: CompareCliOptions) -> list[str]:
    from ggufcheck.checks.prompts import builtin_prompts, load_prompts

    prompts = load_prompts(options.prompts) if options.prompts else builtin_prompts()
    texts = [p.text for p in prompts]
    return texts[: options.max_prompts] if options.max_prompts else texts


def _indexer_top_k(model_path: Path) -> int | None:
    from ggufcheck.arch.spec import spec_for_model
    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(model_path) as model:
        spec, _ = spec_for_model(model)
    indexer = getattr(spec, "indexer", None)
    return getattr(indexer, "top_k", None)


def _tokenize(engine, model_path: Path, texts: list[str], limit: int) -> tuple[list[list[int]], str]:
    if engine.capabilities.tokenize:
        return [engine.tokenize(t)[:limit] for t in texts], f"{engine.name}'s tokenizer"
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.tokenizer import load_tokenizer

    with open_gguf(model_path) as model:
        tok = load_tokenizer(model)
    return [tok.encode(t, add_special=True, parse_special=True)[:limit] for t in texts], "the GGUF's own tokenizer"


def _long_prompt(sequences: list[list[int]], top_k: int | None) -> list[int] | None:
    """DSA models: a prompt longer than the indexer's top_k (the prompts joined and repeated)."""
    if top_k is None or not sequences:
        return None
    for s in sequences:
        if len(s) > top_k + 8:
            return s
    joined: list[int] = []
    while len(joined) <= top_k + 32:
        for s in sequences:
            joined.extend(s)
    return joined[: top_k + 32]


def run(args: argparse.Namespace) -> int:
    options = _options(args)
    console = Console(stderr=False)
    say = (lambda msg: console.print(f"[dim]{msg}[/dim]"))
    started = time.perf_counter()
    engines = []
    try:
        kwargs = {}
        if options.engine.startswith(("http://", "https://")):
            from ggufcheck.engines.http import HttpOptions

            kwargs["http_options"] = HttpOptions(timeout_s=options.timeout, top_k=options.top_k)
        say(f"opening engine {options.engine}")
        engine = open_engine(options.engine, options.model, **kwargs)
        engines.append(engine)
        reference, reason = None, "--reference none: no reference run"
        if options.reference != "none":
            try:
                reference = open_engine(options.reference, options.model)
                engines.append(reference)
            except GGUFCheckError as err:
                reason = f"the reference is unavailable: {err.message}"
        baseline = None
        if reference is not None and options.baseline != "none":
            spec = "reference:fp32" if options.baseline == "auto" else options.baseline
            if not (options.baseline == "auto" and reference.capabilities.activation_dtype == "fp32"):
                try:
                    baseline = open_engine(spec, options.model, **_emulation(spec, engine, options.model))
                    engines.append(baseline)
                except GGUFCheckError as err:
                    say(f"baseline {spec} unavailable ({err.message}); using stated allowances")
        texts = _prompt_texts(options)
        sequences, tokenizer_used = _tokenize(engine, options.model, texts, options.max_tokens)
        top_k = _indexer_top_k(options.model)
        long_prompt = _long_prompt(sequences, top_k)
        stages = run_compare(
            engine, sequences, reference=reference, reference_reason=reason, baseline_engine=baseline,
            options=CompareOptions(top_k=options.top_k, max_new_tokens=options.new_tokens, run_paths=options.paths,
                                   long_decode_to=options.decode_to, sweep_to=options.sweep_to,
                                   run_sanity=options.sanity, indexer_top_k=top_k),
            progress=say, long_prompt=long_prompt,
        )
    finally:
        for e in engines:
            e.close()
    for stage in stages:
        render_stage(console, stage, verbose=options.verbose)
    render_totals(console, stages)
    elapsed = time.perf_counter() - started
    if options.json:
        write_json(options.json, report_json("compare", stages, model=str(options.model), engine=options.engine,
                                             tokenizer=tokenizer_used, prompts=len(sequences), elapsed_s=elapsed))
    failed = any(s.failures for s in stages)
    return int(ExitStatus.FINDINGS if failed else ExitStatus.HEALTHY)
