"""Specs built from llama.cpp-converted files equal the transformers configs they came from;
mutated metadata gives findings that name the key; unknown architectures get a GenericSpec."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ggufcheck.arch.known import deepseek_v3_metadata, glm5_metadata
from ggufcheck.arch.spec import (ArchSpec, Finding, Gating, GenericSpec, Pairing, SpecError,
                                 build_spec, spec_from_metadata)
from ggufcheck.results import Status

ARCHS = ["llama", "qwen2", "qwen3", "glm4moe", "deepseek2", "deepseek2-yarn", "glm-dsa"]


def _f32(x: float) -> float:
    return float(np.float32(x))


def _converted_spec(tiny_converted, arch: str) -> tuple[ArchSpec, dict, dict]:
    from ggufcheck.gguf.reader import open_gguf

    tiny = tiny_converted(arch, "f32")
    config = json.loads((tiny.hf_dir / "config.json").read_text())
    with open_gguf(tiny.gguf_path) as model:
        metadata = dict(model.metadata)
        spec = spec_from_metadata(metadata, model.tensors.keys())
    assert isinstance(spec, ArchSpec)
    return spec, config, metadata


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_equals_hf_config(tiny_converted, arch):
    spec, c, _ = _converted_spec(tiny_converted, arch)
    rope = c.get("rope_parameters") or {}
    assert spec.n_embd == c["hidden_size"]
    assert spec.n_layer == c["num_hidden_layers"] and spec.n_nextn == 0
    assert spec.n_vocab == c["vocab_size"]
    assert spec.n_head == c["num_attention_heads"]
    assert spec.rms_eps == _f32(c["rms_norm_eps"])
    assert spec.rope.base == _f32(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    assert spec.tied_output is c.get("tie_word_embeddings", False)
    if spec.mla is None:
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        assert spec.n_head_kv == c["num_key_value_heads"]
        assert spec.head_dim_k == spec.head_dim_v == head_dim
        assert spec.rope.n_rot == int(head_dim * rope.get("partial_rotary_factor", 1.0))
        assert spec.rope.partial is (rope.get("partial_rotary_factor", 1.0) < 1)
    else:
        m = spec.mla
        assert (m.q_lora_rank, m.kv_lora_rank) == (c["q_lora_rank"], c["kv_lora_rank"])
        assert (m.qk_nope, m.qk_rope, m.v_head) == (c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                                    c["v_head_dim"])
        assert spec.head_dim_k == c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        assert spec.rope.pairing is Pairing.NORM
    if spec.moe is not None:
        e = spec.moe
        assert e.n_expert == c["n_routed_experts"] and e.n_used == c["num_experts_per_tok"]
        assert e.n_shared == c["n_shared_experts"] and e.expert_ff == c["moe_intermediate_size"]
        assert e.leading_dense == c["first_k_dense_replace"]
        assert e.weights_scale == c["routed_scaling_factor"] and e.weights_norm is c["norm_topk_prob"]
        assert (e.n_group, e.n_group_used) == (c.get("n_group", 1), c.get("topk_group", 1))
        assert e.gating is Gating(c.get("scoring_func", "sigmoid"))
    if spec.indexer is not None:
        i = spec.indexer
        assert (i.n_head, i.head_dim, i.top_k) == (c["index_n_heads"], c["index_head_dim"], c["index_topk"])
        assert i.full == tuple(t == "full" for t in c["indexer_types"])
    if rope.get("rope_type") == "yarn":
        assert spec.rope.yarn and spec.rope.factor == rope["factor"]
        assert spec.rope.original_context == rope["original_max_position_embeddings"]
        assert spec.rope.mscale_all_dim == rope["mscale_all_dim"]
        assert (spec.rope.beta_fast, spec.rope.beta_slow) == (rope["beta_fast"], rope["beta_slow"])


@pytest.mark.parametrize("arch", ["deepseek2", "deepseek2-yarn", "glm-dsa"])
def test_kq_scale_equals_transformers_attention(tiny_converted, arch):
    """transformers' own attention module computes the softmax scale independently."""
    transformers = pytest.importorskip("transformers")
    spec, _, _ = _converted_spec(tiny_converted, arch)
    config = transformers.AutoConfig.from_pretrained(tiny_converted(arch).hf_dir)
    if config.model_type == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as Attn
    else:
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention as Attn
    assert spec.kq_scale == pytest.approx(Attn(config, layer_idx=0).scaling, rel=1e-6)


# --- real model dimensions (architectures.md numbers) --------------------------------------


def test_deepseek_v3_derived_numbers():
    spec = spec_from_metadata(deepseek_v3_metadata())
    assert spec.rope.yarn_corr_dims() == (10, 23)  # architectures.md sec 2
    assert spec.rope.mscale == pytest.approx(1.36889, abs=1e-5)
    assert spec.kq_scale == pytest.approx(0.13523, abs=1e-5)
    assert spec.mla.qk_head == 192 and spec.moe.gating is Gating.SIGMOID
    assert spec.n_layer == 61 and spec.moe.n_group == 8


