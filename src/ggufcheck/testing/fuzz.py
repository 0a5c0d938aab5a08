"""Mutation fuzzing of the validated reader: shared by the tests and tools/fuzz_reader.py.

A tiny valid GGUF is written with gguf-py's writer, then mutated (bit flips, byte
overwrites, truncations, header fields set to extreme values). Every outcome must be a
valid parse (whose tensors then dequantize and health-scan without crashing) or the
project's own error. Anything else is a crash.
"""

from __future__ import annotations

import os
import random
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ggufcheck.errors import GGUFCheckError
from ggufcheck.gguf.health import scan_model
from ggufcheck.gguf.reader import open_gguf

EXTREMES = [0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, 2**40]


def write_seed_file(path: Path, seed: int = 0) -> Path:
    """A small valid GGUF with strings, arrays and several tensor types."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_string("general.name", "fuzz seed")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "cd", "<s>"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0, 0.5])
    w.add_uint32("test.u32", 7)
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.bool", True)
    f32 = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("token_embd.weight", f32)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F16):
        data = rng.standard_normal((8, 64)).astype(np.float32)
        q = gguf.quants.quantize(data, qtype)
        w.add_tensor(f"blk.0.{qtype.name.lower()}.weight", q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass
class Outcome:
    kind: str  # "parsed", "rejected" or "crash"
    detail: str


def check_bytes(data: bytes, workdir: Path) -> Outcome:
    """Parse (and on success health-scan) one candidate file."""
    path = workdir / "case.gguf"
    path.write_bytes(data)
    try:
        with open_gguf(path) as model:
            scan_model(model)
        return Outcome("parsed", "")
    except GGUFCheckError as err:
        return Outcome("rejected", str(err))
    except Exception as err:  # anything else is a defect in ggufcheck
        return Outcome("crash", f"{type(err).__name__}: {err}")


def mutations(seed_bytes: bytes, rng: random.Random):
    """Yield (description, mutated bytes) forever."""
    n = len(seed_bytes)
    header_fields = [(4, "<I"), (8, "<Q"), (16, "<Q")]  # version, tensor_count, kv_count
    while True:
        choice = rng.randrange(5)
        data = bytearray(seed_bytes)
        if choice == 0:
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(n)
                data[pos] ^= 1 << rng.randrange(8)
            yield "bit flips", bytes(data)
        elif choice == 1:
            cut = rng.randrange(n)
            yield f"truncate at {cut}", bytes(data[:cut])
        elif choice == 2:
            pos, fmt = rng.choice(header_fields)
            value = rng.choice(EXTREMES) & (0xFFFFFFFF if fmt == "<I" else 0xFFFFFFFFFFFFFFFF)
            struct.pack_into(fmt, data, pos, value)
            yield f"header field at {pos} = {value}", bytes(data)
        elif choice == 3:
            # overwrite an 8-byte word anywhere in the header region with an extreme value
            pos = rng.randrange(0, min(n - 8, 2048))
            struct.pack_into("<Q", data, pos, rng.choice(EXTREMES))
            yield f"u64 at {pos} = extreme", bytes(data)
        else:
            pos = rng.randrange(n)
            length = rng.randint(1, 64)
            data[pos : pos + length] = bytes(rng.randrange(256) for _ in range(length))
            yield f"random bytes at {pos}", bytes(data)


def fuzz(cases: int, seed: int = 0, workdir: Path | None = None):
    """Run ``cases`` mutations; returns (counts by outcome kind, list of crashes)."""
    rng = random.Random(seed)
    own_dir = workdir is None
    tmp = Path(tempfile.mkdtemp(prefix="ggufcheck-fuzz-")) if own_dir else workdir
    try:
        seed_bytes = write_seed_file(tmp / "seed.gguf", seed).read_bytes()
        counts = {"parsed": 0, "rejected": 0, "crash": 0}
        crashes = []
        gen = mutations(seed_bytes, rng)
        for _ in range(cases):
            desc, data = next(gen)
            outcome = check_bytes(data, tmp)
            counts[outcome.kind] += 1
            if outcome.kind == "crash":
                crashes.append((desc, outcome.detail, data))
        return counts, crashes
    finally:
        if own_dir:
            for p in tmp.iterdir():
                os.unlink(p)
            os.rmdir(tmp)
