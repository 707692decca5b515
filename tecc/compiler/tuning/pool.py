"""The tuner's step 2 (docs/tuning.md): NVRTC for every candidate, in a pool of worker processes.

The pool is a `ProcessPoolExecutor` of *spawned* processes: a fork would copy the parent's CUDA
context. Tensors are not picklable, so a worker gets the program as a `ProgramRef` (the op's
file and name, or a module-level factory) and the plan as JSON, and runs the whole `build`; a
program that exists only in memory is emitted by the parent and the workers compile its CUDA
source. Either way the compile cache receives the cubins, so the final build is a cache hit.
A worker never raises: what fails is reported in its `CompileOutcome`.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ...ir.errors import TeccError
from ...ir.tensor import Tensor
from ...runtime.artifact import source_sha256
from ..check import OpSpec
from ..pipeline import compile_plan
from ..plan import Plan

Progress = Callable[[str, int, int, str], None]  # (phase, done, total, label)


def first_line(exc: BaseException) -> str:
    """How a failed candidate's error is recorded: the exception's type and first line."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


# ---- the program, as a worker process rebuilds it ----------------------------------------------

@dataclass(frozen=True)
class ProgramRef:
    """How another process gets the program's tensors, which cannot be pickled: `path` and `op`
    name an OpSpec in a file's `OPS` list (as `tecc tune` has them); `factory` is a module-level
    function returning the build signature (pickled by its qualified name)."""

    path: str | None = None
    op: str | None = None
    factory: Callable[[], Sequence[Tensor]] | None = None

    def tensors(self) -> list[Tensor]:
        if self.factory is not None:
            return list(self.factory())
        if self.path is None or self.op is None:
            raise TeccError("ProgramRef needs a file and an op name, or a factory")
        return list(load_op(self.path, self.op).args)


def load_op(path: str | os.PathLike[str], name: str) -> OpSpec:
    """The OpSpec called `name` in the module-level `OPS` list of the Python file `path`."""
    file = Path(path)
    spec = importlib.util.spec_from_file_location(f"tecc_tune_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise TeccError(f"cannot import {file}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for op in getattr(module, "OPS", ()):
        if isinstance(op, OpSpec) and op.name == name:
            return op
    raise TeccError(f"{file} declares no op named {name!r} in OPS")


# ---- the workers -------------------------------------------------------------------------------

@dataclass(frozen=True)
class CompileOutcome:
    """What a worker sends back: the NVRTC output (None on failure) for the CUDA source with
    this SHA-256, the error otherwise, the seconds it took and the worker's process id."""

    source_sha256: str
    code: Any
    error: str | None
    seconds: float
    pid: int


def _compile_from_ref(ref: ProgramRef, plan_json: str, arch: str, name: str | None,
                      options: tuple[str, ...]) -> CompileOutcome:
    """Worker: rebuild the tensors from `ref` and run the whole build of `plan_json` for `arch`."""
    from ...codegen import CompiledCode

    start = time.perf_counter()
    try:
        kernel = compile_plan(ref.tensors(), Plan.from_json(plan_json), "cuda", name=name, arch=arch, options=options)
    except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is recorded, not fatal
        return CompileOutcome("", None, first_line(exc), time.perf_counter() - start, os.getpid())
    code = CompiledCode(kernel.ptx, kernel.cubin, kernel.resources, "", kernel.arch, kernel.nvrtc_version, options)
    return CompileOutcome(source_sha256(kernel.source), code, None, time.perf_counter() - start, os.getpid())


def _compile_source(source: str, arch: str, name: str, options: tuple[str, ...]) -> CompileOutcome:
    """Worker: NVRTC on CUDA source emitted by the parent (a program that exists only in memory)."""
    from ..cache import compile_cached

    start = time.perf_counter()
    try:
        code, _ = compile_cached(source, arch=arch, name=name, options=options)
    except Exception as exc:  # noqa: BLE001
        return CompileOutcome(source_sha256(source), None, first_line(exc), time.perf_counter() - start, os.getpid())
    return CompileOutcome(source_sha256(source), code, None, time.perf_counter() - start, os.getpid())


# ---- the pool ----------------------------------------------------------------------------------

def compile_candidates(plans: Sequence[Plan], arch: str, *, ref: ProgramRef | None = None,
                       sources: Sequence[tuple[str, str]] | None = None, name: str | None = None,
                       options: Sequence[str] = (), workers: int | None = None,
                       progress: Progress | None = None) -> list[CompileOutcome]:
    """NVRTC for every plan, in a pool of `workers` spawned processes (default: one per plan, at
    most the CPU count; 0 compiles in this process). With `ref` each worker builds from the
    tensors; otherwise `sources` gives each plan's (module name, CUDA source)."""
    if ref is None and sources is None:
        raise TeccError("compile_candidates needs a ProgramRef or the emitted sources")
    opts = tuple(options)
    jobs: list[tuple[Callable[..., CompileOutcome], tuple[Any, ...]]] = []
    for i, plan in enumerate(plans):
        if ref is not None:
            jobs.append((_compile_from_ref, (ref, plan.to_json(), arch, name, opts)))
        else:
            assert sources is not None
            module, source = sources[i]
            jobs.append((_compile_source, (source, arch, module, opts)))
    out: list[CompileOutcome] = []
    in_process = workers == 0 or (workers is None and len(jobs) <= 1) or not jobs
    count = max(1, min(len(jobs) if workers is None else workers, os.cpu_count() or 1, len(jobs)))
    if in_process:
        for fn, job_args in jobs:
            out.append(fn(*job_args))
            if progress is not None:
                progress("compile", len(out), len(jobs), "")
        return out
    try:
        with ProcessPoolExecutor(max_workers=count, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(fn, *job_args) for fn, job_args in jobs]
            for future in futures:
                out.append(future.result())
                if progress is not None:
                    progress("compile", len(out), len(jobs), "")
    except BrokenProcessPool:
        # a spawned worker could not start (e.g. the main script is <stdin>, which spawn must
        # re-import): compile the rest here rather than lose the session
        for fn, job_args in jobs[len(out):]:
            out.append(fn(*job_args))
            if progress is not None:
                progress("compile", len(out), len(jobs), "")
    return out
