"""``ggufcheck reference MODEL.gguf (--prompt TEXT | --tokens 1,2,3)``: run the reference.

Prints the top predictions per position and a per-layer summary (residual norms, router
and indexer activity), and with ``--out`` writes the trace (NAME.safetensors + NAME.json)
that the compare and bisection stages read later.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ggufcheck.errors import ExitStatus, Unavailable, UsageError


@dataclass(frozen=True)
class ReferenceOptions:
    model: Path
    prompt: str | None
    tokens: tuple[int, ...] | None
    dtype: str
    device: str
    out: Path | None
    top: int
    streaming: bool | None
    mla_form: str


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reference",
        help="run the readable reference forward pass over a prompt; print predictions, write a trace",
        description="Compute what the GGUF file should compute (its dequantized weights, fp64 or fp32 "
        "arithmetic): top predictions per position, a per-layer summary, and optionally a trace "
        "(golden states) for later comparison.",
    )
    p.add_argument("model", type=Path, help="path to a .gguf file (any part of a split model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, tokenized with the GGUF's own vocabulary")
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--dtype", choices=("fp32", "fp64"), default="fp64", help="arithmetic precision (default fp64)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--out", type=Path, help="write the trace to OUT.safetensors + OUT.json")
    p.add_argument("--top", type=int, default=3, help="predictions shown per position (default 3)")
    p.add_argument("--json", type=Path, help='write the predictions and per-layer summary to this JSON file '
                                             '("-": standard output)')
    stream = p.add_mutually_exclusive_group()
    stream.add_argument("--stream", dest="streaming", action="store_true", default=True,
                        help="keep no weight once used (default: one pass reads each weight once; memory stays "
                             "at a few row blocks and one expert whatever the model's size)")
    stream.add_argument("--no-stream", dest="streaming", action="store_false",
                        help="keep every dequantized weight (the whole model in memory)")
    p.add_argument("--mla", choices=("naive", "absorbed"), default="naive", help="MLA form (deepseek2, glm-dsa)")


def _parse_tokens(text: str) -> tuple[int, ...]:
    try:
        tokens = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise UsageError(f"--tokens must be comma-separated integers, not {text!r}") from None
    if not tokens:
        raise UsageError("--tokens is empty")
    return tokens


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, not {args.top}")
    options = ReferenceOptions(
        model=args.model, prompt=args.prompt, tokens=_parse_tokens(args.tokens) if args.tokens is not None else None,
        dtype=args.dtype, device=args.device, out=args.out, top=args.top, streaming=args.streaming,
        mla_form=args.mla,
    )
    if options.out is not None:  # before the work, not after it
        try:
            import safetensors  # noqa: F401
        except ImportError as err:
            raise Unavailable("--out writes a safetensors file, and safetensors is not installed",
                              tip="pip install 'ggufcheck[hf]' (or: pip install safetensors)") from err
    import torch

    from ggufcheck.reference import ReferenceModel

    console = Console()
    with ReferenceModel(options.model, dtype=options.dtype, device=options.device,
                        streaming=options.streaming, mla_form=options.mla_form) as ref:
        tokenizer = _tokenizer(ref, required=options.prompt is not None)
        tokens = list(options.tokens) if options.tokens is not None else tokenizer.encode(
            options.prompt, add_special=True, parse_special=True)
        if not tokens:
            raise UsageError("the prompt tokenized to no tokens")
        cfg = ref.cfg
        console.print(f"[bold]{options.model.name}[/]: {cfg.arch}, {cfg.n_layer} layers, D {cfg.n_embd}, "
                      f"vocab {cfg.n_vocab}; {len(tokens)} tokens, {options.dtype} on {ref.device}"
                      f"{', streaming' if ref.streaming else ', weights kept'}")
        started = time.perf_counter()
        with torch.no_grad():
            trace = ref.prefill(tokens)
        elapsed = time.perf_counter() - started
    console.print(_predictions_table(trace, tokens, tokenizer, options.top))
    console.print(_layers_table(trace))
    console.print(f"reference forward: {elapsed:.2f} s; model fingerprint "
                  f"{trace.meta['model_fingerprint']['method']} {trace.meta['model_fingerprint']['value'][:16]}")
    if options.out is not None:
        tensors_path, meta_path = trace.save(options.out)
        console.print(f"trace written: {tensors_path} + {meta_path.name}")
    if getattr(args, "json", None):
        from ggufcheck.report.json import report_json, write_json

        write_json(args.json, report_json("reference", [], model=str(options.model), **_json(
            trace, tokens, tokenizer, options, cfg, elapsed)))
    return int(ExitStatus.HEALTHY)


def _json(trace, tokens: list[int], tokenizer, options, cfg, elapsed: float) -> dict:
    """The same numbers as the tables, for machines."""
    values, ids = trace.top_predictions(options.top)
    predictions = [{"position": t, "token": int(tok), "piece": _piece(tokenizer, int(tok)),
                    "top": [{"id": int(i), "piece": _piece(tokenizer, int(i)), "logprob": float(v)}
                            for v, i in zip(values[t].tolist(), ids[t].tolist())]}
                   for t, tok in enumerate(tokens)]
    layers = [{"layer": i, "residual_in_rms": _rms(trace.layer_input(i)), "attention_rms": _rms(layer.attn_out),
               "ffn_rms": _rms(layer.ffn_out), "residual_out_rms": _rms(layer.hidden),
               "experts_used": None if layer.expert_ids is None else len(set(layer.expert_ids.flatten().tolist()))}
              for i, layer in enumerate(trace.layers)]
    return {"arch": cfg.arch, "dtype": options.dtype, "tokens": [int(t) for t in tokens], "predictions": predictions,
            "layers": layers, "elapsed_s": elapsed, "model_fingerprint": trace.meta["model_fingerprint"]}


def _tokenizer(ref, required: bool):
    """The GGUF's own tokenizer, or None; with --prompt a missing tokenizer is a usage error."""
    try:
        from ggufcheck.tokenizer import load_tokenizer

        return load_tokenizer(ref.gguf)
    except Exception as err:  # noqa: BLE001 - only needed for --prompt and for showing pieces
        if required:
            raise UsageError(f"--prompt needs the GGUF's tokenizer, which is unavailable: {err}",
                             tip="pass token ids with --tokens 1,2,3") from None
        return None


