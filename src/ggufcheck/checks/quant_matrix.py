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

Each path is also judged against the arithmetic the engine states (``x emulated``): the
reference rounding exactly where the engine says its kernels do (reference.precision: 8-bit
activation blocks, and on llama.cpp's CUDA backend each kernel's q8_1 sums: the matrix-matrix
kernels' form for the prefill, the matrix-vector kernels' for the decode). A correct kernel
lands near 1x; a path over ``multiple x`` its emulation ``+ floor`` (the served stage's formula,
without the class allowance) FAILS, naming the type and the kernels ("Q5_K decode (matrix-vector
kernels): 140x its stated arithmetic"). The class allowance (KL 0.015 for 8-bit activations) is
far wider than the emulation on these tiny models: a kernel two orders of magnitude off its own
arithmetic passed it. Measured on the H100 (docs/real-world-cases.md case 4,
benchmarks/results/quants_h100_emulated.txt): CUDA Q4_1 / Q5_1 at ~5x while the engine stated
the CPU's rounding, Q4_0 / Q5_0 decode at ~4-5x and Q2_K prefill at ~20x before their kernels'
forms were emulated. Model sizes are multiples of 256, so every type (K-quants and IQ types
have 256-value blocks) fits each matrix without falling back; ``width`` scales them (errors
grow with width) and ``arch`` ``qwen3moe`` puts the type in routed experts (``mul_mat_id``).
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
# the architectures a row can be built as: a dense llama, or a MoE whose routed experts take the
# type (llama.cpp: the MUL_MAT_ID kernels)
MATRIX_ARCHS = ("llama", "qwen3moe")
# the kernels each path exercises (llama.cpp's CUDA backend: mmq / cuBLAS, mmvq / mmvf)
KERNELS_OF_PATH = {"prefill": "matrix-matrix kernels", "decode": "matrix-vector kernels"}


