"""``--engine vllm[:tp=N,dtype=D,max_model_len=N,...]``: the real vLLM, driven in its own interpreter.

vLLM and its tensor-parallel workers run in the engine's interpreter (``--python PATH``;
default: this one, when vLLM imports here). ggufcheck starts a small worker script there
(:mod:`ggufcheck.probe.scripts.ggufcheck_vllm_worker`) and talks to it over a local
socket: JSON requests, numpy arrays back. Through ``LLM.collective_rpc`` the worker sees
every rank, so this engine offers what an HTTP endpoint cannot:

- ``score``: the FULL next-token distribution at every position, from vLLM's own final
  hidden states and its own ``compute_logits`` (LM head + logits processor);
- ``score_batch`` (one real vLLM batch), ``score_chunked`` (vLLM's scheduler with a small
  token budget, i.e. chunked prefill), ``generate`` (greedy; every step's distribution
  comes from the decode forward pass, not from the prefill);
- ``layer_outputs``: per decoder layer the residual stream, the attention and MLP outputs;
- ``weight(hf_name, rank)``: the parameter a rank really holds. Merged vLLM parameters
  (``qkv_proj``, ``gate_up_proj``) are split back with their own shard metadata; GGUF
  quantized parameters come back as their raw bytes (uint8) for a byte-exact comparison.

It answers in the checkpoint layout (``Capabilities.weight_layout``): vLLM's modules are
the HF ones (its llama applies NEOX rope, so q/k rows must be in checkpoint order, not
in the rope-permuted order llama.cpp's converter stores; see docs/real-world-cases.md).

Process hygiene: the worker runs in its own process group, which is killed on close, on a
timeout and at interpreter exit; nothing is left behind.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ggufcheck.engines.base import (
    LAYER_KINDS,
    Capabilities,
    Engine,
    Generation,
    LayerTrace,
    Switch,
    TokenLogprobs,
    Unsupported,
    log_softmax,
    reasons,
)
from ggufcheck.errors import EngineUnreachable, Unavailable, UsageError

WORKER = Path(__file__).resolve().parent.parent / "probe" / "scripts" / "ggufcheck_vllm_worker.py"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM merges these checkpoint projections into one parameter; the shard ids its GGUF
# plug-in records in ``shard_offset_map`` (and the order of ``output_partition_sizes``)
PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "0"), "up_proj": ("gate_up_proj", "1")}
READ_BATCH_BYTES = 256 << 20
SETUP_TIP = "install it with `bash tools/vllm/setup.sh` and pass --python .venv-vllm/bin/python"


@dataclass(frozen=True)
class VllmOptions:
    """What ``--engine vllm:...`` may set (and the worker's time limits)."""

    tp: int = 1
    dtype: str = "fp32"
    max_model_len: int = 512
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU
    start_timeout: float = 900.0  # seconds for vLLM to load the model
    request_timeout: float = 600.0  # seconds per request
    python: str | None = None  # the engine's interpreter (default: this one)
    # serve the HF checkpoint ggufcheck exports from the GGUF (ggufcheck export) instead of
    # the GGUF through the plug-in: for architectures the plug-in refuses (deepseek2, glm4moe)
    export: bool = False
    # the settings a user flips (checks.switches): eager mode (0: CUDA graphs where vLLM uses
    # them), the prefix cache, the KV cache's dtype
    eager: bool = True
    prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    ep: bool = False  # expert parallelism: each rank holds whole experts, a share of them (enable_expert_parallel)


def parse_options(rest: str, spec: str) -> VllmOptions:
    """``tp=2,dtype=bf16,max_model_len=1024`` -> :class:`VllmOptions` (UsageError naming the spec)."""
    opts = VllmOptions()
    ints = {"tp", "max_model_len", "kv_cache_gib"}
    floats = {"start_timeout", "request_timeout"}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--engine {spec}: bad option {item!r}", tip="options are key=value, comma-separated")
        if key in ints:
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"--engine {spec}: {key} must be a positive integer, not {value!r}")
            opts = replace(opts, **{key: int(value)})
        elif key in floats:
            try:
                opts = replace(opts, **{key: float(value)})
            except ValueError:
                raise UsageError(f"--engine {spec}: {key} must be a number of seconds, not {value!r}") from None
        elif key == "python":
            opts = replace(opts, python=value)
        elif key in ("export", "eager", "prefix_caching", "ep"):
            if value not in ("0", "1"):
                raise UsageError(f"--engine {spec}: {key} must be 0 or 1, not {value!r}")
            opts = replace(opts, **{key: value == "1"})
        elif key == "kv_cache_dtype":
            if value not in KV_CACHE_DTYPES:
                raise UsageError(f"--engine {spec}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                 f"not {value!r}")
            opts = replace(opts, kv_cache_dtype=value)
        elif key == "dtype":
            if value not in DTYPES:
                raise UsageError(f"--engine {spec}: dtype must be one of {', '.join(DTYPES)}, not {value!r}")
            opts = replace(opts, dtype=value)
        else:
            known = sorted(ints | floats | {"dtype", "python", "export", "eager", "prefix_caching", "kv_cache_dtype",
                                            "ep"})
            raise UsageError(f"--engine {spec}: unknown option {key!r}", tip=f"known: {', '.join(known)}")
    return opts


def held_experts(meta: dict) -> list[int]:
    """The global ids of the routed experts a rank's fused expert parameter holds: all of them,
    or under expert parallelism those its ``expert_map`` (global id -> local slot, -1 elsewhere)
    places here."""
    expert_map = meta.get("expert_map")
    if expert_map is None:
        return list(range(meta["shape"][0]))
    return [g for g, slot in enumerate(expert_map) if slot >= 0]


def local_expert(meta: dict, global_id: int) -> int | None:
    """The slot of global expert ``global_id`` in a rank's fused expert parameter (None: not here)."""
    expert_map = meta.get("expert_map")
    if expert_map is None:
        return global_id
    slot = expert_map[global_id] if 0 <= global_id < len(expert_map) else -1
    return None if slot < 0 else int(slot)


def vllm_switches(options: VllmOptions) -> tuple[Switch, ...]:
    """The settings of this vLLM a user flips to find a cause (checks.switches), each where it is
    not at its safe value."""
    out = []
    if not options.eager:
        out.append(Switch({"eager": 1}, {"eager": 0}, "CUDA graphs (captured decode steps)", "decode"))
    if options.prefix_caching:
        out.append(Switch({"prefix_caching": 0}, {"prefix_caching": 1}, "the prefix cache", "kv-cache"))
    if options.kv_cache_dtype != "auto":
        out.append(Switch({"kv_cache_dtype": "auto"}, {"kv_cache_dtype": options.kv_cache_dtype},
                          f"a {options.kv_cache_dtype} KV cache", "kv-cache"))
    if options.tp > 1:
        out.append(Switch({"tp": 1}, {"tp": options.tp}, "tensor parallelism (one rank holds every weight instead)",
                          "sharding"))
    return tuple(out)


def check_tp(model_path: str | Path, tp: int) -> None:
    """A TP size must divide the attention heads (vLLM refuses otherwise): say so before starting."""
    if tp == 1:
        return
    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(model_path) as model:
        arch = model.metadata.get("general.architecture")
        heads = model.metadata.get(f"{arch}.attention.head_count")
        kv = model.metadata.get(f"{arch}.attention.head_count_kv", heads)
    for what, n in (("attention heads", heads), ("key/value heads", kv)):
        if isinstance(n, int) and n % tp and not (what == "key/value heads" and tp % n == 0):
            raise UsageError(f"--engine vllm:tp={tp}: {Path(model_path).name} has {n} {what}, "
                             f"which {tp} ranks cannot split", tip="choose a TP size that divides the head counts")


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


class _Worker:
    """The worker process and its connection: requests with time limits, a clear error on death."""

    def __init__(self, python: str, env: dict[str, str], log_path: Path, start_timeout: float):
        from multiprocessing.connection import Listener

        self.log_path = log_path
        self._dir = tempfile.mkdtemp(prefix="ggufcheck-vllm-")
        address = os.path.join(self._dir, "socket")
        authkey = secrets.token_bytes(16)
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = {**env, "GGUFCHECK_VLLM_ADDRESS": address, "GGUFCHECK_VLLM_AUTHKEY": authkey.hex()}
        self._log = open(log_path, "wb")
        try:
            self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as err:
            self._listener.close()
            raise Unavailable(f"cannot start the vLLM interpreter {python}: {err}", tip=SETUP_TIP) from None
        atexit.register(_reap, self.proc)
        self.conn = None
        accepted: list[Any] = []
        thread = threading.Thread(target=lambda: accepted.append(self._accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + min(start_timeout, 120.0)
        while thread.is_alive() and time.monotonic() < deadline and self.proc.poll() is None:
            thread.join(0.2)
        if not accepted or accepted[0] is None:
            note = self._tail_note()
            self.close()
            raise EngineUnreachable(f"the vLLM worker in {python} did not connect ({self._ended()})" + note,
                                    tip=SETUP_TIP)
        self.conn = accepted[0]

    def _accept(self):
        try:
            return self._listener.accept()
        except OSError:
            return None

    def _ended(self) -> str:
        rc = self.proc.poll()
        if rc is None:
            return "still running, silent"
        return f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"

    def tail(self, n: int = 3000) -> str:
        try:
            if not self._log.closed:
                self._log.flush()
            data = self.log_path.read_bytes()[-n:]
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    def _tail_note(self) -> str:
        tail = self.tail(1200).strip()
        return f"; its log ({self.log_path}) ends:\n{tail}" if tail else ""

    def request(self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None,
                timeout: float = 600.0) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        if self.conn is None:
            raise EngineUnreachable("the vLLM worker is closed")
        try:
            self.conn.send_bytes(json.dumps({**header, "arrays": list(arrays or {})}).encode())
            for value in (arrays or {}).values():
                buf = io.BytesIO()
                np.save(buf, np.asarray(value), allow_pickle=False)
                self.conn.send_bytes(buf.getvalue())
            deadline = time.monotonic() + timeout
            while not self.conn.poll(max(0.0, min(0.5, deadline - time.monotonic()))):
                if self.proc.poll() is not None:
                    raise EngineUnreachable(f"the vLLM worker died during {header.get('op', 'start')} "
                                            f"({self._ended()})" + self._tail_note())
                if time.monotonic() > deadline:
                    note = self._tail_note()
                    self.close()
                    raise EngineUnreachable(f"the vLLM worker did not answer {header.get('op', 'start')} "
                                            f"within {timeout:.0f} s (killed)" + note)
            reply = json.loads(self.conn.recv_bytes().decode())
            out = {name: np.load(io.BytesIO(self.conn.recv_bytes()), allow_pickle=False)
                   for name in reply.get("arrays", [])}
        except (EOFError, OSError, BrokenPipeError) as err:
            raise EngineUnreachable(f"lost the vLLM worker during {header.get('op', 'start')}: "
                                    f"{type(err).__name__} ({self._ended()})" + self._tail_note()) from None
        return reply, out

    def close(self) -> None:
        from ggufcheck.interrupts import interrupted

        if self.conn is not None:
            try:
                if self.proc.poll() is None and not interrupted():  # a signal: kill at once, not after its request
                    self.conn.send_bytes(json.dumps({"op": "close"}).encode())
                    if self.conn.poll(5):
                        self.conn.recv_bytes()
            except (EOFError, OSError):
                pass
            self.conn.close()
            self.conn = None
        _reap(self.proc)
        try:
            self._listener.close()
        except OSError:
            pass
        try:
            self._log.close()
        except OSError:
            pass


def _cached(kind: str, model_path: Path) -> Path:
    """``$GGUFCHECK_CACHE/KIND/STEM-KEY`` (default ~/.cache/ggufcheck, as the test models'
    cache): one folder per file version (path, size, mtime)."""
    st = model_path.stat()
    key = hashlib.sha256(f"{model_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("GGUFCHECK_CACHE") or Path.home() / ".cache" / "ggufcheck")
    return root / kind / f"{model_path.stem}-{key}"


def _config_dir(model_path: Path) -> Path:
    """Where the config.json + tokenizer generated from this GGUF are kept."""
    return _cached("vllm-config", model_path)


def _export_dir(model_path: Path) -> Path:
    """The HF checkpoint exported from this GGUF (made once per file version, then reused)."""
    from ggufcheck.arch.export import export_checkpoint

    out = _cached("vllm-export", model_path)
    if not (out / "config.json").is_file():
        export_checkpoint(model_path, out)  # config.json last: a half-written export is redone
    return out


def build_config_dir(model_path: str | Path, python: str, timeout: float = 300.0) -> Path:
    """config.json + tokenizer for serving ``model_path`` with vLLM's GGUF plug-in
    (``vllm serve M.gguf --tokenizer DIR --hf-config-path DIR``), made offline by
    transformers in vLLM's interpreter; cached per file version."""
    out = _config_dir(Path(model_path))
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([python, str(WORKER), "--config", str(Path(model_path).resolve()), str(out)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not (out / "config.json").is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(f"could not build a vLLM config for {Path(model_path).name}: {tail[0][:300]}")
    return out


def _cpu_binding(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``tp`` ranks: the cores split evenly (vLLM's automatic
    binding fails on small machines)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // tp)
    groups = []
    for r in range(tp):
        mine = cores[r * per:(r + 1) * per] or [cores[r % len(cores)]]
        groups.append(",".join(str(c) for c in mine))
    return "|".join(groups)


class VllmEngine(Engine):
    """vLLM in its own interpreter, ranks reached through ``collective_rpc`` (module docstring)."""

    def __init__(self, model_path: str | Path, options: VllmOptions = VllmOptions(), *, python: str | None = None):
        self.model_path = Path(model_path)
        self.options = options
        python = options.python or python or sys.executable
        if python == sys.executable and not _imports_here("vllm"):
            raise UsageError(f"vLLM is not installed in {python}", tip=SETUP_TIP)
        check_tp(self.model_path, options.tp)
        config_dir = _config_dir(self.model_path)
        config_dir.parent.mkdir(parents=True, exist_ok=True)
        served = self.model_path.resolve()
        if options.export:
            served = config_dir = _export_dir(self.model_path)
        env = dict(os.environ)
        env.update(VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        env.setdefault("GGUFCHECK_VLLM_CPU_COMPAT", "auto")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.kv_cache_gib))
        if options.tp > 1:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_binding(options.tp))
        self._logdir = tempfile.mkdtemp(prefix="ggufcheck-vllm-log-")
        started = time.monotonic()
        self._worker = _Worker(python, env, Path(self._logdir) / "vllm.log", options.start_timeout)
        request = {"model": str(served), "config_dir": str(config_dir), "tp": options.tp,
                   "dtype": DTYPES[options.dtype], "max_model_len": options.max_model_len,
                   "eager": options.eager, "prefix_caching": options.prefix_caching,
                   "kv_cache_dtype": options.kv_cache_dtype, "ep": options.ep}
        hello, _ = self._worker.request(request, timeout=options.start_timeout)
        if not hello.get("ok"):
            self._worker.close()
            if "No module named 'vllm" in str(hello.get("error", "")):
                raise UsageError(_start_error(hello, self.model_path, python), tip=SETUP_TIP)
            raise EngineUnreachable(_start_error(hello, self.model_path, python),
                                    tip="ggufcheck export MODEL.gguf OUT/ writes an HF checkpoint vLLM can serve "
                                        "without the GGUF plug-in" if _refused_arch(hello) else None)
        self.startup_s = time.monotonic() - started
        self.info = hello
        self.vocab_size = int(hello["vocab_size"])
        self.n_layers = int(hello["n_layers"])
        self._params: list[dict[str, Any]] | None = None
        self._read_cache: dict[int, dict[str, np.ndarray]] = {}
        device = str(hello.get("device", "cpu"))
        compat = hello.get("compat") or []
        # On CUDA the plug-in's kernels quantize activations to 8-bit blocks (the "a8" in
        # ggml_mul_mat_a8); on CPU the compatibility layer computes in the model dtype.
        quantized = _has_quantized_blocks(self.model_path) and not options.export
        act = "q8" if quantized and device.startswith("cuda") else options.dtype
        what = "exported checkpoint of " if options.export else ""
        self.name = (f"vllm {hello.get('vllm')} tp={options.tp} {options.dtype} on {device} "
                     f"({what}{self.model_path.name})")
        self.capabilities = Capabilities(
            tokenize=True, score=True, full_vocab=True, max_top_k=self.vocab_size, generate=True, batch=True,
            chunked_prefill=bool(hello.get("chunking")),
            layer_outputs=frozenset(k for k in hello.get("kinds", []) if k in LAYER_KINDS),
            weights=True, tp_size=options.tp, activation_dtype=act, weight_layout="checkpoint",
            switches=vllm_switches(options), expert_parallel=options.ep and options.tp > 1,
            max_sequence=options.max_model_len - 1,  # a score asks for one more token's logits
            reasons=reasons(chunked_prefill=str(hello.get("chunking_why", ""))),
        )
        self._compat = compat

    # ---- tokenization ------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        reply, _ = self._request({"op": "tokenize", "texts": [text], "add_special": add_special})
        return [int(t) for t in reply["ids"][0]]

    def detokenize(self, tokens: Sequence[int]) -> str:
        reply, _ = self._request({"op": "detokenize", "ids": [int(t) for t in tokens]})
        return str(reply["text"])

    # ---- forward passes ------------------------------------------------------------------
    def _request(self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None):
        reply, out = self._worker.request(header, arrays, timeout=self.options.request_timeout)
        if not reply.get("ok"):
            message = str(reply.get("error", "unknown error")).splitlines()[0][:400]
            died = self._worker_death()
            if died:  # the error a request sees after a rank died says nothing of the death: say it
                raise EngineUnreachable(f"vLLM failed {header.get('op')}: {died} (then: {message})",
                                        tip=f"vLLM's log: {self._worker.log_path}")
            raise Unsupported(f"vLLM failed {header.get('op')}: {message}")
        return reply, out

    def _worker_death(self) -> str | None:
        """Which of vLLM's rank processes died and how, where vLLM's log says one did; else None."""
        try:
            with open(self._worker.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, 2) - (1 << 20)))
                tail = f.read().decode("utf-8", "replace")
        except OSError:
            return None
        found = re.findall(r"Worker proc (\S+) died unexpectedly \(exit code: ([^)]*)\)", tail)
        if not found:
            return None
        proc, code = found[-1]
        signal_name = {"-11": "SIGSEGV", "-9": "SIGKILL", "-6": "SIGABRT"}.get(code.strip())
        return (f"vLLM's rank process {proc} died (exit code {code.strip()}"
                + (f": {signal_name}" if signal_name else "") + ")")

    def _check(self, seqs: list[list[int]], new_tokens: int) -> None:
        for s in seqs:
            if not s:
                raise ValueError("cannot score an empty token sequence")
            if len(s) + new_tokens > self.options.max_model_len:
                raise Unsupported(f"sequence of {len(s) + new_tokens} tokens exceeds this engine's "
                                  f"max_model_len={self.options.max_model_len}")

    def _forward(self, seqs: list[list[int]], *, mode: str = "single", new_tokens: int = 1, chunk: int = 0,
                 layers: bool = False):
        self._check(seqs, new_tokens)
        reply, out = self._request({"op": "forward", "seqs": seqs, "mode": mode, "new_tokens": new_tokens,
                                    "chunk": chunk, "layers": layers})
        return reply, out

    def _tables(self, seqs: list[list[int]], reply: dict[str, Any], out: dict[str, np.ndarray]) -> list[TokenLogprobs]:
        tables = []
        for i, s in enumerate(seqs):
            found = np.array(reply["found"][i][:len(s)], dtype=bool)  # positions vLLM computed
            lp = np.zeros((len(s), self.vocab_size), dtype=np.float32)
            lp[found] = log_softmax(out[f"logits{i}"][:found.sum()], np.float32)  # rows in position order
            tables.append(TokenLogprobs(s, self.vocab_size, lp, present=found))
        return tables

    def score(self, tokens: Sequence[int], *, top_k: int = 20) -> TokenLogprobs:
        seq = [int(t) for t in tokens]
        reply, out = self._forward([seq])
        return self._tables([seq], reply, out)[0]

    def score_batch(self, batch: Sequence[Sequence[int]], *, top_k: int = 20) -> list[TokenLogprobs]:
        seqs = [[int(t) for t in s] for s in batch]
        reply, out = self._forward(seqs, mode="batch")
        return self._tables(seqs, reply, out)

    def score_chunked(self, tokens: Sequence[int], chunk_size: int, *, top_k: int = 20) -> TokenLogprobs:
        if not self.capabilities.chunked_prefill:
            raise Unsupported(self.capabilities.why_not("chunked_prefill"))
        seq = [int(t) for t in tokens]
        reply, out = self._forward([seq], mode="chunked", chunk=int(chunk_size))
        return self._tables([seq], reply, out)[0]

    def score_cached(self, tokens: Sequence[int], cached: int, *, top_k: int = 20) -> TokenLogprobs:
        """``tokens`` scored after a request for their first ``cached`` tokens filled vLLM's
        prefix cache: the rows vLLM computed (present) read the cached blocks' KV."""
        if not self.info.get("prefix_caching"):
            raise Unsupported("vLLM was started with prefix caching off")
        seq = [int(t) for t in tokens]
        reply, out = self._forward([seq], mode="cached", chunk=int(cached))
        return self._tables([seq], reply, out)[0]

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, top_k: int = 20) -> Generation:
        prompt = [int(t) for t in prompt]
        reply, out = self._forward([prompt], new_tokens=max_new_tokens)
        generated = [int(t) for t in reply["generated"][0]][:max_new_tokens]
        seq = prompt + generated
        full = self._tables([seq[:-1]], reply, out)[0]  # rows 0 .. P+N-2 (the last token is never fed)
        n = len(seq)
        lp = np.zeros((n, self.vocab_size), dtype=np.float32)
        lp[:n - 1] = full.logprobs
        present = np.zeros(n, dtype=bool)
        present[len(prompt) - 1:n - 1] = full.present[len(prompt) - 1:]
        return Generation(np.array(prompt), np.array(generated), TokenLogprobs(seq, self.vocab_size, lp, present=present))

    def layer_outputs(self, tokens: Sequence[int], kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        seq = [int(t) for t in tokens]
        reply, out = self._forward([seq], layers=True)
        return self._trace(seq, out, kinds)

    def decode_layer_outputs(self, tokens: Sequence[int], prompt_length: int,
                             kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        """The first ``prompt_length`` tokens in vLLM's prefill, then its own decode steps, every
        forward captured: the rows past the prompt come from one-token decode steps. vLLM feeds
        the tokens it samples, so the rest of ``tokens`` must be its greedy continuation (as a
        generation of this engine is); another is refused, naming where it parts."""
        seq = [int(t) for t in tokens]
        p = max(1, min(int(prompt_length), len(seq)))
        if p == len(seq):
            return self.layer_outputs(seq, kinds)
        reply, out = self._forward([seq[:p]], new_tokens=len(seq) - p + 1, layers=True)
        generated = [int(t) for t in reply["generated"][0]]
        if generated[:len(seq) - p] != seq[p:]:
            at = next(i for i, (a, b) in enumerate(zip(generated, seq[p:])) if a != b)
            raise Unsupported(f"vLLM's greedy decode took token {generated[at]} at position {p + at} where the "
                              f"sequence has {seq[p + at]}: a decode trace feeds vLLM's own greedy tokens")
        return self._trace(seq, out, kinds)

    def _trace(self, seq: list[int], out: dict[str, np.ndarray], kinds: Sequence[str]) -> LayerTrace:
        """The per-layer arrays of sequence 0 the worker returned, by kind and layer, per rank."""
        tensors: dict[tuple[str, int], np.ndarray] = {}
        names: dict[tuple[str, int], str] = {}
        modules = {"residual": "layers.{i}", "attention": "layers.{i}.self_attn", "ffn": "layers.{i}.mlp",
                   "router": "layers.{i}.mlp.experts.router",
                   "rope": "layers.{i}.self_attn.rotary_emb"}
        per_rank: dict[int, dict[tuple[str, int], np.ndarray]] = {}
        for key, value in out.items():
            if not key.startswith("layer0."):  # sequence 0
                continue
            _, rank, kind, layer = key.split(".")
            if kind not in kinds and not (kind in ("ropepos", "ropeqheads") and "rope" in kinds):
                continue
            if rank == "0":
                tensors[(kind, int(layer))] = value
                names[(kind, int(layer))] = "model." + modules.get(kind, kind).format(i=layer)
            else:
                per_rank.setdefault(int(rank), {})[(kind, int(layer))] = value
        return LayerTrace(np.array(seq), tensors, names, per_rank)

    # ---- loaded weights ---------------------------------------------------------------------
    def held_parameters(self, rank: int = 0) -> dict[str, dict[str, Any]]:
        """Every parameter rank ``rank`` holds (vLLM names) with its shard metadata."""
        if self._params is None:
            reply, _ = self._request({"op": "params"})
            self._params = reply["ranks"]
        return self._params[rank]

    def held_weight_names(self, *, rank: int = 0) -> list[str]:
        """The held parameters by checkpoint name: merged ones split back into their parts."""
        parts = {}
        for proj, (merged, _) in PACKED.items():
            parts.setdefault(merged, []).append(proj)
        out = []
        held = self.held_parameters(rank)
        absorbed = any(n.endswith("#absorbed") for n in held)
        for name in held:
            module, _, leaf = name.rpartition(".")
            if leaf == "qweight_type" or name.endswith("#absorbed") or (absorbed and leaf in ("W_UK_T", "W_UV")):
                continue  # W_UK_T / W_UV are audited folded back into kv_b_proj
            expert = re.match(r"^(.*\.mlp\.experts)\.(?:[a-z_]+\.)?(w13_weight|w2_weight)$", name)
            if expert:
                projs = ("gate_proj", "up_proj") if expert[2] == "w13_weight" else ("down_proj",)
                out += [f"{expert[1]}.{e}.{p}.weight" for e in held_experts(held[name]) for p in projs]
                continue
            leaf = "weight" if leaf == "qweight" else leaf
            parent, _, proj = module.rpartition(".")
            for part in parts.get(proj, [proj]):
                out.append(f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}")
        return out

    def vllm_name(self, hf_name: str, rank: int = 0) -> tuple[str, str | None]:
        """(the vLLM parameter holding ``hf_name``, the shard id inside it or None)."""
        module, _, leaf = hf_name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        shard = None
        held = self.held_parameters(rank)
        if proj in PACKED:  # merged only where vLLM merged it (MLA's q_proj stands alone)
            merged, merged_shard = PACKED[proj]
            if any(n.startswith(f"{parent}.{merged}.") for n in held):
                module, shard = f"{parent}.{merged}", merged_shard
        candidates = (f"{module}.qweight", f"{module}.{leaf}") if leaf == "weight" else (f"{module}.{leaf}",)
        for name in candidates:
            if name in held:
                return name, shard
        raise Unsupported(f"vLLM holds no parameter for {hf_name} on rank {rank} (looked for "
                          f"{' and '.join(candidates)})")

    def weight(self, hf_name: str, *, rank: int = 0) -> np.ndarray:
        if not 0 <= rank < self.options.tp:
            raise Unsupported(f"rank {rank} outside this engine's TP size {self.options.tp}")
        held = self.held_parameters(rank)
        if f"{hf_name}#absorbed" in held:  # MLA: what the attention kernels use, folded back
            return self._read(f"{hf_name}#absorbed", rank)
        expert = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", hf_name)
        if expert:
            return self._expert(expert[1], int(expert[2]), expert[3], rank)
        name, shard = self.vllm_name(hf_name, rank)
        meta = held[name]
        value = self._read(name, rank)
        if shard is not None:
            offsets = meta.get("shard_offset_map")
            if offsets:  # GGUF-quantized merged parameter: rows [start, end), first row_bytes bytes
                start, end, width = offsets[shard]
                value = value[start:end, :width]
            else:
                sizes = meta.get("output_partition_sizes")
                if not sizes:
                    raise Unsupported(f"{name} on rank {rank} carries no shard metadata to split {hf_name} out")
                order = ["q", "k", "v"] if shard in ("q", "k", "v") else ["0", "1"]
                at = order.index(shard)
                lo = sum(sizes[:at])
                value = value[lo:lo + sizes[at]]
        rows = meta.get("vocab_rows")
        if rows is not None:  # a vocab-parallel shard: drop vLLM's padding rows
            value = value[:rows[1] - rows[0]]
        return np.ascontiguousarray(value)

    def _expert(self, base: str, e: int, proj: str, rank: int) -> np.ndarray:
        """One routed expert's projection out of vLLM's fused ``w13_weight`` [E, 2 * Fe_rank, D]
        (gate rows, then up rows) or ``w2_weight`` [E, D, Fe_rank]."""
        want = "w2_weight" if proj == "down_proj" else "w13_weight"
        held = self.held_parameters(rank)
        name = next((n for n in held if n.startswith(base + ".") and n.endswith(want)), None)
        if name is None:
            raise Unsupported(f"vLLM holds no {want} under {base} on rank {rank}")
        local = local_expert(held[name], e)
        if local is None:
            raise Unsupported(f"expert {e} of {base} is not on rank {rank} (expert parallelism: its expert_map)")
        w = self._read(name, rank)[local]
        if proj == "down_proj":
            return np.ascontiguousarray(w)
        half = w.shape[0] // 2
        return np.ascontiguousarray(w[:half] if proj == "gate_proj" else w[half:])

    def _read(self, name: str, rank: int) -> np.ndarray:
        """One held parameter of one rank. Reads are batched: the parameters that follow it on
        that rank come along, up to READ_BATCH_BYTES, so an audit costs few round trips while
        memory stays bounded on a large model."""
        cache = self._read_cache.setdefault(rank, {})
        if name not in cache:
            cache.clear()
            held = self.held_parameters(rank)
            order = list(held)
            start = order.index(name) if name in order else 0
            batch, size = [name], 0
            for other in order[start:]:
                meta = held[other]
                nbytes = int(np.prod(meta["shape"])) * (1 if meta["dtype"] == "uint8" else 4)
                if other != name and size + nbytes > READ_BATCH_BYTES:
                    break
                if other != name and not other.endswith("qweight_type"):
                    batch.append(other)
                size += nbytes
            _, out = self._request({"op": "read_many", "names": batch, "rank": rank})
            cache.update(out)
        if name not in cache:
            raise Unsupported(f"vLLM rank {rank} could not hand over {name}")
        return cache[name]

    def write_rows(self, vllm_name: str, rank: int, rows: tuple[int, int], value: np.ndarray) -> None:
        """Fault injection for tests: overwrite rows of one parameter on one rank of the live engine."""
        self._request({"op": "write", "name": vllm_name, "rank": rank, "rows": list(rows)}, {"value": value})
        self._params = None
        self._read_cache = {}

    # ---- lifecycle ------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out.update(vllm=self.info.get("vllm"), gguf_plugin=self.info.get("plugin"), torch=self.info.get("torch"),
                   tp=self.options.tp, device=self.info.get("device"), attention=self.info.get("attention"),
                   startup_s=round(self.startup_s, 1),
                   logits="full vocabulary: vLLM's compute_logits on its own final hidden states",
                   cpu_compat=self._compat)
        return out

    def close(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.close()
            self._worker = None


def _imports_here(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _has_quantized_blocks(model_path: Path) -> bool:
    from ggufcheck.gguf.reader import open_gguf

    with open_gguf(model_path) as model:
        return any(t.qtype.name not in ("F32", "F16", "BF16") for t in model.tensors.values()
                   if t.name.startswith("blk.") and len(t.ne) >= 2)


def _refused_arch(hello: dict[str, Any]) -> bool:
    err = str(hello.get("error", ""))
    return any(s in err for s in ("Unknown gguf model_type", "Failed to map GGUF parameters",
                                  "not supported", "is not supported"))


def _start_error(hello: dict[str, Any], model_path: Path, python: str) -> str:
    err = str(hello.get("error", "unknown error"))
    first = err.splitlines()[0][:300] if err else "unknown error"
    if "No module named 'vllm" in err:
        return f"vLLM is not installed in {python} ({first})"
    arch = ""
    try:
        from ggufcheck.gguf.reader import open_gguf

        with open_gguf(model_path) as model:
            arch = str(model.metadata.get("general.architecture", ""))
    except Exception:  # noqa: BLE001
        pass
    what = f" ({arch})" if arch else ""
    return f"vLLM could not load {model_path.name}{what}: {first}"
