"""The measured autotuner: the planner proposes, the GPU decides (docs/tuning.md).

    result = tune(spec, top_k=8)          # an OpSpec, or the build signature with sizes=
    result.plan                           # the fastest candidate that matched the reference
    print(result.table())                 # every candidate: predicted vs measured

The pipeline, top to bottom:

1. **candidates** (`candidate_plans`): the planner ranks each kernel's (strategy, point) pairs by
   predicted time; a whole-program candidate picks one point per kernel. The first candidate is
   the planner's own plan (every kernel at its best); the others change one kernel to one of its
   next `top_k` points and leave the rest at their best. Each is realized on a `Schedule` (the
   primitives may refuse a point: it is dropped), duplicates are merged, and the `top_k` with the
   least predicted time are kept.
2. **compile** (`compile_candidates`): NVRTC in a `ProcessPoolExecutor` (spawned processes, so a
   CUDA context of the parent is never forked). Tensors are not picklable, so a worker gets the
   program as a `ProgramRef` (the op's file and name, or a module-level factory) and the plan as
   JSON, and runs the whole `build`; a program that exists only in memory is emitted here and
   the workers compile its CUDA source. Either way the compile cache receives the cubins.
3. **check**: each candidate runs once on random inputs with poisoned outputs; its outputs are
   compared with the float64 NumPy reference (`OpSpec.reference`), or, without one, with the
   naive plan's result. A candidate over the dtype's bound (tecc.compiler.check.REL_TOL) or one
   that fails to compile or launch is recorded as wrong and never wins.
4. **time** (`CudaBench`): CUDA events around every launch (the profiling hook,
   tecc.compiler.profiling), `warmup` calls, then the median of `repeats` calls, each on the next
   of several device-resident argument sets whose total size is at least twice the L2 cache of
   `tecc.ir.target.from_device()`, so no call finds its inputs in L2 from an earlier one.
5. **store**: every measurement (with the cost model's prediction) and the winner go to the
   tuning database (tecc.compiler.tuning_db), keyed by (op signature, shapes, dtypes, arch) and
   the candidate's strategy. `build(..., tune=True)` looks the problem up first (`tuned_plan`)
   and replays a stored winner without measuring.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..ir.errors import ScheduleError, TeccError
from ..ir.evaluate import evaluate_int
from ..ir.expr import free_vars
from ..ir.tensor import Tensor
from .check import REL_TOL, OpSpec, poison, random_array, relative_error
from .plan import Plan, Step
from .planner import Candidate, PlanResult, plan_program
from .tuning_db import Problem, TuningDB

DEFAULT_TOP_K = 8
DEFAULT_WARMUP = 3
DEFAULT_REPEATS = 20
# The argument sets of one timing session together span at least this many L2 caches: with an
# LRU-like replacement a set's lines are evicted before the rotation comes back to it.
L2_FACTOR = 2.0
MAX_SETS = 512
MAX_SET_BYTES = 2 << 30  # never hold more than 2 GiB of rotating copies on the device

REASON_FROM_DB = "tuned: from the tuning database"
REASON_MEASURED = "tuned: measured now"

Progress = Callable[[str, int, int, str], None]  # (phase, done, total, label)


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


# ---- 1. candidates -----------------------------------------------------------------------------

@dataclass(frozen=True)
class TuneCandidate:
    """One whole-program plan to measure: its plan, the per-kernel choices in words, and the
    cost model's predicted time (the sum over its kernels)."""

    plan: Plan
    label: str
    predicted_us: float

    @property
    def strategy(self) -> str:
        return self.plan.strategy


