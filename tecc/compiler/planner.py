"""The planner: every candidate of a program priced by the cost model, the cheapest realized.

    result = plan_program([A, B, C], target=tc.target("sm_90"), sizes={"M": 4096})
    result.plan          # the Plan: schedule steps, strategy, and the reason for the choice
    print(explain(result))

One planning path (docs/cost-model.md, "The planner"):
1. the program is lowered once (`Program`, tecc.compiler.program) and each kernel of the
   lowered module (one per stage) analyzed (tecc.compiler.cost.analysis): loops, extents,
   affine accesses, kind;
2. per kernel: every registered strategy's guard is asked (one that declines says why); the
   remaining strategies' spaces are enumerated (small: at most a few thousand points, searched
   exhaustively; GEMM's space is pruned by construction: tiles no larger than twice the problem,
   32..1024 threads in whole warps), each point turned into a Workload and a Cost; points that
   break a hard constraint are kept with their reason; the valid ones ranked by predicted time
   (ties: higher strategy priority, fewer threads);
3. graph level: every registered graph strategy (a rewrite of several stages: row fusion, split
   reductions, the online contraction) is asked the same over the whole program; one that takes
   it claims the kernels it replaces (`stages`) and its points are priced the same way, ranked
   at predicted time / the strategy's `margin` (a strategy may order its own points that the
   model does not separate: `GraphStrategy.order`); a program with a scatter asks none unless
   the build is deterministic (SCATTER_PER_KERNEL);
4. the two alternatives are weighed: a graph point is tried before the per-kernel plans of the
   kernels it claims when it is predicted cheaper than the sum of their best points, or within
   GRAPH_TIE of it (a tie at one bound: the rewrite measured on such programs stays);
5. realization, cheapest first: a graph point by its rewrite step on a `Schedule`, the
   per-kernel plans by each kernel's best point its primitives take (realize.py, which runs
   the compile checks in threads); a point the primitives refuse (ScheduleError), or whose
   compile check finds spills, is recorded and the next is tried. The naive strategy (the
   default schedule) always succeeds, so every kernel gets a plan.
   Kernels that differ only in names (a model's layers: rankings.py) share one ranking, and a
   strategy refused FAILURES_PER_STRATEGY times for a kernel is not tried further there;
6. regions: when no graph point takes the whole program, the parts that the graph strategies
   recognise (region_search.py: attention inside a model's graph, a row group) are cut out and
   each planned by this same procedure, its graph points weighed against its own per-kernel
   plans; the stages between them form parts planned the same way, and the parts' modules are
   composed into one (regions.py). The plan is then a list of `region` steps.

The Plan holds the rewrite's step, or the primitives of every kernel then one `default_schedule`
step that binds the kernels planned as naive; its `reason` says what was chosen and why, and
which graph-level strategy won over which per-kernel plans (or lost to them). `PlanResult` keeps
the rankings for `explain`.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ..ir.errors import ScheduleError, ShapeError
from ..ir.target import Target
from ..ir.tensor import Tensor
from ..passes.default_schedule import DEFAULT_THREADS
from . import options as knobs
from .candidate import Candidate, CompileCheck
from .cost.analysis import KernelInfo
from .cost.model import DEFAULT_PARAMETERS, CostParameters, predict
from .part_twins import NameClash, PartRenaming, UnknownNode, signature
from .plan import Plan, Step
from .program import Program, resolve_target
from .realize import FAILURES_PER_STRATEGY, deferring, realize_later
from .rankings import ACTIVE, GroupRanking, Ranking, Rankings, context_key, group_key, ranking_key, shared_rankings
from .strategies.registry import GraphStrategy, Strategy, graph_strategies, strategies

# A rewrite predicted within this fraction of the per-kernel plans it replaces is realized first.
# Both are then at one bound (DRAM, for the memory-bound rewrites), where the model's terms do not
# order two kernels: its elementwise points predicted within 210-230 us measured 136-170 us, the
# staged row reduction spread 174-400 us measured where the model spread it less
# (docs/cost-model.md, "Honesty loop"), and the best per-kernel row sum measured 16% slower than the
# best one-kernel row point that the model ranked beside it (third pass). Each rewrite was measured
# on the programs its guard admits when it was added (row_fused 94-107% of copy, the split
# reductions 78-106%; RESULTS.md): at a tie the measured plan stays.
GRAPH_TIE = 0.05

# Why no graph-level strategy is asked of a program with a scatter unless the build is
# deterministic: its stages are planned per kernel, where the atomic form (scatter_atomic) is
# ranked against the masked sum the scatter lowers to. No rewrite was written or measured for a
# scatter's data-dependent matches; a deterministic build (no atomic form) asks them as for any
# program.
SCATTER_PER_KERNEL = ("the program scatters (tc.scatter_add) and the build is not deterministic: its stages are "
                      "planned per kernel (atomics, scatter_atomic, against the masked sum)")

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
class GroupPlan:
    """The graph-level planning of a program: the rewrites that claimed its kernels, their
    points, and the per-kernel plans of the same kernels they were weighed against."""

    kernels: tuple[str, ...]                         # the kernels the rewrites replace
    ranked: list[Candidate]                          # valid graph points, best (ranked_seconds) first
    rejected: list[Candidate]
    declined: list[tuple[str, str]]                  # (graph strategy, guard's reason)
    per_kernel_seconds: float                        # Σ of the best per-kernel points of `kernels`
    chosen: Candidate | None = None                  # the rewrite realized; None: the per-kernel plans were
    evaluated: int = 0

    @property
    def best(self) -> Candidate | None:
        return next((c for c in self.ranked if c.cost.ok), None)


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
    group: GroupPlan | None = None                   # the graph-level alternative (None: no rewrite applies)
    program: Program | None = None
    # a plan in regions (`plan` of `region` steps): the parts' scheduled modules composed, which
    # build compiles as it is (schedule is None then)
    composed: Any = None
    composed_seconds: float = 0.0                    # the predicted time of the parts' plans
    parts: list["PlanResult"] = field(default_factory=list)  # a plan in regions: each part's planning, in order

    @property
    def predicted_seconds(self) -> float:
        if self.composed is not None:
            return self.composed_seconds
        if self.group is not None and self.group.chosen is not None:
            return self.group.chosen.cost.total
        return sum(k.chosen.cost.total for k in self.kernels)


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


def graph_candidates_for(program: Program, params: CostParameters = DEFAULT_PARAMETERS,
                         only: Sequence[str] | None = None
                         ) -> tuple[list[Candidate], list[tuple[str, str]], tuple[str, ...]]:
    """Every (graph strategy, point) for the program with its cost, the strategies that declined,
    and the kernels the takers claim."""
    out: list[Candidate] = []
    declined: list[tuple[str, str]] = []
    claimed: set[str] = set()
    for s in graph_strategies():
        if only is not None and s.name not in only:
            continue
        why = SCATTER_PER_KERNEL if program.scatters and not program.target.deterministic else s.guard(program)
        if why is not None:
            declined.append((s.name, why))
            continue
        claimed.update(s.stages(program))
        for point in s.space(program):
            w = s.workload(program, point)
            out.append(Candidate(s, dict(point), w, predict(w, program.target, params)))
    order = [k for k in program.kernels if k in claimed]
    return out, declined, tuple(order)


def _rank_key(c: Candidate) -> tuple[float, float, int, int]:
    # equal totals (one shared bound, e.g. L2, binds both): the shorter SM-level chain (the
    # pipeline's own stall, which the bound hides in the model but not on the GPU) goes first
    return (c.ranked_seconds, c.cost.terms.get("chain", 0.0), -c.strategy.priority, c.workload.threads)


def _graph_rank_key(c: Candidate) -> tuple[float, int, float, int]:
    # equal totals of two rewrite points (decoding: every form of the online contraction reads
    # the same K/V bytes, DRAM-bound alike): the strategy measured faster where the forms do
    # differ goes first (its priority: wgmma over mma.sync over the SIMT lanes), then the chain
    return (c.ranked_seconds, -c.strategy.priority, c.cost.terms.get("chain", 0.0), c.workload.threads)


def plan_program(args: Sequence[Tensor] | Program, target: Target | str | None = None, *,
                 sizes: Mapping[str, int] | None = None, name: str | None = None,
                 params: CostParameters = DEFAULT_PARAMETERS, only: Sequence[str] | None = None,
                 keep: int = 8, compile_check: CompileCheck | None = None, weigh: bool = True,
                 regions: bool = True) -> PlanResult:
    """Plan the program `args` (tensors, or a Program lowered already) for `target` (see the
    module docstring).

    compile_check: called as `compile_check(schedule, kernel, arch)` on a point of a strategy
    that is `compile_checked` before the planner takes it (kernel None for a graph rewrite: all
    its kernels); a ScheduleError passes over the point (build gives pipeline.refuse_spills:
    compiled with NVRTC, a point that spills is refused).

    sizes: values of symbolic dimensions to plan for (others are assumed, see analysis.DEFAULT_SIZE).
    only: restrict to these strategies, per-kernel or graph-level (naive is always added as the
    per-kernel fallback).
    weigh: False realizes the best graph-level point that the primitives take whatever the
    per-kernel plans are predicted at (what `plan_strategy` asks).
    regions: when no graph point takes the whole program, plan the parts the graph strategies
    recognise as regions (step 6 of the module docstring; region_search.py)."""
    if isinstance(args, Program):
        program = args if target is None else args.with_target(resolve_target(target))
    else:
        program = Program.of(args, name=name, target=target, sizes=sizes)
    token = ACTIVE.set(Rankings()) if ACTIVE.get() is None else None  # this planning's own, else the caller's
    try:
        result = _plan(program, params, only, keep, compile_check, weigh, regions, graph_only=False)
    finally:
        if token is not None:
            ACTIVE.reset(token)
    assert result is not None
    return result


def _plan(program: Program, params: CostParameters, only: Sequence[str] | None, keep: int,
          compile_check: CompileCheck | None, weigh: bool, regions: bool, graph_only: bool) -> PlanResult | None:
    """plan_program of a Program; with `graph_only`, None unless a graph point takes it."""
    return _plan_later(program, params, only, keep, compile_check, weigh, regions, graph_only)()


def _plan_later(program: Program, params: CostParameters, only: Sequence[str] | None, keep: int,
                compile_check: CompileCheck | None, weigh: bool, regions: bool, graph_only: bool
                ) -> Callable[[], PlanResult | None]:
    """`_plan` in two steps: planned now, and a function that returns the PlanResult once the
    per-kernel realization's compile checks settled (realize_later: left in flight within
    realize.deferring, the parts of a program planned in regions)."""
    tgt = program.target
    start = time.perf_counter()
    only_list = None if only is None else list(only) + ["naive"]
    memo = ACTIVE.get()
    program_key = group_key(program, params, only_list, compile_check, weigh) if memo is not None else None
    known = memo.groups.get(program_key) if memo is not None else None
    if graph_only and known is not None and known.chosen is None:
        return lambda: None   # a twin of a program no graph point took
    kernel_plans: list[KernelPlan] = []
    rankings: list[Ranking] = []
    contexts: list[tuple[Any, ...]] = []   # per kernel: where its realized point holds (context_key)
    here: set[int] = set()                  # the rankings of this program's kernels so far
    copied: list[tuple[KernelPlan, Ranking, tuple[Any, ...]]] = []   # kernels given their twin's refusals
    for kernel in program.kernels:
        info = program.info(kernel)
        key = ranking_key(program, kernel, params, only_list)
        ranking = memo.get(key) if memo is not None else None
        context = context_key(program, kernel, compile_check)
        twin_of_earlier = ranking is not None and id(ranking) not in here
        if ranking is not None:   # the same loops and accesses: the same ranking
            # the first of its structure in this program has the points before the one realized
            # for its twin as that twin's realization left them (refused, not tried), as its own
            # would; a later one in this program clears them (it tries its twin's point first)
            _, failed = ranking.chosen.get(context, (0, ())) if twin_of_earlier else (0, ())
            valid = [replace(c, failed=failed[n] if n < len(failed) else None) for n, c in enumerate(ranking.ranked)]
        else:
            cands, declined = candidates_for(info, tgt, params, only_list)
            valid = sorted((c for c in cands if c.cost.ok), key=_rank_key)
            rejected = [c for c in cands if not c.cost.ok]
            if not valid:
                # every point breaks a hard constraint (a body so large that even one thread per
                # output is estimated past 255 registers): the naive schedule still builds, and
                # ptxas spills what does not fit
                valid = sorted((c for c in rejected if c.strategy.uses_default_schedule), key=_rank_key)[:1]
            ranking = Ranking(valid, rejected, declined, len(cands))
            if memo is not None:
                memo.put(key, ranking)
        here.add(id(ranking))
        rankings.append(ranking)
        contexts.append(context)
        kernel_plans.append(KernelPlan(kernel, info, valid[0], valid, ranking.rejected, ranking.declined,
                                       ranking.evaluated))
        if twin_of_earlier:
            copied.append((kernel_plans[-1], ranking, context))
    group = _plan_group(program, kernel_plans, params, only_list, known)
    search = time.perf_counter() - start

    start = time.perf_counter()
    schedule = None
    if group is not None and (known is None or known.chosen is not None):  # (a twin of a refusal is refused)
        schedule = _realize_group(program, group, compile_check, weigh, known.chosen if known is not None else None)
    if memo is not None and known is None:
        memo.groups[program_key] = _group_ranking(program, group)
    if schedule is None and graph_only:
        return lambda: None
    if schedule is None and regions and only is None:
        found = _in_regions(program, params, compile_check)
        if found is not None:
            composed, parts = found
            seconds = sum(p.predicted_seconds for p in parts)
            result = PlanResult(composed.plan, tgt, kernel_plans, search, time.perf_counter() - start,
                                dict(program.sizes), None, group, program, composed.module, seconds, parts)
            return lambda: result
    realized = (realize_later(program, kernel_plans, compile_check, list(zip(rankings, contexts)))
                if schedule is None else lambda: schedule)
    realize_seconds = time.perf_counter() - start

    def settled() -> PlanResult:
        began = time.perf_counter()
        final = realized()
        for kp, ranking, context in copied:
            # the twin's refusals as its realization settled them (it may have settled after
            # this program was ranked: realize.deferring)
            _, failed = ranking.chosen.get(context, (0, ()))
            for c, mark in zip(kp.ranked, failed):
                if c.failed is None and mark is not None:
                    c.failed = mark
        for kp in kernel_plans:
            kp.ranked = _keep(kp.ranked, keep)
        if group is not None:
            group.ranked = _keep(group.ranked, keep)
        plan = _plan_of(program, final, kernel_plans, group)
        return PlanResult(plan, tgt, kernel_plans, search, realize_seconds + time.perf_counter() - began,
                          dict(program.sizes), final, group, program)
    return settled


def _in_regions(program: Program, params: CostParameters, compile_check: CompileCheck | None
                ) -> tuple[Any, list[PlanResult]] | None:
    """The program planned in regions (region_search.py) and the planning of its parts, or
    None: each part that a graph strategy may take is planned by `_plan` itself (its graph points
    weighed against its own per-kernel plans, as for a whole program), and the rest in parts
    between them, each planned by `_plan` too. No part plans in regions again."""
    from . import region_search

    taken: dict[int, PlanResult] = {}     # id(module) -> the part's planning

    def part_program(part: list[Tensor], name: str | None) -> Program:
        # a part whose tensors carry none of a size its computes use (a scalar summed over R)
        # cannot be a program of its own: ShapeError, which declines the region (graph_level) or
        # planning in regions at all (per_kernel)
        return Program.of(part, name=name, target=program.target, sizes=program.sizes,
                          compile_arch=program.compile_arch)

    twins = _Twins(taken) if knobs.part_twins() else None

    def graph_level(part: list[Tensor]) -> tuple[Plan, Any] | None:
        known = twins.seen(part, program.name, True) if twins is not None else None
        if known is not None and known.earlier is not None:
            if known.earlier() is None:
                return None   # no graph point took the earlier part
            renamed = known.renamed()
            if renamed is not None:
                return renamed
        try:
            part_prog = part_program(part, program.name)
        except ShapeError:
            return None
        found = _plan(part_prog, params, None, 8, compile_check, True, False, graph_only=True)
        if known is not None:
            known.planned(lambda: found)
        if found is None:
            return None
        taken[id(found.schedule.mod)] = found
        return found.plan, found.schedule.mod

    def per_kernel(part: list[Tensor], number: int) -> Callable[[], tuple[Plan, Any]]:
        name = f"{program.name or 'program'}_part{number}"
        known = twins.seen(part, name, False) if twins is not None else None
        if known is not None and known.earlier is not None:
            return known.renamed_later(lambda: per_kernel_planned(part, name, None))
        return per_kernel_planned(part, name, known)

    def per_kernel_planned(part: list[Tensor], name: str, known: "_Twin | None") -> Callable[[], tuple[Plan, Any]]:
        later = _plan_later(part_program(part, name), params, None, 8, compile_check, True, False, graph_only=False)

        @functools.cache
        def result() -> PlanResult:   # (once: the part's settle and its later twins' ask for it)
            found = later()
            assert found is not None
            return found

        def settled() -> tuple[Plan, Any]:
            found = result()
            taken[id(found.schedule.mod)] = found
            return found.plan, found.schedule.mod
        if known is not None:
            known.planned(result)
        return settled

    try:
        # each part's compile checks compile while the next parts are planned (realize.deferring)
        with deferring():
            composed = region_search.propose(program.args, graph_level, per_kernel, program.module.name,
                                             DEFAULT_THREADS, program.inlining())
    except ShapeError:
        return None
    if composed is None:
        return None
    return composed, [taken[id(m)] for m in composed.parts if id(m) in taken]


class _Twins:
    """The parts of a program planned in regions, by structure (part_twins.py): a part of an
    earlier part's structure is given that part's plan and module renamed. `taken`: id(module)
    -> the part's planning, where a renamed part's goes too."""

    def __init__(self, taken: dict[int, PlanResult]) -> None:
        self.taken = taken
        self.firsts: dict[str, tuple[list[str], Callable[[], PlanResult | None]]] = {}

    def seen(self, part: list[Tensor], name: str | None, graph_only: bool) -> "_Twin | None":
        """The part's twin record: `earlier` set when a part of its structure was planned the
        same way (`graph_only`: a region's graph points alone, else a part between regions);
        None when its structure cannot be described (planned as always)."""
        try:
            key, names = signature(part, name)
        except UnknownNode:
            return None
        key = f"{'graph' if graph_only else 'part'}\n{key}"
        return _Twin(self, key, names, self.firsts.get(key))


class _Twin:
    """One part as `_Twins` saw it: its structure's key and names, and the earlier part of that
    structure (`earlier`: its planning, once settled; None for the first)."""

    def __init__(self, twins: _Twins, key: str, names: list[str],
                 first: tuple[list[str], Callable[[], PlanResult | None]] | None) -> None:
        self.twins, self.key, self.names = twins, key, names
        self.earlier = first[1] if first is not None else None
        self.earlier_names = first[0] if first is not None else []

    def planned(self, result: Callable[[], PlanResult | None]) -> None:
        """This part was planned (the first of its structure): `result` gives its planning."""
        self.twins.firsts.setdefault(self.key, (self.names, result))

    def renamed(self) -> tuple[Plan, Any] | None:
        """The earlier part's plan and module with its names replaced by this part's, or None when
        the renaming is not one to one or meets a node it does not know."""
        assert self.earlier is not None
        first = self.earlier()
        assert first is not None and first.schedule is not None
        try:
            renaming = PartRenaming(self.earlier_names, self.names)
            plan = renaming.plan(first.plan)
            module = renaming.module(first.schedule.mod)
        except (NameClash, UnknownNode):
            return None
        group = first.group
        if group is not None:
            group = replace(group, kernels=tuple(renaming.kernel(k) for k in group.kernels))
        self.twins.taken[id(module)] = replace(
            first, plan=plan, kernels=[replace(kp, kernel=renaming.kernel(kp.kernel)) for kp in first.kernels],
            group=group, schedule=None, program=None, search_seconds=0.0, realize_seconds=0.0)
        return plan, module

    def renamed_later(self, plan_itself: Callable[[], Callable[[], tuple[Plan, Any]]]
                      ) -> Callable[[], tuple[Plan, Any]]:
        """`renamed` once the earlier part settled (a per-kernel part: realize.deferring); the
        part planned itself (`plan_itself`) when the renaming refuses."""
        def settled() -> tuple[Plan, Any]:
            found = self.renamed()
            return found if found is not None else plan_itself()()
        return settled


def _group_ranking(program: Program, group: GroupPlan | None) -> GroupRanking:
    """What Rankings.groups keeps of a program's graph-level planning (`group`: None when no
    graph strategy was asked) for the programs of its structure."""
    if group is None:
        return GroupRanking([], [], [], (), 0, absent=True, chosen=None)
    return GroupRanking(group.ranked, group.rejected, group.declined,
                        tuple(program.kernels.index(k) for k in group.kernels), group.evaluated, absent=False,
                        chosen=None if group.chosen is None else group.ranked.index(group.chosen))


def _plan_group(program: Program, kernel_plans: list[KernelPlan], params: CostParameters,
                only: Sequence[str] | None, known: "GroupRanking | None" = None) -> GroupPlan | None:
    """The graph-level alternative: the graph strategies' points, ranked, against the per-kernel
    plans of the kernels they claim (None when no graph strategy was asked). `known`: the
    ranking of a program of the same structure (Rankings.groups)."""
    if known is not None:
        if known.absent:
            return None
        claimed = tuple(program.kernels[n] for n in known.claimed)   # this program's names of those kernels
        per_kernel = sum(kp.chosen.cost.total for kp in kernel_plans if kp.kernel in claimed)
        # the points before the one realized (all of them when none was) as the first left them:
        # refused, or passed over for their predicted time
        last = len(known.ranked) if known.chosen is None else known.chosen
        ranked = [replace(c, failed=c.failed if n < last else None) for n, c in enumerate(known.ranked)]
        return GroupPlan(claimed, ranked, known.rejected, known.declined, per_kernel, None, known.evaluated)
    cands, declined, claimed = graph_candidates_for(program, params, only)
    if not cands and not declined:
        return None
    per_kernel = sum(kp.chosen.cost.total for kp in kernel_plans if kp.kernel in claimed)
    valid = _strategies_order(program, sorted((c for c in cands if c.cost.ok), key=_graph_rank_key))
    rejected = [c for c in cands if not c.cost.ok]
    return GroupPlan(claimed, valid, rejected, declined, per_kernel, None, len(cands))


def _strategies_order(program: Program, ranked: list[Candidate]) -> list[Candidate]:
    """The ranking with each graph strategy's candidates in its own order (GraphStrategy.order),
    in the places its candidates held."""
    out = list(ranked)
    for strategy in {id(c.strategy): c.strategy for c in ranked}.values():
        assert isinstance(strategy, GraphStrategy)
        places = [i for i, c in enumerate(out) if c.strategy is strategy]
        for i, c in zip(places, strategy.order(program, [out[i] for i in places])):
            out[i] = c
    return out


def _realize_group(program: Program, group: GroupPlan, compile_check: CompileCheck | None,
                   weigh: bool = True, twin: int | None = None) -> Any:
    """Realize the best graph point predicted cheaper than the per-kernel plans it replaces (any
    graph point without `weigh`), and return its Schedule; None when there is none (or every
    such point was refused). `twin`: the position of the point realized for a program of the
    same structure, tried first and not compiled again (as `realize` does for a kernel)."""
    from .schedule import Schedule

    order = group.ranked if twin is None else group.ranked[twin:] + group.ranked[:twin]
    checked = order[0] if twin is not None else None
    for cand in order:
        if weigh and cand.ranked_seconds > group.per_kernel_seconds * (1.0 + GRAPH_TIE):
            continue   # (a strategy's own order may put a cheaper point after it)
        sch = Schedule(program.args, name=program.name, lowered=program.module)
        try:
            cand.strategy.apply(sch, program, cand.point)  # type: ignore[arg-type]
            if cand.strategy.compile_checked and compile_check is not None and cand is not checked:
                cand.resources = compile_check(sch, None, program.compile_arch)
        except ScheduleError as exc:
            cand.failed = str(exc).splitlines()[0]
            continue
        group.chosen = cand
        return sch
    return None


def plan_strategy(args: Sequence[Tensor] | Program, strategy: str, target: Target | str | None = None, *,
                  sizes: Mapping[str, int] | None = None, name: str | None = None,
                  compile_check: CompileCheck | None = None) -> PlanResult | None:
    """The plan of the graph-level strategy `strategy` alone: its points ranked by the cost model,
    the best that the primitives (and `compile_check`) take, whatever the other plans of the
    program are predicted at; None when its guard declines or every point is refused. What tests
    and benchmarks ask of one rewrite (`build(plan=result.plan)` builds it)."""
    result = plan_program(args, target, sizes=sizes, name=name, only=[strategy], compile_check=compile_check,
                          weigh=False)
    chosen = result.group.chosen if result.group is not None else None
    return result if chosen is not None and chosen.strategy.name == strategy else None


def _keep(ranked: list[Candidate], keep: int) -> list[Candidate]:
    """The candidates explain shows: the chosen, the next `keep`, the best of every strategy,
    and those the primitives refused."""
    ok = [c for c in ranked if c.failed is None]
    out = ok[:keep]
    for c in ok[keep:]:
        if all(o.strategy.name != c.strategy.name for o in out):
            out.append(c)
    return out + [c for c in ranked if c.failed is not None]




def _plan_of(program: Program, schedule: Any, kernel_plans: list[KernelPlan], group: GroupPlan | None) -> Plan:
    """The Plan of the realized schedule, with its strategy name and the reason for the choice."""
    steps = list(schedule.plan.steps)
    if group is not None and group.chosen is not None:
        chosen = group.chosen
        assert isinstance(chosen.strategy, GraphStrategy)
        return Plan(tuple(steps), chosen.strategy.plan_name, _group_reason(program, group, kernel_plans))
    naive = [kp for kp in kernel_plans if kp.chosen.strategy.uses_default_schedule]
    if naive:
        threads = int(naive[0].chosen.point.get("threads", DEFAULT_THREADS))
        steps.append(Step("default_schedule", {"threads": threads}))
    names = sorted({kp.chosen.strategy.name for kp in kernel_plans})
    reason = _reason(kernel_plans, program.target)
    if group is not None:
        reason += "; " + _graph_lost(group)
    return Plan(tuple(steps), "+".join(names), reason)


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


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def _per_kernel_words(group: GroupPlan, kernel_plans: list[KernelPlan]) -> str:
    picks = ", ".join(f"{kp.kernel} {kp.chosen.strategy.name} {_us(kp.chosen.cost.total)}"
                      for kp in kernel_plans if kp.kernel in group.kernels)
    return f"{_us(group.per_kernel_seconds)} for the per-kernel plans of {len(group.kernels)} kernel(s) ({picks})"


def _group_reason(program: Program, group: GroupPlan, kernel_plans: list[KernelPlan]) -> str:
    """The reason of a graph-level choice: the rewrite's own words, then how it was chosen."""
    chosen = group.chosen
    assert chosen is not None and isinstance(chosen.strategy, GraphStrategy)
    strategy = chosen.strategy
    words = strategy.reason(program, chosen.point, chosen.resources)
    margin = f" (ranked at {_us(chosen.ranked_seconds)}: margin {strategy.margin:g})" if strategy.margin != 1.0 else ""
    words += (f"; graph-level {chosen.label}: predicted {_us(chosen.cost.total)} ({chosen.cost.bound}-bound){margin}, "
              f"best of {sum(1 for c in group.ranked if c.failed is None)} valid / {group.evaluated} evaluated on "
              f"{program.target.arch}, against {_per_kernel_words(group, kernel_plans)}")
    others = [c for c in group.ranked if c.strategy.name != strategy.name and c.failed is None]
    if others:
        words += f"; best {others[0].strategy.name}: {_us(others[0].cost.total)}"
    refused = [c for c in group.ranked if c.failed is not None]
    if refused:
        words += "; passed over: " + "; ".join(f"{c.label}: {c.failed}" for c in refused)
    return words


def _graph_lost(group: GroupPlan) -> str:
    """Why no graph-level rewrite was taken, for the reason of a per-kernel plan."""
    best = group.best
    refused = [c for c in group.ranked if c.failed is not None]
    if best is None and not refused:
        return "no graph-level strategy applies" if not group.ranked else "every graph-level point breaks a constraint"
    words = []
    if best is not None and best.ranked_seconds > group.per_kernel_seconds * (1.0 + GRAPH_TIE):
        words.append(f"graph-level {best.label} predicted {_us(best.cost.total)}, not below the per-kernel "
                     f"plans' {_us(group.per_kernel_seconds)} (nor within {100 * GRAPH_TIE:.0f}%)")
    if refused:
        words.append("graph-level points refused: " + "; ".join(f"{c.label}: {c.failed}" for c in refused))
    return "; ".join(words)


__all__ = ["FAILURES_PER_STRATEGY", "GRAPH_TIE", "SCATTER_PER_KERNEL", "Candidate", "GroupPlan", "KernelPlan",
           "PlanResult", "Rankings", "candidates_for", "graph_candidates_for", "shared_rankings",
           "plan_program", "plan_strategy", "resolve_target"]
