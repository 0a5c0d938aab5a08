"""Measure a correct bf16 / fp16 engine's error, and the faults' errors, against the allowances.

Why: the reference computes in fp32 / fp64 only, so for bf16, fp16 and 8-bit engines the
checks fall back on *stated* allowances (``checks/logits.py`` ALLOWANCES, ``checks/layers/options.py``
LayerOptions.allowances / residual_allowances). An allowance is right when a healthy engine of
its class stays well under it and a real fault lands well over it. This script measures both
sides on the same prompts:

- healthy side: transformers' own modeling code (``hf:bf16``, ``hf:fp16``; ``@cuda`` on a GPU
  machine) fed ggufcheck's rebuild of the file, an implementation independent of the
  reference. Logits metrics vs the fp64 reference; the worst residual-stream error over
  layers; the worst local error of each block replayed on the engine's own input.
- fault side (``--faults``): each catalogued fault of ``ggufcheck.testing.faults`` (an fp32
  reference with one thing wrong) through the same measurements; a fault is "caught" by a
  class when one of its numbers exceeds that class's limit.

    python tools/measure_allowances.py                      # SmolLM2 + tiny deepseek2 / glm-dsa
    python tools/measure_allowances.py M.gguf --engines hf:bf16@cuda,hf:fp16@cuda --faults

Prints one table per model; ``--json F`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ggufcheck.checks.layers import LayerOptions, replay_errors
from ggufcheck.checks.logits import ALLOWANCES, INDEXER_TIE_MARGINS, LogitTolerance, collect, wilson_interval
from ggufcheck.checks.prompts import builtin_prompts
from ggufcheck.engines.reference import ReferenceEngine
from ggufcheck.engines.spec import open_engine
from ggufcheck.tokenizer import load_tokenizer

CLASSES = ("fp16", "bf16", "q8")
LOGIT_FIELDS = ("kl_mean", "kl_p99", "nmse_mean", "delta_p_rms")


def _tokens(ref: ReferenceEngine, n_prompts: int, max_tokens: int) -> list[list[int]]:
    tok = load_tokenizer(ref.model.gguf)
    texts = [p.text for p in builtin_prompts()[:n_prompts]]
    return [s[:max_tokens] for s in (tok.encode(t, add_special=True, parse_special=True) for t in texts) if len(s) >= 2]


def _logit_numbers(ref_tables, tables) -> dict[str, float]:
    m = collect(list(zip(ref_tables, tables)))
    dp = m.delta_p[np.isfinite(m.delta_p)]
    return {"kl_mean": float(m.kl.mean()), "kl_p99": float(np.percentile(m.kl, 99)),
            "argmax_agreement": float(m.agree.mean()),
            "argmax_upper": float(wilson_interval(int(m.agree.sum()), int(m.n))[1]), "nmse_mean": float(m.nmse.mean()),
            "delta_p_rms": float(np.sqrt((dp ** 2).mean())) if dp.size else 0.0, "positions": int(m.n)}


def _layer_numbers(engine, ref64: ReferenceEngine, seqs, cls: str) -> dict[str, float]:
    """Worst residual error over layers and prompts, and worst local attention / FFN error, with
    the DSA / MoE tie margins of class ``cls`` (checks.layers.replay_errors)."""
    rows = replay_errors(engine, ref64.model, seqs, activation_dtype=cls)
    worst = max(rows, key=lambda r: r["residual"])
    return {"residual_max": worst["residual"], "residual_worst_layer": worst["layer"],
            "local_attention_max": max(r["attention"] for r in rows), "local_ffn_max": max(r["ffn"] for r in rows)}


def _limits(cls: str) -> dict[str, float]:
    """Each number's limit for activation class ``cls`` when judged on its allowance alone."""
    a, tol, lay = ALLOWANCES[cls], LogitTolerance(), LayerOptions()
    return {"kl_mean": tol.multiple * a.kl_mean + tol.kl_floor, "kl_p99": tol.multiple * a.kl_p99 + tol.kl_p99_floor,
            "nmse_mean": tol.multiple * a.nmse_mean + tol.nmse_floor,
            "delta_p_rms": tol.multiple * a.delta_p_rms + tol.delta_p_floor,
            "argmax_agreement": a.argmax_agreement - tol.argmax_floor,
            "residual_max": lay.residual_allowances[cls], "local_attention_max": lay.allowances[cls],
            "local_ffn_max": lay.allowances[cls]}


def _over(numbers: dict, limits: dict) -> list[str]:
    """Names of the numbers beyond their limits (argmax: below). The local block errors count only
    when the residual stream is over its limit: the layers stage replays blocks only then."""
    out = [k for k in LOGIT_FIELDS + ("residual_max",) if k in numbers and numbers[k] > limits[k]]
    if "residual_max" in out:
        out += [k for k in ("local_attention_max", "local_ffn_max") if numbers[k] > limits[k]]
    if numbers.get("argmax_upper", 1.0) < limits["argmax_agreement"]:  # as logits.argmax: the Wilson upper bound
        out.append("argmax_agreement")
    return out


