"""The order in which the blocks of the tensor-core attention (online_contraction_mma) launch.

The kernel's grid is (query blocks X, heads): blockIdx.x a block of query rows, blockIdx.y the
leading row axes flattened. The hardware starts blocks in the order L = x + X·y, and that order
decides two things the kernel cannot see from inside one block:

- **which blocks share K and V through L2.** With grouped heads (K[b, h // G, j, d]) the G query
  heads of one K/V head read the same key tiles; in the plain order they are X blocks apart. Here
  the G heads of one query block are consecutive blocks, so each K/V tile is read by G blocks at
  about the same time.
- **the tail.** Under a causal mask the tile count grows with the query block, so the plain
  order starts the shortest blocks of each head first and ends the launch on the longest ones.
  When isl proves that the count never falls from one query block to the next
  (key_tiles.tiles_grow_with_block, from the proven tile bound, not from a "causal" flag), the
  query blocks run from the last: the longest blocks start first and the launch ends on short
  ones (longest-processing-time-first list scheduling).

Block L runs (block_grid)

    g = L % G,  t = L / G,  query_block = t % X  (X - 1 - t % X backwards),  head = (t / X)·G + g

which is a bijection of the grid when G divides the innermost head extent (then head // G =
b·(H / G) + h // G for the flattened head b·H + h, so the G heads of a group share K/V). G is read
from the index structure (kv_group): the innermost head axis h appears in K's and V's leading
indices only as `h // G`. Nothing is keyed by the operation's name.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ...ir import dtype as dt
from ...ir.expr import Binary, Const, Expr, TensorRead, Var, const_int, size_product, walk
from ...ir.stmt import For, LetStmt, Stmt
from ...ir.visitor import SubexpressionReplacer
from .key_tiles import tiles_grow_with_block
from .online_contraction import OnlineChain


def kv_group(chain: OnlineChain, reads: Sequence[TensorRead]) -> int:
    """G when consecutive values of the innermost head axis h come in groups of G that read the
    same rows of `reads` (K and V): h appears in their leading indices only as `h // G` (G a
    constant that divides h's extent: grouped-query heads K[b, h // G, j, d]); 1 otherwise."""
    if len(chain.row) < 2:
        return 1
    h, extent = chain.row[-2], const_int(chain.rows[-2])
    found: set[int] = set()
    for read in reads:
        for e in read.indices[:-2]:
            divs = [n for n in walk(e) if isinstance(n, Binary) and n.op == "//" and n.a is h]
            for n in divs:
                g = const_int(n.b)
                if g is None or g < 1:
                    return 1
                found.add(g)
            rest = SubexpressionReplacer({d: Const(0, dt.int32) for d in divs}).visit(e)
            if any(n is h for n in walk(rest)):
                return 1   # h itself (not only h // G) picks the K/V row
    if len(found) != 1:
        return 1
    (g,) = found
    return g if extent is not None and extent % g == 0 else 1


def launch_order(chain: OnlineChain, reads: Sequence[TensorRead], first: Var, rows: int,
                 bound: tuple[Expr, str] | None) -> tuple[int, bool, str]:
    """(G, backwards, what) for blocks of `rows` query rows: G = kv_group of the K/V `reads`,
    backwards when isl proves that key_tile_bound's tile count `bound` (an expression of the
    query block `first`) never falls with the block; `what` says so for the plan."""
    group = kv_group(chain, reads) if chain.rows[:-1] else 1
    backwards = bound is not None and tiles_grow_with_block(chain, first, rows, bound[0])
    said = []
    if group > 1:
        said.append(f"the {group} query heads of one K/V head launched side by side")
    if backwards:
        said.append("query blocks launched from the last (isl: their key tile counts never fall with the block)")
    return group, backwards, ", ".join(said)


def block_grid(body: Stmt, chain: OnlineChain, rows: int, query_block: Var, head: Var,
               order: tuple[int, bool, str], unique: Callable[[str], str], query_major: bool = False) -> Stmt:
    """The blockIdx loops around `body` (which reads `query_block` and `head`), launching the
    blocks in `order` (launch_order's; module docstring): the plain grid when G = 1 and not
    backwards, else new blockIdx variables and lets that give query_block and head.
    `query_major`: block L runs query block L / heads (from the last when backwards) of head
    L % heads, the persistent form's order (work_item) on the plain grid: every head's longest
    query block starts before any head's shorter one (longest first over the whole launch, not
    per head: the last heads' long blocks no longer start at the end), the heads of one query
    block, and so the G heads of a K/V head, side by side."""
    group, backwards, _ = order
    zero = Const(0, dt.int32)
    X = (chain.rows[-1] + (rows - 1)) // rows
    heads = chain.rows[:-1]
    n_heads = size_product(heads)
    if query_major and heads:
        x, y = Var(unique("block_x"), dt.int32), Var(unique("block_y"), dt.int32)
        linear = x + X * y
        rank = linear // n_heads
        body = LetStmt(query_block, (X - 1) - rank if backwards else rank, LetStmt(head, linear % n_heads, body))
        return For(y, zero, n_heads, "blockIdx.y", For(x, zero, X, "blockIdx.x", body))
    if group == 1 and not backwards:
        body = For(query_block, zero, X, "blockIdx.x", body)
        return For(head, zero, n_heads, "blockIdx.y", body) if heads else body
    x, y = Var(unique("block_x"), dt.int32), Var(unique("block_y"), dt.int32)
    linear = x + X * y
    t = linear // group
    rank = t % X if group > 1 else x   # G = 1: the plain grid's (x, y), backwards
    body = LetStmt(query_block, (X - 1) - rank if backwards else rank, body)
    if heads:
        body = LetStmt(head, (t // X) * group + linear % group if group > 1 else y, body)
    body = For(x, zero, X, "blockIdx.x", body)
    return For(y, zero, n_heads, "blockIdx.y", body) if heads else body


def work_item(chain: OnlineChain, rows: int, order: tuple[int, bool, str], linear: Expr,
              plain: bool = False) -> tuple[Expr, Expr]:
    """(query block, head) of work item `linear` of the persistent form (online_contraction_mma's
    `persistent`): query block major, head minor, so the heads of one query block are consecutive
    items (the G heads of one K/V head side by side for any G) and, with `order` backwards, every
    head's longest query block comes before any shorter one: a grid of P blocks taking items
    p, p + P, p + 2P, .. gets the heaviest P first and ends on the lightest (longest-processing-
    time-first over the whole launch, not per head). `plain`: the plain grid's order (query
    blocks, then heads), for timing against it."""
    X = (chain.rows[-1] + (rows - 1)) // rows
    heads = size_product(chain.rows[:-1])
    if plain:
        return linear % X, linear // X
    rank = linear // heads
    return ((X - 1) - rank if order[1] else rank), linear % heads


__all__ = ["block_grid", "kv_group", "launch_order", "work_item"]
