"""An engine's answers saved to disk, and played back: run once, judge again without the engine.

``diagnose --save-run DIR`` wraps the engine under test in a :class:`RecordingEngine`: every
call the stages make of it (tokenize, score, generate, chunked / cached / batched scoring,
layer traces, the chat template's tokens), its arguments and its answer (or the
:class:`Unsupported` it raised) go to ``DIR`` as the call returns, one ``.npz`` of arrays per
answer (nothing is held in memory). ``ggufcheck rejudge DIR`` replays them through a
:class:`ReplayEngine`: the same checks, run again from the saved answers, with the reference
recomputed from the model file, so a run made on a GPU server can be judged elsewhere, after
the engine freed its GPUs, or again after a check or a limit changed (Polygraphy's pattern:
run the runners, save their outputs, compare later).

A replayed engine answers a call only if the recorded run made it: the same arguments, in the
same order where it was made more than once (a determinism check asks twice). A call the run
did not make (a localization that a changed check now wants) raises :class:`Unsupported`
naming it, so that check says what the saved run lacks instead of guessing. The loaded
weights are not saved (they are the model's size): a replay has no weights capability, and
the weights audit says it needs the engine.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from dataclasses import asdict, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Sequence

import numpy as np

from ggufcheck.engines.base import (Capabilities, Engine, Generation, LayerTrace, MTPDrafts, MTPTrace,
                                    SpeculativeRun, Switch, TokenLogprobs, Unsupported)
from ggufcheck.errors import UsageError

FORMAT = "ggufcheck-saved-run/1"
MANIFEST = "run.json"
CALLS = "calls.jsonl"
# the engine calls a run saves (the Engine interface's, and the optional chat_tokens)
RECORDED = ("tokenize", "detokenize", "score", "score_batch", "score_chunked", "generate", "layer_outputs",
            "chunked_layer_outputs", "score_cached", "score_cold", "decode_layer_outputs", "mtp_outputs", "mtp_drafts",
            "speculative_generate", "chat_tokens")
NO_WEIGHTS = ("a saved run holds no loaded weights (they are the model's size): the weights audit needs the engine "
              "(rerun diagnose with --engine)")


# -- what an engine call was asked --------------------------------------------------------
def _plain(value: Any) -> Any:
    """Arguments as JSON: token arrays and tuples as lists of ints, mappings as dicts."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, dict) or isinstance(value, MappingProxyType):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def call_key(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """One call, as a string: the method, its positional and keyword arguments."""
    return json.dumps([method, _plain(list(args)), _plain(dict(sorted(kwargs.items())))], separators=(",", ":"))


# -- what it answered ---------------------------------------------------------------------
_TABLE_ARRAYS = ("tokens", "logprobs", "topk_ids", "topk_logprobs", "next_logprob", "present", "ambiguous")


def _table_out(table: TokenLogprobs, prefix: str, arrays: dict) -> dict:
    for name in _TABLE_ARRAYS:
        value = getattr(table, name)
        if value is not None:
            arrays[prefix + name] = np.asarray(value)
    return {"vocab_size": int(table.vocab_size)}


def _table_in(meta: dict, prefix: str, arrays) -> TokenLogprobs:
    got = {name: arrays[prefix + name] for name in _TABLE_ARRAYS if prefix + name in arrays}
    return TokenLogprobs(vocab_size=meta["vocab_size"], **got)


def encode(value: Any) -> tuple[dict, dict[str, np.ndarray]]:
    """An answer as (JSON meta, arrays)."""
    arrays: dict[str, np.ndarray] = {}
    if isinstance(value, TokenLogprobs):
        return {"type": "table", **_table_out(value, "", arrays)}, arrays
    if isinstance(value, Generation):
        arrays["prompt"], arrays["generated"] = np.asarray(value.prompt), np.asarray(value.generated)
        return {"type": "generation", "steps": _table_out(value.steps, "steps.", arrays)}, arrays
    if isinstance(value, LayerTrace):
        arrays["tokens"] = np.asarray(value.tokens)
        tensors = []
        for i, ((kind, layer), t) in enumerate(value.tensors.items()):
            arrays[f"t{i}"] = np.asarray(t)
            tensors.append([kind, int(layer), value.names.get((kind, layer))])
        ranks = {}
        for rank, held in value.per_rank.items():
            ranks[str(rank)] = []
            for i, ((kind, layer), t) in enumerate(held.items()):
                arrays[f"r{rank}.{i}"] = np.asarray(t)
                ranks[str(rank)].append([kind, int(layer)])
        return {"type": "trace", "tensors": tensors, "per_rank": ranks}, arrays
    if isinstance(value, MTPTrace):
        arrays["tokens"], arrays["states"] = np.asarray(value.tokens), np.asarray(value.states)
        arrays["trunk_argmax"] = np.asarray(value.trunk_argmax)
        if value.trunk_states is not None:
            arrays["trunk_states"] = np.asarray(value.trunk_states)
        return {"type": "mtp", "table": _table_out(value.table, "table.", arrays)}, arrays
    if isinstance(value, MTPDrafts):
        for f in fields(MTPDrafts):
            if getattr(value, f.name) is not None:
                arrays[f.name] = np.asarray(getattr(value, f.name))
        return {"type": "mtp_drafts"}, arrays
    if isinstance(value, SpeculativeRun):
        return {"type": "speculative", "value": _plain(asdict(value))}, arrays
    if isinstance(value, list) and value and all(isinstance(t, TokenLogprobs) for t in value):
        return {"type": "tables", "tables": [_table_out(t, f"{i}.", arrays) for i, t in enumerate(value)]}, arrays
    return {"type": "json", "value": _plain(value)}, arrays


def decode(meta: dict, arrays) -> Any:
    kind = meta["type"]
    if kind == "table":
        return _table_in(meta, "", arrays)
    if kind == "generation":
        return Generation(arrays["prompt"], arrays["generated"], _table_in(meta["steps"], "steps.", arrays))
    if kind == "trace":
        tensors = {(k, layer): arrays[f"t{i}"] for i, (k, layer, _n) in enumerate(meta["tensors"])}
        names = {(k, layer): n for k, layer, n in meta["tensors"] if n is not None}
        per_rank = {int(r): {(k, layer): arrays[f"r{r}.{i}"] for i, (k, layer) in enumerate(held)}
                    for r, held in meta["per_rank"].items()}
        return LayerTrace(arrays["tokens"], tensors, names, per_rank)
    if kind == "mtp":
        return MTPTrace(arrays["tokens"], arrays["states"], _table_in(meta["table"], "table.", arrays),
                        arrays["trunk_argmax"], arrays.get("trunk_states"))
    if kind == "mtp_drafts":
        return MTPDrafts(**{f.name: arrays[f.name] for f in fields(MTPDrafts) if f.name in arrays})
    if kind == "tables":
        return [_table_in(m, f"{i}.", arrays) for i, m in enumerate(meta["tables"])]
    if kind == "speculative":
        v = meta["value"]
        return SpeculativeRun(**{**v, "prompt": tuple(v["prompt"]), "generated": tuple(v["generated"])})
    return meta["value"]


# -- the engine's description -----------------------------------------------------------
def capabilities_json(caps: Capabilities) -> dict:
    out = {}
    for f in fields(Capabilities):
        value = getattr(caps, f.name)
        if f.name == "switches":
            value = [{"safe": dict(s.safe), "current": dict(s.current), "what": s.what, "component": s.component}
                     for s in value]
        elif isinstance(value, frozenset):
            value = sorted(value)
        out[f.name] = _plain(value)
    return out


def capabilities_from(doc: dict) -> Capabilities:
    known = {f.name for f in fields(Capabilities)}
    values = {k: v for k, v in doc.items() if k in known}
    values["layer_outputs"] = frozenset(values.get("layer_outputs", ()))
    values["switches"] = tuple(Switch(**s) for s in values.get("switches", ()))
    for name in ("reasons", "reference_options", "rounding"):
        values[name] = MappingProxyType(dict(values.get(name) or {}))
    return Capabilities(**values)


def model_identity(path: Path) -> dict:
    """Enough of a file to tell it from another: its size and the hash of its first and last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            digest.update(f.read(1 << 20))
    return {"name": path.name, "size": size, "sha256_ends": digest.hexdigest()}


