"""The GGUF kernel matrix: does each quant type compute correctly on this engine?

"Does quant type X compute correctly on this GPU?" is the first question on a new GPU
architecture, and wrong output from one type's kernel on one architecture is a recurring
report. For every quant type, a tiny llama model whose layer weights (and output head) all
use that type is served by the engine under test and compared with the fp64 reference over
the same dequantized weights, through the served stage (``checks.compare``):

- prefill: prompts of up to ``max_tokens`` tokens scored in one batch (on llama.cpp's CUDA
  backend, batches over 8 tokens take the matrix-matrix kernels, mmq / cuBLAS);
- decode: greedy steps of one token (the matrix-vector kernels, mmvq / mmvf), judged
  against the reference and against the engine's own prefill;
- chunked prefill (pieces of 5 tokens: matrix-vector kernels on a batch).

The allowance is the one the served stage applies to any engine: its stated numerical class
and a measured baseline run of the reference emulating where it rounds (for a quantized
type on llama.cpp, activations in 8-bit blocks). Only the weight type changes from row to
row, so a row that fails where the others pass points at that type's kernels.

Each row also says how its error compares with that emulation alone (``x emulated``): a
correct kernel that rounds where the engine says it does lands near 1x. The class allowance
(KL 0.005 for 8-bit activations) is far wider than the emulation on these tiny models, so a
type whose kernels round several times more than the stated rounding explains passes the
verdict and is named in a note instead. Measured (docs/real-world-cases.md case 4): llama.cpp's
CUDA Q4_1 / Q5_1 at ~5x while the engine stated the CPU's rounding, 1.0-1.3x once it stated
CUDA's q8_1 block sums; Q4_0 / Q5_0 in decode and Q2_K in prefill still named on the H100;
every CPU row near 1x. Model sizes are
multiples of 256, so every type (K-quants and IQ types have 256-value blocks) fits each
matrix without falling back.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ggufcheck.results import Result, StageReport, Status

Progress = Callable[[str], None]

# every ggml type llama.cpp's CUDA backend multiplies (mmq / mmvq / cuBLAS), in ggml order
CUDA_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
              "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ4_NL",
              "IQ4_XS")
# every type the tiny builder writes (floats, gguf-py's quantizers, random valid blocks)
BUILDABLE_TYPES = CUDA_TYPES + ("TQ1_0", "TQ2_0")
# a quick subset: one of each kernel family (float, legacy 32-blocks, K-quants, IQ grids)
QUICK_TYPES = ("F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS")
# the tiny model: every matrix's row length a multiple of 256 (n_embd, n_head*head_dim, n_ff)
MATRIX_DIMS = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)
# the checks that speak for a type's kernels, with the path each one exercises
PATH_OF_CHECK = {
    "logits.kl_mean": "prefill",
    "logits.kl_p99": "prefill",
    "logits.argmax": "prefill",
    "logits.nmse": "prefill",
    "logits.decode_kl_mean": "decode",
    "paths.prefill_vs_decode": "prefill vs decode",
    "paths.chunked_prefill[5]": "chunked prefill",
    "paths.determinism": "determinism",
}


@dataclass(frozen=True)
class MatrixOptions:
    engine: str  # an --engine SPEC (ggufcheck.engines.spec)
    types: Sequence[str] = CUDA_TYPES
    seed: int = 0
    max_prompts: int = 4
    max_tokens: int = 96  # prefill batches of up to this many tokens
    new_tokens: int = 8
    sweep_to: int = 0  # the prefill length sweep (0: none; the rows are about kernels)
    workdir: Path | None = None  # where the tiny models are written (default: a temporary folder)


@dataclass
class MatrixRow:
    """One quant type's verdict: the metrics of each path and the checks that failed."""

    qtype: str
    status: Status
    prefill_kl: float | None = None
    prefill_limit: float | None = None
    argmax: float | None = None
    decode_kl: float | None = None
    prefill_vs_decode_kl: float | None = None
    emulation_kl: float | None = None  # the reference emulating the engine's class vs fp64
    failed_paths: list[str] = field(default_factory=list)
    message: str = ""
    stages: list[StageReport] = field(default_factory=list)

    def times_emulated(self, path: str = "prefill") -> float | None:
        """The path's KL over the emulation's (1: rounds exactly as much as its class says)."""
        kl = self.prefill_kl if path == "prefill" else self.decode_kl
        if kl is None or not self.emulation_kl:
            return None
        return kl / self.emulation_kl

    def emulation_limit(self) -> float | None:
        """The limit the emulation alone would give (``multiple * emulation + floor``, the served
        stage's formula without the class allowance's widening)."""
        from ggufcheck.checks.logits import LogitTolerance

        tol = LogitTolerance()
        return None if self.emulation_kl is None else tol.multiple * self.emulation_kl + tol.kl_floor

    def rounding_excess(self) -> dict[str, float]:
        """The paths whose KL exceeds :meth:`emulation_limit`, with their ratio to the emulation."""
        own = self.emulation_limit()
        if own is None:
            return {}
        return {path: ratio for path, kl in (("prefill", self.prefill_kl), ("decode", self.decode_kl))
                if kl is not None and kl > own and (ratio := self.times_emulated(path)) is not None}

    def rounding_note(self) -> str:
        """The note naming a type whose paths round more than the stated rounding explains ("" if none)."""
        excess = self.rounding_excess()
        if not excess:
            return ""
        from ggufcheck.checks.logits import LogitTolerance

        tol = LogitTolerance()
        paths = ", ".join(f"{path} {ratio:.1f}x" for path, ratio in excess.items())
        allowance = f", within the class allowance {self.prefill_limit:.3g}" if self.prefill_limit is not None else ""
        return (f"rounds more than its class explains: {paths} the KL of the reference emulating that "
                f"rounding ({self.emulation_kl:.2g}; {tol.multiple:g}x + {tol.kl_floor:g} = "
                f"{self.emulation_limit():.2g}){allowance}")

    def result(self) -> Result:
        stats = {k: v for k, v in (("prefill_kl", self.prefill_kl), ("prefill_limit", self.prefill_limit),
                                   ("argmax", self.argmax), ("decode_kl", self.decode_kl),
                                   ("prefill_vs_decode_kl", self.prefill_vs_decode_kl),
                                   ("emulation_kl", self.emulation_kl)) if v is not None}
        if self.failed_paths:
            stats["failed_paths"] = list(self.failed_paths)
        excess = self.rounding_excess()
        if excess:
            stats["rounding_excess"] = excess
        return Result(f"quant_matrix[{self.qtype}]", self.status, "dequant", self.message, stats=stats)


