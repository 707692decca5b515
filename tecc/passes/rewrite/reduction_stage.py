"""The reduction stage a split rewrite takes (split_rows, split_reduce): after elementwise
producers are inlined, the program is ONE compute stage holding ONE Reduce over axes that start
at 0, with no reduction inside it. Each rewrite adds its own conditions on top (split_reduce:
one axis and an output of rank >= 1; split_rows: extents free of the output's axes)."""

from __future__ import annotations

from typing import Sequence

from ...ir.errors import ScheduleError
from ...ir.expr import Reduce, const_int, walk
from ...ir.tensor import ComputeOp, Tensor
from ..lower import choose_inlined, collect_program


def reduction_stage(args: Sequence[Tensor], rewrite: str) -> tuple[Tensor, Reduce]:
    """The one reduction stage of the program `args` and its Reduce, or a ScheduleError that
    names `rewrite` and the condition that fails."""
    prog = choose_inlined(collect_program(args))
    if len(prog.stages) != 1:
        raise ScheduleError(f"{rewrite}: the program has {len(prog.stages)} stages after inlining; one is needed")
    (t,) = prog.stages
    op = t.op
    assert isinstance(op, ComputeOp)
    reduces = {id(n): n for n in walk(op.body) if isinstance(n, Reduce)}
    if len(reduces) != 1:
        raise ScheduleError(f"{rewrite}: {t.name} has {len(reduces)} reductions; one is needed")
    (r,) = reduces.values()
    if any(const_int(ax.lo) != 0 for ax in r.axes):
        raise ScheduleError(f"{rewrite}: {t.name} reduces over an axis that does not start at 0")
    if any(isinstance(n, Reduce) for n in walk(r.source) if n is not r):
        raise ScheduleError(f"{rewrite}: {t.name} has a reduction inside a reduction")
    return t, r


__all__ = ["reduction_stage"]
