"""The column walk of a row too long for registers: vector loads, several in flight, a tail.

`fuse_rows(cache="none" | "online")` reads its row from global memory once per pass. A pass
walks the thread's columns in *chunks* of U vectors of V consecutive columns:

    for j in range(C // (U·T·V)):                         # full chunks: no guard
      for u in unroll(U): for v in vectorize(V):          # U loads of V columns, all in flight
        X_chunk[u·V + v] = X[row, ((j·U + u)·T + tx)·V + v]
      <the pass over the chunk: X[row, col] is X_chunk[u·V + v]>
    for t in unroll(tail):                                # the rest, one vector at a time
      if ((J·U + t)·T + tx)·V < C:                        # J = C // (U·T·V)
        X_chunk[v] = X[row, ((J·U + t)·T + tx)·V + v];  <the pass over that vector>

Consecutive threads take consecutive V-column vectors, as in the registers form's
`(k·T + tx)·V + v`, so a warp's access is contiguous; V·itemsize = 16 bytes makes each load
one LDG.128 (`codegen/vectorize.py`: float4, or 8 bf16/fp16 as one uint4). The U loads of a
chunk are issued before any of them is used, which puts U·16 bytes per thread in flight (one
scalar load at a time, what the column loop had before, leaves DRAM latency uncovered on a
row that only ~64 blocks share). A vector is wholly inside the row or wholly past it because
C is a multiple of V (checked by fuse_rows); for a symbolic C, V is 1 (a row's alignment
cannot be proved), the chunk still holds U loads.

What a chunk computes is the pass's business (`Chunk.each` for per-column work, or whole-chunk
statistics: online_stats.py's max/sum-exp and Welford updates). The chunk registers live across
passes: a load node (`X[row.., col]`, hash-consed) has one register array whichever pass reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...ir import dtype as dt
from ...ir.expr import BufferLoad, Const, Expr, Var, const_int, substitute, walk
from ...ir.stmt import Buffer, BufferStore, For, IfThenElse, Stmt, seq
from ...ir.visitor import SubexpressionReplacer
from ..simplify import same_index


@dataclass
class Chunk:
    """`units` vectors of `vector` columns of one thread: element (u, v) is column `column` of
    the row and slot `slot` (u·V + v) of the chunk registers. `u` is the unrolled unit loop's
    variable, or the constant 0 for a one-vector chunk (the tail); `v` the vector lane's, or 0
    when V = 1."""

    u: Expr
    v: Expr
    units: int
    vector: int
    column: Expr
    slot: Expr
    col: Var
    registers: dict[int, tuple[Expr, Buffer]]

    @property
    def elements(self) -> int:
        return self.units * self.vector

    def value(self, e: Expr) -> Expr:
        """`e` (an expression of the column variable) at element (u, v): staged loads read the
        chunk registers, the column variable is the element's column."""
        staged = SubexpressionReplacer({load: buf[self.slot] for load, buf in self.registers.values()})
        return substitute(staged.visit(e), {self.col: self.column})

    def each(self, body: Stmt, vectorized: bool = False) -> Stmt:
        """`body` (written with `column`, `slot`, `value`) for every element of the chunk; with
        `vectorized` the V elements of a unit are one `vectorize` loop (a vector store)."""
        out = body
        if isinstance(self.v, Var):
            out = For(self.v, 0, self.vector, "vectorize" if vectorized else "unroll", out)
        if isinstance(self.u, Var):
            out = For(self.u, 0, self.units, "unroll", out)
        return out


