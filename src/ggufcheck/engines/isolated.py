"""An engine in a process of its own: its native libraries never meet torch's.

Measured on the lent H200 (issue 20, docs/real-world-cases.md): llama-cpp-python driving a
CUDA build of libllama segfaults in ``llama_model_load_from_file`` once torch is imported in
the same process, and importing torch after llama.cpp aborts; either alone runs. ggufcheck
always loads torch (its reference), so such an engine runs here, in a child interpreter that
imports only the adapter: ``IsolatedEngine("ggufcheck.engines.llama_cpp:LlamaCppEngine",
path, **kwargs)`` builds the adapter in the child and forwards every Engine call to it.

The protocol is pickled frames (4-byte length + payload) over the child's stdin and a
private duplicate of its stdout; the child points fd 1 at stderr, so a native library that
prints cannot corrupt a frame. An exception in the child comes back as the same ggufcheck
error class (Unsupported, Unavailable, UsageError) with its message and tip. The child dies
with the parent's pipe, on close, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from ggufcheck.engines.base import LAYER_KINDS, Engine, Generation, LayerTrace, TokenLogprobs, reasons
from ggufcheck.errors import EngineUnreachable

_HEADER = struct.Struct("<I")


def _send(stream, obj: Any) -> None:
    raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(raw)) + raw)
    stream.flush()


def _receive(stream) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the engine process closed its pipe")
    (size,) = _HEADER.unpack(head)
    raw = stream.read(size)
    if len(raw) < size:
        raise EOFError("the engine process closed its pipe mid-answer")
    return pickle.loads(raw)


def _error_of(kind: str, message: str, tip: str | None) -> Exception:
    """The parent-side exception for a child's ('module:Class', message, tip)."""
    module, _, name = kind.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        cls = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message, tip=tip) if tip is not None else cls(message)
        except TypeError:  # a class with another constructor: its family, same words
            from ggufcheck.errors import GGUFCheckError

            if issubclass(cls, GGUFCheckError):
                return GGUFCheckError(message, tip=tip)
    return EngineUnreachable(f"the engine process failed: {name}: {message}")


