"""Result objects: what every check in every stage returns.

A check never prints and never returns a bare bool. It returns a :class:`Result` with a
status, the component it speaks about (from the verdict vocabulary), where (tensor, layer),
statistics, the worst element, and a message. SKIP and ERROR always carry a reason. A Result
is never changed once made (frozen, its stats and worst read-only): a check that learns more
makes a new one with :meth:`Result.amended`, so what a check judged is what gets reported.
Results serialize to plain JSON (the schema version is in :data:`SCHEMA_VERSION`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

SCHEMA_VERSION = 1


class Status(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"
    ERROR = "ERROR"
    WARN = "WARN"  # nothing wrong was measured, but something the user must know (never the verdict)


class ReadOnlyDict(dict):
    """A Result's stats / worst: a dict (JSON, ``|``, pickling work) that refuses changes."""

    def _read_only(self, *_args: Any, **_kw: Any) -> None:
        raise TypeError("a Result's stats are read-only: make a new one with Result.amended(stats=...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only  # type: ignore[assignment]

    def __reduce__(self):
        return (ReadOnlyDict, (dict(self),))

    def __copy__(self) -> "ReadOnlyDict":
        return self

    def __deepcopy__(self, memo: dict) -> "ReadOnlyDict":
        import copy

        return ReadOnlyDict(copy.deepcopy(dict(self), memo))


@dataclass(frozen=True)
class Result:
    """The outcome of one check."""

    check: str  # e.g. "integrity.offsets", "mapping.shapes", "health.nan"
    status: Status
    component: str  # verdict vocabulary: "gguf-file", "metadata", "mapping", "dequant", ...
    message: str
    tensor: str | None = None
    layer: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    worst: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.status in (Status.SKIP, Status.ERROR) and not self.message:
            raise ValueError(f"{self.check}: a {self.status.value} result needs a reason")
        object.__setattr__(self, "stats", ReadOnlyDict(self.stats or {}))
        if self.worst is not None:
            object.__setattr__(self, "worst", ReadOnlyDict(self.worst))

    def amended(self, note: str = "", *, message: str | None = None, stats: Mapping[str, Any] | None = None,
                **changes: Any) -> "Result":
        """A new Result: ``note`` appended to the message (or ``message`` instead of it),
        ``stats`` merged into the stats, and any other field (check, component, ...) replaced."""
        text = (self.message if message is None else message) + note
        return replace(self, message=text, stats={**self.stats, **(stats or {})}, **changes)

    def __bool__(self) -> bool:  # a Result is truthy when it did not fail
        return self.status in (Status.PASS, Status.SKIP, Status.WARN)

    @property
    def failed(self) -> bool:
        return self.status in (Status.FAIL, Status.ERROR)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "check": self.check,
            "status": self.status.value,
            "component": self.component,
            "message": self.message,
        }
        if self.tensor is not None:
            out["tensor"] = self.tensor
        if self.layer is not None:
            out["layer"] = self.layer
        if self.stats:
            out["stats"] = _jsonable(self.stats)
        if self.worst is not None:
            out["worst"] = _jsonable(self.worst)
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "Result":
        """A Result read back from :meth:`to_json` (a saved run's stages that are not re-judged)."""
        return cls(doc["check"], Status(doc["status"]), doc["component"], doc["message"], tensor=doc.get("tensor"),
                   layer=doc.get("layer"), stats=dict(doc.get("stats") or {}), worst=doc.get("worst"))


def passed(check: str, component: str, message: str, **kw: Any) -> Result:
    return Result(check, Status.PASS, component, message, **kw)


def failed(check: str, component: str, message: str, **kw: Any) -> Result:
    return Result(check, Status.FAIL, component, message, **kw)


def warned(check: str, component: str, message: str, **kw: Any) -> Result:
    return Result(check, Status.WARN, component, message, **kw)


def skipped(check: str, component: str, reason: str, **kw: Any) -> Result:
    return Result(check, Status.SKIP, component, reason, **kw)


def errored(check: str, component: str, reason: str, **kw: Any) -> Result:
    return Result(check, Status.ERROR, component, reason, **kw)


@dataclass
class StageReport:
    """The results of one stage (file, mapping, health, sharding, logits, ...)."""

    stage: str
    results: list[Result] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def add(self, result: Result | Iterable[Result]) -> None:
        if isinstance(result, Result):
            self.results.append(result)
        else:
            self.results.extend(result)

    @property
    def status(self) -> Status:
        statuses = {r.status for r in self.results}
        for s in (Status.ERROR, Status.FAIL, Status.WARN, Status.PASS):
            if s in statuses:
                return s
        return Status.SKIP

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.failed]

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "status": self.status.value,
            "info": _jsonable(self.info),
            "results": [r.to_json() for r in self.results],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "StageReport":
        return cls(doc["stage"], [Result.from_json(r) for r in doc.get("results", ())], dict(doc.get("info") or {}))


def _jsonable(value: Any) -> Any:
    """Plain-JSON form of stats: numpy/torch scalars to Python, NaN/Inf to strings."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if hasattr(value, "tolist") and callable(value.tolist):
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value
