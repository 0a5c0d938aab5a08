"""``--engine llama-server[:bin=PATH,n_gpu_layers=N,...]``: llama.cpp's own HTTP server, started by ggufcheck.

The deployments users run are servers, not a Python binding: ``llama-server`` has its own
slots, prompt cache, chat templating and batching, which llama-cpp-python does not exercise.
This adapter starts the binary on the model (a free port on 127.0.0.1, its log in a temporary
file), waits until it answers ``/health``, and judges it through the HTTP engine's
llama-server dialect (engines/http.py); closing the engine stops the server. The binary is
``bin=``, else ``$GGUFCHECK_LLAMA_SERVER``, else ``llama-server`` on ``PATH``.

Options (each one llama-server flag): ``n_gpu_layers`` (-ngl; above 0 the baseline rounds as
llama.cpp's CUDA backend), ``n_ctx`` (-c, default 4096: the length sweep needs 520),
``flash_attn`` (-fa on|off), ``type_k`` / ``type_v`` (-ctk / -ctv: f16, q8_0, ...),
``threads`` (-t), ``parallel`` (-np, default 1), ``timeout`` (seconds to wait for the model to
load, default 120), ``spec_draft`` (speculative decoding with the file's NextN / MTP head:
``--spec-type draft-mtp --spec-draft-n-max N``; the mtp stage then judges the drafts the server
accepts, checks.mtp ``mtp.served_acceptance``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ggufcheck.engines.base import Switch
from ggufcheck.engines.http import HttpEngine, HttpOptions
from ggufcheck.errors import EngineUnreachable, Unavailable, UsageError

OPTIONS = {"bin": str, "n_gpu_layers": int, "n_ctx": int, "flash_attn": int, "type_k": str, "type_v": str,
           "threads": int, "parallel": int, "timeout": float, "spec_draft": int}
_FLAGS = {"n_gpu_layers": "-ngl", "n_ctx": "-c", "threads": "-t", "parallel": "-np", "type_k": "-ctk",
          "type_v": "-ctv"}
BINARY_ENV = "GGUFCHECK_LLAMA_SERVER"


def parse_options(rest: str, spec: str) -> dict[str, Any]:
    """``key=value,...`` -> typed options (a UsageError naming the spec for a bad one)."""
    out: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in OPTIONS:
            raise UsageError(f"--engine {spec}: unknown option {item!r}", tip=f"options: {', '.join(OPTIONS)}")
        try:
            out[key] = OPTIONS[key](value)
        except ValueError:
            raise UsageError(f"--engine {spec}: {key}={value!r} is not {OPTIONS[key].__name__}") from None
    return out


def server_binary(given: str | None) -> str:
    """The llama-server to start (Unavailable, with the ways to name one, when none is found)."""
    for candidate in (given, os.environ.get(BINARY_ENV), shutil.which("llama-server")):
        if candidate:
            path = shutil.which(candidate) or candidate
            if Path(path).is_file() and os.access(path, os.X_OK):
                return str(path)
            if candidate == given:
                raise Unavailable(f"bin={given}: no executable llama-server there")
    raise Unavailable("no llama-server binary found (bin=PATH, $GGUFCHECK_LLAMA_SERVER or PATH)",
                      tip="build llama.cpp's server (cmake --build build --target llama-server) and pass "
                          "--engine llama-server:bin=build/bin/llama-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServerEngine(HttpEngine):
    """llama-server on the model, started here and stopped by :meth:`close`."""

    def __init__(self, model_path: str | Path, options: dict[str, Any] | None = None, *,
                 http_options: HttpOptions = HttpOptions()):
        opts = dict(options or {})
        self.settings = opts
        binary = server_binary(opts.pop("bin", None))
        wait = float(opts.pop("timeout", 120.0))
        opts.setdefault("n_ctx", 4096)
        opts.setdefault("parallel", 1)
        port = _free_port()
        cmd = [binary, "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
        for key, value in opts.items():
            if key == "flash_attn":
                cmd += ["-fa", "on" if int(value) else "off"]
            elif key == "spec_draft":
                cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(int(value))]
            else:
                cmd += [_FLAGS[key], str(value)]
        self._log = tempfile.NamedTemporaryFile("w+", prefix="ggufcheck-llama-server-", suffix=".log", delete=False)
        self._proc: subprocess.Popen | None = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                                               stdin=subprocess.DEVNULL)
        self.command = cmd
        try:
            self._wait_healthy(port, wait)
            backend = "&backend=cuda" if int(opts.get("n_gpu_layers", 0) or 0) > 0 else ""
            super().__init__(f"http://127.0.0.1:{port}?kind=llama-server{backend}", model_path=model_path,
                             options=http_options)
        except BaseException:
            self.close()
            raise
        self.name = f"llama-server (started by ggufcheck) on {Path(model_path).name}"
        if "spec_draft" in opts:
            self.draft_max = int(opts["spec_draft"])
        self.capabilities = self._with_switches(self.capabilities, opts)

    def _wait_healthy(self, port: int, wait: float) -> None:
        import json
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EngineUnreachable(f"llama-server exited with status {self._proc.returncode} before it served: "
                                        f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if json.loads(resp.read() or b"{}").get("status") == "ok":
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        raise EngineUnreachable(f"llama-server did not answer /health within {wait:.0f} s: {self._log_tail()}",
                                tip="a large model loads slowly: raise timeout= in the spec")

    def _log_tail(self, lines: int = 6) -> str:
        try:
            self._log.flush()
            text = Path(self._log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(its log is empty)"

    @staticmethod
    def _with_switches(caps, opts: dict[str, Any]):
        """The settings a user flips (checks.switches): flash attention off, an F16 KV cache."""
        from dataclasses import replace

        switches = []
        if opts.get("flash_attn", None) != 0:
            switches.append(Switch({"flash_attn": 0}, {"flash_attn": opts.get("flash_attn", "auto")},
                                   "the flash-attention path", "attention"))
        cache = {k: opts[k] for k in ("type_k", "type_v") if k in opts and opts[k] != "f16"}
        if cache:
            switches.append(Switch({k: "f16" for k in cache}, cache, "the quantized KV cache", "kv-cache"))
        return replace(caps, switches=tuple(switches))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "process": "llama-server", "pid": getattr(self._proc, "pid", None),
                "command": " ".join(self.command)}

    def close(self) -> None:
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
            Path(log.name).unlink(missing_ok=True)
            self._log = None
