"""`build`: choose a program's Plan, then compile it (pipeline.py).

    build(args) ──plan="auto"──▶ the candidates in order: graph-level rewrites, the planner, the
                                 generic schedule; the first that takes the program and builds wins
                ──tune=True───▶ the tuning database's winner, or the tuner measures now (tuning/)
                ──plan=Plan───▶ that plan, as given
            ──▶ pipeline.schedule_module(args, plan) ──▶ pipeline.compile_module ──▶ Kernel

The planner (plan="auto") picks each kernel's strategy and parameters by the cost model; its plan
is a list of schedule primitives, replayed on the lowered IR by `Schedule`. `f.explain()` says why.
A candidate whose guard took the program but whose schedule then fails gives way to the next one
(`_first_that_builds`); the plan's reason, `Kernel.fallbacks` and `explain()` say which failed and
why (TECC_STRICT_PLANS=1 raises instead, to debug a strategy).
"""

from __future__ import annotations

import operator
import os
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from ..ir.errors import ShapeError, TeccError
from ..ir.expr import free_vars
from ..ir.stmt import Module
from ..ir.target import Target
from ..ir.tensor import Tensor
from ..passes.default_schedule import DEFAULT_THREADS
from ..passes.manager import DumpIR, PassTiming
from ..ir.scatter import ScatterOp
from ..passes.lower import collect_program, lower
from . import build_cache, region_search
from . import options as knobs
from .kernel import Kernel
from .pipeline import TARGETS, compile_module, default_plan, finish_module, open_dumps, refuse_spills, schedule_module
from .plan import Plan
from . import planner as per_kernel_planner
from .planner import PlanResult
from .schedule import Schedule
from .strategies import column_reduction, online_backward, online_contraction, row_fused, split_row_group, split_rows
from .tuning import tuned_plan

# A candidate is a label and a thunk returning its Plan (or the planner's PlanResult), or None when
# the candidate's guard declines the program.
Candidate = tuple[str, Callable[[], "Plan | PlanResult | region_search.Composed | None"]]

# What a strategy that accepted a program may fail with while it is realized: tecc's own errors
# (a primitive refusing the request) and the internal failures of a strategy's arithmetic or
# bookkeeping. The build then falls back to the next candidate and records why; the last
# candidate (the generic schedule, for plan="auto") is not caught, so a program that cannot be
# built at all says why.
STRATEGY_FAILURES: tuple[type[BaseException], ...] = (
    TeccError, ArithmeticError, LookupError, AssertionError, ValueError, TypeError, AttributeError,
    RecursionError,
)


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
    plan_arch = arch or knobs.default_arch_override()
    candidates: list[Candidate]
    key: str | None = None
    if allow_tf32 and tune:
        raise TeccError("build(): tune=True does not take allow_tf32=True yet (the tuning database has no "
                        "precision in its key); plan with allow_tf32=True, or tune without it")
    if deterministic and tune:
        raise TeccError("build(): tune=True does not take deterministic=True yet (the tuning database has no "
                        "such policy in its key); plan with deterministic=True, or tune without it")
    if tune:
        start = time.perf_counter()
        tuned = tuned_plan(tensors, arch=plan_arch, sizes=sizes, name=name, options=options)
        timing.seconds.append(("tune", time.perf_counter() - start))
        candidates = [("tuned", lambda: tuned)]
    elif plan == "auto" or plan is None:
        key = _build_cache_key(tensors, name, sizes, plan_arch, allow_tf32, deterministic) if dumper is None else None
        found = build_cache.lookup(key) if key is not None else None
        if found is not None:  # planned and scheduled by an earlier build (build_cache.py)
            timing.seconds.append(("build cache hit", 0.0))
            kernel = compile_module(found.module, found.plan, target, arch=arch, options=options, dumper=None,
                                    timing=timing)
            kernel.planning_report = found.report
            return kernel
        candidates = _auto_candidates(tensors, plan_arch, sizes, name, timing, allow_tf32, deterministic)
    else:
        given = _resolve_plan(plan)
        candidates = [("given", lambda: given)]
    module, chosen, planning, fallbacks = _first_that_builds(candidates, tensors, name, dumper, timing)
    if key is not None and not fallbacks:
        build_cache.store(key, chosen, module, planning)
    kernel = compile_module(module, chosen, target, arch=arch, options=options, dumper=dumper, timing=timing)
    kernel.planning = planning
    kernel.fallbacks = fallbacks
    return kernel


