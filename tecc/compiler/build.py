"""`build`: choose a program's Plan, then compile it (pipeline.py).

    build(args) ──lower once──▶ Program (tensors, naive module, the one Target: arch + policies)
                ──plan="auto"──▶ the planner (planner.py): every registered strategy, per kernel and
                                 graph-level (the rewrites), priced by the cost model, the cheapest
                                 realized; the generic schedule if the planner's plan fails to build
                ──tune=True───▶ the tuning database's winner, or the tuner measures now (tuning/)
                ──plan=Plan───▶ that plan, as given
            ──▶ pipeline.schedule_module(program, plan) ──▶ pipeline.compile_module ──▶ Kernel

The plan is a list of schedule primitives (or a rewrite's step), replayed on the lowered IR by
`Schedule`; `f.explain()` says why it was chosen. The planner's plan gives way to the generic
schedule only for a `TeccError` (a primitive or the fixed tail refusing it): the plan's reason,
`Kernel.fallbacks` and `explain()` say which failed and why, and TECC_STRICT_PLANS=1 raises
instead. Any other exception is a bug in a strategy and is raised as it is.
"""

from __future__ import annotations

import operator
import os
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from ..codegen import default_arch
from ..ir.errors import ShapeError, TeccError
from ..ir.expr import free_vars
from ..ir.stmt import Module
from ..ir.tensor import Tensor
from ..passes.manager import DumpIR, PassTiming
from . import build_cache
from . import options as knobs
from . import planner
from .kernel import Kernel
from .pipeline import TARGETS, compile_module, default_plan, finish_module, open_dumps, refuse_spills, schedule_module
from .plan import Plan
from .planner import PlanResult
from .program import Program, resolve_target
from .schedule import Schedule
from .tuning import tuned_plan

# A candidate is a label and a thunk returning its Plan (or the planner's PlanResult).
Candidate = tuple[str, Callable[[], "Plan | PlanResult"]]


def build(args: Sequence[Tensor] | Schedule, target: str = "cuda", *, name: str | None = None,
          dump_ir: str | os.PathLike[str] | None = None, dump_filter: str | None = None,
          arch: str | None = None, plan: Plan | str | dict[str, Any] = "auto",
          options: Sequence[str] = (), sizes: dict[str, int] | None = None, tune: bool = False,
          allow_tf32: bool = False, deterministic: bool = False) -> Kernel:
    """Compile the program whose kernel signature is `args` (inputs and outputs, in order), or
    the scheduled program of a `Schedule`.

    target: "cuda" (NVRTC → cubin, run through cuda.core) or "sim" (the CPU SIMT emulator).
    dump_ir: a directory that receives the IR after every pass (see pipeline.py).
    arch: e.g. "sm_90"; default: TECC_ARCH, else the live device, else sm_90.
    plan: "auto" (the planner picks strategy and parameters by the cost model; `f.explain()`
      says why), a Plan, or its JSON (ignored for a Schedule, which carries its own).
    sizes: values of symbolic dimensions for the planner to plan for (others are assumed).
    options: extra NVRTC options (e.g. "-use_fast_math").
    tune: use the tuning database's winner for this problem (op, shapes from `sizes`, dtypes,
      arch) without measuring, else autotune now on the GPU (docs/tuning.md); `plan` is then
      ignored. `f.plan.reason` says which.
    allow_tf32: let plan="auto" run float32 contractions on tensor cores with their operands
      rounded to tf32 (10 mantissa bits, ~1e-3 relative per product; docs/tensor-cores.md). Off by
      default: a float32 contraction is never silently less accurate. The planner then ranks the
      tf32 tensor-core plan against the float32 SIMT ones by predicted time; `explain()` says
      whether TF32 was on. A given Plan names its intrinsic itself (`mma.m16n8k8.f32.tf32`).
    deterministic: let plan="auto" choose only plans whose results are the same bits run to run:
      no float atomics, so a scatter (`tc.scatter_add`) sums each output element's matches in a
      fixed order instead of adding them with atomics (docs/semantics.md, "Atomics"). Off by
      default: the planner then picks the faster of the two by predicted time."""
    if target not in TARGETS:
        raise TeccError(f"build(): unknown target {target!r}; use one of {TARGETS}")
    timing = PassTiming()
    if isinstance(args, Schedule):
        dumper = open_dumps(args, name, dump_ir, dump_filter)
        module = schedule_module(args, args.plan, name=name, dumper=dumper, timing=timing)
        return compile_module(module, args.plan, target, arch=arch, options=options, dumper=dumper, timing=timing)

    tensors = [args] if isinstance(args, Tensor) else list(args)
    _check_arguments(tensors, sizes)
    dumper = open_dumps(tensors, name, dump_ir, dump_filter)
    if allow_tf32 and tune:
        raise TeccError("build(): tune=True does not take allow_tf32=True yet (the tuning database has no "
                        "precision in its key); plan with allow_tf32=True, or tune without it")
    if deterministic and tune:
        raise TeccError("build(): tune=True does not take deterministic=True yet (the tuning database has no "
                        "such policy in its key); plan with deterministic=True, or tune without it")
    plan_arch = arch or knobs.default_arch_override()
    start = time.perf_counter()
    program = Program.of(tensors, name=name, sizes=sizes,
                         target=resolve_target(plan_arch, allow_tf32=allow_tf32, deterministic=deterministic),
                         compile_arch=plan_arch or default_arch())
    timing.seconds.append(("lower", time.perf_counter() - start))
    candidates: list[Candidate]
    key: str | None = None
    if tune:
        start = time.perf_counter()
        tuned = tuned_plan(tensors, arch=plan_arch, sizes=sizes, name=name, options=options)
        timing.seconds.append(("tune", time.perf_counter() - start))
        candidates = [("tuned", lambda: tuned)]
    elif plan == "auto" or plan is None:
        key = _build_cache_key(program) if dumper is None else None
        found = build_cache.lookup(key) if key is not None else None
        if found is not None:  # planned and scheduled by an earlier build (build_cache.py)
            timing.seconds.append(("build cache hit", 0.0))
            kernel = compile_module(found.module, found.plan, target, arch=arch, options=options, dumper=None,
                                    timing=timing, threads=knobs.split_compile())
            kernel.planning_report = found.report
            return kernel

        def plan_it() -> PlanResult:
            result = planner.plan_program(program, compile_check=refuse_spills)
            timing.seconds.append(("plan", result.search_seconds))
            return result

        candidates = [("planner", plan_it), ("generic", default_plan)]
    else:
        given = _resolve_plan(plan)
        candidates = [("given", lambda: given)]
    module, chosen, planning, fallbacks = _first_that_builds(candidates, program, dumper, timing)
    if key is not None and not fallbacks:
        build_cache.store(key, chosen, module, planning)
    kernel = compile_module(module, chosen, target, arch=arch, options=options, dumper=dumper, timing=timing,
                            threads=knobs.split_compile())
    kernel.planning = planning
    kernel.fallbacks = fallbacks
    return kernel


