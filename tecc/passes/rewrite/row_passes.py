"""The passes over a row group's row, shared by the rewrites that build its kernels (fuse_rows.py:
one kernel per row, split_row_group.py: a long row split over blocks).

A pass is one walk over the row's columns: one per Reduce of a reduction stage (the Reduce's
source at column `col`), one per elementwise output (its value at `col`), in program order
(`row_passes`). In the kernel every reduction stage's row value lives in one register of every
thread (`RowInliner` reads it there), set from the all-reduced accumulators of its Reduces once
they are known (`finish_reduction`), and stored by one thread where the stage is an output.
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Reduce, TensorRead, Var, substitute, walk
from ...ir.stmt import Buffer, BufferStore, IfThenElse, Stmt
from ...ir.tensor import ComputeOp, Tensor
from ...ir.visitor import ExprMutator
from ..lower import Inliner, same_shape
from .row_group import RowGroup


class RowInliner(Inliner):
    """Inlines elementwise producers; a read of a reduction stage of the group at the row being
    computed becomes the thread's register holding that row's value."""

    def __init__(self, base: Inliner, values: dict[Tensor, Buffer], row: tuple[Expr, ...]) -> None:
        super().__init__(base.inlined, base.buffers)
        self.values = values
        self.row = row

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        if e.tensor in self.values:
            idx = tuple(self.visit(i) for i in e.indices)
            if not same_shape(idx, self.row):
                raise ScheduleError(
                    f"fuse_rows: {e.tensor.name} is read at [{', '.join(str(i) for i in idx)}], not at the row "
                    "being computed; such a graph does not keep its row on chip")
            return self.values[e.tensor][Const(0, dt.int32)]
        return super().visit_TensorRead(e)


Pass = tuple[Tensor, Expr, "Reduce | None"]


def row_passes(group: RowGroup, inliner: ExprMutator, row_idx: tuple[Expr, ...], col: Expr) -> list[Pass]:
    """The per-column expression of every pass over the row `row_idx`, in program order: one per
    Reduce of a reduction stage (its source at column `col`, with that Reduce), one per
    elementwise output (its value at `col`, None). `inliner` (a RowInliner) turns reads of the
    group's reduction stages into the registers that hold their row values. Row values and
    column reductions have no pass of their own (fuse_rows computes them)."""
    passes: list[Pass] = []
    for t in group.stages:
        op = t.op
        assert isinstance(op, ComputeOp)
        if t in group.reductions:
            body = substitute(op.body, dict(zip(op.axes, row_idx)))
            seen: set[int] = set()
            for r in [n for n in walk(body) if isinstance(n, Reduce)]:
                if id(r) not in seen:
                    seen.add(id(r))
                    passes.append((t, inliner.visit(substitute(r.source, {r.axes[0]: col})), r))
        elif t in group.elementwise:
            body = substitute(op.body, dict(zip(op.axes, row_idx + (col,))))
            passes.append((t, inliner.visit(body), None))
    return passes


def finish_reduction(t: Tensor, row_idx: tuple[Expr, ...], accs: dict[int, Expr], inliner: ExprMutator,
                      val: Buffer, buffers: dict[Tensor, Buffer], tx: Var, writer: Expr | None = None) -> list[Stmt]:
    """The row value of reduction stage `t` from its all-reduced accumulators, and its store
    (by thread 0, or where `writer` holds) when the stage is an output."""
    op = t.op
    assert isinstance(op, ComputeOp)
    body = substitute(op.body, dict(zip(op.axes, row_idx)))

    class _Finish(ExprMutator):
        def visit_Reduce(self, r: Reduce) -> Expr:  # noqa: N805
            return accs[id(r)]

    zero = Const(0, dt.int32)
    out: list[Stmt] = [BufferStore(val, (zero,), inliner.visit(_Finish().visit(body)))]
    if t in buffers:  # an output: thread 0 of the block writes the row's value
        out.append(IfThenElse(tx == 0 if writer is None else writer, BufferStore(buffers[t], row_idx, val[zero])))
    return out


__all__ = ["Pass", "RowInliner", "finish_reduction", "row_passes"]
