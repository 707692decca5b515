"""Which key tiles an attention mask keeps: bounds on the key loop of a block of query rows,
proved with isl (tecc.ir.poly), for the tensor-core online contraction (online_contraction_mma).

The score s(r, j) of an online chain is often a `where(cond, x, -inf)` (a causal mask j <= i, a
bottom-right one j <= i + Sk - Sq, a window). `kept_conditions` reads the conditions under which
the score is kept. Each affine one, `c·j + a·i + rest <= 0` with c > 0 (coefficients from
`poly.affine_coefficients`), keeps keys up to `floor((-a·i - rest) / c)`; over the rows
[first, last] of a block that is largest at `last` when a <= 0 and at `first` otherwise, and
smallest the other way round. So, with the min over the conditions:

  key_tile_bound       the key tiles a block needs at all: min(ceil(Sk / T), ceil((bound + 1) / T)),
                       proved by checking that no (block, i, j) with j at or past it satisfies every
                       affine condition (`poly.is_empty`); tiles past it are fully -inf and skipped;
  unmasked_tile_bound  the leading tiles every row of the block keeps whole and that lie inside the
                       keys, proved by checking that no point of them violates a condition; those
                       need no per-element guard.

Nothing is special-cased for "causal": any affine condition in the query and key works, and a
condition isl cannot read (a boolean mask tensor) gives no bound: every tile is visited, guarded.
"""

from __future__ import annotations

import math

from ...ir import dtype as dt
from ...ir.expr import Binary, Compare, Const, Expr, Not, Select, Var, binary, compare, substitute
from ...ir.poly import LoopDim, affine_coefficients, is_empty
from .online_contraction import OnlineChain


def kept(score: Expr) -> tuple[list[Expr], Expr]:
    """(conditions, value): the `where`s around the score whose other branch is -inf, and the
    value they keep. The score is -inf unless every condition holds, and is `value` where all do."""
    out: list[Expr] = []
    e = score
    while isinstance(e, Select):
        if is_minus_inf(e.b):
            out.append(e.cond)
            e = e.a
        elif is_minus_inf(e.a):
            out.append(Not(e.cond))  # the kept side is the else branch
            e = e.b
        else:
            break
    return out, e


def kept_conditions(score: Expr) -> list[Expr]:
    """Conditions that hold wherever the score is not -inf (`kept`), split at `&`."""
    out, _ = kept(score)
    flat: list[Expr] = []
    while out:
        c = out.pop()
        if isinstance(c, Binary) and c.op == "&" and c.dtype.is_bool:
            out.extend((c.a, c.b))
        else:
            flat.append(c)
    return flat


def is_minus_inf(e: Expr) -> bool:
    """Whether `e` is the constant -inf (the masked branch of a `where`)."""
    return isinstance(e, Const) and e.dtype.is_float and float(e.value) == -math.inf


def affine_form(cond: Expr, query: Var, key: Var) -> tuple[int, int, Expr] | None:
    """(a, c, rest) with `cond` ⇔ c·key + a·query + rest ≤ 0 (integers a, c; `rest` free of the
    query and the key) for a comparison (or its negation) affine in them; None otherwise."""
    if isinstance(cond, Not) and isinstance(cond.a, Compare):
        flip = {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}
        if cond.a.op not in flip:
            return None
        cond = compare(flip[cond.a.op], cond.a.a, cond.a.b)
    if not isinstance(cond, Compare) or not cond.a.dtype.is_int or not cond.b.dtype.is_int:
        return None
    lhs, rhs = cond.a, cond.b
    if cond.op == "<=":
        f = lhs - rhs
    elif cond.op == "<":
        f = lhs - rhs + 1
    elif cond.op == ">=":
        f = rhs - lhs
    elif cond.op == ">":
        f = rhs - lhs + 1
    else:
        return None
    coeff = affine_coefficients(f, [query, key])
    if coeff is None:
        return None
    a, c = coeff
    return a, c, substitute(f, {query: Const(0, dt.int32), key: Const(0, dt.int32)})


def _upper_bound(cond: Expr, query: Var, key: Var, first: Expr, last: Expr, widest: bool = True) -> Expr | None:
    """For an affine condition c·key + a·query + rest ≤ 0 with c > 0: the largest key it keeps
    for SOME query in [first, last] (`widest`; for EVERY query in it otherwise), floor((-a·q -
    rest) / c) at the q that maximizes (minimizes) it."""
    form = affine_form(cond, query, key)
    if form is None or form[1] <= 0:
        return None
    a, c, rest = form
    at = (last if a <= 0 else first) if widest else (first if a <= 0 else last)
    return (Const(-a, dt.int32) * at - rest) // c


