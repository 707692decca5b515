"""CUDA C -> PTX and cubin with NVRTC, and the ptxas resource report of every kernel.

One NVRTC compilation for a real architecture (`-arch=sm_90`) yields both the PTX and the cubin,
plus the ptxas `-v` log. We run it through `cuda.bindings.nvrtc` directly, with the option list
`cuda.core.ProgramOptions` spells (the one place that knows NVRTC's option syntax): tecc writes
the common list itself, as ProgramOptions does (a test compares the two), so that a build never
imports cuda.core (~0.2 s of a cold process), and asks ProgramOptions for the rest. Why not
`cuda.core.Program.compile`: on a machine without a GPU driver, `compile("ptx")` fails inside
cuda.core (it probes the driver version) while `compile("cubin")` works, and compiling twice to
get both would double the compile time. Going through the bindings works the same with and
without a driver, and PTX, cubin and log come from the very same program.

Headers: NVRTC 13.0 knows the device built-ins but not `cuda_fp16.h` / `cuda_bf16.h`. We add the
CUDA runtime's include directory found by `cuda.pathfinder` (pip wheels `nvidia-cuda-runtime` +
`nvidia-cuda-crt`, conda, `CUDA_HOME`, or /usr/local/cuda); NVRTC >= 13.3 can instead use the
headers it bundles (`use_bundled_headers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterator, Sequence

from tecc.ir.errors import CompileError

from .warpgroup import arch_for_source

DEFAULT_ARCH = "sm_90"
_INSTALL_NVRTC = 'pip install "nvidia-cuda-nvrtc>=13.0,<14"'
_INSTALL_HEADERS = 'pip install "nvidia-cuda-runtime>=13.0,<14" "nvidia-cuda-crt>=13.0,<14"'


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel entry (bytes unless said otherwise).

    `shared_bytes` is the static shared memory (`__shared__` arrays); spills are the bytes a
    thread stores to / loads from local memory because registers ran out (anything above 0 in a
    hot loop usually costs more than the occupancy it bought); `stack_bytes` is the per-thread
    stack frame (local arrays indexed dynamically live there)."""

    registers: int
    shared_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    barriers: int = 0
    constant_bytes: int = 0


@dataclass(frozen=True)
class CompiledCode:
    """The result of `compile_cuda`: PTX text, the cubin for `arch`, the resources of every
    kernel entry (by its extern "C" name), the NVRTC/ptxas log and how it was made."""

    ptx: str
    cubin: bytes
    resources: dict[str, KernelResources]
    log: str
    arch: str
    nvrtc_version: str
    options: tuple[str, ...] = field(default=())


def _import_nvrtc() -> ModuleType:
    """cuda.bindings.nvrtc, checked to reach a loadable libnvrtc (it is loaded lazily)."""
    from cuda.bindings import nvrtc  # type: ignore[import-untyped]

    nvrtc.nvrtcVersion()
    module: ModuleType = nvrtc
    return module


@functools.lru_cache(maxsize=1)
def _nvrtc() -> ModuleType:
    try:
        return _import_nvrtc()
    except Exception as exc:  # ImportError, or the loader's error when libnvrtc.so is missing
        raise CompileError(
            f"NVRTC is not available ({type(exc).__name__}: {exc}). tecc compiles CUDA C with NVRTC "
            f"from the nvidia-cuda-nvrtc wheel: {_INSTALL_NVRTC} (or put a CUDA toolkit's lib64 on the "
            "library path)") from exc


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings return tuple, turning a failure status into CompileError."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise CompileError(f"NVRTC {what} failed: {status}")
    return values[0] if len(values) == 1 else values


def nvrtc_version() -> str:
    """The NVRTC version as 'major.minor' (e.g. '13.0')."""
    major, minor = _check(_nvrtc().nvrtcVersion(), "version query")
    return f"{major}.{minor}"


def supported_archs() -> list[str]:
    """The `sm_XY` targets this NVRTC can compile for."""
    archs = _check(_nvrtc().nvrtcGetSupportedArchs(), "supported-architecture query")
    return [f"sm_{a}" for a in archs]


