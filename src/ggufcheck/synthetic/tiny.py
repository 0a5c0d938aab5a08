"""Tiny random GGUFs written directly, in llama.cpp's exact layout: an independent producer.

:mod:`ggufcheck.testing.convert` gets test files from llama.cpp's converter; this module
writes them itself with ``gguf.GGUFWriter`` from the layout in
docs/architectures.md and llama.cpp's ``load_arch_tensors`` (src/models/*.cpp).
No transformers, no converter: two producers that agree on names and shapes make the
tables tested against them trustworthy. This module also gives what the converter cannot:
any per-tensor quant type (K-quants and IQ types as random valid blocks), NextN layers,
shared indexer layers, split files, and patch hooks for fault injection.

Shapes are numpy order (``reversed(ne)``), the same as torch ``Linear.weight`` [out, in].
Letters: V vocab, D hidden, H / Hkv heads, hd head dim, F dense FFN, E experts,
Fe expert FFN, Ns shared experts, P / R / Vd MLA nope / rope / value dims, L kv_lora,
Lq q_lora, Hi / Di indexer heads / head dim.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T

from ggufcheck.arch.families import archs
from ggufcheck.errors import GGUFCheckError
from ggufcheck.synthetic import qblocks

ARCHS = archs()  # every family the registry declares (arch/families.py) has a tiny builder
_MOE_ARCHS = archs(moe=True)  # arch/families.py
_MLA_ARCHS = archs(mla=True)
_GEMMA_ARCHS = archs(gemma=True)
_BIASED_ROUTER_ARCHS = archs(biased_router=True)


@dataclass(frozen=True)
class TinyDims:
    """Every dimension and hyperparameter of a tiny model (0 / None = feature absent)."""

    arch: str
    n_layer: int  # trunk layers, NextN layers not included
    n_embd: int = 64  # D
    n_head: int = 4  # H
    n_head_kv: int = 2  # Hkv (MLA archs: the file says 1; this field is unused there)
    head_dim: int = 16  # hd (non-MLA)
    n_ff: int = 128  # F, dense FFN
    n_vocab: int = 512  # V: the built-in byte-level BPE vocabulary
    n_rot: int | None = None  # rope dims; None = head_dim (MLA: qk_rope)
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 512
    attn_bias: bool = False  # q/k/v biases (qwen2, glm4moe)
    qk_norm: bool = False  # per-head q/k RMSNorm (qwen3, glm4moe)
    tied_output: bool = False  # no output.weight: llama.cpp uses token_embd
    # MoE
    n_expert: int = 0  # E
    n_expert_used: int = 0  # K
    n_expert_shared: int = 0  # Ns
    n_ff_exp: int = 0  # Fe
    n_dense_lead: int = 0  # leading dense layers
    n_group: int = 1  # G
    n_group_used: int = 1
    expert_weights_scale: float = 1.0
    expert_weights_norm: bool = True
    gating_func: int | None = 2  # 1 softmax, 2 sigmoid; None = key absent (llama.cpp default)
    # MLA
    q_lora_rank: int = 0  # Lq; 0 = plain attn_q
    kv_lora_rank: int = 0  # L
    qk_nope: int = 0  # P
    qk_rope: int = 0  # R
    v_head_dim: int = 0  # Vd
    # "split": attn_k_b + attn_v_b (today's converter); "fused": legacy attn_kv_b only
    # (old deepseek2 files: MHA metadata, no *_mla keys); "both": split and fused present,
    # consistent (a mapping check must flag it; llama.cpp refuses fused glm-dsa files)
    kv_b: str = "split"
    # YaRN (deepseek2)
    yarn_factor: float = 0.0  # 0 = no YaRN
    yarn_orig_ctx: int = 128
    yarn_log_mul: float = 0.1  # stored 0.1 * mscale_all_dim, as the converter writes it
    # DSA indexer (glm-dsa)
    indexer_heads: int = 0  # Hi
    indexer_dim: int = 0  # Di
    indexer_top_k: int = 0
    indexer_types: tuple[bool, ...] | None = None  # per trunk layer: True full, False shared
    # NextN / MTP layers appended after the trunk (counted in block_count)
    n_nextn: int = 0
    # gemma3: sliding-window attention (0 = key absent); llama.cpp's pattern: 5 local, 1 global
    swa_window: int = 0

    @property
    def block_count(self) -> int:
        return self.n_layer + self.n_nextn

    @property
    def rot(self) -> int:
        if self.arch in _MLA_ARCHS:
            return self.qk_rope
        return self.n_rot if self.n_rot is not None else self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.arch in _MOE_ARCHS and i >= self.n_dense_lead

    def has_indexer(self, i: int) -> bool:
        if self.arch != "glm-dsa":
            return False
        if self.indexer_types is None or i >= self.n_layer:  # NextN layers: as a full layer
            return True
        return self.indexer_types[i]


_MOE = dict(n_expert=8, n_expert_used=2, n_expert_shared=1, n_ff_exp=32, n_dense_lead=1,
            expert_weights_scale=2.5)
# Defaults mirror ggufcheck.testing.convert.HF_CONFIGS (all but the vocabulary), so files
# from the two producers can be compared shape for shape.
DEFAULT_DIMS: dict[str, TinyDims] = {
    "llama": TinyDims("llama", n_layer=2, rms_eps=1e-6),
    "qwen2": TinyDims("qwen2", n_layer=2, rms_eps=1e-6, attn_bias=True),
    "qwen3": TinyDims("qwen3", n_layer=2, rms_eps=1e-6, head_dim=32, qk_norm=True),
    # phi3: q/k/v fused in attn_qkv, gate/up in ffn_up, head dim D / H (its converter derives it)
    "phi3": TinyDims("phi3", n_layer=2, rms_eps=1e-5),
    # gemma3: 6 layers so that llama.cpp's default pattern has one global layer (5); a window
    # of 8 so that every prompt crosses it; q/k norms, tied output, sandwich norms, GeGLU
    "gemma3": TinyDims("gemma3", n_layer=6, rms_eps=1e-6, head_dim=32, qk_norm=True, tied_output=True,
                       rope_base=1000000.0, swa_window=8),
    # qwen3moe: every layer MoE, softmax router (no expert_gating_func: llama.cpp's default),
    # no shared expert, no selection bias, q/k norms
    "qwen3moe": TinyDims("qwen3moe", n_layer=2, rms_eps=1e-6, head_dim=32, qk_norm=True, n_expert=8,
                         n_expert_used=2, n_ff_exp=32, gating_func=None, expert_weights_norm=False),
    # gpt-oss: q/k/v/o biases and attention sinks, window 8 on the even layers, YaRN x4 over
    # 128 (no log multiplier, as its converter writes), every layer MoE with biased router
    # and experts, the clamped SwiGLU
    "gpt-oss": TinyDims("gpt-oss", n_layer=2, head_dim=16, n_ff=32, attn_bias=True, rope_base=150000.0,
                        n_expert=8, n_expert_used=2, n_ff_exp=32, gating_func=None, expert_weights_norm=False,
                        swa_window=8, yarn_factor=4.0, yarn_orig_ctx=128, yarn_log_mul=0.0),
    "glm4moe": TinyDims("glm4moe", n_layer=3, head_dim=32, n_rot=16, attn_bias=True,
                        qk_norm=True, **_MOE),
    "deepseek2": TinyDims("deepseek2", n_layer=3, rms_eps=1e-6, n_head_kv=1, n_group=2,
                          n_group_used=1, q_lora_rank=128, kv_lora_rank=32, qk_nope=16,
                          qk_rope=8, v_head_dim=48, **_MOE),
    # glm-dsa: the converter writes no expert_gating_func (llama.cpp defaults to sigmoid).
    # 16 indexer heads (GLM-5: 32): a key scores exactly 0 when ReLU zeroes it in every head,
    # which with 4 heads happened to ~6% of keys, so exact top-k boundary ties (where correct
    # engines may pick different keys) came in the first 8-37 positions of every prompt; with
    # 16, none in 300 tokens of the built-in prompts over 3 seeds
    "glm-dsa": TinyDims("glm-dsa", n_layer=3, n_head_kv=1, gating_func=None, q_lora_rank=48,
                        kv_lora_rank=32, qk_nope=16, qk_rope=16, v_head_dim=32,
                        indexer_heads=16, indexer_dim=64, indexer_top_k=8, **_MOE),
}


def tiny_dims(arch: str, **overrides: Any) -> TinyDims:
    """The default :class:`TinyDims` of ``arch`` with ``overrides`` applied."""
    if arch not in DEFAULT_DIMS:
        raise GGUFCheckError(f"unknown tiny arch {arch!r}; known: {', '.join(ARCHS)}")
    d = dataclasses.replace(DEFAULT_DIMS[arch], **overrides)
    if arch in ("qwen2", "phi3") and d.n_head * d.head_dim != d.n_embd:
        # their files carry no key_length (as the converter writes them): readers take
        # head_dim = n_embd / n_head, so a file with other dims is one llama.cpp refuses
        if "head_dim" in overrides:
            raise GGUFCheckError(f"tiny {arch}: n_head * head_dim ({d.n_head} * {d.head_dim}) must equal n_embd "
                                 f"({d.n_embd}): its files carry no attention.key_length")
        d = dataclasses.replace(d, head_dim=d.n_embd // d.n_head)
    return d


# ---------------------------------------------------------------------------------------
# tensor layout (numpy shapes), per architecture


def tensor_shapes(d: TinyDims) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, in file order: GGUF name -> numpy shape."""
    D, V = d.n_embd, d.n_vocab
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, D)}
    for i in range(d.block_count):
        blk = f"blk.{i}."
        layer: dict[str, tuple[int, ...]] = {"attn_norm.weight": (D,)}
        layer.update(_mla_attention(d) if d.arch in _MLA_ARCHS else _gqa_attention(d))
        if d.has_indexer(i):
            layer.update(_indexer(d))
        norm = "post_attention_norm.weight" if d.arch in ("glm4moe", "gpt-oss") else "ffn_norm.weight"
        if d.arch in _GEMMA_ARCHS:  # sandwich norms around both blocks
            layer["post_attention_norm.weight"] = (D,)
        layer[norm] = (D,)
        layer.update(_moe_ffn(d) if d.is_moe_layer(i) else _dense_ffn(d))
        if d.arch in _GEMMA_ARCHS:
            layer["post_ffw_norm.weight"] = (D,)
        if i >= d.n_layer:  # NextN wiring around the extra block
            layer.update({"nextn.eh_proj.weight": (D, 2 * D), "nextn.enorm.weight": (D,),
                          "nextn.hnorm.weight": (D,), "nextn.shared_head_norm.weight": (D,)})
        out.update({blk + k: v for k, v in layer.items()})
    out["output_norm.weight"] = (D,)
    if not d.tied_output:
        out["output.weight"] = (V, D)
    return out


