"""``ggufcheck shard``: exit statuses, JSON, usage errors (through the module's own parser)."""

from __future__ import annotations

import argparse
import json

import pytest

from ggufcheck.cli import shard
from ggufcheck.errors import UsageError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ggufcheck")
    shard.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["shard", *argv])


def test_known_glm5_tp16_reports_unaligned_k_quants(tmp_path):
    out = tmp_path / "plan.json"
    assert shard.run(_args("--known", "glm-5", "--tp", "16", "--gpu-memory", "141", "--json", str(out))) == 1
    doc = json.loads(out.read_text())
    (stage,) = doc["stages"]
    results = stage["results"]
    bad = [r for r in results if r["status"] == "FAIL"]
    assert bad and all(r["check"] == "sharding.plan.block_alignment" for r in bad)
    assert any("2048 / 16 = 128" in r["message"] for r in bad)


def test_known_deepseek_v3_tp8_is_clean():
    assert shard.run(_args("--known", "deepseek-v3", "--tp", "8", "--gpu-memory", "141")) == 0


def test_file_run_exit_0_and_json(tiny_converted, tmp_path):
    out = tmp_path / "r.json"
    path = str(tiny_converted("llama").gguf_path)
    assert shard.run(_args(path, "--tp", "2", "--backend", "gloo", "--json", str(out))) == 0
    assert "sharding.tp.attention" in out.read_text()


@pytest.mark.parametrize("argv", [("--tp", "2"), ("--tp", "0", "--known", "glm-5"),
                                  ("--tp", "2", "--known", "glm-5", "--gpu-memory", "-1")])
def test_usage_errors(argv):
    with pytest.raises(UsageError):
        shard.run(_args(*argv))


def test_nccl_without_gpus_is_a_usage_error(tiny_converted):
    import torch

    if torch.cuda.is_available():
        pytest.skip("GPUs present")
    with pytest.raises(UsageError):
        shard.run(_args(str(tiny_converted("llama").gguf_path), "--tp", "2", "--backend", "nccl"))
