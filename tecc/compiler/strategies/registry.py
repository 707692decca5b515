"""The strategy registry: which schedule templates exist, what each can serve, and its space.

A **strategy** is a schedule template for one kernel (one stage of the lowered module):

  guard(info, target)            None when it can serve the kernel, else the reason it cannot
  space(info, target)            the points of its parameter space (dicts of JSON values)
  workload(info, point, target)  what the point makes the GPU do, for the cost model
  apply(sch, info, point)        the schedule primitives that realize the point on a Schedule
                                 (recorded there as Plan steps)

A **graph strategy** is a rewrite of a group of stages of the lowered module into kernels of its
own (row fusion, split reductions, the online contraction): the same four declarations over the
whole `Program` (tecc.compiler.program: the tensors, lowered once, and the Target) instead of one
kernel's facts, plus the kernels it replaces (`stages`) and the plan's reason:

  guard(program)                 None when the rewrite applies to the program, else why not
  stages(program)                the kernels of the lowered module it replaces
  space(program)                 its points
  workload(program, point)       what the point makes the GPU do (a second kernel as `then`)
  order(program, ranked)         its points' order where the model does not separate them
  apply(sch, program, point)     the rewrite's plan step on a Schedule
  reason(program, point, ...)    what the rewrite does at this point, for the plan

The registry only lists strategies and their declarations; choosing among them is the
planner's job (tecc.compiler.planner), by predicted time (tecc.compiler.cost): a graph strategy's
points are priced against the per-kernel plans of the stages it claims, and the cheaper is
realized. Strategies import nothing above them: what they plan for arrives as arguments (the
Target, the Program). Adding a strategy is one file in this package that calls `register(...)` at
import: `load_all()` imports every module of the package.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Union

from ...ir.target import Target
from ..cost.analysis import KernelInfo
from ..cost.model import Workload

if TYPE_CHECKING:
    from ...codegen import KernelResources
    from ..program import Program

Point = dict[str, Any]


class Strategy:
    """Base of strategies; subclasses set `name`, `description` and override the four methods.

    `uses_default_schedule` marks the naive fallback, realized by the "default_schedule" step
    rather than by primitives. `priority` only breaks ties between equal predictions.
    `compile_checked`: the planner hands the chosen point to its compile check before taking it
    (build's: compiled with NVRTC, a point that spills is passed over; ptxas's register
    allocation is what the register estimate can only approximate; compiling is cheap, and the
    compile cache keeps it for the build)."""

    name: str = ""
    description: str = ""
    uses_default_schedule: bool = False
    priority: int = 0
    compile_checked: bool = False

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        return [{}]

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        raise NotImplementedError

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        raise NotImplementedError

    def describe(self, point: Point) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in point.items())
        return f"{self.name}({inner})"

    def __repr__(self) -> str:
        return f"<Strategy {self.name}>"


class GraphStrategy:
    """Base of graph-level strategies (see the module docstring); subclasses set `name`,
    `description` and override guard, space, workload, apply and reason.

    Every graph rewrite of tecc today replaces the whole module (its plan step must come
    first), so `stages` defaults to every kernel of the lowered program and the planner weighs
    the rewrite against the per-kernel plans of all of them.

    `margin`: the planner ranks a point of this strategy at its predicted time divided by the
    margin (1: as predicted). A margin above 1 records a measured bias of the model against the
    rewrite in the regime its guard admits (split_rows: the Little's-law rate of the row kernel it
    replaces is optimistic near the edge); each one cites its measurement where it is set.
    `compile_checked`: the planner compiles the realized point (NVRTC, all kernels of the
    rewritten module) and passes over a point that spills (or serializes its wgmmas), as for the
    per-kernel strategies. `plan_name`: the Plan's strategy name (default: `name`)."""

    name: str = ""
    description: str = ""
    priority: int = 0
    margin: float = 1.0
    compile_checked: bool = False
    uses_default_schedule: bool = False

    @property
    def plan_name(self) -> str:
        return self.name

    def guard(self, program: "Program") -> str | None:
        return None

    def stages(self, program: "Program") -> tuple[str, ...]:
        return tuple(program.kernels)

    def space(self, program: "Program") -> Iterable[Point]:
        return [{}]

    def workload(self, program: "Program", point: Point) -> Workload:
        raise NotImplementedError

    def order(self, program: "Program", ranked: list[Any]) -> list[Any]:
        """This strategy's valid candidates (the planner's: `.point`, `.workload`, `.cost`) in
        the order to try them; they arrive ranked by predicted time, and keep the places in the
        planner's ranking that they held. A strategy that knows better than the model where its
        points are too close to order overrides it (online_backward_mma)."""
        return ranked

    def apply(self, sch: Any, program: "Program", point: Point) -> None:
        raise NotImplementedError

    def reason(self, program: "Program", point: Point,
               resources: "Mapping[str, KernelResources] | None" = None) -> str:
        """What the rewrite does at `point`, for the plan (`resources`: ptxas's report of the
        compile check, when there was one)."""
        return self.describe(point)

    def describe(self, point: Point) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in point.items())
        return f"{self.name}({inner})"

    def __repr__(self) -> str:
        return f"<GraphStrategy {self.name}>"


