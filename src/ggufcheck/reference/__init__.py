"""The reference forward pass: what a GGUF file should compute, in readable PyTorch.

Weights are the file's own dequantized values (read in the GGUF layout, not via an HF
rebuild); arithmetic is fp32 or fp64 on CPU or CUDA. Entry points::

    from ggufcheck.reference import ReferenceModel, Trace
    ref = ReferenceModel("model.gguf", dtype="fp64")
    trace = ref.prefill([1, 2, 3])          # per-layer states + log-softmax
    trace.save("golden"); Trace.load("golden")
    out = ref.run_layer(i, trace.layer_input(i), trace.positions)   # replay one layer

Layout: config.py (frozen config from metadata) -> layers.py (primitives) -> mla.py /
dsa.py (MLA, DSA indexer) -> dense.py / gemma3.py / gqa_moe.py / mla_moe.py (one family each) ->
weights.py (dequantized weights, layer streaming) -> model.py (prefill, decode, replay)
-> trace.py (golden states on disk).
"""

from ggufcheck.reference.cache import KVCache, LayerOutput
from ggufcheck.reference.config import ReferenceConfig, config_from_gguf
from ggufcheck.reference.model import ReferenceModel
from ggufcheck.reference.trace import TracedLayer, Trace, model_fingerprint

__all__ = ["KVCache", "LayerOutput", "TracedLayer", "ReferenceConfig", "ReferenceModel", "Trace",
           "config_from_gguf", "model_fingerprint"]
