"""One visitor and one mutator for expressions and statements (the expression ones are in
expr_visitor.py and re-exported here).

Dispatch is by node class name: `visit_Binary`, `visit_For`, ... A mutator that changes nothing
returns the very same node, so unchanged subtrees stay shared and passes stay cheap. Expression
results are memoized per mutator instance (expressions are hash-consed, so a shared subexpression
is rewritten once).
"""

from __future__ import annotations

from typing import Any

from .expr import Expr
from .expr_visitor import ExprMutator as ExprMutator
from .expr_visitor import ExprVisitor as ExprVisitor
from .expr_visitor import SubexpressionReplacer as SubexpressionReplacer
from .expr_visitor import VarSubstituter as VarSubstituter
from .expr_visitor import visit_method
from .stmt import (Allocate, AsyncCopy, Barrier, BarrierRef, BulkCopy, BufferStore, Evaluate, For, FragmentRef,
                   IfThenElse, Instruction, LetStmt, MatrixLoad, MatrixMultiply, PrimFunc, Seq, SharedMatrix, Stmt,
                   TensorCopy, TensorStore, WarpgroupMatrixMultiply)

# Statements whose expressions `matrix_stmt_exprs` lists.
_MATRIX = (MatrixMultiply, MatrixLoad, AsyncCopy, WarpgroupMatrixMultiply, BulkCopy, TensorCopy, TensorStore,
           Instruction)


class StmtVisitor:
    """Walks statements (and, through `visit_expr`, the expressions in them). Dispatch is by node
    class (`visit_method`): a subclass overrides `visit_<Node>` for the nodes it handles (the
    matrix-level ones included: `visit_MatrixMultiply`, `visit_TensorCopy`, ...) and every other
    node reaches `generic_visit`."""

    def visit(self, s: Stmt) -> Any:
        return visit_method(self, "visit_", s)(s)

    def visit_expr(self, e: Expr) -> None:
        """Called on every expression a statement holds; override to inspect them."""

    def generic_visit(self, s: Stmt) -> None:
        if isinstance(s, For):
            self.visit_expr(s.min)
            self.visit_expr(s.extent)
            self.visit(s.body)
        elif isinstance(s, BufferStore):
            for i in s.indices:
                self.visit_expr(i)
            self.visit_expr(s.value)
        elif isinstance(s, Allocate):
            self.visit(s.body)
        elif isinstance(s, IfThenElse):
            self.visit_expr(s.cond)
            self.visit(s.then_case)
            if s.else_case is not None:
                self.visit(s.else_case)
        elif isinstance(s, LetStmt):
            self.visit_expr(s.value)
            self.visit(s.body)
        elif isinstance(s, Seq):
            for x in s.stmts:
                self.visit(x)
        elif isinstance(s, Evaluate):
            self.visit_expr(s.value)
        elif isinstance(s, Barrier):
            pass
        elif isinstance(s, _MATRIX):
            for e in matrix_stmt_exprs(s):
                self.visit_expr(e)
        else:
            raise TypeError(f"StmtVisitor: no rule for {type(s).__name__}")


def matrix_stmt_exprs(s: Stmt) -> list[Expr]:
    """The expressions a matrix-level statement holds: fragment offsets, addresses, predicate,
    descriptor starts, barrier indices and counts."""
    if isinstance(s, WarpgroupMatrixMultiply):
        a = s.a.start if isinstance(s.a, SharedMatrix) else s.a.offset
        return [s.d.offset, a, s.b.start, s.scale_d]
    if isinstance(s, Instruction):
        return s.exprs()
    if isinstance(s, BulkCopy):
        return [*s.dst_indices, *s.src_indices, s.bar.index]
    if isinstance(s, TensorCopy):
        return [*s.dst_indices, *s.coords, s.bar.index]
    if isinstance(s, TensorStore):
        return [*s.src_indices, *s.coords]
    if isinstance(s, MatrixMultiply):
        return [s.d.offset, s.a.offset, s.b.offset, s.c.offset]
    if isinstance(s, MatrixLoad):
        return [s.dst.offset, *s.src_indices]
    if isinstance(s, AsyncCopy):
        return [*s.dst_indices, *s.src_indices] + ([s.predicate] if s.predicate is not None else [])
    return []