AnyStrategy = Union[Strategy, GraphStrategy]

_REGISTRY: dict[str, AnyStrategy] = {}


def register(strategy: AnyStrategy) -> AnyStrategy:
    """Add `strategy` (per-kernel or graph-level) to the registry (its name must be new)."""
    if not strategy.name:
        raise ValueError(f"{strategy!r} has no name")
    if strategy.name in _REGISTRY and type(_REGISTRY[strategy.name]) is not type(strategy):
        raise ValueError(f"a strategy named {strategy.name!r} is registered already")
    _REGISTRY[strategy.name] = strategy
    return strategy


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


LOAD_ERRORS: dict[str, str] = {}



class ChosenPointStrategy(GraphStrategy):
    """A graph strategy whose one point its module has chosen already: `choose(program)` returns
    a refusal (a str) or a choice of `choice_type` with `.plan` (its first step's arguments are
    the point) and `.reason`; guard, space and reason read it."""

    choice_type: type = object

    def choose(self, program: "Program") -> Any:
        raise NotImplementedError

    def _chosen(self, program: "Program") -> Any:
        found = self.choose(program)
        assert isinstance(found, self.choice_type), found
        return found

    def guard(self, program: "Program") -> str | None:
        found = self.choose(program)
        return found if isinstance(found, str) else None

    def space(self, program: "Program") -> list[Point]:
        return [dict(self._chosen(program).plan.steps[0].args)]

    def reason(self, program: "Program", point: Point, resources: Any = None) -> str:
        return str(self._chosen(program).reason)


_LOADED: list[bool] = []   # load_all has gone through the package once


def load_all() -> None:
    """Import every strategy module of this package (each registers itself), once per process
    (the planner asks at every kernel; listing the package's files each time cost seconds a
    model). A module that fails to import is skipped and its error kept in LOAD_ERRORS: one
    broken strategy file must not take the planner down (naive always remains)."""
    if _LOADED:
        return
    from . import __name__ as package
    from . import __path__ as here

    for mod in pkgutil.iter_modules(here):
        if mod.name != "registry" and not mod.name.startswith("_"):
            try:
                importlib.import_module(f"{package}.{mod.name}")
            except Exception as exc:  # noqa: BLE001 - reported through LOAD_ERRORS
                LOAD_ERRORS[mod.name] = f"{type(exc).__name__}: {exc}"
    _LOADED.append(True)


def strategies() -> list[Strategy]:
    """Every registered per-kernel strategy, by name."""
    load_all()
    return [s for k in sorted(_REGISTRY) if isinstance(s := _REGISTRY[k], Strategy)]


def graph_strategies() -> list[GraphStrategy]:
    """Every registered graph-level strategy, by name."""
    load_all()
    return [s for k in sorted(_REGISTRY) if isinstance(s := _REGISTRY[k], GraphStrategy)]


def get(name: str) -> AnyStrategy:
    load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no strategy {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


__all__ = ["LOAD_ERRORS", "AnyStrategy", "ChosenPointStrategy", "GraphStrategy", "Point", "Strategy", "get", "graph_strategies", "load_all",
           "register", "strategies", "unregister"]