def _gqa_attention(d: TinyDims) -> dict[str, tuple[int, ...]]:
    D, q_out, kv_out = d.n_embd, d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    if d.arch == "phi3":  # [q; k; v] in one tensor
        return {"attn_qkv.weight": (q_out + 2 * kv_out, D), "attn_output.weight": (D, q_out)}
    t: dict[str, tuple[int, ...]] = {"attn_q.weight": (q_out, D), "attn_k.weight": (kv_out, D),
                                     "attn_v.weight": (kv_out, D)}
    if d.attn_bias:
        t.update({"attn_q.bias": (q_out,), "attn_k.bias": (kv_out,), "attn_v.bias": (kv_out,)})
    if d.qk_norm:
        t.update({"attn_q_norm.weight": (d.head_dim,), "attn_k_norm.weight": (d.head_dim,)})
    t["attn_output.weight"] = (D, q_out)
    if d.arch == "gpt-oss":  # the output bias and one sink per head
        t.update({"attn_output.bias": (D,), "attn_sinks.weight": (d.n_head,)})
    return t


def _mla_attention(d: TinyDims) -> dict[str, tuple[int, ...]]:
    D, H, L = d.n_embd, d.n_head, d.kv_lora_rank
    P, R, Vd = d.qk_nope, d.qk_rope, d.v_head_dim
    t: dict[str, tuple[int, ...]] = {}
    if d.q_lora_rank:
        t.update({"attn_q_a.weight": (d.q_lora_rank, D), "attn_q_a_norm.weight": (d.q_lora_rank,),
                  "attn_q_b.weight": (H * (P + R), d.q_lora_rank)})
    else:
        t["attn_q.weight"] = (H * (P + R), D)
    t.update({
        "attn_kv_a_mqa.weight": (L + R, D),  # [latent L ; k_pe R]
        "attn_kv_a_norm.weight": (L,),
    })
    if d.kv_b in ("fused", "both"):
        t["attn_kv_b.weight"] = (H * (P + Vd), L)  # HF kv_b_proj: per head P K rows, Vd V rows
    if d.kv_b in ("split", "both"):
        t["attn_k_b.weight"] = (H, L, P)  # kv_b's K rows per head, transposed
        t["attn_v_b.weight"] = (H, Vd, L)  # kv_b's V rows per head
    if d.kv_b not in ("split", "fused", "both"):
        raise GGUFCheckError(f"kv_b must be split, fused or both, got {d.kv_b!r}")
    t["attn_output.weight"] = (D, H * Vd)
    return t


