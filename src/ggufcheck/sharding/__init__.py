"""Tensor-parallel sharding verification, on CPUs, before any GPU is rented.

The data flow, one module each:

- ``rules``       how vLLM splits each tensor under TP (column / row / replicated / vocab),
                  the per-rank slice of a tensor, vocabulary padding, kv-head replication
- ``plan``        static checks from the file alone: heads and FF dims divisible, row
                  splits of quantized bytes on block boundaries, vocab padding, memory
- ``mla``         the MLA kv_b rebuilt from attn_k_b / attn_v_b, split per rank the way
                  vLLM does, and the per-rank W_UK / W_UV invariants
- ``dist``        a small launcher: N ranks (gloo on CPU, NCCL on GPUs), one process group
                  per run, timeouts so a hung rank never hangs the command line
- ``collectives`` all-reduce / all-gather self-test with exactly known answers
- ``parallel``    the sharded layer math (column-parallel, row-parallel + all-reduce,
                  vocab-parallel embedding, parallel lm_head) in fp64
- ``invariance``  sharded vs unsharded, per layer kind, on the file's real weights
- ``weights``     the ``weights`` stage: per-rank loaded weights vs their expected slices
"""

# the process-group backends ``dist`` runs; here so the command line can offer them without
# importing torch (1.7 s) for every command
BACKENDS = ("auto", "gloo", "nccl")
