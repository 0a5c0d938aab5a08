"""Architecture-level file checks: the metadata spec, the tensor mapping, the shard plan.

Bridges the file stage to ``ggufcheck.arch`` (specs and tables) and
``ggufcheck.sharding`` (plans). An architecture without a spec or table still gets every
integrity and health check; the checks that need a table are SKIPPED with that reason.
"""

from __future__ import annotations

from ggufcheck.gguf.reader import GGUFModel
from ggufcheck.results import Result, skipped


def architecture_results(model: GGUFModel, tp: int | None = None) -> list[Result]:
    arch = model.architecture or "unknown"
    out = [skipped("metadata.spec", "metadata", f"no architecture spec is wired yet for {arch!r}")]
    out.append(skipped("mapping.tensors", "mapping", f"no tensor table is wired yet for {arch!r}"))
    if tp is not None:
        out.append(skipped("sharding.plan", "sharding", f"no shard plan is wired yet for {arch!r} at TP {tp}"))
    return out
