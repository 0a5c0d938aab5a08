"""Which GPU architectures a compiled extension carries code for: ELF + fatbinary headers.

Standard library only (struct): this file runs inside the target interpreter. A CUDA
extension (``.so``) keeps its device code in the ELF section ``.nv_fatbin`` (``__nv_relfatbin``
for relocatable device code): one or more fatbinary containers, each a 16-byte header

    u32 magic 0xBA55ED50 | u16 version | u16 header size (16) | u64 size of the entries

followed by entries, each with its own header (64 bytes, longer for newer arches):

    off 0  u16 kind (1 PTX, 2 ELF/SASS cubin; 0x10 also ELF)
    off 4  u32 entry header size         off 8  u32 payload size (padded)
    off 28 u32 sm arch (e.g. 90)         off 48 u64 flags

and the next entry starts at ``entry + header size + payload size``. Only headers are read
(payloads may be compressed; they are skipped by seeking), so a 1 GB libtorch_cuda.so costs
milliseconds. ``cuobjdump --list-elf/--list-ptx`` cross-checks this parse where installed.

Compatibility rule (CUDA's): SASS for sm_XY runs on a GPU of compute capability X.Z with
Z >= Y (same major); PTX for compute_XY can be JIT-compiled by the driver for any GPU of
compute capability >= X.Y (slow first start, and no arch-specific instructions).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

FATBIN_MAGIC = 0xBA55ED50
FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
KIND_PTX = 1
KIND_ELF = (2, 0x10)
_MAX_ENTRIES = 1_000_000  # a malformed file must not spin forever


class FatbinError(ValueError):
    """The file is not an ELF we can read, or a fatbinary header is inconsistent."""


def elf_sections(f) -> dict[str, tuple[int, int]]:
    """ELF64 little-endian section table: name -> (file offset, size)."""
    f.seek(0)
    ident = f.read(64)
    if len(ident) < 64 or ident[:4] != b"\x7fELF":
        raise FatbinError("not an ELF file")
    if ident[4] != 2 or ident[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF")
    (shoff,) = struct.unpack_from("<Q", ident, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ident, 0x3A)
    if shoff == 0:
        return {}
    if shentsize < 64:
        raise FatbinError(f"section header size {shentsize} < 64")
    f.seek(shoff)
    first = f.read(shentsize)
    if len(first) < 64:
        raise FatbinError("section table past end of file")
    if shnum == 0:  # extended numbering: the real count is in section 0's sh_size
        shnum = struct.unpack_from("<Q", first, 0x20)[0]
    if shstrndx == 0xFFFF:  # SHN_XINDEX: the real index is in section 0's sh_link
        shstrndx = struct.unpack_from("<I", first, 0x28)[0]
    if shnum > 1_000_000 or shstrndx >= shnum:
        raise FatbinError(f"implausible section table ({shnum} sections, names in {shstrndx})")
    f.seek(shoff)
    table = f.read(shentsize * shnum)
    if len(table) < shentsize * shnum:
        raise FatbinError("section table truncated")
    headers = []
    for i in range(shnum):
        name, _type = struct.unpack_from("<II", table, i * shentsize)
        offset, size = struct.unpack_from("<QQ", table, i * shentsize + 0x18)
        headers.append((name, _type, offset, size))
    _, _, str_off, str_size = headers[shstrndx]
    f.seek(str_off)
    names = f.read(min(str_size, 16 << 20))
    out = {}
    for name, sh_type, offset, size in headers:
        end = names.find(b"\0", name)
        label = names[name:end if end >= 0 else None].decode("latin-1")
        if sh_type != 8:  # SHT_NOBITS has no bytes in the file
            out[label] = (offset, size)
    return out


def fatbin_entries(f, offset: int, size: int) -> list[dict]:
    """Every entry header of every container in one fatbinary section."""
    entries: list[dict] = []
    pos, end = offset, offset + size
    while pos + 16 <= end:
        f.seek(pos)
        header = f.read(16)
        magic, version, hsize, fat_size = struct.unpack("<IHHQ", header)
        if magic != FATBIN_MAGIC:
            if magic == 0:  # zero padding between containers
                pos += 8
                continue
            raise FatbinError(f"bad fatbinary magic {magic:#x} at offset {pos}")
        if hsize < 16 or pos + hsize + fat_size > end:
            raise FatbinError(f"fatbinary container at {pos} runs past its section")
        entry, stop = pos + hsize, pos + hsize + fat_size
        while entry + 32 <= stop:
            f.seek(entry)
            raw = f.read(64)
            if len(raw) < 32:
                raise FatbinError(f"fatbinary entry at {entry} truncated")
            kind, _ver, ehsize, payload = struct.unpack_from("<HHII", raw, 0)
            if ehsize == 0:
                break
            arch = struct.unpack_from("<I", raw, 28)[0]
            flags = struct.unpack_from("<Q", raw, 48)[0] if len(raw) >= 56 else 0
            entries.append({"kind": "ptx" if kind == KIND_PTX else "elf" if kind in KIND_ELF
                            else f"kind{kind}", "arch": arch, "flags": flags, "offset": entry})
            if len(entries) > _MAX_ENTRIES:
                raise FatbinError("more than a million fatbinary entries: malformed")
            entry += ehsize + payload
        pos = stop
    return entries


def scan_file(path: str) -> dict:
    """Arches of the code a library loads at run time (``.nv_fatbin``: 'sass', 'ptx') and,
    apart, of relocatable device code kept for device linking (``__nv_relfatbin``:
    'relocatable_sass', 'relocatable_ptx'), which the CUDA runtime never loads."""
    with open(path, "rb") as f:
        sections = elf_sections(f)
        found = [(n, sections[n]) for n in FATBIN_SECTIONS if n in sections]
        arches = {n: {"sass": set(), "ptx": set()} for n in FATBIN_SECTIONS}
        count = 0
        for name, (offset, size) in found:
            for e in fatbin_entries(f, offset, size):
                count += 1
                if e["kind"] == "ptx":
                    arches[name]["ptx"].add(e["arch"])
                elif e["kind"] == "elf":
                    arches[name]["sass"].add(e["arch"])
    run, rel = arches[".nv_fatbin"], arches["__nv_relfatbin"]
    out = {"sass": sorted(run["sass"]), "ptx": sorted(run["ptx"]),
           "sections": [n for n, _ in found], "entries": count}
    if rel["sass"] or rel["ptx"]:
        out.update(relocatable_sass=sorted(rel["sass"]), relocatable_ptx=sorted(rel["ptx"]))
    return out


def verdict(sass: list[int], ptx: list[int], major: int, minor: int) -> str:
    """'sass' (machine code runs as is), 'ptx-only' (driver JIT), or 'none' for cc major.minor."""
    cc = major * 10 + minor
    if any(a // 10 == major and a % 10 <= minor for a in sass):
        return "sass"
    if any(a <= cc for a in ptx):
        return "ptx-only"
    return "none"


_ARCH_RE = re.compile(r"\.sm_(\d+)[a-z]?\.(cubin|ptx)\b")


def cuobjdump_archs(path: str, timeout: float = 60.0) -> dict | None:
    """The same question asked of ``cuobjdump``; None when it is not installed."""
    exe = shutil.which("cuobjdump")
    if exe is None:
        return None
    out: dict = {"sass": set(), "ptx": set(), "errors": []}
    for flag, key in (("--list-elf", "sass"), ("--list-ptx", "ptx")):
        try:
            proc = subprocess.run([exe, flag, path], capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            out["errors"].append(f"cuobjdump {flag} timed out after {timeout:.0f} s")
            continue
        for m in _ARCH_RE.finditer(proc.stdout):
            out[key].add(int(m.group(1)))
        # cuobjdump exits non-zero on a file with no device code: that is an answer, not an error
        if proc.returncode != 0 and "does not contain device code" not in proc.stderr:
            out["errors"].append(proc.stderr.strip()[-300:])
    return {"sass": sorted(out["sass"]), "ptx": sorted(out["ptx"]), "errors": out["errors"]}
