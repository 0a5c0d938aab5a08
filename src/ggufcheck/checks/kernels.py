"""The kernel stage: the plan of kernel cases, real model data, and the probe's answers.

The host side of ``ggufcheck kernels``. It builds the plan (which kernel at which shape and
dtype: real GLM-5 / DeepSeek-V3 shapes by default, the model's own with ``--model``), writes
the model's real data (weight rows, norm weights, router, quantized blocks with gguf-py's
dequantization as truth, layer-0 inputs from embedding rows) to a torch file the probe
loads, runs ggufcheck_probe_kernels.py in the target interpreter, and turns each answer into
a Result (component ``kernel``; ``stats['tier']`` says which tier decided). If the probe
process dies inside a case (a segfault, a sticky CUDA error, a hang), that case FAILs at the
"runs" tier and the probe restarts for the remaining cases.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufcheck.comparison import Comparison, Worst, to_result
from ggufcheck.probe.runner import ProbeTarget, run_probe
from ggufcheck.results import Result, StageReport, Status, errored

SRC_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding the ggufcheck package
MAX_RESTARTS = 4

# Real shapes (docs/architectures.md): DeepSeek-V3 MLA P+R = 192, V = 128; GLM-5 P+R = 256, V = 256;
# absorbed decode q/k = L + R = 576 (latent + rope), v = L = 512; GQA 32 heads over 8.
GPU_ATTENTION = [
    {"name": "mla_prefill_192_128", "h": 16, "g": 16, "t": 1024, "s": 1024, "d": 192, "e": 128, "causal": True},
    {"name": "mla_prefill_256_256", "h": 16, "g": 16, "t": 1024, "s": 1024, "d": 256, "e": 256, "causal": True},
    {"name": "mla_decode_576_512", "h": 16, "g": 16, "t": 1, "s": 4096, "d": 576, "e": 512, "causal": False},
    {"name": "mla_decode_576_512_mqa", "h": 16, "g": 1, "t": 1, "s": 4096, "d": 576, "e": 512, "causal": False},
    {"name": "gqa_128", "h": 32, "g": 8, "t": 1024, "s": 1024, "d": 128, "e": 128, "causal": True},
]


def _cpu_shape(shape: dict) -> dict:
    """The same head dims at CPU-friendly lengths and head counts."""
    ratio = shape["h"] // shape["g"]  # query heads per kv head, kept
    heads = max(2, shape["h"] // 8)
    if shape["g"] > 1:
        heads = max(2 * ratio, heads - heads % ratio)
    small = dict(shape, h=heads, g=1 if shape["g"] == 1 else heads // ratio,
                 t=min(shape["t"], 64), s=min(shape["s"], 128))
    if small["causal"]:
        small["s"] = small["t"]
    return small


@dataclass(frozen=True)
class ModelShapes:
    """What the plan needs from a model's metadata (docs/architectures.md key names)."""

    arch: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    eps: float
    rope_base: float
    n_rot: int
    mla: tuple[int, int, int] | None = None  # (P+R, V, L) when the model is MLA
    experts: int = 0
    experts_used: int = 0
    gating: str = "softmax"
    indexer: tuple[int, int, int] | None = None  # (heads, key_length, top_k)
    qtypes: tuple[str, ...] = ()
    window: int = 0  # sliding-window layers (gemma3, gpt-oss, phi3): their attention gets its own cases


@dataclass(frozen=True)
class KernelOptions:
    target: ProbeTarget = field(default_factory=ProbeTarget)
    model: Path | None = None
    dtypes_gpu: tuple[str, ...] = ("bfloat16", "float16")
    dtypes_cpu: tuple[str, ...] = ("float32", "bfloat16")
    time_kernels: bool = True
    case_timeout_s: float = 180.0
    total_timeout_s: float = 1500.0
    only: tuple[str, ...] = ()  # kinds to run (empty: all)


