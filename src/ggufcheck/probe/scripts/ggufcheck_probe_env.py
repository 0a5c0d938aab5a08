"""Environment probe: what the target interpreter has, and whether its GPU code fits the GPU.

Runs inside the target interpreter (standard library; torch inside a try). Reports Python,
torch, CUDA runtime and driver, the GPU (name, compute capability, memory), then each
engine package imported in its own child process of this same interpreter (so one that
crashes or hangs on import cannot take the others with it), and for each package's compiled
extensions which GPU architectures their fatbinaries carry SASS or PTX for.

Request: {"packages": [...], "scan_extensions": bool, "cuobjdump_budget_s": float,
          "import_timeout_s": float}. Replies: JSON lines (see ggufcheck_probe_common).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
import time

import ggufcheck_build_info as build_info
import ggufcheck_fatbin as fatbin
from ggufcheck_probe_common import PREFIX, emit, exception_text, open_channel, read_request

DEFAULT_PACKAGES = ["torch", "vllm", "sglang", "flash_attn", "vllm.vllm_flash_attn",
                    "flashinfer", "triton", "transformers", "llama_cpp"]
MAX_SO_FILES = 400


def python_info() -> dict:
    return {"type": "python", "executable": sys.executable, "version": platform.python_version(),
            "implementation": platform.python_implementation(), "platform": platform.platform(),
            "prefix": sys.prefix}


def torch_info() -> dict:
    info: dict = {"type": "torch"}
    try:
        import torch
    except BaseException as exc:  # noqa: BLE001 - any failure is the answer
        info["error"] = exception_text(exc)
        return info
    info.update(version=torch.__version__, file=torch.__file__, cuda_runtime=torch.version.cuda,
                hip=getattr(torch.version, "hip", None), debug=torch.version.debug)
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception as exc:  # noqa: BLE001
        info["cudnn_error"] = exception_text(exc)
    try:
        info["arch_list"] = torch.cuda.get_arch_list()
        info["cuda_available"] = torch.cuda.is_available()
        info["device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
    except Exception as exc:  # noqa: BLE001
        info["cuda_error"] = exception_text(exc)
        return info
    if info.get("device_count"):
        try:
            props = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info(0)
            info["gpu"] = {"name": props.name, "major": props.major, "minor": props.minor,
                           "total_memory": props.total_memory, "free_memory": free,
                           "multiprocessors": props.multi_processor_count,
                           "visible_as": os.environ.get("CUDA_VISIBLE_DEVICES")}
        except Exception as exc:  # noqa: BLE001
            info["gpu_error"] = exception_text(exc)
    return info


def driver_info() -> dict:
    """Driver version from NVML and the CUDA driver API version from libcuda (ctypes)."""
    info: dict = {"type": "driver"}
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() == 0:
            buf = ctypes.create_string_buffer(96)
            if nvml.nvmlSystemGetDriverVersion(buf, 96) == 0:
                info["driver_version"] = buf.value.decode()
            nvml.nvmlShutdown()
    except OSError as exc:
        info["nvml_error"] = str(exc)
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if cuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            info["cuda_driver_api"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError as exc:
        info["libcuda_error"] = str(exc)
    return info


def import_in_child(name: str, timeout: float) -> dict:
    """Import ``name`` in a fresh child of this interpreter; a crash or hang is the answer."""
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--import", name],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or "")[-800:] if isinstance(exc.stderr, str) else ""
        return {"status": "error", "error": f"import hung: no answer in {timeout:.0f} s",
                "stderr_tail": tail}
    for line in proc.stdout.splitlines():
        if line.startswith(PREFIX):
            import json
            answer = json.loads(line[len(PREFIX):])
            answer["seconds"] = round(time.monotonic() - started, 2)
            return answer
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    return {"status": "error", "error": f"import crashed the interpreter ({how})",
            "stderr_tail": proc.stderr[-800:]}


def import_here(name: str) -> dict:
    """The child side: import, then say version, file, and what failed if anything did."""
    top = name.split(".")[0]
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name in (name, top) or (exc.name and name.startswith(exc.name + "."))
        return {"status": "missing" if missing else "error", "error": exception_text(exc)}
    except BaseException as exc:  # noqa: BLE001 - SystemExit, OSError from a .so: all answers
        return {"status": "error", "error": exception_text(exc)}
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        version = None
        for dist in importlib.metadata.packages_distributions().get(top, []):
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    file = getattr(module, "__file__", None)
    return {"status": "ok", "version": version, "file": file,
            "directory": os.path.dirname(file) if file else None}


def package_directory(name: str, answer: dict) -> str | None:
    """Where a package's files are, even when importing it failed (find_spec imports parents)."""
    if answer.get("directory"):
        return answer["directory"]
    if "." in name:
        return None
    try:
        spec = importlib.util.find_spec(name)
    except BaseException:  # noqa: BLE001
        return None
    if spec and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    if spec and spec.origin and spec.origin.endswith(".so"):
        return os.path.dirname(spec.origin)
    return None