class StmtMutator:
    """Rebuilds statements bottom-up, returning unchanged nodes as they are.

    Expressions inside statements go through `visit_expr` (identity by default); set
    `expr_mutator` to rewrite them with an ExprMutator."""

    expr_mutator: ExprMutator | None = None

    def visit(self, s: Stmt) -> Stmt:
        out: Stmt = visit_method(self, "visit_", s)(s)
        return out

    def visit_expr(self, e: Expr) -> Expr:
        return self.expr_mutator.visit(e) if self.expr_mutator is not None else e

    def visit_func(self, f: PrimFunc) -> PrimFunc:
        return f.with_body(self.visit(f.body))

    def generic_visit(self, s: Stmt) -> Stmt:
        if isinstance(s, For):
            mn, ext, body = self.visit_expr(s.min), self.visit_expr(s.extent), self.visit(s.body)
            if mn is s.min and ext is s.extent and body is s.body:
                return s
            return For(s.var, mn, ext, s.kind, body, s.annotations)
        if isinstance(s, BufferStore):
            idx = tuple(self.visit_expr(i) for i in s.indices)
            val = self.visit_expr(s.value)
            if val is s.value and all(x is y for x, y in zip(idx, s.indices)):
                return s
            return BufferStore(s.buffer, idx, val)
        if isinstance(s, Allocate):
            body = self.visit(s.body)
            return s if body is s.body else Allocate(s.buffer, body)
        if isinstance(s, IfThenElse):
            c = self.visit_expr(s.cond)
            t = self.visit(s.then_case)
            f = self.visit(s.else_case) if s.else_case is not None else None
            if c is s.cond and t is s.then_case and f is s.else_case:
                return s
            return IfThenElse(c, t, f)
        if isinstance(s, LetStmt):
            v, body = self.visit_expr(s.value), self.visit(s.body)
            return s if (v is s.value and body is s.body) else LetStmt(s.var, v, body)
        if isinstance(s, Seq):
            stmts = tuple(self.visit(x) for x in s.stmts)
            return s if all(x is y for x, y in zip(stmts, s.stmts)) else Seq(stmts)
        if isinstance(s, Evaluate):
            v = self.visit_expr(s.value)
            return s if v is s.value else Evaluate(v)
        if isinstance(s, Barrier):
            return s
        if isinstance(s, Instruction):
            return s.with_operands(tuple(self._operand(o.kind, v) for o, v in zip(s.row.operands, s.operands)))
        hopper = self._hopper(s)
        if hopper is not None:
            return hopper
        if isinstance(s, MatrixMultiply):
            refs = tuple(self._fragment(r) for r in (s.d, s.a, s.b, s.c))
            if all(x is y for x, y in zip(refs, (s.d, s.a, s.b, s.c))):
                return s
            return MatrixMultiply(s.intrinsic, *refs)
        if isinstance(s, MatrixLoad):
            dst = self._fragment(s.dst)
            idx = tuple(self.visit_expr(i) for i in s.src_indices)
            if dst is s.dst and all(x is y for x, y in zip(idx, s.src_indices)):
                return s
            return MatrixLoad(s.intrinsic, dst, s.src, idx)
        if isinstance(s, AsyncCopy):
            di = tuple(self.visit_expr(i) for i in s.dst_indices)
            si = tuple(self.visit_expr(i) for i in s.src_indices)
            p = self.visit_expr(s.predicate) if s.predicate is not None else None
            if p is s.predicate and all(x is y for x, y in zip(di + si, s.dst_indices + s.src_indices)):
                return s
            return AsyncCopy(s.dst, di, s.src, si, s.bytes, p, s.cache, s.unit_stride_at_launch, s.along)
        raise TypeError(f"StmtMutator: no rule for {type(s).__name__}")

    def _hopper(self, s: Stmt) -> Stmt | None:
        """The warpgroup and mbarrier statements rebuilt (or `s` itself), None for other statements."""
        if isinstance(s, WarpgroupMatrixMultiply):
            d, b = self._fragment(s.d), self._shared_matrix(s.b)
            a = self._shared_matrix(s.a) if isinstance(s.a, SharedMatrix) else self._fragment(s.a)
            scale = self.visit_expr(s.scale_d)
            if d is s.d and a is s.a and b is s.b and scale is s.scale_d:
                return s
            return WarpgroupMatrixMultiply(s.intrinsic, d, a, b, scale)
        if isinstance(s, BulkCopy):
            di = tuple(self.visit_expr(i) for i in s.dst_indices)
            si = tuple(self.visit_expr(i) for i in s.src_indices)
            bar = self._barrier(s.bar)
            if bar is s.bar and all(x is y for x, y in zip(di + si, s.dst_indices + s.src_indices)):
                return s
            return BulkCopy(s.dst, di, s.src, si, s.bytes, bar)
        if isinstance(s, TensorCopy):
            di = tuple(self.visit_expr(i) for i in s.dst_indices)
            co = tuple(self.visit_expr(i) for i in s.coords)
            bar = self._barrier(s.bar)
            if bar is s.bar and all(x is y for x, y in zip(di + co, s.dst_indices + s.coords)):
                return s
            return TensorCopy(s.dst, di, s.map, co, bar)
        if isinstance(s, TensorStore):
            si = tuple(self.visit_expr(i) for i in s.src_indices)
            co = tuple(self.visit_expr(i) for i in s.coords)
            if all(x is y for x, y in zip(si + co, s.src_indices + s.coords)):
                return s
            return TensorStore(s.src, si, s.map, co)
        return None

    def _operand(self, kind: str, value: Any) -> Any:
        """An instruction's operand with its expressions rewritten (the very value if unchanged)."""
        if kind == "expr":
            return self.visit_expr(value)
        if kind == "barrier":
            return self._barrier(value)
        return value

    def _shared_matrix(self, ref: SharedMatrix) -> SharedMatrix:
        start = self.visit_expr(ref.start)
        return ref if start is ref.start else SharedMatrix(ref.buffer, start, ref.descriptor)

    def _barrier(self, ref: BarrierRef) -> BarrierRef:
        index = self.visit_expr(ref.index)
        return ref if index is ref.index else BarrierRef(ref.buffer, index)

    def _fragment(self, ref: FragmentRef) -> FragmentRef:
        offset = self.visit_expr(ref.offset)
        return ref if offset is ref.offset else FragmentRef(ref.buffer, offset)