def test_glm5_derived_numbers():
    from ggufcheck.arch.known import glm5_2_metadata

    spec = spec_from_metadata(glm5_metadata())
    assert spec.kq_scale == 1 / 16  # no YaRN: 1 / sqrt(192 + 64)
    assert (spec.n_block, spec.n_layer, spec.n_nextn) == (79, 78, 1)
    assert spec.moe.gating is Gating.SIGMOID  # default for glm-dsa
    assert all(spec.indexer.full) and len(spec.indexer.full) == 78
    spec52 = spec_from_metadata(glm5_2_metadata())
    full = spec52.indexer.full
    assert full[:7] == (True, True, True, False, False, False, True)
    assert spec52.indexer.source_layer(5) == 2 and spec52.indexer.source_layer(6) == 6


# --- findings -------------------------------------------------------------------------------


def _findings(meta: dict) -> list[Finding]:
    spec, findings = build_spec(meta)
    assert spec is None and findings
    return findings


MUTATIONS = [
    # (metadata changes, the key a finding must name)
    ({"glm-dsa.attention.kv_lora_rank": None}, "glm-dsa.attention.kv_lora_rank"),
    ({"glm-dsa.attention.key_length_mla": 64}, "glm-dsa.attention.key_length_mla"),  # = R: P = 0
    ({"glm-dsa.attention.key_length": 100}, "glm-dsa.attention.key_length"),  # MQA view != L+R
    ({"glm-dsa.nextn_predict_layers": 79}, "glm-dsa.nextn_predict_layers"),
    ({"glm-dsa.expert_used_count": 300}, "glm-dsa.expert_used_count"),
    ({"glm-dsa.expert_group_count": 3}, "glm-dsa.expert_group_count"),
    ({"glm-dsa.attention.indexer.types": [True] * 79}, "glm-dsa.attention.indexer.types"),
    ({"glm-dsa.attention.indexer.types": [False] + [True] * 77}, "glm-dsa.attention.indexer.types"),
    ({"glm-dsa.attention.indexer.types": "full"}, "glm-dsa.attention.indexer.types"),
    ({"glm-dsa.attention.indexer.key_length": 32}, "glm-dsa.attention.indexer.key_length"),
    ({"glm-dsa.expert_gating_func": 4}, "glm-dsa.expert_gating_func"),
    ({"glm-dsa.embedding_length": "6144"}, "glm-dsa.embedding_length"),
    ({"glm-dsa.attention.layer_norm_rms_epsilon": float("nan")}, "glm-dsa.attention.layer_norm_rms_epsilon"),
    ({"glm-dsa.attention.head_count": 0}, "glm-dsa.attention.head_count"),
    ({"glm-dsa.rope.dimension_count": 63}, "glm-dsa.rope.dimension_count"),
    ({"glm-dsa.attention.key_length_mla": None, "glm-dsa.attention.value_length_mla": None},
     "glm-dsa.attention.key_length_mla"),  # glm-dsa requires the split layout
    ({"glm-dsa.vocab_size": None}, "glm-dsa.vocab_size"),
]


@pytest.mark.parametrize("changes,key", MUTATIONS, ids=[k for _, k in MUTATIONS])
def test_mutated_metadata_names_the_key(changes, key):
    meta = glm5_metadata()
    for k, v in changes.items():
        if v is None:
            del meta[k]
        else:
            meta[k] = v
    findings = _findings(meta)
    assert key in {f.key for f in findings}, findings
    with pytest.raises(SpecError) as err:
        spec_from_metadata(meta)
    assert key in str(err.value)
    from ggufcheck.checks.mapping import finding_result

    results = [finding_result(f) for f in err.value.findings]
    assert results and all(r.status is Status.FAIL and r.component == "metadata" for r in results)


@pytest.mark.parametrize("changes,key", [
    ({"deepseek2.attention.head_count_kv": 3}, "deepseek2.attention.head_count_kv"),
    ({"deepseek2.rope.scaling.factor": -1.0}, "deepseek2.rope.scaling.factor"),
    ({"deepseek2.expert_group_used_count": 9}, "deepseek2.expert_group_used_count"),
    ({"deepseek2.leading_dense_block_count": 62}, "deepseek2.leading_dense_block_count"),
])
def test_mutated_deepseek_metadata(changes, key):
    meta = deepseek_v3_metadata()
    meta.update(changes)
    assert key in {f.key for f in _findings(meta)}


def test_gqa_findings():
    meta = {"general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.block_count": 2,
            "qwen3.attention.head_count": 6, "qwen3.attention.head_count_kv": 4,
            "qwen3.attention.layer_norm_rms_epsilon": 1e-6, "qwen3.vocab_size": 10,
            "qwen3.feed_forward_length": 128}
    keys = {f.key for f in _findings(meta)}
    assert "qwen3.attention.head_count_kv" in keys  # 4 does not divide 6
    assert "qwen3.attention.key_length" in keys  # 64 / 6 heads, no key_length
    meta.update({"qwen3.attention.head_count_kv": 2, "qwen3.attention.key_length": 16,
                 "qwen3.rope.dimension_count": 32})
    assert {f.key for f in _findings(meta)} == {"qwen3.rope.dimension_count"}


