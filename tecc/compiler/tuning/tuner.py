"""The measured autotuner: the planner proposes, the GPU decides (docs/tuning.md).

    result = tune(spec, top_k=8)          # an OpSpec, or the build signature with sizes=
    result.plan                           # the fastest candidate that matched the reference
    print(result.table())                 # every candidate: predicted vs measured

The entry points, `tune` and `tuned_plan` (what `build(..., tune=True)` calls), run the
steps of the package (tecc/compiler/tuning/__init__.py lists them) in order.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ...ir.errors import TeccError
from ...ir.evaluate import evaluate_int
from ...ir.expr import free_vars
from ...ir.tensor import Tensor
from ...runtime.artifact import source_sha256
from ..check import OpSpec
from ..pipeline import compile_plan, default_plan
from ..plan import Plan
from .bench import Bench, CudaBench
from .candidates import DEFAULT_TOP_K, TuneCandidate, candidate_plans
from .check import Reference
from .database import Problem, TuningDB
from .pool import CompileOutcome, ProgramRef, Progress, compile_candidates, first_line

DEFAULT_WARMUP = 3
DEFAULT_REPEATS = 20

REASON_FROM_DB = "tuned: from the tuning database"
REASON_MEASURED = "tuned: measured now"


# ---- what a session found ----------------------------------------------------------------------

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
    from ...runtime.cuda import cuda_unavailable_reason

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
    from ...codegen import default_arch

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
        from ...codegen import default_arch

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
    kernels = [compile_plan(args, p, "sim", name=name, options=options) for p in plans]
    sources = None if ref is not None else [(k.module.name, k.source) for k in kernels]
    outcomes = compile_candidates(plans, arch, ref=ref, sources=sources, name=name, options=options,
                                  workers=workers, progress=progress)
    results = [CandidateResult(c) for c in candidates]
    for kernel, outcome, result in zip(kernels, outcomes, results + [None] * need_naive):
        if outcome.code is not None and outcome.source_sha256 != source_sha256(kernel.source):
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

    reference = Reference.make(spec, args, shapes, np.random.default_rng(seed), kernels[-1] if need_naive else None,
                               bench)
    timing_arrays = reference.arguments()
    for i, (kernel, result) in enumerate(zip(kernels, results)):
        if progress is not None:
            progress("measure", i, len(results), result.candidate.label)
        if result.error is None:
            _check_and_time(kernel, result, reference, timing_arrays, bench, warmup, repeats)
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


def _check_and_time(kernel: Any, result: CandidateResult, reference: Reference, timing_arrays: list[np.ndarray],
                    bench: Bench, warmup: int, repeats: int) -> None:
    """Steps 3 and 4 for one candidate: only one that matches the reference is timed."""
    result.rel_error, result.error = reference.check(kernel, bench)
    if result.error is not None:
        return
    try:
        result.times_us = bench.time(kernel, timing_arrays, warmup, repeats)
    except Exception as exc:  # noqa: BLE001
        result.error = f"timing failed: {first_line(exc)}"


__all__ = [
    "DEFAULT_REPEATS", "DEFAULT_WARMUP", "REASON_FROM_DB", "REASON_MEASURED", "CandidateResult", "TuneResult",
    "concrete_shapes", "problem_of", "require_gpu", "tune", "tuned_plan",
]