def _indexer(d: TinyDims) -> dict[str, tuple[int, ...]]:
    Hi, Di = d.indexer_heads, d.indexer_dim
    return {"indexer.attn_q_b.weight": (Hi * Di, d.q_lora_rank),
            "indexer.attn_k.weight": (Di, d.n_embd),
            "indexer.k_norm.weight": (Di,), "indexer.k_norm.bias": (Di,),
            "indexer.proj.weight": (Hi, d.n_embd)}


def _dense_ffn(d: TinyDims) -> dict[str, tuple[int, ...]]:
    D, F = d.n_embd, d.n_ff
    if d.arch == "phi3":  # [gate; up] in ffn_up
        return {"ffn_up.weight": (2 * F, D), "ffn_down.weight": (D, F)}
    return {"ffn_gate.weight": (F, D), "ffn_up.weight": (F, D), "ffn_down.weight": (D, F)}


def _moe_ffn(d: TinyDims) -> dict[str, tuple[int, ...]]:
    D, E, Fe, Fs = d.n_embd, d.n_expert, d.n_ff_exp, d.n_ff_exp * d.n_expert_shared
    t: dict[str, tuple[int, ...]] = {
        "ffn_gate_inp.weight": (E, D), **({"exp_probs_b.bias": (E,)} if d.arch in _BIASED_ROUTER_ARCHS else {}),
        "ffn_gate_exps.weight": (E, Fe, D), "ffn_up_exps.weight": (E, Fe, D),
        "ffn_down_exps.weight": (E, D, Fe),
    }
    if d.n_expert_shared:
        t.update({"ffn_gate_shexp.weight": (Fs, D), "ffn_up_shexp.weight": (Fs, D),
                  "ffn_down_shexp.weight": (D, Fs)})
    if d.arch == "gpt-oss":  # a biased router and biased experts
        t.update({"ffn_gate_inp.bias": (E,), "ffn_gate_exps.bias": (E, Fe), "ffn_up_exps.bias": (E, Fe),
                  "ffn_down_exps.bias": (E, D)})
    return t


