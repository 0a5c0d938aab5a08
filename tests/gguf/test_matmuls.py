"""gguf.matmuls: the one rule for which weights an engine multiplies activations with."""

from types import SimpleNamespace

import gguf

from ggufcheck.gguf.matmuls import matmul_weight_types, routed_expert_types

T = gguf.GGMLQuantizationType


def info(qtype, *ne):
    return SimpleNamespace(qtype=qtype, ne=ne)


def test_layers_and_the_untied_head_only():
    tensors = {"token_embd.weight": info(T.Q8_0, 64, 100), "output.weight": info(T.Q6_K, 64, 100),
               "blk.0.attn_q.weight": info(T.Q4_K, 64, 64), "blk.0.attn_norm.weight": info(T.F32, 64),
               "output_norm.weight": info(T.F32, 64)}
    assert sorted(matmul_weight_types(tensors)) == ["Q4_K", "Q6_K"]


def test_a_tied_head_is_the_embedding():
    tensors = {"token_embd.weight": info(T.Q8_0, 64, 100), "blk.0.ffn_up.weight": info(T.F16, 64, 128)}
    assert sorted(matmul_weight_types(tensors)) == ["F16", "Q8_0"]


def test_routed_experts():
    tensors = {"blk.1.ffn_up_exps.weight": info(T.F32, 64, 32, 4), "blk.1.ffn_up_shexp.weight": info(T.F16, 64, 32),
               "blk.1.ffn_gate_inp.weight": info(T.F32, 64, 4)}
    assert routed_expert_types(tensors) == {"F32"}
