"""Typed reading of GGUF metadata keys, where every problem becomes a finding naming the key.

:mod:`ggufcheck.arch.spec` builds specs through :class:`Keys`: a missing required key, a
value of the wrong type or out of range is recorded as a :class:`Finding` (the full GGUF
key and the problem) and reads as None, so one pass reports every bad key instead of
stopping at the first. :class:`SpecError` carries them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ggufcheck.errors import GGUFCheckError


@dataclass(frozen=True)
class Finding:
    """One missing or inconsistent metadata key."""

    key: str  # the full GGUF key, e.g. "deepseek2.attention.key_length_mla"
    problem: str

    def __str__(self) -> str:
        return f"{self.key}: {self.problem}"


class SpecError(GGUFCheckError):
    """Metadata from which no trustworthy spec can be built; carries every finding."""

    def __init__(self, arch: str, findings: list[Finding]):
        self.arch = arch
        self.findings = list(findings)
        lines = "; ".join(str(f) for f in self.findings)
        super().__init__(f"{arch}: {len(self.findings)} metadata finding(s): {lines}",
                         tip="compare the keys with the converter that wrote the file")


# ---------------------------------------------------------------------------------------
# reading keys


REQUIRED = object()


class Keys:
    """Typed access to ``{arch}.*`` keys; every problem becomes a Finding naming the key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str):
        self.metadata = metadata
        self.prefix = f"{arch}."
        self.findings: list[Finding] = []
        self.notes: list[str] = []

    def key(self, name: str) -> str:
        return self.prefix + name

    def has(self, name: str) -> bool:
        return self.key(name) in self.metadata

    def fail(self, name: str, problem: str) -> None:
        self.findings.append(Finding(self.key(name) if not name.startswith(("general.", "tokenizer."))
                                     else name, problem))

    def _raw(self, name: str, default: Any) -> tuple[bool, Any]:
        """(found, value); a missing required key is a finding and reads as None."""
        key = name if name.startswith(("general.", "tokenizer.")) else self.key(name)
        if key in self.metadata:
            return True, self.metadata[key]
        if default is REQUIRED:
            self.fail(name, "missing (required)")
            return False, None
        return False, default

    def int(self, name: str, default: Any = REQUIRED, minimum: int = 1) -> Any:
        found, value = self._raw(name, default)
        if not found:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            self.fail(name, f"expected an integer, found {value!r}")
            return None
        if value < minimum:
            self.fail(name, f"must be >= {minimum}, found {int(value)}")
            return None
        return int(value)

    def float(self, name: str, default: Any = REQUIRED, positive: bool = False) -> Any:
        found, value = self._raw(name, default)
        if not found:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(name, f"expected a finite number, found {value!r}")
            return None
        if positive and value <= 0:
            self.fail(name, f"must be > 0, found {value!r}")
            return None
        return float(value)

    def bool(self, name: str, default: Any = REQUIRED) -> Any:
        found, value = self._raw(name, default)
        if not found:
            return value
        if not isinstance(value, bool):
            self.fail(name, f"expected a bool, found {value!r}")
            return None
        return value

    def str(self, name: str, default: Any = REQUIRED) -> Any:
        found, value = self._raw(name, default)
        if not found:
            return value
        if not isinstance(value, str):
            self.fail(name, f"expected a string, found {value!r}")
            return None
        return value

    def bool_list(self, name: str) -> tuple[bool, ...] | None:
        found, value = self._raw(name, None)
        if not found:
            return None
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, bool) for v in value):
            self.fail(name, f"expected an array of bools, found {type(value).__name__}")
            return None
        return tuple(value)


def check(keys: Keys, ok: bool, name: str, problem: str) -> bool:
    if not ok:
        keys.fail(name, problem)
    return ok
