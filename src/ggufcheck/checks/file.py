"""The file stage: integrity, metadata, mapping and dequantization health of a GGUF.

This is what ``ggufcheck inspect`` prints and the first stage ``diagnose`` runs after the
environment. Structural problems that make a file untrustworthy are raised by the reader
(exit 2); everything here is a finding about a file that could be read.
"""

from __future__ import annotations

import time

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ggufcheck.gguf.health import TensorHealth, scan_model
from ggufcheck.gguf.reader import GGUFModel, TensorInfo
from ggufcheck.results import Result, StageReport, failed, passed, skipped

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.diagnose.session import Session


@dataclass(frozen=True)
class FileStageOptions:
    health: bool = True  # dequantize every tensor (the slow part)
    layers: tuple[int, ...] | None = None  # --layers: scan only these layers' tensors (and the non-layer ones)
    tp: int | None = None  # also check the shard rules for this tensor-parallel size


@dataclass
class ModelSummary:
    """What a person wants to see first about a model file."""

    path: str
    architecture: str | None
    name: str | None
    layers: int | None
    parameters: int
    file_size: int
    n_tensors: int
    n_parts: int
    version: int
    quant_mix: dict[str, dict[str, Any]] = field(default_factory=dict)
    context_length: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(model: GGUFModel) -> ModelSummary:
    arch = model.architecture
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    elements: Counter[str] = Counter()
    for t in model.tensors.values():
        counts[t.type_name] += 1
        nbytes[t.type_name] += t.nbytes
        elements[t.type_name] += t.n_elements
    total_bytes = sum(nbytes.values()) or 1
    mix = {
        name: {
            "tensors": counts[name], "bytes": nbytes[name], "elements": elements[name],
            "share_of_bytes": nbytes[name] / total_bytes,
            "bits_per_weight": 8 * nbytes[name] / elements[name] if elements[name] else 0.0,
        }
        for name in sorted(counts, key=lambda n: -nbytes[n])
    }
    return ModelSummary(
        path=str(model.path),
        architecture=arch,
        name=model.get("general.name") if isinstance(model.get("general.name"), str) else None,
        layers=_int_or_none(model.get(f"{arch}.block_count")),
        parameters=sum(t.n_elements for t in model.tensors.values()),
        file_size=model.file_size,
        n_tensors=len(model.tensors),
        n_parts=len(model.paths),
        version=model.version,
        quant_mix=mix,
        context_length=_int_or_none(model.get(f"{arch}.context_length")),
    )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def integrity_results(model: GGUFModel) -> list[Result]:
    """The reader validated the container; record what was checked, and soft findings."""
    out = [
        passed(
            "integrity.container", "gguf-file",
            f"GGUF v{model.version}: {len(model.metadata)} metadata keys and {len(model.tensors)} tensors "
            f"validated (types, dims, block sizes, aligned in-bounds non-overlapping data) in {len(model.paths)} file(s)",
            stats={"version": model.version, "alignment": model.alignment, "parts": [str(p) for p in model.paths]},
        )
    ]
    for path, size, data_start in model.parts:
        in_part = [t for t in model.tensors.values() if t.path == path]
        end = max((t.offset + t.nbytes for t in in_part), default=data_start)
        trailing = size - end
        if trailing > model.alignment:
            out.append(failed(
                "integrity.trailing-bytes", "gguf-file",
                f"{path.name}: {trailing} bytes after the last tensor's data (truncated write or a tensor missing from the header?)",
                stats={"file_size": size, "data_end": end},
            ))
        used = sum(t.nbytes for t in in_part)
        gap = end - data_start - used
        slack = model.alignment * max(1, len(in_part))
        if gap > slack:
            out.append(failed(
                "integrity.gaps", "gguf-file",
                f"{path.name}: {gap} bytes of the data section belong to no tensor (more than alignment padding)",
                stats={"unused_bytes": gap},
            ))
    if not model.architecture:
        out.append(failed("metadata.architecture", "metadata", "general.architecture is missing or not a string"))
    return out


def health_results(healths: list[TensorHealth], infos: dict[str, TensorInfo]) -> list[Result]:
    out = []
    for h in healths:
        info = infos[h.name]
        if h.healthy:
            out.append(passed("health.values", "dequant", f"{h.qtype}: finite, |x| <= {h.absmax:.4g}",
                              tensor=h.name, stats=h.stats()))
        else:
            worst = {"block": h.first_bad_block, "element": h.first_bad_value}
            out.append(failed("health.values", "dequant", "; ".join(h.problems), tensor=h.name,
                              stats=h.stats(), worst={k: v for k, v in worst.items() if v is not None} or None,
                              layer=_layer_of(info.name)))
    return out


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1])
    return None


def run_file_stage(
    model: GGUFModel,
    options: FileStageOptions = FileStageOptions(),
    progress: Callable[[TensorInfo], None] | None = None,
) -> StageReport:
    """Run every file-level check; returns the stage report (info holds the summary)."""
    report = StageReport("file")
    report.info["summary"] = summarize(model).to_json()
    report.add(integrity_results(model))
    report.add(_arch_results(model, options))
    if options.health:
        started = time.perf_counter()
        chosen = [info for name, info in model.tensors.items()
                  if options.layers is None or not name.startswith("blk.") or int(name.split(".")[1]) in options.layers]
        healths = scan_model(model, chosen, progress=progress)
        seconds = time.perf_counter() - started
        scanned = sum(info.nbytes for info in chosen)
        if len(chosen) < len(model.tensors):
            report.info["not_checked"] = (f"the health of {len(model.tensors) - len(chosen)} tensors of layers outside "
                                          "--layers")
        report.info["health_scan"] = {"tensor_bytes": scanned, "seconds": round(seconds, 3),
                                      "mb_per_s": round(scanned / 1e6 / seconds, 1) if seconds > 0 else None}
        report.add(health_results(healths, model.tensors))
    else:
        report.add(skipped("health.values", "dequant", "health scan disabled (--no-health)"))
    return report


def _arch_results(model: GGUFModel, options: FileStageOptions) -> list[Result]:
    """Metadata spec, mapping and (with --tp) shard-plan checks, from ggufcheck.arch."""
    from ggufcheck.checks.architecture import architecture_results

    return architecture_results(model, tp=options.tp)


def run(session: "Session") -> list[StageReport]:
    """The stage entry point: the session's model file."""
    session.say("checking the file: integrity, metadata, mapping, dequantization health")
    return [run_file_stage(session.open_model(), FileStageOptions(health=session.options.health,
                                                                  layers=session.options.layers))]
