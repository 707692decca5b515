"""The passes over a row group's row, shared by the rewrites that build its kernels (fuse_rows.py:
one kernel per row, split_row_group.py: a long row split over blocks).

A pass is one walk over the row's columns: one per Reduce of a reduction stage (the Reduce's
source at column `col`), one per elementwise output (its value at `col`), in program order
(`row_passes`). In the kernel every reduction stage's row value lives in one register of every
thread (`RowInliner` reads it there), set from the all-reduced accumulators of its Reduces once
they are known (`finish_reduction`), and stored by one thread where the stage is an output.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import BufferLoad, Call, Const, Expr, Reduce, TensorRead, Var, free_vars, substitute, walk
from ...ir.stmt import Buffer, BufferStore, IfThenElse, Stmt
from ...ir.tensor import ComputeOp, Tensor
from ...ir.visitor import ExprMutator
from ..lower import Inliner
from .row_algebra import delta_sum
from .row_group import RowGroup, at_the_row


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
            if not at_the_row(idx, self.row):
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


class _AnyBuffer(dict):  # type: ignore[type-arg]
    """A buffer for every tensor asked for (one_hot_sums reads expressions, it builds no kernel)."""

    def __missing__(self, t: Tensor) -> Buffer:
        self[t] = buf = Buffer(t.name, t.dtype, tuple(t.shape))
        return buf


def one_hot_sums(group: RowGroup) -> set[Tensor]:
    """The group's reduction stages whose every Reduce fuse_rows computes in closed form, without a
    walk over the row (row_algebra.delta_sum: a sum over a one-hot row), for the cost model."""
    row = tuple(Var(f"row{i}", dt.int32) for i in range(len(group.rows)))
    col = Var("col", dt.int32)
    closed: dict[Tensor, bool] = {}
    for t, expr, r in row_passes(group, Inliner(group.program.inlined, _AnyBuffer()), row, col):
        if r is not None:
            one_hot = r.combiner == "sum" and delta_sum(expr, col, group.columns, (), r.acc_dtype) is not None
            closed[t] = closed.get(t, True) and one_hot
    return {t for t, yes in closed.items() if yes}


def finish_reduction(t: Tensor, row_idx: tuple[Expr, ...], accs: dict[int, Expr], inliner: ExprMutator,
                      val: Buffer, buffers: dict[Tensor, Buffer], tx: Var, writer: Expr | None = None) -> list[Stmt]:
    """The row value of reduction stage `t` from its all-reduced accumulators, and its store
    (by thread 0, or where `writer` holds) when the stage is an output."""
    op = t.op
    assert isinstance(op, ComputeOp)
    zero = Const(0, dt.int32)
    # a row value kept with trailing size-1 axes (row_group.row_shaped) is at [row.., 0..]
    at = row_idx + (zero,) * (len(op.axes) - len(row_idx))
    body = substitute(op.body, dict(zip(op.axes, at)))

    class _Finish(ExprMutator):
        def visit_Reduce(self, r: Reduce) -> Expr:  # noqa: N805
            return accs[id(r)]

    out: list[Stmt] = [BufferStore(val, (zero,), inliner.visit(_Finish().visit(body)))]
    if t in buffers:  # an output: thread 0 of the block writes the row's value
        out.append(IfThenElse(tx == 0 if writer is None else writer, BufferStore(buffers[t], at, val[zero])))
    return out


# Intrinsics worth a register to compute once: each is a libdevice call of tens of instructions
# (expf: ~10 with the range reduction, sinf/logf more), against one register per column.
EXPENSIVE = ("exp", "log", "sin", "cos", "tanh", "erf", "sigmoid", "exp2", "log2")


def first_pass(passes: Sequence[tuple[Tensor, Expr, Reduce | None]], e: Expr) -> int:
    return next(i for i, (_, expr, _r) in enumerate(passes) if any(n is e for n in walk(expr)))


def shared_column_values(passes: Sequence[tuple[Tensor, Expr, Reduce | None]], column: Var,
                          new_buffer: Callable[[Expr], Buffer]) -> dict[Expr, Buffer]:
    """The expensive per-column values (EXPENSIVE intrinsics that depend on the column) that a
    reduction pass computes and a later pass computes again -- softmax's `exp(x - max)` in the sum
    pass and in the output pass -- each with a register array that keeps it (one per column of
    the thread, like the cached row) so the later pass reads it instead of recomputing it.
    Expressions are hash-consed, so "the same value" is identity of the node."""
    out: dict[Expr, Buffer] = {}
    for i, (_, expr, r) in enumerate(passes):
        if r is None:
            continue  # an output pass is the last to need its values
        later = {id(n) for _, e, _r in passes[i + 1:] for n in walk(e)}
        for n in walk(expr):
            if (isinstance(n, Call) and n.name in EXPENSIVE and id(n) in later and n not in out
                    and column in free_vars(n) and not any(n is m or _contains(m, n) for m in out)):
                out[n] = new_buffer(n)
    return out


def _contains(outer: Expr, inner: Expr) -> bool:
    return any(n is inner for n in walk(outer))


def row_spans(touched: Sequence[set[int]], arrays: Sequence[Buffer],
               loaded: Sequence[Buffer]) -> list[tuple[float, float]]:
    """The passes (first, last) over which each row array is live, from `touched[i]` (ids of the
    arrays pass i reads or writes): a cached input (`loaded`) from the load pass (-1) on, a kept
    value from just after the pass that computes it (that pass turns each element of its
    operands into one element of it: `t_row[j] = exp(x_row[j] - m)`, so an operand whose last
    use is that pass hands its registers over one by one)."""
    spans: list[tuple[float, float]] = []
    for buf in arrays:
        at = [i for i, ids in enumerate(touched) if id(buf) in ids]
        first = -1.0 if any(buf is b for b in loaded) else min(at, default=-1) + 0.5
        spans.append((first, float(max(at, default=-1))))
    return spans


def peak_row_words(spans: Sequence[tuple[float, float]], words: int) -> int:
    """Registers per thread the row arrays (`words` each) hold at once: softmax's exp(x - max)
    array takes over the registers of the input row it is computed from, so the peak is the
    most arrays live in one pass, not their sum."""
    last = max((hi for _, hi in spans), default=0.0)
    points = [q / 2 for q in range(-2, int(2 * last) + 2)]  # every pass and every gap between two
    return max((words * sum(1 for lo, hi in spans if lo <= p <= hi) for p in points), default=0)


def reads_only(t: Tensor, values: dict[Tensor, Buffer], known: set[Tensor], inliner: ExprMutator,
                row_idx: tuple[Expr, ...]) -> bool:
    """Whether row value `t` reads, of the group's row values and statistics, only `known` ones."""
    op = t.op
    assert isinstance(op, ComputeOp)
    at = row_idx + (Const(0, dt.int32),) * (len(op.axes) - len(row_idx))
    loaded = {id(n.buffer) for n in walk(inliner.visit(substitute(op.body, dict(zip(op.axes, at)))))
              if isinstance(n, BufferLoad)}
    return all(u in known for u, buf in values.items() if id(buf) in loaded)


def statistic_copies(group: RowGroup, values: dict[Tensor, Buffer], inliner: ExprMutator,
                     row_idx: tuple[Expr, ...]) -> dict[Expr, Expr]:
    """The register of each row value that is a reduction stage's value itself (a keepdim
    statistic `m'[r, 0] = m[r]`, which a loss saves for its backward) -> that stage's register
    (online_stats.max_sum_exp_pair reads through them)."""
    stats = {id(values[t]): t for t in group.reductions}
    out: dict[Expr, Expr] = {}
    for u in group.row_values:
        op = u.op
        assert isinstance(op, ComputeOp)
        at = row_idx + (Const(0, dt.int32),) * (len(op.axes) - len(row_idx))
        body = inliner.visit(substitute(op.body, dict(zip(op.axes, at))))
        if isinstance(body, BufferLoad) and id(body.buffer) in stats and body.dtype == u.dtype:
            out[values[u][Const(0, dt.int32)]] = body
    return out


__all__ = ["EXPENSIVE", "Pass", "RowInliner", "finish_reduction", "first_pass", "one_hot_sums", "peak_row_words", "reads_only", "row_passes",
           "row_spans", "shared_column_values", "statistic_copies"]
