"""Finding loops and stages in a kernel, rewriting one node, and fresh names.

Schedule primitives address loops by the name of their variable: Vars are identities and every
primitive rebuilds the tree, so a name is what survives a rewrite. Names inside one kernel are
kept unique by the primitives (lowering starts them unique; every new loop gets `fresh_name`).
"""

from __future__ import annotations

from typing import Callable, Iterator

from ...ir.errors import ScheduleError
from ...ir.expr import ATOMIC_INTRINSICS, BufferLoad, Call, Const, Expr, walk
from ...ir.stmt import (
    Allocate,
    Buffer,
    BufferStore,
    Evaluate,
    For,
    IfThenElse,
    LetStmt,
    PrimFunc,
    Seq,
    Stmt,
)
from ...ir.visitor import StmtMutator


def iter_with_path(s: Stmt, path: tuple[Stmt, ...] = ()) -> Iterator[tuple[Stmt, tuple[Stmt, ...]]]:
    """Every statement under `s` with its ancestors (outermost first), pre-order."""
    yield s, path
    inner = path + (s,)
    if isinstance(s, Seq):
        for x in s.stmts:
            yield from iter_with_path(x, inner)
    elif isinstance(s, (For, Allocate, LetStmt)):
        yield from iter_with_path(s.body, inner)
    elif isinstance(s, IfThenElse):
        yield from iter_with_path(s.then_case, inner)
        if s.else_case is not None:
            yield from iter_with_path(s.else_case, inner)


def find_loop(func: PrimFunc, name: str) -> tuple[For, tuple[Stmt, ...]]:
    """The loop of `func` whose variable is called `name`, with its ancestors."""
    for s, path in iter_with_path(func.body):
        if isinstance(s, For) and s.var.name == name:
            return s, path
    loops = ", ".join(s.var.name for s, _ in iter_with_path(func.body) if isinstance(s, For))
    raise ScheduleError(f"kernel {func.name} has no loop {name!r}; its loops are: {loops}")


def loops_on_path(path: tuple[Stmt, ...]) -> list[For]:
    return [s for s in path if isinstance(s, For)]


def leaves(s: Stmt) -> list[Stmt]:
    """The leaf statements (stores, evaluates) under `s`."""
    return [x for x, _ in iter_with_path(s) if isinstance(x, (BufferStore, Evaluate))]


def stage_of(buffer: Buffer) -> str:
    return buffer.tensor


def stage_leaves(func: PrimFunc, stage: str) -> list[tuple[Stmt, tuple[Stmt, ...]]]:
    """The stores of `func` that compute `stage`: into its buffer, its accumulator or its write
    cache, and the atomic additions into them (a scatter's, tecc/passes/rewrite/scatter_atomic.py)."""
    out = []
    names = (stage, f"{stage}.acc", f"{stage}.local")
    for s, path in iter_with_path(func.body):
        if isinstance(s, BufferStore) and s.buffer.tensor in names:
            out.append((s, path))
        elif isinstance(s, Evaluate) and _atomic_target(s) in names:
            out.append((s, path))
    return out


def _atomic_target(s: Evaluate) -> str | None:
    """The stage an `atomic_add` statement adds into, or None."""
    v = s.value
    if isinstance(v, Call) and v.name in ATOMIC_INTRINSICS and isinstance(v.args[0], BufferLoad):
        return v.args[0].buffer.tensor  # type: ignore[no-any-return]
    return None


def stage_loops(func: PrimFunc, stage: str) -> list[For]:
    """Every loop that encloses a store of `stage`, in pre-order (outer and earlier first)."""
    wanted: set[int] = set()
    for _, path in stage_leaves(func, stage):
        wanted |= {id(x) for x in loops_on_path(path)}
    return [s for s, _ in iter_with_path(func.body) if isinstance(s, For) and id(s) in wanted]


def all_names(func: PrimFunc) -> set[str]:
    """Every variable and buffer name of a kernel (its parameters included)."""
    names = {p.name for p in func.params} | {func.name}
    for s, _ in iter_with_path(func.body):
        if isinstance(s, (For, LetStmt)):
            names.add(s.var.name)
        elif isinstance(s, Allocate):
            names.add(s.buffer.name)
    return names


def fresh_name(taken: set[str], base: str) -> str:
    cand, n = base, 0
    while cand in taken:
        n += 1
        cand = f"{base}{n}"
    taken.add(cand)
    return cand


class _Replace(StmtMutator):
    def __init__(self, old: Stmt, new: Stmt) -> None:
        self.old = old
        self.new = new

    def visit(self, s: Stmt) -> Stmt:
        if s is self.old:
            return self.new
        return self.generic_visit(s)


def replace_stmt(root: Stmt, old: Stmt, new: Stmt) -> Stmt:
    """`root` with the node `old` (by identity) replaced by `new`."""
    return _Replace(old, new).visit(root)


def with_body(loop: For, body: Stmt) -> For:
    return For(loop.var, loop.min, loop.extent, loop.kind, body, loop.annotations)


def reads_buffer(e: Expr, buffer: Buffer) -> bool:
    return any(isinstance(n, BufferLoad) and n.buffer is buffer for n in walk(e))


def rebuffer(s: Stmt, old: Buffer, new: Buffer, indices: "Callable[[tuple[Expr, ...]], tuple[Expr, ...]]") -> Stmt:
    """`s` with every load and store of `old` turned into one of `new` at `indices(old indices)`."""
    from ...ir.visitor import ExprMutator

    class _Loads(ExprMutator):
        def visit_BufferLoad(self, e: BufferLoad) -> Expr:
            idx = tuple(self.visit(i) for i in e.indices)
            if e.buffer is old:
                return BufferLoad(new, indices(idx))
            return e if all(a is b for a, b in zip(idx, e.indices)) else BufferLoad(e.buffer, idx)

    class _Stores(StmtMutator):
        def visit_BufferStore(self, st: BufferStore) -> Stmt:
            idx = tuple(self.visit_expr(i) for i in st.indices)
            val = self.visit_expr(st.value)
            if st.buffer is old:
                return BufferStore(new, indices(idx), val)
            if val is st.value and all(a is b for a, b in zip(idx, st.indices)):
                return st
            return BufferStore(st.buffer, idx, val)

    m = _Stores()
    m.expr_mutator = _Loads()
    return m.visit(s)


def rewrite_guards(func: PrimFunc, new_conditions: dict[int, Expr]) -> PrimFunc:
    """`func` with the condition of each IfThenElse whose id is in `new_conditions` replaced by
    the new one (an `if` with no else whose new condition is the constant True is dropped)."""

    class _Rewrite(StmtMutator):
        def visit_IfThenElse(self, s: IfThenElse) -> Stmt:
            cond = new_conditions.get(id(s))
            if cond is None:
                return self.generic_visit(s)
            if isinstance(cond, Const) and bool(cond.value) and s.else_case is None:
                return s.then_case
            return IfThenElse(cond, s.then_case, s.else_case)

    return func.with_body(_Rewrite().visit(func.body))
