"""The host side of the probe protocol: run a probe script inside the target interpreter.

ggufcheck checks the environment the engine really runs in, which is usually not its own:
``--python PATH`` names the engine's interpreter. A probe is a standalone script (see
:mod:`ggufcheck.probe.scripts`) started as ``PATH SCRIPT`` with that interpreter's
environment, ``CUDA_VISIBLE_DEVICES`` narrowed to one device, a JSON request on stdin and
JSON lines back. It never hangs ggufcheck: an idle timeout (no message for N seconds) and a
total timeout kill the probe's whole process group. A missing or crashing interpreter is a
:class:`ProbeFailed` (exit status 2) carrying the tail of its stderr.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufcheck.errors import GGUFCheckError

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PREFIX = "@@ggufcheck-probe@@ "
STDERR_TAIL = 2000


class ProbeFailed(GGUFCheckError):
    """The target interpreter could not be started, crashed, or timed out."""


@dataclass(frozen=True)
class ProbeTarget:
    """Which interpreter and which GPU a probe runs on."""

    python: str = sys.executable
    device: int | None = 0  # index among the devices visible to ggufcheck; None: leave as is
    extra_env: tuple[tuple[str, str], ...] = ()

    def resolved_python(self) -> str:
        path = shutil.which(self.python) if os.sep not in self.python else self.python
        if not path or not os.path.isfile(path):
            raise ProbeFailed(f"target interpreter not found: {self.python}",
                              tip="pass --python with the path of the engine's python executable")
        if not os.access(path, os.X_OK):
            raise ProbeFailed(f"target interpreter is not executable: {path}")
        return path

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.device is not None:
            env["CUDA_VISIBLE_DEVICES"] = physical_device(self.device, env.get("CUDA_VISIBLE_DEVICES"))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(dict(self.extra_env))
        return env


def physical_device(index: int, visible: str | None) -> str:
    """Device ``index`` as the child's CUDA_VISIBLE_DEVICES, honouring the parent's own list."""
    if index < 0:
        raise ProbeFailed(f"--device must be >= 0, not {index}")
    if visible is None or visible.strip() == "":
        return str(index)
    listed = [d.strip() for d in visible.split(",") if d.strip()]
    if index >= len(listed):
        raise ProbeFailed(f"--device {index}: CUDA_VISIBLE_DEVICES={visible!r} lists only "
                          f"{len(listed)} device(s)")
    return listed[index]


@dataclass
class ProbeOutput:
    """Everything one probe process said, and how it ended."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""
    returncode: int | None = None
    timed_out: str | None = None  # why it was killed, if it was
    elapsed_s: float = 0.0

    @property
    def done(self) -> bool:
        return any(m.get("type") == "done" for m in self.messages)

    @property
    def last_started(self) -> str | None:
        """The case that started but sent no result: where a crash or hang happened."""
        finished = {m.get("case") for m in self.messages if m.get("type") == "result"}
        started = [m.get("case") for m in self.messages if m.get("type") == "start"]
        pending = [c for c in started if c not in finished]
        return pending[-1] if pending else None

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("type") == kind]

    def stderr_tail(self, n: int = STDERR_TAIL) -> str:
        return self.stderr[-n:].strip()

    def how_it_ended(self) -> str:
        if self.timed_out:
            return self.timed_out
        rc = self.returncode
        if rc is not None and rc < 0:
            try:
                return f"killed by signal {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exit status {rc}"

    def require_done(self, python: str) -> None:
        """Raise :class:`ProbeFailed` unless the probe finished its protocol."""
        if self.done and self.returncode == 0:
            return
        tail = self.stderr_tail()
        raise ProbeFailed(
            f"probe in {python} failed ({self.how_it_ended()})"
            + (f"; stderr tail:\n{tail}" if tail else "; no stderr"),
            tip="run that interpreter by hand: does `PYTHON -c 'import torch'` work?",
        )


def run_probe(
    script: str,
    request: dict[str, Any],
    target: ProbeTarget = ProbeTarget(),
    *,
    idle_timeout: float = 120.0,
    total_timeout: float = 1800.0,
) -> ProbeOutput:
    """Run ``scripts/<script>`` in the target interpreter; never hangs past the timeouts.

    ``idle_timeout``: seconds without any protocol message (a hung kernel);
    ``total_timeout``: the whole run.
    """
    python = target.resolved_python()
    path = SCRIPTS / script
    try:
        proc = subprocess.Popen(
            [python, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=target.environment(),
            start_new_session=True,
        )
    except OSError as err:
        raise ProbeFailed(f"cannot start target interpreter {python}: {err}") from None
    out = ProbeOutput()
    started = time.monotonic()
    try:
        proc.stdin.write(json.dumps(request).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died at once; its stderr says why
    _pump(proc, out, started, idle_timeout, total_timeout)
    out.elapsed_s = time.monotonic() - started
    return out


def _pump(proc: subprocess.Popen, out: ProbeOutput, started: float,
          idle_timeout: float, total_timeout: float) -> None:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    buffers = {"stdout": b"", "stderr": b""}
    err_chunks: list[bytes] = []
    last_progress = time.monotonic()
    open_streams = 2
    while open_streams:
        now = time.monotonic()
        wait = min(idle_timeout - (now - last_progress), total_timeout - (now - started))
        if wait <= 0:
            case = out.last_started
            where = f" in case {case}" if case else ""
            why = (f"timed out{where}: no message for {idle_timeout:.0f} s"
                   if now - started < total_timeout else
                   f"timed out{where}: total time over {total_timeout:.0f} s")
            out.timed_out = why
            _kill_group(proc)
            break
        for key, _ in sel.select(timeout=wait):
            chunk = os.read(key.fileobj.fileno(), 1 << 16)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.data == "stderr":
                err_chunks.append(chunk)
                continue
            buffers["stdout"] += chunk
            *lines, buffers["stdout"] = buffers["stdout"].split(b"\n")
            for line in lines:
                text = line.decode("utf-8", "replace")
                if text.startswith(PREFIX):
                    try:
                        out.messages.append(json.loads(text[len(PREFIX):]))
                        last_progress = time.monotonic()
                    except json.JSONDecodeError:
                        err_chunks.append(b"[unparsable probe message] " + line + b"\n")
    sel.close()
    try:
        out.returncode = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out.returncode = proc.wait()
    out.stderr = b"".join(err_chunks).decode("utf-8", "replace")[-50_000:]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
