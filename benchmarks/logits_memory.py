"""Peak memory of the full-vocabulary logit metrics: whole-table vs blocks of rows.

The logits stage and the prefill sweep compare [T, V] log-prob tables. On Gemma 3's 262,144
token vocabulary a 513-row table is 1.07 GB in float64, and whole-table arithmetic (KL, NMSE,
a top-k partition) made several temporaries of that size at once. ``checks.logits`` and
``TokenLogprobs.top_k`` now work a block of rows at a time (``engines.base.row_blocks``).
This script measures both side by side in one run (numpy's allocations, via tracemalloc) and
checks that they give the same numbers.

    python benchmarks/logits_memory.py [--rows 513] [--vocab 262144]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from ggufcheck.checks.logits import compare_tables
from ggufcheck.engines.base import TokenLogprobs


def whole_table(ref: TokenLogprobs, eng: TokenLogprobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The metrics as written before (whole-table temporaries): KL, NMSE, top-2 margin."""
    lr, le = ref.logprobs.astype(np.float64), eng.logprobs.astype(np.float64)
    kl = (np.exp(lr) * (lr - le)).sum(axis=1)
    nmse = ((le - lr) ** 2).mean(axis=1) / np.maximum(lr.var(axis=1), 1e-30)
    ids = np.argpartition(-ref.logprobs, 1, axis=1)[:, :2]
    top2 = np.sort(np.take_along_axis(ref.logprobs, ids, axis=1), axis=1)[:, ::-1]
    return kl, nmse, top2[:, 0] - top2[:, 1]


def measure(fn):
    tracemalloc.start()
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, peak, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=513)
    ap.add_argument("--vocab", type=int, default=262144)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((args.rows, args.vocab)) * 3
    lr = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    noisy = logits + 0.05 * rng.standard_normal(logits.shape)
    le = noisy - np.log(np.exp(noisy).sum(axis=1, keepdims=True))
    del logits, noisy
    tokens = rng.integers(0, args.vocab, args.rows)
    ref, eng = TokenLogprobs(tokens, args.vocab, lr), TokenLogprobs(tokens, args.vocab, le)
    table_gb = lr.nbytes / 2**30
    (kl0, nmse0, margin0), peak0, s0 = measure(lambda: whole_table(ref, eng))
    m, peak1, s1 = measure(lambda: compare_tables(ref, eng))
    rows = m["position"]
    same = (np.allclose(m["kl"], kl0[rows], rtol=1e-9, atol=1e-15) and np.allclose(m["nmse"], nmse0[rows], rtol=1e-9)
            and np.allclose(m["ref_margin"], margin0[rows], rtol=1e-12))
    print(f"{args.rows} rows x {args.vocab} vocabulary: one float64 table {table_gb:.2f} GB")
    print(f"whole-table metrics: peak {peak0 / 2**30:.2f} GB above the tables, {s0:.2f} s")
    print(f"blocks of rows:      peak {peak1 / 2**30:.2f} GB above the tables, {s1:.2f} s")
    print(f"peak ratio whole / blocks: {peak0 / max(peak1, 1):.1f}x; time ratio {s0 / max(s1, 1e-9):.2f}x; "
          f"same numbers: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
