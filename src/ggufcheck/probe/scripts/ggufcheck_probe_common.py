"""The probe side of the protocol: read one JSON request, write JSON lines back.

Standard library only. The protocol channel is a private duplicate of the process's stdout;
file descriptor 1 is then pointed at stderr, so whatever a library prints while it is
imported or run (vLLM and Triton print a lot) cannot corrupt the channel. Every message is
one line ``@@ggufcheck-probe@@ {json}``; the host ignores lines without the prefix.

Messages: ``{"type": "start", "case": ID}`` before a case runs (so the host knows which case
a crash or hang happened in), ``{"type": "result", ...}``, ``{"type": "info", ...}`` and
finally ``{"type": "done"}``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback

PREFIX = "@@ggufcheck-probe@@ "
_channel = None


def open_channel():
    """Take stdout for the protocol; route fd 1 (library prints) to stderr."""
    global _channel
    if _channel is None:
        sys.stdout.flush()
        _channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
    return _channel


def read_request() -> dict:
    text = sys.stdin.read()
    return json.loads(text) if text.strip() else {}


def _plain(value):
    """JSON-safe: NaN/Inf become strings, tuples lists, unknown objects their repr."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def emit(message: dict) -> None:
    channel = open_channel()
    channel.write(PREFIX + json.dumps(_plain(message)) + "\n")
    channel.flush()


def exception_text(exc: BaseException, limit: int = 600) -> str:
    """'Type: message (at file:line)', short enough for a report line."""
    text = f"{type(exc).__name__}: {exc}".strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno})"
    return text if len(text) <= limit else text[: limit - 3] + "..."
