"""Absent metadata keys that engines read differently: named as a WARN, with each reading.

The reading ggufcheck's reference takes for an absent rope.scaling.type (linear, as llama.cpp)
is checked against llama.cpp itself on the same file, not against a hand-typed number."""

from __future__ import annotations

import numpy as np
import pytest

from ggufcheck.arch.defaults import divergent_defaults
from ggufcheck.arch.spec import build_spec
from ggufcheck.checks.mapping import mapping_stage
from ggufcheck.gguf.reader import open_gguf
from ggufcheck.results import Status


def _warnings(path):
    with open_gguf(path) as m:
        return [r for r in mapping_stage(m) if r.status is Status.WARN]


def test_deepseek2_without_gating_or_norm_keys_warns_with_each_reading(tiny_gguf):
    f = tiny_gguf("deepseek2", gating_func=None, expert_weights_norm=False)
    warns = {r.stats["key"]: r for r in _warnings(f.path)}
    assert set(warns) == {"deepseek2.expert_gating_func", "deepseek2.expert_weights_norm"}
    gating = warns["deepseek2.expert_gating_func"]
    assert gating.component == "metadata" and gating.stats["reference"] == "softmax"
    assert "sigmoid" in gating.message and "softmax" in gating.message and "exp_probs_b" in gating.message
    assert len(gating.stats["readings"]) == 3


def test_files_that_state_their_keys_do_not_warn(tiny_gguf):
    for arch in ("llama", "deepseek2", "glm-dsa", "qwen3moe"):  # glm-dsa / qwen3moe: absent, but no disagreement
        assert not _warnings(tiny_gguf(arch).path), arch


def test_glm_lite_dims_read_sigmoid_as_current_llama_cpp(tiny_gguf):
    """llama.cpp's rule: a deepseek2 file with 47 or 48 blocks and a 154880-token vocabulary,
    without expert_gating_func, is GLM-4.7 Lite: sigmoid (softmax for any other)."""
    with open_gguf(tiny_gguf("deepseek2", gating_func=None).path) as m:
        metadata, names = dict(m.metadata), list(m.tensors)
    for blocks, vocab, want in ((47, 154880, "sigmoid"), (48, 154880, "sigmoid"), (47, 1000, "softmax"),
                                (27, 154880, "softmax")):
        md = {**metadata, "deepseek2.block_count": blocks, "deepseek2.vocab_size": vocab}
        spec, _ = build_spec(md, names)
        assert spec.moe.gating.value == want, (blocks, vocab)
        (d,) = [d for d in divergent_defaults(md, names, spec) if d.key.endswith("gating_func")]
        assert d.reference == want


def _with_rope_factor(factor):
    def patch(plan):
        plan.metadata["llama.rope.scaling.factor"] = (factor, __import__("gguf").GGUFValueType.FLOAT32)
    return patch


def test_rope_factor_without_type_is_linear_as_llama_cpp_reads_it(tiny_gguf):
    """The reference reads the file as llama.cpp does (linear), and llama.cpp agrees with it on
    a prompt long enough for linear scaling by 4 to move every rotation."""
    llama_cpp_engine = pytest.importorskip("ggufcheck.engines.llama_cpp")
    pytest.importorskip("llama_cpp")
    from ggufcheck.engines.reference import ReferenceEngine

    f = tiny_gguf("llama", patch=_with_rope_factor(4.0))
    (warn,) = _warnings(f.path)
    assert warn.stats["key"] == "llama.rope.scaling.type" and warn.stats["reference"] == "linear scaling by 4"
    tokens = [1 + (7 * i) % 200 for i in range(48)]
    with llama_cpp_engine.LlamaCppEngine(f.path) as engine, ReferenceEngine(f.path, dtype="fp64") as ref:
        got, want = engine.score(tokens).logprobs, ref.score(tokens).logprobs
    plain = tiny_gguf("llama")  # the same weights without scaling: what ignoring the factor computes
    with ReferenceEngine(plain.path, dtype="fp64") as unscaled:
        ignored = unscaled.score(tokens).logprobs
    kl = lambda p, q: float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))  # noqa: E731
    assert kl(want, got) < 1e-3 < kl(ignored, got), (kl(want, got), kl(ignored, got))