def matrix_dims(width: int = 256, arch: str = "llama") -> dict:
    """The tiny model's dims at ``width`` (n_embd; a multiple of 256): heads of 64, n_ff twice
    the width; a MoE gets 4 routed experts of width ``width`` (2 used)."""
    if width % 256:
        raise ValueError(f"width {width} is not a multiple of 256")
    dims = dict(MATRIX_DIMS, n_embd=width, n_head=width // 64, n_head_kv=max(1, width // 128), n_ff=2 * width)
    if arch == "qwen3moe":
        dims.update(n_expert=4, n_expert_used=2, n_ff_exp=width)
    return dims
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
    width: int = 256  # n_embd of the tiny models (matrix_dims)
    arch: str = "llama"  # MATRIX_ARCHS


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
    emulation_kl: float | None = None  # the reference emulating the engine's class vs fp64 (mean, served stage)
    # per path, on the same rows (those no routing / indexer near-tie of the reference reaches):
    # (the engine's mean KL, the mean KL of the reference computing the path's stated arithmetic)
    arithmetic: dict[str, tuple[float, float]] = field(default_factory=dict)
    failed_paths: list[str] = field(default_factory=list)
    message: str = ""
    stages: list[StageReport] = field(default_factory=list)

    def path_emulation(self, path: str) -> float | None:
        """The KL of the reference computing ``path``'s stated arithmetic against fp64."""
        return self.arithmetic[path][1] if path in self.arithmetic else None

    def times_emulated(self, path: str = "prefill") -> float | None:
        """The path's KL over its emulation's on the same rows (1: rounds exactly as much as the
        engine says)."""
        kl = self.arithmetic[path][0] if path in self.arithmetic else None
        emulated = self.path_emulation(path)
        if kl is None or not emulated:
            return None
        return kl / emulated

    def emulation_limit(self, path: str = "prefill") -> float | None:
        """The limit the path's emulation alone gives (``multiple * emulation + floor``, the
        served stage's formula without the class allowance's widening)."""
        from ggufcheck.checks.logits import LogitTolerance

        tol = LogitTolerance()
        emulated = self.path_emulation(path)
        return None if emulated is None else tol.multiple * emulated + tol.kl_floor

    def rounding_excess(self) -> dict[str, float]:
        """The paths whose KL exceeds their :meth:`emulation_limit`, with the ratio to their emulation."""
        from ggufcheck.checks.arithmetic import excess

        return {path: ratio for path, pair in self.arithmetic.items() if (ratio := excess(pair)) is not None}

    def rounding_finding(self) -> str:
        """The finding naming the paths that compute off their stated arithmetic ("" if none)."""
        from ggufcheck.checks.logits import LogitTolerance

        tol = LogitTolerance()
        found = []
        for path, ratio in self.rounding_excess().items():
            found.append(f"{self.qtype} {path} ({KERNELS_OF_PATH[path]}): {ratio:.1f}x the KL of its stated "
                         f"arithmetic (the reference computing it: {self.path_emulation(path):.2g}; limit "
                         f"{tol.multiple:g}x + {tol.kl_floor:g} = {self.emulation_limit(path):.2g})")
        if not found:
            return ""
        over = [path for path in self.rounding_excess() if self.prefill_limit is not None
                and self.arithmetic[path][0] > self.prefill_limit]
        allowance = ("" if self.prefill_limit is None else
                     f"; over the class allowance {self.prefill_limit:.3g} too ({', '.join(over)})" if over else
                     f"; within the class allowance {self.prefill_limit:.3g}, which a kernel this far off its "
                     "own arithmetic passes")
        return "; ".join(found) + allowance

    def result(self) -> Result:
        stats = {k: v for k, v in (("prefill_kl", self.prefill_kl), ("prefill_limit", self.prefill_limit),
                                   ("argmax", self.argmax), ("decode_kl", self.decode_kl),
                                   ("prefill_vs_decode_kl", self.prefill_vs_decode_kl),
                                   ("emulation_kl", self.emulation_kl)) if v is not None}
        if self.arithmetic:  # per path: [the engine's KL, the stated arithmetic's KL] on the same rows
            stats["arithmetic"] = {path: list(pair) for path, pair in self.arithmetic.items()}
        if self.failed_paths:
            stats["failed_paths"] = list(self.failed_paths)
        excess = self.rounding_excess()
        if excess:
            stats["rounding_excess"] = excess
        return Result(f"quant_matrix[{self.qtype}]", self.status, "dequant", self.message, stats=stats)


def build_model(qtype: str, folder: Path, seed: int = 0, width: int = 256, arch: str = "llama") -> Path:
    """The tiny model of one row: every 2-D layer weight (a MoE's routed experts included) and
    the head in ``qtype``."""
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    suffix = "" if (width, arch) == (256, "llama") else f"-{arch}-{width}"
    path = folder / f"matrix-{qtype.lower()}{suffix}.gguf"
    # a MoE's router stays F32: what it selects is not the type's kernels, and a quantized router's
    # near-ties would leave most rows unjudged
    qtypes = {"default": qtype, "ffn_gate_inp": "F32"} if arch != "llama" else qtype
    built = build_tiny_gguf(arch, path, qtypes=qtypes, seed=seed, **matrix_dims(width, arch))
    if built.fallbacks:  # the dims are chosen so that none falls back; say so if one did
        raise AssertionError(f"{qtype}: tensors fell back to another type: {', '.join(built.fallbacks)}")
    return path


def _kl_mean(result: Result | None) -> float | None:
    kl = (result.stats or {}).get("kl") if result is not None else None
    return float(kl["mean"]) if isinstance(kl, dict) and "mean" in kl else None


def summarize(qtype: str, stages: list[StageReport],
              arithmetic: dict[str, tuple[float, float]] | None = None) -> MatrixRow:
    """A row from the served stage's reports for one type's model, and each path's KL against
    that of its stated arithmetic (:func:`path_arithmetic`)."""
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
        arithmetic=dict(arithmetic or {}),
        failed_paths=paths,
    )
    blame = by_check.get("logits.path_blame")
    finding = row.rounding_finding()
    if failed:
        row.message = (blame.message if blame is not None and blame.failed else
                       "; ".join(f"{r.check}: {r.message}" for r in failed[:2]))
        if finding:
            row.message += "; " + finding
    elif finding:
        row.message = finding
    else:
        row.message = "prefill, decode and chunked prefill agree with the reference and with their stated arithmetic"
    if finding:
        row.status = Status.FAIL
        row.failed_paths = sorted({*row.failed_paths, *(f"{path} arithmetic" for path in row.rounding_excess())})
    return row


