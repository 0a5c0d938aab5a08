"""Rows shared by several architectures: embeddings and output, dense FFN, MoE, NextN.

Sources, cited per row: llama.cpp's converter (``conversion/*.py``), its tensor names
(``gguf-py/gguf/constants.py``, ``tensor_mapping.py``) and loaders (``src/models/*.cpp``,
which say what is optional), and transformers 5.24's modeling files (HF names). The rows
were checked against real converted files by tests/arch/test_rebuild_vs_hf.py.
"""

from __future__ import annotations

from ggufcheck.arch.table import HF, REPLICATED, Row, Shard, ShardKind

COL = Shard(ShardKind.COLUMN, 0)
ROW = Shard(ShardKind.ROW, 1)
VOCAB = Shard(ShardKind.VOCAB, 0, note="vLLM pads the vocab to a multiple of 64 per rank")


def row(gguf: str, shape: str, hf: str | None, shard: Shard = REPLICATED, part: str = "attn", *,
        transform: str = "identity", role: str = "w", module: HF | None = None,
        when: str | None = None, required: bool = True, src: str = "") -> Row:
    """A table row from compact arguments (``shape`` is a comma-separated string)."""
    return Row(gguf=gguf, shape=tuple(s.strip() for s in shape.split(",")), shard=shard,
               hf=HF(hf, transform, role) if hf is not None else None, part=part,
               module=module, when=when, required=required, source=src)


L = "model.layers.{i}."  # HF layer prefix

# token_embd / output: every family. output.weight absent = tied embeddings (llama.cpp loads
# token_embd again, TENSOR_DUPLICATED, in every loader below).
GLOBAL = (
    row("token_embd.weight", "vocab, D", "model.embed_tokens.weight", VOCAB, "global",
        src="constants.py TOKEN_EMBD; transformers *Model.embed_tokens"),
    row("output_norm.weight", "D", "model.norm.weight", part="global",
        src="constants.py OUTPUT_NORM; transformers *Model.norm"),
    row("output.weight", "vocab, D", "lm_head.weight", VOCAB, "global", required=False,
        src="constants.py OUTPUT; absent when tie_word_embeddings (conversion/base.py)"),
)

# llama-3.1 style rope scaling factors: derived from the HF config, no HF tensor
ROPE_FREQS = row("rope_freqs.weight", "n_rot//2", None, part="global", required=False,
                 src="src/models/llama.cpp, deepseek2.cpp: ROPE_FREQS {n_rot/2}, TENSOR_NOT_REQUIRED")

# dense SwiGLU FFN; F = feed_forward_length
DENSE_FFN = (
    row("blk.{i}.ffn_gate.weight", "F, D", L + "mlp.gate_proj.weight", COL, "dense_ffn",
        src="constants.py FFN_GATE; transformers *MLP.gate_proj"),
    row("blk.{i}.ffn_up.weight", "F, D", L + "mlp.up_proj.weight", COL, "dense_ffn",
        src="constants.py FFN_UP; transformers *MLP.up_proj"),
    row("blk.{i}.ffn_down.weight", "D, F", L + "mlp.down_proj.weight", ROW, "dense_ffn",
        src="constants.py FFN_DOWN; transformers *MLP.down_proj"),
)

_EXP_COL = Shard(ShardKind.COLUMN, 1, experts=True, note="TP splits the expert FF dim; EP dim 0")
_EXP_ROW = Shard(ShardKind.ROW, 2, experts=True, note="TP splits the expert FF dim; EP dim 0")
_X = L + "mlp.experts."


