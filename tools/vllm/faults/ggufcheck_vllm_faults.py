"""Faults injected into the real vLLM, for ggufcheck's tests (issue 36 item 6).

A vLLM general plug-in (entry point ``vllm.general_plugins``), installed only into the test
engine's venv (``tools/vllm/setup.sh`` -> ``.venv-vllm``), never into ggufcheck or a user's
environment. vLLM loads it in every process it starts (the engine core and each rank's
worker); it does nothing unless ``GGUFCHECK_VLLM_FAULT`` names one fault:

- ``permute_experts:LAYER``: after the weights load and before vLLM processes them into its
  kernels' layouts, that layer's routed experts (``w13_weight`` / ``w2_weight``) rolled by one
  on every rank: the loaded model is wrong, in the engine's own parameters.
- ``rank_attention:RANK:LAYER``: that layer's attention output scaled by 1.5 on tensor-parallel
  rank RANK only, after vLLM's all-reduce (a rank-local step wrong: the ranks' residual streams
  part there).
- ``decode_mlp:LAYER``: the second half of that layer's MLP output scaled by 1.5 on one-token
  forwards only, on every rank (a matrix-vector kernel wrong: decode steps, not prefills).
- ``stale_prefix_cache``: every KV cache block scaled by 0.5 when a request is scheduled with
  a prefix-cache hit, before it runs (the cached blocks it reads went stale; its own new
  blocks are written afresh).

The patches are vLLM's own functions wrapped in place: the weight post-processing step its
model loaders call (``process_weights_after_loading``, as imported by vLLM's base loader and
by the GGUF plug-in's loader) and the model runner's ``execute_model``.
"""

from __future__ import annotations

import os

ENV = "GGUFCHECK_VLLM_FAULT"


def register() -> None:
    """vLLM's plug-in entry point: install the fault ``GGUFCHECK_VLLM_FAULT`` names, once per process."""
    fault = os.environ.get(ENV, "")
    if not fault:
        return
    kind, *args = fault.split(":")
    if kind == "permute_experts":
        _after_loading(lambda model: _roll_experts(model, int(args[0])))
    elif kind == "rank_attention":
        _after_loading(lambda model: _scale_rank_attention(model, int(args[0]), int(args[1])))
    elif kind == "decode_mlp":
        _after_loading(lambda model: _scale_one_token_mlp(model, int(args[0])))
    elif kind == "stale_prefix_cache":
        _on_prefix_hits(0.5)
    else:
        raise ValueError(f"{ENV}={fault!r}: unknown fault (permute_experts:LAYER, rank_attention:RANK:LAYER, "
                         "decode_mlp:LAYER, stale_prefix_cache)")


# -- loading ------------------------------------------------------------------------------
def _after_loading(change) -> None:
    """Run ``change(model)`` when a loader has put the weights in, before vLLM processes them."""
    import importlib

    from vllm.model_executor.model_loader import utils

    original = getattr(utils.process_weights_after_loading, "_ggufcheck_original", utils.process_weights_after_loading)

    def process_weights_after_loading(model, *args, **kwargs):
        change(model)
        return original(model, *args, **kwargs)

    process_weights_after_loading._ggufcheck_original = original
    for name in ("vllm.model_executor.model_loader.utils", "vllm.model_executor.model_loader.base_loader",
                 "vllm_gguf_plugin.loader"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading = process_weights_after_loading


def _layers(model) -> list:
    inner = getattr(model, "model", model)
    return list(getattr(inner, "layers", []))


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _roll_experts(model, layer: int) -> None:
    import torch

    target = f".layers.{layer}."
    for name, module in model.named_modules():
        if target not in name + "." or not hasattr(module, "w13_weight"):
            continue
        with torch.no_grad():
            for param in ("w13_weight", "w2_weight"):
                w = getattr(module, param)
                w.data.copy_(torch.roll(w.data, shifts=1, dims=0))


def _scale_rank_attention(model, rank: int, layer: int) -> None:
    if _tp_rank() != rank:
        return

    def wrong(_mod, _args, out):
        return (out[0] * 1.5, *out[1:]) if isinstance(out, tuple) else out * 1.5

    _layers(model)[layer].self_attn.register_forward_hook(wrong)


def _scale_one_token_mlp(model, layer: int) -> None:
    def one_token_wrong(_mod, _args, out):
        value = out[0] if isinstance(out, tuple) else out
        if value.shape[0] != 1:
            return out
        value = value.clone()
        value[..., value.shape[-1] // 2:] *= 1.5
        return (value, *out[1:]) if isinstance(out, tuple) else value

    _layers(model)[layer].mlp.register_forward_hook(one_token_wrong)


# -- computing ----------------------------------------------------------------------------
def _on_prefix_hits(factor: float) -> None:
    """Scale every KV cache block when a request is scheduled with a prefix-cache hit."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = getattr(GPUModelRunner.execute_model, "_ggufcheck_original", GPUModelRunner.execute_model)

    def execute_model(self, scheduler_output, *args, **kwargs):
        new = getattr(scheduler_output, "scheduled_new_reqs", None) or []
        if any(int(getattr(r, "num_computed_tokens", 0) or 0) > 0 for r in new):
            _scale(getattr(self, "kv_caches", None), factor)
        return original(self, scheduler_output, *args, **kwargs)

    execute_model._ggufcheck_original = original
    GPUModelRunner.execute_model = execute_model


def _scale(caches, factor: float) -> None:
    import torch

    if isinstance(caches, torch.Tensor):
        caches.mul_(factor)
    elif isinstance(caches, (list, tuple)):
        for c in caches:
            _scale(c, factor)
    elif isinstance(caches, dict):
        for c in caches.values():
            _scale(c, factor)
