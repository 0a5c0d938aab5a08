"""A GGUF as an HF checkpoint (config.json, safetensors, tokenizer), from the verified rebuild.

Engines that cannot load a GGUF of some architecture (vLLM's GGUF plug-in refuses deepseek2
and glm4moe) can still serve the SAME weights from a checkpoint: this writes the checkpoint
layout of :func:`ggufcheck.arch.rebuild.iter_hf_tensors` (the rebuild the ``hf`` engine and
the weights audit use, verified against transformers and llama.cpp), a ``config.json`` from
the architecture spec (``arch.hf_config``), and a byte-level BPE ``tokenizer.json``
built from the file's own vocabulary. What vLLM's loaders expect beyond transformers'
config is added explicitly: ``topk_method: "noaux_tc"`` when the router has a selection bias
(``e_score_correction_bias``), ``scoring_func`` from the gating function.

Weights are written one group at a time into safetensors shards of at most ``shard_bytes``,
so memory stays bounded by the largest group; dtype float32 by default (exact for every
dequantized value).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ggufcheck.errors import GGUFCheckError, Unavailable


def export_config(spec: Any, names, metadata=None) -> dict[str, Any]:
    """config.json for ``spec`` (``names``: the file's tensor names, for the router bias)."""
    try:
        import transformers
    except ImportError as err:
        raise Unavailable(f"export needs transformers ({err})", tip="pip install 'ggufcheck[hf]'") from err
    from ggufcheck.arch.hf_config import MODEL_TYPES, hf_config

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = MODEL_TYPES.get(spec.arch)
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)  # e.g. "DeepseekV3ForCausalLM"
    if causal_lm is None:
        raise Unavailable(f"no checkpoint config for architecture {spec.arch!r} (have: {', '.join(MODEL_TYPES)})")
    config = transformers.AutoConfig.for_model(model_type, **hf_config(spec)).to_dict()
    config["architectures"] = [causal_lm]
    config["torch_dtype"] = config["dtype"] = "float32"
    for key in ("bos", "eos"):
        value = (metadata or {}).get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            config[f"{key}_token_id"] = int(value)
    if spec.moe is not None:
        config["scoring_func"] = spec.moe.gating.value  # "sigmoid" / "softmax"
        if any(n.endswith("exp_probs_b.bias") for n in names):
            config["topk_method"] = "noaux_tc"  # vLLM reads e_score_correction_bias only then
    return config


def export_tokenizer(model, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json from a gpt2-style (byte-level BPE) GGUF vocabulary."""
    meta = model.metadata
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise Unavailable(f"export writes byte-level BPE tokenizers only; this file's is "
                          f"{meta.get('tokenizer.ggml.model')!r}")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError as err:
        raise Unavailable(f"export needs the tokenizers package ({err})") from err
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    if bos is not None:
        cfg["bos_token"] = tokens[int(bos)]
    if eos is not None:
        cfg["eos_token"] = tokens[int(eos)]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def export_checkpoint(model_path: str | Path, out: str | Path, *, dtype: torch.dtype = torch.float32,
                      shard_bytes: int = 2 << 30) -> dict[str, Any]:
    """Write the checkpoint of ``model_path`` into ``out``; returns a summary."""
    from safetensors.torch import save_file

    from ggufcheck.arch.rebuild import iter_hf_tensors
    from ggufcheck.arch.spec import ArchSpec, spec_for_model
    from ggufcheck.arch.tables import table_for
    from ggufcheck.gguf.reader import open_gguf

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open_gguf(model_path) as model:
        spec, findings = spec_for_model(model)
        if not isinstance(spec, ArchSpec) or findings:
            raise GGUFCheckError(f"{model_path}: no architecture spec to export from "
                                 f"({'; '.join(str(f) for f in findings) or 'unsupported architecture'})")
        table = table_for(spec)
        config = export_config(spec, model.tensors, model.metadata)
        export_tokenizer(model, out)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        count = 0
        for name, tensor in iter_hf_tensors(model, spec, table, dtype=dtype, layout="checkpoint",
                                            include_nextn=False, tied_lm_head=False):
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensor.contiguous()
            size += nbytes
            count += 1
    weight_map = {}
    n = len(shards)
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    if n > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return {"arch": spec.arch, "model_type": config["model_type"], "tensors": count, "files": n, "out": str(out)}
