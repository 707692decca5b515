"""Substitution of variables inside statements."""

from __future__ import annotations

from typing import Mapping

from ..ir.expr import Expr, Var, substitute
from ..ir.stmt import Stmt
from ..ir.visitor import ExprMutator, StmtMutator


class _VarSubstituter(ExprMutator):
    def __init__(self, mapping: Mapping[Var, Expr]) -> None:
        super().__init__()
        self.mapping = mapping

    def visit_Var(self, v: Var) -> Expr:
        return self.mapping.get(v, v)


def substitute_stmt(s: Stmt, mapping: Mapping[Var, Expr]) -> Stmt:
    """`s` with every occurrence of a variable in `mapping` replaced by its expression."""
    m = StmtMutator()
    m.expr_mutator = _VarSubstituter(mapping)
    return m.visit(s)


__all__ = ["substitute_stmt", "substitute"]
