"""``ggufcheck export``: the checkpoint transformers loads by itself computes what the GGUF does.

Independent check: transformers' own ``from_pretrained`` on the written folder (its config
parsing, its safetensors loading, its modeling code) against ggufcheck's fp64 reference on
the GGUF.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ggufcheck.arch.families import FAMILIES

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.mark.parametrize("arch", sorted(FAMILIES))  # every family exports (arch/families.py)
def test_exported_checkpoint_matches_the_reference(arch, tmp_path):
    import torch
    import transformers

    from ggufcheck.arch.export import export_checkpoint
    from ggufcheck.engines.reference import ReferenceEngine
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    model = build_tiny_gguf(arch, tmp_path / f"{arch}.gguf", qtypes="Q8_0", seed=2).path
    out = tmp_path / "ckpt"
    summary = export_checkpoint(model, out)
    assert summary["files"] == 1 and (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    if arch == "deepseek2":
        assert config["topk_method"] == "noaux_tc" and config["scoring_func"] == "sigmoid"
    tokens = [5, 300, 17, 260, 99, 400, 3, 77, 301, 12]
    # transformers' GlmMoeDsa hard-codes eps 1e-6 in the MLA q_a / kv_a norms, ignoring the config
    # (tests/reference/test_vs_transformers.py): the reference is told the same to compare
    options = {"lora_norm_eps": 1e-6} if arch == "glm-dsa" else {}
    ref = ReferenceEngine(model, dtype="fp64", **options).score(tokens).logprobs
    kw = {"experts_implementation": "eager"} if config.get("n_routed_experts") else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, **kw)
    with torch.no_grad():
        got = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].double(), -1).numpy()
    assert np.abs(got - ref).max() < 1e-5  # fp64 both sides; glm4moe measured 1.3e-6
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("hello there")) == "hello there"


@pytest.mark.slow
def test_export_bad_input_is_one_line_and_exit_2(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "ggufcheck", "export", str(tmp_path / "nope.gguf"),
                              str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 60)
    bad = subprocess.run([sys.executable, "-m", "ggufcheck", "export", str(junk), str(tmp_path / "out2")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "junk.gguf" in bad.stderr and "Traceback" not in bad.stderr