def tensor_role(name: str) -> str:
    """A tensor's name without ``blk.N.`` and ``.weight``: ``attn_k_b``, ``attn_q.bias``."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2:
        parts = parts[2:]
    if parts[-1] == "weight":
        parts = parts[:-1]
    return ".".join(parts)


# ---------------------------------------------------------------------------------------
# metadata


def metadata(d: TinyDims, file_type: int | None = None) -> dict[str, tuple[Any, T]]:
    """The model's GGUF key/values (without tokenizer): key -> (value, value type).

    The keys and their types are those llama.cpp's converter writes for the arch
    (checked against converted files by tests/testing/).
    """
    a = d.arch
    kv: dict[str, tuple[Any, T]] = {
        "general.architecture": (a, T.STRING),
        "general.type": ("model", T.STRING),
        # (not "phi3": llama.cpp then requires <s>, </s>, <unk> in the vocabulary, llama-vocab.cpp)
        "general.name": (f"ggufcheck tiny {a.replace('phi3', 'phi 3')}", T.STRING),
        f"{a}.block_count": (d.block_count, T.UINT32),
        f"{a}.context_length": (d.context_length, T.UINT32),
        f"{a}.embedding_length": (d.n_embd, T.UINT32),
        f"{a}.feed_forward_length": (d.n_ff, T.UINT32),
        f"{a}.attention.head_count": (d.n_head, T.UINT32),
        f"{a}.rope.freq_base": (d.rope_base, T.FLOAT32),
        f"{a}.attention.layer_norm_rms_epsilon": (d.rms_eps, T.FLOAT32),
    }
    # Written only where llama.cpp's converter writes them (readers must apply defaults:
    # qwen2 has no key_length / rope.dimension_count, qwen2/3 and glm4moe no vocab_size).
    if a in ("llama", *_MLA_ARCHS):
        kv[f"{a}.vocab_size"] = (d.n_vocab, T.UINT32)
    if a in ("llama", "glm4moe", "phi3", *_MLA_ARCHS):
        kv[f"{a}.rope.dimension_count"] = (d.rot, T.UINT32)
    if a == "phi3":  # its converter: the original context, and a window (0 = none)
        kv[f"{a}.rope.scaling.original_context_length"] = (d.context_length, T.UINT32)
        kv[f"{a}.attention.sliding_window"] = (d.swa_window, T.UINT32)
    if a in _MLA_ARCHS and d.kv_b == "fused":  # legacy files: the MHA view, no *_mla keys
        kv.update({
            f"{a}.attention.head_count_kv": (d.n_head, T.UINT32),
            f"{a}.attention.key_length": (d.qk_nope + d.qk_rope, T.UINT32),
            f"{a}.attention.value_length": (d.v_head_dim, T.UINT32),
            f"{a}.attention.kv_lora_rank": (d.kv_lora_rank, T.UINT32),
        })
        if d.q_lora_rank:
            kv[f"{a}.attention.q_lora_rank"] = (d.q_lora_rank, T.UINT32)
    elif a in _MLA_ARCHS:  # MLA, written as MQA with one big kv head + the *_mla keys
        kv.update({
            f"{a}.attention.head_count_kv": (1, T.UINT32),
            f"{a}.attention.key_length": (d.kv_lora_rank + d.qk_rope, T.UINT32),
            f"{a}.attention.value_length": (d.kv_lora_rank, T.UINT32),
            f"{a}.attention.kv_lora_rank": (d.kv_lora_rank, T.UINT32),
            f"{a}.attention.key_length_mla": (d.qk_nope + d.qk_rope, T.UINT32),
            f"{a}.attention.value_length_mla": (d.v_head_dim, T.UINT32),
        })
        if d.q_lora_rank:
            kv[f"{a}.attention.q_lora_rank"] = (d.q_lora_rank, T.UINT32)
    else:
        kv[f"{a}.attention.head_count_kv"] = (d.n_head_kv, T.UINT32)
        if a not in ("qwen2", "phi3"):
            kv.update({
                f"{a}.attention.key_length": (d.head_dim, T.UINT32),
                f"{a}.attention.value_length": (d.head_dim, T.UINT32),
            })
    if a in _MOE_ARCHS:
        kv.update({
            f"{a}.expert_count": (d.n_expert, T.UINT32),
            f"{a}.expert_used_count": (d.n_expert_used, T.UINT32),
            f"{a}.expert_feed_forward_length": (d.n_ff_exp, T.UINT32),
        })
        if a in _BIASED_ROUTER_ARCHS:  # the DeepSeek-V3-style router's keys (qwen3moe's converter writes none)
            kv.update({
                f"{a}.expert_group_count": (d.n_group, T.UINT32),
                f"{a}.expert_group_used_count": (d.n_group_used, T.UINT32),
                f"{a}.expert_shared_count": (d.n_expert_shared, T.UINT32),
                f"{a}.leading_dense_block_count": (d.n_dense_lead, T.UINT32),
                f"{a}.expert_weights_scale": (d.expert_weights_scale, T.FLOAT32),
            })
        if d.gating_func is not None:
            kv[f"{a}.expert_gating_func"] = (d.gating_func, T.UINT32)
        if d.expert_weights_norm:
            kv[f"{a}.expert_weights_norm"] = (True, T.BOOL)
        if a == "glm4moe" or d.n_nextn:
            kv[f"{a}.nextn_predict_layers"] = (d.n_nextn, T.UINT32)
    if d.yarn_factor:
        kv.update({
            f"{a}.rope.scaling.type": ("yarn", T.STRING),
            f"{a}.rope.scaling.factor": (d.yarn_factor, T.FLOAT32),
            f"{a}.rope.scaling.original_context_length": (d.yarn_orig_ctx, T.UINT32),
            f"{a}.rope.scaling.yarn_beta_fast": (32.0, T.FLOAT32),
            f"{a}.rope.scaling.yarn_beta_slow": (1.0, T.FLOAT32),
        })
        if d.yarn_log_mul:  # deepseek2's converter writes it; gpt-oss's does not
            kv[f"{a}.rope.scaling.yarn_log_multiplier"] = (d.yarn_log_mul, T.FLOAT32)
    if d.swa_window and a != "phi3":  # and gemma3's local rope base, as the converter writes it
        kv[f"{a}.attention.sliding_window"] = (d.swa_window, T.UINT32)
        if a in _GEMMA_ARCHS:
            kv[f"{a}.rope.freq_base_swa"] = (10000.0, T.FLOAT32)
    if a == "glm-dsa":
        types = d.indexer_types if d.indexer_types is not None else (True,) * d.n_layer
        kv.update({
            f"{a}.attention.indexer.head_count": (d.indexer_heads, T.UINT32),
            f"{a}.attention.indexer.key_length": (d.indexer_dim, T.UINT32),
            f"{a}.attention.indexer.top_k": (d.indexer_top_k, T.UINT32),
            f"{a}.attention.indexer.types": (list(types), T.ARRAY),  # not in gguf 0.19 constants
        })
    if file_type is not None:
        kv["general.file_type"] = (file_type, T.UINT32)
    kv["general.quantization_version"] = (gguf.GGML_QUANT_VERSION, T.UINT32)
    return kv


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
_MERGE_LEVELS = 4  # 702 + 18,252 + 474,552 + ... merges: past every real vocabulary


def _merge_pairs(n: int) -> list[tuple[str, str]]:
    """The first ``n`` merges (left, right), level by level: level 1 joins ``Ġ`` or a letter
    with a letter; level k joins each level k-1 token with a letter."""
    level = [(x, y) for x in "Ġ" + _LETTERS for y in _LETTERS]
    out: list[tuple[str, str]] = []
    for _ in range(_MERGE_LEVELS):
        out.extend(level[: n - len(out)])
        if len(out) >= n:
            break
        level = [(x + y, z) for x, y in level for z in _LETTERS]
    return out


def tokenizer_metadata(n_vocab: int) -> dict[str, tuple[Any, T]]:
    """A byte-level BPE ("gpt2") vocabulary of ``n_vocab`` tokens llama.cpp can load.

    256 byte tokens, then merges, then one control token ``<|endoftext|>`` (BOS = EOS) as the
    last id. The merges come in levels: two-character merges of common letters first
    (``Ġ`` = space: ``Ġt``, ``th``, ...), then each earlier token extended by one letter
    (``Ġth`` + ``e``), so any size up to ~490,000 is a valid BPE whose merged tokens exist
    (GLM-5's 154,880 included); vocabularies of up to 959 tokens are as they always were.
    """
    if n_vocab < 258:
        raise GGUFCheckError(f"n_vocab must be >= 258 for the byte-level vocabulary, got {n_vocab}")
    byte_chars = _bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)]
    n_merges = n_vocab - 257
    pairs = _merge_pairs(n_merges)
    if n_merges > len(pairs):
        raise GGUFCheckError(f"n_vocab must be <= {257 + len(pairs)} for the built-in vocabulary")
    merges = [f"{x} {y}" for x, y in pairs]
    tokens += [x + y for x, y in pairs]
    tokens.append("<|endoftext|>")
    types = [int(gguf.TokenType.NORMAL)] * (len(tokens) - 1) + [int(gguf.TokenType.CONTROL)]
    eot = len(tokens) - 1
    return {
        "tokenizer.ggml.model": ("gpt2", T.STRING),
        "tokenizer.ggml.pre": ("default", T.STRING),
        "tokenizer.ggml.tokens": (tokens, T.ARRAY),
        "tokenizer.ggml.token_type": (types, T.ARRAY),
        "tokenizer.ggml.merges": (merges, T.ARRAY),
        "tokenizer.ggml.bos_token_id": (eot, T.UINT32),
        "tokenizer.ggml.eos_token_id": (eot, T.UINT32),
    }


# ---------------------------------------------------------------------------------------
# weights and encoding


def random_tensor(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """One tensor of :func:`random_weights`, seeded by (seed, name): streaming builders call it per tensor."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    x = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith(".bias"):
        x *= 0.1
    elif len(shape) == 1:
        x = 1.0 + 0.1 * x
    else:  # the contracted (input) dim is the last one, except k_b [H, L, P]: L
        fan_in = shape[1] if name.endswith("attn_k_b.weight") else shape[-1]
        x *= np.float32(1.0 / np.sqrt(fan_in))
    return x


def random_weights(d: TinyDims, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights for every tensor (numpy shapes), deterministic per (seed, name).

    Matrices ~ N(0, 1/in_features) so activations stay O(1); norm weights 1 + 0.1 N(0,1);
    biases and the router's ``exp_probs_b`` 0.1 N(0,1) (nonzero, so mistakes show).
    Each tensor has its own generator, so adding or removing one changes no other.
    A fused attn_kv_b (``kv_b="fused"`` or ``"both"``) is built from the attn_k_b / attn_v_b
    of the same seed (``cat([k_b.transpose(0, 2, 1), v_b], 1).reshape(H*(P+Vd), L)``): split
    and fused files of one seed are the same model.
    """
    wanted = tensor_shapes(d)
    generate = tensor_shapes(dataclasses.replace(d, kv_b="both")) if d.kv_b == "fused" else wanted
    out = {}
    for name, shape in generate.items():
        out[name] = random_tensor(name, shape, seed)
    for name in list(out):
        if name.endswith("attn_kv_b.weight") and name.replace("kv_b", "k_b") in out:
            k_b, v_b = out[name.replace("kv_b", "k_b")], out[name.replace("kv_b", "v_b")]
            kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [H, P+Vd, L]
            out[name] = np.ascontiguousarray(kv.reshape(-1, kv.shape[-1]))  # [H*(P+Vd), L]
    return {name: out[name] for name in wanted}


def resolve_qtypes(names_shapes: dict[str, tuple[int, ...]],
                   qtypes: str | Q | dict[str, str | Q]) -> tuple[dict[str, Q], list[str]]:
    """Pick each tensor's quant type; returns (name -> type, names that fell back).

    ``qtypes`` is one type for all, or a dict keyed by full tensor name, by role (see
    :func:`tensor_role`, e.g. ``"attn_k_b"``, ``"token_embd"``) or ``"default"``; a full name
    wins over a role, a role over the default. 1-D tensors and biases are F32 unless named
    explicitly (as the converter does). A tensor whose row length is not a multiple of the chosen
    type's block size falls back to F16 (its name is listed in the second result).
    """
    table = qtypes if isinstance(qtypes, dict) else {"default": qtypes}
    table = {k: _qtype(v) for k, v in table.items()}
    default = table.get("default", Q.F32)
    chosen, fallbacks = {}, []
    for name, shape in names_shapes.items():
        role = tensor_role(name)
        if name in table:
            qt = table[name]
        elif role in table:
            qt = table[role]
        else:
            # 1-D tensors and biases stay F32, as the converter writes them (llama.cpp's CPU
            # add_id, gpt-oss's expert-bias add, asserts an F32 bias)
            qt = Q.F32 if len(shape) == 1 or name.endswith(".bias") else default
        if shape[-1] % qblocks.block_size(qt):
            fallbacks.append(name)
            qt = Q.F16 if shape[-1] % qblocks.block_size(Q.F16) == 0 else Q.F32
        chosen[name] = qt
    return chosen, fallbacks


def _qtype(value: str | Q) -> Q:
    if isinstance(value, Q):
        return value
    try:
        return Q[str(value).upper()]
    except KeyError:
        raise GGUFCheckError(f"unknown quant type {value!r}") from None


def encode(x: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Encode float32 ``x`` as ``qtype`` data for GGUFWriter.add_tensor(raw_dtype=qtype).

    F32 -> float32, F16 -> float16; types gguf-py can quantize -> its bytes; any other
    quant type -> random valid blocks from ``rng`` with ``x``'s standard deviation (the values
    of ``x`` are then not represented: dequantize the file to get the weights). The spread
    matters: random bytes alone give weights 1000x apart from type to type, and a model whose
    activations explode is too ill-conditioned to tell one kernel from another.
    """
    if qtype == Q.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if qtype == Q.F16:
        return x.astype(np.float16)
    try:
        return gguf.quants.quantize(x, qtype)
    except NotImplementedError:
        n_rows = int(np.prod(x.shape[:-1]))
        blocks = qblocks.random_blocks(rng, n_rows, x.shape[-1], qtype)
        want = float(np.std(x)) if x.size else 0.0
        if qtype in qblocks.F16_SCALE_OFFSETS and want > 0:
            got = float(np.std(gguf.quants.dequantize(blocks, qtype)))
            if got > 0:
                blocks = qblocks.scale_blocks(blocks, qtype, want / got)
        return blocks.reshape(*x.shape[:-1], blocks.shape[-1])


# ---------------------------------------------------------------------------------------
# building


@dataclass
class TinyPlan:
    """Everything about to be written, open to a patch hook (fault injection).

    ``metadata``: key -> (value, GGUFValueType), in file order; ``weights``: float32 arrays
    (numpy shapes) in file order; ``qtypes``: name -> type. After encoding, ``data`` holds
    name -> (array for GGUFWriter, qtype) and ``shapes`` name -> declared numpy shape.
    """

    dims: TinyDims
    metadata: dict[str, tuple[Any, T]]
    weights: dict[str, np.ndarray]
    qtypes: dict[str, Q]
    data: dict[str, tuple[np.ndarray, Q]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class TinyGGUF:
    """A built tiny GGUF: its file(s), the dims, the type of every tensor."""

    path: Path  # the (first) file
    paths: tuple[Path, ...]  # all parts of a split model (just ``path`` otherwise)
    dims: TinyDims
    qtypes: dict[str, Q]  # actual type of every tensor
    fallbacks: tuple[str, ...]  # tensors that could not take the requested type
    random_block_tensors: tuple[str, ...]  # tensors written as random blocks (no quantizer)
    seed: int


Patch = Callable[[TinyPlan], None]


def draftable_nextn(plan: TinyPlan) -> None:
    """A patch: a model whose NextN / MTP head drafts exactly what its trunk will choose.

    Random weights give a head whose drafts the trunk almost never accepts, on the engine and
    on the reference alike, so an acceptance rate measured on them cannot tell a broken head
    from a healthy one. Here every block's output projection is scaled to 1e-4 (attention
    output, FFN / expert / shared-expert down), in the trunk and in the NextN block: the residual
    stream is the token's embedding (to ~1e-4), the trunk's choice after token x is g(x) = argmax(output @
    (output_norm * rms(embed(x)))), and the trunk's greedy sequence is x -> g(x) -> g(g(x)).
    The head's ``eh_proj`` is [I | 1e-4 W] over [token ; state] and its
    norms equal the trunk's final norm (enorm ones, shared_head_norm = output_norm), so the
    head fed token x drafts g(x) as well: a correct engine's drafts are all accepted, and a
    head that reads the wrong half, the wrong state or the wrong token is rejected."""
    d, w = plan.dims, plan.weights
    if not d.n_nextn:
        raise GGUFCheckError("draftable_nextn needs a NextN layer (n_nextn=1)")
    # not exactly zero: a tensor of zeros is what the file's health scan flags (a weight never
    # written); 1e-4 of the random values leaves each block's output ~1e-4 of the residual
    quiet = ("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight",
             "ffn_down_exps.bias", "attn_output.bias")
    for name in w:
        if name.startswith("blk.") and name.split(".", 2)[2] in quiet:
            w[name] = w[name] * np.float32(1e-4)
    for i in range(d.n_layer, d.block_count):
        eh = w[f"blk.{i}.nextn.eh_proj.weight"] * np.float32(1e-4)  # [D, 2D]: output rows, input columns
        eh[:, : d.n_embd] = np.eye(d.n_embd, dtype=eh.dtype)
        w[f"blk.{i}.nextn.eh_proj.weight"] = eh
        w[f"blk.{i}.nextn.enorm.weight"] = np.ones_like(w[f"blk.{i}.nextn.enorm.weight"])
        w[f"blk.{i}.nextn.shared_head_norm.weight"] = w["output_norm.weight"].copy()


def plan_tiny(arch: str | TinyDims, *, qtypes: str | Q | dict[str, str | Q] = "F32", seed: int = 0,
              patch: Patch | None = None, patch_encoded: Patch | None = None,
              **dims: Any) -> tuple[TinyPlan, list[str], list[str]]:
    """Plan a tiny model and encode it (no file written): (plan, fallbacks, random-block names)."""
    d = arch if isinstance(arch, TinyDims) else tiny_dims(arch, **dims)
    weights = random_weights(d, seed)
    chosen, fallbacks = resolve_qtypes({k: v.shape for k, v in weights.items()}, qtypes)
    file_type = _file_type(chosen)
    kv = metadata(d, file_type) | tokenizer_metadata(d.n_vocab)
    plan = TinyPlan(dims=d, metadata=kv, weights=weights, qtypes=chosen)
    if patch is not None:
        patch(plan)
    random_named = []
    for name, x in plan.weights.items():
        qt = plan.qtypes[name]
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), 1])
        arr = encode(x, qt, rng)
        if qt not in qblocks.FLOAT_TYPES and _needs_random(qt):
            random_named.append(name)
        plan.data[name] = (arr, qt)
        plan.shapes[name] = tuple(x.shape)
    if patch_encoded is not None:
        patch_encoded(plan)
    return plan, fallbacks, random_named


