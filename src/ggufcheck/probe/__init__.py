"""Code that runs inside the *target* Python environment: the engine's, not ggufcheck's.

An import that works says nothing about whether a kernel runs on this GPU, and one that
runs may be wrong. So ggufcheck asks the engine's own interpreter:

- :mod:`ggufcheck.probe.runner` starts a probe script in that interpreter
  (``--python PATH``, one GPU via ``CUDA_VISIBLE_DEVICES``), JSON on stdin, JSON lines back,
  with idle and total timeouts; a missing or crashing interpreter is a clear error.
- :mod:`ggufcheck.probe.scripts` holds the probe scripts themselves (standard library and
  torch only): the environment probe, the fatbinary reader, the kernel probe and its
  three tiers (imports, runs with a poisoned output, agrees with fp64).
- (the real activations that ``ggufcheck kernels --model`` feeds the probe are computed in
  this interpreter by :mod:`ggufcheck.reference.activations`)

The stages that turn probe answers into results are :mod:`ggufcheck.checks.environment` and
:mod:`ggufcheck.checks.kernels`.
"""
