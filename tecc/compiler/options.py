"""Every knob of tecc in one place: environment variables and their defaults.

Nothing else reads the environment (but the runtime, for TECC_CUDA_GRAPHS, below: it runs saved
artifacts without the compiler); values are read when a build starts, never at import time.

| variable            | default                         | meaning |
|---------------------|---------------------------------|---------|
| TECC_DUMP_IR        | unset                           | `DIR` or `DIR:KERNEL`: dump the IR after every pass of every build into DIR/<module>/ (only kernels whose name contains KERNEL; nothing for a module with none) |
| TECC_ARCH           | the live device, else sm_90     | the default `arch` of builds for target "cuda" |
| TECC_CACHE_DIR      | ~/.cache/tecc                   | the compile cache (DIR/cubin/), build cache (DIR/builds/) and tuning database (DIR/tuning.sqlite) |
| TECC_NO_CACHE       | unset                           | 1 bypasses the compile cache (neither read nor written) |
| TECC_BUILD_CACHE    | 1                               | 0 turns off the build cache alone (plans and final loop IR; build_cache.py) |
| TECC_TUNING_DB      | TECC_CACHE_DIR/tuning.sqlite    | the SQLite tuning database |
| TECC_PROGRESS       | auto                            | 0 hides the CLI's progress bars, 1 forces them (auto: only on a terminal) |
| TECC_SIM_CHECKS     | 1                               | 0 turns off the emulator's out-of-bounds / race / uninitialized-read checks (faster) |
| TECC_VERIFY_IR      | 1                               | 0 skips the IR verifier between passes |
| TECC_STRICT_PLANS   | unset                           | 1: the planner's plan that fails to build with a TeccError raises instead of falling back to the generic schedule (the fuzzer and tests use it to find strategy bugs; other exceptions are raised always) |
| TECC_CUDA_GRAPHS    | patch                           | 0 turns off the CUDA executor's graphs of repeated calls; patch (the default) also patches a call's graph for new pointers, 1 replays exact pointers only (read by tecc/runtime/graphs.py when an executor is made: the runtime runs without the compiler) |
| TECC_COMPILE_THREADS | half the machine's CPUs (1 to 8) | how many of the planner's compile checks (NVRTC) run at once (realize.py: a check's compile overlaps the planning of the next kernels); 1: one at a time |
| TECC_SPLIT_COMPILE  | half the machine's CPUs (1 to 8) | N > 1: a build's final compile of a module of several kernels uses NVRTC's --split-compile=N (cache.compile_cached) |
| TECC_PART_TWINS     | 1                               | 0: a program planned in regions plans every part itself, instead of giving a part of an earlier part's structure that part's plan and module renamed (part_twins.py) |
| TECC_PRECISE_MATH   | unset                           | 1 keeps the precise sinf/cosf (and a GELU's erff/tanhf) where a result rounded to float16/bfloat16 would get the cheap sin_approx/cos_approx (gelu_erf_approx/gelu_tanh_approx) (tecc/passes/approx_math.py) |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..ir.errors import TeccError


@dataclass(frozen=True)
class DumpRequest:
    directory: Path
    kernel_filter: str | None


def dump_request(explicit: str | os.PathLike[str] | None, module_name: str,
                 kernel_filter: str | None = None) -> DumpRequest | None:
    """Where to dump the IR: the `dump_ir=` argument as given, else TECC_DUMP_IR's DIR/<module>/."""
    if explicit is not None:
        return DumpRequest(Path(explicit), kernel_filter)
    env = os.environ.get("TECC_DUMP_IR")
    if not env:
        return None
    directory, _, filt = env.partition(":")
    return DumpRequest(Path(directory) / module_name, filt or kernel_filter)


def default_arch_override() -> str | None:
    return os.environ.get("TECC_ARCH") or None


def cache_dir() -> Path:
    env = os.environ.get("TECC_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tecc"


def cache_enabled() -> bool:
    """False when TECC_NO_CACHE is set to anything but '' or '0'."""
    return os.environ.get("TECC_NO_CACHE", "") in ("", "0")


def build_cache_enabled() -> bool:
    """The build cache (build_cache.py): on with the compile cache, unless TECC_BUILD_CACHE=0."""
    return cache_enabled() and os.environ.get("TECC_BUILD_CACHE", "1") != "0"


def tuning_db_path() -> Path:
    env = os.environ.get("TECC_TUNING_DB")
    return Path(env) if env else cache_dir() / "tuning.sqlite"


def progress_bars() -> bool | None:
    """True/False when TECC_PROGRESS forces the CLI's progress bars on/off; None: decide by the terminal."""
    env = os.environ.get("TECC_PROGRESS", "")
    if env in ("0", "1"):
        return env == "1"
    return None


def sim_checks() -> bool:
    return os.environ.get("TECC_SIM_CHECKS", "1") != "0"


def verify_ir() -> bool:
    return os.environ.get("TECC_VERIFY_IR", "1") != "0"


def precise_math() -> bool:
    """True when TECC_PRECISE_MATH is set to anything but '' or '0': no cheap sin/cos/GELU, even where
    the result is rounded to a 16-bit float (the approx_math pass and the cost model both ask)."""
    return os.environ.get("TECC_PRECISE_MATH", "") not in ("", "0")


def part_twins() -> bool:
    """The planner's repeated parts (part_twins.py): on unless TECC_PART_TWINS=0."""
    return os.environ.get("TECC_PART_TWINS", "1") != "0"


def relaunch() -> bool:
    """A compiled torch graph's programs relaunched on their pointers alone when the graph's
    inputs keep their layouts (tecc/torch/runtime.py): on unless TECC_RELAUNCH=0, read per call."""
    return os.environ.get("TECC_RELAUNCH", "1") != "0"


def strict_plans() -> bool:
    """True when TECC_STRICT_PLANS is set to anything but '' or '0': the planner's plan that
    fails to build with a TeccError raises instead of falling back to the generic schedule
    (tecc/compiler/build.py)."""
    return os.environ.get("TECC_STRICT_PLANS", "") not in ("", "0")


def compile_threads() -> int:
    """TECC_COMPILE_THREADS: how many compile checks the planner runs at once (realize.py);
    default half the machine's CPUs, 1 to 8 (on a 2-core machine that others load, a check
    compiling beside the planning slowed both: measured in docs/cache.md)."""
    return _threads("TECC_COMPILE_THREADS", _half_the_cpus())


def split_compile() -> int:
    """TECC_SPLIT_COMPILE: the threads of NVRTC's split compile of a build's module of several
    kernels; default half the machine's CPUs, 1 to 8 (1: none; on the GPU host's 16 cores the
    backward of GPT-2 small compiled in 0.09 s per kernel with 8 threads, 0.32 s with one:
    docs/cache.md)."""
    return _threads("TECC_SPLIT_COMPILE", _half_the_cpus())


def _half_the_cpus() -> int:
    """The threads' default: half the machine's CPUs, 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _threads(variable: str, default: int) -> int:
    env = os.environ.get(variable, "")
    if not env.strip():
        return default
    try:
        return max(1, int(env))
    except ValueError:
        raise TeccError(f"{variable}={env!r} is not a whole number (1: one thread)") from None
