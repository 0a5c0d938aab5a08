"""The rank launcher and the collectives self-test (gloo, N processes on this CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from ggufcheck.results import Status
from ggufcheck.checks.sharding.invariance import check_collectives
from ggufcheck.sharding import collectives
from ggufcheck.sharding.dist import DistOptions, RanksFailed, run_ranks


def _collect(ctx, payload):
    return collectives.rank_collectives(ctx)


def _hang_on_rank1(ctx, payload):
    if ctx.rank == 1:
        time.sleep(600)
    return ctx.all_reduce(torch.ones(1))


def _raise_on_rank1(ctx, payload):
    if ctx.rank == 1:
        raise RuntimeError("boom on purpose")
    return ctx.all_reduce(torch.ones(1))


def _wrong_sum(ctx, payload):
    """A broken all-reduce stand-in: rank 0 adds 1 to what it received."""
    out = collectives.rank_collectives(ctx, sizes=(7,))
    if ctx.rank == 0:
        out = {k: (v + 1 if k.startswith("all_reduce") else v) for k, v in out.items()}
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])  # TP 8: test_invariance.py::test_tp8_on_8_head_models[llama]
def test_collectives_are_exact(tp):
    per_rank = run_ranks(_collect, None, DistOptions(tp, "gloo", timeout_s=60))
    results = check_collectives(per_rank, "gloo")
    assert results and all(r.status is Status.PASS for r in results)


def test_a_wrong_collective_result_fails():
    per_rank = run_ranks(_wrong_sum, None, DistOptions(2, "gloo", timeout_s=60))
    results = check_collectives(per_rank, "gloo")
    bad = [r for r in results if r.failed]
    assert bad and all("all_reduce" in r.check for r in bad) and bad[0].worst["rank"] == 0


@pytest.mark.slow
def test_a_hung_rank_times_out():
    started = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        run_ranks(_hang_on_rank1, None, DistOptions(2, "gloo", timeout_s=4))
    assert time.monotonic() - started < 30
    assert "did not finish" in err.value.message or "failed" in err.value.message


def test_a_raising_rank_is_named():
    with pytest.raises(RanksFailed) as err:
        run_ranks(_raise_on_rank1, None, DistOptions(2, "gloo", timeout_s=30))
    assert err.value.rank == 1 and "boom on purpose" in err.value.message
