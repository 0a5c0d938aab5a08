"""Kernel probe: each kernel the engine would use, on this GPU, in three tiers.

Runs inside the target interpreter (standard library + torch). The host sends a plan:
which cases (kernel x shape x dtype) and, with a model, a torch file of real weight rows
and quantized blocks. Each case goes through ggufcheck_probe_tiers.run_case (imports ->
runs with a poisoned output -> agrees with fp64 within a baseline-derived tolerance).

Kernels: torch SDPA per forced backend (flash, efficient, cudnn, math); flash_attn_varlen_func
from flash_attn and vllm.vllm_flash_attn; ggufcheck's own GPU dequantization; vLLM's
ggml_dequantize / ggml_mul_mat_vec_a8 / ggml_mul_mat_a8; building blocks (RMSNorm torch and
vLLM, RoPE NORM and NEOX, router softmax/sigmoid + top-k, indexer scores + top-k, linear).

Dimension letters: B batch, H query heads, G kv heads, T query tokens, S key tokens,
D q/k head dim, E v head dim (SDPA layout (B, H, T, D)).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
import warnings

BOOT = time.monotonic()  # the probe's start: importing torch and opening CUDA count against it

from ggufcheck_probe_common import emit, exception_text, open_channel, read_request
from ggufcheck_probe_tiers import (KernelCase, NotInstalled, Unsupported, run_case,
                                   topk_compare)

torch = None  # imported in main(), inside a try


def _dt(name: str):
    return getattr(torch, name)


def _import(module: str):
    """The module at the exact path the engine imports; NotInstalled if its top is absent."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise NotInstalled(f"{module} ({exc.name} is not installed)") from None
        raise


def _gen(seed: int, device: str):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _randn(shape, dtype, device, seed, scale=1.0):
    """Fresh normal data drawn on the CPU (device-independent), then rounded to dtype."""
    x = torch.randn(shape, generator=_gen(seed, device), dtype=torch.float32) * scale
    return x.to(dtype).to(device)


# ----------------------------------------------------------------------------- attention
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


def attention_mask(t_len, s_len, device, window=0):
    """(T, S) bool: bottom-right aligned causal (query i sees keys j <= i + (S - T), top-left
    when T == S); with a sliding ``window`` > 0 only keys with (i + S - T) - j < window
    (gemma3, gpt-oss: llama.cpp LLAMA_SWA_TYPE_STANDARD)."""
    mask = torch.ones(t_len, s_len, dtype=torch.bool, device=device).tril(s_len - t_len)
    if window:
        mask &= ~torch.ones(t_len, s_len, dtype=torch.bool, device=device).tril(s_len - t_len - window)
    return mask