def build_model(qtype: str, folder: Path, seed: int = 0) -> Path:
    """The tiny llama model of one row: every 2-D layer weight and the head in ``qtype``."""
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    path = folder / f"matrix-{qtype.lower()}.gguf"
    built = build_tiny_gguf("llama", path, qtypes=qtype, seed=seed, **MATRIX_DIMS)
    if built.fallbacks:  # the dims are chosen so that none falls back; say so if one did
        raise AssertionError(f"{qtype}: tensors fell back to another type: {', '.join(built.fallbacks)}")
    return path


def _kl_mean(result: Result | None) -> float | None:
    kl = (result.stats or {}).get("kl") if result is not None else None
    return float(kl["mean"]) if isinstance(kl, dict) and "mean" in kl else None


def summarize(qtype: str, stages: list[StageReport]) -> MatrixRow:
    """A row from the served stage's reports for one type's model."""
    by_check = {r.check: r for stage in stages for r in stage.results}
    failed = [r for r in by_check.values() if r.failed and r.check.startswith(("logits.", "paths."))]
    paths = sorted({PATH_OF_CHECK.get(r.check, r.check) for r in failed if r.check != "logits.path_blame"})
    kl = by_check.get("logits.kl_mean")
    argmax = by_check.get("logits.argmax")
    measured = next((s.info.get("measured_baseline") for s in stages if s.info.get("measured_baseline")), None)
    row = MatrixRow(
        qtype=qtype, status=Status.FAIL if failed else Status.PASS, stages=stages,
        prefill_kl=_kl_mean(kl), prefill_limit=(kl.stats or {}).get("limit") if kl else None,
        argmax=(argmax.stats or {}).get("agreement") if argmax else None,
        decode_kl=_kl_mean(by_check.get("logits.decode_kl_mean")),
        prefill_vs_decode_kl=_kl_mean(by_check.get("paths.prefill_vs_decode")),
        emulation_kl=float(measured["kl_mean"]) if measured else None,
        failed_paths=paths,
    )
    blame = by_check.get("logits.path_blame")
    if failed:
        row.message = (blame.message if blame is not None and blame.failed else
                       "; ".join(f"{r.check}: {r.message}" for r in failed[:2]))
    else:
        row.message = "prefill, decode and chunked prefill agree with the reference"
        note = row.rounding_note()
        if note:
            row.message += "; " + note
    return row


def run_row(qtype: str, options: MatrixOptions, folder: Path, say: Progress) -> MatrixRow:
    """Build one type's model and run the served stage on it; an engine that cannot load or
    run the type gives a SKIP row with its reason (an unsupported type is not a wrong one)."""
    from ggufcheck.checks.compare import run as run_served
    from ggufcheck.diagnose.session import DiagnoseOptions, Session
    from ggufcheck.engines.base import Unsupported
    from ggufcheck.errors import EngineUnreachable, GGUFCheckError, Unavailable

    path = build_model(qtype, folder, options.seed)
    session = Session(DiagnoseOptions(
        model=path, engine=options.engine, max_prompts=options.max_prompts, max_tokens=options.max_tokens,
        new_tokens=options.new_tokens, decode_to=0, sweep_to=options.sweep_to, sanity=False), say)
    try:
        stages = run_served(session)
    except Unsupported as err:  # the engine declines the type: not a wrong kernel
        return MatrixRow(qtype, Status.SKIP, message=f"the engine cannot run {qtype}: {err}")
    except Unavailable:
        raise  # the engine itself is missing: no row can run
    except EngineUnreachable as err:  # it crashed or stopped answering on this type: a finding
        return MatrixRow(qtype, Status.ERROR, failed_paths=["engine"],
                         message=f"the engine failed on {qtype}: {err}")
    except GGUFCheckError as err:  # it refused the file (llama.cpp: unknown type, bad shape)
        return MatrixRow(qtype, Status.SKIP, message=f"the engine cannot run {qtype}: {err}")
    finally:
        session.close()
    return summarize(qtype, stages)


def run_matrix(options: MatrixOptions, say: Progress = lambda _m: None,
               on_row: Callable[[MatrixRow], None] = lambda _r: None) -> list[MatrixRow]:
    """One row per quant type, in ``options.types`` order."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="ggufcheck-matrix-") as tmp:
        folder = Path(options.workdir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for qtype in options.types:
            say(f"{qtype}: building the tiny model and comparing {options.engine} with the reference")
            row = run_row(qtype, options, folder, say)
            rows.append(row)
            on_row(row)
    return rows
