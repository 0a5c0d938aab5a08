"""Numba CPU kernels, one module per quantization family; ``registry.py`` names them per type.

Why numba: gguf-py's vectorized numpy dequantization runs at tens of MB/s on a 2-core machine;
a 400 GB model needs GB/s. Each kernel walks the blocks in parallel (``prange``) and writes
float32 straight into the caller's buffer, with no temporaries.

Why one module per family: a family's members share their block layout and field helpers,
and a type's variants sit side by side, so one reading holds the element order once:

- ``floats``: F16, BF16 (no blocks);
- ``legacy``: the 32-element blocks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0;
- ``kquants``: the 256-element super-blocks Q2_K .. Q6_K;
- ``levels``: 4-bit indices into a level table, IQ4_NL, IQ4_XS, MXFP4, NVFP4;
- ``ternary``: TQ1_0, TQ2_0;
- ``grids``: the codebook types IQ1_S .. IQ3_S;
- ``common``: byte readers and constants every family uses; ``lanes``: the streaming-store
  lane operation (LLVM intrinsics) of the ``*_streaming`` variants.

Variants of one type (all bit-exact with gguf-py, tests hold each to it and to each other):

- ``<type>(src, out, *tables)``: the plain kernel, every size;
- ``<type>_streaming(src, out, *tables, n_tasks)``: the same values written with non-temporal
  stores, for outputs past twice the last-level cache (``lanes.py`` says why and measures);
  legacy and K-quant types except Q3_K (measured slower);
- the health scan's fused pass compiles the plain kernel serially (``fused.py``), so it has no
  source of its own.

Vectorizing the plain kernels: a per-block loop with a constant trip count (``range(32)``) is
fully unrolled by LLVM and then left to the SLP vectorizer, which must keep every load of
``row`` after the previous store to ``orow`` (it cannot prove the two arrays apart), so it emits
scalar code. Where that mattered (Q8_0, Q4_0, Q4_1, Q6_K) the trip count is read from the
output's shape (``w = o2.shape[1]``, i.e. 32, unknown at compile time): the loop vectorizer then
takes the loop, with a runtime overlap check, and emits 8-wide int->float converts and
multiplies (1.5-2x measured into a reused buffer, reaching the machine's fill rate). Types whose
inner loop is a table lookup (IQ4_NL) or which SLP already vectorizes (Q2_K) measured no faster
that way and keep constant trip counts. Per block, each source byte is read once and its fields
are split with constant shifts (``x & 3``, ``(x >> 2) & 3``, ...) into the outputs it feeds:
that shape is what LLVM vectorizes (2-4x over a loop with a per-element variable shift,
measured on the K-quants).

Bit-exactness rules followed everywhere (gguf-py is the oracle):
- every value is float32 and every product/sum is one float32 IEEE operation, in gguf-py's
  order (e.g. Q4_1 is ``(d * q) + m``, two roundings; no fused multiply-add: numba emits no
  FMA without ``fastmath``);
- float16 scales are widened through a 65536-entry table built by numpy's own conversion;
- integer field unpacking mirrors gguf-py's reshapes; the comment above each kernel gives
  the element order as ``e = ...``.

Inside a plain kernel ``src`` is the flat uint8 bytes of whole blocks, ``out`` the flat float32
output (``n_blocks * block_elements``), ``row``/``orow`` one block's bytes and values.
"""
