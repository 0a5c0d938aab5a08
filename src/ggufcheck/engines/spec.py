"""``--engine SPEC`` strings -> an open Engine.

    reference[:fp32|fp64]        ggufcheck's reference model over MODEL.gguf
    hf[:fp32|bf16|fp16|fp64][@cpu|@cuda[:N]]
                                 transformers model rebuilt from MODEL.gguf by ggufcheck
    hf-gguf[:fp32|bf16|fp16|fp64][@cpu|@cuda[:N]]
                                 transformers' own GGUF loader and modeling code (needs
                                 accelerate): independent of ggufcheck's tables and reference
    llama-cpp[:key=value,...]    llama.cpp in process (n_ctx=, n_threads=, n_batch=, seed=,
                                 cuda_graphs=0, cuda_fusion=0, cublas_f32=1: its CUDA
                                 backend's runtime switches, in a process of its own,
                                 type_k=/type_v= KV-cache ggml types: 0 F32, 1 F16 default,
                                 8 Q8_0; flash_attn=0|1; n_gpu_layers=N offloads N layers
                                 (99: all) to a GPU build named by LLAMA_CPP_LIB_PATH, in a
                                 process of its own (isolate=1; CUDA llama.cpp and torch
                                 crash in one process); verbose=1: llama.cpp's own log)
    vllm[:tp=N,dtype=fp32|bf16|fp16,max_model_len=N,kv_cache_gib=N]
                                 the real vLLM (GGUF plug-in) in its own interpreter
                                 (python=; --python PATH), every TP rank reachable
    llama-server[:bin=PATH,n_gpu_layers=N,n_ctx=N,flash_attn=0|1,type_k=T,type_v=T,threads=N]
                                 llama.cpp's own server, started by ggufcheck on MODEL.gguf
                                 (bin=, else $GGUFCHECK_LLAMA_SERVER, else PATH) and judged
                                 over HTTP; stopped when the run ends
    http://HOST:PORT[/v1][?kind=vllm|llama-cpp-python|llama-server][&backend=cuda]
    python:MODULE:FACTORY[:key=value,...]
                                 a user's own engine: FACTORY(model_path[, key=value...]) -> Engine

Each kind is one :class:`EngineKind` in :data:`KINDS` (its usage line, how it opens, its TP
size, whether it runs in another interpreter); :func:`parse_spec` reads a spec once into an
:class:`EngineSpec` that the run keeps (``DiagnoseOptions.engine_spec``). Heavy libraries
are imported only by the adapter a spec names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ggufcheck.engines.base import Engine
from ggufcheck.errors import UsageError

@dataclass(frozen=True)
class EngineKind:
    """One kind of engine ``--engine`` can name: how its spec reads, how it opens, and what the
    run needs to know of it before it opens (its TP size, its interpreter). A new engine is
    one module in ``engines/`` and one entry in :data:`KINDS`."""

    name: str
    usage: str  # how its spec reads, shown in --help
    open: Callable[[str, str, "Path | None", dict], Engine]  # (spec, options text, model, kwargs)
    ranks: Callable[[str, str], int] | None = None  # (spec, options text) -> the TP size it runs at
    interpreter: bool = False  # runs in the interpreter --python names
    needs_model: bool = True
    # (options text, settings) -> the options text with those settings: how a switch (checks.
    # switches) reopens this kind with one setting flipped; None: its settings cannot be flipped
    respec: Callable[[str, dict], str] | None = None


@dataclass(frozen=True)
class EngineSpec:
    """An ``--engine`` string, parsed once: its kind and its options text."""

    text: str
    kind: EngineKind
    rest: str

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def tp(self) -> int | None:
        """The tensor-parallel size the spec runs the engine at; None for an engine without one."""
        return None if self.kind.ranks is None else self.kind.ranks(self.text, self.rest)

    def with_settings(self, settings: dict) -> "EngineSpec":
        """This spec with ``settings`` (option -> value) set: the engine a switch flips to."""
        if self.kind.respec is None:
            raise UsageError(f"--engine {self.text}: its settings cannot be changed by ggufcheck")
        rest = self.kind.respec(self.rest, dict(settings))
        head = self.text[:len(self.text) - len(self.rest)] if self.rest and self.text.endswith(self.rest) else \
            self.kind.name + ":"
        if not head.endswith((":", "?")) and rest:
            head += ":"
        return EngineSpec(head + rest, self.kind, rest)

    def open(self, model_path: str | Path | None, **kwargs) -> Engine:
        if self.kind.needs_model and model_path is None:
            raise UsageError(f"--engine {self.text} needs the model file")
        return self.kind.open(self.text, self.rest, model_path, kwargs)


def merge_options(rest: str, settings: dict) -> str:
    """``key=value,...`` with ``settings`` replacing or adding keys, in their first order."""
    items = [item.partition("=") for item in filter(None, rest.split(","))]
    out, seen = [], set()
    for key, _sep, value in items:
        if key in settings:
            value, _ = str(settings[key]), seen.add(key)
        out.append(f"{key}={value}")
    out += [f"{k}={v}" for k, v in settings.items() if k not in seen]
    return ",".join(out)


def _plugin_respec(rest: str, settings: dict) -> str:
    module, _, tail = rest.partition(":")
    factory, _, options = tail.partition(":")
    return f"{module}:{factory}:{merge_options(options, settings)}"


def _hf_respec(rest: str, settings: dict) -> str:
    dtype, at, device = rest.partition("@")
    return f"{settings.get('dtype', dtype or 'fp32')}{at}{device}"


def _options(text: str, spec: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise UsageError(f"--engine {spec}: bad option {item!r}", tip="options are key=INTEGER, comma-separated")
        out[key] = int(value)
    return out


def _http(spec: str, rest: str, model_path, kwargs: dict) -> Engine:
    from ggufcheck.engines.http import HttpEngine, HttpOptions

    try:
        return HttpEngine(spec, model_path=model_path, options=kwargs.pop("http_options", HttpOptions()))
    except ValueError as err:
        raise UsageError(f"--engine {spec}: {err}") from err


def _plugin(spec: str, rest: str, model_path, kwargs: dict) -> Engine:
    from ggufcheck.engines.plugin import load_plugin

    return load_plugin(rest, model_path)


LLAMA_CPP_OPTIONS = {"n_ctx", "n_threads", "n_batch", "seed", "type_k", "type_v", "flash_attn", "n_gpu_layers",
                     "main_gpu", "isolate", "verbose", "cuda_graphs", "cuda_fusion", "cublas_f32"}
# options of llama.cpp's CUDA backend read from the environment when the library loads (its
# ggml-cuda sources: getenv), set in the engine's own process: option -> (variable, value when 0 / 1)
LLAMA_CPP_CUDA_ENV = {"cuda_graphs": ("GGML_CUDA_DISABLE_GRAPHS", {0: "1", 1: None}),
                      "cuda_fusion": ("GGML_CUDA_DISABLE_FUSION", {0: "1", 1: None}),
                      "cublas_f32": ("GGML_CUDA_CUBLAS_COMPUTE_TYPE", {0: None, 1: "f32"})}


def _llama_cpp(spec: str, rest: str, model_path, kwargs: dict) -> Engine:
    from ggufcheck.engines.llama_cpp import LlamaCppEngine

    # type_k/v: ggml type of the KV cache (0 F32, 1 F16 default, 8 Q8_0); flash_attn: 0/1
    opts = _options(rest, spec)
    unknown = set(opts) - LLAMA_CPP_OPTIONS
    if unknown:
        raise UsageError(f"--engine {spec}: unknown option(s) {', '.join(sorted(unknown))}",
                         tip=f"known: {', '.join(sorted(LLAMA_CPP_OPTIONS))}")
    # a GPU build of llama.cpp cannot share a process with torch (engines.isolated):
    # offloading runs it in a process of its own; isolate=0|1 overrides
    python = kwargs.pop("python", None)  # --python: the interpreter whose llama_cpp runs it (isolated)
    env = {}
    for option, (variable, values) in LLAMA_CPP_CUDA_ENV.items():
        if option in opts:
            value = int(opts.pop(option))
            if value not in values:
                raise UsageError(f"--engine {spec}: {option} must be 0 or 1")
            env[variable] = values[value]  # None: the variable removed (the backend's default)
    isolate = opts.pop("isolate", 1 if (opts.get("n_gpu_layers") or python or env) else 0)
    if env and not isolate:
        raise UsageError(f"--engine {spec}: {', '.join(LLAMA_CPP_CUDA_ENV)} are read when llama.cpp loads: they "
                         "need an engine process of its own (leave isolate=0 out)")
    if isolate:
        from ggufcheck.engines.isolated import IsolatedEngine
        from ggufcheck.engines.rowwise import NO_NUMBA

        # numba's LLVM in a process where a CUDA libggml loaded: SIGSEGV (engines/rowwise.py); the
        # engine's own process may load one (LLAMA_CPP_LIB_PATH) even with every layer on the CPU
        env[NO_NUMBA] = "1"

        return IsolatedEngine("ggufcheck.engines.llama_cpp:LlamaCppEngine", model_path, preload=("llama_cpp",),
                              python=python, env=env, **{**kwargs, **opts})
    return LlamaCppEngine(model_path, **{**kwargs, **opts})


def _vllm(spec: str, rest: str, model_path, kwargs: dict) -> Engine:
    from ggufcheck.engines.vllm import VllmEngine, parse_options

    return VllmEngine(model_path, parse_options(rest, spec), python=kwargs.get("python"))


def _vllm_ranks(spec: str, rest: str) -> int:
    from ggufcheck.engines.vllm import parse_options

    return int(parse_options(rest, spec).tp)


def _reference(spec: str, rest: str, model_path, kwargs: dict) -> Engine:
    from ggufcheck.engines.reference import ReferenceEngine

    dtype = rest or "fp64"
    if dtype not in ("fp32", "fp64"):
        raise UsageError(f"--engine {spec}: the reference computes in fp32 or fp64")
    kwargs.pop("python", None)
    return ReferenceEngine(model_path, dtype=dtype, **kwargs)


def hf_dtype_device(spec: str, rest: str) -> tuple[str, str]:
    """``hf[:DTYPE][@DEVICE]``'s dtype (default fp32) and device (default cpu), checked."""
    dtype, _, device = rest.partition("@")
    dtype = dtype or "fp32"
    if dtype not in ("fp32", "fp64", "bf16", "fp16"):
        raise UsageError(f"--engine {spec}: dtype must be fp32, fp64, bf16 or fp16")
    device = device or "cpu"
    index = device.partition(":")[2] if device.startswith("cuda:") else ""
    if device not in ("cpu", "cuda") and not (device.startswith("cuda:") and index.isdigit()):
        raise UsageError(f"--engine {spec}: device must be cpu, cuda or cuda:N", tip="e.g. hf:bf16@cuda:0")
    return dtype, device


