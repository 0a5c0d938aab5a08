"""Metadata keys whose absence engines read differently: each reading, named.

A GGUF file that leaves out a key which changes the math is read by every engine with its own
default, and those defaults disagree: llama.cpp's loader fills an absent deepseek2
``expert_gating_func`` with softmax (for the old DeepSeek V2 / V2.5 files; current builds read
sigmoid for GLM-4.7 Lite's dims), while the original DeepSeek-V3 / R1 / Kimi-K2 checkpoints route with
sigmoid; an absent ``rope.scaling.type`` next to a scaling factor is linear scaling to
llama.cpp (its default type string) and no scaling to transformers' GGUF loader (it maps no
rope-scaling key), which vLLM's GGUF path uses for its config. A deployment that "works on
llama.cpp and is garbage on vLLM" (or the reverse) often starts here, and nothing in the file
is wrong enough to fail.

:func:`divergent_defaults` lists, for one file, every such key that is absent, with what each
engine reads and what ggufcheck's reference uses (it follows current llama.cpp); the file
stage reports each as a WARN (``metadata.defaults``). Each reading cites where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ggufcheck.arch.spec import ArchSpec, glm_lite_gating


@dataclass(frozen=True)
class Divergence:
    """One absent key and how the engines read its absence."""

    key: str  # the full GGUF key
    reference: str  # what ggufcheck's reference (and the verdicts) use
    readings: tuple[tuple[str, str], ...]  # (who, what they read), each with its source
    evidence: str = ""  # what in the file hints at the right reading

    @property
    def message(self) -> str:
        each = "; ".join(f"{who}: {what}" for who, what in self.readings)
        hint = f". In this file: {self.evidence}" if self.evidence else ""
        return (f"{self.key} is absent and engines read it differently ({each}); ggufcheck's reference uses "
                f"{self.reference}{hint}. Set the key in the file (gguf-py's gguf_new_metadata.py) or check "
                "which reading your engine applies")


def divergent_defaults(metadata: Mapping[str, Any], tensor_names: Iterable[str],
                       spec: ArchSpec | None) -> list[Divergence]:
    """Every absent key of this file that engines default differently (see the module docstring)."""
    if spec is None or not isinstance(spec, ArchSpec):
        return []
    arch = spec.arch
    names = set(tensor_names)
    out = []
    biased = any(n.endswith("exp_probs_b.bias") for n in names)  # a noaux_tc (DeepSeek-V3-style) router
    if arch == "deepseek2" and spec.moe is not None and metadata.get(f"{arch}.expert_gating_func") in (None, 0):
        lite = glm_lite_gating(arch, spec.n_layer + spec.n_nextn, spec.n_vocab)
        out.append(Divergence(
            f"{arch}.expert_gating_func", spec.moe.gating.value,
            (("llama.cpp before the GLM-4.7 Lite rule", "softmax (llama-model.cpp: 'for compatibility with existing "
              "DeepSeek V2 and V2.5 GGUFs')"),
             ("current llama.cpp", f"{'sigmoid' if lite else 'softmax'} (sigmoid only for 47 or 48 blocks and a "
              "154880-token vocabulary: GLM-4.7 Lite)"),
             ("the original checkpoint's config.json", "scoring_func: softmax for DeepSeek-V2 / V2.5, sigmoid for "
              "DeepSeek-V3 / R1, Kimi-K2 and GLM-4.7 Flash")),
            "a selection bias exp_probs_b, which only the sigmoid (noaux_tc) routers of DeepSeek-V3-style models "
            "have: sigmoid is the likely training reading" if biased else
            "no selection bias exp_probs_b: a DeepSeek-V2-style softmax router is the likely training reading"))
    if arch == "deepseek2" and spec.moe is not None and biased and f"{arch}.expert_weights_norm" not in metadata:
        out.append(Divergence(
            f"{arch}.expert_weights_norm", str(spec.moe.weights_norm).lower(),
            (("llama.cpp", "false (an optional key, default false)"),
             ("the original checkpoint's config.json", "norm_topk_prob: true for DeepSeek-V3 / R1, false for "
              "DeepSeek-V2")),
            "a selection bias exp_probs_b (DeepSeek-V3-style router), whose checkpoints normalize the top-k weights"))
    rope = spec.rope
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if (rope is not None and f"{arch}.rope.scaling.type" not in metadata and isinstance(factor, (int, float))
            and not isinstance(factor, bool) and factor not in (0, 1)):
        out.append(Divergence(
            f"{arch}.rope.scaling.type", f"linear scaling by {factor:g}",
            (("llama.cpp", f"linear: every position divided by {factor:g} (llama-model.cpp reads the type with "
              "the default string 'linear', then freq_scale = 1 / factor)"),
             ("transformers' GGUF loader (and vLLM's GGUF path, which takes its config)", "no rope scaling (its "
              "GGUF config map reads no rope.scaling key)")),
            f"rope.scaling.factor {factor:g}"))
    return out