def candidate_plans(args: Sequence[Tensor], arch: str | None = None, *, sizes: Mapping[str, int] | None = None,
                    name: str | None = None, top_k: int = DEFAULT_TOP_K) -> tuple[PlanResult, list[TuneCandidate]]:
    """The planner's result and up to `top_k` whole-program candidates, least predicted time
    first (see the module docstring, step 1). The first is always the planner's own plan."""
    if top_k < 1:
        raise TeccError(f"top_k must be at least 1, got {top_k}")
    result = plan_program(list(args), arch, sizes=sizes, name=name, keep=top_k)
    best = [kp.chosen for kp in result.kernels]
    choices: list[list[Candidate]] = [best]
    for i, kp in enumerate(result.kernels):
        alternatives = [c for c in kp.ranked if c.failed is None and c is not kp.chosen][:top_k - 1]
        for alt in alternatives:
            choices.append(best[:i] + [alt] + best[i + 1:])
    found: dict[str, TuneCandidate] = {}  # by the steps' JSON: two picks may realize the same plan
    for picks in choices:
        plan = _realize(args, name, result, picks)
        if plan is None:
            continue
        key = json.dumps([s.to_json() for s in plan.steps], sort_keys=True)
        if key not in found:
            predicted = sum(p.cost.total for p in picks) * 1e6
            found[key] = TuneCandidate(plan, "; ".join(p.label for p in picks), predicted)
    ranked = list(found.values())
    first, rest = ranked[0], sorted(ranked[1:], key=lambda c: c.predicted_us)
    return result, [first, *rest][:top_k]


def _realize(args: Sequence[Tensor], name: str | None, result: PlanResult, picks: Sequence[Candidate]) -> Plan | None:
    """The plan of one pick per kernel, applied in kernel order on one Schedule (as the planner
    realizes its own choice); None when a primitive refuses a pick."""
    from ..passes.default_schedule import DEFAULT_THREADS
    from .schedule import Schedule

    sch = Schedule(list(args), name=name)
    naive_threads: int | None = None
    for kp, pick in zip(result.kernels, picks):
        if pick.strategy.uses_default_schedule:
            # one default_schedule step binds every unbound kernel: the first naive pick sets it
            if naive_threads is None:
                naive_threads = int(pick.point.get("threads", DEFAULT_THREADS))
            continue
        try:
            pick.strategy.apply(sch, kp.info, pick.point)
        except ScheduleError:
            return None
    steps = list(sch.plan.steps)
    if naive_threads is not None:
        steps.append(Step("default_schedule", {"threads": naive_threads}))
    strategy = "+".join(sorted({p.strategy.name for p in picks}))
    return Plan(tuple(steps), strategy, "; ".join(p.label for p in picks))


# ---- 2. compiling in a process pool -----------------------------------------------------------

@dataclass(frozen=True)
class CompileOutcome:
    """What a worker sends back: the NVRTC output (None on failure) for the CUDA source with
    this SHA-256, the error otherwise, the seconds it took and the worker's process id."""

    source_sha256: str
    code: Any
    error: str | None
    seconds: float
    pid: int


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _compile_from_ref(ref: ProgramRef, plan_json: str, arch: str, name: str | None,
                      options: tuple[str, ...]) -> CompileOutcome:
    """Worker: rebuild the tensors from `ref` and run the whole build of `plan_json` for `arch`."""
    from ..codegen import CompiledCode
    from .build import build

    start = time.perf_counter()
    try:
        kernel = build(ref.tensors(), "cuda", name=name, arch=arch, plan=Plan.from_json(plan_json), options=options)
    except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is recorded, not fatal
        return CompileOutcome("", None, _first_line(exc), time.perf_counter() - start, os.getpid())
    code = CompiledCode(kernel.ptx, kernel.cubin, kernel.resources, "", kernel.arch, kernel.nvrtc_version, options)
    return CompileOutcome(_sha(kernel.source), code, None, time.perf_counter() - start, os.getpid())


def _compile_source(source: str, arch: str, name: str, options: tuple[str, ...]) -> CompileOutcome:
    """Worker: NVRTC on CUDA source emitted by the parent (a program that exists only in memory)."""
    from .cache import compile_cached

    start = time.perf_counter()
    try:
        code, _ = compile_cached(source, arch=arch, name=name, options=options)
    except Exception as exc:  # noqa: BLE001
        return CompileOutcome(_sha(source), None, _first_line(exc), time.perf_counter() - start, os.getpid())
    return CompileOutcome(_sha(source), code, None, time.perf_counter() - start, os.getpid())


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


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


# ---- 3.-4. checking and timing ----------------------------------------------------------------