# -- one call, by name --------------------------------------------------------------------
class _ByCall(Engine):
    """The Engine calls a run saves, each passed to ``_call(method, *args, **kwargs)``: the
    recording engine asks its engine and saves the answer, the replay reads it back. The
    arguments keep the form the stages gave (the saved key is built from them)."""

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def tokenize(self, text, *, add_special=True):
        return self._call("tokenize", text, add_special=add_special)

    def detokenize(self, tokens):
        return self._call("detokenize", tokens)

    def score(self, tokens, *, top_k=20):
        return self._call("score", tokens, top_k=top_k)

    def score_batch(self, batch, *, top_k=20):
        return self._call("score_batch", batch, top_k=top_k)

    def score_chunked(self, tokens, chunk_size, *, top_k=20):
        return self._call("score_chunked", tokens, chunk_size, top_k=top_k)

    def generate(self, prompt, max_new_tokens, *, top_k=20):
        return self._call("generate", prompt, max_new_tokens, top_k=top_k)

    def layer_outputs(self, tokens, kinds=None):
        return self._call("layer_outputs", tokens, **({} if kinds is None else {"kinds": kinds}))

    def chunked_layer_outputs(self, tokens, chunk_size, kinds=None):
        return self._call("chunked_layer_outputs", tokens, chunk_size, **({} if kinds is None else {"kinds": kinds}))

    def score_cached(self, tokens, cached, *, top_k=20):
        return self._call("score_cached", tokens, cached, top_k=top_k)

    def score_cold(self, tokens, rows, *, top_k=20):
        return self._call("score_cold", tokens, rows, top_k=top_k)

    def decode_layer_outputs(self, tokens, prompt_length, kinds=None):
        return self._call("decode_layer_outputs", tokens, prompt_length,
                          **({} if kinds is None else {"kinds": kinds}))

    def mtp_outputs(self, tokens):
        return self._call("mtp_outputs", tokens)

    def mtp_drafts(self, tokens, start_rows, n_draft):
        return self._call("mtp_drafts", tokens, start_rows, n_draft)

    def speculative_generate(self, prompt, max_new_tokens):
        return self._call("speculative_generate", prompt, max_new_tokens)


