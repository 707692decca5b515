"""What the tests ask of one graph-level strategy: its plan for a program alone (the planner's
`plan_strategy`: the strategy's points ranked by the cost model, the best that the primitives and
the build's compile check take), whatever the planner would weigh it against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tecc.compiler.pipeline import refuse_spills
from tecc.compiler.plan import Plan
from tecc.compiler.planner import PlanResult, plan_strategy


@dataclass
class Choice:
    """A strategy's plan for a program, and the planning behind it."""

    plan: Plan
    result: PlanResult

    @property
    def reason(self) -> str:
        return self.plan.reason

    @property
    def args(self) -> dict[str, Any]:
        return dict(self.plan.steps[0].args)


def choose(args: Sequence[Any], strategy: str, target: Any = None, *, sizes: Mapping[str, int] | None = None,
           name: str | None = None, check: bool = True) -> Choice | None:
    """`strategy`'s plan for the program `args` on `target`, or None when its guard declines or no
    point realizes (`check`: with the build's compile check, NVRTC's spill and wgmma checks)."""
    result = plan_strategy(list(args), strategy, target, sizes=sizes, name=name,
                           compile_check=refuse_spills if check else None)
    return None if result is None else Choice(result.plan, result)


def propose_wgmma(args: Sequence[Any], target: Any = None, name: str | None = None) -> Choice | None:
    return choose(args, "online_contraction_wgmma", target, name=name)


def propose_mma(args: Sequence[Any], target: Any = None, name: str | None = None) -> Choice | None:
    return choose(args, "online_contraction_mma", target, name=name)


def propose_simt(args: Sequence[Any], target: Any = None) -> Choice | None:
    return choose(args, "online_contraction", target)
