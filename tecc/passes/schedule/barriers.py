"""insert_barriers: put `__syncthreads()` where threads of a block hand shared memory to each other.

Walks each kernel in execution order keeping the shared buffers written and read since the last
barrier. Before a statement that reads a buffer written since then (read after write), or writes
one read since then (write after read: the next tile must not overwrite what a slower thread is
still reading), it inserts a Barrier and starts over. Loops are walked twice so the dependence
from the end of one iteration to the start of the next is seen (the barrier at the top of a
k-tile loop). Thread-bound loops are transparent (their body runs for all threads at once), and
a barrier is placed before a whole loop whose accesses conflict rather than inside it.

Assumptions, kept by the primitives that create shared buffers: shared accesses by different
threads under one statement touch different elements (cooperative copies), so two writes need no
barrier between them. Every barrier lands outside thread-dependent conditions (guards are on
leaves, around stores only). A barrier inside a thread loop narrower than the block would be
reached by only some threads: that raises ScheduleError.
"""

from __future__ import annotations

from ...ir.errors import ScheduleError
from ...ir.expr import BufferLoad, Expr, const_int, walk
from ...ir.stmt import (
    Allocate,
    Barrier,
    Buffer,
    BufferStore,
    Evaluate,
    For,
    IfThenElse,
    LetStmt,
    PrimFunc,
    Seq,
    Stmt,
    launch_dims,
    seq,
)
from ...ir.visitor import StmtMutator
from .loops import iter_with_path

State = tuple[frozenset[Buffer], frozenset[Buffer]]  # (written, read) since the last barrier
EMPTY: State = (frozenset(), frozenset())


def _accesses(s: Stmt) -> State:
    """The shared buffers `s` writes and reads, anywhere inside it."""
    w: set[Buffer] = set()
    r: set[Buffer] = set()

    def loads(e: Expr) -> None:
        for n in walk(e):
            if isinstance(n, BufferLoad) and n.buffer.scope == "shared":
                r.add(n.buffer)

    for x, _ in iter_with_path(s):
        if isinstance(x, BufferStore):
            if x.buffer.scope == "shared":
                w.add(x.buffer)
            loads(x.value)
            for i in x.indices:
                loads(i)
        elif isinstance(x, IfThenElse):
            loads(x.cond)
        elif isinstance(x, Evaluate):
            loads(x.value)
        elif isinstance(x, For):
            loads(x.min)
            loads(x.extent)
    return frozenset(w), frozenset(r)


def _conflict(state: State, acc: State) -> bool:
    written, read = state
    w, r = acc
    return bool(r & written) or bool(w & read)


def _join(a: State, b: State) -> State:
    return a[0] | b[0], a[1] | b[1]


class _Inserter:
    def __init__(self, func: PrimFunc) -> None:
        self.func = func
        self.block = launch_dims(func).block

    def run(self, s: Stmt, state: State, in_narrow: str | None) -> tuple[Stmt, State]:
        if isinstance(s, Barrier):
            return s, EMPTY
        if isinstance(s, Seq):
            out: list[Stmt] = []
            for x in s.stmts:
                y, state = self.run(x, state, in_narrow)
                out.append(y)
            return seq(*out), state
        if isinstance(s, Allocate):
            body, state = self.run(s.body, state, in_narrow)
            return Allocate(s.buffer, body), state
        if isinstance(s, For) and (s.is_block or s.is_thread):
            narrow = in_narrow
            if s.is_thread:
                axis = "xyz".index(s.kind[-1])
                if (const_int(s.extent) or 0) < self.block[axis]:
                    narrow = s.var.name
            body, state = self.run(s.body, state if s.is_thread else EMPTY, narrow)
            return For(s.var, s.min, s.extent, s.kind, body, s.annotations), state
        acc = _accesses(s)
        if isinstance(s, For) and not (acc[0] or acc[1]):
            return s, state
        barrier: list[Stmt] = []
        if _conflict(state, acc):
            if in_narrow is not None:
                raise ScheduleError(
                    f"kernel {self.func.name}: shared memory needs a barrier inside thread loop {in_narrow}, "
                    "which is narrower than the block (only some threads would reach it)"
                )
            barrier = [Barrier()]
            state = EMPTY
        if isinstance(s, For):
            _, end = self.run(s.body, state, in_narrow)
            body, end = self.run(s.body, _join(state, end), in_narrow)
            return seq(*barrier, For(s.var, s.min, s.extent, s.kind, body, s.annotations)), _join(state, end)
        return seq(*barrier, s), _join(state, acc)


class _Strip(StmtMutator):
    def visit_Seq(self, s: Seq) -> Stmt:
        return seq(*(self.visit(x) for x in s.stmts if not isinstance(x, Barrier)))


def insert_barriers(func: PrimFunc) -> PrimFunc:
    """`func` with barriers exactly where its shared-memory accesses need them (old ones removed)."""
    if not any(isinstance(x, Allocate) and x.buffer.scope == "shared" for x, _ in iter_with_path(func.body)):
        return func
    body = _Strip().visit(func.body)
    body, _ = _Inserter(func).run(body, EMPTY, None)
    return func.with_body(body)


__all__ = ["insert_barriers", "LetStmt"]
