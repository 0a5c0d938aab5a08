"""The probe protocol: the real probe in this interpreter, and interpreters that fail."""

from __future__ import annotations

import os
import platform
import stat
import sys
import textwrap
import time

import pytest

from ggufcheck.checks.environment import EnvOptions, run_environment_stage
from ggufcheck.checks.kernels import KernelOptions, run_plan
from ggufcheck.errors import ExitStatus
from ggufcheck.probe.runner import ProbeFailed, ProbeTarget, physical_device, run_probe
from ggufcheck.results import Status


def _fake_python(tmp_path, body: str, name: str = "python") -> str:
    """An 'interpreter' that is a shell script: it ignores the probe and does ``body``."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture(scope="module")
def env_run():
    """One real env probe in this interpreter (torch imports once for the tests below)."""
    request = {"packages": ["json", "this", "ggufcheck_surely_missing_pkg"], "scan_extensions": False}
    return run_probe("ggufcheck_probe_env.py", request, ProbeTarget(sys.executable, 0))


def test_real_env_probe_in_this_interpreter(env_run):
    from ggufcheck.checks.environment import environment_report

    assert env_run.done and env_run.returncode == 0
    by = {r.check: r for r in environment_report(env_run.messages).results}
    assert platform.python_version() in by["environment.python"].message
    assert by["environment.package.json"].status == Status.PASS
    assert by["environment.package.ggufcheck_surely_missing_pkg"].status == Status.SKIP
    assert by["environment.torch"].status == Status.PASS
    split = environment_report(env_run.messages).info["time"]  # where the probe's time went
    assert set(split["imports"]) == {"json", "this", "ggufcheck_surely_missing_pkg"}
    assert split["imports_s"] == round(sum(split["imports"].values()), 3) > 0 and split["scan_s"] == 0


def test_library_prints_cannot_corrupt_the_channel(env_run):
    # `import this` prints the Zen of Python to stdout in its child; the channel survives
    assert any(m.get("name") == "this" and m.get("status") == "ok" for m in env_run.messages)


def test_device_index_maps_through_the_parents_visible_devices():
    assert physical_device(1, "4,5,6") == "5"
    assert physical_device(2, None) == "2"
    with pytest.raises(ProbeFailed):
        physical_device(3, "4,5")
    env = ProbeTarget(sys.executable, 0).environment()
    assert env["CUDA_VISIBLE_DEVICES"] == physical_device(0, os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_nonexistent_interpreter_is_a_usage_error():
    with pytest.raises(ProbeFailed, match="not found") as info:
        run_environment_stage(EnvOptions(target=ProbeTarget("/nonexistent/bin/python3")))
    assert info.value.exit_status == ExitStatus.USAGE


def test_crashing_interpreter_reports_its_stderr_tail(tmp_path):
    python = _fake_python(tmp_path, """\
        echo "Fatal Python error: init_fs_encoding: failed to get the Python codec" >&2
        exit 1
        """)
    with pytest.raises(ProbeFailed) as info:
        run_environment_stage(EnvOptions(target=ProbeTarget(python)))
    assert "init_fs_encoding" in str(info.value)
    assert "exit status 1" in str(info.value)
    assert info.value.exit_status == ExitStatus.USAGE


def test_interpreter_killed_by_a_signal(tmp_path):
    python = _fake_python(tmp_path, "echo 'about to die' >&2\nkill -SEGV $$\n")
    with pytest.raises(ProbeFailed, match="SIGSEGV"):
        run_environment_stage(EnvOptions(target=ProbeTarget(python)))


def test_hanging_interpreter_times_out_and_is_killed(tmp_path):
    python = _fake_python(tmp_path, "sleep 60 &\nsleep 60\n")  # a child holds the pipes too
    started = time.monotonic()
    out = run_probe("ggufcheck_probe_env.py", {}, ProbeTarget(python), idle_timeout=1.0)
    assert time.monotonic() - started < 15
    assert out.timed_out and "no message for 1 s" in out.timed_out
    with pytest.raises(ProbeFailed, match="timed out"):
        out.require_done(python)


def _protocol_emulator(tmp_path, crash_case: str, mode: str) -> str:
    """A fake interpreter speaking the kernel protocol: dies (or hangs) in ``crash_case``."""
    py = tmp_path / "emulator.py"
    py.write_text(textwrap.dedent(f"""\
        import json, os, signal, sys, time
        req = json.load(sys.stdin)
        P = "@@ggufcheck-probe@@ "
        for c in req["cases"]:
            print(P + json.dumps({{"type": "start", "case": c["id"]}}), flush=True)
            if c["id"] == {crash_case!r}:
                if {mode!r} == "segv":
                    sys.stderr.write("illegal memory access\\n"); sys.stderr.flush()
                    os.kill(os.getpid(), signal.SIGSEGV)
                time.sleep(60)
            print(P + json.dumps({{"type": "result", "case": c["id"], "kind": c["kind"],
                                   "status": "PASS", "tier": "agrees", "message": "ok",
                                   "stats": {{}}}}), flush=True)
        print(P + json.dumps({{"type": "done"}}), flush=True)
        """))
    return _fake_python(tmp_path, f'exec "{sys.executable}" "{py}"\n', name="python-emulator")


@pytest.mark.parametrize("mode", ["segv", "hang"])
def test_a_case_that_kills_the_probe_fails_and_the_rest_still_run(tmp_path, mode):
    plan = [{"id": f"fake.{i}", "kind": "fake"} for i in range(4)]
    python = _protocol_emulator(tmp_path, "fake.1", mode)
    options = KernelOptions(target=ProbeTarget(python), case_timeout_s=2.0)
    answers, info = run_plan(plan, options, None)
    by = {a["case"]: a for a in answers}
    assert set(by) == {"fake.0", "fake.1", "fake.2", "fake.3"}
    assert by["fake.1"]["status"] == "FAIL" and by["fake.1"]["tier"] == "runs"
    assert ("SIGSEGV" in by["fake.1"]["message"]) if mode == "segv" else ("timed out" in by["fake.1"]["message"])
    assert all(by[c]["status"] == "PASS" for c in ("fake.0", "fake.2", "fake.3"))
    assert info["restarts"] == 1


def test_probe_scripts_import_no_ggufcheck():
    from ggufcheck.probe.runner import SCRIPTS

    for script in SCRIPTS.glob("ggufcheck_*.py"):
        text = script.read_text()
        assert "import ggufcheck." not in text and "from ggufcheck." not in text, script.name
    assert os.path.isfile(SCRIPTS / "ggufcheck_probe_kernels.py")


SYSTEM_PYTHON = "/usr/bin/python3"


def _python_without_torch() -> str:
    import subprocess

    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"{SYSTEM_PYTHON} not present")
    if subprocess.run([SYSTEM_PYTHON, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has torch")
    return SYSTEM_PYTHON


def test_target_without_torch_is_reported_not_crashed():
    python = _python_without_torch()
    env = run_environment_stage(EnvOptions(target=ProbeTarget(python), packages=("json",),
                                           scan_extensions=False))
    by = {r.check: r for r in env.results}
    assert by["environment.torch"].status == Status.FAIL and "torch" in by["environment.torch"].message
    from ggufcheck.checks.kernels import run_kernel_stage

    report = run_kernel_stage(KernelOptions(target=ProbeTarget(python), only=("rmsnorm",)))
    assert [r.check for r in report.results if r.status == Status.ERROR] == ["kernels.probe"]


def test_cli_env_with_a_missing_interpreter_exits_2_with_one_line(capsys):
    from ggufcheck.cli import COMMANDS, main

    if "env" not in COMMANDS:
        pytest.skip("the lead has not registered `env` in ggufcheck.cli.COMMANDS yet")
    assert main(["env", "--python", "/nonexistent/bin/python3"]) == ExitStatus.USAGE
    err = capsys.readouterr().err
    assert "target interpreter not found: /nonexistent/bin/python3" in err and "Traceback" not in err
