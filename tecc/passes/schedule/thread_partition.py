"""How a tile is divided among a block's threads for a cooperative copy: written once, for the
cp.async rings of tensorized kernels (tile_staging.py), the attention kernels' Q, K and V tiles
(passes/rewrite/mma_tiles.py's TileStaging.copy_tile) and cache_read's shared staging (cache_read.py).

A tile of (e0, e1, ..) chunks -- a chunk is what one instruction moves: 16 bytes for cp.async,
a float4, one element -- is numbered in row-major chunk order. Chunk q sits at coordinates
(q // (e1·e2·..), .., q % e_last) (`chunk_coordinates`), and thread t of T takes chunks t,
t + T, t + 2T, ...: consecutive threads take consecutive chunks of a row, so the accesses of a
warp cover whole lines of global memory (`tile_copy`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ...ir.expr import Expr, Var
from ...ir.stmt import IfThenElse, Stmt


def chunk_coordinates(flat: Expr, extents: Sequence[int]) -> list[Expr]:
    """The row-major coordinates of chunk number `flat` of a box of `extents` chunks, outermost
    first; the outermost is left undivided (`flat` may run past the box: callers guard it)."""
    out: list[Expr] = []
    stride = 1
    for e in extents:
        stride *= e
    for k, e in enumerate(extents):
        stride //= e
        q = flat // stride if stride > 1 else flat
        out.append(q % e if k > 0 else q)
    return out


def tile_copy(unrolled: Callable[[str, int, Callable[[Var], Stmt]], Stmt], name: str, thread: Expr, threads: int,
              rows: int, width: int, size: int, copy: Callable[[Expr, Expr], Stmt]) -> Stmt:
    """The copy of a `rows` x `width` tile in chunks of `size` elements by `threads` threads:
    an unrolled loop (`unrolled(name, count, body)`) whose step u has thread `thread` copy chunk
    thread + threads·u, built by `copy(row, column)` at its first element. Where the chunks are
    not a whole number per thread, the last step is guarded."""
    per_row = width // size
    chunks = rows * per_row

    def step(u: Var) -> Stmt:
        chunk = thread + threads * u
        r, col = chunk_coordinates(chunk, (rows, per_row))
        st = copy(r, col * size)
        if chunks % threads:
            st = IfThenElse(chunk < chunks, st)
        return st
    return unrolled(name, -(-chunks // threads), step)


__all__ = ["chunk_coordinates", "tile_copy"]
