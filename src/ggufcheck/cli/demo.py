"""``ggufcheck demo``: the whole method on a model it builds itself, offline, in about a minute.

Builds a tiny random GLM-5-style model (``glm-dsa``: MLA + DSA indexer + MoE) in llama.cpp's
exact GGUF layout, then diagnoses two engines serving it at tensor-parallel size 2:

1. a healthy one (the fp32 reference forward pass: an independent precision, run through
   the same Engine interface any deployment uses);
2. the same engine carrying the classic MLA tensor-parallel bug: kv_b rebuilt as
   [all K; all V] with the split patched to match, exact on one GPU and wrong on two.

and prints both verdicts. Exit status 0 when the healthy engine is judged healthy and the
faulty one is blamed on ``mla-kv-b``; 1 otherwise (the doctor itself would be wrong).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.rule import Rule

from ggufcheck.cli import status
from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
from ggufcheck.errors import ExitStatus
from ggufcheck.report.diagnosis import render_diagnosis, render_verdict

FAULT = "kv-b-all-k-then-v"
TP = 2


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="diagnose a healthy and a kv_b-TP-faulty engine on a tiny GLM-5-style model (offline)",
        description=__doc__.splitlines()[0].split(": ", 1)[1],
    )
    p.add_argument("--keep", type=Path, metavar="DIR", help="keep the tiny model and reports in DIR")
    p.add_argument("-v", "--verbose", action="store_true", help="print both full diagnoses")
    p.add_argument("--json", type=Path, help='write both diagnoses to this JSON file ("-": standard output)')


def run(args: argparse.Namespace) -> int:
    from ggufcheck.testing.faults import make_faulty_engine
    from ggufcheck.synthetic.tiny import build_tiny_gguf
    from ggufcheck.engines.reference import ReferenceEngine

    console = Console()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ggufcheck-demo-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        # expert FF 64: its TP-2 row split (32) starts on a Q8_0 block, so the plan is clean
        model = build_tiny_gguf("glm-dsa", workdir / "tiny-glm-dsa.gguf", qtypes="Q8_0", seed=0,
                                n_ff_exp=64).path
        where = str(model) if args.keep else "a temporary file (--keep DIR keeps it)"
        console.print(f"built a tiny GLM-5-style model (MLA + DSA indexer + 8-expert MoE, Q8_0) in {where}")
        console.print(f"the faulty engine stores one attention weight (MLA's kv_b_proj, which holds every head's "
                      f"key and value rows) as \\[all K; all V] instead of head by head, and patches the split to "
                      f"match: exact on one GPU, but split over {TP} GPUs (tensor parallelism) each GPU computes "
                      "attention with the wrong rows, a bug met in a real vLLM deployment. The diagnosis must find "
                      "it without being told.")
        options = DiagnoseOptions(model=model, tp=TP, max_prompts=2, max_tokens=24, new_tokens=4, sanity=False,
                                  decode_to=0, sweep_to=0)
        runs = [
            ("healthy engine: reference fp32", lambda: ReferenceEngine(model, dtype="fp32")),
            (f"faulty engine: {FAULT} at TP {TP}", lambda: make_faulty_engine(FAULT, model, tp=TP)),
        ]
        verdicts, diagnoses = [], []
        for title, make in runs:
            console.print(Rule(title))
            with make() as engine, status(console, args, "diagnosing") as shown:
                diagnosis = diagnose(options, progress=lambda m: shown.update(m), engine=engine)
            diagnoses.append((title, diagnosis))
            if args.verbose:
                render_diagnosis(console, diagnosis, verbose=False)
            else:
                render_verdict(console, diagnosis.verdict, diagnosis.elapsed_s)
            verdicts.append(diagnosis.verdict)
    healthy, faulty = verdicts
    ok = healthy.healthy and faulty.component == "mla-kv-b"
    console.print(Rule("summary"))
    console.print(f"healthy engine -> {'healthy' if healthy.healthy else healthy.component}; "
                  f"faulty engine -> {faulty.component}"
                  + (f" at layer {faulty.layer}" if faulty.layer is not None else "")
                  + f"  ({time.perf_counter() - started:.0f} s)")
    if not ok:
        console.print("[bold red]the diagnosis did not name the expected components[/]")
    console.print("next, on your own model: [bold]ggufcheck diagnose MODEL.gguf --engine llama-cpp[/] "
                  "(or --engine vllm:tp=2 / http://HOST:PORT/v1; see docs/engines.md)")
    if args.json:
        from ggufcheck.report.json import report_json, write_json

        write_json(args.json, report_json("demo", [], ok=ok, runs=[
            {"engine": title, "verdict": d.verdict.to_json(), "stages": [s.to_json() for s in d.stages],
             "elapsed_s": d.elapsed_s} for title, d in diagnoses]))
    return int(ExitStatus.HEALTHY if ok else ExitStatus.FINDINGS)
