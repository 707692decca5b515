"""Cross-thread reduction: combine per-thread partial accumulators over the threads of a block.

After a reduction loop has been split so that each thread of `threadIdx.x` reduced its own slice
into its local accumulator `acc[0]` (a partial result), `allreduce` appends the statements that
make every thread's `acc[0]` the combination over all `threads` threads of the block:

1. a butterfly of warp shuffles (`acc = acc op shfl_xor(acc, m)` for m = 16, 8, 4, 2, 1): after
   it every lane of a warp holds the warp's combination (5 steps, no shared memory, no barrier);
2. when the block has more than one warp, lane 0 of each warp writes its warp's value into a
   shared array `red[warps]`, one `__syncthreads()`, and every thread combines the `warps`
   values itself (a broadcast read: all lanes read the same word, no bank conflict).

The result is in every thread (an all-reduce), so statements after it may use it anywhere in the
block, e.g. `exp(x - max)` of a softmax. The shared array is used once; a second reduction gets
its own array, so no barrier is needed after the reads (write-after-read cannot happen).

Requirements (checked): `threads` is a multiple of 32 and at most 1024, every thread of the block
reaches the statements (they hold a barrier and full-warp shuffles: never put them under a
thread-dependent condition), and the combiner is associative and commutative (`+ * max min`); for
floating-point `+` the order differs from a serial sum (results differ in the last bits).
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, binary, warp_shuffle
from ...ir.stmt import (
    Allocate,
    Barrier,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    Stmt,
    seq,
)

WARP = 32
COMBINERS = ("+", "*", "max", "min")


def warp_allreduce(acc: Buffer, op: str) -> Stmt:
    """The shuffle butterfly: every lane's acc[0] becomes the warp's combination."""
    zero = Const(0, dt.int32)
    steps: list[Stmt] = []
    mask = WARP // 2
    while mask >= 1:
        steps.append(BufferStore(acc, (zero,), binary(op, acc[zero], warp_shuffle("shfl_xor", acc[zero], mask))))
        mask //= 2
    return seq(*steps)


def allreduce(acc: Buffer, op: str, lane: Expr, threads: int, name: str) -> Stmt:
    """Statements making `acc[0]` of each of the `threads` threads (`lane` = threadIdx.x) the
    combination by `op` over all of them. `name` names the shared array of the block stage."""
    if op not in COMBINERS:
        raise ScheduleError(f"cross-thread reduction of {acc.name}: combiner {op!r} is not one of {COMBINERS}")
    if threads % WARP or not 0 < threads <= 1024:
        raise ScheduleError(f"cross-thread reduction of {acc.name}: {threads} threads; use a multiple of 32 up to 1024")
    if acc.scope != "local":
        raise ScheduleError(f"cross-thread reduction of {acc.name}: the accumulator must be local, is {acc.scope}")
    warp_stage = warp_allreduce(acc, op)
    warps = threads // WARP
    if warps == 1:
        return warp_stage
    zero = Const(0, dt.int32)
    red = Buffer(name, acc.dtype, (warps,), "shared", tensor=f"{acc.tensor}.block")
    w = Var(f"{name}_w", dt.int32)
    block_stage = seq(
        IfThenElse(lane % WARP == 0, BufferStore(red, (lane // WARP,), acc[zero])),
        Barrier(),
        BufferStore(acc, (zero,), red[zero]),
        For(w, 0, warps - 1, "unroll", BufferStore(acc, (zero,), binary(op, acc[zero], red[w + 1]))),
    )
    return seq(warp_stage, Allocate(red, block_stage))


__all__ = ["allreduce", "warp_allreduce", "COMBINERS", "WARP"]