class IsolatedEngine(Engine):
    """``factory`` ("module:Class") built with ``(model_path, **kwargs)`` in a child process."""

    def __init__(self, factory: str, model_path: str | Path, *, python: str | None = None,
                 preload: Sequence[str] = (), env: dict[str, str | None] | None = None, **kwargs: Any):
        # ``env``: variables the child's native libraries read when they load (None: removed)
        extra = dict(env or {})
        env = {k: v for k, v in dict(os.environ, PYTHONUNBUFFERED="1").items() if extra.get(k, "") is not None}
        env.update({k: v for k, v in extra.items() if v is not None})
        src = str(Path(__file__).resolve().parents[2])  # the child imports this same ggufcheck
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        # ``preload``: modules imported before anything else, numpy included (the order native
        # libraries are loaded in matters: measured, CUDA libllama segfaults at model load when
        # numpy came first, docs/real-world-cases.md)
        boot = ("import importlib, sys\nfailed = None\n"
                f"for m in {list(preload)!r}:\n"
                "    try:\n        importlib.import_module(m)\n"
                "    except Exception as e:\n        failed = f'{sys.executable} cannot import {m}: {e}'\n"
                "from ggufcheck.engines.isolated import _serve\n_serve(failed)")
        self._proc = subprocess.Popen([python or sys.executable, "-c", boot],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        atexit.register(self.close)
        try:
            info = self._call("__init__", factory, str(model_path), kwargs)
        except BaseException:
            self.close()  # a child that could not build the engine is not left waiting
            raise
        self.name = info["name"]
        self.vocab_size = info["vocab_size"]
        caps = info["capabilities"]
        self.capabilities = dataclasses.replace(caps, reasons=reasons(**dict(caps.reasons)))

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        proc = getattr(self, "_proc", None)
        if proc is None or proc.poll() is not None:
            raise EngineUnreachable(f"the engine process is not running (exit status "
                                    f"{None if proc is None else proc.returncode}); its stderr says why")
        try:
            _send(proc.stdin, (method, args, kwargs))
            ok, value = _receive(proc.stdout)
        except (EOFError, BrokenPipeError, OSError) as err:
            code = proc.wait(timeout=5) if proc.poll() is None else proc.returncode
            if method == "__init__" and code and code > 0:  # it never served: numpy / ggufcheck did not import
                raise EngineUnreachable(f"the engine process ({proc.args[0]}) exited with status {code} before it "
                                        "could serve", tip="its error is printed above (that interpreter needs "
                                        "numpy and the engine's package)") from None
            raise EngineUnreachable(f"the engine process died during {method} (exit status {code}: "
                                    f"{'killed by signal ' + str(-code) if code and code < 0 else err})",
                                    tip="its stderr above names the native library's complaint") from None
        if ok:
            return value
        raise _error_of(*value)

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self._call("tokenize", text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._call("detokenize", [int(t) for t in tokens])

    def score(self, tokens: Sequence[int], *, top_k: int = 20) -> TokenLogprobs:
        return self._call("score", [int(t) for t in tokens], top_k=top_k)

    def score_batch(self, batch: Sequence[Sequence[int]], *, top_k: int = 20) -> list[TokenLogprobs]:
        return self._call("score_batch", [[int(t) for t in seq] for seq in batch], top_k=top_k)

    def score_chunked(self, tokens: Sequence[int], chunk_size: int, *, top_k: int = 20) -> TokenLogprobs:
        return self._call("score_chunked", [int(t) for t in tokens], chunk_size, top_k=top_k)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, top_k: int = 20) -> Generation:
        return self._call("generate", [int(t) for t in prompt], max_new_tokens, top_k=top_k)

    def layer_outputs(self, tokens: Sequence[int], kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        return self._call("layer_outputs", [int(t) for t in tokens], tuple(kinds))

    def chunked_layer_outputs(self, tokens: Sequence[int], chunk_size: int,
                              kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        return self._call("chunked_layer_outputs", [int(t) for t in tokens], int(chunk_size), tuple(kinds))

    def decode_layer_outputs(self, tokens: Sequence[int], prompt_length: int,
                             kinds: Sequence[str] = LAYER_KINDS) -> LayerTrace:
        return self._call("decode_layer_outputs", [int(t) for t in tokens], int(prompt_length), tuple(kinds))

    def chat_tokens(self, messages: Sequence[dict]) -> list[int]:
        return self._call("chat_tokens", [dict(m) for m in messages])

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "process": "isolated", "pid": getattr(self._proc, "pid", None)}

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        self._proc = None
        try:
            if proc.poll() is None:
                _send(proc.stdin, ("close", (), {}))
                proc.stdin.close()
                proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _serve(preload_failure: str | None = None) -> None:
    """The child: build the engine, then answer calls until told to close or the pipe ends.
    ``preload_failure``: why a module to load first did not import (the engine is then
    Unavailable, said as such to the parent)."""
    frames_in = sys.stdin.buffer
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a native library prints goes to stderr, never into a frame
    sys.stdout = sys.stderr
    engine = None
    while True:
        try:
            method, args, kwargs = _receive(frames_in)
        except EOFError:
            break
        try:
            if method == "__init__" and preload_failure:
                from ggufcheck.errors import Unavailable

                raise Unavailable(preload_failure, tip="install the engine's package in that interpreter, or "
                                                       "pass the interpreter that has it with --python")
            if method == "__init__":
                factory, model_path, options = args
                module, _, name = factory.partition(":")
                engine = getattr(importlib.import_module(module), name)(model_path, **options)
                caps = engine.capabilities
                value = {"name": engine.name, "vocab_size": engine.vocab_size,
                         "capabilities": dataclasses.replace(caps, reasons=dict(caps.reasons))}
            elif method == "close":
                if engine is not None:
                    engine.close()
                _send(frames_out, (True, None))
                break
            else:
                value = getattr(engine, method)(*args, **kwargs)
            _send(frames_out, (True, value))
        except Exception as err:  # every failure goes back to the parent as its own class
            kind = f"{type(err).__module__}:{type(err).__qualname__}"
            _send(frames_out, (False, (kind, str(getattr(err, "message", err)), getattr(err, "tip", None))))


if __name__ == "__main__":
    _serve()
