"""Edits of a kernel's statements that break the one-pass ("last block combines") protocol, for
the tests that check the emulator catches each broken variant (tests/test_split_reduce_last_block.py,
tests/test_split_rows_last_block.py). Not a test module: tests/ is on sys.path."""

from tecc.ir.expr import Call
from tecc.ir.stmt import Evaluate, IfThenElse, Seq, Stmt, seq
from tecc.ir.visitor import StmtMutator


class Edit(StmtMutator):
    """Drops the statements `drop(previous, statement, next)` picks from every sequence, and
    replaces a statement by `swap(statement)` where that is not None."""

    def __init__(self, drop=None, swap=None):
        self.drop = drop or (lambda prev, s, nxt: False)
        self.swap = swap or (lambda s: None)

    def visit(self, s: Stmt) -> Stmt:  # type: ignore[override]
        new = self.swap(s)
        return new if new is not None else super().visit(s)

    def visit_Seq(self, s: Seq) -> Stmt:
        items = [self.visit(x) for x in s.stmts]
        kept = [x for n, x in enumerate(items)
                if not self.drop(items[n - 1] if n else None, x, items[n + 1] if n + 1 < len(items) else None)]
        return seq(*kept)


def holds_atomic(s) -> bool:
    """The leader's `if` around the arrival count."""
    return isinstance(s, IfThenElse) and "atomic_add" in str(s.then_case)


def is_fence(s) -> bool:
    return isinstance(s, Evaluate) and isinstance(s.value, Call) and s.value.name == "thread_fence"
