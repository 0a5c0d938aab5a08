"""Real activations for the kernel cases, computed by ggufcheck's reference model.

Random inputs miss what breaks kernels in practice: outlier channels, large logits,
near-tied router scores. With ``--model`` the kernel stage feeds each kernel tensors the
model itself produces (fp32 reference, CPU) for a batch of random token ids:

- attention: layer 0's real q/k/v after RoPE. GQA models: per head q, k, v. MLA models:
  the naive prefill form (q = [q_nope, q_pe], k = [k_b c, k_pe], v = v_b c) and the
  absorbed decode form (q = [k_b^T q_nope, q_pe] of the last token, k = [c, k_pe], v = c);
  softmax scale as the model uses it (YaRN mscale included);
- RMSNorm: the residual stream entering a deeper layer (after a few real layers) with that
  layer's attn_norm weight; MLA's kv latent before attn_kv_a_norm;
- router: the normed input of the first MoE layer and that layer's real router.

Dimension letters: T tokens, H heads, G kv heads, D hidden, P/R/V/L MLA dims.
"""

from __future__ import annotations

from typing import Any

MAX_LAYERS_RUN = 4  # layers run to reach a deeper residual / the first MoE layer


def real_activations(path, n_tokens: int = 128, seed: int = 0) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors for the probe's data file, notes saying what each one is)."""
    import torch

    from ggufcheck.reference import mla as mla_ops
    from ggufcheck.reference.layers import apply_rope, linear, rms_norm
    from ggufcheck.reference.model import ReferenceModel

    data: dict[str, Any] = {}
    notes: dict[str, str] = {}
    with ReferenceModel(path, dtype=torch.float32, device="cpu") as ref:
        cfg = ref.cfg
        vocab = ref.gguf.tensors["token_embd.weight"].shape[0]
        tokens = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
        pos = torch.arange(n_tokens)
        h = ref.embed(tokens)  # [T, D]
        w0 = ref.weights.layer(0)
        x0 = rms_norm(h, w0["attn_norm.weight"], cfg.rms_eps)  # layer-0 attention input [T, D]
        data["activations"] = x0
        cos, sin = ref.rope(pos, 0)
        if cfg.is_mla:
            data.update(_mla_attention(cfg, w0, x0, cos, sin, mla_ops, apply_rope))
            kv = linear(x0, w0["attn_kv_a_mqa.weight"])  # [T, L+R]
            data[f"rmsnorm.{cfg.kv_lora_rank}"] = {"x": kv[:, : cfg.kv_lora_rank],
                                                   "w": w0["attn_kv_a_norm.weight"]}
            notes["attention"] = (f"real layer-0 MLA q/k/v of {n_tokens} random tokens (reference "
                                  "model, fp32): naive prefill and absorbed decode forms")
        else:
            data.update(_gqa_attention(cfg, w0, x0, cos, sin, apply_rope, rms_norm, linear))
            notes["attention"] = f"real layer-0 q/k/v after RoPE of {n_tokens} random tokens (reference model, fp32)"
        target = min(cfg.n_dense_lead if cfg.n_expert else MAX_LAYERS_RUN, MAX_LAYERS_RUN, cfg.n_layer - 1)
        for i in range(target):
            h = ref.run_layer(i, h, pos).hidden  # [T, D]
        wt = ref.weights.layer(target)
        data[f"rmsnorm.{cfg.n_embd}"] = {"x": h, "w": wt["attn_norm.weight"]}
        notes["rmsnorm"] = f"the residual stream entering layer {target} and its attn_norm"
        if cfg.is_moe_layer(target) and "ffn_gate_inp.weight" in wt:
            after_attn = ref.run_layer(target, h, pos).after_attn
            data["router_input"] = rms_norm(after_attn, wt["ffn_norm.weight"], cfg.rms_eps)
            data["router.w"] = wt["ffn_gate_inp.weight"]
            if "exp_probs_b.bias" in wt:
                data["router.bias"] = wt["exp_probs_b.bias"]
            notes["router"] = f"layer {target}'s real router on its real normed input"
    return data, notes


def _heads_first(t):
    """[T, H, d] -> [1, H, T, d], the SDPA layout."""
    return t.transpose(0, 1).unsqueeze(0).contiguous()


def _gqa_attention(cfg, w, x, cos, sin, apply_rope, rms_norm, linear) -> dict:
    n_tok = x.shape[0]
    q = linear(x, w["attn_q.weight"], w.get("attn_q.bias")).view(n_tok, cfg.n_head, cfg.head_dim_k)
    k = linear(x, w["attn_k.weight"], w.get("attn_k.bias")).view(n_tok, cfg.n_head_kv, cfg.head_dim_k)
    v = linear(x, w["attn_v.weight"], w.get("attn_v.bias")).view(n_tok, cfg.n_head_kv, cfg.head_dim_v)
    if "attn_q_norm.weight" in w:
        q = rms_norm(q, w["attn_q_norm.weight"], cfg.rms_eps)
        k = rms_norm(k, w["attn_k_norm.weight"], cfg.rms_eps)
    q, k = apply_rope(q, cos, sin, cfg.rope_mode), apply_rope(k, cos, sin, cfg.rope_mode)
    return {"attn.gqa": {"q": _heads_first(q), "k": _heads_first(k), "v": _heads_first(v),
                         "scale": cfg.kq_scale}}


def _mla_attention(cfg, w, x, cos, sin, mla_ops, apply_rope) -> dict:
    import torch

    n_tok = x.shape[0]
    _qr, q_nope, q_pe = mla_ops.project_q(cfg, w, x)  # [T, H, P], [T, H, R]
    c, k_pe = mla_ops.project_kv(cfg, w, x)  # [T, L], [T, 1, R]
    q_pe = apply_rope(q_pe, cos, sin, cfg.rope_mode)
    k_pe = apply_rope(k_pe, cos, sin, cfg.rope_mode)[:, 0]  # [T, R]
    k_b, v_b = mla_ops.kv_b_split(cfg, w)  # [H, L, P], [H, V, L]
    k_nope = torch.einsum("sc,hcd->shd", c, k_b)  # [T, H, P]
    v = torch.einsum("sc,hec->she", c, v_b)  # [T, H, V]
    q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, P+R]
    k = torch.cat((k_nope, k_pe[:, None].expand(n_tok, cfg.n_head, cfg.qk_rope)), dim=-1)  # [T, H, P+R]
    q_abs = torch.einsum("thd,hcd->thc", q_nope, k_b)  # [T, H, L]
    q_dec = torch.cat((q_abs, q_pe), dim=-1)[-1:]  # [1, H, L+R]: the last token decodes
    k_dec = torch.cat((c, k_pe), dim=-1)[:, None]  # [T, 1, L+R]: one latent key for all heads
    v_dec = c[:, None]  # [T, 1, L]
    return {"attn.prefill": {"q": _heads_first(q), "k": _heads_first(k), "v": _heads_first(v),
                             "scale": cfg.kq_scale},
            "attn.decode": {"q": _heads_first(q_dec), "k": _heads_first(k_dec), "v": _heads_first(v_dec),
                            "scale": cfg.kq_scale}}
