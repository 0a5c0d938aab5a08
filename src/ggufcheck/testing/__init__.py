"""Test models for ggufcheck and for users testing their own engines.

- :mod:`ggufcheck.testing.convert`: tiny random transformers models converted to GGUF by
  llama.cpp's own ``convert_hf_to_gguf.py`` (``tiny_converted(arch, outtype)``, cached).
- :mod:`ggufcheck.synthetic.tiny`: an independent builder writing tiny random GGUFs directly
  in llama.cpp's layout, with per-tensor quant types (``build_tiny_gguf``), and split files.
- :mod:`ggufcheck.testing.filefaults`: file-level fault injection (always a new file).
- :mod:`ggufcheck.synthetic.qblocks`: where each quant block keeps its scales (random valid
  blocks for types gguf-py cannot quantize; scale corruption).
- :mod:`ggufcheck.testing.models`: where the real registry models and the cache live.

The other producer of test models, an independent writer of tiny random GGUFs with any
per-tensor quant type, is product code (:mod:`ggufcheck.synthetic`): the kernel matrix and the
demo build their models with it. Two independent producers (llama.cpp's converter and our own
writer) agreeing on names and shapes is what makes the tables checked against them trustworthy. Submodules are imported
on demand: nothing heavy is imported here.
"""
