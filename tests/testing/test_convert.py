"""The converter pipeline: caching, races, clear errors, and llama.cpp agreeing with transformers.

The last test is the end-to-end check that a converted tiny file means what the HF model
means: llama.cpp (through llama-cpp-python) and transformers, two implementations we did
not write, give the same log-probabilities on the same tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ggufcheck.errors import GGUFCheckError, Unavailable
from ggufcheck.testing import convert

pytestmark = pytest.mark.hf


def test_cached_call_returns_the_same_files_without_rebuilding(tiny_converted):
    first = tiny_converted("llama", "f32")
    stamp = first.gguf_path.stat().st_mtime_ns
    again = convert.tiny_converted("llama", "f32")
    assert again == first and again.gguf_path.stat().st_mtime_ns == stamp
    config = json.loads((first.hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == convert.VOCAB_SIZE


@pytest.mark.slow
def test_two_processes_racing_on_a_cold_cache(tmp_path, tiny_converted):
    """Both get the same file; it is built once; it is byte-identical to the session cache's
    (HF build and conversion are deterministic across processes)."""
    warm = tiny_converted("llama", "f32")  # skips early if the converter is unavailable
    code = ("import sys; from ggufcheck.testing.convert import tiny_converted; "
            "print(tiny_converted('llama', 'f32', cache_dir=sys.argv[1]).gguf_path)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    root = tmp_path / "tiny-converted"
    built = sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))
    assert len(built) == 2 and any(n.endswith("-f32.gguf") for n in built)  # one HF dir, one GGUF
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp leftovers
    cold = root / warm.gguf_path.name
    assert str(cold) in paths and cold.read_bytes() == warm.gguf_path.read_bytes()


def test_hf_build_is_deterministic_per_seed(tmp_path):
    pytest.importorskip("transformers")
    a = convert.build_hf_tiny("qwen2", tmp_path / "a", seed=3)
    b = convert.build_hf_tiny("qwen2", tmp_path / "b", seed=3)
    c = convert.build_hf_tiny("qwen2", tmp_path / "c", seed=4)
    weights = [(d / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1] and weights[0] != weights[2]


def test_bad_llama_cpp_source_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("GGUFCHECK_LLAMA_CPP_SRC", str(tmp_path))
    with pytest.raises(Unavailable, match="convert_hf_to_gguf.py"):
        convert.llama_cpp_source()


@pytest.mark.slow
def test_converter_failure_reports_its_stderr(tmp_path, tiny_converted):
    tiny_converted("llama", "f32")  # skip early if the converter is unavailable
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(GGUFCheckError, match="NoSuchModelForCausalLM"):
        convert.convert_to_gguf(tmp_path, tmp_path / "out.gguf", "f32")


def test_unknown_arch_and_outtype_are_clear_errors(tmp_path):
    with pytest.raises(GGUFCheckError, match="unknown tiny arch"):
        convert.tiny_converted("gpt5", cache_dir=tmp_path)
    with pytest.raises(GGUFCheckError, match="unknown outtype"):
        convert.tiny_converted("llama", "q4_k", cache_dir=tmp_path)


def _llama_cpp_logprobs(path, tokens):
    llama_cpp = pytest.importorskip("llama_cpp")
    # F32 KV cache (GGML_TYPE_F32 = 0): the default F16 cache alone moves logits by ~1e-3
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=0, type_v=0)
    llm.eval(tokens)
    logits = np.array(llm.scores[:len(tokens)], dtype=np.float64)
    llm.close()
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)


def _transformers_logprobs(hf_dir, tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.llama
@pytest.mark.parametrize("arch", ["llama", "qwen3", "glm4moe", "deepseek2", "deepseek2-yarn", "glm-dsa"])
def test_llama_cpp_agrees_with_transformers(tiny_converted, arch):
    m = tiny_converted(arch, "f32")
    # positions far from 0 tell rope pairings apart; glm-dsa gets 8 tokens (= index_topk),
    # where its sparse attention equals dense attention
    n = 8 if arch == "glm-dsa" else 40
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, convert.VOCAB_SIZE, n)]
    ours = _llama_cpp_logprobs(m.gguf_path, tokens)
    theirs = _transformers_logprobs(m.hf_dir, tokens)
    diff = np.abs(ours - theirs).max()
    spread = np.abs(theirs[1:] - theirs[:-1]).max()  # how much positions differ at all
    # Measured (F32 KV cache): ~4e-7 for all but glm-dsa, 1.1e-4 there: transformers'
    # GlmMoeDsa hard-codes eps 1e-6 in q_a/kv_a_layernorm, llama.cpp uses the file's
    # rms eps (1e-5); with rms_norm_eps=1e-6 in the config the two agree to 3e-7.
    tolerance = 5e-4 if arch == "glm-dsa" else 2e-5
    assert diff < tolerance, f"{arch}: max |dlogprob| {diff:.2e}"
    assert spread > 50 * diff  # the agreement is not a flat output agreeing with itself
    if arch == "deepseek2-yarn":  # same weights as deepseek2: YaRN must be what makes it agree
        plain = _transformers_logprobs(tiny_converted("deepseek2", "f32").hf_dir, tokens)
        assert np.abs(ours - plain).max() > 10 * diff