def attention_fp64(q, k, v, scale, causal, window=0):
    """(B,H,T,D) x (B,G,S,D) x (B,G,S,E) -> (B,H,T,E) in fp64; G divides H (GQA)."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    h, g = q.shape[1], k.shape[1]
    if g != h:
        k = k.repeat_interleave(h // g, dim=1)  # (B,H,S,D)
        v = v.repeat_interleave(h // g, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale  # (B,H,T,S)
    if causal:
        s = s.masked_fill(~attention_mask(s.shape[-2], s.shape[-1], s.device, window), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def attention_in_dtype(q, k, v, scale, causal, window=0):
    """The honest baseline: the same math with every op in the inputs' dtype."""
    h, g = q.shape[1], k.shape[1]
    if g != h:
        k = k.repeat_interleave(h // g, dim=1)
        v = v.repeat_interleave(h // g, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~attention_mask(s.shape[-2], s.shape[-1], s.device, window), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def attention_inputs(shape: dict, dtype: str, device: str, seed: int, data: dict | None):
    b, h, g = shape.get("b", 1), shape["h"], shape["g"]
    t, s, d, e = shape["t"], shape["s"], shape["d"], shape["e"]
    dt = _dt(dtype)
    real = (data or {}).get(shape.get("real", ""))
    if real is not None:  # real q/k/v from the reference model (see ggufcheck.reference.activations)
        q, k, v = real["q"][:, :h], real["k"], real["v"]
        if k.shape[1] == 1 and g > 1:  # MLA's one latent key, expanded to every head
            k, v = k.expand(-1, g, -1, -1), v.expand(-1, g, -1, -1)
        else:
            k, v = k[:, :g], v[:, :g]
        q, k, v = (x.contiguous().to(dt).to(device) for x in (q, k, v))
    else:
        q = _randn((b, h, t, d), dt, device, seed)
        k = _randn((b, g, s, d), dt, device, seed + 1)
        v = _randn((b, g, s, e), dt, device, seed + 2)
    scale = shape.get("scale") or 1.0 / math.sqrt(d)
    return {"q": q, "k": k, "v": v, "scale": scale, "causal": bool(shape.get("causal")),
            "window": int(shape.get("window", 0))}


def _sdpa_reasons(caught) -> str:
    """torch's own words for why the forced backend declined: its warnings, without the
    headers, the source locations, and the lines about the backends we disabled."""
    import re
    texts = []
    for w in caught:
        text = re.sub(r"\(Triggered internally at [^)]*\)\.?", "", str(w.message))
        text = re.sub(r"\s+", " ", text).strip()
        if not text or text.endswith("not used because:") or "has been runtime disabled" in text:
            continue
        if text not in texts:
            texts.append(text)
    return " | ".join(texts)[:700]


def sdpa_case(spec: dict, data: dict | None) -> KernelCase:
    shape, dtype, device, backend = spec["shape"], spec["dtype"], spec["device"], spec["backend"]

    def load():
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        if backend in ("efficient", "cudnn") and not device.startswith("cuda"):
            raise Unsupported(f"the {backend} SDPA backend exists only on CUDA")
        return getattr(SDPBackend, SDPA_BACKENDS[backend])

    def execute(sdp_backend, x, out):
        from torch.nn.attention import sdpa_kernel
        gqa = x["k"].shape[1] != x["q"].shape[1]
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel([sdp_backend]):
            warnings.simplefilter("always")
            try:
                if x["window"]:  # a sliding window is an explicit mask (flash declines masks)
                    mask = attention_mask(x["q"].shape[-2], x["k"].shape[-2], x["q"].device, x["window"])
                    return torch.nn.functional.scaled_dot_product_attention(
                        x["q"], x["k"], x["v"], attn_mask=mask, scale=x["scale"], enable_gqa=gqa)
                return torch.nn.functional.scaled_dot_product_attention(
                    x["q"], x["k"], x["v"], is_causal=x["causal"], scale=x["scale"],
                    enable_gqa=gqa)
            except RuntimeError as exc:
                if "No available kernel" in str(exc):
                    raise Unsupported(_sdpa_reasons(caught) or str(exc)) from None
                raise

    return KernelCase(
        id=spec["id"], kind="sdpa", dtype=dtype, device=device, load=load,
        prepare=lambda: attention_inputs(shape, dtype, device, spec.get("seed", 0), data),
        execute=execute,
        reference=lambda x: attention_fp64(x["q"], x["k"], x["v"], x["scale"], x["causal"], x["window"]),
        baseline=lambda x: attention_in_dtype(x["q"], x["k"], x["v"], x["scale"], x["causal"], x["window"]),
        baseline_doc="same attention math with every op in the dtype (plain torch matmul/softmax)",
        out_spec=lambda x: ((*x["q"].shape[:-1], x["v"].shape[-1]), x["q"].dtype),
        info={"backend": backend, "shape": shape})


def varlen_case(spec: dict, data: dict | None) -> KernelCase:
    """flash_attn_varlen_func: packed (total, H, D) sequences, cu_seqlens, causal."""
    shape, dtype, device, source = spec["shape"], spec["dtype"], spec["device"], spec["source"]
    seqlens = shape.get("seqlens", [1, 17, 128, 300, 64])

    def load():
        if not device.startswith("cuda"):
            raise Unsupported("flash_attn_varlen_func runs only on CUDA")
        module = _import(source)
        fn = getattr(module, "flash_attn_varlen_func", None)
        if fn is None:
            raise AttributeError(f"{source} has no flash_attn_varlen_func")
        return fn

    def prepare():
        total, h, g, d, e = sum(seqlens), shape["h"], shape["g"], shape["d"], shape["e"]
        dt, seed = _dt(dtype), spec.get("seed", 0)
        cu = torch.tensor([0] + list(_cumsum(seqlens)), dtype=torch.int32, device=device)
        return {"q": _randn((total, h, d), dt, device, seed),
                "k": _randn((total, g, d), dt, device, seed + 1),
                "v": _randn((total, g, e), dt, device, seed + 2),
                "cu": cu, "max": max(seqlens), "scale": 1.0 / math.sqrt(d)}

    window = int(shape.get("window", 0))

    def execute(fn, x, out):
        extra = {"window_size": (window - 1, 0)} if window else {}  # flash-attn: keys i - (w - 1) .. i
        try:
            y = fn(x["q"], x["k"], x["v"], cu_seqlens_q=x["cu"], cu_seqlens_k=x["cu"],
                   max_seqlen_q=x["max"], max_seqlen_k=x["max"], softmax_scale=x["scale"],
                   causal=True, **extra)
        except RuntimeError as exc:
            if "head" in str(exc).lower() and "dim" in str(exc).lower():
                raise Unsupported(exception_text(exc)) from None
            raise
        return y[0] if isinstance(y, tuple) else y

    def per_sequence(x, fn):
        outs, starts = [], [0] + list(_cumsum(seqlens))
        for a, z in zip(starts[:-1], starts[1:]):
            q, k, v = (t[a:z].transpose(0, 1).unsqueeze(0) for t in (x["q"], x["k"], x["v"]))
            outs.append(fn(q, k, v, x["scale"], True, window)[0].transpose(0, 1))  # (len, H, E)
        return torch.cat(outs)

    return KernelCase(
        id=spec["id"], kind="varlen", dtype=dtype, device=device, load=load, prepare=prepare,
        execute=execute, reference=lambda x: per_sequence(x, attention_fp64),
        baseline=lambda x: per_sequence(x, attention_in_dtype),
        baseline_doc="per-sequence attention with every op in the dtype",
        out_spec=lambda x: ((x["q"].shape[0], x["q"].shape[1], x["v"].shape[-1]), x["q"].dtype),
        info={"source": source, "shape": {**shape, "seqlens": seqlens}})


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


# ----------------------------------------------------------------------------- building blocks
def rmsnorm_case(spec: dict, data: dict | None) -> KernelCase:
    shape, dtype, device, impl = spec["shape"], spec["dtype"], spec["device"], spec["impl"]
    rows, dim, eps = shape.get("rows", 64), shape["dim"], shape.get("eps", 1e-6)

    def load():
        if impl == "torch":
            return lambda x, w, out: torch.nn.functional.rms_norm(x, (dim,), w, eps)
        if not device.startswith("cuda"):
            raise Unsupported("vLLM's rms_norm op runs only on CUDA")
        _import("vllm._custom_ops")
        op = torch.ops._C.rms_norm

        def run(x, w, out):
            op(out, x, w, eps)
        return run

    def prepare():
        dt = _dt(dtype)
        pair = (data or {}).get(f"rmsnorm.{dim}")  # the real input and weight of this norm
        if pair is not None:
            return {"x": pair["x"][:rows].to(dt).to(device), "w": pair["w"].to(dt).to(device)}
        real = (data or {}).get(f"norm.{dim}")
        w = real.to(dt).to(device) if real is not None else \
            (1.0 + 0.1 * _randn((dim,), torch.float32, "cpu", 5)).to(dt).to(device)
        x = (data or {}).get("activations")
        if x is not None and x.shape[-1] == dim:
            x = x[:rows].to(dt).to(device)
        else:
            x = _randn((rows, dim), dt, device, spec.get("seed", 0), scale=3.0)
        return {"x": x, "w": w}

    def reference(x):
        x64, w64 = x["x"].to(torch.float64), x["w"].to(torch.float64)
        return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64

    def baseline(x):
        xi, w = x["x"], x["w"]
        return xi * torch.rsqrt(xi.pow(2).mean(-1, keepdim=True) + eps) * w

    return KernelCase(
        id=spec["id"], kind="rmsnorm", dtype=dtype, device=device, load=load, prepare=prepare,
        execute=lambda fn, x, out: fn(x["x"], x["w"], out), reference=reference,
        baseline=baseline, baseline_doc="x * rsqrt(mean(x^2) + eps) * w with every op in the dtype",
        out_spec=lambda x: (tuple(x["x"].shape), x["x"].dtype), info={"impl": impl, "shape": shape})


def rope_tables(positions, n_rot, base):
    """cos/sin (T, n_rot/2) in fp64 from theta_i(p) = p * base^(-2i/n_rot)."""
    inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def rope_apply(x, cos, sin, pairing):
    """x (T, H, n_rot); NORM rotates (x[2i], x[2i+1]); NEOX rotates (x[i], x[i + n/2])."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if pairing == "norm":
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return out.flatten(-2)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def rope_case(spec: dict, data: dict | None) -> KernelCase:
    shape, dtype, device = spec["shape"], spec["dtype"], spec["device"]
    pairing, impl = spec["pairing"], spec["impl"]
    t, h, n_rot, base = shape.get("t", 64), shape["h"], shape["n_rot"], shape.get("base", 10000.0)

    def load():
        if impl == "torch":
            def run(x, out):
                # the common engine form: fp32 angles, cos/sin cast to the dtype, math in the dtype
                inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float32, device=device) / n_rot)
                ang = x["pos"].to(torch.float32)[:, None] * inv[None, :]
                return rope_apply(x["x"], ang.cos().to(x["x"].dtype), ang.sin().to(x["x"].dtype),
                                  pairing)
            return run
        if not device.startswith("cuda"):
            raise Unsupported("vLLM's rotary_embedding op runs only on CUDA")
        ops = _import("vllm._custom_ops")

        def run(x, out):
            inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float32, device=device) / n_rot)
            ang = torch.arange(int(x["pos"].max()) + 1, device=device, dtype=torch.float32)[:, None] * inv
            cache = torch.cat((ang.cos(), ang.sin()), dim=-1).to(x["x"].dtype)
            q = x["x"].clone().reshape(t, h * n_rot)
            k = x["x"][:, :1].clone().reshape(t, n_rot)
            ops.rotary_embedding(x["pos"].long(), q, k, n_rot, cache, pairing == "neox")
            return q.reshape(t, h, n_rot)
        return run

    def prepare():
        dt = _dt(dtype)
        # positions far from 0 (every pairing is the identity at 0), plus a few small ones
        far = torch.randint(1000, shape.get("max_pos", 32768), (t - 4,), generator=_gen(9, "cpu"))
        pos = torch.cat((torch.tensor([0, 1, 2, 3]), far)).to(device)
        return {"x": _randn((t, h, n_rot), dt, device, spec.get("seed", 0)), "pos": pos}

    def reference_for(which):
        def ref(x):
            cos, sin = rope_tables(x["pos"].cpu(), n_rot, base)
            return rope_apply(x["x"].to(torch.float64).cpu(), cos, sin, which).to(x["x"].device)
        return ref

    other = "neox" if pairing == "norm" else "norm"

    def compare(out, ref, x, case):
        from ggufcheck_probe_tiers import UNIT_ROUNDOFF, rel_l2
        err = rel_l2(out, ref)
        err_other = rel_l2(out, reference_for(other)(x))
        # baseline: the irreducible error of the engine form: fp32 angles (p * inv_freq
        # rounded to fp32, which at p ~ 3e4 is off by ~1e-3 rad), exact rotation, output
        # rounded to the dtype; independent of the kernel under test
        inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float32) / n_rot)
        ang = (x["pos"].cpu().to(torch.float32)[:, None] * inv[None, :]).double()
        low = rope_apply(x["x"].to(torch.float64).cpu(), ang.cos(), ang.sin(), pairing)
        base_err = rel_l2(low.to(x["x"].dtype), ref.cpu())
        tol = case.multiple * base_err + UNIT_ROUNDOFF[dtype]
        stats = {"rel_l2": err, "rel_l2_vs_other_pairing": err_other, "baseline_rel_l2": base_err,
                 "tol": tol, "baseline": "fp32 angles, exact rotation, rounded to the dtype"}
        if not torch.isfinite(out).all():
            return False, stats, "NaN/Inf in the rotated output"
        if err > tol:
            hint = f" (it matches the {other.upper()} pairing: {err_other:.3g})" if err_other < tol else ""
            return False, stats, f"{pairing.upper()} RoPE disagrees with fp64: rel L2 {err:.3g} > tol {tol:.3g}{hint}"
        return True, stats, (f"{pairing.upper()} rel L2 {err:.3g} <= tol {tol:.3g}; the "
                             f"{other.upper()} pairing would be {err_other:.3g} off")

    return KernelCase(
        id=spec["id"], kind="rope", dtype=dtype, device=device, load=load, prepare=prepare,
        execute=lambda fn, x, out: fn(x, out), reference=reference_for(pairing), compare=compare,
        out_spec=lambda x: (tuple(x["x"].shape), x["x"].dtype),
        info={"pairing": pairing, "impl": impl, "shape": shape})


def router_case(spec: dict, data: dict | None) -> KernelCase:
    """Router as MoE engines run it: logits = x @ Wg^T, softmax or sigmoid, + bias, top-k."""
    shape, dtype, device = spec["shape"], spec["dtype"], spec["device"]
    t, dim, e, k = shape.get("t", 64), shape["dim"], shape["experts"], shape["k"]
    gating = shape.get("gating", "sigmoid")

    def probs(logits):
        return torch.sigmoid(logits) if gating == "sigmoid" else torch.softmax(logits, dim=-1)

    def run(x, out):
        logits = torch.nn.functional.linear(x["x"], x["w"]).float()
        return torch.topk(probs(logits) + x["bias"].to(logits.device), k, dim=-1).indices

    def prepare():
        dt = _dt(dtype)
        real = data or {}
        w = real.get("router.w")
        w = w.to(dt).to(device) if w is not None else _randn((e, dim), dt, device, 3, 0.02)
        bias = real.get("router.bias")
        bias = bias.float().to(device) if bias is not None else torch.zeros(e, device=device)
        act = real.get("router_input", real.get("activations"))
        x = act[:t].to(dt).to(device) if act is not None and act.shape[-1] == dim else \
            _randn((t, dim), dt, device, spec.get("seed", 0))
        return {"x": x, "w": w, "bias": bias, "k": k}

    def reference(x):
        logits = x["x"].to(torch.float64) @ x["w"].to(torch.float64).T
        return probs(logits) + x["bias"].to(torch.float64)

    def margin(out, ref, x):
        # baseline: the same math in the same dtype on the CPU (independent of this device's
        # kernels): 3 x its worst score deviation from fp64 + fp32 roundoff at the score scale
        low = torch.nn.functional.linear(x["x"].cpu(), x["w"].cpu()).float()
        dev = (probs(low.double()) + x["bias"].double().cpu() - ref.cpu()).abs().max().item()
        return 3.0 * dev + 2.0 ** -24 * ref.abs().max().item()

    return KernelCase(
        id=spec["id"], kind="router", dtype=dtype, device=device, load=lambda: run,
        prepare=prepare, execute=lambda fn, x, out: fn(x, out), reference=reference,
        compare=topk_compare(margin), out_spec=lambda x: ((t, k), torch.int64),
        info={"gating": gating, "shape": shape})


def indexer_case(spec: dict, data: dict | None) -> KernelCase:
    """DSA indexer: score[t,s] = sum_h w[t,h] relu(q[t,h] . k[s]), causal, top-k over s."""
    shape, dtype, device = spec["shape"], spec["dtype"], spec["device"]
    t, hi, di, k = shape.get("t", 256), shape["heads"], shape["dim"], shape["top_k"]

    def scores(x, dt, dev):
        q, kk, w = (x[n].to(dt).to(dev) for n in ("q", "kk", "w"))
        s = torch.einsum("thd,sd->ths", q, kk).relu()  # (T, Hi, S)
        s = (s * w[:, :, None]).sum(1)  # (T, S)
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        return s.masked_fill(~causal, -math.inf)

    def run(x, out):
        return torch.topk(scores(x, _dt(dtype), device), k, dim=-1).indices

    def prepare():
        dt = _dt(dtype)
        return {"q": _randn((t, hi, di), dt, device, 11), "kk": _randn((t, di), dt, device, 12),
                "w": _randn((t, hi), dt, device, 13, scale=hi ** -0.5 * di ** -0.5), "k": k}

    def margin(out, ref, x):
        # baseline: the same dtype math on the CPU (independent of this device's kernels)
        low = scores(x, _dt(dtype), "cpu").double()
        finite = torch.isfinite(ref.cpu())
        dev = (low - ref.cpu()).abs()[finite].max().item()
        return 3.0 * dev + 2.0 ** -24 * ref.cpu()[finite].abs().max().item()

    return KernelCase(
        id=spec["id"], kind="indexer", dtype=dtype, device=device, load=lambda: run,
        prepare=prepare, execute=lambda fn, x, out: fn(x, out),
        reference=lambda x: scores(x, torch.float64, device), compare=topk_compare(margin),
        out_spec=lambda x: ((t, k), torch.int64), info={"shape": shape})


def linear_case(spec: dict, data: dict | None) -> KernelCase:
    """y = x @ W^T (cuBLAS on GPU) with real weight rows when a model is given."""
    shape, dtype, device = spec["shape"], spec["dtype"], spec["device"]
    name = shape.get("tensor")

    def prepare():
        dt = _dt(dtype)
        real = (data or {}).get(f"weight.{name}") if name else None
        w = real.to(dt).to(device) if real is not None else \
            _randn((shape["out"], shape["in"]), dt, device, 21, scale=shape["in"] ** -0.5)
        act = (data or {}).get("activations")
        x = act[: shape.get("t", 64)].to(dt).to(device) if act is not None and \
            act.shape[-1] == w.shape[1] else _randn((shape.get("t", 64), w.shape[1]), dt, device, 22)
        return {"x": x, "w": w}

    return KernelCase(
        id=spec["id"], kind="linear", dtype=dtype, device=device,
        load=lambda: torch.nn.functional.linear, prepare=prepare,
        execute=lambda fn, x, out: fn(x["x"], x["w"]),
        reference=lambda x: x["x"].to(torch.float64) @ x["w"].to(torch.float64).T,
        baseline=lambda x: (x["x"].to(torch.float64) @ x["w"].to(torch.float64).T).to(x["x"].dtype),
        baseline_doc="fp64 product rounded to the dtype; floor adds fp32 accumulation u*sqrt(K)",
        floor=_linear_floor(dtype, shape),
        out_spec=lambda x: ((x["x"].shape[0], x["w"].shape[0]), x["x"].dtype),
        info={"shape": shape})


def _linear_floor(dtype: str, shape: dict) -> float:
    from ggufcheck_probe_tiers import UNIT_ROUNDOFF
    # products summed in (at least) fp32: a probabilistic error bound u32 * sqrt(K)
    return UNIT_ROUNDOFF[dtype] + UNIT_ROUNDOFF["float32"] * math.sqrt(shape["in"])


# ----------------------------------------------------------------------------- GGUF kernels
def dequant_case(spec: dict, data: dict | None) -> KernelCase:
    """Quantized blocks -> values, against gguf-py's dequantization (computed by the host)."""
    dtype, device, qtype, impl = spec["dtype"], spec["device"], spec["qtype"], spec["impl"]
    block = (data or {}).get(f"quant.{qtype}")

    def load():
        if block is None:
            raise Unsupported(f"no {qtype} blocks were sent (host could not build any)")
        if impl == "ggufcheck":
            if not device.startswith("cuda"):
                raise Unsupported("ggufcheck's GPU (Triton) dequantization needs a CUDA target")
            src = spec.get("ggufcheck_src")
            if src and src not in sys.path:
                sys.path.insert(0, src)
            try:
                device_mod = importlib.import_module("ggufcheck.gguf.quants.device")
                gguf = importlib.import_module("gguf")
            except ModuleNotFoundError as exc:
                raise Unsupported(f"ggufcheck's dequantization does not import here ({exc})") from None
            gpu = device_mod._triton_kernels()
            if gpu is None:
                raise Unsupported(f"no Triton path: {device_mod._triton_error[0]}")
            qenum = gguf.GGMLQuantizationType[qtype]
            if qenum not in gpu.KERNELS:
                raise Unsupported(f"ggufcheck has no Triton kernel for {qtype} (it would fall "
                                  "back to the CPU path, which is not a GPU kernel)")
            # writes into the caller's (poisoned) buffer: the "runs" tier sees unwritten values
            return lambda raw, qt, rows, cols, out: gpu.dequantize(
                raw.contiguous(), qenum, out.dtype, out=out.view(-1))
        if not device.startswith("cuda"):
            raise Unsupported("vLLM's ggml ops run only on CUDA")
        ops = _import("vllm._custom_ops")

        def run(raw, qt, rows, cols, out):
            try:
                return ops.ggml_dequantize(raw, qt, rows, cols, _dt(dtype))
            except TypeError:  # older vLLM: no dtype argument, fp16 out
                return ops.ggml_dequantize(raw, qt, rows, cols)
        return run

    def prepare():
        return {"raw": block["raw"].to(device), "want": block["values"], "qt": int(block["qtype_id"])}

    def execute(fn, x, out):
        rows, cols = x["want"].shape
        y = fn(x["raw"], x["qt"], rows, cols, out)
        return y.reshape(rows, cols)

    def compare(out, ref, x, case):
        from ggufcheck_probe_tiers import UNIT_ROUNDOFF
        got = out.to(torch.float64).cpu()
        want = ref.to(torch.float64)
        # gguf-py computes d * q in fp32; an fp32 kernel may differ by fused multiply-add
        # rounding (1-2 ulp); a kernel writing fp16/bf16 by that dtype's rounding
        u = UNIT_ROUNDOFF.get(str(out.dtype).replace("torch.", ""), 2.0 ** -24)
        tol = 4 * u * want.abs() + 1e-30
        nan_ok = torch.isnan(got) == torch.isnan(want)
        bad = ((got - want).abs() > tol) & ~torch.isnan(want)
        # bit-exact against gguf-py's values rounded once to the output dtype (NaN == NaN)
        rounded = want.to(out.dtype).to(torch.float64)
        exact = float(((got == rounded) | (torch.isnan(got) & torch.isnan(rounded))).double().mean())
        stats = {"elements": want.numel(), "mismatches": int(bad.sum()),
                 "bit_exact_fraction": exact, "out_dtype": str(out.dtype),
                 "max_abs": float((got - want).abs().nan_to_num(0).max())}
        if bad.any() or not nan_ok.all():
            row = int(bad.nonzero()[0][0]) if bad.any() else -1
            return False, stats, (f"{int(bad.sum())} of {want.numel()} values differ from gguf-py "
                                  f"beyond 4 ulp of {stats['out_dtype']} (first in row {row})")
        return True, stats, (f"{want.numel()} values within 4 ulp of {stats['out_dtype']} of "
                             f"gguf-py ({exact:.1%} bit-exact)")

    return KernelCase(
        id=spec["id"], kind="dequant", dtype=dtype, device=device, load=load, prepare=prepare,
        execute=execute, reference=lambda x: x["want"], compare=compare,
        out_spec=lambda x: (tuple(x["want"].shape), _dt(dtype)),
        info={"impl": impl, "qtype": qtype})


def ggml_matmul_case(spec: dict, data: dict | None) -> KernelCase:
    """vLLM's quantized mat-vec / mat-mul: x @ dequant(W)^T against fp64 from gguf-py values."""
    dtype, device, qtype, op_name = spec["dtype"], spec["device"], spec["qtype"], spec["op"]
    block = (data or {}).get(f"quant.{qtype}")
    t = 1 if op_name == "ggml_mul_mat_vec_a8" else spec.get("t", 16)

    def load():
        if block is None:
            raise Unsupported(f"no {qtype} blocks were sent")
        if not device.startswith("cuda"):
            raise Unsupported("vLLM's ggml ops run only on CUDA")
        ops = _import("vllm._custom_ops")
        return getattr(ops, op_name)

    def prepare():
        rows, cols = block["values"].shape
        return {"raw": block["raw"].to(device), "w": block["values"],
                "x": _randn((t, cols), _dt(dtype), device, 31), "qt": int(block["qtype_id"])}

    return KernelCase(
        id=spec["id"], kind="ggml_matmul", dtype=dtype, device=device, load=load, prepare=prepare,
        execute=lambda fn, x, out: fn(x["raw"], x["x"], x["qt"], x["w"].shape[0]),
        reference=lambda x: (x["x"].to(torch.float64).cpu() @ x["w"].to(torch.float64).T),
        baseline=lambda x: (_q8_blocks(x["x"]).cpu() @ x["w"].float().T).to(_dt(dtype)),
        baseline_doc="x quantized to int8 in blocks of 32 (as vLLM's a8 kernels do), fp32 matmul "
                     "with gguf-py's dequantized W, rounded to the dtype",
        info={"op": op_name, "qtype": qtype})


def _q8_blocks(x):
    """x (T, K) -> the values int8 block quantization (32 per block, scale max/127) keeps."""
    blocks = x.float().reshape(x.shape[0], -1, 32)  # (T, K/32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    q = (blocks / scale.clamp_min(1e-30)).round().clamp(-127, 127)
    return (q * scale).reshape(x.shape)


def fused_moe_case(spec: dict, data: dict | None) -> KernelCase:
    """vLLM's fused_experts (unquantized) against an explicit fp64 loop over experts."""
    shape, dtype, device = spec["shape"], spec["dtype"], spec["device"]
    t, dim, inter, e, k = shape["t"], shape["dim"], shape["inter"], shape["experts"], shape["k"]

    def load():
        if not device.startswith("cuda"):
            raise Unsupported("vLLM's fused MoE runs only on CUDA")
        module = _import("vllm.model_executor.layers.fused_moe")
        fn = getattr(module, "fused_experts", None)
        if fn is None:
            raise AttributeError("vllm.model_executor.layers.fused_moe has no fused_experts")
        return fn

    def prepare():
        dt = _dt(dtype)
        x = _randn((t, dim), dt, device, 41)
        w13 = _randn((e, 2 * inter, dim), dt, device, 42, scale=dim ** -0.5)  # [E, gate;up, D]
        w2 = _randn((e, dim, inter), dt, device, 43, scale=inter ** -0.5)  # [E, D, I]
        logits = _randn((t, e), torch.float32, device, 44)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        return {"x": x, "w13": w13, "w2": w2, "weights": weights, "ids": ids.to(torch.int32)}

    def loop(x, dt):
        out = torch.zeros(t, dim, dtype=dt, device=x["x"].device)
        xs = x["x"].to(dt)
        for token in range(t):
            for slot in range(k):
                ex = int(x["ids"][token, slot])
                gu = x["w13"][ex].to(dt) @ xs[token]  # [2I]
                act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
                out[token] += x["weights"][token, slot].to(dt) * (x["w2"][ex].to(dt) @ act)
        return out

    return KernelCase(
        id=spec["id"], kind="fused_moe", dtype=dtype, device=device, load=load, prepare=prepare,
        execute=lambda fn, x, out: fn(x["x"], x["w13"], x["w2"], x["weights"], x["ids"]),
        reference=lambda x: loop(x, torch.float64), baseline=lambda x: loop(x, _dt(dtype)),
        baseline_doc="the same loop over experts with every op in the dtype",
        out_spec=lambda x: (tuple(x["x"].shape), x["x"].dtype), info={"shape": shape})


BUILDERS = {"sdpa": sdpa_case, "varlen": varlen_case, "rmsnorm": rmsnorm_case, "rope": rope_case,
            "router": router_case, "indexer": indexer_case, "linear": linear_case,
            "dequant": dequant_case, "ggml_matmul": ggml_matmul_case, "fused_moe": fused_moe_case}


def main() -> None:
    global torch
    request = read_request()
    open_channel()
    try:
        import torch as _torch
        torch = _torch
    except BaseException as exc:  # noqa: BLE001
        emit({"type": "fatal", "error": f"torch does not import: {exception_text(exc)}"})
        emit({"type": "done"})
        return
    cuda = torch.cuda.is_available()
    emit({"type": "info", "torch": torch.__version__, "cuda": cuda, "startup_s": round(time.monotonic() - BOOT, 3),
          "gpu": torch.cuda.get_device_name(0) if cuda else None,
          "capability": list(torch.cuda.get_device_capability(0)) if cuda else None})
    data = None
    if request.get("data_file"):
        data = torch.load(request["data_file"], weights_only=True)
    when = "cuda" if cuda else "cpu"
    for spec in request.get("cases", []):
        if spec.get("when", when) != when:
            continue  # the plan holds a GPU and a CPU version of each case
        emit({"type": "start", "case": spec["id"]})
        started = time.monotonic()
        try:
            case = BUILDERS[spec["kind"]](spec, data)
            result = run_case(case, time_it=bool(request.get("time")) and spec["device"].startswith("cuda"))
        except Exception as exc:  # noqa: BLE001 - a bug in building the case, not a kernel fault
            result = {"type": "result", "case": spec["id"], "kind": spec["kind"], "status": "ERROR",
                      "tier": "imports", "message": f"probe could not build the case: {exception_text(exc)}",
                      "stats": {}}
        result["seconds"] = round(time.monotonic() - started, 3)  # building, compiling and running it
        emit(result)
        if spec["device"].startswith("cuda") and result["status"] == "FAIL":
            try:
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a sticky CUDA error: the context is gone
                emit({"type": "fatal", "error": f"CUDA context unusable after {spec['id']}: "
                      f"{exception_text(exc)}", "after": spec["id"]})
                os._exit(3)
    emit({"type": "done"})


if __name__ == "__main__":
    main()