def build_tiny_gguf(arch: str | TinyDims, path: str | Path, *,
                    qtypes: str | Q | dict[str, str | Q] = "F32", seed: int = 0,
                    patch: Patch | None = None, patch_encoded: Patch | None = None,
                    **dims: Any) -> TinyGGUF:
    """Write a tiny random GGUF of ``arch`` (llama, qwen2, qwen3, gemma3, qwen3moe, gpt-oss, glm4moe, deepseek2,
    glm-dsa).

    ``dims`` override :data:`DEFAULT_DIMS` fields (e.g. ``n_nextn=1``, ``yarn_factor=4.0``,
    ``indexer_types=(True, False, False)``, ``n_embd=256`` for K-quants); or pass a
    :class:`TinyDims`. ``qtypes``: see :func:`resolve_qtypes`. ``patch(plan)`` may edit
    metadata, weights and types before encoding; ``patch_encoded(plan)`` may edit the
    encoded data and declared shapes. Same arguments -> identical bytes.
    """
    plan, fallbacks, random_named = plan_tiny(arch, qtypes=qtypes, seed=seed, patch=patch,
                                              patch_encoded=patch_encoded, **dims)
    out = Path(path)
    _write(out, plan.dims.arch, plan.metadata, plan.data, plan.shapes, list(plan.data))
    return TinyGGUF(path=out, paths=(out,), dims=plan.dims, qtypes=dict(plan.qtypes),
                    fallbacks=tuple(fallbacks), random_block_tensors=tuple(random_named), seed=seed)