def path_arithmetic(session, stages: list[StageReport]) -> dict[str, tuple[float, float]]:
    """Per path, on the same rows: the engine's mean KL against fp64 and that of the reference
    computing the path's stated arithmetic. Prefill: the prompts in one forward each; decode:
    the engine's own generations (kept by the paths stage) as it decodes them, and the emulation
    fed them the same way (an engine that states a decode form of its own,
    Emulation.decode_block_sums, is emulated in it: the prompt in one forward, then one token per
    forward, as the engine decoded). Rows from a routing / indexer near-tie of
    the reference onward are left out on both sides (a MoE's flip is not a kernel's arithmetic).
    Empty without an emulation (the engine states none) or a reference."""
    from ggufcheck.checks.arithmetic import means, row_kls

    if (not session.emulation() or session.options.baseline.split(":")[0] != "reference"
            or session.reference() is None):
        return {}
    reference, engine = session.reference(), session.engine()
    emulated = session.baseline_for(engine)  # the reference rounding as the engine states
    out: dict[str, tuple[float, float]] = {}
    try:
        rows = [row_kls(reference.score(p), engine.score(p), emulated.score(p), 0) for p in session.tokens()]
        out["prefill"] = means(rows)
        if unemulated_decode(session):  # a rounding the reference does not compute: not compared
            return {path: pair for path, pair in out.items() if pair is not None}
        generations = next((s.info.get("generations") for s in stages if s.info.get("generations")), None) or []
        rows = []
        for g in generations:
            prompt = g["tokens"][:g["prompt_length"]]
            steps = len(g["tokens"]) - len(prompt)
            decoded = engine.generate(prompt, steps)  # the engine's decode rows (greedy: the same tokens)
            tokens = [int(t) for t in decoded.sequence]
            rows.append(row_kls(reference.score(tokens), decoded.steps, emulated.score_decoded(tokens, len(prompt)),
                                len(prompt) - 1))
        out["decode"] = means(rows)
    finally:
        emulated.close()
    return {path: pair for path, pair in out.items() if pair is not None}


def unemulated_decode(session) -> str | None:
    """What the engine states of its decode path that the reference does not compute
    (Emulation.decode_unemulated), or None: that decode is judged by the class allowance alone."""
    return getattr(session.emulation().get("emulate"), "decode_unemulated", None)


def run_row(qtype: str, options: MatrixOptions, folder: Path, say: Progress) -> MatrixRow:
    """Build one type's model and run the served stage on it; an engine that cannot load or
    run the type gives a SKIP row with its reason (an unsupported type is not a wrong one)."""
    from ggufcheck.checks.compare import run as run_served
    from ggufcheck.diagnose.session import DiagnoseOptions, Session
    from ggufcheck.engines.base import Unsupported
    from ggufcheck.errors import EngineUnreachable, GGUFCheckError, Unavailable

    path = build_model(qtype, folder, options.seed, options.width, options.arch)
    session = Session(DiagnoseOptions(
        model=path, engine=options.engine, max_prompts=options.max_prompts, max_tokens=options.max_tokens,
        new_tokens=options.new_tokens, decode_to=0, sweep_to=options.sweep_to, sanity=False), say)
    try:
        stages = run_served(session)
        arithmetic = path_arithmetic(session, stages)
        unemulated = unemulated_decode(session)  # said in the row
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
    row = summarize(qtype, stages, arithmetic)
    if unemulated:
        row.message += f"; decode not judged against its stated arithmetic: {unemulated}"
    return row


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