def test_deepseek2_defaults_and_legacy_layout():
    meta = deepseek_v3_metadata()
    del meta["deepseek2.expert_gating_func"], meta["deepseek2.expert_weights_scale"]
    spec = spec_from_metadata(meta)
    assert spec.moe.gating is Gating.SOFTMAX and spec.moe.weights_scale == 1.0
    assert any("expert_gating_func" in n for n in spec.notes)
    meta["deepseek2.expert_weights_scale"] = 0.0  # 0 means 1
    assert spec_from_metadata(meta).moe.weights_scale == 1.0
    # legacy MLA files: no *_length_mla; key/value_length are the MHA view P+R and V
    del meta["deepseek2.attention.key_length_mla"], meta["deepseek2.attention.value_length_mla"]
    meta.update({"deepseek2.attention.key_length": 192, "deepseek2.attention.value_length": 128,
                 "deepseek2.attention.head_count_kv": 128})
    legacy = spec_from_metadata(meta)
    assert not legacy.mla.split_kv_b and (legacy.mla.qk_nope, legacy.mla.v_head) == (128, 128)


def test_unknown_architecture_is_generic():
    meta = {"general.architecture": "mamba", "mamba.embedding_length": 640,
            "mamba.block_count": 18, "mamba.attention.head_count": 4}
    spec, findings = build_spec(meta, ["token_embd.weight"])
    assert findings == [] and isinstance(spec, GenericSpec) and not spec.supported
    assert "no spec or tensor table for architecture 'mamba'" in spec.reason
    assert (spec.n_embd, spec.n_block, spec.tied_output) == (640, 18, True)
    assert build_spec({})[1][0].key == "general.architecture"


def test_mixtral_style_llama_is_generic_not_a_false_finding():
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 2,
            "llama.expert_count": 8, "llama.attention.head_count": 4}
    spec, findings = build_spec(meta)
    assert not findings and isinstance(spec, GenericSpec) and "Mixtral" in spec.reason


def test_real_gemma3_file_spec():
    """Gemma 3 270M as llama.cpp's loader reads it (src/models/gemma3.cpp): window 512 on five
    of every six layers, local rope base 10000 (its default: the file has no freq_base_swa),
    q scaled by 1/sqrt(head dim 256), embeddings by sqrt(640), no soft-cap."""
    from ggufcheck.errors import Unavailable
    from ggufcheck.gguf.reader import open_gguf
    from ggufcheck.testing.models import gemma3_path

    try:
        path = gemma3_path()
    except Unavailable as err:
        pytest.skip(str(err))
    with open_gguf(path) as model:
        spec, findings = build_spec(model.metadata, model.tensors)
    assert not findings and spec.supported and spec.arch == "gemma3"
    assert (spec.n_block, spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim_k) == (18, 640, 4, 1, 256)
    assert spec.swa.window == 512 and spec.swa.rope_base == 10000.0 and spec.rope.base == 1e6
    assert [i for i in range(18) if not spec.swa.is_swa(i)] == [5, 11, 17]
    assert spec.kq_scale == 1 / 16 and math.isclose(spec.embed_scale, math.sqrt(640)) and spec.final_softcap == 0


def test_gemma3_keys_as_llama_cpp_reads_them():
    base = {"general.architecture": "gemma3", "gemma3.embedding_length": 64, "gemma3.block_count": 62,
            "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 2,
            "gemma3.attention.key_length": 32, "gemma3.attention.value_length": 32,
            "gemma3.feed_forward_length": 128, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.vocab_size": 300}
    spec = spec_from_metadata(base)  # no sliding_window key: every layer global
    assert spec.swa is None and any("globally" in n for n in spec.notes)
    assert spec.kq_scale == 1 / math.sqrt(64 / 4)  # 62 layers = 27B: 1/sqrt(D/H), not 1/sqrt(hd)
    spec = spec_from_metadata({**base, "gemma3.block_count": 4, "gemma3.attention.sliding_window": 16,
                               "gemma3.attention.sliding_window_pattern": [True, False, True, False],
                               "gemma3.final_logit_softcapping": 30.0, "gemma3.rope.freq_base_swa": 5e4})
    assert spec.swa.layers == (True, False, True, False) and spec.swa.rope_base == 5e4
    assert spec.final_softcap == 30.0 and spec.kq_scale == 1 / math.sqrt(32)
    spec = spec_from_metadata({**base, "gemma3.block_count": 4, "gemma3.attention.sliding_window": 16,
                               "gemma3.attention.sliding_window_pattern": 2})
    assert spec.swa.layers == (True, False, True, False)
    _, findings = build_spec({**base, "gemma3.block_count": 4, "gemma3.attention.sliding_window": 16,
                              "gemma3.attention.sliding_window_pattern": [True]})
    assert findings and findings[0].key == "gemma3.attention.sliding_window_pattern"


def test_specs_are_frozen():
    spec = spec_from_metadata(glm5_metadata())
    with pytest.raises(AttributeError):
        spec.n_embd = 1  # type: ignore[misc]
    assert math.isclose(spec.rope.base, 1e6)
