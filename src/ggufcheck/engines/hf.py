"""``--engine hf``: a transformers model built from the GGUF through ggufcheck's rebuild.

Not transformers' own GGUF loader (it lacks MLA / DSA architectures and hides its name
mapping): the weights come from :func:`ggufcheck.arch.rebuild.iter_hf_tensors` through
ggufcheck's tensor table, the config from the architecture spec, and the modeling code is
transformers' (an independent second implementation of the math). Per-layer outputs come
from forward hooks on the decoder layers, attention and MLP modules.

The transformers config comes from ``arch/hf_config.py`` (every family in
``arch/families.py``); a file it cannot express (a softmax-routed deepseek2: transformers'
deepseek_v3 routes with sigmoid) makes the engine raise Unsupported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ggufcheck.arch.hf_config import MODEL_TYPES, hf_config
from ggufcheck.engines.base import (
    LAYER_KINDS,
    Capabilities,
    Engine,
    Generation,
    GGUFVocabTokenizer,
    LayerTrace,
    Switch,
    TokenLogprobs,
    Unsupported,
    reasons,
)
from ggufcheck.errors import Unavailable

def _load_streaming(transformers, config, model, spec, table, torch_dtype, device: str):
    """The transformers model built where it will run, in its dtype, then filled one rebuilt
    tensor (one block of experts) at a time: host memory holds one such piece, not the model
    (building in float32 on the CPU and converting held ~2.5x the model: 131 GB for a 2-layer
    GLM-5-dims file on a 125 GB host). Parameters and buffers end as ``module.to(dtype)`` left
    them before (a test compares every one). Returns (module, missing names, unexpected names)."""
    import torch

    from ggufcheck.arch.rebuild import iter_hf_parts

    with torch.device(device):
        module = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    # everything in the dtype, as the engine always was: transformers keeps some modules in
    # float32 (the MoE router's gate), and its buffers (rotary inv_freq) are float32
    module.to(torch_dtype)
    params = dict(module.named_parameters())
    targets = {**dict(module.named_buffers()), **params}  # (a router's score-correction bias is a buffer)
    filled, unexpected = set(), []
    with torch.no_grad():
        for name, tensor, experts in iter_hf_parts(model, spec, table, layout="transformers", include_nextn=False):
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            (target.data if experts is None else target.data[experts]).copy_(tensor)
            filled.add(name)
    if spec.tied_output:
        module.tie_weights()
        filled.add("lm_head.weight")
    missing = sorted(n for n in params if n not in filled and not (spec.tied_output and n == "lm_head.weight"))
    return module, missing, unexpected


class HFEngine(GGUFVocabTokenizer, Engine):
    """A transformers causal LM (``torch.nn.Module``) in ``dtype`` on CPU or CUDA.

    Inputs go to the module's device; every result comes back to the CPU as numpy.
    """

    def __init__(self, module: Any, *, dtype: str = "fp32", name: str = "hf", tokenizer: Any = None,
                 reference_options: Mapping[str, Any] | None = None):
        import torch

        self._torch = torch
        self.module = module.eval()
        self.device = next(module.parameters()).device
        self.vocab_size = int(module.config.vocab_size)
        self.name = name
        import torch
        import transformers

        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"
        self._tokenizer = tokenizer
        self.capabilities = Capabilities(
            tokenize=tokenizer is not None, score=True, full_vocab=True, max_top_k=self.vocab_size, generate=True,
            batch=True, chunked_prefill=False, layer_outputs=frozenset({"residual", "attention", "ffn"}),
            weights=True, activation_dtype=dtype, weight_layout="transformers",
            reference_options=dict(reference_options or {}),
            reasons=reasons(tokenize="no tokenizer was given for this transformers model",
                            chunked_prefill="not wired for transformers models"),
            # a low-precision run's one flip (checks.switches): the same code in fp32
            switches=(Switch({"dtype": "fp32"}, {"dtype": dtype}, f"the {dtype} arithmetic", "output"),)
            if dtype in ("bf16", "fp16") else (),
        )

    @classmethod
    def from_transformers_gguf(cls, model_path: str | Path, *, dtype: str = "fp32", device: str = "cpu") -> "HFEngine":
        """transformers' OWN GGUF loader (``from_pretrained(gguf_file=...)``: its dequantization,
        its tensor mapping, its config reading) and its modeling code: an implementation that
        shares nothing with ggufcheck's tables or reference (``--engine/--reference hf-gguf``).
        It covers the architectures transformers' GGUF support lists (gemma3, qwen3moe, ...)."""
        try:
            import torch
            import transformers
        except ImportError as err:
            raise Unavailable(f"transformers is not installed ({err})", tip="pip install 'ggufcheck[hf]'") from err
        try:
            import accelerate  # noqa: F401 - transformers' GGUF loader requires it
        except ImportError as err:
            raise Unavailable("transformers' GGUF loader needs accelerate", tip="pip install accelerate") from err
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise Unavailable(f"hf-gguf@{device}: torch sees no CUDA device (torch {torch.__version__})")
        path = Path(model_path)
        torch_dtype = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16,
                       "fp16": torch.float16}[dtype]
        try:
            module = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                       dtype=torch_dtype)
        except (ValueError, KeyError, NotImplementedError, OSError) as err:
            raise Unsupported(f"transformers' GGUF loader refused {path.name}: {str(err).splitlines()[0][:200]}") \
                from None
        module.to(device)
        tokenizer = None
        try:
            from ggufcheck.gguf.reader import open_gguf
            from ggufcheck.tokenizer import load_tokenizer

            with open_gguf(path) as model:
                tokenizer = load_tokenizer(model)
        except Exception:  # noqa: BLE001 - no tokenizer: the diagnosis tokenizes with the engine under test
            tokenizer = None
        where = "" if device == "cpu" else f" on {device}"
        return cls(module, dtype=dtype, name=f"transformers GGUF loader {type(module).__name__} {dtype}{where} "
                                             f"({path.name})", tokenizer=tokenizer)

    @classmethod
    def from_gguf(cls, model_path: str | Path, *, dtype: str = "fp32", device: str = "cpu") -> "HFEngine":
        try:
            import torch
            import transformers
        except ImportError as err:
            raise Unavailable(f"transformers is not installed ({err})", tip="pip install 'ggufcheck[hf]'") from err
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise Unavailable(f"hf@{device}: torch sees no CUDA device (torch {torch.__version__})")
        from ggufcheck.arch.spec import spec_for_model
        from ggufcheck.arch.tables import table_for
        from ggufcheck.gguf.reader import open_gguf

        torch_dtype = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16,
                       "fp16": torch.float16}[dtype]
        with open_gguf(model_path) as model:
            spec, findings = spec_for_model(model)
            if spec is None or not getattr(spec, "supported", False):
                raise Unsupported(f"no architecture spec for this file ({findings or 'unsupported'})")
            table = table_for(spec)
            try:
                kwargs = hf_config(spec)
            except Unavailable as err:
                raise Unsupported(str(err)) from err
            config = transformers.AutoConfig.for_model(MODEL_TYPES.get(spec.arch, spec.arch), **kwargs)
            module, missing, unexpected = _load_streaming(transformers, config, model, spec, table, torch_dtype,
                                                          device)
            if missing or unexpected:
                raise Unsupported(f"the rebuild does not fit transformers' {spec.arch} model: missing "
                                  f"{missing[:3]}, unexpected {unexpected[:3]}")
            try:
                from ggufcheck.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(model)
            except Exception:  # noqa: BLE001
                tokenizer = None
        where = "" if device == "cpu" else f" on {device}"
        # transformers' DeepseekV3 / GlmMoeDsa build the MLA q_a / kv_a RMSNorms with eps 1e-6
        # whatever the config says (llama.cpp and vLLM use the file's rms eps): its semantics
        semantics = {"lora_norm_eps": 1e-6} if spec.mla is not None else {}
        return cls(module, dtype=dtype, name=f"hf {spec.arch} {dtype}{where} ({Path(model_path).name})",
                   tokenizer=tokenizer, reference_options=semantics)

    def _logprobs(self, batch: list[list[int]]) -> list[np.ndarray]:
        torch = self._torch
        width = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T] right-padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        with torch.no_grad():
            logits = self.module(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits  # [B, T, V]
        lp = torch.log_softmax(logits.to(torch.float64), dim=-1).cpu().numpy()
        return [lp[i, :len(s)] for i, s in enumerate(batch)]

    def score(self, tokens: Sequence[int], *, top_k: int = 20) -> TokenLogprobs:
        tokens = [int(t) for t in tokens]
        return TokenLogprobs(tokens, self.vocab_size, self._logprobs([tokens])[0])

    def score_batch(self, batch: Sequence[Sequence[int]], *, top_k: int = 20) -> list[TokenLogprobs]:
        seqs = [[int(t) for t in s] for s in batch]
        return [TokenLogprobs(s, self.vocab_size, lp) for s, lp in zip(seqs, self._logprobs(seqs))]

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, top_k: int = 20) -> Generation:
        torch = self._torch
        prompt = [int(t) for t in prompt]
        n = len(prompt) + max_new_tokens
        table = np.zeros((n, self.vocab_size))
        generated: list[int] = []
        with torch.no_grad():
            out = self.module(input_ids=torch.tensor([prompt], device=self.device), use_cache=True)
            for step in range(max_new_tokens):
                row = torch.log_softmax(out.logits[0, -1].to(torch.float64), dim=-1).cpu().numpy()
                table[len(prompt) - 1 + step] = row
                token = int(np.argmax(row))
                generated.append(token)
                if step + 1 < max_new_tokens:
                    out = self.module(input_ids=torch.tensor([[token]], device=self.device), use_cache=True,
                                      **self._cache_of(out))
        present = np.zeros(n, dtype=bool)
        present[len(prompt) - 1:len(prompt) - 1 + max_new_tokens] = True
        return Generation(np.array(prompt), np.array(generated),
                          TokenLogprobs(prompt + generated, self.vocab_size, table, present=present))

    def layer_outputs(self, tokens: Sequence[int], kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        tokens = [int(t) for t in tokens]
        return self._traced(tokens, [tokens], kinds)

    def decode_layer_outputs(self, tokens: Sequence[int], prompt_length: int,
                             kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """The prompt in one forward, then one token per forward through the KV cache, as
        :meth:`generate` decodes: the per-layer tensors of every step, concatenated (where a
        decode parts from the prefill of the same tokens: checks.path_layers)."""
        tokens = [int(t) for t in tokens]
        p = max(1, min(int(prompt_length), len(tokens)))
        return self._traced(tokens, [tokens[:p], *([t] for t in tokens[p:])], kinds)

    def _traced(self, tokens: list[int], pieces: list[list[int]], kinds: Sequence[str]) -> LayerTrace:
        """Run ``pieces`` in turn (one forward each, through the KV cache after the first) with
        hooks on every layer; each kind's rows concatenated over the pieces."""
        torch = self._torch
        layers = self.module.model.layers
        parts: dict[tuple[str, int], list[np.ndarray]] = {}
        hooks = []

        def keep(kind: str, i: int):
            def hook(_mod, _inp, output):
                value = output[0] if isinstance(output, tuple) else output
                parts.setdefault((kind, i), []).append(value[0].detach().float().cpu().numpy())  # [T, D]
            return hook

        for i, layer in enumerate(layers):
            # what each block adds to the residual: Gemma norms the block outputs first
            sandwich = hasattr(layer, "post_feedforward_layernorm")
            if "residual" in kinds:
                hooks.append(layer.register_forward_hook(keep("residual", i)))
            if "attention" in kinds:
                module = layer.post_attention_layernorm if sandwich else layer.self_attn
                hooks.append(module.register_forward_hook(keep("attention", i)))
            if "ffn" in kinds:
                module = layer.post_feedforward_layernorm if sandwich else layer.mlp
                hooks.append(module.register_forward_hook(keep("ffn", i)))
        try:
            with torch.no_grad():
                out = None
                for piece in pieces:
                    ids = torch.tensor([piece], device=self.device)
                    if len(pieces) == 1:
                        out = self.module(input_ids=ids)
                    elif out is None:
                        out = self.module(input_ids=ids, use_cache=True)
                    else:
                        out = self.module(input_ids=ids, use_cache=True, **self._cache_of(out))
        finally:
            for h in hooks:
                h.remove()
        return LayerTrace(np.array(tokens), {k: np.concatenate(v) for k, v in parts.items()})

    @staticmethod
    def _cache_of(out) -> dict:
        """The KV cache of a forward's output, under the name this transformers takes it by
        (``cache`` from 5.25 on, ``past_key_values`` before: now a deprecated alias)."""
        if "cache" in getattr(out, "__dataclass_fields__", {}):
            return {"cache": out.cache}
        return {"past_key_values": out.past_key_values}

    def held_weight_names(self, *, rank: int = 0) -> list[str]:
        persistent = {n for n, _ in self.module.named_buffers() if n.endswith("e_score_correction_bias")}
        return [name for name, _ in self.module.named_parameters()] + sorted(persistent)

    def weight(self, hf_name: str, *, rank: int = 0) -> np.ndarray:
        return self.weight_tensor(hf_name, rank=rank).float().cpu().numpy()

    def weight_experts(self, hf_name: str, experts: slice, *, rank: int = 0) -> np.ndarray:
        return self.weight_tensor(hf_name, experts, rank=rank).float().cpu().numpy()

    def weight_tensor(self, hf_name: str, experts: slice | None = None, *, rank: int = 0) -> torch.Tensor:
        """The parameter (``experts``: those experts of a stacked one) as the model holds it,
        in its dtype and on its device, without a copy: the weights audit compares it where it
        lives (a GLM-5 MoE layer's experts copied to the host and compared on 16 CPU cores
        took 2.5 minutes per 3 layers on the H100 host)."""
        if rank != 0:
            raise Unsupported("a single-process transformers model has only rank 0")
        params = dict(self.module.named_parameters())
        params.update((n, b) for n, b in self.module.named_buffers() if n.endswith("e_score_correction_bias"))
        if hf_name not in params:
            raise Unsupported(f"the transformers model has no parameter {hf_name!r}")
        held = params[hf_name].detach()
        return held if experts is None else held[experts]