def measure_model(path: Path, specs: list[str], faults: bool, n_prompts: int, max_tokens: int) -> dict:
    file_ref = ReferenceEngine(path, dtype="fp64")
    arch = file_ref.model.cfg.arch
    # transformers' glm_moe_dsa hard-codes the q_a / kv_a norm eps (1e-6; files say 1e-5,
    # reference/config.py): its rows are measured against a reference told so, the faults not
    hf_ref = ReferenceEngine(path, dtype="fp64", lora_norm_eps=1e-6) if arch == "glm-dsa" else file_ref
    seqs = _tokens(file_ref, n_prompts, max_tokens)
    ref_tables: dict[tuple[int, float], list] = {}

    def reference_tables(ref64: ReferenceEngine, margin: float) -> list:
        if (id(ref64), margin) not in ref_tables:
            ref64.tie_margin = margin
            ref_tables[(id(ref64), margin)] = [ref64.score(s) for s in seqs]
        return ref_tables[(id(ref64), margin)]

    candidates = [(spec, hf_ref if spec.startswith("hf") else file_ref, lambda spec=spec: open_engine(spec, path))
                  for spec in specs]
    if faults:
        from ggufcheck.testing.faults import FAULTS, make_faulty_engine

        for name, fault in FAULTS.items():
            if fault.applies_to(arch) and fault.stage in ("layers", "weights", "logits"):
                candidates.append((f"fault {name}", file_ref, lambda name=name: make_faulty_engine(name, path)))
    rows = []
    lay = LayerOptions()
    for label, ref64, make in candidates:
        t0 = time.perf_counter()
        print(f"  {path.name}: {label}", file=sys.stderr, flush=True)
        try:
            engine = make()
        except Exception as err:  # noqa: BLE001 - an engine this machine cannot open is reported, not fatal
            rows.append({"engine": label, "unavailable": f"{type(err).__name__}: {err}"})
            continue
        # a healthy engine is judged with its own class's tie margins; a fault with the widest
        # ones, so that "caught" below holds for every class
        cls = engine.capabilities.activation_dtype
        judged_as = "bf16" if label.startswith("fault") else cls  # bf16 / q8: the widest margins
        margin = INDEXER_TIE_MARGINS.get(judged_as, 0.0)
        router_margin = lay.router_tie_margins.get(judged_as, lay.router_tie_margin)
        numbers = _logit_numbers(reference_tables(ref64, margin), [engine.score(s) for s in seqs])
        if "residual" in engine.capabilities.layer_outputs:
            numbers.update(_layer_numbers(engine, ref64, seqs, judged_as))
        engine.close()
        row = {"engine": label, "activation_dtype": cls, "indexer_tie_margin": margin,
               "router_tie_margin": router_margin, **numbers, "seconds": round(time.perf_counter() - t0, 1)}
        row["over"] = {c: _over(numbers, _limits(c)) for c in CLASSES}
        rows.append(row)
    for ref in {id(r): r for r in (file_ref, hf_ref)}.values():
        ref.close()
    return {"model": str(path), "arch": arch, "prompts": len(seqs), "tokens": sum(len(s) for s in seqs),
            "rows": rows}


def _print(result: dict) -> None:
    print(f"\n{Path(result['model']).name} ({result['arch']}): {result['prompts']} prompts, {result['tokens']} tokens")
    cols = ("kl_mean", "kl_p99", "argmax_agreement", "nmse_mean", "delta_p_rms", "residual_max",
            "local_attention_max", "local_ffn_max")
    heads = ("KL mean", "KL p99", "argmax", "NMSE", "dp rms", "resid", "loc attn", "loc ffn")
    print(f"{'':32s}" + "".join(f"{h:>10s}" for h in heads) + "   verdict")
    for cls in CLASSES:
        lim = _limits(cls)
        print(f"{'limit, ' + cls + ' allowance':32s}" + "".join(f"{lim[c]:10.3g}" for c in cols))
    for row in result["rows"]:
        if "unavailable" in row:
            print(f"{row['engine']:32s} unavailable: {row['unavailable']}")
            continue
        cells = "".join(f"{row[c]:10.3g}" if c in row else f"{'-':>10s}" for c in cols)
        if row["engine"].startswith("fault"):
            caught = [c for c in CLASSES if row["over"][c]]
            verdict = "caught under " + ", ".join(caught) if caught else "NOT caught under any class"
            if caught and len(caught) < len(CLASSES):
                verdict += " (not " + ", ".join(c for c in CLASSES if c not in caught) + ")"
        else:
            own = row["over"].get(row["activation_dtype"])
            verdict = ("within its class" if not own else "BEYOND its class: " + ",".join(own)) if own is not None else ""
        print(f"{row['engine'][:32]:32s}{cells}   {verdict}")
    print("(argmax: the raw agreement; the check uses its 95% Wilson upper bound, as does the verdict)")


def _default_models() -> list[Path]:
    from ggufcheck.testing import convert
    from ggufcheck.testing.models import smollm2_path

    paths = []
    try:
        paths.append(Path(smollm2_path()))
    except Exception as err:  # noqa: BLE001
        print(f"SmolLM2 unavailable: {err}", file=sys.stderr)
    for arch in ("deepseek2", "glm-dsa"):
        try:
            paths.append(Path(convert.tiny_converted(arch, "f32").gguf_path))
        except Exception as err:  # noqa: BLE001
            print(f"tiny {arch} unavailable: {err}", file=sys.stderr)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="*", type=Path)
    p.add_argument("--engines", default="hf:bf16,hf:fp16", help="comma-separated engine specs (default hf:bf16,hf:fp16)")
    p.add_argument("--faults", action="store_true", help="also measure every applicable catalogued fault")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(time.strftime("%Y-%m-%d %H:%M:%S %Z"), platform.node(), platform.processor() or platform.machine(),
          f"torch {torch.__version__}", f"cuda {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no cuda")
    results = []
    for path in a.models or _default_models():
        results.append(measure_model(path, a.engines.split(","), a.faults, a.prompts, a.max_tokens))
        _print(results[-1])
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
