"""Plan before running: each stage's peak memory and time for this file on this host.

A 402 GB GLM-5 is not a model to discover the limits of by being killed. Before any stage
runs, :func:`plan_resources` estimates from the file's tensor table (no weight read) and a
one-second calibration of this host (dequantization and fp64 matmul rates) what every stage
will hold and how long it will take, then decides:

- the weight cache (``reference/weights.py``): the whole model in the working dtype when it
  fits the budget left beside the largest stage, else float32 entries (compact) up to that
  budget, the rest streamed on every pass;
- the device of the reference: a GPU where one is present with room for its working set
  (``--reference-device auto``), else the CPU;
- refusal: when a stage's estimate passes ``--max-memory`` (default 80% of the memory
  available now), the run stops before it starts, naming the stage, what fills it and the
  cheaper options (fewer tokens, no long decode or sweep, a subset of layers, a GPU).

The estimates are upper bounds built from the terms below (their sum, not measured), and
``benchmarks/scale.py`` prints them beside the measured peaks. A reference pass over T tokens:

- fixed: the interpreter with torch and numba's compiled kernels, and the freed heap memory
  glibc is told to keep (``runtime.keep_freed_memory``): ``BASE_BYTES``;
- weights in flight: at most a few row blocks and one expert (``reference/weights.py``);
- activations: ~``ACTIVATION_COPIES`` [T, D] tensors per layer in flight, the attention's
  per-head projections ([S, H, d] keys and values of the naive MLA form), one block of scores
  (``SCORES_BYTES``, three copies: scores, mask, softmax);
- the logits [T, V] and their log-softmax table (the table is what the checks keep);
- a traced pass (the layers stage) keeps four [T, D] states per layer.

Time: weights touched (every non-expert tensor, and ``min(E, T x K)`` experts per MoE layer)
times the calibrated cost of dequantizing one, plus 2 x T x active weights of fp64 arithmetic.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ggufcheck.runtime import TRIM_THRESHOLD_BYTES

GIB = 1 << 30
# python + torch + numba with its kernels compiled + the opened file's metadata (measured 0.50 GiB
# after one GLM-5-dims pass), and up to the trim threshold of freed heap memory that glibc keeps
BASE_BYTES = int(0.5 * GIB) + TRIM_THRESHOLD_BYTES
ACTIVATION_COPIES = 14  # [T, D]-sized tensors alive in one layer of the reference (residual, norms, projections)
DEFAULT_MEMORY_SHARE = 0.8  # --max-memory default: this share of the memory available at start
CACHE_SHARE = 0.25  # the weight cache takes at most this share of the memory available
CACHE_CAP = 2 * GIB  # ... and at most this much, whatever the host (small models that fit stay resident)


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total: int
    free: int


@dataclass(frozen=True)
class Host:
    """What this machine offers now."""

    cpus: int
    ram_total: int
    ram_available: int
    gpus: tuple[GPU, ...] = ()

    def describe(self) -> str:
        gpus = ", ".join(f"{g.name} {g.free / GIB:.0f}/{g.total / GIB:.0f} GiB free" for g in self.gpus) or "no GPU"
        return f"{self.cpus} CPUs, {self.ram_available / GIB:.1f} of {self.ram_total / GIB:.1f} GiB available; {gpus}"


def probe_host(with_gpus: bool = True) -> Host:
    """This machine's CPUs, memory and (when torch sees CUDA) GPUs with their free memory."""
    from ggufcheck.runtime import usable_cores

    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total, avail = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
        with open("/proc/meminfo") as f:  # MemAvailable counts reclaimable page cache (SC_AVPHYS_PAGES does not)
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (ValueError, OSError):
        total = avail = 8 * GIB
    gpus: list[GPU] = []
    if with_gpus:
        try:
            import torch

            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    free, tot = torch.cuda.mem_get_info(i)
                    gpus.append(GPU(i, torch.cuda.get_device_name(i), int(tot), int(free)))
        except Exception:  # noqa: BLE001 - no GPU is an answer, not an error
            gpus = []
    return Host(usable_cores(), int(total), int(avail), tuple(gpus))


# ---------------------------------------------------------------------------------------
# the model, from its tensor table


