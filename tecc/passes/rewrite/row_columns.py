"""Column reductions of a row group: partial sums over blocks of rows, then a combine kernel.

A normalization's backward has, beside the row kernel's dX, parameter gradients that reduce
over the rows: `dγ[j] = Σ_r dY[r, j]·x̂[r, j]`, `dβ[j] = Σ_r dY[r, j]` (row_group.py calls them
column reductions). Their sources are values of the row kernel at column j (x̂ needs the row's
mean and variance), so computing them anywhere else re-reads X and dY. Instead the row kernel
walks rows in a loop, each block over rows blk, blk + S, blk + 2S, ... (S = `row_blocks`
blocks), and adds each row's values into per-thread accumulators of the thread's own columns
(with the row in registers a thread owns the same K·V columns in every row):

    for blk in blockIdx.x(S): for tx in threadIdx.x(T):
      acc_q[k·V + v] = identity                          (one array per column reduction q)
      for it in serial(ceil(rows / S)):
        if it·S + blk < rows: <the row kernel on row it·S + blk>;
                              acc_q[slot] ⊕= source_q(row, col)    (over the thread's columns)
        barrier()                                        (the next row reuses the shared stages)
      partial_q[blk, col] = acc_q[slot]

and a second kernel folds the S partial rows of every column reduction, in a fixed order (no
atomics: the result does not depend on the schedule of the blocks):

    for bo in blockIdx.x(ceil(C / TX)): for ty in threadIdx.y(TY): for tx in threadIdx.x(TX):
      o = bo·TX + tx
      acc_q = ⊕_{i < ceil(S/TY)} partial_q[i·TY + ty, o]       (unrolled: every load in flight)
      block_q[ty, tx] = acc_q; barrier()
      if ty == 0: Y_q[o] = finish_q(⊕_w block_q[w, tx])       (the stage's cast / scale)

Consecutive lanes take consecutive columns, so the partial reads are coalesced. The partials
are S·C accumulators per column reduction (float32 for 16-bit sources); the strategy keeps S
to about one wave of the row kernel's blocks. With the row in registers only: a re-read row
(cache "none" / "online") has no fixed set of columns per thread to accumulate into.
"""

from __future__ import annotations

from typing import Callable

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Reduce, Var, binary, cast, reduce_identity, substitute
from ...ir.stmt import Allocate, Barrier, Buffer, BufferStore, For, IfThenElse, Stmt, seq
from ...ir.tensor import ComputeOp, Tensor
from ...ir.visitor import ExprMutator
from ..lower import COMBINE, Inliner
from .row_group import RowGroup

# the combine kernel's block: 32 consecutive columns (one warp: coalesced partial reads) × 32
# partial rows, so S ≤ 1024 row blocks take at most 32 loads per thread, all in flight
COMBINE_COLUMNS = 32
COMBINE_ROWS = 32
# Where a thread keeps its columns' sums: registers ("local"), or shared memory ("shared": C
# words per column reduction per block, which frees K·V registers each, so that wide rows keep
# two blocks per SM; each thread reads and writes only its own words, so no barrier is needed)
COLUMN_SCOPES = ("local", "shared")
# Resident blocks per SM a row kernel with column reductions is planned for (and asks ptxas for,
# `__launch_bounds__(T, n)`): more gain little (each holds a row in flight) and every block adds
# a partial row per column reduction, S·C float32 values written and read again by the combine
# kernel, against R·C row elements read and written by the row kernel. Asking for more than the
# plan launches would only squeeze registers: layer norm's backward with its statistics
# recomputed spilled 28 bytes at (128, 6) and none at (128, 4).
MAX_COLUMN_BLOCKS_PER_SM = 4


