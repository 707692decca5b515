"""The tuner's step 1 (docs/tuning.md): the whole-program plans worth measuring.

The planner ranks each kernel's (strategy, point) pairs by predicted time; a whole-program
candidate picks one point per kernel. The first candidate is the planner's own plan (every
kernel at its best); the others change one kernel to one of its next `top_k` points and leave
the rest at their best. Each is realized on a `Schedule` (the primitives may refuse a point: it
is dropped), duplicates are merged, and the `top_k` with the least predicted time are kept.
When the planner took a graph-level rewrite (attention's online contraction, row fusion, a split
reduction), the candidates are its plan and the rewrite's next-ranked points instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

from ...ir.errors import ScheduleError, TeccError
from ...ir.tensor import Tensor
from ..plan import Plan, Step
from ..pipeline import refuse_spills
from ..planner import Candidate, PlanResult, plan_program

DEFAULT_TOP_K = 8


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
    first (see the module docstring). The first is always the planner's own plan."""
    if top_k < 1:
        raise TeccError(f"top_k must be at least 1, got {top_k}")
    result = plan_program(list(args), arch, sizes=sizes, name=name, keep=top_k, compile_check=refuse_spills)
    if result.group is not None and result.group.chosen is not None:
        return result, _rewrite_candidates(result, top_k)
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


def _rewrite_candidates(result: PlanResult, top_k: int) -> list[TuneCandidate]:
    """The planner's plan (a graph-level rewrite) and the rewrite strategies' next points, each
    realized on a Schedule of the lowered program (a point the primitives refuse is dropped)."""
    from ..schedule import Schedule

    group, program = result.group, result.program
    assert group is not None and group.chosen is not None and program is not None
    out = [TuneCandidate(result.plan, group.chosen.label, group.chosen.cost.total * 1e6)]
    for cand in group.ranked:
        if len(out) >= top_k:
            break
        if cand is group.chosen or cand.failed is not None:
            continue
        sch = Schedule(program.args, name=program.name, lowered=program.module)
        try:
            cand.strategy.apply(sch, program, cand.point)  # type: ignore[arg-type]
        except ScheduleError:
            continue
        plan = Plan(tuple(sch.plan.steps), cand.strategy.plan_name, cand.label)  # type: ignore[union-attr]
        out.append(TuneCandidate(plan, cand.label, cand.cost.total * 1e6))
    return out


def _realize(args: Sequence[Tensor], name: str | None, result: PlanResult, picks: Sequence[Candidate]) -> Plan | None:
    """The plan of one pick per kernel, applied in kernel order on one Schedule (as the planner
    realizes its own choice); None when a primitive refuses a pick."""
    from ...passes.default_schedule import DEFAULT_THREADS
    from ..schedule import Schedule

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