@dataclass(frozen=True)
class ModelFacts:
    """What the estimates need, read from the tensor table and the config (no weight read)."""

    name: str
    file_bytes: int
    n_weights: int
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    head_k: int  # per-head query/key dims the scores contract (MLA: P + R)
    head_v: int
    kv_expand: int  # per key: the widest expanded projection per head, summed over heads (naive MLA: H(P+V))
    layer_fixed: tuple[int, ...]  # per layer: weights read whatever the tokens (all but routed experts)
    per_expert: tuple[int, ...]  # per layer: weights of one routed expert (0: dense layer)
    n_expert: int
    n_expert_used: int
    indexer_top_k: int
    largest_tensor: int  # elements
    whole_tensors: int  # elements of the per-head 3-D tensors a layer reads whole at once (MLA's k_b and v_b)

    def touched(self, layer: int, tokens: int) -> int:
        """Weights a pass over ``tokens`` tokens reads in ``layer`` (at most)."""
        experts = min(self.n_expert, tokens * self.n_expert_used) if self.per_expert[layer] else 0
        return self.layer_fixed[layer] + experts * self.per_expert[layer]

    def active(self, layer: int) -> int:
        """Weights one token multiplies with in ``layer``."""
        return self.layer_fixed[layer] + self.n_expert_used * self.per_expert[layer]


def model_facts(gguf: Any, cfg: Any) -> ModelFacts:
    """:class:`ModelFacts` of an opened file and its ReferenceConfig."""
    fixed = [0] * cfg.n_layer
    per_expert = [0] * cfg.n_layer
    whole = [0] * cfg.n_layer
    for name, info in gguf.tensors.items():
        if not name.startswith("blk."):
            continue
        layer = int(name.split(".")[1])
        if layer >= cfg.n_layer:
            continue  # NextN layers are not run
        if "_exps." in name and len(info.shape) >= 2 and cfg.n_expert:
            per_expert[layer] += info.n_elements // cfg.n_expert
        else:
            fixed[layer] += info.n_elements
            if len(info.shape) == 3:
                whole[layer] += info.n_elements
    n_head = cfg.n_head
    if cfg.is_mla:
        head_k, head_v = cfg.qk_nope + cfg.qk_rope, cfg.v_head
        kv_expand = n_head * (cfg.qk_nope + cfg.v_head)
    else:
        head_k, head_v = cfg.head_dim_k, cfg.head_dim_v
        kv_expand = n_head * (head_k + head_v)  # GQA keys / values repeated to every query head
    return ModelFacts(
        name=str(getattr(gguf, "path", "")), file_bytes=int(gguf.file_size),
        n_weights=sum(t.n_elements for t in gguf.tensors.values()), n_layer=cfg.n_layer, n_embd=cfg.n_embd,
        n_vocab=cfg.n_vocab, n_head=n_head, head_k=head_k, head_v=head_v, kv_expand=kv_expand,
        layer_fixed=tuple(fixed), per_expert=tuple(per_expert), n_expert=cfg.n_expert,
        n_expert_used=cfg.n_expert_used, indexer_top_k=cfg.indexer_top_k if cfg.has_indexer else 0,
        largest_tensor=max(t.n_elements for t in gguf.tensors.values()), whole_tensors=max(whole, default=0),
    )


# ---------------------------------------------------------------------------------------
# this host's rates


