"""``--engine SPEC`` strings -> an open Engine.

    reference[:fp32|fp64]        ggufcheck's reference model over MODEL.gguf
    hf[:fp32|bf16|fp16|fp64][@cpu|@cuda[:N]]
                                 transformers model rebuilt from MODEL.gguf by ggufcheck
    hf-gguf[:fp32|bf16|fp16|fp64][@cpu|@cuda[:N]]
                                 transformers' own GGUF loader and modeling code (needs
                                 accelerate): independent of ggufcheck's tables and reference
    llama-cpp[:key=value,...]    llama.cpp in process (n_ctx=, n_threads=, n_batch=, seed=,
                                 type_k=/type_v= KV-cache ggml types: 0 F32, 1 F16 default,
                                 8 Q8_0; flash_attn=0|1; n_gpu_layers=N offloads N layers
                                 (99: all) to a GPU build named by LLAMA_CPP_LIB_PATH, in a
                                 process of its own (isolate=1; CUDA llama.cpp and torch
                                 crash in one process); verbose=1: llama.cpp's own log)
    vllm[:tp=N,dtype=fp32|bf16|fp16,max_model_len=N,kv_cache_gib=N]
                                 the real vLLM (GGUF plug-in) in its own interpreter
                                 (python=; --python PATH), every TP rank reachable
    http://HOST:PORT[/v1][?kind=vllm|llama-cpp-python|llama-server][&backend=cuda]
    python:MODULE:FACTORY        a user's own engine: FACTORY(model_path) -> Engine

Heavy libraries are imported only by the adapter a spec names.
"""

from __future__ import annotations

from pathlib import Path

from ggufcheck.engines.base import Engine
from ggufcheck.errors import UsageError

SPEC_HELP = ("reference[:fp32], hf[:bf16][@cuda], hf-gguf[:fp32] (transformers' own GGUF loader), llama-cpp[:n_ctx=N,n_gpu_layers=N], vllm[:tp=N,dtype=D,max_model_len=N], "
             "http://HOST:PORT[/v1], python:MODULE:FACTORY")


def _options(text: str, spec: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise UsageError(f"--engine {spec}: bad option {item!r}", tip="options are key=INTEGER, comma-separated")
        out[key] = int(value)
    return out


def open_engine(spec: str, model_path: str | Path | None, **kwargs) -> Engine:
    """Open the engine ``spec`` names, for the model at ``model_path``."""
    head, _, rest = spec.partition(":")
    if spec.startswith("hf@"):  # hf@cuda: the default dtype on a device
        head, rest = "hf", spec[2:]
    if spec.startswith("hf-gguf@"):
        head, rest = "hf-gguf", spec[len("hf-gguf"):]
    if spec.startswith(("http://", "https://")):
        from ggufcheck.engines.http import HttpEngine, HttpOptions

        try:
            return HttpEngine(spec, model_path=model_path, options=kwargs.pop("http_options", HttpOptions()))
        except ValueError as err:
            raise UsageError(f"--engine {spec}: {err}") from err
    if head == "python":
        from ggufcheck.engines.plugin import load_plugin

        return load_plugin(rest, model_path)
    if model_path is None:
        raise UsageError(f"--engine {spec} needs the model file")
    if head == "llama-cpp":
        from ggufcheck.engines.llama_cpp import LlamaCppEngine

        # type_k/v: ggml type of the KV cache (0 F32, 1 F16 default, 8 Q8_0); flash_attn: 0/1
        allowed = {"n_ctx", "n_threads", "n_batch", "seed", "type_k", "type_v", "flash_attn", "n_gpu_layers",
                   "main_gpu", "isolate", "verbose"}
        opts = _options(rest, spec)
        unknown = set(opts) - allowed
        if unknown:
            raise UsageError(f"--engine {spec}: unknown option(s) {', '.join(sorted(unknown))}",
                             tip=f"known: {', '.join(sorted(allowed))}")
        # a GPU build of llama.cpp cannot share a process with torch (engines.isolated):
        # offloading runs it in a process of its own; isolate=0|1 overrides
        python = kwargs.pop("python", None)  # --python: the interpreter whose llama_cpp runs it (isolated)
        isolate = opts.pop("isolate", 1 if (opts.get("n_gpu_layers") or python) else 0)
        if isolate:
            from ggufcheck.engines.isolated import IsolatedEngine

            return IsolatedEngine("ggufcheck.engines.llama_cpp:LlamaCppEngine", model_path, preload=("llama_cpp",),
                                  python=python, **{**kwargs, **opts})
        return LlamaCppEngine(model_path, **{**kwargs, **opts})
    if head == "vllm":
        from ggufcheck.engines.vllm import VllmEngine, parse_options

        return VllmEngine(model_path, parse_options(rest, spec), python=kwargs.get("python"))
    if head == "reference":
        from ggufcheck.engines.reference import ReferenceEngine

        dtype = rest or "fp64"
        if dtype not in ("fp32", "fp64"):
            raise UsageError(f"--engine {spec}: the reference computes in fp32 or fp64")
        return ReferenceEngine(model_path, dtype=dtype, **kwargs)
    if head in ("hf", "hf-gguf"):
        from ggufcheck.engines.hf import HFEngine

        dtype, _, device = rest.partition("@")
        dtype = dtype or "fp32"
        if dtype not in ("fp32", "fp64", "bf16", "fp16"):
            raise UsageError(f"--engine {spec}: dtype must be fp32, fp64, bf16 or fp16")
        device = device or "cpu"
        index = device.partition(":")[2] if device.startswith("cuda:") else ""
        if device not in ("cpu", "cuda") and not (device.startswith("cuda:") and index.isdigit()):
            raise UsageError(f"--engine {spec}: device must be cpu, cuda or cuda:N", tip="e.g. hf:bf16@cuda:0")
        if head == "hf-gguf":
            return HFEngine.from_transformers_gguf(model_path, dtype=dtype, device=device)
        return HFEngine.from_gguf(model_path, dtype=dtype, device=device)
    raise UsageError(f"--engine {spec}: unknown engine", tip=f"one of: {SPEC_HELP}")
