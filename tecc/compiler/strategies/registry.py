"""The strategy registry: which schedule templates exist, what each can serve, and its space.

A **strategy** is a schedule template for one kernel (one stage of the lowered module):

  guard(info, target)            None when it can serve the kernel, else the reason it cannot
  space(info, target)            the points of its parameter space (dicts of JSON values)
  workload(info, point, target)  what the point makes the GPU do, for the cost model
  apply(sch, info, point)        the schedule primitives that realize the point on a Schedule
                                 (recorded there as Plan steps)

The registry only lists strategies and their declarations; choosing among them is the
planner's job (tecc.compiler.planner), by predicted time (tecc.compiler.cost). Adding a
strategy is one file in this package that calls `register(...)` at import: `load_all()`
imports every module of the package.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import KernelInfo
from ..cost.model import Workload

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


_REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add `strategy` to the registry (its name must be new)."""
    if not strategy.name:
        raise ValueError(f"{strategy!r} has no name")
    if strategy.name in _REGISTRY and type(_REGISTRY[strategy.name]) is not type(strategy):
        raise ValueError(f"a strategy named {strategy.name!r} is registered already")
    _REGISTRY[strategy.name] = strategy
    return strategy


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


LOAD_ERRORS: dict[str, str] = {}


def load_all() -> None:
    """Import every strategy module of this package (each registers itself). A module that
    fails to import is skipped and its error kept in LOAD_ERRORS: one broken strategy file
    must not take the planner down (naive always remains)."""
    from . import __name__ as package
    from . import __path__ as here

    for mod in pkgutil.iter_modules(here):
        if mod.name != "registry" and not mod.name.startswith("_"):
            try:
                importlib.import_module(f"{package}.{mod.name}")
            except Exception as exc:  # noqa: BLE001 - reported through LOAD_ERRORS
                LOAD_ERRORS[mod.name] = f"{type(exc).__name__}: {exc}"


def strategies() -> list[Strategy]:
    """Every registered strategy, by name."""
    load_all()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def get(name: str) -> Strategy:
    load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no strategy {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


__all__ = ["LOAD_ERRORS", "Point", "Strategy", "get", "load_all", "register", "strategies", "unregister"]