class ColumnPartials:
    """The column reductions of `group` inside fuse_rows' row kernel (module docstring):
    accumulators, their updates per row, the partial stores and the combine kernel."""

    def __init__(self, group: RowGroup, row_blocks: int, slots: Expr, buffers: dict[Tensor, Buffer],
                 unique: Callable[[str], str], scope: str = "local", threads: int = 1, lane: Expr | None = None
                 ) -> None:
        if row_blocks < 1:
            raise ScheduleError(f"fuse_rows: the column reductions {', '.join(t.name for t in group.column_reductions)} "
                                "need row_blocks >= 1 (the blocks whose partial sums the combine kernel folds)")
        if scope not in COLUMN_SCOPES:
            raise ScheduleError(f"fuse_rows: column_sums={scope!r}; one of {', '.join(COLUMN_SCOPES)}")
        self.group, self.S, self.buffers, self.unique = group, row_blocks, buffers, unique
        self.scope, self.threads, self.lane = scope, threads, lane
        self.stages = group.column_reductions
        self.reduces: list[Reduce] = []
        self.accs: list[Buffer] = []
        self.partials: list[Buffer] = []
        for t in self.stages:
            op = t.op
            assert isinstance(op, ComputeOp)
            r = op.reductions[0]
            self.reduces.append(r)
            # shared: slot-major, so that a warp's lanes touch consecutive words (no bank conflict)
            size = slots * threads if scope == "shared" else slots
            self.accs.append(Buffer(unique(f"{t.name}_cols"), r.acc_dtype, (size,), scope, tensor=f"{t.name}.cols"))
            self.partials.append(Buffer(unique(f"{t.name}_partial"), r.acc_dtype, (Const(row_blocks, dt.int32),
                                        group.columns), "global", tensor=f"{t.name}.partial"))

    def _at(self, slot: Expr) -> Expr:
        """The thread's element `slot` of an accumulator array."""
        if self.scope == "shared":
            assert self.lane is not None
            return slot * self.threads + self.lane
        return slot

    def init(self, column_loop: Callable[[Stmt], Stmt], slot: Expr) -> Stmt:
        """Every accumulator at the identity of its combiner."""
        return seq(*(column_loop(BufferStore(acc, (self._at(slot),), reduce_identity(r.combiner, acc.dtype)))
                     for r, acc in zip(self.reduces, self.accs)))

    def update(self, column_loop: Callable[[Stmt], Stmt], row_idx: tuple[Expr, ...], col: Expr, slot: Expr,
               value: Callable[[Expr], Expr]) -> Stmt:
        """acc_q[slot] ⊕= source_q at (row, col); `value` turns a tensor expression of the row
        into its value in the kernel (inlining, row statistics in registers, the cached row)."""
        steps: list[Stmt] = []
        for t, r, acc in zip(self.stages, self.reduces, self.accs):
            op = t.op
            assert isinstance(op, ComputeOp)
            at = substitute(r.source, {**dict(zip(r.axes, row_idx)), op.axes[0]: col})
            i = self._at(slot)
            steps.append(BufferStore(acc, (i,), binary(COMBINE[r.combiner], acc[i], value(cast(at, acc.dtype)))))
        return column_loop(seq(*steps))

    def store(self, column_loop: Callable[[Stmt, bool], Stmt], blk: Var, col: Expr, slot: Expr) -> Stmt:
        """partial_q[blk, col] = acc_q[slot] for the thread's columns."""
        return seq(*(column_loop(BufferStore(p, (blk, col), acc[self._at(slot)]), self.scope == "local")
                     for p, acc in zip(self.partials, self.accs)))

    def wrap(self, body: Stmt) -> Stmt:
        for acc in reversed(self.accs):
            body = Allocate(acc, body)
        return body

    def combine_kernel(self, inliner: Inliner) -> Stmt:
        """The body of the kernel that folds the S partial rows of every column reduction and
        writes it (its attrs: `attrs`)."""
        TX, TY, S = COMBINE_COLUMNS, COMBINE_ROWS, self.S
        C = self.group.columns
        bo, ty, tx, i, w = (Var(self.unique(n), dt.int32) for n in ("bo", "ty", "tx", "i", "w"))
        o = bo * TX + tx
        zero = Const(0, dt.int32)
        s = i * TY + ty
        allocs: list[Buffer] = []
        gather: list[Stmt] = []
        finish: list[Stmt] = []
        for t, r, partial in zip(self.stages, self.reduces, self.partials):
            op = COMBINE[r.combiner]
            acc = Buffer(self.unique(f"{t.name}_total"), r.acc_dtype, (1,), "local", tensor=f"{t.name}.total")
            block = Buffer(self.unique(f"{t.name}_block"), r.acc_dtype, (TY, TX), "shared", tensor=f"{t.name}.block")
            allocs += [acc, block]
            load: Stmt = BufferStore(acc, (zero,), binary(op, acc[zero], partial[s, o]))
            if S % TY:
                load = IfThenElse(s < S, load)
            gather.append(seq(BufferStore(acc, (zero,), reduce_identity(r.combiner, acc.dtype)),
                              IfThenElse(o < C, For(i, 0, -(-S // TY), "unroll", load)),
                              BufferStore(block, (ty, tx), acc[zero])))
            fold = For(w, 0, TY - 1, "unroll", BufferStore(acc, (zero,), binary(op, acc[zero], block[w + 1, tx])))
            finish.append(seq(fold, BufferStore(self.buffers[t], (o,), _finished(t, acc[zero], o, inliner))))
        body: Stmt = seq(*gather, Barrier(), IfThenElse((ty == 0) & (o < C), seq(*finish)))
        for buf in reversed(allocs):
            body = Allocate(buf, body)
        return For(bo, 0, (C + (TX - 1)) // TX, "blockIdx.x",
                   For(ty, 0, TY, "threadIdx.y", For(tx, 0, TX, "threadIdx.x", body)))

    @property
    def attrs(self) -> tuple[tuple[str, object], ...]:
        return (("column_combine", tuple(t.name for t in self.stages)), ("row_blocks", self.S))


def row_loop(step: Var, row_blocks: int, flat_row: Expr, n_rows: Expr, body: Stmt, barrier: bool) -> Stmt:
    """The rows `flat_row` = step·S + blk of one block, one after another, each under the row
    guard (uniform over the block), with a barrier after each when the body has shared stages
    (the next row rewrites them: allreduce's arrays are written once per row)."""
    inner: Stmt = IfThenElse(flat_row < n_rows, body)
    if barrier:
        inner = seq(inner, Barrier())
    return For(step, 0, (n_rows + (row_blocks - 1)) // row_blocks, "serial", inner)


def _finished(t: Tensor, total: Expr, o: Expr, inliner: Inliner) -> Expr:
    """Column stage `t`'s body at output `o` with its Reduce replaced by the folded total."""
    op = t.op
    assert isinstance(op, ComputeOp)

    class _Finish(ExprMutator):
        def visit_Reduce(self, r: Reduce) -> Expr:  # noqa: N805
            return cast(total, r.dtype)

    return inliner.visit(_Finish().visit(substitute(op.body, {op.axes[0]: o})))


__all__ = ["COLUMN_SCOPES", "COMBINE_COLUMNS", "COMBINE_ROWS", "ColumnPartials", "MAX_COLUMN_BLOCKS_PER_SM", "row_loop"]