def moe_rows(probs_b_required: bool, fused_gate_up: bool) -> tuple[Row, ...]:
    """Router, routed experts (stacked [E, ...] in GGUF) and shared experts.

    HF checkpoints keep experts one by one (conversion/deepseek.py and glm.py stack them
    with torch.stack(dim=0)); transformers 5.x modules fuse gate and up
    (modeling_deepseek_v3.py DeepseekV3Experts.gate_up_proj [E, 2Fe, D], gate rows first).
    """
    rows = [
        row("blk.{i}.ffn_gate_inp.weight", "E, D", L + "mlp.gate.weight", part="moe",
            src="constants.py FFN_GATE_INP; transformers *TopkRouter.weight"),
        row("blk.{i}.exp_probs_b.bias", "E", L + "mlp.gate.e_score_correction_bias", part="moe",
            required=probs_b_required,
            src="constants.py FFN_EXP_PROBS_B; *TopkRouter.e_score_correction_bias; "
                "glm4-moe.cpp requires it, deepseek2.cpp / glm-dsa.cpp TENSOR_NOT_REQUIRED"),
        row("blk.{i}.ffn_gate_exps.weight", "E, Fe, D", _X + "{e}.gate_proj.weight", _EXP_COL,
            "moe", transform="unstack_experts", when="split_gate_up",
            module=HF(_X + "gate_up_proj", "fuse_gate_up", "gate"),
            src="conversion/deepseek.py merge_expert; modeling_deepseek_v3.py DeepseekV3Experts"),
        row("blk.{i}.ffn_up_exps.weight", "E, Fe, D", _X + "{e}.up_proj.weight", _EXP_COL,
            "moe", transform="unstack_experts", when="split_gate_up",
            module=HF(_X + "gate_up_proj", "fuse_gate_up", "up"),
            src="conversion/deepseek.py merge_expert; modeling_deepseek_v3.py DeepseekV3Experts"),
        row("blk.{i}.ffn_down_exps.weight", "E, D, Fe", _X + "{e}.down_proj.weight", _EXP_ROW,
            "moe", transform="unstack_experts", module=HF(_X + "down_proj"),
            src="conversion/deepseek.py merge_expert; DeepseekV3Experts.down_proj [E, D, Fe]"),
        row("blk.{i}.ffn_gate_shexp.weight", "Fs, D", L + "mlp.shared_experts.gate_proj.weight",
            COL, "moe", when="shared_experts", src="constants.py FFN_GATE_SHEXP"),
        row("blk.{i}.ffn_up_shexp.weight", "Fs, D", L + "mlp.shared_experts.up_proj.weight",
            COL, "moe", when="shared_experts", src="constants.py FFN_UP_SHEXP"),
        row("blk.{i}.ffn_down_shexp.weight", "D, Fs", L + "mlp.shared_experts.down_proj.weight",
            ROW, "moe", when="shared_experts", src="constants.py FFN_DOWN_SHEXP"),
    ]
    if fused_gate_up:  # some deepseek2 files: llama.cpp create_tensor_gate_up_exps
        rows.insert(2, row(
            "blk.{i}.ffn_gate_up_exps.weight", "E, 2*Fe, D", _X + "{e}.{proj}.weight",
            Shard(ShardKind.COLUMN, 1, experts=True,
                  note="gate rows [0, Fe), up rows [Fe, 2Fe): split each half, not the whole"),
            "moe", transform="split_fused_gate_up", when="fused_gate_up",
            module=HF(_X + "gate_up_proj"),
            src="constants.py FFN_GATE_UP_EXP; llama-model.cpp create_tensor_gate_up_exps"))
    return tuple(rows)


# NextN / MTP: the last nextn_predict_layers blocks are full decoder blocks plus these
# (tensor_mapping.py NEXTN_*: model.layers.{bid}.eh_proj ...; loaders: glm4-moe.cpp,
# deepseek2.cpp, glm-dsa.cpp). transformers' modules do not build MTP layers.
NEXTN = (
    row("blk.{i}.nextn.eh_proj.weight", "D, 2*D", L + "eh_proj.weight", part="nextn",
        src="tensor_mapping.py NEXTN_EH_PROJ; loaders {2*n_embd, n_embd}"),
    row("blk.{i}.nextn.enorm.weight", "D", L + "enorm.weight", part="nextn",
        src="tensor_mapping.py NEXTN_ENORM"),
    row("blk.{i}.nextn.hnorm.weight", "D", L + "hnorm.weight", part="nextn",
        src="tensor_mapping.py NEXTN_HNORM"),
    row("blk.{i}.nextn.embed_tokens.weight", "vocab, D", L + "embed_tokens.weight", VOCAB,
        "nextn", required=False, src="tensor_mapping.py NEXTN_EMBED_TOKENS; TENSOR_NOT_REQUIRED"),
    row("blk.{i}.nextn.shared_head_head.weight", "vocab, D", L + "shared_head.head.weight",
        VOCAB, "nextn", required=False,
        src="tensor_mapping.py NEXTN_SHARED_HEAD_HEAD; TENSOR_NOT_REQUIRED"),
    row("blk.{i}.nextn.shared_head_norm.weight", "D", L + "shared_head.norm.weight",
        part="nextn", required=False,
        src="tensor_mapping.py NEXTN_SHARED_HEAD_NORM; TENSOR_NOT_REQUIRED"),
)