class Bench:
    """Where candidates run: `run` once for the check (host arrays, written in place), `time`
    for the measurement (microseconds per call). Subclassed by CudaBench; tests stub it."""

    device: str = ""
    note: str = ""

    def run(self, kernel: Any, arrays: list[np.ndarray]) -> None:
        kernel(*arrays)

    def time(self, kernel: Any, arrays: list[np.ndarray], warmup: int, repeats: int) -> list[float]:
        raise NotImplementedError


class CudaBench(Bench):
    """Times on the current CUDA device: CUDA events around every launch (the profiling hook),
    rotating over device-resident copies of the arguments that together span `L2_FACTOR` times
    the L2 size. The copies are made once per distinct argument list and reused by every
    candidate (they all share the build signature)."""

    def __init__(self) -> None:
        from ..ir.target import from_device
        from ..runtime.cuda import current_device

        self._device = current_device()
        self.target = from_device(self._device)
        self.device = str(self._device.name)
        self._sets: list[list[Any]] = []
        self._key: tuple[int, ...] = ()
        self._keep: list[Any] = []

    def rotation(self, set_bytes: int) -> int:
        """How many argument sets to rotate over: enough to span L2_FACTOR × L2, at least 2."""
        need = math.ceil(L2_FACTOR * self.target.l2_bytes / max(set_bytes, 1)) + 1
        return max(2, min(need, MAX_SETS, max(2, MAX_SET_BYTES // max(set_bytes, 1))))

    def _device_sets(self, arrays: list[np.ndarray]) -> list[list[Any]]:
        key = tuple(id(a) for a in arrays)
        if key == self._key:
            return self._sets
        from cuda.core.utils import StridedMemoryView  # type: ignore[import-untyped]

        from ..runtime import arrays as rt_arrays

        stream = self._device.default_stream
        count = self.rotation(sum(a.nbytes for a in arrays))
        self._keep, self._sets = [], []
        try:
            for _ in range(count):
                views = []
                for a in arrays:
                    buf = rt_arrays.to_device(np.ascontiguousarray(a), self._device, stream)
                    self._keep.append(buf)
                    views.append(StridedMemoryView.from_buffer(buf, tuple(a.shape), dtype=a.dtype))
                self._sets.append(views)
            stream.sync()
            self.note = f"{count} device-resident argument sets of {sum(a.nbytes for a in arrays) / 1e6:.2f} MB"
        except Exception as exc:  # noqa: BLE001 - keep measuring, warm-L2 host arrays are still events-timed
            self._keep, self._sets = [], [arrays]
            self.note = f"host arrays (device copies failed: {_first_line(exc)})"
        self._key = key
        return self._sets

    def time(self, kernel: Any, arrays: list[np.ndarray], warmup: int, repeats: int) -> list[float]:
        from .profiling import profile

        sets = self._device_sets(arrays)
        times: list[float] = []
        with profile() as prof:
            for i in range(warmup + repeats):
                before = len(prof.launches)
                kernel(*sets[i % len(sets)])
                if i >= warmup:
                    times.append(sum(r.time_ms or 0.0 for r in prof.launches[before:]) * 1e3)
        return times


@dataclass
class CandidateResult:
    """One candidate's fate: compile seconds, the check's relative error, the times (µs)."""

    candidate: TuneCandidate
    compile_seconds: float = 0.0
    error: str | None = None          # compile / launch failure, or the check's FAIL line
    rel_error: float | None = None
    times_us: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.times_us)

    @property
    def median_us(self) -> float | None:
        return statistics.median(self.times_us) if self.times_us else None


@dataclass
class TuneResult:
    """What `tune` returns: the problem, the winning plan, every candidate's result."""

    problem: Problem
    plan: Plan
    results: list[CandidateResult]
    device: str = ""
    note: str = ""
    seconds: float = 0.0

    @property
    def winner(self) -> CandidateResult | None:
        good = [r for r in self.results if r.ok]
        return min(good, key=lambda r: r.median_us or math.inf) if good else None

    def table(self) -> str:
        """Every candidate, predicted vs measured, the winner marked with *."""
        win = self.winner
        lines = [f"{'':2}{'predicted':>11} {'measured':>11} {'ratio':>6}  candidate"]
        for r in sorted(self.results, key=lambda r: (not r.ok, r.median_us or math.inf)):
            measured = f"{r.median_us:9.1f}us" if r.median_us is not None else f"{'-':>11}"
            ratio = f"{r.median_us / r.candidate.predicted_us:6.2f}" if r.median_us and r.candidate.predicted_us else f"{'-':>6}"
            mark = "* " if r is win else "  "
            line = f"{mark}{r.candidate.predicted_us:9.1f}us {measured} {ratio}  {r.candidate.label}"
            if r.error:
                line += f"  REJECTED: {r.error}"
            lines.append(line)
        return "\n".join(lines)


# ---- the tuner --------------------------------------------------------------------------------

def concrete_shapes(args: Sequence[Tensor], sizes: Mapping[str, int] | None) -> list[tuple[int, ...]]:
    """Every argument's shape with the symbolic dimensions bound by `sizes` (TeccError naming
    the missing ones: the tuning database keys on concrete shapes)."""
    sizes = dict(sizes or {})
    missing = sorted({v.name for t in args for s in t.shape for v in free_vars(s) if v.name not in sizes})
    if missing:
        raise TeccError(f"tuning needs concrete shapes: give the size of {', '.join(missing)} "
                        f"(sizes={{{', '.join(repr(m) + ': ...' for m in missing)}}}); measurements are "
                        "stored per shape")
    out = []
    for t in args:
        env = {v: sizes[v.name] for s in t.shape for v in free_vars(s)}
        out.append(tuple(evaluate_int(s, env) for s in t.shape))
    return out


def require_gpu() -> None:
    from ..runtime.cuda import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:
        raise TeccError(f"tuning needs a CUDA device to measure on, and none is usable here ({reason}). "
                        "plan=\"auto\" (the default) picks a plan by the cost model without one; a plan "
                        "tuned on a GPU is reused from the tuning database (TECC_TUNING_DB) without measuring")


def problem_of(args: Sequence[Tensor], sizes: Mapping[str, int] | None, arch: str, name: str | None) -> Problem:
    return Problem.of(list(args), concrete_shapes(args, sizes), arch, name)


def tuned_plan(args: Sequence[Tensor], *, arch: str | None = None, sizes: Mapping[str, int] | None = None,
               name: str | None = None, db: TuningDB | None = None, top_k: int = DEFAULT_TOP_K,
               options: Sequence[str] = ()) -> Plan:
    """`build(..., tune=True)`: the stored winner of the problem when the database has one
    (nothing is measured), else `tune` now (which needs a GPU)."""
    from ..codegen import default_arch

    the_arch = arch or default_arch()
    db = db if db is not None else TuningDB()
    hit = db.winner(problem_of(args, sizes, the_arch, name))
    if hit is not None:
        stored = Plan.from_json(hit.plan)
        return Plan(stored.steps, stored.strategy,
                    f"{REASON_FROM_DB} ({hit.strategy}, median {hit.median_us:.1f} us on {the_arch})")
    return tune(list(args), arch=arch, sizes=sizes, name=name, db=db, top_k=top_k, options=options).plan


def tune(program: OpSpec | Sequence[Tensor], *, arch: str | None = None, sizes: Mapping[str, int] | None = None,
         name: str | None = None, top_k: int = DEFAULT_TOP_K, ref: ProgramRef | None = None,
         workers: int | None = None, bench: Bench | None = None, db: TuningDB | None = None,
         warmup: int = DEFAULT_WARMUP, repeats: int = DEFAULT_REPEATS, options: Sequence[str] = (),
         seed: int = 0, progress: Progress | None = None) -> TuneResult:
    """Measure the planner's top-k candidates of `program` and store them (module docstring).

    program: an OpSpec (its sizes, reference and name are used) or the build signature.
    arch: must be the device's when measuring on the GPU (default: the device's).
    ref: how worker processes rebuild the tensors (else they compile source emitted here).
    bench: where candidates run and are timed (default CudaBench: needs a CUDA device).
    Returns the TuneResult; `.plan` is the winner, its reason starting with "tuned: measured now"."""
    from .build import build, default_plan

    start = time.perf_counter()
    spec = program if isinstance(program, OpSpec) else None
    args: list[Tensor] = list(spec.args) if spec is not None else list(program)  # type: ignore[arg-type]
    the_sizes = dict(spec.sizes if spec is not None else {}) | dict(sizes or {})
    name = name or (spec.name if spec is not None else None)
    if bench is None:
        require_gpu()
        bench = CudaBench()
        device_arch = bench.target.arch
        if arch is not None and arch != device_arch:
            raise TeccError(f"cannot tune for {arch} on this {bench.device} ({device_arch}): measurements are "
                            f"made on the device; tune without arch= (or --arch {device_arch})")
        arch = device_arch
    if arch is None:
        from ..codegen import default_arch

        arch = default_arch()
    shapes = concrete_shapes(args, the_sizes)
    problem = Problem.of(args, shapes, arch, name)
    db = db if db is not None else TuningDB()

    _, candidates = candidate_plans(args, arch, sizes=the_sizes, name=name, top_k=top_k)
    plans = [c.plan for c in candidates]
    need_naive = spec is None
    if need_naive:
        plans.append(default_plan())
    # the parent needs each candidate's loop IR to run it: build for "sim" (no NVRTC) here,
    # the workers compile; the source hashes must agree
    kernels = [build(args, "sim", name=name, plan=p, options=options) for p in plans]
    sources = None if ref is not None else [(k.module.name, k.source) for k in kernels]
    outcomes = compile_candidates(plans, arch, ref=ref, sources=sources, name=name, options=options,
                                  workers=workers, progress=progress)
    results = [CandidateResult(c) for c in candidates]
    for kernel, outcome, result in zip(kernels, outcomes, results + [None] * need_naive):
        if outcome.code is not None and outcome.source_sha256 != _sha(kernel.source):
            outcome = CompileOutcome("", None, "the worker's CUDA source differs from this process's",
                                     outcome.seconds, outcome.pid)
        if outcome.code is not None:
            kernel.attach_binary(outcome.code, tuple(options))
            kernel.target = "cuda"
        if result is not None:
            result.compile_seconds = outcome.seconds
            result.error = outcome.error
        elif outcome.error is not None:
            raise TeccError(f"{name or 'op'}: the naive plan (the reference) does not compile: {outcome.error}")

    rng = np.random.default_rng(seed)
    inputs = _inputs(spec, args, shapes, rng)
    refs = _reference(spec, args, shapes, inputs, kernels[-1] if need_naive else None, bench)
    arrays = _arguments(args, shapes, inputs)
    for i, (kernel, result) in enumerate(zip(kernels, results)):
        if progress is not None:
            progress("measure", i, len(results), result.candidate.label)
        if result.error is None:
            _check_and_time(kernel, result, spec, args, shapes, inputs, refs, arrays, bench, warmup, repeats)
    if progress is not None:
        progress("measure", len(results), len(results), "")

    db.record_many(problem, [{"strategy": r.candidate.strategy, "plan": r.candidate.plan,
                              "times_us": r.times_us, "predicted_us": r.candidate.predicted_us,
                              "ok": r.ok, "error": r.error} for r in results], device=bench.device)
    out = TuneResult(problem, _winning_plan(problem, results, name), results, bench.device, bench.note,
                     time.perf_counter() - start)
    return out


def _winning_plan(problem: Problem, results: list[CandidateResult], name: str | None) -> Plan:
    good = [r for r in results if r.ok]
    if not good:
        errors = "; ".join(f"{r.candidate.label}: {r.error}" for r in results[:3])
        raise TeccError(f"{name or 'op'}: no candidate compiled, ran and matched the reference ({errors})")
    best = min(good, key=lambda r: r.median_us or math.inf)
    plan = best.candidate.plan
    return Plan(plan.steps, plan.strategy,
                f"{REASON_MEASURED} ({plan.strategy}, median {best.median_us:.1f} us on {problem.arch}, "
                f"fastest correct of {len(good)}/{len(results)}; predicted {best.candidate.predicted_us:.1f} us)")


def _inputs(spec: OpSpec | None, args: Sequence[Tensor], shapes: list[tuple[int, ...]],
            rng: np.random.Generator) -> list[np.ndarray]:
    input_shapes = [s for t, s in zip(args, shapes) if t.is_placeholder]
    if spec is not None and spec.make_inputs is not None:
        return list(spec.make_inputs(rng, input_shapes))
    return [random_array(rng, s, t.dtype) for t, s in zip([t for t in args if t.is_placeholder], input_shapes)]


def _arguments(args: Sequence[Tensor], shapes: list[tuple[int, ...]], inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Inputs in signature order with poisoned outputs (fresh arrays each call)."""
    it = iter(inputs)
    return [next(it).copy() if t.is_placeholder else poison(s, t.dtype) for t, s in zip(args, shapes)]


def _reference(spec: OpSpec | None, args: Sequence[Tensor], shapes: list[tuple[int, ...]],
               inputs: list[np.ndarray], naive: Any, bench: Bench) -> list[np.ndarray]:
    """The expected outputs in float64: OpSpec.reference, else the naive plan's result."""
    outputs = [t for t in args if not t.is_placeholder]
    if spec is not None:
        refs = spec.reference(*[a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a
                                for a in inputs])
        if isinstance(refs, np.ndarray) or np.isscalar(refs):
            refs = [refs]
        out_shapes = [s for t, s in zip(args, shapes) if not t.is_placeholder]
        return [np.broadcast_to(np.asarray(r, dtype=np.float64), s) for r, s in zip(refs, out_shapes)]
    arrays = _arguments(args, shapes, inputs)
    try:
        bench.run(naive, arrays)
    except Exception as exc:  # noqa: BLE001 - reported as a TeccError that says what failed
        raise TeccError(f"the naive plan (the reference) failed to run: {_first_line(exc)}") from exc
    got = [a for t, a in zip(args, arrays) if not t.is_placeholder]
    return [a.astype(np.float64) for a, _ in zip(got, outputs)]


def _check_and_time(kernel: Any, result: CandidateResult, spec: OpSpec | None, args: Sequence[Tensor],
                    shapes: list[tuple[int, ...]], inputs: list[np.ndarray], refs: list[np.ndarray],
                    timing_arrays: list[np.ndarray], bench: Bench, warmup: int, repeats: int) -> None:
    arrays = _arguments(args, shapes, inputs)
    try:
        bench.run(kernel, arrays)
    except Exception as exc:  # noqa: BLE001 - a candidate that faults is rejected, the others go on
        result.error = f"run failed: {_first_line(exc)}"
        return
    worst = 0.0
    for t, out, ref in zip([t for t in args if not t.is_placeholder],
                           [a for t, a in zip(args, arrays) if not t.is_placeholder], refs):
        if t.dtype.is_float:
            err, where = relative_error(out, ref)
            bound = (spec.rel_tol if spec is not None and spec.rel_tol else None) or REL_TOL[t.dtype.name]
        else:
            err = float(np.count_nonzero(out.astype(np.float64) != ref))
            where, bound = f"{int(err)} elements differ", 0.0
        worst = max(worst, err)
        if err > bound:
            result.rel_error = err
            result.error = f"wrong result: {t.name} rel err {err:.2e} > {bound:.0e}, {where}"
            return
    result.rel_error = worst
    try:
        result.times_us = bench.time(kernel, timing_arrays, warmup, repeats)
    except Exception as exc:  # noqa: BLE001
        result.error = f"timing failed: {_first_line(exc)}"


__all__ = [
    "REASON_FROM_DB",
    "REASON_MEASURED",
    "Bench",
    "CandidateResult",
    "CompileOutcome",
    "CudaBench",
    "ProgramRef",
    "TuneCandidate",
    "TuneResult",
    "candidate_plans",
    "compile_candidates",
    "concrete_shapes",
    "load_op",
    "problem_of",
    "require_gpu",
    "tune",
    "tuned_plan",
]
