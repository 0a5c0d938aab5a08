"""The ``weights`` stage: the parameters the engine actually holds, against the GGUF.

Before any computation is compared, each parameter the engine loaded (per tensor-parallel
rank, in the engine's own naming: checkpoint names, or transformers' fused experts) is
compared with the slice of the GGUF tensor it should hold, through the architecture's tensor
table and the shard rules (:func:`ggufcheck.sharding.weights.check_engine_weights`). A
wrong expert order, a mis-rebuilt kv_b or a rank holding another rank's slice is named here,
with the tensor, before the layers stage sees its consequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ggufcheck.results import StageReport, skipped

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.diagnose.session import Session


def run(session: "Session") -> list[StageReport]:
    from ggufcheck.arch.spec import ArchSpec, spec_for_model
    from ggufcheck.arch.tables import table_for
    from ggufcheck.sharding.weights import check_engine_weights, hf_params

    report = StageReport("weights")
    engine = session.engine()
    if not engine.capabilities.weights:
        report.add(skipped("weights.loaded", "weights", engine.capabilities.why_not("weights")))
        return [report]
    model = session.open_model()
    spec, findings = spec_for_model(model)
    table = table_for(spec) if isinstance(spec, ArchSpec) and not findings else None
    if table is None:
        report.add(skipped("weights.loaded", "weights", "no spec/table for this architecture: nothing to audit against"))
        return [report]
    caps = engine.capabilities
    names = sorted(hf_params(spec, table, model.tensors, caps.weight_layout))
    session.say(f"auditing {len(names)} loaded parameters on {caps.tp_size} rank(s)")
    report.add(check_engine_weights(model, spec, table, engine, names))
    report.info.update(tp=caps.tp_size, parameters=len(names), layout=caps.weight_layout)
    return [report]
