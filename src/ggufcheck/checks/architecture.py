"""Architecture-level file checks: the metadata spec, the tensor mapping, the shard plan.

Bridges the file stage to ``ggufcheck.arch`` (specs and tables) and
``ggufcheck.sharding`` (plans). An architecture without a spec or table still gets every
integrity and health check; the checks that need a table are SKIPPED with that reason.
"""

from __future__ import annotations

from ggufcheck.checks.mapping import mapping_stage
from ggufcheck.gguf.reader import GGUFModel
from ggufcheck.results import Result


def architecture_results(model: GGUFModel, tp: int | None = None) -> list[Result]:
    out = mapping_stage(model)  # the metadata spec's findings, then the mapping check
    if tp is not None:
        from ggufcheck.checks.sharding import plan_results

        out.extend(plan_results(model, tp))
    return out
