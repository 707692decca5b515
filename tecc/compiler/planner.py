"""The planner: for each kernel, the strategy and point with the least predicted time.

    result = plan_program([A, B, C], target=tc.target("sm_90"), sizes={"M": 4096})
    result.plan          # the Plan: schedule steps, strategy, and the reason for the choice
    print(explain(result))

For every kernel of the lowered module (one per stage):
1. analyze it (tecc.compiler.cost.analysis): loops, extents, affine accesses, kind;
2. ask every registered strategy's guard; a strategy that declines says why;
3. enumerate each remaining strategy's space (they are small: at most a few thousand points,
   searched exhaustively; GEMM's space is pruned by construction: tiles no larger than twice the
   problem, 32..1024 threads in whole warps), turn each point into a Workload and a Cost;
   points that break a hard constraint are kept with their reason;
4. rank the valid points by predicted time (ties: higher strategy priority, fewer threads);
5. realize the best point with the schedule primitives on a `Schedule`; if a primitive refuses
   it (ScheduleError), record why and take the next one. The naive strategy (the default
   schedule) always succeeds, so every kernel gets a plan.

The Plan holds the primitives of every kernel, then one `default_schedule` step that binds the
kernels planned as naive; its `reason` says what was chosen and why. `PlanResult` keeps the
ranking for `explain`.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ..ir.errors import ScheduleError
from ..ir.target import Target, from_device
from ..ir.target import target as target_of
from ..ir.tensor import Tensor
from ..passes.default_schedule import DEFAULT_THREADS
from ..passes.lower import lower
from .cost.analysis import KernelInfo, analyze_kernel
from .cost.model import DEFAULT_PARAMETERS, Cost, CostParameters, Workload, predict
from .plan import Plan, Step
from .strategies.registry import Point, Strategy, strategies

# A strategy whose primitives refused this many of its points for one kernel is not tried
# further there: the refusals that recur are the program's, not the point's (a loop whose
# dependences isl cannot rule out, e.g. over symbolic extents, refuses every parallel binding),
# and each try schedules the kernel again.
FAILURES_PER_STRATEGY = 6

# (scheduled program, kernel name, arch) -> None, or ScheduleError to pass over the point
CompileCheck = Callable[[Any, str, str], None]


@dataclass
class Candidate:
    """One (strategy, point) for a kernel with its workload and predicted cost."""

    strategy: Strategy
    point: Point
    workload: Workload
    cost: Cost
    failed: str | None = None          # why the schedule primitives refused it

    @property
    def label(self) -> str:
        return self.strategy.describe(self.point)

    @property
    def ok(self) -> bool:
        return self.cost.ok and self.failed is None


@dataclass
class KernelPlan:
    """The planning of one kernel: what it is, what was tried, what was chosen."""

    kernel: str
    info: KernelInfo
    chosen: Candidate
    ranked: list[Candidate]                          # valid candidates, best first
    rejected: list[Candidate]                        # broke a hard constraint (cost.rejected says why)
    declined: list[tuple[str, str]]                  # (strategy, guard's reason)
    evaluated: int = 0

    def runner_up(self, strategy: str | None = None) -> Candidate | None:
        for c in self.ranked:
            if c is not self.chosen and (strategy is None or c.strategy.name == strategy):
                return c
        return None


@dataclass
class PlanResult:
    plan: Plan
    target: Target
    kernels: list[KernelPlan]
    search_seconds: float
    realize_seconds: float
    sizes: dict[str, int] = field(default_factory=dict)
    # the Schedule the planner applied the plan on, to check that the primitives take it: its IR
    # is what replaying `plan` gives (replay is deterministic), so build compiles it as it is
    # instead of scheduling the program a second time
    schedule: Any = None

    @property
    def predicted_seconds(self) -> float:
        return sum(k.chosen.cost.total for k in self.kernels)


def resolve_target(target: Target | str | None) -> Target:
    """A Target from a Target, an arch name, or None (the live device, else sm_90)."""
    if isinstance(target, Target):
        return target
    if target:
        try:
            return target_of(target)
        except ValueError:
            # an arch without a table (or not an arch at all): rank for sm_90 and let NVRTC
            # judge the arch when it compiles
            return target_of("sm_90")
    try:
        return from_device()
    except Exception:  # noqa: BLE001 - no device here: plan for the default architecture
        return target_of("sm_90")


def candidates_for(info: KernelInfo, target: Target, params: CostParameters = DEFAULT_PARAMETERS,
                   only: Sequence[str] | None = None) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Every (strategy, point) for the kernel with its cost, and the strategies that declined."""
    out: list[Candidate] = []
    declined: list[tuple[str, str]] = []
    for s in strategies():
        if only is not None and s.name not in only:
            continue
        why = s.guard(info, target)
        if why is not None:
            declined.append((s.name, why))
            continue
        for point in s.space(info, target):
            w = s.workload(info, point, target)
            out.append(Candidate(s, dict(point), w, predict(w, target, params)))
    return out, declined