def _planner_target(plan_arch: str | None, allow_tf32: bool, deterministic: bool = False) -> str | None | Target:
    """What the per-kernel planner plans for: the arch (resolved by the planner), or with TF32
    allowed or determinism asked the resolved Target carrying that policy (Target.allow_tf32,
    Target.deterministic)."""
    if not allow_tf32 and not deterministic:
        return plan_arch
    return per_kernel_planner.resolve_target(plan_arch).replace(allow_tf32=allow_tf32, deterministic=deterministic)


def _build_cache_key(tensors: list[Tensor], name: str | None, sizes: dict[str, int] | None,
                     plan_arch: str | None, allow_tf32: bool = False, deterministic: bool = False) -> str | None:
    """The build cache's key of an auto-planned program (None with the caches off)."""
    if not knobs.build_cache_enabled():
        return None
    naive = lower(tensors, name)
    # the whole Target, not only its arch: an H100 and an H200 are both sm_90 and plan apart
    # (its repr carries the policies, deterministic included)
    target = per_kernel_planner.resolve_target(plan_arch).replace(allow_tf32=allow_tf32, deterministic=deterministic)
    return build_cache.build_key(str(naive), name=naive.name, sizes=sizes, target=repr(target),
                                 allow_tf32=allow_tf32)


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


def _auto_candidates(tensors: list[Tensor], plan_arch: str | None, sizes: dict[str, int] | None,
                     name: str | None, timing: PassTiming, allow_tf32: bool = False,
                     deterministic: bool = False) -> list[Candidate]:
    """plan="auto": the candidates in the order they are tried.

    Graph-level rewrites the per-kernel planner cannot express, first: a contraction over the axis
    of a (max, sum of exp) row statistic -- attention, softmax then a contraction -- as one kernel
    with a running max (docs/attention.md); its backward (tc.grad's FlashAttention-2 form) as
    three tensor-core kernels (docs/training.md); a reduction over rows too
    few to fill the GPU (or a full reduction) as a grid reduction split over blocks; softmax /
    norms over such rows as partial statistics, then the outputs; a graph of stages sharing a row
    as one kernel when that moves fewer global bytes; a column / middle-axis reduction as a split
    reduction (docs/memory-bound.md says when each applies). Then the same rewrites on the parts
    of the program they recognise, the rest planned per kernel (regions, region_search.py), then
    the per-kernel planner, then the generic schedule (always valid). Only the per-kernel planner
    reads `allow_tf32` (its tensor-core strategy); the graph-level rewrites keep float32
    arithmetic. A program with a scatter (tc.scatter_add) skips the whole-program rewrites unless
    the build is deterministic, and its regions never hold the scatter: the per-kernel planner
    ranks the atomic form (strategies/scatter_atomic.py) against the reduction the scatter lowers
    to, which a graph-level rewrite would take without that comparison."""

    def planner() -> PlanResult:
        result = per_kernel_planner.plan_program(tensors, _planner_target(plan_arch, allow_tf32, deterministic),
                                                 sizes=sizes, name=name, compile_check=refuse_spills)
        timing.seconds.append(("plan", result.search_seconds))
        return result

    def in_regions() -> region_search.Composed | None:
        return region_search.propose(
            tensors, lambda part: _graph_level(part, plan_arch, sizes, name),
            lambda part, number: _per_kernel(part, number, plan_arch, sizes, name, allow_tf32, deterministic),
            name or "", DEFAULT_THREADS)

    tail: list[Candidate] = [("regions", in_regions), ("planner", planner), ("generic", default_plan)]
    if not deterministic and any(isinstance(t.op, ScatterOp) for t in collect_program(tensors).order):
        return tail  # regions never hold a scatter (region_search.py): the planner ranks its forms
    return _graph_level_candidates(tensors, plan_arch, sizes, name) + tail


