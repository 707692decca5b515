"""Give every variable and buffer of a kernel a distinct name.

Variables are identities in the IR, so two loops may both be called `i`, or a schedule's `bx`
may meet a tensor named `bx`. C needs distinct names: this pass renames the later binder
(`i` → `i1`) and every use of it. It runs last, right before code generation."""

from __future__ import annotations

import dataclasses

from ..ir.expr import Var
from ..ir.stmt import Allocate, Buffer, For, LetStmt, Module, PrimFunc, Stmt
from ..ir.visitor import StmtMutator
from .names import fresh_name
from .substitute import substitute_stmt


class _Renamer(StmtMutator):
    def __init__(self, taken: set[str]) -> None:
        self.taken = taken

    def fresh(self, name: str) -> str:
        return fresh_name(name, self.taken)

    def _rebind(self, var: Var) -> Var | None:
        name = self.fresh(var.name)
        return None if name == var.name else Var(name, var.dtype, var.kind)

    def visit_For(self, s: For) -> Stmt:
        new = self._rebind(s.var)
        if new is None:
            return self.generic_visit(s)
        body = self.visit(substitute_stmt(s.body, {s.var: new}))
        return For(new, s.min, s.extent, s.kind, body, s.annotations)

    def visit_LetStmt(self, s: LetStmt) -> Stmt:
        new = self._rebind(s.var)
        if new is None:
            return self.generic_visit(s)
        body = self.visit(substitute_stmt(s.body, {s.var: new}))
        return LetStmt(new, s.value, body)

    def visit_Allocate(self, s: Allocate) -> Stmt:
        name = self.fresh(s.buffer.name)
        if name == s.buffer.name:
            return self.generic_visit(s)
        b = s.buffer
        renamed = dataclasses.replace(b, name=name)  # keeps the layout (swizzle) and the fragment role
        body = self.visit(_replace_buffer(s.body, b, renamed))
        return Allocate(renamed, body)


def _replace_buffer(s: Stmt, old: Buffer, new: Buffer) -> Stmt:
    from ..ir.expr import BufferLoad, Expr
    from ..ir.stmt import AsyncCopy, BufferStore, FragmentRef, MatrixLoad, MatrixMultiply
    from ..ir.visitor import ExprMutator

    class _Loads(ExprMutator):
        def visit_BufferLoad(self, e: BufferLoad) -> Expr:
            idx = tuple(self.visit(i) for i in e.indices)
            return BufferLoad(new if e.buffer is old else e.buffer, idx)

    class _Stores(StmtMutator):
        def visit_BufferStore(self, st: BufferStore) -> Stmt:
            idx = tuple(self.visit_expr(i) for i in st.indices)
            return BufferStore(new if st.buffer is old else st.buffer, idx, self.visit_expr(st.value))

        # the matrix-level statements name buffers outside loads and stores
        def _ref(self, ref: FragmentRef) -> FragmentRef:
            return FragmentRef(new, self.visit_expr(ref.offset)) if ref.buffer is old else self._fragment(ref)

        def visit_MatrixMultiply(self, st: MatrixMultiply) -> Stmt:
            return MatrixMultiply(st.intrinsic, self._ref(st.d), self._ref(st.a), self._ref(st.b), self._ref(st.c))

        def visit_MatrixLoad(self, st: MatrixLoad) -> Stmt:
            return MatrixLoad(st.intrinsic, self._ref(st.dst), new if st.src is old else st.src,
                              tuple(self.visit_expr(i) for i in st.src_indices))

        def visit_AsyncCopy(self, st: AsyncCopy) -> Stmt:
            pred = self.visit_expr(st.predicate) if st.predicate is not None else None
            return AsyncCopy(new if st.dst is old else st.dst, tuple(self.visit_expr(i) for i in st.dst_indices),
                             new if st.src is old else st.src, tuple(self.visit_expr(i) for i in st.src_indices),
                             st.bytes, pred, st.cache, st.unit_stride_at_launch, st.along)

    m = _Stores()
    m.expr_mutator = _Loads()
    return m.visit(s)


def unique_names_func(func: PrimFunc) -> PrimFunc:
    taken = {p.name for p in func.params} | {func.name}
    return _Renamer(taken).visit_func(func)


def unique_names(module: Module) -> Module:
    return module.with_kernels([unique_names_func(k) for k in module.kernels])
