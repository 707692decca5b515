"""What a row group is: the matching half of row fusion (fuse_rows.py builds the kernel).

A program is a *row group* when, after elementwise producers are inlined (lower.choose_inlined),
its stages all iterate over the same rows R (one or more dimensions) and the same C columns:

* **row reductions**: shape R, every Reduce over one axis of extent C (the row's columns);
* **elementwise outputs** of shape R + (C,);
* **row values**: elementwise outputs of shape R, or R and trailing axes of extent 1 (a per-row
  loss `m + log(s) - pick`, a saved `rsqrt(var + eps)` of shape R + (1,)), computed once per row
  from the row's statistics and read at [row.., 0..];
* **column reductions**: shape (C,), one Reduce over the row axes (extents R), whose source is a
  value of the row at column j: `dγ[j] = Σ_r dY[r, j]·x̂[r, j]`, `dβ[j] = Σ_r dY[r, j]`, the
  parameter gradients of a normalization's backward. Nothing may read them (a column statistic
  read back by a row would need every row first).

Reads of the row reductions and row values index them by the row being computed (the reader's
own row axes, or a column reduction's reduced axes). Which reduction is a row and which a
column reduction is decided by its reads, not its shape (with as many rows as columns both have
shape (C,)): a row reduction reads a row-shaped tensor at `[row.., k]` with its reduced axis k
last, a column reduction reads one at `[r.., j]`, its reduced axes first and its own axis last.
Nothing here looks at names: softmax, log-softmax, layer norm, RMS norm, their backwards and a
cross-entropy forward are all row groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...ir.errors import ScheduleError
from ...ir.expr import Expr, Reduce, TensorRead, const_int, const_product, walk
from ...ir.tensor import ComputeOp, Tensor
from ..lower import Program, choose_inlined, collect_program, same_shape


@dataclass
class RowGroup:
    """A program all of whose stages share the row: the row reductions, the elementwise outputs,
    the row shape and the reduced extent; the row values and column reductions (module
    docstring), empty for the forward normalizations."""

    program: Program
    rows: tuple[Expr, ...]
    columns: Expr
    reductions: tuple[Tensor, ...]
    elementwise: tuple[Tensor, ...]
    row_values: tuple[Tensor, ...] = ()
    column_reductions: tuple[Tensor, ...] = ()

    @property
    def stages(self) -> tuple[Tensor, ...]:
        return self.program.stages

    @property
    def row_inputs(self) -> tuple[Tensor, ...]:
        """The inputs that hold a row: shape rows + (columns,), read along the row (the ones
        fuse_rows caches), or a view of such rows: (columns,) last and leading dimensions that
        multiply to the rows' (transformers' logits [B, T, V] read as B·T rows of V through a
        view: fuse_rows caches it where the passes read it at one index of the row; a view of
        another element size than the rows of the row's shape is left out). An input
        of shape rows + (1,), read at [row.., 0] (a per-row target or scale kept with its
        size-1 axis), is a per-row value, not a row."""
        rows = self.rows + (self.columns,)
        plain = [t for t in self.program.args if t.is_placeholder and same_shape(t.shape, rows)]
        sizes = {t.dtype.bits for t in plain}
        # a view of another element size than the rows of the row's own shape is read in place:
        # the cached arrays take one vector width (row_fused), which the first chooses
        views = [t for t in self.program.args if t.is_placeholder and t not in plain
                 and holds_rows(t.shape, self.rows, self.columns) and (not sizes or t.dtype.bits in sizes)]
        return tuple(t for t in self.program.args if t in plain or t in views)


def holds_rows(shape: Sequence[Expr], rows: Sequence[Expr], columns: Expr) -> bool:
    """Whether a tensor of `shape` holds the rows: rows + (columns,), or (columns,) last after
    leading dimensions whose constant product is the rows' (a view of them: RowGroup.row_inputs)."""
    if same_shape(tuple(shape), tuple(rows) + (columns,)):
        return True
    if len(shape) < 2 or not same_shape((shape[-1],), (columns,)):
        return False
    lead, want = const_product(shape[:-1]), const_product(rows)
    return lead is not None and lead == want


def row_group(args: Sequence[Tensor]) -> RowGroup:
    """The row group of the program `args`, or ScheduleError saying why it is not one."""
    prog = choose_inlined(collect_program(args))
    stages = prog.stages
    reducing = [t for t in stages if isinstance(t.op, ComputeOp) and t.op.reductions]
    columnwise = tuple(t for t in reducing if _reads_as_column_reduction(t))
    reductions = tuple(t for t in reducing if t not in columnwise)
    if not reductions:
        raise ScheduleError("fuse_rows: the program has no reduction stage" if not columnwise else
                            "fuse_rows: the program reduces over rows only (column reductions): no row to share")
    rows = reductions[0].shape
    columns = _row_columns(reductions, rows)
    row_values = tuple(t for t in stages if t not in reducing and row_shaped(t.shape, rows))
    elementwise = tuple(t for t in stages if t not in reducing and t not in row_values)
    for t in elementwise:
        if not same_shape(t.shape, rows + (columns,)):
            raise ScheduleError(
                f"fuse_rows: elementwise stage {t.name} has shape {_fmt(t.shape)}, not rows + columns "
                f"{_fmt(rows + (columns,))} or the rows {_fmt(rows)}")
    for t in columnwise:
        _check_column_reduction(t, rows, columns)
    _check_reads_at_the_row(prog, reductions + row_values, columnwise, len(rows))
    return RowGroup(prog, tuple(rows), columns, reductions, elementwise, row_values, columnwise)


