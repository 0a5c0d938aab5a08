"""One CPU budget for every thread pool in the process, sized from the cores actually free.

A diagnosis runs torch (OpenMP), numba and llama.cpp (ggml) one after another, each with
its own pool. On a quiet machine their defaults are right. With other work on the cores,
threads that spin while they wait for each other (libgomp spins ~300k iterations before it
sleeps) burn CPU time that buys nothing: measured on 2 cores (benchmarks/under_load.py),
a SmolLM2 diagnosis took 3.3x its quiet wall time and ~2x its CPU time next to two busy
processes. So, once, before torch or numba are imported (the CLI calls :func:`configure`
first):

- the cores this process may use (affinity and a cgroup CPU quota), and how many of them
  are idle now (``/proc/stat`` sampled over 0.2 s while this process sleeps);
- every pool gets that many threads (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
  ``OPENBLAS_NUM_THREADS``, ``NUMBA_NUM_THREADS``; llama.cpp's ``n_threads`` through
  :func:`threads`);
- OpenMP waits briefly (``GOMP_SPINCOUNT`` 10000) on a quiet machine, and sleeps at once
  (``OMP_WAIT_POLICY=PASSIVE``) when fewer cores are idle than the process may use.

A variable the user already set is left alone; ``GGUFCHECK_THREADS=N`` fixes the count, and
``GGUFCHECK_THREADS=off`` leaves every pool at its own default.
"""

from __future__ import annotations

import os
import time

_CHOSEN: int | None = None


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def idle_cores(sample_s: float = 0.2) -> float | None:
    """How many cores' worth of CPU time was idle over ``sample_s`` (None off Linux)."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return idle, sum(fields[:8])

    try:
        idle0, total0 = read()
        time.sleep(sample_s)
        idle1, total1 = read()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (idle1 - idle0) / (total1 - total0) * (os.cpu_count() or 1)


def configure() -> int | None:
    """Size the thread pools once (see the module docstring); the chosen count, or None
    when ``GGUFCHECK_THREADS=off``."""
    global _CHOSEN
    wanted = os.environ.get("GGUFCHECK_THREADS", "").strip().lower()
    if wanted == "off":
        return None
    cores = usable_cores()
    n = max(1, int(wanted)) if wanted.isdigit() else cores
    idle = idle_cores()
    busy = idle is not None and idle < min(n, cores) - 0.5
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, str(n))
    if busy:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    else:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    _CHOSEN = n
    return n


MMAP_THRESHOLD_BYTES = 32 << 20  # allocations up to this size come from (and go back to) glibc's heap
TRIM_THRESHOLD_BYTES = 256 << 20  # freed heap memory glibc keeps (counted in the plan's fixed part)


def keep_freed_memory() -> bool:
    """Ask glibc to serve allocations up to 32 MB from its heap and keep up to 256 MB freed there.

    The reference reads a big model as a stream of short-lived tensors (8 MB row blocks);
    glibc gives every allocation over its dynamic threshold fresh pages from the kernel and
    hands them back on free, so each block is faulted in and zeroed again: ~10% of a streaming
    decode step on 2 cores. With the threshold at glibc's maximum (32 MB), a freed block is
    reused warm; larger tensors still come from and go back to the kernel. (Keeping every
    allocation on the heap, M_MMAP_MAX = 0, was 5% faster again but doubled the peak of a
    2080-token GLM-5-dims pass through fragmentation: 4.65 GB against 2.47.)
    ``GGUFCHECK_MALLOC=default`` leaves glibc as it is; a no-op off glibc. True when applied."""
    if os.environ.get("GGUFCHECK_MALLOC", "").lower() == "default":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return (bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
                and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))
    except (OSError, AttributeError):
        return False


def threads() -> int:
    """The thread count for a pool created now (llama.cpp's n_threads): the configured one,
    else the usable cores."""
    return _CHOSEN or usable_cores()
