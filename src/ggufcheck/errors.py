"""Exception types and exit statuses, in one place.

Every error ggufcheck raises on purpose is a :class:`GGUFCheckError`; the CLI turns each
into one clear line and an exit status (never a traceback). A :class:`BadFileError` names
the file, the field or tensor, and the byte offset where the file stopped making sense.
"""

from __future__ import annotations

import enum
from pathlib import Path


class ExitStatus(enum.IntEnum):
    """The CLI's exit statuses (documented in the README)."""

    HEALTHY = 0
    FINDINGS = 1  # a check failed: the report says which
    USAGE = 2  # bad arguments or an unreadable / malformed input file
    ENGINE_UNREACHABLE = 3  # the engine under test did not answer usably
    INTERNAL = 4  # a defect in ggufcheck itself (the message asks for a report)
    UNVERIFIED = 5  # nothing failed, but nothing compared the deployment with a reference


# The one wording of the exit statuses: ``ggufcheck --help`` prints it, and the README and
# docs/index.md carry it verbatim (tests/cli/test_exit_status_docs.py)
EXIT_STATUS_TEXT = (
    "Exit status: 0 healthy, 1 a check failed (the verdict names it), 2 usage error or "
    "unreadable/malformed input, 3 engine unreachable, 4 an internal ggufcheck error, 5 not "
    "verified (nothing failed, but neither the layers nor the logits stage could compare the "
    "deployment with a reference), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM; engines and their "
    "worker processes are closed first)."
)


class GGUFCheckError(Exception):
    """Base class: an error with a message meant for the user, and a tip."""

    exit_status: ExitStatus = ExitStatus.USAGE

    def __init__(self, message: str, *, tip: str | None = None):
        super().__init__(message)
        self.message = message
        self.tip = tip

    def __str__(self) -> str:
        return self.message


class UsageError(GGUFCheckError):
    """Bad command-line arguments or options."""


class BadFileError(GGUFCheckError):
    """A model file that cannot be trusted: names the file, the field and the offset."""

    def __init__(
        self,
        path: str | Path,
        problem: str,
        *,
        field: str | None = None,
        offset: int | None = None,
        tip: str | None = None,
    ):
        self.path = str(path)
        self.problem = problem
        self.field = field
        self.offset = offset
        where = []
        if field is not None:
            where.append(field)
        if offset is not None:
            where.append(f"byte offset {offset}")
        location = f" ({', '.join(where)})" if where else ""
        super().__init__(f"{self.path}: {problem}{location}", tip=tip)


class EngineUnreachable(GGUFCheckError):
    """The engine under test is down, too slow, or answers something unusable."""

    exit_status = ExitStatus.ENGINE_UNREACHABLE


class Unavailable(GGUFCheckError):
    """An optional dependency or capability is missing; checks needing it are skipped."""
