"""What a compiled engine says of how it was built: llama.cpp's libraries, read without loading them.

Standard library only (this file runs inside the target interpreter). For the folder a
``llama_cpp`` package loads its libraries from (``LLAMA_CPP_LIB_PATH``, else the package's
``lib/``): which ggml backends it carries (``libggml-<backend>.so``), the ggml version (the
``libggml-base.so.X.Y.Z`` file name) and commit (``ggml_commit()`` of libggml-base, which touches
no GPU), and for a CUDA build the CUDA libraries it links (ELF ``DT_NEEDED``: ``libcudart.so.13``
names the toolkit's major release) and, where the binary carries it in plain text, the exact
toolkit release (``Cuda compilation tools, release 13.2, V13.2.78``: PTX headers and cubin notes
that are not compressed). A build whose toolkit is not recorded says so.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import sys

# nvcc's banner, "release 13.0, V13.0.88". In a zstd-compressed fatbin the "13.0" after the V
# is a back-reference to the release just before it, so the bytes read "release 13.0, V.88"
# (measured: the H200 build of 2026-12-07): the release completes the version
TOOLKIT = re.compile(rb"Cuda compilation tools, release (\d+\.\d+), V(\d+\.\d+\.\d+|\.\d+)")
DT_NEEDED = 1


def needed(path: str) -> list[str]:
    """The shared libraries an ELF file names (DT_NEEDED), in order; [] if it names none."""
    if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # imported from the package, not as a probe
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ggufcheck_fatbin import elf_sections

    with open(path, "rb") as f:
        sections = elf_sections(f)
        if ".dynamic" not in sections or ".dynstr" not in sections:
            return []
        off, size = sections[".dynamic"]
        f.seek(off)
        dynamic = f.read(min(size, 1 << 20))
        soff, ssize = sections[".dynstr"]
        f.seek(soff)
        strings = f.read(min(ssize, 16 << 20))
    out = []
    for i in range(0, len(dynamic) - 15, 16):
        tag, value = struct.unpack_from("<qQ", dynamic, i)
        if tag == 0:
            break
        if tag == DT_NEEDED and value < len(strings):
            end = strings.find(b"\0", value)
            out.append(strings[value:end].decode("latin-1"))
    return out


def toolkit_release(path: str) -> str | None:
    """The CUDA toolkit release a binary records in plain text (e.g. "13.2.78"), or None."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            found = TOOLKIT.search(m)
            if not found:
                return None
            version = found.group(2).decode()
            return found.group(1).decode() + version if version.startswith(".") else version


def ggml_commit(lib_dir: str) -> str | None:
    """``ggml_commit()`` of the folder's libggml-base (loaded by path; it opens no device)."""
    import ctypes

    path = os.path.join(lib_dir, "libggml-base.so")
    if not os.path.isfile(path):
        return None
    try:
        fn = getattr(ctypes.CDLL(path), "ggml_commit", None)
    except OSError:
        return None
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    value = fn()
    return value.decode("utf-8", "replace") if value else None


def llama_cpp_build(package_dir: str) -> dict:
    """The build facts of the llama.cpp libraries ``llama_cpp`` (at ``package_dir``) loads."""
    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH") or os.path.join(package_dir, "lib")
    out: dict = {"lib_dir": lib_dir, "backends": [], "ggml_version": None, "ggml_commit": None}
    if not os.path.isdir(lib_dir):
        out["error"] = f"no library folder {lib_dir}"
        return out
    names = sorted(os.listdir(lib_dir))
    for name in names:
        m = re.fullmatch(r"libggml-base\.so\.(\d+\.\d+\.\d+)", name)
        if m:
            out["ggml_version"] = m.group(1)
        m = re.fullmatch(r"libggml-([a-z0-9]+)\.so", name)
        if m and m.group(1) != "base":
            out["backends"].append(m.group(1))
    out["ggml_commit"] = ggml_commit(lib_dir)
    cuda = os.path.join(lib_dir, "libggml-cuda.so")
    if os.path.isfile(cuda):
        out["cuda"] = cuda_facts(cuda)
    return out


def cuda_facts(path: str) -> dict:
    """The CUDA libraries a binary links (DT_NEEDED), its CUDA runtime and that runtime's major
    release, and the toolkit release it records in plain text (None where it does not)."""
    links = needed(path)
    runtime = next((n for n in links if n.startswith("libcudart.so")), None)
    return {"needed": [n for n in links if "cu" in n], "runtime": runtime,
            "runtime_major": runtime.rsplit(".", 1)[-1] if runtime and runtime[-1].isdigit() else None,
            "toolkit": toolkit_release(path)}


# vLLM's compiled ops are built against one torch: its wheel pins that release exactly
VERSION_ASSIGN = re.compile(r"""^(__version__|__commit_id__)\s*=.*?=\s*(['"])(.*?)\2""", re.M)


def vllm_build(package_dir: str) -> dict:
    """The build facts of the ``vllm`` package at ``package_dir``, read from its files without
    importing it: version and commit (``_version.py``), the distribution it came from and the
    torch release its wheel pins (``Requires-Dist: torch==X`` whose marker holds here), the torch
    installed beside it, and its compiled ops (``_C*.so``): the CUDA libraries they link and the
    toolkit release they record."""
    from importlib import metadata

    out: dict = {"package_dir": package_dir, "version": None, "commit": None, "dist": None,
                 "torch_pinned": None, "torch_installed": None, "extensions": [], "cuda": None}
    version_file = os.path.join(package_dir, "_version.py")
    if os.path.isfile(version_file):
        with open(version_file, encoding="utf-8", errors="replace") as f:
            for key, _q, value in VERSION_ASSIGN.findall(f.read()):
                out["version" if key == "__version__" else "commit"] = value or None
    dists = metadata.packages_distributions().get("vllm") or []
    for name in dists:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        out["dist"] = f"{dist.metadata['Name']} {dist.version}"
        out["torch_pinned"] = _pinned("torch", dist.requires or [])
        break
    try:
        out["torch_installed"] = metadata.version("torch")
    except metadata.PackageNotFoundError:
        pass
    ops = sorted(n for n in os.listdir(package_dir) if re.fullmatch(r"_C\w*\.(abi3\.)?so|_C\w*\.cpython.*\.so", n))
    out["extensions"] = ops
    for name in ops:  # the first op library linking a CUDA runtime (a CPU build: none)
        path = os.path.join(package_dir, name)
        if any(n.startswith("libcudart.so") for n in needed(path)):
            out["cuda"] = {"file": name, **cuda_facts(path)}
            break
    return out


def _pinned(package: str, requires: list[str]) -> str | None:
    """The exact release ``requires`` pins ``package`` to on this machine (``==X`` whose
    environment marker holds; packaging evaluates markers where it is installed, else only an
    unmarked pin counts), or None."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        Requirement = None
    for line in requires:
        if Requirement is not None:
            try:
                req = Requirement(line)
            except Exception:  # noqa: BLE001 - a line packaging cannot read is skipped
                continue
            if req.name != package or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
                continue
            pins = [s.version for s in req.specifier if s.operator == "=="]
        else:
            m = re.fullmatch(rf"{package}\s*==\s*([^\s;]+)", line.strip())
            pins = [m.group(1)] if m else []
        if pins:
            return pins[0]
    return None
