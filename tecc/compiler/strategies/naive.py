"""naive: the default schedule, one thread per output element (always valid, the fallback).

Realized by the "default_schedule" plan step (tecc.passes.default_schedule): the spatial loops
are fused into one index, split into blocks of `threads` and bound to blockIdx.x / threadIdx.x;
reductions run serially in each thread."""

from __future__ import annotations

from typing import Any, Iterable

from ...ir.target import Target
from ...passes.default_schedule import DEFAULT_THREADS
from ..cost.analysis import KernelInfo
from ..cost.model import Workload
from ._simple import simple_workload
from .registry import Point, Strategy, register


class Naive(Strategy):
    name = "naive"
    description = "one thread per output element, reductions serial per thread (the default schedule)"
    uses_default_schedule = True
    priority = -1

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        return [{"threads": DEFAULT_THREADS}]

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        return simple_workload(info, target, threads=int(point["threads"]), vector=1, unroll=1, fused_index=True)

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        """Nothing: the planner appends Step("default_schedule") for every naive kernel."""


register(Naive())
