"""Substitution of variables inside statements."""

from __future__ import annotations

from typing import Mapping

from ..ir.expr import Expr, Var, substitute
from ..ir.stmt import Stmt
from ..ir.visitor import StmtMutator, VarSubstituter


def substitute_stmt(s: Stmt, mapping: Mapping[Var, Expr]) -> Stmt:
    """`s` with every occurrence of a variable in `mapping` replaced by its expression."""
    m = StmtMutator()
    m.expr_mutator = VarSubstituter(mapping)
    return m.visit(s)


__all__ = ["substitute_stmt", "substitute"]
