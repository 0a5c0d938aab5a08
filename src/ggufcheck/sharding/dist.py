"""A small launcher for N tensor-parallel ranks: one process each, one process group per run.

Why not torchrun: the check must run from inside the CLI and tests, on 2 CPU cores with
gloo, and later on 8 GPUs with NCCL, and must never hang. So:

- the parent starts ``world_size`` processes (``fork`` for gloo on Linux: no re-import, the
  payload is inherited; ``spawn`` for NCCL, which must not inherit a CUDA context);
- ranks meet through a ``FileStore`` in a private temporary directory (no ports to race for);
- each rank runs ``fn(ctx, payload)`` once: callers batch every layer kind into one run,
  reusing the process group, because process start-up is the cost;
- results come back as files (``torch.save``), errors as the rank's traceback;
- a deadline for the whole run and a collective timeout inside the group: a hung or dead
  rank ends the run with :class:`RanksFailed` naming the rank, and the parent kills (by
  pid, only its own children) whatever is still running.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ggufcheck.errors import GGUFCheckError, UsageError
from ggufcheck.sharding import BACKENDS


class RanksFailed(GGUFCheckError):
    """A rank raised, died, or did not finish before the deadline."""

    def __init__(self, message: str, *, rank: int | None = None, detail: str = ""):
        super().__init__(message, tip="rerun with fewer ranks or a longer --timeout; the rank's traceback is in the report")
        self.rank = rank
        self.detail = detail


@dataclass(frozen=True)
class DistOptions:
    """How to launch the ranks."""

    world_size: int
    backend: str = "auto"  # "gloo" | "nccl" | "auto" (NCCL when enough GPUs are visible)
    timeout_s: float = 120.0  # whole run; collectives time out a little earlier
    start_method: str | None = None  # default: fork for gloo on Linux, spawn otherwise

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"the TP size must be >= 1, got {self.world_size}")
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")


def resolve_backend(backend: str, world_size: int) -> str:
    """``auto`` -> ``nccl`` when torch sees at least ``world_size`` GPUs and NCCL, else ``gloo``."""
    import torch.distributed as dist

    if backend == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not dist.is_nccl_available() or gpus < world_size:
            raise UsageError(f"--backend nccl needs {world_size} GPUs and NCCL; torch sees {gpus} GPU(s)"
                             f"{'' if dist.is_nccl_available() else ' and no NCCL'}",
                             tip="use --backend gloo to run the ranks on CPU")
    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed")
    return backend


@dataclass
class RankContext:
    """What a rank's function gets: who it is, its device, and the two collectives used."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    record: list | None = None  # when a list: every collective's local input is appended

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over ranks (a new tensor; ``t`` is left alone)."""
        import torch.distributed as dist

        if self.record is not None:
            self.record.append(t.detach().cpu().clone())
        out = t.detach().clone().to(self.device).contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Rank-ordered concatenation of every rank's ``t`` along ``dim``."""
        import torch.distributed as dist

        if self.record is not None:
            self.record.append(t.detach().cpu().clone())
        t = t.detach().to(self.device).contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=dim)

    def to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)


@dataclass
class LocalContext(RankContext):
    """A stand-in rank without peers: collectives return the local tensor unchanged.

    Used to compute what rank r's partial results SHOULD be (with a known-good loader) in
    the parent process, so a wrong result can be attributed to the rank that made it.
    """

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.record is not None:
            self.record.append(t.detach().cpu().clone())
        return t.detach().clone()

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.record is not None:
            self.record.append(t.detach().cpu().clone())
        return t.detach()


def run_ranks(fn: Callable[[RankContext, Any], Any], payload: Any, options: DistOptions) -> list[Any]:
    """Run ``fn(ctx, payload)`` on every rank; return the per-rank results (moved to CPU).

    ``fn`` and ``payload`` must be picklable when the start method is ``spawn`` (module-level
    functions). Raises :class:`RanksFailed` on any rank's exception, death or timeout.
    """
    backend = resolve_backend(options.backend, options.world_size)
    method = options.start_method or ("fork" if backend == "gloo" and sys.platform == "linux" else "spawn")
    ctx = multiprocessing.get_context(method)
    workdir = Path(tempfile.mkdtemp(prefix="ggufcheck-tp-"))
    collective_timeout = max(5.0, options.timeout_s * 0.8)
    procs = []
    try:
        for rank in range(options.world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(rank, options.world_size, backend, str(workdir), collective_timeout, fn, payload),
                name=f"ggufcheck-tp-rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        _wait(procs, workdir, options.timeout_s)
        return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(options.world_size)]
    finally:
        for p in procs:  # only our own children, by handle
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait(procs: list, workdir: Path, timeout_s: float) -> None:
    """Wait for all ranks; on the first failure give the others a moment, then raise."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        failed = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
        if failed:
            time.sleep(0.5)  # let the peers of a dead rank fail too, then blame the first
            failed = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
            rank = min(failed, key=lambda r: _error_time(workdir, r))
            err = workdir / f"rank{rank}.err"
            detail = err.read_text() if err.exists() else ""
            last = detail.strip().splitlines()[-1] if detail.strip() else f"exit code {procs[rank].exitcode}"
            raise RanksFailed(f"rank {rank} of {len(procs)} failed: {last}", rank=rank, detail=detail)
        if not alive:
            return
        if time.monotonic() > deadline:
            raise RanksFailed(f"ranks {alive} of {len(procs)} did not finish within {timeout_s:.0f} s "
                              "(a hung collective or a dead peer)", rank=alive[0])
        procs[alive[0]].join(0.05)


def _error_time(workdir: Path, rank: int) -> float:
    """When a rank wrote its traceback (a rank that died without one: last)."""
    err = workdir / f"rank{rank}.err"
    return err.stat().st_mtime_ns if err.exists() else float("inf")


def _rank_main(rank: int, world_size: int, backend: str, workdir: str, timeout_s: float,
               fn: Callable[[RankContext, Any], Any], payload: Any) -> None:
    """One rank: join the group, run ``fn``, save its result; on error save the traceback."""
    import torch.distributed as dist

    out = Path(workdir)
    try:
        torch.set_num_threads(1)  # N ranks on few cores: one thread each
        if backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks on this host
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=f"file://{workdir}/store", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            result = fn(RankContext(rank, world_size, backend, device), payload)
            dist.barrier()
        except BaseException:  # write the traceback BEFORE the group closes: peers fail after us
            (out / f"rank{rank}.err").write_text(traceback.format_exc())
            os._exit(1)
        finally:
            dist.destroy_process_group()
        tmp = out / f".rank{rank}.pt"
        torch.save(_to_cpu(result), tmp)
        os.replace(tmp, out / f"rank{rank}.pt")
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # skip atexit handlers inherited through fork


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
