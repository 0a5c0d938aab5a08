"""Whole-file scan rate: ``inspect``'s dequantize-and-health-check pass vs a plain read.

Builds a synthetic multi-GB GGUF (random quant blocks with finite scales, a Q4_K / Q6_K /
Q8_0 / Q4_0 mix like a real model's), then in the same run measures:
  1. a plain sequential read of the file (64 MB chunks), cold (page cache dropped for the
     file with posix_fadvise) and warm;
  2. ggufcheck's health scan of every tensor (the file stage of ``inspect``), cold and warm.
Prints MB/s of each and the ratio scan / read. The file is deleted at the end.

Usage: python benchmarks/scan.py [--gb 2.0] [--dir /tmp] [--keep]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import gguf
import numpy as np

from ggufcheck.gguf.health import SCALE_FIELDS, scan_model
from ggufcheck.gguf.reader import open_gguf

Q = gguf.GGMLQuantizationType
MIX = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0]
ROW = 4096


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, rng: np.random.Generator) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * ROW // block_size
    data = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    scales = (rng.random(n_blocks, dtype=np.float32) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    for off in SCALE_FIELDS[qtype]:
        data[:, off : off + 2] = scales
    return data.reshape(rows, ROW // block_size * type_size)


def build(path: Path, gigabytes: float) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(0)
    target = gigabytes * 1e9
    written, i = 0, 0
    while written < target:
        qtype = MIX[i % len(MIX)]
        rows = 8192
        blocks = random_blocks(qtype, rows, rng)
        w.add_tensor(f"blk.{i // len(MIX)}.t{i % len(MIX)}.weight", blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        written += blocks.nbytes
        i += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read(path: Path) -> float:
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 << 20)
        view = memoryview(buf)
        while f.readinto(view):
            pass
    return time.perf_counter() - started


def scan(path: Path) -> float:
    started = time.perf_counter()
    with open_gguf(path) as model:
        healths = scan_model(model)
    elapsed = time.perf_counter() - started
    bad = [h.name for h in healths if not h.healthy]
    assert not bad, f"synthetic tensors reported unhealthy: {bad[:3]}"
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    path = args.dir / "ggufcheck-scan-bench.gguf"
    print(f"building {args.gb:.1f} GB synthetic model at {path} ...", flush=True)
    build(path, args.gb)
    size_mb = path.stat().st_size / 1e6
    try:
        rows = []
        for label, fn in (("plain read", plain_read), ("ggufcheck scan", scan)):
            drop_cache(path)
            cold = fn(path)
            warm = fn(path)
            rows.append((label, size_mb / cold, size_mb / warm))
        print(f"\nfile: {size_mb:.0f} MB, cores: {os.cpu_count()}")
        print(f"{'':16} {'cold MB/s':>10} {'warm MB/s':>10}")
        for label, cold, warm in rows:
            print(f"{label:16} {cold:10.0f} {warm:10.0f}")
        (_, read_cold, read_warm), (_, scan_cold, scan_warm) = rows
        print(f"{'scan / read':16} {scan_cold / read_cold:10.2f} {scan_warm / read_warm:10.2f}")
    finally:
        if not args.keep:
            path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