def split_path(prefix: str | Path, split_no: int, split_count: int) -> Path:
    """llama.cpp's split file name: ``{prefix}-{no:05d}-of-{count:05d}.gguf`` (no is 1-based)."""
    return Path(f"{prefix}-{split_no:05d}-of-{split_count:05d}.gguf")


def build_tiny_split(arch: str | TinyDims, prefix: str | Path, n_split: int = 2, *,
                     qtypes: str | Q | dict[str, str | Q] = "F32", seed: int = 0,
                     patch: Patch | None = None, patch_encoded: Patch | None = None,
                     **dims: Any) -> TinyGGUF:
    """Write a tiny model as ``n_split`` files the way llama.cpp's gguf-split does.

    Files ``{prefix}-0000k-of-0000N.gguf``; all metadata in the first file only; every file
    has ``split.no`` (uint16, 0-based), ``split.count`` (uint16) and ``split.tensors.count``
    (int32, total over all files); tensors spread in file order, as evenly as possible by
    count, every part non-empty. Returns the first path as ``path`` and all in ``paths``.
    """
    plan, fallbacks, random_named = plan_tiny(arch, qtypes=qtypes, seed=seed, patch=patch,
                                              patch_encoded=patch_encoded, **dims)
    names = list(plan.data)
    if not 1 <= n_split <= len(names):
        raise GGUFCheckError(f"n_split must be in 1..{len(names)}, got {n_split}")
    bounds = np.linspace(0, len(names), n_split + 1).round().astype(int)
    paths = []
    for k in range(n_split):
        part = names[bounds[k]:bounds[k + 1]]
        kv = dict(plan.metadata) if k == 0 else {}
        kv |= {"split.no": (k, T.UINT16), "split.count": (n_split, T.UINT16),
               "split.tensors.count": (len(names), T.INT32)}
        p = split_path(prefix, k + 1, n_split)
        _write(p, plan.dims.arch, kv, plan.data, plan.shapes, part)
        paths.append(p)
    return TinyGGUF(path=paths[0], paths=tuple(paths), dims=plan.dims, qtypes=dict(plan.qtypes),
                    fallbacks=tuple(fallbacks), random_block_tensors=tuple(random_named), seed=seed)