def _rank_key(c: Candidate) -> tuple[float, float, int, int]:
    # equal totals (one shared bound, e.g. L2, binds both): the shorter SM-level chain (the
    # pipeline's own stall, which the bound hides in the model but not on the GPU) goes first
    return (c.cost.total, c.cost.terms.get("chain", 0.0), -c.strategy.priority, c.workload.threads)


def plan_program(args: Sequence[Tensor], target: Target | str | None = None, *,
                 sizes: Mapping[str, int] | None = None, name: str | None = None,
                 params: CostParameters = DEFAULT_PARAMETERS, only: Sequence[str] | None = None,
                 keep: int = 8, compile_check: CompileCheck | None = None) -> PlanResult:
    """Plan every kernel of the program `args` for `target` (see the module docstring).

    compile_check: called as `compile_check(schedule, kernel, arch)` on a point of a strategy
    that is `compile_checked` before the planner takes it; a ScheduleError passes over the point
    (build gives pipeline.refuse_spills: compiled with NVRTC, a point that spills is refused).

    sizes: values of symbolic dimensions to plan for (others are assumed, see analysis.DEFAULT_SIZE).
    only: restrict to these strategies (naive is always added as the fallback)."""
    tgt = resolve_target(target)
    start = time.perf_counter()
    module = lower(list(args), name)
    only_list = None if only is None else list(only) + ["naive"]
    kernel_plans: list[KernelPlan] = []
    twins: dict[str, int] = {}           # a kernel's structure -> the first kernel planned with it
    twin_of: list[int | None] = []
    for k in module.kernels:
        info = analyze_kernel(k, sizes)
        key = structure(k)
        first = twins.setdefault(key, len(kernel_plans))
        if first != len(kernel_plans):   # the same loops and accesses: the same ranking
            seen = kernel_plans[first]
            valid = [replace(c, failed=None) for c in seen.ranked]
            rejected, declined, evaluated = seen.rejected, seen.declined, seen.evaluated
            twin_of.append(first)
        else:
            cands, declined = candidates_for(info, tgt, params, only_list)
            valid = sorted((c for c in cands if c.cost.ok), key=_rank_key)
            rejected = [c for c in cands if not c.cost.ok]
            if not valid:
                # every point breaks a hard constraint (a body so large that even one thread per
                # output is estimated past 255 registers): the naive schedule still builds, and
                # ptxas spills what does not fit
                valid = sorted((c for c in rejected if c.strategy.uses_default_schedule), key=_rank_key)[:1]
            evaluated = len(cands)
            twin_of.append(None)
        kernel_plans.append(KernelPlan(k.name, info, valid[0], valid, rejected, declined, evaluated))
    search = time.perf_counter() - start

    start = time.perf_counter()
    schedule = _realize(args, name, kernel_plans, tgt.arch, compile_check, twin_of)
    steps = list(schedule.plan.steps)
    realize = time.perf_counter() - start
    for kp in kernel_plans:
        kp.ranked = _keep(kp, keep)
    naive = [kp for kp in kernel_plans if kp.chosen.strategy.uses_default_schedule]
    if naive:
        threads = int(naive[0].chosen.point.get("threads", DEFAULT_THREADS))
        steps.append(Step("default_schedule", {"threads": threads}))
    names = sorted({kp.chosen.strategy.name for kp in kernel_plans})
    plan = Plan(tuple(steps), "+".join(names), _reason(kernel_plans, tgt))
    return PlanResult(plan, tgt, kernel_plans, search, realize, dict(sizes or {}), schedule)


