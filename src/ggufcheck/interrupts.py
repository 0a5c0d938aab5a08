"""Ctrl-C and SIGTERM end a run cleanly: engines closed, worker processes reaped, exit 130 / 143.

Python turns SIGINT into KeyboardInterrupt, so the ``finally`` clauses that close engines run;
SIGTERM (what ``kill``, ``timeout``, systemd and CI runners send) would end the process at once,
leaving a vLLM worker and its tensor-parallel ranks running, holding GPUs. :func:`handled`
turns SIGTERM and SIGHUP into :class:`Terminated` (a KeyboardInterrupt), so both unwind the
same way, and records that the run was interrupted: a worker being closed then is killed at
once instead of being asked to finish its request (engines/vllm.py). The exit status is the
shell's convention, 128 + the signal number.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

_SIGNAL: int | None = None  # the signal that interrupted this run, once one did


class Terminated(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, unwinding like Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted() -> bool:
    """Whether a signal is ending this run (cleanup should not wait for work in flight)."""
    return _SIGNAL is not None


def exit_status(err: KeyboardInterrupt) -> int:
    """128 + the signal number: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + int(getattr(err, "signum", signal.SIGINT))


def name(err: KeyboardInterrupt) -> str:
    return signal.Signals(getattr(err, "signum", signal.SIGINT)).name


@contextmanager
def handled() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise in the main thread while the block runs (handlers
    restored after; outside the main thread nothing changes)."""
    global _SIGNAL
    _SIGNAL = None

    def on_signal(signum: int, _frame) -> None:
        global _SIGNAL
        _SIGNAL = signum
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, on_signal)
        except (ValueError, OSError):  # not the main thread: leave the process's handlers alone
            pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
