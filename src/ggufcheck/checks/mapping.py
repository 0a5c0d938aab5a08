"""The mapping check: does the file hold exactly the tensors its architecture's table calls
for, with the shapes the metadata implies?

Findings (component ``mapping``, each naming the tensor): missing required tensors,
unexpected tensors (with a hint when the name says why: a NextN tensor the metadata does
not declare, an indexer tensor on a shared layer, a layer past block_count), shape
mismatches, and both the split (``attn_k_b`` + ``attn_v_b``) and fused (``attn_kv_b``)
MLA layouts in one layer. Recognized facts are PASS results with a note: tied output,
NextN layers. An architecture without a table gets one SKIP with that reason: never a
silent pass.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ggufcheck.arch.keys import Finding
from ggufcheck.arch.spec import ArchSpec, GenericSpec, build_spec
from ggufcheck.arch.table import TensorTable, expected_tensors
from ggufcheck.arch.tables import table_for
from ggufcheck.results import Result, failed, passed, skipped, warned

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.gguf.reader import GGUFModel

COMPONENT = "mapping"
MAX_PER_KIND = 50  # per-tensor results per kind of finding; the rest are summarized
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_KV_SPLIT = ("attn_k_b.weight", "attn_v_b.weight")


def check_mapping(model: "GGUFModel", spec: ArchSpec | GenericSpec | None,
                  table: TensorTable | None) -> list[Result]:
    """Compare ``model``'s tensors with ``table`` expanded for ``spec``."""
    arch = model.architecture or "?"
    if spec is None:
        return [skipped("mapping.tensors", COMPONENT,
                        f"no spec for {arch!r}: its metadata findings come first")]
    if not spec.supported or table is None:
        return [skipped("mapping.tensors", COMPONENT,
                        f"no tensor table for architecture {spec.arch!r}: tensors not checked "
                        "against a layout (integrity and health checks still ran)")]
    assert isinstance(spec, ArchSpec)
    names = list(model.tensors)
    expected = expected_tensors(spec, table, names)
    out: list[Result] = []
    out += _limit([failed("mapping.missing", COMPONENT, f"required tensor {e.name} is missing "
                          f"(expected numpy shape {list(e.shape)})", tensor=e.name, layer=e.layer)
                   for e in expected.values() if e.required and e.name not in model.tensors],
                  "mapping.missing", "missing tensors")
    out += _limit([_shape_result(model, e) for e in expected.values()
                   if e.name in model.tensors and tuple(model.tensors[e.name].shape) != e.shape],
                  "mapping.shape", "shape mismatches")
    both_kv = _both_kv_b(spec, names)
    out += both_kv
    skip = {r.tensor for r in both_kv} | {f"blk.{r.layer}.{s}" for r in both_kv for s in _KV_SPLIT}
    out += _limit([_unexpected(spec, n) for n in names if n not in expected and n not in skip],
                  "mapping.unexpected", "unexpected tensors")
    out += _notes(spec, expected, model)
    if not any(r.failed for r in out):
        n_optional = sum(1 for e in expected.values() if not e.required and e.name not in model.tensors)
        out.insert(0, passed("mapping.tensors", COMPONENT,
                             f"all {len(names)} tensors match the {spec.arch} table "
                             f"({n_optional} optional tensors absent)",
                             stats={"tensors": len(names), "optional_absent": n_optional}))
    return out


def finding_result(finding: Finding) -> Result:
    """One missing or inconsistent metadata key as a FAIL of the ``metadata`` component."""
    return failed("metadata.spec", "metadata", str(finding), stats={"key": finding.key})


def spec_results(spec: ArchSpec | GenericSpec | None, findings: list[Finding]) -> list[Result]:
    """The ``metadata`` component's Results for a built spec (one per finding, or one PASS/SKIP)."""
    if findings:
        return [finding_result(f) for f in findings]
    if spec is None or not spec.supported:
        arch = spec.arch if spec is not None else "?"
        reason = spec.reason if isinstance(spec, GenericSpec) else "no spec"
        return [skipped("metadata.spec", "metadata", f"no spec for architecture {arch!r}: {reason}")]
    note = f" ({'; '.join(spec.notes)})" if spec.notes else ""
    return [passed("metadata.spec", "metadata",
                   f"{spec.arch}: {spec.n_layer} layers (+{spec.n_nextn} NextN), D {spec.n_embd}, "
                   f"H {spec.n_head}/{spec.n_head_kv}, vocab {spec.n_vocab}{note}")]


