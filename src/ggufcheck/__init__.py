"""ggufcheck: find why a deployed GGUF language model produces wrong output.

The package is laid out in data-flow order: ``gguf`` (validated file access and
dequantization) -> ``arch`` (architecture specs and tensor tables) -> ``reference`` /
``engines`` (what the file should compute, and what a deployment does compute) ->
``checks`` (one module per stage, all returning :class:`ggufcheck.results.Result`) ->
``diagnose`` (the ordered plan and verdict) -> ``report`` (text, JSON, HTML).
"""

__version__ = "0.1.0"