def _hf(loader: str):
    def open_(spec: str, rest: str, model_path, kwargs: dict) -> Engine:
        from ggufcheck.engines.hf import HFEngine

        dtype, device = hf_dtype_device(spec, rest)
        return getattr(HFEngine, loader)(model_path, dtype=dtype, device=device)
    return open_


def _llama_server(spec: str, rest: str, model_path, kwargs: dict) -> Engine:
    from ggufcheck.engines.http import HttpOptions
    from ggufcheck.engines.llama_server import LlamaServerEngine, parse_options

    return LlamaServerEngine(model_path, parse_options(rest, spec),
                             http_options=kwargs.pop("http_options", HttpOptions()))


KINDS: dict[str, EngineKind] = {k.name: k for k in (
    EngineKind("reference", "reference[:fp32]", _reference),
    EngineKind("hf", "hf[:bf16][@cuda]", _hf("from_gguf"), respec=_hf_respec),
    EngineKind("hf-gguf", "hf-gguf[:fp32] (transformers' own GGUF loader)", _hf("from_transformers_gguf"),
               respec=_hf_respec),
    EngineKind("llama-cpp", "llama-cpp[:n_ctx=N,n_gpu_layers=N]", _llama_cpp, interpreter=True, respec=merge_options),
    EngineKind("vllm", "vllm[:tp=N,dtype=D,max_model_len=N]", _vllm, ranks=_vllm_ranks, interpreter=True,
               respec=merge_options),
    EngineKind("llama-server", "llama-server[:bin=PATH,n_gpu_layers=N,flash_attn=0|1,type_k=q8_0]", _llama_server,
               respec=merge_options),
    EngineKind("http", "http://HOST:PORT[/v1]", _http, needs_model=False),
    EngineKind("python", "python:MODULE:FACTORY[:key=value,...]", _plugin, needs_model=False, respec=_plugin_respec),
)}
SPEC_HELP = ", ".join(k.usage for k in KINDS.values())


def parse_spec(text: str) -> EngineSpec:
    """``--engine TEXT`` -> its :class:`EngineSpec` (a UsageError naming the kinds for an unknown one)."""
    if text.startswith(("http://", "https://")):
        return EngineSpec(text, KINDS["http"], text)
    head, _, rest = text.partition(":")
    for name in ("hf-gguf", "hf"):  # hf@cuda: the default dtype on a device
        if text.startswith(name + "@"):
            head, rest = name, text[len(name):]
    if head not in KINDS:
        raise UsageError(f"--engine {text}: unknown engine", tip=f"one of: {SPEC_HELP}")
    return EngineSpec(text, KINDS[head], rest)


def open_engine(spec: "str | EngineSpec", model_path: str | Path | None, **kwargs) -> Engine:
    """Open the engine ``spec`` names, for the model at ``model_path``."""
    return (spec if isinstance(spec, EngineSpec) else parse_spec(spec)).open(model_path, **kwargs)
