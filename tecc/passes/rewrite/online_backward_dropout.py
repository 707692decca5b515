"""Dropout in the backward kernels of the online contraction: one Philox call per four tile
elements, the keep bits handed between lanes by shuffles.

The backward program of dropout attention (tecc.ir.autodiff_online) holds the forward's keep
condition in its weights (dV's `where(keep, P·scale, 0)` and dP's `where(keep, dP·scale, 0)`):
one condition, drawn from one `RandomUniform(seed, offset, n)` of index n = Y(row)·E + key (the
key the rand tensor's last axis, E its extent). Each element evaluating it makes its own Philox
call (the generic weights); `keep_form` finds that shape, and where E is a multiple of 4 (a
constant, or tested once per launch: the branch is uniform, as the shuffles need) keys
4a .. 4a + 3 of a row are one counter group, so the kernels draw each group once:

* **key-block-major** (C rows = keys, columns = queries: element e of a lane at key
  g + 8·(e // 2), query 2t + e % 2): the four lanes g = 4a .. 4a + 3 (same t) hold the four keys
  of a group for each of their four (query, key half) pairs, i.e. four groups: lane i = g % 4
  draws group i (query 2t + i % 2, key half i // 2), packs its four keep bits, and two
  `shfl_xor` (lanes 4 and 8 apart) gather all sixteen, group k at bits 4k .. 4k + 3; element e
  reads bit 4e + i (its group is k = e).
* **query-major** (dQ's kernel; C rows = queries, columns = keys, as the forward's): the forward's
  scheme (online_mma_dropout): lanes 2u, 2u + 1 hold keys 4u .. 4u + 3 of rows g and g + 8, each
  draws one row's group, one `shfl_xor(bits, 1)` swaps them.

Every group's four draws are written with indices base | w (w = 0 .. 3) from one aligned base,
so the counter offset + ((base | w) >> 2) is one expression to the compiler and the four
inlined Philox calls are one. The C layout (m16n8: element e of lane l at (l // 4 + 8·(e // 2),
2·(l % 4) + e % 2)) is checked against the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...ir import dtype as dt
from ...ir.expr import (
    Binary,
    Cast,
    Const,
    Expr,
    Select,
    Var,
    binary,
    cast,
    compare,
    const_int,
    free_vars,
    select,
    substitute,
    walk,
    warp_shuffle,
)
from ...ir.philox import RandomUniform
from ...ir.stmt import IfThenElse, LetStmt, Stmt, seq
from ...ir.visitor import SubexpressionReplacer
from .online_backward import BackwardChain


@dataclass(frozen=True)
class KeepForm:
    """The weights' one dropout condition `cond`, its draw `draw` (index Y·E + key, in the
    kernel's variables) and E."""

    cond: Expr
    draw: RandomUniform
    extent: Expr


def keep_form(chain: BackwardChain) -> KeepForm | None:
    """The module docstring's shape of the weights' dropout condition, or None."""
    weights = [chain.probs] + [o.weight for o in chain.outputs]
    draws = {id(n): n for w in weights for n in walk(w) if isinstance(n, RandomUniform)}
    if len(draws) != 1:
        return None
    (u,) = draws.values()
    assert isinstance(u, RandomUniform)
    conds = {id(n.cond): n.cond for w in weights for n in walk(w) if isinstance(n, Select)
             and any(x is u for x in walk(n.cond))}
    if len(conds) != 1:
        return None
    (cond,) = conds.values()
    # every draw is inside that condition
    if any(any(isinstance(x, RandomUniform) for x in walk(SubexpressionReplacer({cond: Const(True, dt.bool_)}).visit(w)))
           for w in weights):
        return None
    key = chain.key
    if any(v is key or v is chain.query for e in (u.seed, u.offset) for v in free_vars(e)):
        return None
    n = u.index.a if isinstance(u.index, Cast) and u.index.a.dtype.is_int else u.index
    if not (isinstance(n, Binary) and n.op == "+"):
        return None
    k = n.b.a if isinstance(n.b, Cast) else n.b
    x = n.a.a if isinstance(n.a, Cast) and n.a.a.dtype.is_int else n.a
    if k is not key or any(v is key for v in free_vars(n.a)) or not (isinstance(x, Binary) and x.op == "*"):
        return None
    extent = x.b.a if isinstance(x.b, Cast) else x.b
    if any(isinstance(v, Var) and v.kind != "size" for v in free_vars(extent)):
        return None
    return KeepForm(cond, u, extent)