def shared_objects(directory: str) -> list[str]:
    """The .so files under a package's folder (at most MAX_SO_FILES)."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "tests", "include")]
        for f in files:
            if f.endswith(".so") or ".so." in f:
                found.append(os.path.join(root, f))
        if len(found) >= MAX_SO_FILES:
            break
    return sorted(found)[:MAX_SO_FILES]


def scan_extensions(name: str, directory: str, gpu: dict | None, budget: list[float],
                    seen: set[str], cross_check_all: bool = False) -> None:
    files = plain = 0
    with_code: list[dict] = []
    for path in shared_objects(directory):
        real = os.path.realpath(path)
        if real in seen:  # vllm's folder holds vllm_flash_attn's: report each file once
            continue
        seen.add(real)
        files += 1
        message = {"type": "extension", "package": name, "file": path}
        t_scan = time.monotonic()
        try:
            message["size"] = os.path.getsize(path)
            scan = fatbin.scan_file(path)
            message["scan_s"] = round(time.monotonic() - t_scan, 3)
        except (OSError, fatbin.FatbinError) as exc:
            message["error"] = str(exc)
            emit(message)
            continue
        message.update(scan)
        if not scan["entries"]:
            plain += 1
            continue
        if gpu and (scan["sass"] or scan["ptx"]):
            message["verdict"] = fatbin.verdict(scan["sass"], scan["ptx"], gpu["major"], gpu["minor"])
        with_code.append(message)
    # cuobjdump cross-checks the fatbinary parser on this machine, on the package's smallest
    # file with device code (measured on the H100: torch's libtorch_cuda.so alone took 13 s of
    # a 24 s probe); ``cuobjdump_all``: on every such file while the budget lasts
    for n, message in enumerate(sorted(with_code, key=lambda m: m.get("size", 0))):
        if budget[0] > 0 and (n == 0 or cross_check_all):
            t0 = time.monotonic()
            message["cuobjdump"] = fatbin.cuobjdump_archs(message["file"], timeout=min(60.0, budget[0]))
            message["cuobjdump_s"] = round(time.monotonic() - t0, 3)
            budget[0] -= time.monotonic() - t0
    for message in with_code:
        emit(message)
    emit({"type": "extension_summary", "package": name, "files": files,
          "without_device_code": plain})


def main() -> None:
    request = read_request()
    open_channel()
    emit(python_info())
    torch_msg = torch_info()
    emit(torch_msg)
    emit(driver_info())
    gpu = torch_msg.get("gpu")
    budget = [float(request.get("cuobjdump_budget_s", 120.0))]
    scanned: set[str] = set()
    for name in request.get("packages", DEFAULT_PACKAGES):
        emit({"type": "start", "case": f"package.{name}"})
        answer = import_in_child(name, float(request.get("import_timeout_s", 180.0)))
        answer.update(type="result", kind="package", case=f"package.{name}", name=name)
        directory = package_directory(name, answer)
        answer["directory"] = directory
        emit(answer)
        if request.get("scan_extensions", True) and directory:
            scan_extensions(name, directory, gpu, budget, scanned, bool(request.get("cuobjdump_all")))
        if name == "llama_cpp" and directory:  # how its llama.cpp was built (ggufcheck_build_info)
            try:
                emit({"type": "build", "package": name, **build_info.llama_cpp_build(directory)})
            except Exception as exc:  # noqa: BLE001 - a file it cannot read is an answer too
                emit({"type": "build", "package": name, "error": exception_text(exc)})
        if name == "vllm" and directory:  # which torch its compiled ops were built against
            try:
                emit({"type": "build", "package": name, **build_info.vllm_build(directory)})
            except Exception as exc:  # noqa: BLE001 - a file it cannot read is an answer too
                emit({"type": "build", "package": name, "error": exception_text(exc)})
    emit({"type": "done"})


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--import":
        open_channel()
        emit(import_here(sys.argv[2]))
    else:
        main()