@dataclass(frozen=True)
class Rates:
    """Seconds per weight dequantized to fp64, and fp64 flops per second, on the chosen device."""

    dequant_s: float
    flops: float
    device: str

    @staticmethod
    def calibrate(gguf: Any, device: str = "cpu") -> "Rates":
        """Time the file's own largest 2-D tensor type (~4M weights, twice: the second counts)
        and a [256, 2048] x [2048, 2048] fp64 product. About a second."""
        import torch

        from ggufcheck.gguf.dequant import dequantize_tensor, dequantize_wide

        matrices = [t for t in gguf.tensors.values() if len(t.shape) >= 2]
        info = max(matrices, key=lambda t: t.n_elements) if matrices else next(iter(gguf.tensors.values()))
        rows = max(1, min(info.n_rows, (4 << 20) // max(1, info.row_elements)))
        dequant = math.inf
        for _ in range(2):
            t0 = time.perf_counter()
            if device == "cpu":
                dequantize_wide(gguf, info.name, 0, rows)
            else:
                dequantize_tensor(gguf, info.name, rows=slice(0, rows), device=device).to(torch.float64)
                torch.cuda.synchronize()
            dequant = min(dequant, (time.perf_counter() - t0) / (rows * info.row_elements))
        a = torch.randn(256, 2048, dtype=torch.float64, device=device)
        b = torch.randn(2048, 2048, dtype=torch.float64, device=device)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            (a @ b).sum().item()
            best = min(best, time.perf_counter() - t0)
        return Rates(dequant, 2 * 256 * 2048 * 2048 / best, device)


# ---------------------------------------------------------------------------------------
# one reference pass, and the stages


def pass_peak(m: ModelFacts, tokens: int, traced: bool = False, itemsize: int = 8) -> int:
    """Peak bytes of one reference pass over ``tokens`` tokens (besides the fixed base and the
    weight cache)."""
    from ggufcheck.reference import layers, weights

    t, d = tokens, m.n_embd
    weights_in_flight = (3 * weights.BLOCK_BYTES + min(m.largest_tensor * itemsize, weights.ROW_BLOCK_BYTES)
                         + m.whole_tensors * itemsize)
    activations = ACTIVATION_COPIES * t * d * itemsize + t * m.n_head * (m.head_k + m.head_v) * itemsize
    keys = t * m.kv_expand * itemsize  # the naive form's per-head keys and values over the whole prompt
    scores = 3 * min(layers.SCORES_BYTES, m.n_head * t * t * itemsize)
    if m.indexer_top_k:
        scores += 3 * t * t * itemsize  # the indexer's [T, S] scores, their mask and the top-k mask
    logits = 2 * t * m.n_vocab * 8  # logits and their log-softmax table (float64)
    trace = 4 * m.n_layer * t * d * itemsize if traced else 0
    return weights_in_flight + activations + keys + scores + logits + trace


def pass_seconds(m: ModelFacts, tokens: int, rates: Rates, cached: float = 0.0) -> float:
    """Seconds of one reference pass over ``tokens`` tokens; ``cached``: share of the weights
    the cache serves (not dequantized again)."""
    read = sum(m.touched(i, tokens) for i in range(m.n_layer)) * (1 - cached)
    flops = 2 * tokens * sum(m.active(i) for i in range(m.n_layer))
    flops += 2 * m.n_layer * m.n_head * tokens * tokens * (m.head_k + m.head_v)  # scores and the weighted sum
    flops += 2 * tokens * m.n_vocab * m.n_embd  # the output head
    return read * rates.dequant_s + flops / rates.flops + 2 * m.n_vocab * m.n_embd * 8 / 10e9 * (1 - cached)


@dataclass
class StageEstimate:
    stage: str
    peak: int  # bytes, the cache and the base excluded
    seconds: float
    what: str  # what fills it / what it runs


@dataclass
class ResourcePlan:
    host: Host
    model: ModelFacts
    max_memory: int
    device: str  # where the reference runs
    cache_budget: int
    compact: bool
    stages: list[StageEstimate] = field(default_factory=list)
    refusal: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return BASE_BYTES + self.cache_budget + max((s.peak for s in self.stages), default=0)

    def to_json(self) -> dict:
        return {"host": self.host.describe(), "max_memory": self.max_memory, "reference_device": self.device,
                "weight_cache": {"budget": self.cache_budget, "compact": self.compact},
                "stages": [{"stage": s.stage, "peak": s.peak, "seconds": round(s.seconds, 1), "what": s.what}
                           for s in self.stages],
                "estimated_peak": self.peak, "refusal": self.refusal, "notes": self.notes}


def plan_resources(options: Any, gguf: Any, cfg: Any, host: Host, rates: Rates,
                   engine: Any = None, max_memory: int | None = None) -> ResourcePlan:
    """The plan of one ``diagnose`` (``options``: :class:`~ggufcheck.diagnose.session.DiagnoseOptions`)."""
    m = model_facts(gguf, cfg)
    limit = max_memory or int(DEFAULT_MEMORY_SHARE * host.ram_available)
    item = 8
    prompts = max(1, options.max_prompts or 4)
    t_prompt = options.max_tokens
    long_prompt = m.indexer_top_k + 32 if m.indexer_top_k else 0
    longest = max(t_prompt, options.decode_to or 0, options.sweep_to or 0, long_prompt)
    stages: list[StageEstimate] = []
    read_all = m.n_weights * rates.dequant_s
    stages.append(StageEstimate("file", int(0.2 * GIB), read_all / 2 if options.health else 1.0,
                                "the health scan: 64 MB of the file at a time"))
    if options.tp:
        stages.append(StageEstimate("sharding", int(1.0 * GIB), read_all / 4, "one layer of each kind, sharded"))
    engine_kind = engine.name if engine is not None else ""  # (an EngineSpec; None: an engine given open)
    in_process = engine_kind in ("reference", "hf", "hf-gguf")
    engine_bytes = 0
    if engine_kind in ("hf", "hf-gguf"):
        from ggufcheck.engines.spec import hf_dtype_device

        dtype, device = hf_dtype_device(engine.text, engine.rest)
        if device == "cpu":  # transformers holds the model here
            engine_bytes = m.n_weights * {"bf16": 2, "fp16": 2, "fp64": 8}.get(dtype, 4)
    experts = getattr(options, "experts", None)
    if experts is not None and m.n_expert:  # --experts: the other experts' rows are not read
        left_out = sum(m.per_expert) * (m.n_expert - len(experts))
        stages.append(StageEstimate("weights", engine_bytes + int(0.5 * GIB), (m.n_weights - left_out) * rates.dequant_s,
                                    f"every tensor the engine holds, of the routed experts {len(experts)} of "
                                    f"{m.n_expert}"))
    else:
        stages.append(StageEstimate("weights", engine_bytes + int(0.5 * GIB), read_all, "every tensor the engine holds"))
    chosen = getattr(options, "layers", None)
    if chosen is not None:  # --layers: those layers replayed, nothing else read; no served stage
        share = len(chosen) / m.n_layer
        stages[0].seconds *= share
        stages[-1].seconds *= share
        layer_s = sum(pass_seconds(m, t_prompt, rates) * m.touched(i, t_prompt) /
                      max(1, sum(m.touched(j, t_prompt) for j in range(m.n_layer))) for i in chosen)
        stages.append(StageEstimate("layers", engine_bytes + 2 * pass_peak(m, t_prompt, itemsize=item)
                                    - 2 * 2 * t_prompt * m.n_vocab * 8 + 4 * m.n_layer * prompts * t_prompt * m.n_embd * 4,
                                    2 * prompts * layer_s, f"layers {', '.join(map(str, chosen))} replayed on the "
                                    f"engine's input ({prompts} prompts of {t_prompt} tokens, fp64 and fp32)"))
        return _finish(ResourcePlan(host, m, limit, "cpu", 0, False, stages), options, host, item)
    traced = 2 * pass_peak(m, t_prompt, traced=True, itemsize=item) + 4 * m.n_layer * prompts * t_prompt * m.n_embd * 4
    stages.append(StageEstimate("layers", engine_bytes + traced,
                                2 * prompts * pass_seconds(m, t_prompt, rates),
                                f"{prompts} prompts of {t_prompt} tokens traced through every layer (fp64 and fp32)"))
    tables = 3 * longest * m.n_vocab * 8  # engine, reference and baseline tables of the longest sequence
    served_peak = engine_bytes + pass_peak(m, longest, itemsize=item) + tables
    ref_passes = [t_prompt] * (3 * prompts) + [options.decode_to or t_prompt, t_prompt] * 2
    if options.sweep_to:
        ref_passes += [options.sweep_to] * 2
    if long_prompt:
        ref_passes += [long_prompt] * 2
    seconds = sum(pass_seconds(m, t, rates) for t in ref_passes)
    what = (f"{len(ref_passes)} reference passes (longest {longest} tokens), tables of {longest} x {m.n_vocab} "
            "on each side")
    if engine_kind == "reference":  # the engine under test is ggufcheck's own: its decode steps cost here too
        steps = 2 * max(options.decode_to - t_prompt, options.new_tokens) + 3 * options.new_tokens
        chunks = prompts * math.ceil(t_prompt / 5)
        seconds += steps * pass_seconds(m, 1, rates) + chunks * pass_seconds(m, 5, rates) \
            + (len(ref_passes) // 2) * pass_seconds(m, t_prompt, rates)
        what += f"; the reference as the engine: {steps} decode steps and {chunks} 5-token chunks, each a pass"
    stages.append(StageEstimate("served", served_peak, seconds, what))
    return _finish(ResourcePlan(host, m, limit, "cpu", 0, False, stages), options, host, item)


def _finish(plan: ResourcePlan, options: Any, host: Host, item: int) -> ResourcePlan:
    """The refusal, the weight cache and the reference's device, from the stages' estimates."""
    m, limit, stages = plan.model, plan.max_memory, plan.stages
    working = BASE_BYTES + max(s.peak for s in stages)
    if working > limit:
        worst = max(stages, key=lambda s: s.peak)
        plan.refusal = (f"the {worst.stage} stage needs ~{worst.peak / GIB:.1f} GiB ({worst.what}) beside "
                        f"{BASE_BYTES / GIB:.1f} GiB of ggufcheck itself, over the {limit / GIB:.1f} GiB allowed "
                        f"(--max-memory; this host: {host.describe()})")
    model_bytes = m.n_weights * item
    budget = max(0, min(limit - working, int(CACHE_SHARE * host.ram_available), CACHE_CAP))
    # the fp32 baseline run reads every weight too: when both copies fit, both stay (on SmolLM2
    # the baseline otherwise dequantized every tensor on every one of its ~10 passes)
    both = m.n_weights * (item + 4) if item == 8 and getattr(options, "baseline", "none") != "none" else 0
    if both and both <= budget:
        plan.cache_budget, plan.compact = both, False
    elif model_bytes <= budget:
        plan.cache_budget, plan.compact = model_bytes, False
    else:
        plan.cache_budget, plan.compact = budget, True
        share = min(1.0, budget / max(1, m.n_weights * 4))
        plan.notes.append(f"the model is {model_bytes / GIB:.1f} GiB in fp64: the cache keeps "
                          f"{share:.0%} of it (float32), the rest is read again on every pass")
    plan.device = _reference_device(options, host, working)
    return plan


def _reference_device(options: Any, host: Host, working: int) -> str:
    """``--reference-device``: cpu, cuda[:N], or auto: the GPU with the most free memory when
    it has room for the reference's working set (twice it: the engine may share the card)."""
    wanted = getattr(options, "reference_device", "auto") or "auto"
    if wanted != "auto":
        return wanted
    if host.gpus:
        best = max(host.gpus, key=lambda g: g.free)
        if best.free > 2 * working:
            return f"cuda:{best.index}"
    return "cpu"


def cheaper_options(plan: ResourcePlan) -> str:
    """What to pass instead when a stage does not fit."""
    tips = ["--max-tokens 32", "--decode-to 0", "--sweep-to 0", "--layers 0,1 (a subset of the layers)"]
    if not plan.host.gpus:
        tips.append("a host with a GPU (the reference runs there)")
    tips.append("--max-memory with more, where the host has it")
    return ", ".join(tips)


def format_plan(plan: ResourcePlan) -> list[str]:
    """The plan as lines for the terminal (printed before the first stage)."""
    m = plan.model
    lines = [f"plan: {m.n_weights / 1e9:.2f}e9 weights, {m.file_bytes / 1e9:.2f} GB, {m.n_layer} layers"
             f"{f', {m.n_expert} experts' if m.n_expert else ''}; {plan.host.describe()}",
             f"  memory allowed {plan.max_memory / GIB:.1f} GiB; weight cache {plan.cache_budget / GIB:.1f} GiB"
             f"{' (float32)' if plan.compact else ''}; reference on {plan.device}"]
    for s in plan.stages:
        lines.append(f"  {s.stage:<9} ~{(BASE_BYTES + plan.cache_budget + s.peak) / GIB:5.1f} GiB  "
                     f"~{_duration(s.seconds):>8}  {s.what}")
    lines += [f"  {note}" for note in plan.notes]
    return lines


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
