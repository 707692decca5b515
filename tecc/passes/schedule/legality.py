"""Legality of a schedule change, decided on dependences computed with islpy (tecc.ir.poly).

A primitive describes the schedule it wants as a new schedule vector per statement of the
*current* IR (a permutation of loop entries for `reorder`, a group index before a loop for
loop distribution); it is legal when every dependence source still runs before its sink.
A loop may run its iterations in parallel (`bind`) when it carries no dependence.

Reductions: the update `acc[x] = acc[x] op value` of a reduction with op in + * max min (and a
value that does not read acc) may run its instances in any order, because those combiners are
associative and commutative. `reorder` therefore ignores the dependences of such an update on
itself. Floating-point + and * are associative only up to rounding: a reordered float sum gives a
result that differs from the serial one in the last bits (docs/schedule.md).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Callable, Sequence

from ...ir import poly
from ...ir.errors import ScheduleError
from ...ir.expr import Binary, BufferLoad, Var
from ...ir.stmt import BufferStore, For, PrimFunc
from .loops import reads_buffer

ASSOCIATIVE = ("+", "*", "min", "max", "fmin", "fmax")

# Set while the planner applies again the point its primitives took for a twin of the kernel (the
# same loops and accesses up to names: tecc/compiler/rankings.py, Schedule.deferring): the
# dependences are the twin's, which these checks passed, so they are not computed again.
TRUSTED: ContextVar[bool] = ContextVar("tecc_legality_trusted", default=False)


def is_reduction_update(node: object) -> bool:
    """`acc[x] = acc[x] op value` with an associative, commutative op and value free of acc."""
    if not isinstance(node, BufferStore) or not isinstance(node.value, Binary):
        return False
    v = node.value
    if v.op not in ASSOCIATIVE:
        return False
    for self_side, other in ((v.a, v.b), (v.b, v.a)):
        if (isinstance(self_side, BufferLoad) and self_side.buffer is node.buffer
                and all(a is b for a, b in zip(self_side.indices, node.indices))
                and not reads_buffer(other, node.buffer)):
            return True
    return False


def default_entries(s: poly.PolyStmt) -> list[object]:
    out: list[object] = []
    for k, lp in enumerate(s.loops):
        out += [s.positions[k], lp.var]
    out.append(s.positions[len(s.loops)])
    return out


def _describe(deps: poly.Dependences, bad: object) -> str:
    """Name the two statements of one violated dependence."""
    by_name = {s.name: s for s in deps.space.stmts}
    try:
        m = bad.get_map_list().get_at(0)  # type: ignore[attr-defined]
        import islpy as isl

        src = by_name.get(m.get_tuple_name(isl.dim_type.in_))
        dst = by_name.get(m.get_tuple_name(isl.dim_type.out))
    except Exception:  # pragma: no cover - description only
        return ""
    if src is None or dst is None:
        return ""
    return f": `{str(dst.node).strip()}` depends on `{str(src.node).strip()}`"


def check_schedule(func: PrimFunc, what: str, entries: Callable[[poly.PolyStmt], Sequence[object]],
                   reductions_commute: bool) -> None:
    """Raise ScheduleError when the schedule given by `entries` breaks a dependence of `func`
    (nothing is checked under TRUSTED)."""
    if TRUSTED.get():
        return
    # the unordered dependences (pairs in both directions) and one map to the old schedule
    # followed by the new: poly.keeps_order asks the question without the lexicographic order
    # of the old schedule (`dependences(ordered=True)`) and of the new (`respects`), the costly
    # isl steps; only a refused schedule pays them, to name a dependence it breaks
    deps = poly.dependences(func.body, ordered=False)
    rel = deps.relation
    if reductions_commute:
        rel = deps.without_self(s.name for s in deps.space.stmts if is_reduction_update(s.node))
    if poly.keeps_order(rel, *order_map(deps.space, entries)):
        return
    rel = rel.intersect(deps.schedule.lex_lt_union_map(deps.schedule))
    new = deps.space.union([deps.space.schedule_piece(s, list(entries(s))) for s in deps.space.stmts])
    bad = rel.subtract(new.lex_lt_union_map(new))
    raise ScheduleError(f"{what} is illegal: it would run a dependence backwards{_describe(deps, bad)}")


def order_map(space: poly.StmtSpace, entries: Callable[[poly.PolyStmt], Sequence[object]]
              ) -> tuple[object, int, int]:
    """The map of every statement instance to its current schedule vector followed by the one
    `entries` gives, and the two vectors' lengths (poly.keeps_order's arguments)."""
    width = 2 * space.depth + 3
    old_rows = [_padded(default_entries(s), width) for s in space.stmts]
    new_rows = [_padded(list(entries(s)), width) for s in space.stmts]
    # entries that are one constant in every statement (the padding, most loop positions) differ
    # by zero in every pair and never decide an order: left out, the isl space is half as wide
    old_keep, new_keep = _varying(old_rows), _varying(new_rows)
    rows = [[r[k] for k in old_keep] + [n[k] for k in new_keep] for r, n in zip(old_rows, new_rows)]
    both = space.union([space.schedule_piece(s, row, len(row)) for s, row in zip(space.stmts, rows)])
    return both, len(old_keep), len(new_keep)


def _varying(rows: Sequence[Sequence[object]]) -> list[int]:
    """The columns of `rows` that are not one integer in every row."""
    out = []
    for k in range(len(rows[0]) if rows else 0):
        col = [r[k] for r in rows]
        if not (isinstance(col[0], int) and all(isinstance(c, int) and c == col[0] for c in col)):
            out.append(k)
    return out


def _padded(entries: Sequence[object], width: int) -> list[object]:
    return list(entries) + [0] * (width - len(entries))


def check_parallel(func: PrimFunc, loop: For, what: str) -> None:
    """Raise ScheduleError when `loop` carries a dependence (its iterations are not independent;
    nothing is checked under TRUSTED)."""
    if TRUSTED.get():
        return
    deps = poly.dependences(func.body, ordered=False)  # carried or not is the same in both directions
    level = None
    for s in deps.space.stmts:
        for d, lp in enumerate(s.loops):
            if lp.var is loop.var:
                level = 2 * d + 1
                break
        if level is not None:
            break
    if level is None:
        return  # no statement under the loop
    import islpy as isl

    # only dependences between two statements under this loop: other loops at the same depth
    # have the same schedule level but are not this loop
    under = [s for s in deps.space.stmts if any(lp.var is loop.var for lp in s.loops)]
    universe = "; ".join(f"{s.name}[{', '.join(f'x{k}' for k in range(len(s.loops)))}]" for s in under)
    inside = isl.UnionSet(f"{{ {universe} }}")
    rel = deps.relation.intersect_domain(inside).intersect_range(inside)
    if poly.carried_at(rel, deps.schedule, level):
        raise ScheduleError(
            f"{what} is illegal: loop {loop.var.name} carries a dependence (an iteration uses a value "
            "another iteration computes, e.g. a reduction over it), so its iterations cannot run in parallel"
        )


def loop_vars(s: poly.PolyStmt) -> list[Var]:
    return [lp.var for lp in s.loops]