def m16n8(c_map: Callable[[Expr | int, Expr | int], tuple[Expr | int, Expr | int]]) -> bool:
    return all(c_map(lane, e) == (lane // 4 + 8 * (e // 2), 2 * (lane % 4) + e % 2) for lane in range(32)
               for e in range(4))


def group_bits(form: KeepForm, at: dict[Var, Expr]) -> Expr:
    """The keep bits of the four elements of the counter group whose first element sits at
    `at` (the condition's variables): bit w for key + w, one Philox call (indices base | w)."""
    u0 = substitute(form.draw, at)
    assert isinstance(u0, RandomUniform)
    cond = substitute(form.cond, at)
    bits: Expr = Const(0, dt.int32)
    for w in range(4):
        draw = u0 if w == 0 else RandomUniform(u0.seed, u0.offset, binary("|", u0.index, Const(w, u0.index.dtype)))
        bit = cast(SubexpressionReplacer({u0: draw}).visit(cond), dt.int32)
        bits = bit if w == 0 else bits | (bit * Const(1 << w, dt.int32))
    return bits


def uniform_branch(form: KeepForm, shared: Stmt, per_element: Stmt) -> Stmt:
    """`shared` where E is a multiple of 4 (decided here when E is a constant, else by a branch
    every thread takes alike), else `per_element`."""
    e = const_int(form.extent)
    if e is not None:
        return shared if e % 4 == 0 else per_element
    return IfThenElse(compare("==", binary("&", form.extent, Const(3, form.extent.dtype)), Const(0, form.extent.dtype)),
                      shared, per_element)


def key_major_keeps(form: KeepForm, lane: Expr, query0: Expr, key0: Expr, unique: Callable[[str], str],
                    lower: Callable[[Expr], tuple[list[Stmt], Expr]], query: Var, key: Var
                    ) -> tuple[Callable[[Stmt], Stmt], list[Expr]]:
    """The key-major kernel's keep bits of one n8 tile (module docstring): (a wrapper binding
    them around the tile's statements, the keep condition of elements e = 0 .. 3). `query0`:
    the tile's query of element 0 of lane t = 0 (its first column); `key0`: the warp's first key."""
    g, t = lane // 4, lane % 4
    i = g % 4
    at = {query: query0 + 2 * t + i % 2, key: key0 + 8 * (i // 2) + 4 * (g // 4)}
    stmts, bits = lower(group_bits(form, at))
    own, pair, every = (Var(unique(n), dt.int32) for n in ("keep_bits", "keep_pair", "keep_all"))
    y, z = Var(unique("keep_from_4"), dt.int32), Var(unique("keep_from_8"), dt.int32)
    odd, high = compare("==", i % 2, Const(1, dt.int32)), compare("==", i // 2, Const(1, dt.int32))
    lane_bit = select(compare("==", i, Const(0, dt.int32)), Const(1, dt.int32),
                      select(compare("==", i, Const(1, dt.int32)), Const(2, dt.int32),
                             select(compare("==", i, Const(2, dt.int32)), Const(4, dt.int32), Const(8, dt.int32))))
    bit = Var(unique("keep_lane_bit"), dt.int32)
    keeps = [compare("!=", binary("&", every, bit * Const(16 ** e, dt.int32)), Const(0, dt.int32)) for e in range(4)]

    def wrap(body: Stmt) -> Stmt:
        # every lane shuffles (a shuffle under a select's arm would run on some lanes only)
        return seq(*stmts, LetStmt(own, bits, LetStmt(y, warp_shuffle("shfl_xor", own, Const(4, dt.int32)), LetStmt(
            pair, select(odd, y + own * Const(16, dt.int32), own + y * Const(16, dt.int32)),
            LetStmt(z, warp_shuffle("shfl_xor", pair, Const(8, dt.int32)), LetStmt(
                every, select(high, z + pair * Const(256, dt.int32), pair + z * Const(256, dt.int32)),
                LetStmt(bit, lane_bit, body)))))))
    return wrap, keeps


def query_major_keeps(form: KeepForm, lane: Expr, row0: Expr, key0: Expr, unique: Callable[[str], str],
                      lower: Callable[[Expr], tuple[list[Stmt], Expr]], query: Var, key: Var
                      ) -> tuple[Callable[[Stmt], Stmt], list[Expr]]:
    """The query-major kernel's keep bits of one n8 tile (the forward's scheme, module
    docstring). `row0`: the warp's first query; `key0`: the tile's first key."""
    g, t = lane // 4, lane % 4
    odd = compare("==", t % 2, Const(1, dt.int32))
    at = {query: row0 + g + select(odd, Const(8, dt.int32), Const(0, dt.int32)), key: key0 + 4 * (t // 2)}
    stmts, bits = lower(group_bits(form, at))
    own, other = Var(unique("keep_bits"), dt.int32), Var(unique("keep_other"), dt.int32)
    rows = (select(odd, other, own), select(odd, own, other))   # rows g and g + 8
    masks = (select(odd, Const(4, dt.int32), Const(1, dt.int32)), select(odd, Const(8, dt.int32), Const(2, dt.int32)))
    keeps = [compare("!=", binary("&", rows[e // 2], masks[e % 2]), Const(0, dt.int32)) for e in range(4)]

    def wrap(body: Stmt) -> Stmt:
        return seq(*stmts, LetStmt(own, bits, LetStmt(other, warp_shuffle("shfl_xor", own, Const(1, dt.int32)), body)))
    return wrap, keeps


__all__ = ["KeepForm", "group_bits", "keep_form", "key_major_keeps", "m16n8", "query_major_keeps", "uniform_branch"]