def default_arch() -> str:
    """The live device's architecture (`sm_XY` from cuda.core's compute capability), or
    'sm_90' when there is no device or driver. Never raises."""
    try:
        from cuda.core import Device  # type: ignore[import-untyped]

        major, minor = Device().compute_capability
        return f"sm_{major}{minor}"
    except Exception:  # no driver library, no device, or an initialization error
        return DEFAULT_ARCH


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding cuda_fp16.h and its includes (empty when none is installed)."""
    try:
        from cuda.pathfinder import locate_nvidia_header_directory  # type: ignore[import-untyped]

        located = locate_nvidia_header_directory("cudart")
    except Exception:
        return ()
    return (located.abs_path,) if located is not None else ()


def nvrtc_options(arch: str, extra: Sequence[str] = (), needs_headers: bool = False) -> list[str]:
    """The NVRTC command line: C++17, ptxas -v for the resource report, the CUDA include
    directory, then `extra` (caller options go last so they can override)."""
    include = list(cuda_include_dirs())
    bundled = False
    if needs_headers and not include:
        major, minor = (int(x) for x in nvrtc_version().split("."))
        bundled = (major, minor) >= (13, 3)
        if not bundled:
            raise CompileError(
                "the kernel needs cuda_fp16.h / cuda_bf16.h but no CUDA include directory was found and "
                f"NVRTC {major}.{minor} bundles none (13.3+ does). Install the headers: {_INSTALL_HEADERS}, "
                "or set CUDA_HOME to a CUDA toolkit")
    if bundled:
        from cuda.core import ProgramOptions

        options = ProgramOptions(arch=arch, std="c++17", ptxas_options=["-v"], include_path=include or None,
                                 use_bundled_headers=bundled)
        return [o.decode() for o in options.as_bytes("nvrtc")] + list(extra)
    return _spelled(arch, tuple(include)) + list(extra)


@functools.lru_cache(maxsize=None)
def _spelled(arch: str, include: tuple[str, ...]) -> list[str]:
    """What `ProgramOptions(arch=arch, std="c++17", ptxas_options=["-v"], include_path=include)
    .as_bytes("nvrtc")` spells, without importing cuda.core (~0.2 s of a cold process's first
    build; tests/test_codegen.py checks that the two agree)."""
    return ([f"-arch={arch}", "--ptxas-options=-v"] + [f"--include-path={d}" for d in include]
            + ["--std=c++17"])


def compile_cuda(source: str, *, arch: str = DEFAULT_ARCH, name: str = "tecc",
                 options: Sequence[str] = (), threads: int = 1) -> CompiledCode:
    """Compile one CUDA C translation unit for `arch` ('sm_90', ...) to PTX and cubin. A source
    emit_source marked as needing the architecture-specific target (wgmma) is compiled for
    `arch` + 'a' (sm_90a); the result's `arch` says which.

    `threads` > 1: a source of several kernels is compiled with NVRTC's `--split-compile`, which
    optimizes and assembles its kernels in that many threads (`split_compile_flags`). ptxas
    compiles each kernel on its own either way: the kernels' machine code (the cubin's .text
    sections), their resources and the PTX are the same (tests/test_codegen.py compares them);
    the cubin's note of the tool options differs, and ptxas's performance advisories (C75xx),
    which the split's threads print to the process's stderr, are taken from there into the log
    (fd 2 is captured while it compiles; what else was written there is written back after), so
    the user sees none of them; a compile whose log is read for them (the planner's checks)
    still does not split, as the capture is the one file descriptor of the whole process.

    Raises CompileError (with `.log` and `.source`) when NVRTC rejects the source; the message
    quotes the offending lines with their numbers."""
    split = split_compile_flags(source, threads)
    if not split:
        return _compile_reported(source, arch, name, tuple(options))
    # the split's ptxas threads print their advisories to fd 2: taken into the log, where a
    # compile without the split has them, not shown to the user
    with _stderr_captured() as captured:
        code = _compile_reported(source, arch, name, (*options, *split))
    lines = captured.text.splitlines()
    advisories = [line for line in lines if line.startswith("ptxas")]
    others = [line for line in lines if line and not line.startswith("ptxas")]
    if others:   # what other threads wrote meanwhile goes where it was going
        sys.stderr.write("\n".join(others) + "\n")
    if not advisories:
        return code
    return dataclasses.replace(code, log="\n".join(([code.log.rstrip()] if code.log.strip() else []) + advisories))


def _compile_reported(source: str, arch: str, name: str, options: tuple[str, ...]) -> CompiledCode:
    """`_compile`, with ptxas's report of every kernel (a probe compile where the driver's
    compute cache left it empty)."""
    code = _compile(source, arch=arch, name=name, options=options)
    if code.resources or ".entry" not in code.ptx:
        return code
    # No `-v` report: with a CUDA driver on the machine, ptxas answers from the driver's compute
    # cache (~/.nv/ComputeCache) and prints nothing for a cubin it had made before (measured on
    # an H200: the second compile of a source reports nothing; CUDA_CACHE_DISABLE only counts when
    # set before the process loads NVRTC). The report is what the planner's spill and C7515
    # checks and Kernel.resources read, so a probe compile of the source plus one unique empty
    # kernel (a new PTX text: a cache miss) gives it; the binary stays the first compile's.
    global _probes
    _probes += 1
    probe_kernel = f"{_PROBE_PREFIX}{os.getpid()}_{_probes}_{time.time_ns()}"
    probe = _compile(source + f'\nextern "C" __global__ void {probe_kernel}() {{}}\n', arch=arch, name=name,
                     options=options)
    resources = {k: v for k, v in probe.resources.items() if not k.startswith(_PROBE_PREFIX)}
    log = "\n".join(line for line in probe.log.splitlines() if _PROBE_PREFIX not in line)
    return dataclasses.replace(code, resources=resources, log=log)


class _Captured:
    text = ""


@contextlib.contextmanager
def _stderr_captured() -> Iterator[_Captured]:
    """File descriptor 2 into a temporary file while the block runs; the text is the yielded
    object's after the block (nothing captured where fd 2 cannot be duplicated)."""
    captured = _Captured()
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield captured
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.text = tmp.read().decode(errors="replace")


