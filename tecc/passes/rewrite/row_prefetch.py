"""A row-walking block's next row staged in shared memory by cp.async (fuse_rows'
`prefetch_into="shared"`).

fuse_rows' `prefetch` loads a block's next row while this one is computed. Loaded into a second
set of registers it is at ptxas's mercy: the next row's registers are the loop-carried copy of
this row's, so ptxas issued those loads after the row's last use of its own registers, past both
reductions' barriers of layer norm's backward at 4096 columns (fp32 and bf16, 512 threads: the
loads were in flight only through the dX pass and the column sums, and the backward ran no faster
than without them). Staged in shared memory the loads need no registers and cannot be held back:

    stage_X[2][K·T·V]                                     (X's type; two halves, by row parity)
    before the rows:  if blk < rows: cp.async X[row 0] -> stage_X[0];  commit
    for each row (step):
      wait_group 0                                        (this row, copied one step ago)
      x_row[k·V + v] = stage_X[step & 1][col]             (each thread reads what it copied)
      if there is a next row: cp.async X[next row] -> stage_X[(step + 1) & 1];  commit
      <the row: reductions, outputs, column sums>

Each thread copies its own V-wide vectors of the row (cp.async of V·itemsize bytes: 4, 8 or 16)
to the words it reads back, so no barrier publishes them (the wait alone); the half written at
step + 1 was last read at step - 1, before that row's barrier. The copies of the next row are
issued as soon as this row is taken, and stay in flight through its reductions and barriers.
"""

from __future__ import annotations

from typing import Callable

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, cast, substitute
from ...ir.stmt import AsyncCommit, AsyncCopy, AsyncWait, Buffer, BufferStore, For, IfThenElse, Stmt, seq

PREFETCH_INTO = ("registers", "shared")
ASYNC_BYTES = (4, 8, 16)


class StagedRows:
    """The next-row stages of a row kernel's cached inputs (module docstring): `stage` adds an
    input, `take` reads this row's copy into its registers, `issue` copies a row."""

    def __init__(self, T: int, V: int, K: int, tx: Var, k: Var, step: Var, row_idx: tuple[Expr, ...],
                 guard: Callable[[Expr], Expr] | None, unique: Callable[[str], str]) -> None:
        self.T, self.V, self.K, self.tx, self.k, self.step = T, V, K, tx, k, step
        self.row_idx, self.guard, self.unique = row_idx, guard, unique
        self.span = K * T * V            # the columns a half holds: every thread's K vectors
        self.inputs: list[tuple[Buffer, Buffer]] = []    # (stage, the input it copies)

    def stage(self, src: Buffer, name: str) -> Buffer:
        nbytes = self.V * src.dtype.bytes
        if nbytes not in ASYNC_BYTES:
            raise ScheduleError(f"fuse_rows: prefetch_into='shared' copies a thread's {self.V} {src.dtype} "
                                f"element(s) of {name} with one cp.async, which moves 4, 8 or 16 bytes, not {nbytes}: "
                                "take a vector of 4, 8 or 16 bytes, or prefetch_into='registers'")
        buf = Buffer(self.unique(f"{src.name}_stage"), src.dtype, (2 * self.span,), "shared", tensor=f"{name}.stage")
        self.inputs.append((buf, src))
        return buf

    def half(self, step: Expr) -> Expr:
        return (step & 1) * self.span

    def take(self, stage: Buffer, reg: Buffer, slot: Expr, col: Expr) -> Stmt:
        """This row's element at `col` of `stage` into register `slot` of `reg` (a column walk body)."""
        return BufferStore(reg, (slot,), cast(stage[self.half(self.step) + col], reg.dtype))

    def issue(self, step: Expr) -> Stmt:
        """The copies of the block's row at `step` into its half: one cp.async per vector of every
        thread, each vector wholly inside the row or past it (then not copied)."""
        k, T, V = self.k, self.T, self.V
        first = (k * T + self.tx) * V
        row = tuple(substitute(i, {self.step: step}) for i in self.row_idx)
        copies: list[Stmt] = []
        for buf, src in self.inputs:
            nbytes = V * src.dtype.bytes
            copy: Stmt = AsyncCopy(buf, (self.half(step) + first,), src, row + (first,), nbytes,
                                   cache="cg" if nbytes == 16 else "ca")
            if self.guard is not None:
                copy = IfThenElse(self.guard(first), copy)
            copies.append(For(k, 0, Const(self.K, dt.int32), "unroll", copy))
        return seq(*copies)

    @staticmethod
    def wait() -> Stmt:
        return AsyncWait(0)

    @staticmethod
    def commit() -> Stmt:
        return AsyncCommit()

    def smem_bytes(self) -> int:
        return sum(2 * self.span * src.dtype.bytes for _, src in self.inputs)


def stage_bytes(T: int, V: int, K: int, itemsizes: list[int]) -> int:
    """The shared memory a block's stages take: two halves of K·T·V elements per cached input."""
    return sum(2 * K * T * V * size for size in itemsizes)


__all__ = ["ASYNC_BYTES", "PREFETCH_INTO", "StagedRows", "stage_bytes"]