@dataclass
class ColumnWalk:
    """The chunked walk over a row of `columns` (C) columns by `threads` (T) threads of lane
    `tx`: chunks of `unroll` (U) vectors of `vector` (V) columns. `col` is the column variable
    the passes' expressions are written in; `new_var` / `new_buffer` make fresh names. `start`:
    the walk covers columns [start, start + C) of the row instead of [0, C) (one block's chunk
    of a split row, passes/rewrite/split_row_group.py; a multiple of V, so vectors stay aligned)."""

    columns: Expr
    threads: int
    vector: int
    unroll: int
    tx: Var
    col: Var
    new_var: Callable[[str], Var]
    new_buffer: Callable[[BufferLoad, int], Buffer]
    registers: dict[int, tuple[Expr, Buffer]] = field(default_factory=dict)
    start: Expr | None = None
    reads: int = 0    # the passes so far that load the row (a pass computing only from indices loads none)

    def __post_init__(self) -> None:
        self.j, self.u, self.v, self.t = (self.new_var(n) for n in ("j", "u", "v", "t"))

    @property
    def buffers(self) -> list[Buffer]:
        """The chunk register arrays made so far (to allocate around the kernel body)."""
        return [buf for _, buf in self.registers.values()]

    def staged_loads(self, exprs: Sequence[Expr], row: tuple[Expr, ...]) -> list[BufferLoad]:
        """The global loads of `exprs` that read the row being computed at the column, indexed
        `[row.., col]` or by a suffix of it (`g[col]` of a layer norm): in bounds for every
        column of the row, so they may be loaded ahead of the pass into the chunk registers."""
        out: list[BufferLoad] = []
        for e in exprs:
            for n in walk(e):
                if (isinstance(n, BufferLoad) and n.buffer.scope == "global" and n not in out
                        and 1 <= len(n.indices) <= len(row) + 1 and n.indices[-1] is self.col
                        and all(map(same_index, n.indices[:-1], row[len(row) + 1 - len(n.indices):]))):
                    out.append(n)
        return out

    def loop(self, exprs: Sequence[Expr], row: tuple[Expr, ...], body: Callable[[Chunk], Stmt]) -> Stmt:
        """The walk of one pass whose per-column expressions are `exprs`: every chunk loads the
        staged loads of `exprs` into registers, then runs `body(chunk)`."""
        loads = self.staged_loads(exprs, row)
        self.reads += bool(loads)
        for load in loads:
            if id(load) not in self.registers:
                self.registers[id(load)] = (load, self.new_buffer(load, self.unroll * self.vector))
        regs = {id(load): self.registers[id(load)] for load in loads}
        T, V, U = self.threads, self.vector, self.unroll
        C = self.columns
        c_const = const_int(C)
        step = U * T * V
        full: Expr = Const(c_const // step, dt.int32) if c_const is not None else C // step

        v: Expr = self.v if V > 1 else Const(0, dt.int32)

        def chunk(first_vector: Expr, u: Expr, units: int) -> Stmt:
            column = ((first_vector + u) * T + self.tx) * V + v
            if self.start is not None:
                column = self.start + column
            ch = Chunk(u, v, units, V, column, u * V + v, self.col, regs)
            stage = [ch.each(BufferStore(buf, (ch.slot,), substitute(load, {self.col: column})), vectorized=True)
                     for load, buf in regs.values()]
            return seq(*stage, body(ch))

        parts: list[Stmt] = []
        if c_const is None or c_const >= step:
            parts.append(For(self.j, 0, full, "serial",
                             chunk(self.j * U, self.u if U > 1 else Const(0, dt.int32), U)))
        # the tail: fewer than U·T·V columns, at most U vectors per thread
        if c_const is None:
            tail, guarded = U, True
        else:
            rest = c_const - (c_const // step) * step
            tail, guarded = -(-rest // (T * V)), rest % (T * V) != 0
        if tail:
            def tail_step(t: Expr) -> Stmt:
                one = chunk(full * U + t, Const(0, dt.int32), 1)
                if guarded:
                    one = IfThenElse(((full * U + t) * T + self.tx) * V < C, one)
                return one

            parts.append(For(self.t, 0, tail, "unroll", tail_step(self.t)) if tail > 1 else
                         tail_step(Const(0, dt.int32)))
        return seq(*parts)


__all__ = ["Chunk", "ColumnWalk"]
