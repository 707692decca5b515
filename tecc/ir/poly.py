"""Polyhedral analyses with islpy.

Expressions are translated to isl's Presburger syntax when they are quasi-affine (sums, products
by constants, floor division and modulo by positive constants, min/max); anything else makes an
analysis answer "unknown" rather than guess. Size variables become isl parameters (assumed >= 0),
iteration variables become set dimensions bounded by their ranges.

islpy >= 2026.2 dropped the implicit BasicSet -> Set conversions; every conversion here is explicit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import islpy as isl

from .expr import Binary, Cast, Compare, Const, Expr, IterVar, Not, Var, free_vars


class _Names:
    """Stable isl names for tecc variables (tecc names may repeat; isl names may not)."""

    def __init__(self) -> None:
        self.by_var: dict[Var, str] = {}

    def __call__(self, v: Var) -> str:
        name = self.by_var.get(v)
        if name is None:
            name = f"{v.name}_{len(self.by_var)}"
            self.by_var[v] = name
        return name


def affine_text(e: Expr, names: _Names) -> str | None:
    """`e` in isl syntax, or None when it is not quasi-affine."""
    if isinstance(e, Const):
        return str(int(e.value)) if e.dtype.is_int else None
    if isinstance(e, Var):
        return names(e) if e.dtype.is_int else None
    if isinstance(e, Cast):
        return affine_text(e.a, names) if (e.dtype.is_int and e.a.dtype.is_int) else None
    if isinstance(e, Binary) and e.dtype.is_int:
        a, b = affine_text(e.a, names), affine_text(e.b, names)
        if a is None or b is None:
            return None
        if e.op in ("+", "-"):
            return f"({a} {e.op} {b})"
        if e.op == "*":
            if isinstance(e.a, Const) or isinstance(e.b, Const):
                return f"({a} * {b})"
            return None
        if e.op in ("min", "max"):
            return f"{e.op}({a}, {b})"
        if e.op in ("//", "%") and isinstance(e.b, Const) and int(e.b.value) > 0:
            return f"floor({a} / {b})" if e.op == "//" else f"({a} mod {b})"
    return None


_CMP = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "="}
_NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}


def condition_text(e: Expr, names: _Names) -> str | None:
    """A bool expression as an isl constraint, or None when it is not a Presburger formula."""
    if isinstance(e, Const) and e.dtype.is_bool:
        return "true" if e.value else "false"
    if isinstance(e, Compare) and e.op in _CMP:
        a, b = affine_text(e.a, names), affine_text(e.b, names)
        if a is None or b is None:
            return None
        return f"{a} {_CMP[e.op]} {b}"
    if isinstance(e, Not) and isinstance(e.a, Compare) and e.a.op in _NEGATED:
        return condition_text(Compare(_NEGATED[e.a.op], e.a.a, e.a.b), names)
    if isinstance(e, Binary) and e.dtype.is_bool and e.op in ("&", "|"):
        a, b = condition_text(e.a, names), condition_text(e.b, names)
        if a is None or b is None:
            return None
        return f"(({a}) {'and' if e.op == '&' else 'or'} ({b}))"
    return None


@dataclass(frozen=True)
class Violation:
    """A point of the iteration domain where an index leaves its bounds."""

    point: dict[str, int]
    index_value: int | None

    def __str__(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.point.items())
        return f"at {where}" if where else "for every point"


def _domain(iter_vars: Iterable[IterVar], conditions: Sequence[Expr], names: _Names,
            extra: Sequence[str]) -> tuple[str, list[str], list[str]] | None:
    """The isl text of a domain, its set dimensions and its parameters; None if not affine."""
    constraints: list[str] = []
    dims: list[str] = []
    for v in iter_vars:
        lo, ext = affine_text(v.lo, names), affine_text(v.extent, names)
        if lo is None or ext is None:
            return None
        n = names(v)
        dims.append(n)
        constraints.append(f"{lo} <= {n} < {lo} + {ext}")
    for c in conditions:
        t = condition_text(c, names)
        if t is None:
            return None
        constraints.append(t)
    constraints.extend(extra)
    params = [n for v, n in names.by_var.items() if n not in dims]
    for v, n in names.by_var.items():
        if n in params and v.kind == "size":
            constraints.append(f"{n} >= 0")
    return " and ".join(constraints) or "true", dims, params


def find_out_of_bounds(index: Expr, extent: Expr, conditions: Sequence[Expr] = ()) -> Violation | None:
    """A point where `index` falls outside [0, extent), given that every iteration variable in it
    ranges over its domain and `conditions` hold; None when no such point exists or when the
    question is not affine (then nothing can be proved either way)."""
    names = _Names()
    idx, ext = affine_text(index, names), affine_text(extent, names)
    if idx is None or ext is None:
        return None
    cond_vars: set[Var] = set()
    for c in conditions:
        cond_vars |= free_vars(c)
    iter_vars = sorted({v for v in free_vars(index) | cond_vars if isinstance(v, IterVar)},
                       key=lambda v: names(v))
    # make the extents' own variables known before the domain is written
    for v in iter_vars:
        for e in (v.lo, v.extent):
            for fv in free_vars(e):
                names(fv)
    dom = _domain(iter_vars, conditions, names, [f"({idx} < 0 or {idx} >= {ext})"])
    if dom is None:
        return None
    text, dims, params = dom
    if any(isinstance(v, IterVar) and names(v) not in dims for v in names.by_var):
        return None  # an iteration variable of an extent is itself unbounded here: unknown
    src = f"[{', '.join(params)}] -> {{ [{', '.join(dims)}] : {text} }}"
    bad = isl.Set(src)
    if bad.is_empty():
        return None
    pt = bad.sample_point()
    point: dict[str, int] = {}
    space = pt.get_space()
    inverse = {n: v.name for v, n in names.by_var.items()}
    for kind in (isl.dim_type.param, isl.dim_type.set):
        for pos in range(space.dim(kind)):
            isl_name = space.get_dim_name(kind, pos)
            point[inverse.get(isl_name, isl_name)] = int(pt.get_coordinate_val(kind, pos).to_python())
    return Violation(point, None)


def is_provably_true(cond: Expr, iter_vars: Sequence[IterVar], context: Sequence[Expr] = ()) -> bool:
    """True when `cond` holds at every point of the iteration domain (under `context`).
    False means "not proved" (it may still hold)."""
    names = _Names()
    neg = condition_text(cond, names)
    if neg is None:
        return False
    for v in iter_vars:
        for e in (v.lo, v.extent):
            for fv in free_vars(e):
                names(fv)
    dom = _domain(iter_vars, context, names, [f"not ({neg})"])
    if dom is None:
        return False
    text, dims, params = dom
    if any(isinstance(v, IterVar) and names(v) not in dims for v in names.by_var):
        return False
    return isl.Set(f"[{', '.join(params)}] -> {{ [{', '.join(dims)}] : {text} }}").is_empty()
