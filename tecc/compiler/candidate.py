"""One point of a strategy as the planner ranks it (`Candidate`), and the compile check it may be
put through (`CompileCheck`): shared by the planner (planner.py) and the memory of what it ranked
(rankings.py), which imports them from here rather than from the planner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .cost.model import Cost, Workload
from .strategies.registry import AnyStrategy, GraphStrategy, Point

# (scheduled program, kernel name or None for every kernel, arch) -> ptxas's report per kernel
# (or None), or ScheduleError to pass over the point
CompileCheck = Callable[[Any, "str | None", str], "Mapping[str, Any] | None"]


@dataclass
class Candidate:
    """One (strategy, point) with its workload and predicted cost: of one kernel for a per-kernel
    strategy, of the kernels it replaces for a graph strategy."""

    strategy: AnyStrategy
    point: Point
    workload: Workload
    cost: Cost
    failed: str | None = None          # why the schedule primitives (or the compile check) refused it
    resources: Mapping[str, Any] | None = None   # ptxas's report of a compile-checked graph point

    @property
    def label(self) -> str:
        return self.strategy.describe(self.point)

    @property
    def ok(self) -> bool:
        return self.cost.ok and self.failed is None

    @property
    def ranked_seconds(self) -> float:
        """The time the point is ranked at: predicted, over a graph strategy's margin."""
        margin = self.strategy.margin if isinstance(self.strategy, GraphStrategy) else 1.0
        return self.cost.total / margin


__all__ = ["Candidate", "CompileCheck"]