def _piece(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return str(token_id)
    try:
        return repr(tokenizer.token_str(token_id))[1:-1]
    except Exception:  # noqa: BLE001 - display only
        return str(token_id)


def _predictions_table(trace, tokens: list[int], tokenizer, top: int) -> Table:
    values, ids = trace.top_predictions(top)
    table = Table(title="top predictions per position (log-probability)", title_justify="left")
    table.add_column("pos", justify="right")
    table.add_column("token")
    for k in range(top):
        table.add_column(f"#{k + 1}")
    for t, token in enumerate(tokens):
        cells = [f"{_piece(tokenizer, int(i))} [dim]{v:.3f}[/]" for v, i in zip(values[t].tolist(), ids[t].tolist())]
        table.add_row(str(t), f"{token} {_piece(tokenizer, token)}", *cells)
    return table


def _layers_table(trace) -> Table:
    table = Table(title="per-layer summary (RMS over tokens and dims)", title_justify="left")
    for name in ("layer", "residual in", "attn out", "ffn/moe out", "residual out", "experts used", "indexer"):
        table.add_column(name, justify="right" if name != "indexer" else "left")
    for i, layer in enumerate(trace.layers):
        h_in = trace.layer_input(i)
        experts = "-" if layer.expert_ids is None else str(len(set(layer.expert_ids.flatten().tolist())))
        if layer.topk is None:
            indexer = "-"
        else:
            kind = "full" if layer.topk_full else "shared"
            ties = int(layer.topk_ties.sum()) if layer.topk_ties is not None else 0
            indexer = f"{kind}, k={layer.topk.shape[1]}" + (f", {ties} tied" if ties else "")
        table.add_row(str(i), *(f"{_rms(x):.4g}" for x in (h_in, layer.attn_out, layer.ffn_out, layer.hidden)),
                      experts, indexer)
    return table


def _rms(x) -> float:
    return float(x.double().pow(2).mean().sqrt())