def split_compile_flags(source: str, threads: int) -> list[str]:
    """`--split-compile=threads` for a source of more than one kernel when `threads` > 1 (NVRTC
    12.4+ has the option; tecc asks for 13), else nothing."""
    if threads <= 1 or source.count("__global__") < 2:
        return []
    major, minor = (int(x) for x in nvrtc_version().split("."))
    return [f"--split-compile={threads}"] if (major, minor) >= (13, 0) else []


_PROBE_PREFIX = "tecc_resource_probe_"
_probes = 0


def _compile(source: str, *, arch: str, name: str, options: Sequence[str]) -> CompiledCode:
    nvrtc = _nvrtc()
    arch = arch_for_source(source, arch)  # wgmma needs sm_90a (codegen marks such sources)
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise CompileError(f"arch must look like 'sm_90', got {arch!r}")
    if arch.rstrip("af") not in supported_archs():
        raise CompileError(f"NVRTC {nvrtc_version()} cannot compile for {arch}; it supports "
                           f"{', '.join(supported_archs())}")
    flags = nvrtc_options(arch, options, needs_headers="#include" in source)
    program = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "program creation")
    try:
        status = nvrtc.nvrtcCompileProgram(program, len(flags), [f.encode() for f in flags])[0]
        log = _read(program, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog).decode(errors="replace")
        if int(status) != 0:
            raise CompileError(_error_message(source, log, name, arch), log=log, source=source)
        ptx = _read(program, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX).decode()
        cubin = _read(program, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, text=False)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return CompiledCode(ptx=ptx, cubin=cubin, resources=parse_ptxas_log(log), log=log, arch=arch,
                        nvrtc_version=nvrtc_version(), options=tuple(flags))


def _read(program: Any, size_fn: Any, read_fn: Any, text: bool = True) -> bytes:
    """One NVRTC output (log, PTX, cubin) as bytes; text outputs lose their trailing NUL."""
    size = int(_check(size_fn(program), "output size query"))
    buffer = b" " * size
    _check(read_fn(program, buffer), "output read")
    return buffer.rstrip(b"\x00") if text else buffer


def _error_message(source: str, log: str, name: str, arch: str) -> str:
    """What went wrong, where: each diagnostic of the log followed by the source lines it points
    at (with one line of context and the line numbers NVRTC uses)."""
    lines = source.splitlines()
    diagnostic = re.compile(rf"^{re.escape(name)}\((\d+)\): (?:catastrophic )?error.*$", re.MULTILINE)
    parts = [f"NVRTC could not compile {name!r} for {arch}:"]
    for match in diagnostic.finditer(log):
        number = int(match.group(1))
        parts.append(f"  {match.group(0)}")
        for n in range(max(1, number - 1), min(len(lines), number + 1) + 1):
            marker = ">" if n == number else " "
            parts.append(f"  {marker} {n:4d} | {lines[n - 1]}")
    if len(parts) == 1:
        parts.append(log.strip() or "(NVRTC gave no log)")
    parts.append("The full log is in CompileError.log, the CUDA C in CompileError.source.")
    return "\n".join(parts)


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """The per-entry resources in a ptxas `-v` log.

    ptxas prints, per entry: "Compiling entry function 'k' for 'sm_90'", "Function properties
    for k", "N bytes stack frame, N bytes spill stores, N bytes spill loads", and "Used N
    registers, used N barriers, N bytes smem, N bytes cmem[0]" (fields absent when zero)."""
    frames: dict[str, tuple[int, int, int]] = {}
    used: dict[str, str] = {}
    entry = properties_of = None
    for text in log.splitlines():
        if (m := _ENTRY.search(text)) is not None:
            entry = m.group(1)
        elif (m := _PROPERTIES.search(text)) is not None:
            properties_of = m.group(1)
        elif (m := _FRAME.search(text)) is not None and properties_of is not None:
            frames[properties_of] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif _USED.search(text) is not None and entry is not None:
            used[entry] = text

    def number(pattern: str, text: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    out: dict[str, KernelResources] = {}
    for kernel, text in used.items():
        stack, stores, loads = frames.get(kernel, (0, 0, 0))
        out[kernel] = KernelResources(
            registers=number(r"Used (\d+) registers", text),
            shared_bytes=number(r"(\d+) bytes smem", text),
            spill_stores=stores, spill_loads=loads, stack_bytes=stack,
            barriers=number(r"used (\d+) barriers", text),
            constant_bytes=number(r"(\d+) bytes cmem\[0\]", text))
    return out