# -- recording ----------------------------------------------------------------------------
class RunRecorder:
    """Writes a saved run: ``run.json`` (the options, the engine's description, the model's
    identity) and one line per engine call in ``calls.jsonl``, arrays in ``calls/N.npz``."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        (self.directory / "calls").mkdir(parents=True, exist_ok=True)
        for old in (self.directory / "calls").glob("*.npz"):
            old.unlink()  # a directory reused for a new run holds this run's calls only
        (self.directory / CALLS).write_text("")
        self.count = 0
        self.manifest: dict[str, Any] = {"format": FORMAT}

    def write_manifest(self, doc: dict) -> None:
        """Add ``doc``'s fields to ``run.json`` (written whole each time: a run cut short leaves
        a readable manifest of what it saved)."""
        self.manifest.update(doc)
        tmp = self.directory / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1, default=str))
        os.replace(tmp, self.directory / MANIFEST)

    def record(self, key: str, answer: Any = None, raised: Unsupported | None = None) -> None:
        line: dict[str, Any] = {"key": key}
        if raised is not None:
            line["unsupported"] = raised.message
        else:
            meta, arrays = encode(answer)
            line["answer"] = meta
            if arrays:
                name = f"calls/{self.count:05d}.npz"
                np.savez(self.directory / name, **arrays)
                line["arrays"] = name
        self.count += 1
        with open(self.directory / CALLS, "a") as f:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


class RecordingEngine(_ByCall):
    """The engine under test, unchanged, with each of its answers saved as it returns."""

    def __init__(self, inner: Engine, recorder: RunRecorder):
        self.inner = inner
        self.recorder = recorder
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.vocab_size = inner.vocab_size

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        key = call_key(method, args, kwargs)
        try:
            answer = getattr(self.inner, method)(*args, **kwargs)
        except Unsupported as why:
            self.recorder.record(key, raised=why)
            raise
        self.recorder.record(key, answer)
        return answer


    # the weights are the engine's, read live (a saved run does not hold them)
    def weight(self, hf_name, *, rank=0):
        return self.inner.weight(hf_name, rank=rank)

    def weight_experts(self, hf_name, experts, *, rank=0):
        return self.inner.weight_experts(hf_name, experts, rank=rank)

    def held_weight_names(self, *, rank=0):
        return self.inner.held_weight_names(rank=rank)

    def describe(self):
        return self.inner.describe()

    def close(self):
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # what the interface does not name: chat_tokens, model_path, ...
        if name == "inner":
            raise AttributeError(name)
        value = getattr(self.inner, name)
        if name in RECORDED and callable(value):
            return lambda *a, **k: self._call(name, *a, **k)
        return value


# -- replaying ----------------------------------------------------------------------------
class ReplayEngine(_ByCall):
    """The engine of a saved run: answers each call the run made, in order, from disk."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        manifest = self.directory / MANIFEST
        if not manifest.is_file():
            raise UsageError(f"{self.directory}: not a saved run (no {MANIFEST})",
                             tip="save one with `ggufcheck diagnose MODEL --engine SPEC --save-run DIR`")
        try:
            self.manifest = json.loads(manifest.read_text())
        except (OSError, ValueError) as err:
            raise UsageError(f"{manifest}: unreadable ({err})") from None
        if self.manifest.get("format") != FORMAT:
            raise UsageError(f"{manifest}: format {self.manifest.get('format')!r}, this ggufcheck reads {FORMAT!r}")
        engine = self.manifest.get("engine") or {}
        try:
            caps = capabilities_from(engine["capabilities"])
            self.vocab_size = int(engine["vocab_size"])
            self.name = str(engine["name"])
        except (KeyError, TypeError, ValueError) as err:
            raise UsageError(f"{manifest}: the field 'engine' is incomplete ({type(err).__name__}: {err})") from None
        self.capabilities = Capabilities(**{f.name: getattr(caps, f.name) for f in fields(Capabilities)
                                           if f.name not in ("weights", "reasons", "switches")},
                                         weights=False, switches=(),
                                         reasons=MappingProxyType({**caps.reasons, "weights": NO_WEIGHTS}))
        self._described = dict(engine.get("describe") or {})
        self._extras = dict(engine.get("attributes") or {})
        self._answers: dict[str, list[dict]] = defaultdict(list)
        self._used: dict[str, int] = defaultdict(int)
        try:
            lines = (self.directory / CALLS).read_text().splitlines()
            for n, line in enumerate(lines, 1):
                entry = json.loads(line)
                self._answers[entry["key"]].append(entry)
        except (OSError, ValueError, KeyError) as err:
            raise UsageError(f"{self.directory / CALLS}: unreadable at line {n if lines else 0} "
                             f"({type(err).__name__}: {err})") from None

    def set_model_path(self, path: Path) -> None:
        """Where the model is now (a check that reads the file's tensor types asks the engine)."""
        self._extras["model_path"] = str(path)

    @property
    def calls(self) -> int:
        return sum(len(v) for v in self._answers.values())

    @property
    def unused(self) -> int:
        return sum(len(v) - self._used[k] for k, v in self._answers.items())

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        key = call_key(method, args, kwargs)
        entries = self._answers.get(key, [])
        n = self._used[key]
        if n >= len(entries):
            said = "made once" if len(entries) == 1 else f"made {len(entries)} times" if entries else "not made"
            raise Unsupported(f"the saved run has no answer for this {method} call ({said} in the run: "
                              "a replay answers only the calls the run made)")
        self._used[key] = n + 1
        entry = entries[n]
        if "unsupported" in entry:
            raise Unsupported(entry["unsupported"])
        arrays = {}
        if "arrays" in entry:
            with np.load(self.directory / entry["arrays"], allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        return decode(entry["answer"], arrays)


    def describe(self):
        return {**self._described, "replayed_from": str(self.directory)}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name == "chat_tokens" and self._extras.get("chat_tokens"):
            return lambda *a, **k: self._call("chat_tokens", *a, **k)
        if name in self._extras and name != "chat_tokens":
            return self._extras[name]
        raise AttributeError(name)


def engine_manifest(engine: Engine) -> dict:
    """What a replay needs of the engine itself: its name, vocabulary, capabilities, description
    and the plain attributes the stages read (the model path, the version)."""
    inner = getattr(engine, "inner", engine)
    attributes: dict[str, Any] = {"chat_tokens": callable(getattr(inner, "chat_tokens", None))}
    for name in ("model_path", "version"):
        value = getattr(inner, name, None)
        if isinstance(value, (str, int, float, Path)):
            attributes[name] = str(value) if isinstance(value, Path) else value
    return {"name": engine.name, "vocab_size": int(engine.vocab_size),
            "capabilities": capabilities_json(engine.capabilities), "describe": _plain(engine.describe()),
            "attributes": attributes}
