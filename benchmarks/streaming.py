"""Layer streaming: the reference over a model larger than it may hold, peak RSS vs file size.

Builds a synthetic llama-shaped GGUF of several GB (llama-3-8B layer shapes: D 4096, 32 / 8
heads, FFN 14336, vocab 32000; random Q8_0 blocks with small finite scales, F32 norms),
then in a fresh child process (so the peak RSS is the run's own, not the build's):
  1. a plain sequential read of the file (64 MB chunks, page cache dropped first);
  2. the reference in streaming mode (one layer's weights at a time, mmap pages released
     after each layer) over a short prompt, fp32, page cache dropped first.
Prints the peak RSS against the file size and against the bound the design promises
(process baseline + the largest layer dequantized + its raw bytes + an output-head chunk +
activations), and the time against the plain read. The file is deleted at the end.

Usage: python benchmarks/streaming.py [--layers 16] [--tokens 8] [--dir /tmp] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

Q8 = gguf.GGMLQuantizationType.Q8_0
D, H, HKV, FF, VOCAB = 4096, 32, 8, 14336, 32000
HD = D // H


def q8_0_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 rows [rows, cols/32*34]: f16 scale ~0.002 then 32 random int8."""
    n_blocks = rows * cols // 32
    data = rng.integers(-128, 128, size=(n_blocks, 34), dtype=np.int16).astype(np.uint8)
    scales = (0.001 + 0.002 * rng.random(n_blocks, dtype=np.float32)).astype(np.float16)
    data[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, cols // 32 * 34)


def build(path: Path, n_layer: int) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_dimension_count(HD)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)

    def add(name: str, rows: int, cols: int) -> None:
        blocks = q8_0_blocks(rows, cols, rng)
        w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=Q8)

    add("token_embd.weight", VOCAB, D)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(D, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(D, dtype=np.float32))
        add(f"blk.{i}.attn_q.weight", H * HD, D)
        add(f"blk.{i}.attn_k.weight", HKV * HD, D)
        add(f"blk.{i}.attn_v.weight", HKV * HD, D)
        add(f"blk.{i}.attn_output.weight", D, H * HD)
        add(f"blk.{i}.ffn_gate.weight", FF, D)
        add(f"blk.{i}.ffn_up.weight", FF, D)
        add(f"blk.{i}.ffn_down.weight", D, FF)
    w.add_tensor("output_norm.weight", np.ones(D, dtype=np.float32))
    add("output.weight", VOCAB, D)
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


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set (VmRSS) or its high-water mark (VmHWM), MiB. VmHWM, not
    getrusage's ru_maxrss: Linux carries ru_maxrss over fork + exec, so a child would report
    the parent's peak (the builder holds the whole file in memory before writing it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(path: Path, n_tokens: int) -> None:
    """Runs in a fresh process: measures, prints one JSON line."""
    import torch

    from ggufcheck.reference import ReferenceModel

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = memoryview(bytearray(64 << 20))
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    del buf
    baseline = rss_mb()
    drop_cache(path)
    tokens = list(range(1, n_tokens + 1))
    t0 = time.perf_counter()
    with ReferenceModel(path, dtype="fp32", streaming=True) as ref:
        layer_mb = max(ref.weights.layer_bytes(i) for i in range(ref.cfg.n_layer)) / 2**20
        layer_params = max(sum(ref.gguf.tensors[n].n_elements for n in ref.weights._layer_names[i])
                           for i in range(ref.cfg.n_layer))
        per_layer: list[float] = []
        run_layer = ref._layer

        def measured(i, *a, **k):  # RSS after each layer (weights released): must stay flat
            out = run_layer(i, *a, **k)
            per_layer.append(rss_mb())
            return out

        ref._layer = measured
        with torch.no_grad():
            logits = ref.prefill(tokens, trace=False)
    ref_s = time.perf_counter() - t0
    peak = rss_mb("VmHWM")
    head_chunk_mb = 16384 * D * 4 / 2**20
    print(json.dumps(dict(read_s=read_s, ref_s=ref_s, peak_mb=peak, baseline_mb=baseline,
                          layer_raw_mb=layer_mb, layer_fp32_mb=layer_params * 4 / 2**20,
                          head_chunk_mb=head_chunk_mb, finite=bool(torch.isfinite(logits).all()),
                          rss_after_layer=per_layer)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.tokens)
        return 0
    path = args.dir / "ggufcheck-streaming-bench.gguf"
    print(f"building a {args.layers}-layer llama-shaped Q8_0 model at {path} ...", flush=True)
    build(path, args.layers)
    size_mb = path.stat().st_size / 2**20
    try:
        out = subprocess.run([sys.executable, __file__, "--child", str(path), "--tokens", str(args.tokens)],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        bound = r["baseline_mb"] + r["layer_fp32_mb"] + r["layer_raw_mb"] + r["head_chunk_mb"]
        print(f"file {size_mb:.0f} MiB; largest layer {r['layer_raw_mb']:.0f} MiB raw, "
              f"{r['layer_fp32_mb']:.0f} MiB dequantized fp32; {args.tokens} tokens; {os.cpu_count()} cores")
        print(f"peak RSS {r['peak_mb']:.0f} MiB = {r['peak_mb'] / size_mb:.2f} x file size; "
              f"bound (baseline {r['baseline_mb']:.0f} + layer fp32 + layer raw + head chunk "
              f"{r['head_chunk_mb']:.0f}) = {bound:.0f} MiB -> {'holds' if r['peak_mb'] <= bound * 1.25 else 'EXCEEDED'} "
              f"(peak / bound {r['peak_mb'] / bound:.2f})")
        after = r["rss_after_layer"]
        print(f"RSS after each layer: first {after[0]:.0f} MiB, last {after[-1]:.0f} MiB, max {max(after):.0f} MiB")
        print(f"time: plain sequential read (cold) {r['read_s']:.1f} s ({size_mb / r['read_s']:.0f} MiB/s), "
              f"streaming reference (cold) {r['ref_s']:.1f} s: ratio {r['ref_s'] / r['read_s']:.1f}; "
              f"logits finite: {r['finite']}")
    finally:
        if not args.keep:
            path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
