"""An engine in a process of its own (engines.isolated): same numbers, same errors, no leaks.

A CUDA build of llama.cpp and torch crash in one process (measured on the H200, issue 20),
so GPU llama.cpp runs isolated. The isolated path is exercised here with the CPU library:
it must return bit-identical tables to the in-process adapter, carry the adapter's errors
back as the same classes, survive native prints on fd 1, and turn a child's crash into a
clear EngineUnreachable instead of a hang or a traceback.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggufcheck.engines.base import Unsupported
from ggufcheck.engines.isolated import IsolatedEngine
from ggufcheck.engines.spec import open_engine
from ggufcheck.errors import EngineUnreachable


@pytest.mark.llama
def test_isolated_llama_cpp_matches_in_process_bit_for_bit(llama_engine, smollm2_path, prompts):
    engine = open_engine("llama-cpp:isolate=1,n_ctx=128,n_threads=2", smollm2_path)
    try:
        assert isinstance(engine, IsolatedEngine) and engine.vocab_size == llama_engine.vocab_size
        assert engine.capabilities == llama_engine.capabilities
        tokens = engine.tokenize(prompts[0])
        assert tokens == llama_engine.tokenize(prompts[0])
        assert np.array_equal(engine.score(tokens).logprobs, llama_engine.score(tokens).logprobs)
        gen, local = engine.generate(tokens, 3), llama_engine.generate(tokens, 3)
        assert list(gen.generated) == list(local.generated)
        trace = engine.layer_outputs(tokens[:6], ("residual",))
        assert np.array_equal(trace.tensors[("residual", 3)], llama_engine.layer_outputs(tokens[:6]).tensors[("residual", 3)])
        with pytest.raises(Unsupported, match="chunk size"):  # the adapter's own error, same class
            engine.score_chunked(tokens, 10_000)
        decoded = engine.decode_layer_outputs(tokens[:8], 4, ("residual",)).tensors  # the decode path, traced
        assert np.array_equal(decoded[("residual", 3)],
                              llama_engine.decode_layer_outputs(tokens[:8], 4, ("residual",)).tensors[("residual", 3)])
        chat = [{"role": "user", "content": "Hi"}]
        assert engine.chat_tokens(chat) == llama_engine.chat_tokens(chat)  # the chat template stage's tokens
    finally:
        engine.close()
    assert engine._proc is None


def test_a_child_that_prints_or_crashes_is_reported_not_hung(tiny_gguf):
    engine = IsolatedEngine("ggufcheck.testing.faults:crashing_engine", tiny_gguf("llama").path)
    try:
        tokens = [1, 2, 3, 4]
        assert engine.score(tokens).logprobs.shape[0] == 4  # a print on fd 1 did not corrupt the answer
        with pytest.raises(EngineUnreachable, match="signal 11"):
            engine.generate(tokens, 2)
        with pytest.raises(EngineUnreachable, match="not running"):
            engine.score(tokens)
    finally:
        engine.close()


def test_a_factory_that_fails_raises_its_own_error(tmp_path):
    from ggufcheck.errors import GGUFCheckError

    missing = tmp_path / "missing.gguf"
    with pytest.raises(GGUFCheckError, match="missing.gguf"):
        IsolatedEngine("ggufcheck.engines.reference:ReferenceEngine", missing)


def test_a_failed_start_leaves_no_child_behind(tmp_path):
    psutil = pytest.importorskip("psutil")  # to count this process's children

    from ggufcheck.errors import GGUFCheckError

    before = {c.pid for c in psutil.Process().children()}
    with pytest.raises(GGUFCheckError):
        IsolatedEngine("ggufcheck.engines.reference:ReferenceEngine", tmp_path / "missing.gguf")
    assert {c.pid for c in psutil.Process().children() if c.is_running() and c.status() != "zombie"} <= before
