"""Prototype (not wired in): fused dequantize-and-statistics scan, one pass over the quantized bytes.

Why it is here: the whole-file scan (benchmarks/scan.py) runs at ~0.1-0.3x the plain read rate
because health.py dequantizes 1 MB chunks (one parallel launch each) and then runs a branchy,
unvectorized statistics loop (4-6 GB/s of float32). This prototype decodes each row into an
L1/L2-resident scratch row with a *serial* compile of the cpu.py kernel and computes the
statistics with integer bit tricks (non-finite count, max |x| and zero test on the float32 bits,
which vectorize without fastmath) plus float64 sums under reassoc only. Measured 2026-12-03 on
the 2-core CI-like machine, 256 MB in memory: Q4_K 5955 MB/s, Q6_K 5764, Q8_0 5012, Q4_0 2497,
against a plain cold read of ~2400 MB/s; sums agree with chunk_stats.

To land it: numba caches neither closures nor entry points taking a dispatcher argument, and a
serial njit of cpu.<k>.py_func would share the parallel kernel's cache index; so cpu.py must grow
module-level serial block functions (cache=True) that both its parallel kernels and per-type
fused wrappers call. Then: exact slow path for rows with NaN/Inf, fused bad-scale check,
F32/F16/BF16, tests against the chunked gguf-py path, benchmarks/scan.py re-run.

Run: python tools/prototypes/fused_scan.py
"""
import time, numpy as np, gguf, numba
from numba import njit, prange
from ggufcheck.gguf.quants import samples, tables, cpu
from ggufcheck.gguf.quants.host import dequantize_into
from ggufcheck.gguf.stats import chunk_stats
numba.config.THREADING_LAYER='workqueue'
Q=gguf.GGMLQuantizationType

@njit(fastmath={'reassoc','nsz','contract'}, boundscheck=False)
def row_stats(v, bits, out):
    s = 0.0; sq = 0.0
    nonfin = 0; amax = np.uint32(0); orb = np.uint32(0)
    for i in range(v.size):
        a = bits[i] & np.uint32(0x7fffffff)
        nonfin += (a >= np.uint32(0x7f800000))
        amax = max(amax, a)
        orb |= a
        x = np.float64(v[i])
        s += x
        sq += x * x
    out[0] = nonfin; out[1] = amax; out[2] = orb; out[3] = s; out[4] = sq

def make_scan(serial):
    @njit(parallel=True, boundscheck=False)
    def scan(src2d, row_el, h, out):
        n = src2d.shape[0]
        ntask = min(n, 64)
        for t in prange(ntask):
            lo = t * n // ntask; hi = (t + 1) * n // ntask
            scratch = np.empty(row_el, np.float32)
            bits = scratch.view(np.uint32)
            for r in range(lo, hi):
                serial(src2d[r], scratch, h)
                row_stats(scratch, bits, out[r])
    return scan

for name in ('Q4_K','Q4_0','Q8_0','Q6_K'):
    q=Q[name]; block,size=tables.block_geometry(q); rb=4096//block*size; n=256*2**20//rb//1024*1024
    d=samples.realistic_blocks(q,n*4096//block,seed=1).reshape(n,rb)
    serial = njit(boundscheck=False)(getattr(cpu, name.lower()).py_func)
    scan = make_scan(serial)
    h = tables.f16_to_f32()
    out = np.zeros((n, 5))
    t=time.perf_counter(); scan(d, 4096, h, out); tc=time.perf_counter()-t
    best=1e9
    for _ in range(3):
        t=time.perf_counter(); scan(d, 4096, h, out); best=min(best,time.perf_counter()-t)
    # check vs chunk stats
    ref = dequantize_into(d[:64], q, np.empty((64,4096),np.float32)); c = chunk_stats(ref)
    print(name, f'compile {tc:.1f}s fused {d.nbytes/best/1e6:.0f} MB/s ({n*4096/best/1e9:.1f} Gelem/s)', 'sum ok', np.isclose(out[:64,3].sum(), c.total), np.isclose(out[:64,4].sum(), c.total_sq), out[:64,1].max().astype(np.uint32).view(np.float32) if False else np.array([out[:64,1].max()],np.uint32).view(np.float32)[0], c.absmax)
