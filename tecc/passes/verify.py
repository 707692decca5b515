"""The IR verifier: invariants every pass must keep.

- every variable an expression uses is bound: a kernel parameter, an enclosing loop or let;
- no loop variable is bound twice on one path;
- buffers: global ones are kernel parameters, shared/local ones are inside their Allocate;
- a barrier is never under a condition or loop that depends on the thread index (all threads of
  the block must reach it);
- matrix statements (mma, ldmatrix, cp.async) name buffers in scope and bound variables; whether
  all 32 lanes of a warp reach a warp-collective one depends on values (a warp-uniform condition
  is fine), so the emulator checks that when it runs.
"""

from __future__ import annotations

from ..ir.errors import ScheduleError
from ..ir.expr import BufferLoad, Expr, Var, buffers_read, free_vars, frozen_free_vars, walk
from ..ir.stmt import (
    Allocate,
    AsyncCopy,
    Barrier,
    Buffer,
    BufferStore,
    BulkCopy,
    TensorCopy,
    TensorStore,
    For,
    IfThenElse,
    Instruction,
    LetStmt,
    MatrixLoad,
    MatrixMultiply,
    Module,
    PrimFunc,
    WarpgroupMatrixMultiply,
)
from ..ir.visitor import StmtVisitor


class _Verifier(StmtVisitor):
    def __init__(self, func: PrimFunc) -> None:
        self.func = func
        self.vars: set[Var] = {p for p in func.params if isinstance(p, Var)}
        self.buffers: set[Buffer] = {p for p in func.params if isinstance(p, Buffer)}
        self.thread_vars: set[Var] = set()
        self.thread_dependent_depth = 0

    def fail(self, msg: str) -> None:
        raise ScheduleError(f"kernel {self.func.name}: {msg}")

    def visit_expr(self, e: Expr) -> None:
        if frozen_free_vars(e) <= self.vars and buffers_read(e) <= self.buffers:
            return
        for v in free_vars(e):
            if v not in self.vars:
                self.fail(f"variable {v.name} is used in {e} but not bound (not a parameter, loop or let)")
        for n in walk(e):
            if isinstance(n, BufferLoad) and n.buffer not in self.buffers:
                self.fail(f"buffer {n.buffer.name} is read in {e} outside its allocation / not a parameter")

    def _depends_on_thread(self, e: Expr) -> bool:
        return not frozen_free_vars(e).isdisjoint(self.thread_vars)

    def visit_For(self, s: For) -> None:
        self.visit_expr(s.min)
        self.visit_expr(s.extent)
        if s.var in self.vars:
            self.fail(f"loop variable {s.var.name} is bound twice")
        self.vars.add(s.var)
        dep = self._depends_on_thread(s.min) or self._depends_on_thread(s.extent)
        if s.is_thread:
            self.thread_vars.add(s.var)
        self.thread_dependent_depth += dep
        self.visit(s.body)
        self.thread_dependent_depth -= dep
        self.vars.discard(s.var)

    def visit_LetStmt(self, s: LetStmt) -> None:
        self.visit_expr(s.value)
        self.vars.add(s.var)
        if self._depends_on_thread(s.value):
            self.thread_vars.add(s.var)
        self.visit(s.body)
        self.vars.discard(s.var)

    def visit_IfThenElse(self, s: IfThenElse) -> None:
        self.visit_expr(s.cond)
        dep = self._depends_on_thread(s.cond)
        self.thread_dependent_depth += dep
        self.visit(s.then_case)
        if s.else_case is not None:
            self.visit(s.else_case)
        self.thread_dependent_depth -= dep

    def visit_Allocate(self, s: Allocate) -> None:
        self.buffers.add(s.buffer)
        self.visit(s.body)
        self.buffers.discard(s.buffer)

    def visit_BufferStore(self, s: BufferStore) -> None:
        if s.buffer not in self.buffers:
            self.fail(f"store to buffer {s.buffer.name} outside its allocation / not a parameter")
        self.generic_visit(s)

    def _in_scope(self, buffers: tuple[Buffer, ...], what: str) -> None:
        for b in buffers:
            if b not in self.buffers:
                self.fail(f"{what} uses buffer {b.name} outside its allocation / not a parameter")

    def visit_MatrixMultiply(self, s: MatrixMultiply) -> None:
        self._in_scope((s.d.buffer, s.a.buffer, s.b.buffer, s.c.buffer), s.intrinsic)
        self.generic_visit(s)

    def visit_MatrixLoad(self, s: MatrixLoad) -> None:
        self._in_scope((s.dst.buffer, s.src), s.intrinsic)
        self.generic_visit(s)

    def visit_AsyncCopy(self, s: AsyncCopy) -> None:
        self._in_scope((s.dst, s.src), "cp.async")
        self.generic_visit(s)

    def visit_WarpgroupMatrixMultiply(self, s: WarpgroupMatrixMultiply) -> None:
        self._in_scope((s.d.buffer, s.a.buffer, s.b.buffer), s.intrinsic)  # a SharedMatrix or a FragmentRef
        self.generic_visit(s)

    def visit_Instruction(self, s: Instruction) -> None:
        # barriers, wgmma.wait_group's accumulators
        self._in_scope(s.buffers(), "mbarrier" if s.name.startswith("mbarrier") else s.name)
        self.generic_visit(s)

    def visit_BulkCopy(self, s: BulkCopy) -> None:
        self._in_scope((s.dst, s.src, s.bar.buffer), "cp.async.bulk")
        self.generic_visit(s)

    def visit_TensorCopy(self, s: TensorCopy) -> None:
        self._in_scope((s.dst, s.map.buffer, s.bar.buffer), "cp.async.bulk.tensor")
        self.generic_visit(s)

    def visit_TensorStore(self, s: TensorStore) -> None:
        self._in_scope((s.src, s.map.buffer), "cp.async.bulk.tensor (store)")
        self.generic_visit(s)

    def visit_Barrier(self, s: Barrier) -> None:
        if self.thread_dependent_depth:
            self.fail("a barrier sits under a condition or loop bound that depends on the thread index; "
                      "not every thread of the block would reach it")


def verify_func(func: PrimFunc) -> None:
    _Verifier(func).visit(func.body)


def verify_module(module: Module) -> None:
    for k in module.kernels:
        verify_func(k)


