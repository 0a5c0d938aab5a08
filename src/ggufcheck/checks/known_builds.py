"""Engine builds known to compute wrong, each with its public source: what ``env`` warns about.

A build's provenance (probe/scripts/ggufcheck_build_info.py: the CUDA toolkit that compiled a
llama.cpp, its ggml version) is matched against this table. Each entry names the releases, the
quant types whose kernels it breaks, what goes wrong, what fixed it and where that was reported;
an entry is added only with a public source and the exact releases it names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownBroken:
    engine: str
    toolkits: tuple[str, ...]  # nvcc versions ("13.2.78"), as the binary records them
    releases: str  # the CUDA releases, as users know them
    types: tuple[str, ...]  # the quant types whose kernels it breaks
    what: str
    fixed: str
    sources: tuple[str, ...]


KNOWN_BROKEN = (
    KnownBroken(
        engine="llama.cpp (CUDA)",
        toolkits=("13.2.51", "13.2.78"),
        releases="CUDA 13.2.0 and 13.2.1",
        types=("IQ1_S", "IQ2_S", "IQ3_S"),
        what="nvcc miscompiles the byte reads of a packed int in these types' MMQ tile loads and vec_dot "
             "kernels (reported on sm_120): near-random dequantized values, garbage on all but very short prompts",
        fixed="CUDA 13.2.2 (nvcc 13.2.86) and later; in llama.cpp by PR #28784 (__byte_perm)",
        sources=("https://github.com/ggml-org/llama.cpp/issues/28581",
                 "https://github.com/ggml-org/llama.cpp/pull/28784",
                 "https://github.com/unslothai/unsloth/issues/4849"),
    ),
)


def known_broken(engine: str, toolkit: str | None) -> list[KnownBroken]:
    """The entries of ``engine`` ("llama.cpp (CUDA)") that name this exact toolkit release."""
    if not toolkit:
        return []
    return [k for k in KNOWN_BROKEN if k.engine == engine and toolkit in k.toolkits]