def _row_columns(reductions: Sequence[Tensor], rows: Sequence[Expr]) -> Expr:
    """The extent C every row reduction reduces over, or ScheduleError."""
    columns: Expr | None = None
    for t in reductions:
        op = t.op
        assert isinstance(op, ComputeOp)
        if not same_shape(t.shape, rows):
            raise ScheduleError(f"fuse_rows: reduction {t.name} has shape {_fmt(t.shape)}, not the row shape {_fmt(rows)}")
        for r in op.reductions:
            if len(r.axes) != 1 or const_int(r.axes[0].lo) != 0:
                raise ScheduleError(f"fuse_rows: {t.name} reduces over {len(r.axes)} axes; one axis from 0 is needed")
            _no_nested_reduction(t, r)
            ext = r.axes[0].extent
            if columns is None:
                columns = ext
            elif ext is not columns:
                raise ScheduleError(f"fuse_rows: {t.name} reduces over {ext} columns, another stage over {columns}")
    assert columns is not None
    return columns


def _reads_as_column_reduction(t: Tensor) -> bool:
    """Whether reduction stage `t` is one Reduce producing a vector indexed by column j whose
    source reads some tensor at [its reduced axes.., j] (module docstring)."""
    op = t.op
    assert isinstance(op, ComputeOp)
    if len(op.axes) != 1 or len(op.reductions) != 1:
        return False
    r = op.reductions[0]
    key = tuple(r.axes) + (op.axes[0],)
    return any(isinstance(n, TensorRead) and same_shape(n.indices, key) for n in walk(r.source))


def _check_column_reduction(t: Tensor, rows: Sequence[Expr], columns: Expr) -> None:
    op = t.op
    assert isinstance(op, ComputeOp)
    r = op.reductions[0]
    if t.shape[0] is not columns:
        raise ScheduleError(f"fuse_rows: column reduction {t.name} has {t.shape[0]} outputs, not the {columns} columns")
    if len(r.axes) != len(rows) or any(a.extent is not n or const_int(a.lo) != 0 for a, n in zip(r.axes, rows)):
        raise ScheduleError(f"fuse_rows: column reduction {t.name} reduces over "
                            f"{_fmt([a.extent for a in r.axes])}, not over the rows {_fmt(rows)}")
    _no_nested_reduction(t, r)


def _no_nested_reduction(t: Tensor, r: Reduce) -> None:
    if any(isinstance(inner, Reduce) for inner in walk(r.source)):
        raise ScheduleError(f"fuse_rows: {t.name} has a reduction inside a reduction")


def _check_reads_at_the_row(prog: Program, per_row: Sequence[Tensor], columnwise: Sequence[Tensor],
                            n_rows: int) -> None:
    """Shapes alone do not make a row group: a per-row stage must be read at the reader's own
    row. With as many rows as columns, `B[i, j] = A[i, j] / colsum[j]` has the right shapes but
    reads a column statistic along the row (the guard once took it and fuse_rows then failed).
    A column reduction's row is its reduced axes; nothing reads a column reduction."""
    for reader in prog.order:
        op = reader.op
        if not isinstance(op, ComputeOp):
            continue
        row = tuple(op.reductions[0].axes) if reader in columnwise else tuple(op.axes[:n_rows])
        for read in walk(op.body):
            if not isinstance(read, TensorRead):
                continue
            if read.tensor in columnwise:
                raise ScheduleError(f"fuse_rows: {reader.name} reads the column reduction {read.tensor.name}; a "
                                    "column statistic is known only after every row")
            if read.tensor in per_row and not at_the_row(read.indices, row):
                raise ScheduleError(
                    f"fuse_rows: {reader.name} reads {read.tensor.name} at [{_fmt(read.indices)[1:-1]}], not at "
                    f"the row being computed [{_fmt(row)[1:-1]}]")


def row_shaped(shape: Sequence[Expr], rows: Sequence[Expr]) -> bool:
    """Whether a stage of `shape` holds one value per row: the rows, or the rows and trailing
    axes of extent 1 (a per-row statistic kept with its size-1 axis, torch's keepdim=True)."""
    n = len(rows)
    return (len(shape) >= n and same_shape(shape[:n], rows)
            and all(const_int(d) == 1 for d in shape[n:]))


def at_the_row(indices: Sequence[Expr], row: Sequence[Expr]) -> bool:
    """Whether a per-row value is read at `row`: the row's indices, then 0 on its size-1 axes."""
    n = len(row)
    return (len(indices) >= n and same_shape(indices[:n], row)
            and all(const_int(i) == 0 for i in indices[n:]))


def _fmt(shape: Sequence[Expr]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


__all__ = ["RowGroup", "at_the_row", "holds_rows", "row_group", "row_shaped"]