def key_tile_bound(chain: OnlineChain, first: Var, rows: int, tile: int) -> tuple[Expr, str] | None:
    """(tiles, why): the number of key tiles of `tile` keys that the block of query rows
    [first·rows, first·rows + rows) needs, proved by isl: no key at or past tiles·tile is kept by
    any row of the block. None when the conditions give no affine bound (every tile is visited)."""
    query, key = chain.row[-1], chain.key
    conds = kept_conditions(chain.score)
    lo = first * rows
    hi = binary("min", lo + rows, chain.rows[-1]) - 1
    bounds = [b for b in (_upper_bound(c, query, key, lo, hi) for c in conds) if b is not None]
    if not bounds:
        return None
    last: Expr = bounds[0]
    for b in bounds[1:]:
        last = binary("min", last, b)
    all_tiles = (chain.keys + (tile - 1)) // tile
    tiles = binary("min", all_tiles, (binary("max", last + 1, Const(0, dt.int32)) + (tile - 1)) // tile)
    affine = [c for c in conds if _upper_bound(c, query, key, lo, hi) is not None]
    loops = [LoopDim(first, Const(0, dt.int32), (chain.rows[-1] + (rows - 1)) // rows, "blockIdx.x"),
             LoopDim(query, lo, Const(rows, dt.int32), "serial"),
             LoopDim(key, Const(0, dt.int32), chain.keys, "serial")]
    proof = [compare("<", query, chain.rows[-1]), *affine, compare(">=", key, tiles * tile)]
    if not is_empty(loops, proof):
        return None
    why = (f"key tiles per block min(ceil({chain.keys} / {tile}), ceil((last kept key + 1) / {tile})), the last kept "
           f"key {last} from {' and '.join(map(str, affine))} (isl: no kept key past it)")
    return tiles, why


def unmasked_tile_bound(chain: OnlineChain, first: Var, rows: int, tile: int) -> Expr | None:
    """The number of leading key tiles in which EVERY score of the block of query rows
    [first·rows, first·rows + rows) is kept and every key is below the key extent, proved by isl
    (no point of those tiles violates a condition), so the kernel evaluates them without the
    guard; None when a condition gives no affine bound (a mask tensor) or the proof fails."""
    query, key = chain.row[-1], chain.key
    conds = kept_conditions(chain.score)
    lo = first * rows
    hi = binary("min", lo + rows, chain.rows[-1]) - 1
    whole = chain.keys // tile
    full: Expr = whole
    for c in conds:
        b = _upper_bound(c, query, key, lo, hi, widest=False)
        if b is None:
            return None
        full = binary("min", full, binary("max", b + 1, Const(0, dt.int32)) // tile)
    loops = [LoopDim(first, Const(0, dt.int32), (chain.rows[-1] + (rows - 1)) // rows, "blockIdx.x"),
             LoopDim(query, lo, Const(rows, dt.int32), "serial"),
             LoopDim(key, Const(0, dt.int32), full * tile, "serial")]
    inside = compare("<", query, chain.rows[-1])
    for violated in [compare(">=", key, chain.keys), *(Not(c) for c in conds)]:
        if not is_empty(loops, [inside, violated]):
            return None
    return full


def tiles_inside_keys(chain: OnlineChain, first: Var, rows: int, tile: int, tiles: Expr) -> bool:
    """Whether every key of the first `tiles` key tiles (an expression of the query block
    `first`: the block's visited tiles) is below the key extent, proved by isl for every block;
    then the per-element guard of those tiles needs no key-extent test (a key extent that is a
    multiple of the tile, or a mask whose last kept key is inside the keys)."""
    kt, j = Var("key_tile", dt.int32), Var("tile_key", dt.int32)
    loops = [LoopDim(first, Const(0, dt.int32), (chain.rows[-1] + (rows - 1)) // rows, "blockIdx.x"),
             LoopDim(kt, Const(0, dt.int32), tiles, "serial"),
             LoopDim(j, Const(0, dt.int32), Const(tile, dt.int32), "serial")]
    return is_empty(loops, [compare(">=", kt * tile + j, chain.keys)])


def query_block_start(conditions: list[Expr], query: Var, key: Var, block: Var, key_tile: int, rows: int,
                      queries: Expr, keys: Expr) -> tuple[Expr, str] | None:
    """(first, why): the first block of `rows` query rows that keeps any key of the key block
    [block·key_tile, block·key_tile + key_tile) under the affine `conditions` (the backward's
    transpose of key_tile_bound: its key-block-major kernel skips the query blocks before it),
    proved by isl: no (block, query, key) with the key in the block, every condition true and the
    query before first·rows. Each condition c·key + a·query + rest ≤ 0 with a < 0 keeps queries
    from ceil((c·key + rest) / -a), least at the block's first key when c ≥ 0, at its last
    otherwise. None when no condition bounds the query from below."""
    k0 = block * key_tile
    k1 = binary("min", k0 + key_tile, keys) - 1
    bounds: list[Expr] = []
    affine: list[Expr] = []
    for cond in conditions:
        form = affine_form(cond, query, key)
        if form is None or form[0] >= 0:
            continue
        a, c, rest = form
        at = k0 if c >= 0 else k1
        bounds.append((Const(c, dt.int32) * at + rest + (-a - 1)) // (-a))
        affine.append(cond)
    if not bounds:
        return None
    first: Expr = bounds[0]
    for b in bounds[1:]:
        first = binary("max", first, b)
    start = binary("max", first, Const(0, dt.int32)) // rows
    loops = [LoopDim(block, Const(0, dt.int32), (keys + (key_tile - 1)) // key_tile, "blockIdx.x"),
             LoopDim(key, k0, Const(key_tile, dt.int32), "serial"),
             LoopDim(query, Const(0, dt.int32), queries, "serial")]
    proof = [compare("<", key, keys), *affine, compare("<", query, start * rows)]
    if not is_empty(loops, proof):
        return None
    why = (f"query blocks per key block from {start}, the first query that keeps a key of the block from "
           f"{' and '.join(map(str, affine))} (isl: no kept key before it)")
    return start, why


def whole_tile(conditions: list[Expr], query: Var, key: Var, q0: Expr, k0: Expr, rows: int, key_tile: int,
               queries: Expr, keys: Expr, first: Var, block: Var) -> Expr | None:
    """A condition on the tile of queries [q0, q0 + rows) x keys [k0, k0 + key_tile) under which
    every element is inside the extents and keeps every condition (each c·key + a·query + rest ≤ 0
    at the tile's corner that maximizes it), so the backward's elementwise stage needs no guard
    there; proved by isl over the query blocks `first` (q0 = first·rows) and key blocks `block`
    (k0 = block·key_tile): no element of a tile where it holds is outside or dropped. None when a
    condition is not affine (a mask tensor) or the proof fails."""
    out: Expr = compare("<=", k0 + key_tile, keys) & compare("<=", q0 + rows, queries)
    for cond in conditions:
        form = affine_form(cond, query, key)
        if form is None:
            return None
        a, c, rest = form
        kx = k0 + (key_tile - 1) if c > 0 else k0
        qx = q0 + (rows - 1) if a > 0 else q0
        out = out & compare("<=", Const(c, dt.int32) * kx + Const(a, dt.int32) * qx + rest, Const(0, dt.int32))
    at = {q0: first * rows, k0: block * key_tile} if isinstance(q0, Var) and isinstance(k0, Var) else {}
    holds = substitute(out, at) if at else out
    loops = [LoopDim(block, Const(0, dt.int32), (keys + (key_tile - 1)) // key_tile, "blockIdx.x"),
             LoopDim(first, Const(0, dt.int32), (queries + (rows - 1)) // rows, "serial"),
             LoopDim(key, block * key_tile, Const(key_tile, dt.int32), "serial"),
             LoopDim(query, first * rows, Const(rows, dt.int32), "serial")]
    for violated in [compare(">=", key, keys), compare(">=", query, queries), *(Not(c) for c in conditions)]:
        if not is_empty(loops, [holds, violated]):
            return None
    return out


def skipping_description(chain: OnlineChain, bound: tuple[Expr, str] | None, unmasked: Expr | None = None) -> str:
    """What the kernel does about fully masked and unmasked key tiles, for explain()."""
    whole = "" if unmasked is None else (f"; the first {unmasked} key tiles, which every row of the block keeps "
                                         "whole (isl), without the per-element guard")
    if bound is not None:
        return bound[1] + whole
    if kept_conditions(chain.score):
        return "every key tile visited (no affine bound on the key in the mask's conditions)" + whole
    return "every key tile visited (no mask)" + whole


def tiles_grow_with_block(chain: OnlineChain, first: Var, rows: int, tiles: Expr) -> bool:
    """Whether the block's tile count `tiles` (key_tile_bound's, an expression of `first`) never
    falls from one query block to the next, proved by isl: no block b < last has
    tiles(b + 1) < tiles(b). Then the later query blocks carry the most work and the kernel
    launches them first (the tail of a launch is its shortest blocks)."""
    blocks = (chain.rows[-1] + (rows - 1)) // rows
    loops = [LoopDim(first, Const(0, dt.int32), blocks - 1, "blockIdx.x")]
    following = substitute(tiles, {first: first + 1})
    return is_empty(loops, [compare("<", following, tiles)]) and not is_empty(loops, [compare("<", tiles, following)])


__all__ = ["affine_form", "is_minus_inf", "kept", "kept_conditions", "key_tile_bound", "query_block_start",
           "skipping_description", "tiles_grow_with_block", "whole_tile",
           "tiles_inside_keys", "unmasked_tile_bound"]
