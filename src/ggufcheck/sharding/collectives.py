"""Collectives self-test: all-reduce and all-gather of tensors whose results are known exactly.

Garbage only under TP can be the communication layer itself (custom all-reduce races,
broken peer-to-peer: fault catalog #17). Before trusting any sharded comparison, each rank
sends small integers that every dtype represents exactly, so the expected sums and
gathers follow from a formula, with no tolerance:

- all-reduce: rank r sends ``(r + 1) * (i % m + 1)``; the sum is ``(i % m + 1) * N(N+1)/2``
  (m = 97, or 7 for bf16 / fp16 so that sums up to TP 8 stay exact)
- all-gather: rank r sends ``r * 1000 + (i % 500)``; the result is every rank's in rank order

Sizes include one larger than typical chunk sizes of ring algorithms. On NCCL the low
precision dtypes the engines reduce in (bf16, fp16) are exercised as well. The answers are
judged in :mod:`ggufcheck.checks.sharding.invariance` (``check_collectives``).
"""

from __future__ import annotations

import torch

from ggufcheck.sharding.dist import RankContext

SIZES = (7, 4099, 65537)  # odd, just past a power of two, and one past 2^16


def _dtypes(backend: str) -> tuple[torch.dtype, ...]:
    # bf16 / fp16 integer sums stay exact while below 256 / 2048: we keep values small
    return (torch.float64, torch.float32, torch.bfloat16, torch.float16) if backend == "nccl" else (
        torch.float64, torch.float32)


def _modulus(dtype: torch.dtype) -> int:
    # max sum at TP 8 is m * 36: exact in fp32 / fp64 for 97, in bf16 (<= 256) for 7
    return 97 if dtype in (torch.float64, torch.float32) else 7


def _reduce_input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return ((rank + 1) * (torch.arange(n) % _modulus(dtype) + 1)).to(dtype)


def _gather_input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (rank * 1000 + torch.arange(n) % 500).to(dtype) if dtype in (torch.float64, torch.float32) else (
        (rank * 8 + torch.arange(n) % 8).to(dtype))


def rank_collectives(ctx: RankContext, sizes: tuple[int, ...] = SIZES) -> dict[str, torch.Tensor]:
    """What one rank receives from each collective (run inside :func:`dist.run_ranks`)."""
    out = {}
    for dtype in _dtypes(ctx.backend):
        for n in sizes:
            if dtype in (torch.bfloat16, torch.float16) and n > 4099:
                continue
            key = f"{str(dtype).removeprefix('torch.')}/{n}"
            out[f"all_reduce/{key}"] = ctx.all_reduce(ctx.to(_reduce_input(ctx.rank, n, dtype))).cpu()
            out[f"all_gather/{key}"] = ctx.all_gather(ctx.to(_gather_input(ctx.rank, n, dtype)), dim=0).cpu()
    return out


def expected(op: str, dtype: torch.dtype, n: int, world_size: int) -> torch.Tensor:
    """The exact answer, from the formula (not from a second collective)."""
    if op == "all_reduce":
        return ((torch.arange(n) % _modulus(dtype) + 1) * (world_size * (world_size + 1) // 2)).to(dtype)
    return torch.cat([_gather_input(r, n, dtype) for r in range(world_size)])
