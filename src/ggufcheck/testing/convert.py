"""Tiny random transformers models, converted to GGUF by llama.cpp's OWN converter.

This is one of two independent producers of test GGUFs (the other is
:mod:`ggufcheck.synthetic.tiny`, which writes files directly). Files made here carry the
authority of llama.cpp's ``convert_hf_to_gguf.py``: tensor names, shapes, the kv_b split,
the llama q/k permutation and the metadata keys are whatever llama.cpp writes, so tests
that compare ggufcheck's tables and HF rebuild against these files check ggufcheck against
llama.cpp and transformers, not against itself.

The converter comes from the llama-cpp-python 0.3.36 source distribution (it vendors
llama.cpp). It runs in a subprocess (``_convert_script.py``) because it needs its own
vendored gguf-py. Tiny models have no tokenizer, so the SmolLM2 GGUF's vocabulary (49152
tokens) is copied in; hence ``vocab_size = 49152`` in every config below.

Built models are cached by (arch, outtype, seed, BUILD_VERSION); concurrent processes are
serialized by a lock file and publish results by atomic rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufcheck.errors import GGUFCheckError, Unavailable
from ggufcheck.testing.models import cache_dir as _default_cache_dir
from ggufcheck.testing.models import smollm2_path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# Part of every cache key, with a fingerprint of the arch's config (so editing a config
# below invalidates its cached files by itself). Bump when the build procedure changes.
BUILD_VERSION = "2"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
VOCAB_SIZE = 49152  # SmolLM2's vocabulary, copied into every converted file

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, max_position_embeddings=512,
               tie_word_embeddings=False)
_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True)
# MLA dims all distinct (P 16, R 8, V 48, L 32, q_lora 128; H*(P+R) = 96, H*V = 192), so a
# swapped or mis-split dimension changes a shape instead of passing unnoticed.
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=128,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=48)

# arch -> (transformers config class, model class, config kwargs). Data, not code.
HF_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # GQA 4/2, NORM rope after the converter's q/k permutation.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        **_COMMON, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)),
    # GQA 4/2; Qwen2 always has q/k/v biases.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        **_COMMON, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)),
    # GQA 4/2 with head_dim 32 != hidden/heads (16), q/k norms.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        **_COMMON, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32)),
    # Phi-3: q/k/v fused (qkv_proj) and gate/up fused (gate_up_proj), GQA 4/2, no sliding
    # window (llama.cpp switches Phi SWA off: with one, the two differ past the window).
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        **_COMMON, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "original_max_position_embeddings": 512})),
    # Gemma 3 text: GQA 4/2, head_dim 32, q/k norms, sandwich norms, GeGLU, tied output;
    # 6 layers = the default pattern's 5 sliding-window layers and 1 global; a window of 8
    # so prompts cross it. query_pre_attn_scalar = head_dim, the q scale llama.cpp applies to
    # every size but 27B (transformers' default 256 would be a different model).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, max_position_embeddings=512, tie_word_embeddings=True,
        intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8, rms_norm_eps=1e-6)),
    # Qwen3 MoE: qwen3's attention (head_dim 32, q/k norms), every layer MoE with 8 experts,
    # 2 used, softmax router with renormalized weights (what llama.cpp computes for qwen3moe).
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        **_COMMON, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1)),
    # gpt-oss: GQA 4/2 with q/k/v/o biases and per-head attention sinks, sliding window 8 on the
    # even layers, YaRN (factor 4 over 128), 8 experts (2 used) with biases and the clamped
    # SwiGLU, a router with a bias whose weights are a softmax over the chosen logits.
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        **_COMMON, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0})),
    # GQA 4/2, head_dim 32 != hidden/heads (as GLM-4.5), attention bias, q/k norm,
    # partial rotary 0.5, layer 0 dense, no NextN layer.
    "glm4moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        **_COMMON, **_MOE, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True,
        num_nextn_predict_layers=0, n_group=1, topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})),
    # DeepSeek-V3 style MLA with q_lora, sigmoid router with bias, 2 groups (1 used).
    "deepseek2": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        **_COMMON, **_MOE, **_MLA, intermediate_size=128, num_hidden_layers=3, n_group=2,
        topk_group=1, num_nextn_predict_layers=0, scoring_func="sigmoid",
        topk_method="noaux_tc")),
    # As deepseek2, with YaRN rope scaling (factor 4 over an original context of 128).
    "deepseek2-yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        **_COMMON, **_MOE, **_MLA, intermediate_size=128, num_hidden_layers=3, n_group=2,
        topk_group=1, num_nextn_predict_layers=0, scoring_func="sigmoid",
        topk_method="noaux_tc",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # GLM-5: exactly /work/shared/examples/tiny_glm_dsa_hf.py (index_head_dim must be a
    # multiple of 64 for llama.cpp's Hadamard rotation; index_topk 8 so prompts > 8 tokens
    # exercise the sparse indexer).
    "glm-dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=32, index_topk=8, index_head_dim=64, index_n_heads=16,
        max_position_embeddings=512)),
}
ARCHS = tuple(HF_CONFIGS)


@dataclass(frozen=True)
class TinyModel:
    """A converted tiny model: the HF directory (config + safetensors) and its GGUF."""

    arch: str  # the key of HF_CONFIGS ("deepseek2-yarn" is GGUF arch deepseek2)
    hf_dir: Path
    gguf_path: Path


# ---------------------------------------------------------------------------------------
# llama.cpp source


def llama_cpp_source() -> Path:
    """The vendored llama.cpp directory of the llama-cpp-python 0.3.36 sdist.

    Looked up in order: $GGUFCHECK_LLAMA_CPP_SRC; the cache dir ($GGUFCHECK_CACHE or
    ~/.cache/ggufcheck); else downloaded there with ``pip download --no-binary :all:`` and
    unpacked. Raises :class:`Unavailable` (with the reason) if none of this works.
    """
    env = os.environ.get("GGUFCHECK_LLAMA_CPP_SRC")
    if env:
        path = Path(env)
        if not (path / "convert_hf_to_gguf.py").is_file():
            raise Unavailable(f"llama.cpp source unavailable: GGUFCHECK_LLAMA_CPP_SRC={env} "
                              "has no convert_hf_to_gguf.py")
        return path
    root = _default_cache_dir()
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    path = root / name / "vendor" / "llama.cpp"
    if (path / "convert_hf_to_gguf.py").is_file():
        return path
    with _lock(root / f"{name}.lock"):
        if (path / "convert_hf_to_gguf.py").is_file():  # another process got it meanwhile
            return path
        _download_sdist(root, name)
    return path


# What the converter needs from the sdist's vendor/llama.cpp (its script, model classes,
# vendored gguf-py).
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")


def _download_sdist(root: Path, name: str) -> None:
    with tempfile.TemporaryDirectory(dir=root, prefix=".dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"llama.cpp source unavailable: pip download failed: {exc}") from None
        tarball = Path(tmp) / f"{name}.tar.gz"
        if proc.returncode != 0 or not tarball.is_file():
            raise Unavailable("llama.cpp source unavailable: pip download failed: "
                              + _tail(proc.stderr or proc.stdout),
                              tip="set GGUFCHECK_LLAMA_CPP_SRC to an unpacked "
                                  f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist's vendor/llama.cpp")
        unpack = Path(tmp) / "unpacked"
        keep = [f"{name}/vendor/llama.cpp/{part}" for part in _CONVERTER_PARTS]
        try:
            with tarfile.open(tarball) as tar:  # only the converter: ~5 of the sdist's 217 MB
                members = [m for m in tar.getmembers() if any(m.name.startswith(k) for k in keep)]
                tar.extractall(unpack, members=members, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise Unavailable(f"llama.cpp source unavailable: cannot unpack {tarball.name}: {exc}") from None
        dest = root / name
        if dest.exists():  # a stale partial copy: replace it
            shutil.rmtree(dest)
        os.rename(unpack / name, dest)


# ---------------------------------------------------------------------------------------
# HF model


def build_hf_tiny(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build a tiny random transformers model for ``arch`` and save it into ``out_dir``.

    ``arch`` is a key of :data:`HF_CONFIGS` (llama, qwen2, qwen3, gemma3, qwen3moe, glm4moe, deepseek2,
    deepseek2-yarn, glm-dsa). Weights come from transformers' own initialization under
    ``torch.manual_seed(seed)``; then every 1-D parameter (norm weights, biases) is set to
    ``1 + 0.1 * randn`` and every router ``e_score_correction_bias`` to ``0.1 * randn``, so
    a mistake in handling them changes the output. Saved with ``save_pretrained``
    (config.json + model.safetensors, float32). Returns ``out_dir``.
    """
    if arch not in HF_CONFIGS:
        raise GGUFCheckError(f"unknown tiny arch {arch!r}; known: {', '.join(ARCHS)}")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise Unavailable(f"tiny HF models unavailable: {exc}", tip="pip install transformers") from None
    config_name, model_name, kwargs = HF_CONFIGS[arch]
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        raise Unavailable(f"tiny {arch} unavailable: transformers {transformers.__version__} "
                          f"has no {model_name}")
    out = Path(out_dir)
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms and biases away from their init values, so mistakes show
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
        if model_name.startswith("GptOss"):
            # biases small (an o_proj bias near 1 would be the same large vector in every token's
            # residual, and every token would route alike) and router logits O(1) per token, so
            # the tokens' own states decide the routing
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                elif name.endswith("router.weight"):
                    p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
                elif name.endswith("embed_tokens.weight"):  # tokens that differ by more than the biases
                    p.copy_(torch.randn_like(p))
        if model_name.startswith("Gemma3"):
            # Gemma's norms multiply by 1 + w and the converter stores fp32(1 + w): pick w so
            # that 1 + w is exact in fp32 (x - 1 is exact for x in [0.5, 2]), so the file holds
            # exactly the model's norm and fp64 comparisons are not limited by that rounding
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_((1 + 0.1 * torch.randn_like(p)).float().clamp(0.5, 1.5) - 1)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(out, safe_serialization=True)
    if model_name.startswith("Gemma3"):
        # llama.cpp's Gemma3Model trims token_embd to the tokenizer's size, read from
        # tokenizer.json when there is no tokenizer.model: state the whole vocabulary
        vocab = {f"<t{i}>": i for i in range(config.vocab_size)}
        (out / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    return out


# ---------------------------------------------------------------------------------------
# conversion


def convert_to_gguf(hf_dir: str | Path, out_path: str | Path, outtype: str = "f32") -> Path:
    """Convert ``hf_dir`` to ``out_path`` with llama.cpp's convert_hf_to_gguf.py.

    ``outtype`` is f32, f16, bf16 or q8_0 (the converter's ``--outtype``). Runs in a
    subprocess with the vendored gguf-py; the SmolLM2 GGUF provides the vocabulary.
    Raises :class:`Unavailable` when the converter or vocabulary is missing and
    :class:`GGUFCheckError` (with the converter's stderr tail) when conversion fails.
    """
    if outtype not in OUTTYPES:
        raise GGUFCheckError(f"unknown outtype {outtype!r}; known: {', '.join(OUTTYPES)}")
    llama_cpp = llama_cpp_source()
    vocab = smollm2_path()
    script = Path(__file__).with_name("_convert_script.py")
    out = Path(out_path)
    cmd = [sys.executable, str(script), str(llama_cpp), str(vocab), str(hf_dir), str(out), outtype]
    if "phi3" in Path(hf_dir).name:
        # llama.cpp sets token attributes by general.name: a "phi3" name requires <s>, </s> and
        # <unk> in the vocabulary (llama-vocab.cpp), which the copied byte-level one lacks
        cmd += ["--model-name", "ggufcheck-tiny"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GGUFCheckError(f"llama.cpp converter did not run on {hf_dir}: {exc}") from None
    if proc.returncode != 0 or not out.is_file():
        raise GGUFCheckError(f"llama.cpp converter failed on {hf_dir} (exit {proc.returncode}): "
                             + _tail(proc.stderr or proc.stdout))
    return out


def tiny_converted(arch: str, outtype: str = "f32", cache_dir: str | Path | None = None,
                   seed: int = 0) -> TinyModel:
    """A tiny random ``arch`` model and its llama.cpp conversion to ``outtype``, cached.

    Built on first call (HF model ~seconds, conversion ~10-20 s), then reused from
    ``cache_dir`` (default $GGUFCHECK_CACHE or ~/.cache/ggufcheck) under a key of
    (arch, outtype, seed, BUILD_VERSION). Safe when processes race: a per-key lock
    serializes builders and results are published by atomic rename. Treat the returned
    files as read-only: other tests share them.
    """
    if arch not in HF_CONFIGS:
        raise GGUFCheckError(f"unknown tiny arch {arch!r}; known: {', '.join(ARCHS)}")
    if outtype not in OUTTYPES:
        raise GGUFCheckError(f"unknown outtype {outtype!r}; known: {', '.join(OUTTYPES)}")
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    root = root / "tiny-converted"
    root.mkdir(parents=True, exist_ok=True)
    key = f"{arch}-s{seed}-v{BUILD_VERSION}-{_fingerprint(arch)}"
    hf_dir = root / f"{key}-hf"
    gguf_path = root / f"{key}-{outtype}.gguf"
    if not (hf_dir / "config.json").is_file():
        with _lock(root / f"{key}-hf.lock"):
            if not (hf_dir / "config.json").is_file():
                tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}-hf-"))
                try:
                    build_hf_tiny(arch, tmp, seed=seed)
                    os.rename(tmp, hf_dir)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    if not gguf_path.is_file():
        with _lock(root / f"{key}-{outtype}.lock"):
            if not gguf_path.is_file():
                fd, tmp_name = tempfile.mkstemp(dir=root, prefix=f".{key}-{outtype}-", suffix=".gguf")
                os.close(fd)
                try:
                    convert_to_gguf(hf_dir, tmp_name, outtype)
                    os.replace(tmp_name, gguf_path)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp_name)
    return TinyModel(arch=arch, hf_dir=hf_dir, gguf_path=gguf_path)


# ---------------------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def _lock(path: Path):
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fingerprint(arch: str) -> str:
    """8 hex digits identifying the arch's HF config (its class names and kwargs)."""
    text = json.dumps(HF_CONFIGS[arch], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join((text or "").strip().splitlines()[-lines:]) or "(no output)"
