"""What the device lead scripts (chunk_lead.py, real_lead.py, op_lead.py, q8_1_emulation.py) share:
the engine options from a ``--spec`` string, the engine and reference pair, the per-row metrics,
and the emulation of a Q4_1 x q8_1 product the CPU's way and CUDA's way (q8_1_emulation.py's
docstring says how they differ)."""

from __future__ import annotations

import numpy as np


def spec_options(spec: str) -> dict[str, int]:
    """'n_gpu_layers=99,flash_attn=1' -> {'n_gpu_layers': 99, 'flash_attn': 1} ('' -> {}: the CPU)."""
    options = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        options[key] = int(value)
    return options


def open_engines(model: str, spec: str):
    """llama.cpp in a process of its own (a CUDA libllama cannot share one with torch) and the
    fp64 reference; prints which."""
    from ggufcheck.engines.isolated import IsolatedEngine
    from ggufcheck.engines.reference import ReferenceEngine

    engine = IsolatedEngine("ggufcheck.engines.llama_cpp:LlamaCppEngine", model, preload=("llama_cpp",),
                            **spec_options(spec))
    reference = ReferenceEngine(model, dtype="fp64")
    print(f"engine: {engine.name}; reference: {reference.name}")
    return engine, reference


def kl_rows(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """KL(ref || got) per row of two [T, V] log-prob tables."""
    p = np.exp(ref)
    return (p * (ref - got)).sum(axis=-1)


def rel_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row relative error ||a - b|| / ||b|| of two [T, D] arrays."""
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)


QK = 32


def q4_1_blocks(raw: np.ndarray, n_out: int, n_in: int):
    """(d [out, nb], m [out, nb], q [out, n_in] in 0..15) of a Q4_1 tensor's raw bytes."""
    nb = n_in // QK
    blocks = raw.reshape(n_out, nb, 20)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0]
    qs = blocks[:, :, 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n_out, n_in)  # low nibbles 0..15, high 16..31
    return d, m, q.astype(np.int32)


def q8_1(x: np.ndarray):
    """(d_a [rows, nb] f32, q [rows, n] int, s [rows, nb] f32): the CUDA quantize_q8_1 (d = amax / 127,
    q = round(x / d), s = the block's sum of the unrounded x)."""
    rows, n = x.shape
    xb = x.reshape(rows, n // QK, QK).astype(np.float32)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    q = np.where(amax[..., None] > 0, np.round(xb / np.where(d > 0, d, 1)[..., None]), 0).astype(np.int32)
    return d, q.reshape(rows, n), xb.sum(axis=-1, dtype=np.float32)


def product(dw, mw, qw, da, qa, sa, half_products: bool) -> np.ndarray:
    """[rows, out]: sum over blocks of sumi * (d_w d_a) + m_w s_a, the scale products in f16 or f32."""
    rows, n = qa.shape
    out_n, nb = dw.shape
    sumi = np.einsum("obk,rbk->rob", qw.reshape(out_n, nb, QK), qa.reshape(rows, nb, QK))  # [rows, out, nb] exact ints
    dd = dw.astype(np.float32)[None] * da.astype(np.float16).astype(np.float32)[:, None]  # f16 d_a, as stored
    ms = mw.astype(np.float32)[None] * sa.astype(np.float16).astype(np.float32)[:, None]
    if half_products:
        dd, ms = dd.astype(np.float16).astype(np.float32), ms.astype(np.float16).astype(np.float32)
    return (sumi.astype(np.float32) * dd + ms).sum(axis=-1, dtype=np.float64)


def emulated_forms(raw: np.ndarray, n_out: int, n_in: int, x: np.ndarray) -> dict[str, np.ndarray]:
    """The Q4_1 product of ``x`` [rows, n_in] the CPU's way (s from the rounded values, f32 scale
    products) and CUDA's way (s from the unrounded values, f16 scale products as on sm_70+)."""
    dw, mw, qw = q4_1_blocks(np.asarray(raw, np.uint8).reshape(-1), n_out, n_in)
    da, qa, sa = q8_1(x)
    sa_cpu = qa.reshape(qa.shape[0], -1, QK).sum(axis=-1) * da.astype(np.float16).astype(np.float32)
    return {"cpu": product(dw, mw, qw, da, qa, sa_cpu.astype(np.float32), half_products=False),
            "cuda": product(dw, mw, qw, da, qa, sa, half_products=True),
            "cuda_f32_products": product(dw, mw, qw, da, qa, sa, half_products=False)}
