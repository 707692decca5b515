"""The visitor and the mutator of expressions, and the substitution built on them.

Part of tecc.ir.visitor (which re-exports every name here next to the statement visitor and
mutator): expressions need them below the statements, for `tecc.ir.expr.substitute`.

Dispatch is by node class name: `visit_Binary`, `visit_Var`, ... A mutator that changes nothing
returns the very same node, so unchanged subtrees stay shared and passes stay cheap. Expression
results are memoized per mutator instance (expressions are hash-consed, so a shared subexpression
is rewritten once).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from .arith import binary, compare, select
from .expr_nodes import Binary, BufferLoad, Call, Cast, Compare, Const, Expr, Not, Reduce, Select, TensorRead, Var


def visit_method(obj: Any, prefix: str, node: Any) -> Callable[[Any], Any]:
    """The most specific `visit_<Class>` for `node`, following its class hierarchy
    (so `visit_Var` also sees IterVar and ReduceAxis), else `generic_visit`. A node with a
    `dispatch_name` (an instruction statement: its row's constructor, e.g. WarpgroupWait) answers
    to `visit_<dispatch_name>` first. The method's name is found once per visitor class and node
    class (and dispatch name), kept in the visitor class's own table."""
    table: dict[tuple[Any, ...], str] | None = type(obj).__dict__.get("_visit_methods")
    if table is None:
        table = {}
        setattr(type(obj), "_visit_methods", table)
    kind = type(node)
    name = table.get((prefix, kind))
    if name is None:
        name = table[(prefix, kind)] = _NAMED if hasattr(kind, "dispatch_name") else _method_name(
            type(obj), prefix, kind, None)
    if name is _NAMED:
        named = node.dispatch_name
        name = table.get((prefix, kind, named))
        if name is None:
            name = table[(prefix, kind, named)] = _method_name(type(obj), prefix, kind, named)
    return getattr(obj, name)  # type: ignore[no-any-return]


_NAMED = "(by its dispatch name)"   # a node class whose nodes answer to their dispatch name first


def _method_name(visitor: type, prefix: str, kind: type, named: str | None) -> str:
    """The name of the method `visit_method` takes for a node of class `kind` (with dispatch
    name `named`) on a visitor of class `visitor`."""
    if named is not None and getattr(visitor, prefix + named, None) is not None:
        return prefix + named
    for klass in kind.__mro__:
        if getattr(visitor, prefix + klass.__name__, None) is not None:
            return prefix + klass.__name__
    return "generic_visit"


class ExprVisitor:
    """Walks an expression tree; override `visit_<Node>` and call `self.generic_visit(e)` to recurse."""

    def visit(self, e: Expr) -> Any:
        return visit_method(self, "visit_", e)(e)

    def generic_visit(self, e: Expr) -> None:
        if isinstance(e, TensorRead):
            for i in e.indices:
                self.visit(i)
            return
        for c in e.children:
            self.visit(c)


class ExprMutator:
    """Rebuilds an expression bottom-up; nodes whose children did not change are returned as they are."""

    def __init__(self) -> None:
        self._memo: dict[int, tuple[Expr, Expr]] = {}

    def visit(self, e: Expr) -> Expr:
        hit = self._memo.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        out: Expr = visit_method(self, "visit_", e)(e)
        self._memo[id(e)] = (e, out)
        return out

    def generic_visit(self, e: Expr) -> Expr:
        if isinstance(e, (Const, Var)):
            return e
        if isinstance(e, Binary):
            a, b = self.visit(e.a), self.visit(e.b)
            return e if (a is e.a and b is e.b) else binary(e.op, a, b)
        if isinstance(e, Compare):
            a, b = self.visit(e.a), self.visit(e.b)
            return e if (a is e.a and b is e.b) else compare(e.op, a, b)
        if isinstance(e, Not):
            a = self.visit(e.a)
            return e if a is e.a else Not(a)
        if isinstance(e, Cast):
            a = self.visit(e.a)
            return e if a is e.a else (Cast(e.dtype, a) if a.dtype != e.dtype else a)
        if isinstance(e, Select):
            c, a, b = self.visit(e.cond), self.visit(e.a), self.visit(e.b)
            return e if (c is e.cond and a is e.a and b is e.b) else select(c, a, b)
        if isinstance(e, Call):
            args = tuple(self.visit(a) for a in e.args)
            return e if all(x is y for x, y in zip(args, e.args)) else e.with_args(args)
        if isinstance(e, Reduce):
            src = self.visit(e.source)
            return e if src is e.source else Reduce(e.combiner, src, e.axes)
        if isinstance(e, TensorRead):
            idx = tuple(self.visit(i) for i in e.indices)
            return e if all(x is y for x, y in zip(idx, e.indices)) else TensorRead(e.tensor, idx)
        if isinstance(e, BufferLoad):
            idx = tuple(self.visit(i) for i in e.indices)
            return e if all(x is y for x, y in zip(idx, e.indices)) else BufferLoad(e.buffer, idx)
        rebuild = getattr(e, "with_children", None)
        if rebuild is not None:  # a node defined above this module (tc.rand's RandomUniform) rebuilds itself
            kids = tuple(self.visit(c) for c in e.children)
            return e if all(x is y for x, y in zip(kids, e.children)) else rebuild(kids)
        raise TypeError(f"ExprMutator: no rule for {type(e).__name__}")


class VarSubstituter(ExprMutator):
    """Replaces each variable in `mapping` by its expression (the one substitution mutator:
    `expr.substitute` for an expression, `passes.substitute.substitute_stmt` for a statement)."""

    def __init__(self, mapping: Mapping[Var, Expr]) -> None:
        super().__init__()
        self.mapping = mapping

    def visit_Var(self, v: Var) -> Expr:
        return self.mapping.get(v, v)


class SubexpressionReplacer(ExprMutator):
    """Replaces whole subexpressions, found by identity (expressions are hash-consed, so "the same
    expression" is one node), with the given expressions; what is replaced is not visited again."""

    def __init__(self, mapping: Mapping[Expr, Expr]) -> None:
        super().__init__()
        self._by_id = {id(e): (e, v) for e, v in mapping.items()}

    def visit(self, e: Expr) -> Expr:
        hit = self._by_id.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        return super().visit(e)
