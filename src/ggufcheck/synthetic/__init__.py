"""Tiny random GGUFs written directly in llama.cpp's layout: models ggufcheck builds for itself.

- :mod:`ggufcheck.synthetic.tiny`: an independent writer of tiny random GGUFs for every family
  in ``arch/families.py``, with any per-tensor quant type (``build_tiny_gguf``), NextN layers
  and split files;
- :mod:`ggufcheck.synthetic.qblocks`: where each quant block keeps its scales (random valid
  blocks for types gguf-py cannot quantize; scale corruption for the file-fault tests).

Why product code, not ``testing/``: the kernel matrix (``ggufcheck quants``) and ``ggufcheck
demo`` build their models here, and product modules never import ``ggufcheck.testing`` (the
oracle of the tests: ``tests/test_layering.py``). The tests and the fault engines build on
these models too. Submodules are imported on demand.
"""