# ----------------------------------------------------------------------------- the plan
def build_plan(shapes: ModelShapes | None = None, options: KernelOptions = KernelOptions()) -> list[dict]:
    """Every case, once for a GPU target (``when: cuda``) and once for CPU (``when: cpu``)."""
    plan: list[dict] = []
    for when, device, dtypes in (("cuda", "cuda", options.dtypes_gpu), ("cpu", "cpu", options.dtypes_cpu)):
        attn = attention_shapes(shapes)
        if when == "cpu":
            attn = [_cpu_shape(a) for a in attn]
        for a in attn:
            for backend in ("flash", "efficient", "cudnn", "math"):
                for dt in dtypes:
                    plan.append(_spec("sdpa", when, device, dt, f"{backend}.{a['name']}",
                                      shape=a, backend=backend))
        for a in attn:
            if a["t"] != a["s"]:
                continue  # varlen cases: prefill shapes
            for source in ("flash_attn", "vllm.vllm_flash_attn"):
                plan.append(_spec("varlen", when, device, dtypes[0], f"{source}.{a['name']}",
                                  shape=dict(a, seqlens=[1, 17, 128, 300, 64] if when == "cuda" else [1, 7, 30]),
                                  source=source))
        hidden = shapes.hidden if shapes else 7168
        dims = [hidden] + ([shapes.mla[2]] if shapes and shapes.mla else [] if shapes else [512])
        for dim in _unique(dims):
            for impl in ("torch", "vllm"):
                for dt in _unique([*dtypes, "float32"]):
                    plan.append(_spec("rmsnorm", when, device, dt, f"{impl}.{dim}", impl=impl,
                                      shape={"dim": dim, "rows": 64 if when == "cuda" else 16,
                                             "eps": shapes.eps if shapes else 1e-6}))
        n_rot = shapes.n_rot if shapes else 64
        base = shapes.rope_base if shapes else 10000.0
        for pairing in ("norm", "neox"):
            for impl in ("torch", "vllm"):
                for dt in dtypes:
                    plan.append(_spec("rope", when, device, dt, f"{impl}.{pairing}", impl=impl,
                                      pairing=pairing, shape={"t": 256 if when == "cuda" else 32,
                                                              "h": 16 if when == "cuda" else 2,
                                                              "n_rot": n_rot, "base": base}))
        experts = shapes.experts if shapes and shapes.experts else 256
        used = shapes.experts_used if shapes and shapes.experts_used else 8
        gating = shapes.gating if shapes and shapes.experts else "sigmoid"
        for dt in _unique(["float32", dtypes[0]]):
            plan.append(_spec("router", when, device, dt, f"{gating}.{experts}x{used}",
                              shape={"t": 256 if when == "cuda" else 32, "dim": hidden,
                                     "experts": experts, "k": used, "gating": gating}))
        hi, di, top_k = shapes.indexer if shapes and shapes.indexer else (32, 128, 2048)
        t_idx = 1024 if when == "cuda" else 96  # queries = keys; (T, Hi, S) scores materialised
        k_idx = min(top_k, t_idx // 4) if when == "cuda" else 16
        for dt in _unique(["float32", dtypes[0]]):
            plan.append(_spec("indexer", when, device, dt, f"{hi}x{di}.top{k_idx}",
                              shape={"t": t_idx, "heads": hi, "dim": di, "top_k": k_idx}))
        for dt in dtypes:
            plan.append(_spec("linear", when, device, dt, f"{hidden}",
                              shape={"t": 64 if when == "cuda" else 8, "in": hidden,
                                     "out": 2048 if when == "cuda" else 64,
                                     "tensor": "linear"}))
        for dt in dtypes[:1]:
            plan.append(_spec("fused_moe", when, device, dt, f"{experts}x{used}",
                              shape={"t": 16, "dim": min(hidden, 2048), "inter": 256,
                                     "experts": experts, "k": used}))
        for qtype in (shapes.qtypes if shapes else DEFAULT_QTYPES):
            for dt in _unique(["float32", dtypes[0]]):
                plan.append(_spec("dequant", when, device, dt, f"ggufcheck.{qtype}", impl="ggufcheck",
                                  qtype=qtype, ggufcheck_src=SRC_ROOT))
            plan.append(_spec("dequant", when, device, dtypes[0], f"vllm.{qtype}", impl="vllm", qtype=qtype))
            for op in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"):
                plan.append(_spec("ggml_matmul", when, device, dtypes[0], f"{op}.{qtype}", op=op, qtype=qtype))
    if options.only:
        plan = [p for p in plan if p["kind"] in options.only]
    ids = [p["id"] for p in plan]
    assert len(ids) == len(set(ids)), "case ids must be unique: crash tracking relies on them"
    return plan


def _unique(values):
    return list(dict.fromkeys(values))


DEFAULT_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _spec(kind: str, when: str, device: str, dtype: str, name: str, **extra: Any) -> dict:
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
    return {"id": f"{kind}.{name}.{short}.{when}", "kind": kind, "when": when, "device": device,
            "dtype": dtype, **extra}


def attention_shapes(shapes: ModelShapes | None) -> list[dict]:
    if shapes is None:
        return [dict(a) for a in GPU_ATTENTION]
    h = min(shapes.heads, 32)  # heads are independent: cap them to bound time, keep head dims real
    if shapes.mla:
        qk, v, latent = shapes.mla
        rope = shapes.n_rot
        return [
            {"name": f"mla_prefill_{qk}_{v}", "h": h, "g": h, "t": 1024, "s": 1024, "d": qk, "e": v, "causal": True},
            {"name": f"mla_decode_{latent + rope}_{latent}", "h": h, "g": h, "t": 1, "s": 4096,
             "d": latent + rope, "e": latent, "causal": False},
            {"name": f"mla_decode_{latent + rope}_{latent}_mqa", "h": h, "g": 1, "t": 1, "s": 4096,
             "d": latent + rope, "e": latent, "causal": False},
        ]
    ratio = max(1, shapes.heads // max(1, shapes.kv_heads))
    h = max(ratio, (h // ratio) * ratio)
    full = {"name": f"gqa_{shapes.heads}x{shapes.kv_heads}_{shapes.head_dim_qk}", "h": h,
            "g": h // ratio, "t": 1024, "s": 1024, "d": shapes.head_dim_qk, "e": shapes.head_dim_v,
            "causal": True}
    if not shapes.window or shapes.window >= full["s"]:
        return [full]
    # the sliding-window layers' attention: a mask SDPA's flash backend declines, flash-attn's window_size
    return [full, dict(full, name=f"{full['name']}_swa{shapes.window}", window=shapes.window)]


# ----------------------------------------------------------------------------- model data
def model_shapes(model) -> ModelShapes:
    """Shapes from ggufcheck.arch.spec (the one metadata boundary); raw metadata keys
    (docs/architectures.md) only when no spec can be built for this architecture."""
    qtypes = tuple(sorted({t.qtype.name for t in model.tensors.values()
                           if t.qtype.name not in ("F32", "F64", "I8", "I16", "I32", "I64")}))
    try:
        from ggufcheck.arch.spec import ArchSpec, spec_for_model

        spec, _findings = spec_for_model(model)
    except ImportError:
        spec = None
    if spec is not None and isinstance(spec, ArchSpec):
        return ModelShapes(
            arch=spec.arch, hidden=spec.n_embd, heads=spec.n_head, kv_heads=spec.n_head_kv,
            head_dim_qk=spec.head_dim_k, head_dim_v=spec.head_dim_v, eps=spec.rms_eps,
            rope_base=spec.rope.base, n_rot=spec.rope.n_rot,
            mla=(spec.mla.qk_head, spec.mla.v_head, spec.mla.kv_lora_rank) if spec.mla else None,
            experts=spec.moe.n_expert if spec.moe else 0,
            experts_used=spec.moe.n_used if spec.moe else 0,
            gating=spec.moe.gating.value if spec.moe else "softmax",
            indexer=(spec.indexer.n_head, spec.indexer.head_dim, spec.indexer.top_k)
            if spec.indexer else None, qtypes=qtypes, window=spec.swa.window if spec.swa else 0)
    return _shapes_from_metadata(model, qtypes)


def _shapes_from_metadata(model, qtypes: tuple[str, ...]) -> ModelShapes:
    arch = model.architecture or "llama"

    def get(key, default=None):
        return model.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv = get("attention.head_count_kv", heads)
    kv = int(kv[0] if isinstance(kv, list) else kv)
    head_dim = int(get("attention.key_length", hidden // heads))
    mla = None
    if get("attention.key_length_mla") is not None and get("attention.value_length_mla") is not None:
        mla = (int(get("attention.key_length_mla")), int(get("attention.value_length_mla")),
               int(get("attention.kv_lora_rank")))
    gating_id = get("expert_gating_func")
    from ggufcheck.arch.families import family  # the gating when the key is absent, declared once

    known = family(arch)
    default_gating = known.gating if known is not None and known.gating else "softmax"
    gating = {1: "softmax", 2: "sigmoid"}.get(int(gating_id), default_gating) if gating_id else default_gating
    indexer = None
    if get("attention.indexer.head_count") is not None:
        indexer = (int(get("attention.indexer.head_count")), int(get("attention.indexer.key_length")),
                   int(get("attention.indexer.top_k")))
    return ModelShapes(
        arch=arch, hidden=hidden, heads=heads, kv_heads=kv, head_dim_qk=head_dim,
        head_dim_v=int(get("attention.value_length", head_dim)),
        eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        n_rot=int(get("rope.dimension_count", head_dim)), mla=mla,
        experts=int(get("expert_count", 0) or 0), experts_used=int(get("expert_used_count", 0) or 0),
        gating=gating, indexer=indexer, qtypes=tuple(qtypes))


def model_data(model, shapes: ModelShapes, plan: list[dict], path: Path, rows: int = 64) -> dict:
    """Write the probe's torch file of real data; returns notes on what is real and what is not."""
    import numpy as np
    import torch

    from ggufcheck.gguf.dequant import dequantize, dequantize_tensor

    data: dict[str, Any] = {}
    notes: dict[str, str] = {}
    gen = np.random.default_rng(0)
    tensors = model.tensors
    # layer-0 inputs: embedding rows of random token ids, RMS-normalised by blk.0.attn_norm
    emb = "token_embd.weight"
    if emb in tensors:
        n_tok = tensors[emb].n_rows
        ids = sorted(set(gen.integers(0, n_tok, size=256).tolist()))
        x = torch.cat([dequantize_tensor(model, emb, rows=slice(i, i + 1)) for i in ids])
        norm = tensors.get("blk.0.attn_norm.weight")
        w = dequantize_tensor(model, norm.name).float() if norm else torch.ones(x.shape[-1])
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + shapes.eps) * w
        data["activations"] = x.float()
        data[f"norm.{shapes.hidden}"] = w.float()
        notes["activations"] = (f"layer-0 attention inputs: {len(ids)} embedding rows normalised by "
                                "blk.0.attn_norm (not reference-model activations of deeper layers: "
                                "ggufcheck.reference has no trace API yet)")
    latent = tensors.get("blk.0.attn_kv_a_norm.weight")
    if latent is not None:
        data[f"norm.{latent.ne[0]}"] = dequantize_tensor(model, latent.name).float()
    gate = next((t for n, t in tensors.items() if n.endswith("ffn_gate_inp.weight")), None)
    if gate is not None:
        data["router.w"] = dequantize_tensor(model, gate.name).float()
        bias = tensors.get(gate.name.replace("ffn_gate_inp.weight", "exp_probs_b.bias"))
        if bias is not None:
            data["router.bias"] = dequantize_tensor(model, bias.name).float()
        notes["router"] = f"real router {gate.name}"
    proj = next((tensors[n] for n in ("blk.0.attn_q.weight", "blk.0.attn_q_a.weight",
                                      "blk.0.attn_output.weight") if n in tensors), None)
    if proj is not None and "activations" in data and proj.ne[0] == shapes.hidden:
        take = min(proj.n_rows, 2048)
        data["weight.linear"] = dequantize_tensor(model, proj.name, rows=slice(0, take)).float()
        notes["linear"] = f"first {take} rows of {proj.name}"
    try:
        from ggufcheck.reference.activations import real_activations

        real, real_notes = real_activations(model.path)
        data.update(real)
        notes.update(real_notes)
        notes["activations"] = "layer-0 attention inputs from the reference model (fp32)"
    except Exception as err:  # noqa: BLE001 - any reference failure: say so, use weights only
        notes["reference"] = (f"reference activations unavailable ({type(err).__name__}: {err}); "
                              "attention inputs are random, other inputs embedding rows")
    for spec in plan:  # point attention cases at the real q/k/v and their true lengths
        if spec["kind"] != "sdpa":
            continue
        name = spec["shape"]["name"]
        key = "attn.gqa" if name.startswith("gqa") else "attn.prefill" if "prefill" in name else "attn.decode"
        if key in data:
            real_q, real_k = data[key]["q"], data[key]["k"]
            spec["shape"] = dict(spec["shape"], real=key, t=real_q.shape[2], s=real_k.shape[2],
                                 scale=float(data[key]["scale"]))
    for qtype in shapes.qtypes:
        info = next((t for t in tensors.values() if t.qtype.name == qtype), None)
        if info is None:
            continue
        take = min(info.n_rows, rows)
        raw = np.ascontiguousarray(model.raw_rows(info.name, 0, take))
        values = dequantize(raw, info.qtype)
        data[f"quant.{qtype}"] = {"raw": torch.from_numpy(raw.copy()), "values": torch.from_numpy(values),
                                  "qtype_id": int(info.qtype), "tensor": info.name}
        notes[f"quant.{qtype}"] = f"{take} real rows of {info.name}"
    torch.save(data, path)
    return notes


def synthetic_quant_data(qtypes: tuple[str, ...], path: Path, rows: int = 64, cols: int = 1024) -> dict:
    """No model: quantize random values where gguf-py can, random block bytes elsewhere
    (as gguf-py's own tests fuzz), with gguf-py's dequantization as the truth."""
    import numpy as np
    import torch
    import gguf

    from ggufcheck.gguf.dequant import dequantize

    gen = np.random.default_rng(0)
    data, notes = {}, {}
    for name in qtypes:
        qtype = gguf.GGMLQuantizationType[name]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            raw = gguf.quants.quantize(gen.standard_normal((rows, cols)).astype(np.float32), qtype)
            how = "gguf-py quantized normal values"
        except NotImplementedError:
            raw = gen.integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)
            how = "random block bytes (gguf-py cannot quantize this type)"
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        values = dequantize(raw, qtype)
        data[f"quant.{name}"] = {"raw": torch.from_numpy(raw.copy()), "values": torch.from_numpy(values),
                                 "qtype_id": int(qtype), "tensor": None}
        notes[f"quant.{name}"] = how
    torch.save(data, path)
    return notes


# ----------------------------------------------------------------------------- running
def run_kernel_stage(options: KernelOptions = KernelOptions()) -> StageReport:
    shapes = None
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ggufcheck-kernels-") as tmp:
        data_file = Path(tmp) / "data.pt"
        if options.model is not None:
            from ggufcheck.gguf.reader import open_gguf

            with open_gguf(options.model) as model:
                shapes = model_shapes(model)
                plan = build_plan(shapes, options)
                notes = model_data(model, shapes, plan, data_file)
        else:
            plan = build_plan(None, options)
            notes = synthetic_quant_data(DEFAULT_QTYPES, data_file)
        os.chmod(tmp, 0o755)
        answers, fatal = run_plan(plan, options, str(data_file))
    report = StageReport("kernels", info={"model": str(options.model) if options.model else None,
                                          "shapes": shapes.__dict__ if shapes else "default (GLM-5 / DeepSeek-V3)",
                                          "data": notes, "probe": fatal, "time": time_split(answers, fatal)})
    for fatal in fatal.get("messages", []):
        if fatal.get("type") == "fatal" and not fatal.get("after"):  # nothing could run at all
            report.add(errored("kernels.probe", "kernel", f"the kernel probe could not start in "
                               f"{options.target.python}: {fatal['error']}"))
    for answer in answers:
        report.add(result_from_answer(answer))
    return report


def time_split(answers: list[dict], info: dict) -> dict:
    """Where the stage's time went: the probe's start (importing torch, opening the GPU), the
    whole probe, the cases together and the five slowest (first calls include compiling)."""
    timed = sorted(((a["case"], a["seconds"]) for a in answers if "seconds" in a), key=lambda x: -x[1])
    starts = [m["startup_s"] for m in info.get("messages", []) if m.get("type") == "info" and "startup_s" in m]
    return {"probe_s": info.get("probe_s"), "startup_s": sum(starts) if starts else None,
            "cases_s": round(sum(t for _, t in timed), 3), "slowest": [list(x) for x in timed[:5]]}


def run_plan(plan: list[dict], options: KernelOptions, data_file: str | None) -> tuple[list[dict], dict]:
    """Run the plan; restart after a crash inside a case (that case FAILs at 'runs')."""
    answers: list[dict] = []
    info: dict[str, Any] = {"restarts": 0, "messages": [], "probe_s": 0.0}
    remaining = list(plan)
    for attempt in range(MAX_RESTARTS + 1):
        request = {"cases": remaining, "data_file": data_file, "time": options.time_kernels}
        out = run_probe("ggufcheck_probe_kernels.py", request, options.target,
                        idle_timeout=options.case_timeout_s, total_timeout=options.total_timeout_s)
        info["messages"] += [m for m in out.messages if m.get("type") in ("info", "fatal")]
        info["probe_s"] = round(info["probe_s"] + out.elapsed_s, 3)
        got = out.of_type("result")
        answers += got
        if out.done:
            break
        crashed = out.last_started
        fatal = next((m for m in out.messages if m.get("type") == "fatal"), None)
        if crashed is None and fatal is None:
            out.require_done(options.target.python)  # died before any case: ProbeFailed
        if crashed is not None:
            spec = next(s for s in remaining if s["id"] == crashed)
            answers.append({"case": crashed, "kind": spec["kind"], "status": "FAIL", "tier": "runs",
                            "dtype": spec.get("dtype"), "device": spec.get("device"),
                            "message": f"the probe process died in this case ({out.how_it_ended()}): "
                                       f"{out.stderr_tail(400)}", "stats": {}})
        done_ids = {a["case"] for a in answers}
        remaining = [s for s in remaining if s["id"] not in done_ids]
        info["restarts"] = attempt + 1
        if not remaining:
            break
    else:
        for spec in remaining:
            answers.append({"case": spec["id"], "kind": spec["kind"], "status": "ERROR", "tier": "runs",
                            "message": f"not run: the probe died {MAX_RESTARTS + 1} times", "stats": {}})
    return answers, info


def result_from_answer(a: dict) -> Result:
    stats = dict(a.get("stats") or {})
    stats.update(case=a["case"], tier=a.get("tier"), dtype=a.get("dtype"), device=a.get("device"))
    for key in ("backend", "source", "impl", "pairing", "qtype", "op", "shape", "gating"):
        if key in a:
            stats[key] = a[key]
    # "sdpa.flash.gqa_128.bf16.cuda" -> "flash gqa_128 bf16" (no brackets: rich reads markup)
    parts = a["case"].split(".")
    label = " ".join(parts[1:-1]) if len(parts) > 2 else a["case"]
    timing = f" ({stats['ms']:.3f} ms)" if "ms" in stats else ""
    agreement = probe_agreement(stats) if a.get("tier") == "agrees" and a["status"] in ("PASS", "FAIL") else None
    if agreement is not None:  # the probe measured; the verdict is the comparison's, as everywhere
        limit = (f"{stats['multiple']:g} x baseline {stats['baseline_rel_l2']:.3g} + floor {stats['floor']:.3g}, "
                 f"baseline: {stats['baseline']}")
        overflow = (f"; the plain {a.get('dtype')} baseline overflows here ({stats['baseline_nonfinite']} non-finite "
                    "values), so the limit uses output rounding" if stats.get("baseline_nonfinite") else "")
        return to_result(agreement, f"kernels.{a['kind']}", "kernel", stats=stats,
                         message=f"{label} | agrees: {agreement.text()} (limit {limit}){overflow}{timing}")
    message = f"{label} | {a.get('tier')}: {a.get('message')}{timing}"
    return Result(f"kernels.{a['kind']}", Status(a["status"]), "kernel", message, stats=stats)


def probe_agreement(stats: dict) -> Comparison | None:
    """The probe's agreement tier (ggufcheck_probe_tiers._agree: the kernel's output against fp64,
    relative L2, limit ``multiple * baseline + floor``) as a Comparison; None for a case with its
    own agreement rule (top-k sets, index sets), which the probe words itself."""
    if not {"rel_l2", "tol", "baseline_rel_l2", "multiple", "floor"} <= stats.keys():
        return None
    w = stats.get("worst") or {}
    worst = Worst((int(w["index"]),), float(w["got"]), float(w["want"])) if "index" in w else None
    return Comparison("rel_error", float(stats["rel_l2"]), float(stats["tol"]), "vs fp64",
                      baseline=float(stats["baseline_rel_l2"]), worst=worst)