def mapping_stage(model: "GGUFModel") -> list[Result]:
    """Spec (component ``metadata``) then mapping results for one open model."""
    spec, findings = build_spec(model.metadata, model.tensors.keys())
    return (spec_results(spec, findings) + defaults_results(model, spec)
            + check_mapping(model, spec, table_for(spec) if spec else None))


def defaults_results(model: "GGUFModel", spec) -> list[Result]:
    """A WARN per absent key that engines read differently (arch/defaults.py)."""
    from ggufcheck.arch.defaults import divergent_defaults

    return [warned("metadata.defaults", "metadata", d.message,
                   stats={"key": d.key, "reference": d.reference, "readings": dict(d.readings)})
            for d in divergent_defaults(model.metadata, model.tensors.keys(), spec)]


# --- helpers ------------------------------------------------------------------------------


def _shape_result(model: "GGUFModel", e) -> Result:
    found = list(model.tensors[e.name].shape)
    return failed("mapping.shape", COMPONENT,
                  f"{e.name}: numpy shape {found}, the metadata implies {list(e.shape)} "
                  f"({', '.join(e.row.shape)})", tensor=e.name, layer=e.layer,
                  stats={"expected": list(e.shape), "found": found})


def _both_kv_b(spec: ArchSpec, names: list[str]) -> list[Result]:
    if spec.mla is None:
        return []
    present = set(names)
    out = []
    for i in range(spec.n_block):
        fused = f"blk.{i}.attn_kv_b.weight"
        split = [f"blk.{i}.{s}" for s in _KV_SPLIT]
        if fused in present and any(s in present for s in split):
            layout = "split (key_length_mla present)" if spec.mla.split_kv_b else "legacy attn_kv_b"
            out.append(failed("mapping.kv_b", COMPONENT,
                              f"layer {i} has both attn_kv_b and attn_k_b/attn_v_b: engines pick "
                              f"different ones; the metadata says {layout}", tensor=fused, layer=i))
    return out


def _unexpected(spec: ArchSpec, name: str) -> Result:
    hint = ""
    m = _LAYER.match(name)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        if i >= spec.n_block:
            hint = f": layer {i} is past block_count {spec.n_block}"
        elif rest.startswith("nextn.") and not spec.is_nextn_layer(i):
            hint = (f": a NextN tensor, but nextn_predict_layers = {spec.n_nextn} makes layer {i} "
                    "a run layer (is the key missing?)")
        elif rest.startswith("indexer.") and spec.indexer is not None and not spec.indexer.is_full(i):
            hint = f": layer {i} is a shared-indexer layer (indexer types: {spec.indexer.types_source})"
        elif rest.startswith("attn_kv_b") and spec.mla is not None and spec.mla.split_kv_b:
            hint = ": the metadata declares the split MLA layout (attn_k_b / attn_v_b)"
        elif rest.startswith(("attn_k_b", "attn_v_b")) and spec.mla is not None and not spec.mla.split_kv_b:
            hint = ": the metadata declares the legacy layout (no key_length_mla / value_length_mla)"
        layer = i
    else:
        layer = None
    return failed("mapping.unexpected", COMPONENT, f"tensor {name} is not in the {spec.arch} table{hint}",
                  tensor=name, layer=layer)


def _notes(spec: ArchSpec, expected: dict, model: "GGUFModel") -> list[Result]:
    out = []
    if "output.weight" not in model.tensors and "token_embd.weight" in model.tensors:
        out.append(passed("mapping.tied_output", COMPONENT,
                          "output.weight absent: tied embeddings, the output projection is token_embd.weight",
                          tensor="token_embd.weight"))
    if spec.n_nextn:
        layers = list(range(spec.n_layer, spec.n_block))
        found = [n for n, e in expected.items() if e.layer in layers and n in model.tensors]
        msg = (f"NextN layer(s) {layers}: {len(found)} tensors recognized (kept, not run)" if found
               else f"NextN layer(s) {layers} declared but their tensors are absent (trunk-only file)")
        out.append(passed("mapping.nextn", COMPONENT, msg, stats={"layers": layers, "tensors": len(found)}))
    return out


def _limit(results: list[Result], check: str, what: str) -> list[Result]:
    if len(results) <= MAX_PER_KIND:
        return results
    rest = results[MAX_PER_KIND:]
    return results[:MAX_PER_KIND] + [failed(check, COMPONENT, f"... and {len(rest)} more {what}",
                                             stats={"tensors": [r.tensor for r in rest]})]