def _graph_level_candidates(tensors: list[Tensor], plan_arch: str | None, sizes: dict[str, int] | None,
                            name: str | None) -> list[Candidate]:
    """The rewrites that take a whole program (attention and its backward, row groups, split and
    column reductions), in the order build asks them."""

    def proposal(propose: Callable[[], Any]) -> Callable[[], Plan | None]:
        def ask() -> Plan | None:
            found = propose()
            return None if found is None else found.plan
        return ask

    return [
        ("online_contraction_wgmma", proposal(lambda: online_contraction.propose_wgmma(tensors, plan_arch, name))),
        ("online_contraction_mma", proposal(lambda: online_contraction.propose_mma(tensors, plan_arch, name))),
        ("online_contraction", proposal(lambda: online_contraction.propose(tensors, plan_arch))),
        ("online_backward_mma", proposal(lambda: online_backward.propose(tensors, plan_arch, name))),
        ("split_rows", proposal(lambda: split_rows.propose(tensors, plan_arch, sizes=sizes))),
        ("split_row_group", proposal(lambda: split_row_group.propose(tensors, plan_arch, sizes=sizes))),
        ("row_fused", proposal(lambda: row_fused.propose(tensors))),
        ("column_reduction", proposal(lambda: column_reduction.propose(tensors))),
    ]


def _graph_level(part: list[Tensor], plan_arch: str | None, sizes: dict[str, int] | None,
                 name: str | None) -> tuple[Plan, Module] | None:
    """The first graph-level rewrite that takes the part and schedules it: its plan and module."""
    for _, ask in _graph_level_candidates(part, plan_arch, sizes, name):
        try:
            plan = ask()
            if plan is None:
                continue
            steps = Plan(tuple(s for s in plan.steps if s.primitive != "default_schedule"))
            return plan, Schedule(part, steps, name=name).mod
        except STRATEGY_FAILURES:
            if knobs.strict_plans():
                raise
            continue
    return None


def _per_kernel(part: list[Tensor], number: int, plan_arch: str | None, sizes: dict[str, int] | None,
                name: str | None, allow_tf32: bool, deterministic: bool) -> tuple[Plan, Module]:
    """The per-kernel planner's plan of a part and its scheduled module."""
    result = per_kernel_planner.plan_program(part, _planner_target(plan_arch, allow_tf32, deterministic), sizes=sizes,
                                             name=f"{name or 'program'}_part{number}", compile_check=refuse_spills)
    return result.plan, result.schedule.mod


def _first_that_builds(candidates: list[Candidate], tensors: list[Tensor], name: str | None,
                       dumper: DumpIR | None, timing: PassTiming,
                       ) -> tuple[Module, Plan, PlanResult | None, list[tuple[str, str]]]:
    """Lower and schedule with the first candidate that takes the program and builds.

    A candidate that fails (STRATEGY_FAILURES) is recorded as (label, why) and the next one is
    tried; its dumps are removed. The last candidate's failure is raised. Returns the final module,
    the plan (its reason says which candidates failed), the planner's result when it was chosen,
    and the failures."""
    fallbacks: list[tuple[str, str]] = []
    for position, (label, ask) in enumerate(candidates):
        last = position == len(candidates) - 1
        first_dump = dumper.count if dumper is not None else 0
        try:
            found = ask()
            if found is None:
                continue
            planning = found if isinstance(found, PlanResult) else None
            chosen = found.plan if isinstance(found, (PlanResult, region_search.Composed)) else found
            if isinstance(found, region_search.Composed):  # planned and scheduled in parts
                if dumper is not None:
                    dumper.write("compose.txt", f"# the parts, composed\n{dumper.text(found.module)}")
                module = finish_module(found.module, chosen, dumper=dumper, timing=timing)
            else:
                # the planner already scheduled the program (to check that the primitives take the
                # plan): compile that IR; with dumps on, the replay writes one file per primitive
                program: Sequence[Tensor] | Schedule = tensors
                if planning is not None and dumper is None and planning.schedule is not None:
                    program = planning.schedule
                module = schedule_module(program, chosen, name=name, dumper=dumper, timing=timing)
        except STRATEGY_FAILURES as exc:
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