def _write(path: Path, arch: str, kv: dict[str, tuple[Any, T]],
           data: dict[str, tuple[np.ndarray, Q]], shapes: dict[str, tuple[int, ...]],
           names: list[str]) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.kv_data[0].clear()  # drop the automatic general.architecture: kv says it all
    # (gguf-split writes only split.* keys into parts after the first: no architecture)
    for key, (value, vtype) in kv.items():
        if vtype == T.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    for name in names:
        arr, qt = data[name]
        writer.add_tensor(name, arr, raw_shape=_byte_shape(shapes[name], qt, arr), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _byte_shape(shape: tuple[int, ...], qt: Q, arr: np.ndarray) -> tuple[int, ...]:
    """The raw_shape GGUFWriter expects: byte shape for uint8 data, element shape otherwise."""
    if arr.dtype != np.uint8:
        return tuple(shape)
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    return (*shape[:-1], shape[-1] // bs * ts)


def _needs_random(qt: Q) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, qblocks.block_size(qt)), np.float32), qt)
        return False
    except NotImplementedError:
        return True


_FILE_TYPES = {Q.F32: 0, Q.F16: 1, Q.Q4_0: 2, Q.Q4_1: 3, Q.Q8_0: 7, Q.Q5_0: 8, Q.Q5_1: 9,
               Q.Q2_K: 10, Q.Q3_K: 12, Q.Q4_K: 15, Q.Q5_K: 17, Q.Q6_K: 18, Q.BF16: 32}


def _file_type(chosen: dict[str, Q]) -> int | None:
    """general.file_type from the most common type of the 2-D+ tensors (llama_ftype)."""
    counts: dict[Q, int] = {}
    for qt in chosen.values():
        counts[qt] = counts.get(qt, 0) + 1
    main = max(counts, key=lambda q: (q != Q.F32, counts[q]))
    return _FILE_TYPES.get(main)