def _build_cache_key(program: Program) -> str | None:
    """The build cache's key of an auto-planned program (None with the caches off): its naive IR
    and the whole Target, not only its arch (an H100 and an H200 are both sm_90 and plan apart);
    its repr carries the build's policies, allow_tf32 and deterministic."""
    if not knobs.build_cache_enabled():
        return None
    return build_cache.build_key(str(program.module), name=program.module.name, sizes=program.sizes,
                                 target=repr(program.target), allow_tf32=program.target.allow_tf32)


def _check_arguments(tensors: list[Tensor], sizes: dict[str, int] | None) -> None:
    """The argument list holds tensors, and `sizes` gives non-negative ints to size names the
    program has."""
    for pos, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TeccError(f"build(): argument {pos} is a {type(t).__name__}, not a tensor made by "
                            "tc.placeholder / tc.compute")
    if not sizes:
        return
    known = {v.name for t in tensors for dim in t.shape for v in free_vars(dim)}
    for key, value in sizes.items():
        if key not in known:
            raise ShapeError(f"build(): sizes names {key!r}, which is no size of this program; its sizes are "
                             f"{', '.join(sorted(known)) or 'none (every dimension is a constant)'}")
        try:
            ok = not isinstance(value, bool) and operator.index(value) >= 0
        except TypeError:
            ok = False
        if not ok:
            raise ShapeError(f"build(): sizes[{key!r}] is {value!r}; give a non-negative int")


def _first_that_builds(candidates: list[Candidate], program: Program, dumper: DumpIR | None, timing: PassTiming,
                       ) -> tuple[Module, Plan, PlanResult | None, list[tuple[str, str]]]:
    """Schedule the program with the first candidate that builds.

    A candidate that fails with a TeccError (a primitive refusing the plan, the fixed tail of
    passes) is recorded as (label, why) and the next one is tried; its dumps are removed. The
    last candidate's failure is raised, and so is any other exception: a Python error inside a
    strategy is a bug, not a reason to build something slower. Returns the final module, the plan
    (its reason says which candidates failed), the planner's result when it was chosen, and the
    failures."""
    fallbacks: list[tuple[str, str]] = []
    for position, (label, ask) in enumerate(candidates):
        last = position == len(candidates) - 1
        first_dump = dumper.count if dumper is not None else 0
        try:
            found = ask()
            planning = found if isinstance(found, PlanResult) else None
            chosen = found.plan if isinstance(found, PlanResult) else found
            if planning is not None and planning.composed is not None and dumper is None:
                # planned in regions: the parts' modules, scheduled and composed by the planner
                module = finish_module(planning.composed, chosen, dumper=dumper, timing=timing)
            else:
                # the planner already scheduled the program (to check that the primitives take the
                # plan): compile that IR; with dumps on, the replay writes one file per primitive
                # (a plan in regions: compose.txt, regions.replay)
                source: Sequence[Tensor] | Schedule = program.args
                if planning is not None and dumper is None and planning.schedule is not None:
                    source = planning.schedule
                module = schedule_module(source, chosen, name=program.name, dumper=dumper, timing=timing,
                                         lowered=program.module)
        except TeccError as exc:
            if last or knobs.strict_plans():
                raise
            fallbacks.append((label, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
            if dumper is not None:
                dumper.rewind(first_dump)
            continue
        if fallbacks:
            tried = "; ".join(f"{who} failed ({why})" for who, why in fallbacks)
            chosen = replace(chosen, reason=(chosen.reason + "; " if chosen.reason else "") + f"fell back: {tried}")
        return module, chosen, planning, fallbacks
    raise TeccError("build(): no candidate plan applies to this program")  # the list ends in one that always does


def _resolve_plan(plan: Plan | str | dict[str, Any]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, dict)):
        return Plan.from_json(plan)
    raise TeccError(f"build(): plan must be 'auto', a Plan or its JSON, got {type(plan).__name__}")
