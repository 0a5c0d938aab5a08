"""llama.cpp built from source for the CPU, healthy or with a defect in one kernel: faults in the
real engine, not in a wrapper of the reference (issue 36 item 6).

The source is the llama-cpp-python 0.3.36 sdist's vendored llama.cpp (ggml 0.25.3), the version
the installed ``llama_cpp`` package binds, fetched from the package registry and cached next to
the converter (``testing.convert``). A build is ``libllama``, ``libggml*`` and llama.cpp's own
server (``llama-server``, for ``--engine llama-server``; engines/llama_server.py) for x86-64 with
AVX2 (not ``GGML_NATIVE``: on this machine kind a native build selects AMX paths and dies at the
first decode), ~4 minutes on 2 cores, cached by defect. ``LLAMA_CPP_LIB_PATH`` pointing at the
returned folder makes ``llama_cpp`` load it: in a process of its own (``llama-cpp:isolate=1``),
since a process that already loaded the package's own library keeps it.

Each defect is one edit of one line, named for the kernel it breaks and the path that reaches it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ggufcheck.errors import Unavailable


@dataclass(frozen=True)
class Defect:
    """One line of llama.cpp changed: in ``file``, the first ``old`` after ``after`` becomes ``new``."""

    file: str
    after: str
    old: str
    new: str
    what: str
    qtype: str
    path: str  # the path it reaches: "decode" (matrix-vector kernels) or "prefill"


DEFECTS = {
    # ggml-cpu's AVX2 Q4_K matrix-vector kernel over repacked weights (a one-token step, and the
    # rows of a prompt left over from groups of 4): its min term 3% too small
    "q4_k-gemv-min": Defect(
        file="ggml/src/ggml-cpu/arch/x86/repack.cpp",
        after="void ggml_gemv_q4_K_8x8_q8_K(",
        old="_mm256_mul_ps(col_dmin_f32, row_scale_f32), acc_min_rows);",
        new="_mm256_mul_ps(_mm256_mul_ps(col_dmin_f32, _mm256_set1_ps(0.97f)), row_scale_f32), acc_min_rows);",
        what="ggml-cpu's AVX2 Q4_K matrix-vector kernel (repacked 8x8) scales its min term by 0.97",
        qtype="Q4_K", path="decode"),
    # llama.cpp's graph: the flash-attention path (flash_attn=1) scales the scores 1.25x; the
    # path without flash attention is right, so flipping flash_attn makes the failure go away
    "flash-attn-scale": Defect(
        file="src/llama-graph.cpp",
        after="cur = ggml_flash_attn_ext(ctx0, q, k, v, kq_mask,",
        old="kq_scale, hparams.f_max_alibi_bias,",
        new="kq_scale * 1.25f, hparams.f_max_alibi_bias,",
        what="llama.cpp's flash-attention graph path scales the attention scores 1.25x",
        qtype="", path="flash attention"),
    # ggml-cpu's AVX2 IQ4_NL matrix-matrix kernel over repacked weights (the rows of a prompt in
    # groups of 4; one-token steps take the matrix-vector kernel): every level of its value table
    # 8 too high (of levels -127..113), so only a batched prefill is wrong (+1 was measured too
    # small to tell: KL 0.002 between a cold prefill and the steps, under the q8 allowance)
    "iq4_nl-gemm-table": Defect(
        file="ggml/src/ggml-cpu/arch/x86/repack.cpp",
        after="void ggml_gemm_iq4_nl_8x8_q8_0(",
        old="signextendlut = _mm256_permute2f128_si256(signextendlut, signextendlut, 0);",
        new="signextendlut = _mm256_add_epi8(_mm256_permute2f128_si256(signextendlut, signextendlut, 0), "
            "_mm256_set1_epi8(8));",
        what="ggml-cpu's AVX2 IQ4_NL matrix-matrix kernel (repacked 8x8) reads every level of its table 8 too high",
        qtype="IQ4_NL", path="prefill"),
    # llama.cpp's deepseek2 NextN / MTP draft graph (only an MTP context builds it): with
    # GGUFCHECK_MTP_DEFECT set in the process's environment, the head's eh_proj is fed
    # [state ; token] instead of [token ; state]; unset, the graph is llama.cpp's own (one build
    # serves the healthy and the faulty server). The trunk's output is untouched, so a server
    # with speculative decoding on still answers right; only its drafts are rejected
    "mtp-concat-order": Defect(
        file="src/models/deepseek2.cpp",
        after="llama_model_deepseek2::graph_mtp::graph_mtp(",
        old="ggml_concat(ctx0, e_norm, h_norm, 0);",
        new='ggml_concat(ctx0, std::getenv("GGUFCHECK_MTP_DEFECT") ? h_norm : e_norm, '
            'std::getenv("GGUFCHECK_MTP_DEFECT") ? e_norm : h_norm, 0);',
        what="llama.cpp's deepseek2 MTP draft graph concatenates the head's inputs as [state ; token] "
             "when GGUFCHECK_MTP_DEFECT is set",
        qtype="", path="mtp"),
}
# the defects the tests build into one library (each reached only by its own type or setting)
TEST_DEFECTS = ("flash-attn-scale", "iq4_nl-gemm-table", "mtp-concat-order", "q4_k-gemv-min")

# the parts of the sdist's vendor/llama.cpp a CPU build of libllama needs
_BUILD_PARTS = ("CMakeLists.txt", "cmake/", "ggml/", "include/", "src/", "common/", "vendor/", "licenses/", "LICENSE",
                "tools/", "scripts/")
BUILD_ENV = "GGUFCHECK_LLAMA_CPP_BUILD"  # a folder of builds to use instead of the cache


def build_dir() -> Path:
    from ggufcheck.testing.convert import _default_cache_dir

    return Path(os.environ.get(BUILD_ENV) or _default_cache_dir() / "llama-cpp-builds")


def built_library(defects: str | tuple[str, ...] | None = None) -> Path:
    """The folder holding libllama and libggml* of llama.cpp with ``defects`` (names of
    :data:`DEFECTS`; None: healthy), built once and cached. Raises Unavailable (with why)
    without cmake, ninja or a compiler."""
    names = tuple(sorted({defects} if isinstance(defects, str) else set(defects or ())))
    unknown = [d for d in names if d not in DEFECTS]
    if unknown:
        raise KeyError(f"unknown defect(s) {', '.join(unknown)}; known: {', '.join(DEFECTS)}")
    from ggufcheck.testing.convert import LLAMA_CPP_PYTHON_VERSION

    out = build_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}-{'+'.join(names) or 'healthy'}"
    if (out / "libllama.so").is_file() and (out / "llama-server").is_file():
        return out
    missing = [tool for tool in ("cmake", "ninja", "cc", "c++") if shutil.which(tool) is None]
    if missing:
        raise Unavailable(f"llama.cpp cannot be built here: {', '.join(missing)} not found")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        source = _source(Path(tmp))
        for name in names:
            apply_defect(source, DEFECTS[name])
        build = Path(tmp) / "build"
        configure = ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                     "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
                     "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=OFF",
                     # the server without its web page (no npm, no download): ggufcheck talks to its API
                     "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                     "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                     "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DCMAKE_SKIP_BUILD_RPATH=OFF",
                     "-DCMAKE_BUILD_RPATH=$ORIGIN"]
        make = ["cmake", "--build", str(build), "--target", "llama", "llama-server", "-j", str(os.cpu_count() or 2)]
        for cmd in (configure, make):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                raise Unavailable(f"llama.cpp build failed ({' '.join(cmd[:3])}): {(done.stdout + done.stderr)[-1500:]}")
        staged = Path(tmp) / "lib"
        staged.mkdir()
        for lib in [*(build / "bin").glob("lib*.so*"), build / "bin" / "llama-server"]:
            shutil.copy2(lib, staged / lib.name, follow_symlinks=True)
        if out.exists():  # an older build of these defects (without the server): replaced
            shutil.rmtree(out)
        staged.rename(out)
    return out


def apply_defect(source: Path, defect: Defect) -> None:
    """Edit one line of ``source`` as ``defect`` says (ValueError if the source has moved on)."""
    path = source / defect.file
    text = path.read_text()
    start = text.find(defect.after)
    at = text.find(defect.old, start) if start >= 0 else -1
    if at < 0:
        raise ValueError(f"{defect.file}: the line to change is not where it was ({defect.after!r} ... {defect.old!r})")
    path.write_text(text[:at] + defect.new + text[at + len(defect.old):])


def _source(into: Path) -> Path:
    """The sdist's vendor/llama.cpp build parts, unpacked under ``into``."""
    from ggufcheck.testing.convert import LLAMA_CPP_PYTHON_VERSION

    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    tarball = into / f"{name}.tar.gz"
    if done.returncode != 0 or not tarball.is_file():
        raise Unavailable(f"llama.cpp source unavailable: pip download failed: {(done.stdout + done.stderr)[-800:]}")
    prefix = f"{name}/vendor/llama.cpp/"
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(_BUILD_PARTS)]
        tar.extractall(into, members=members, filter="data")
    tarball.unlink()
    return into / prefix