def _keep(kp: KernelPlan, keep: int) -> list[Candidate]:
    """The candidates explain shows: the chosen, the next `keep`, the best of every strategy,
    and those the primitives refused."""
    ok = [c for c in kp.ranked if c.failed is None]
    out = ok[:keep]
    for c in ok[keep:]:
        if all(o.strategy.name != c.strategy.name for o in out):
            out.append(c)
    return out + [c for c in kp.ranked if c.failed is not None]


def structure(kernel: Any) -> str:
    """A kernel's loop nest with every name replaced by its order of first appearance: kernels
    that differ only in names (a model's layers) have the same structure, and so the same
    candidates, costs and realizable points."""
    names: dict[str, str] = {}
    return _IDENTIFIER.sub(lambda m: names.setdefault(m.group(0), f"n{len(names)}"), str(kernel))


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _realize(args: Sequence[Tensor], name: str | None, kernel_plans: list[KernelPlan], arch: str,
             compile_check: CompileCheck | None, twin_of: Sequence[int | None] | None = None) -> Any:
    """Apply each kernel's best realizable candidate on one Schedule, and return it. A kernel
    with an earlier twin (`structure`) tries the twin's chosen point first: the points ranked
    before it were refused for the twin, and would be for the kernel; and the point is not
    compiled again to check for spills (the same code up to names, so the same registers)."""
    from .schedule import Schedule

    sch = Schedule(list(args), name=name)
    for number, kp in enumerate(kernel_plans):
        failures: dict[str, int] = {}
        twin = twin_of[number] if twin_of is not None else None
        order = list(kp.ranked)
        checked = None  # the twin's point, which ptxas already compiled without spilling
        if twin is not None:
            position = kernel_plans[twin].ranked.index(kernel_plans[twin].chosen)
            order = order[position:] + order[:position]
            checked = order[0]
        for cand in order:
            if cand.strategy.uses_default_schedule:
                kp.chosen = cand
                break
            if failures.get(cand.strategy.name, 0) >= FAILURES_PER_STRATEGY:
                cand.failed = f"not tried: {FAILURES_PER_STRATEGY} better points of {cand.strategy.name} failed"
                continue
            before = sch.checkpoint()
            try:
                cand.strategy.apply(sch, kp.info, cand.point)
                if cand.strategy.compile_checked and compile_check is not None and cand is not checked:
                    compile_check(sch, kp.kernel, arch)
                kp.chosen = cand
                break
            except ScheduleError as exc:
                cand.failed = str(exc).splitlines()[0]
                failures[cand.strategy.name] = failures.get(cand.strategy.name, 0) + 1
                sch.rollback(before)  # as if the candidate had never been tried
    return sch


def _reason(kernel_plans: list[KernelPlan], tgt: Target) -> str:
    parts = []
    for kp in kernel_plans:
        c = kp.chosen
        part = (f"{kp.kernel}: {c.label}, predicted {c.cost.total * 1e6:.1f} us ({c.cost.bound}-bound), "
                f"best of {len(kp.ranked)} valid / {kp.evaluated} evaluated on {tgt.arch}")
        other = next((r for r in kp.ranked if r.strategy.name != c.strategy.name and r.ok), None)
        if other is not None and math.isfinite(other.cost.total):
            part += f"; best {other.strategy.name}: {other.cost.total * 1e6:.1f} us"
        parts.append(part)
    return "; ".join(parts)


__all__ = ["Candidate", "KernelPlan", "PlanResult", "candidates_for", "plan_program", "resolve_target"]
