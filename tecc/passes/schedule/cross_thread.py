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

`chan_allreduce` is the same two stages for a triple (count, mean, M2) of per-thread moments
(Welford statistics of a thread's columns): the combiner is Chan's pairwise update (`chan_merge`)
instead of an operator, three values travel per shuffle, and the shared stage holds `red[3, warps]`.
Each butterfly step merges the lower lane's triple with the upper one's, in that order on both
lanes, so both get the same bits (the update is not symmetric in its two operands).

Requirements (checked): `threads` is a multiple of 32 and at most 1024, every thread of the block
reaches the statements (they hold a barrier and full-warp shuffles: never put them under a
thread-dependent condition), and the combiner is associative and commutative (`+ * max min`); for
floating-point `+` the order differs from a serial sum (results differ in the last bits).
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, binary, select, warp_shuffle
from ...ir.stmt import (
    Allocate,
    Barrier,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    LetStmt,
    Stmt,
    seq,
)

WARP = 32
COMBINERS = ("+", "*", "max", "min", "fmax", "fmin")


def warp_allreduce(acc: Buffer, op: str, lanes: int = WARP) -> Stmt:
    """The shuffle butterfly: every lane's acc[0] becomes the combination over its group of
    `lanes` consecutive lanes (a power of two up to the warp; lanes ^ m for m = lanes/2, ..., 1:
    the whole warp by default)."""
    zero = Const(0, dt.int32)
    steps: list[Stmt] = []
    mask = lanes // 2
    while mask >= 1:
        steps.append(BufferStore(acc, (zero,), binary(op, acc[zero], warp_shuffle("shfl_xor", acc[zero], mask))))
        mask //= 2
    return seq(*steps)


def allreduce(acc: Buffer, op: str, lane: Expr, threads: int, name: str, shuffle_stage: bool = False) -> Stmt:
    """Statements making `acc[0]` of each of the `threads` threads (`lane` = threadIdx.x) the
    combination by `op` over all of them. `name` names the shared array of the block stage.

    shuffle_stage: the block stage's combine of the W warp values (W a power of two) is a
    butterfly too: each lane reads `red[lane % W]` and log2(W) shuffle steps combine them (one
    shared read and 2·log2(W) instructions per thread instead of W reads and W - 1 combines;
    every lane of every warp combines the same values in the same pairs, so all get the same
    bits). The row kernels that walk rows (fuse_rows' row_blocks) take it; the one-row-per-block
    kernels keep the serial combine they were measured with."""
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
    if shuffle_stage and warps & (warps - 1) == 0:
        return seq(warp_stage, Allocate(red, seq(
            IfThenElse(lane % WARP == 0, BufferStore(red, (lane // WARP,), acc[zero])),
            Barrier(),
            BufferStore(acc, (zero,), red[lane % warps]),
            warp_allreduce(acc, op, warps))))
    w = Var(f"{name}_w", dt.int32)
    block_stage = seq(
        IfThenElse(lane % WARP == 0, BufferStore(red, (lane // WARP,), acc[zero])),
        Barrier(),
        BufferStore(acc, (zero,), red[zero]),
        For(w, 0, warps - 1, "unroll", BufferStore(acc, (zero,), binary(op, acc[zero], red[w + 1]))),
    )
    return seq(warp_stage, Allocate(red, block_stage))


# (count, mean, M2): the moments of a set of values; M2 = Σ (x - mean)². count is kept in the
# accumulator's float type, so one shuffle moves each value (exact up to 2^24 in float32).
Moments = tuple[Expr, Expr, Expr]


def _check_moments(bufs: tuple[Buffer, Buffer, Buffer]) -> None:
    for b in bufs:
        if b.scope != "local" or not b.dtype.is_float or b.dtype != bufs[0].dtype:
            raise ScheduleError(f"Chan combine of {b.name}: the moments must be local buffers of one float type, "
                                f"got {b.scope} {b.dtype}")


def chan_merge(moments: tuple[Buffer, Buffer, Buffer], a: Moments, b: Moments, name: str) -> Stmt:
    """Statements making `moments` (count, mean, M2 buffers, element 0) the moments of the union
    of two disjoint sets whose moments are `a` and `b` (Chan, Golub & LeVeque, "Updating formulae
    and a pairwise algorithm for computing sample variances", 1979):

        n = n_a + n_b;  delta = mean_b - mean_a;  w = n_b / max(n, 1)
        mean = mean_a + delta·w;   M2 = M2_a + M2_b + delta²·n_a·w      (= delta²·n_a·n_b / n)

    `max(n, 1)`: two empty sets (a thread that saw no column has (0, 0, 0)) give w = 0 and stay
    (0, 0, 0) instead of 0/0 = NaN. The operands may read the buffers being written: each is bound
    (`let`) before the first store. `name` prefixes the let variables."""
    _check_moments(moments)
    count, mean, m2 = moments
    zero = Const(0, dt.int32)
    ft = count.dtype
    lets: list[tuple[Var, Expr]] = []

    def bind(label: str, value: Expr) -> Expr:
        if isinstance(value, (Const, Var)):
            return value
        var = Var(f"{name}_{label}", ft, "value")  # a let-bound float
        lets.append((var, value))
        return var

    n_a, mean_a, m2_a = (bind(f"{k}_a", x) for k, x in zip(("count", "mean", "m2"), a))
    n_b, mean_b, m2_b = (bind(f"{k}_b", x) for k, x in zip(("count", "mean", "m2"), b))
    n = bind("count", n_a + n_b)
    delta = bind("delta", mean_b - mean_a)
    w = bind("weight", n_b / binary("max", n, Const(1.0, ft)))
    body: Stmt = seq(
        BufferStore(m2, (zero,), m2_a + m2_b + delta * delta * n_a * w),
        BufferStore(mean, (zero,), mean_a + delta * w),
        BufferStore(count, (zero,), n),
    )
    for var, value in reversed(lets):
        body = LetStmt(var, value, body)
    return body


def chan_allreduce(moments: tuple[Buffer, Buffer, Buffer], lane: Expr, threads: int, name: str) -> Stmt:
    """Statements making each of the `threads` threads' moments (count, mean, M2 buffers, element
    0; `lane` = threadIdx.x) the moments of the union of all of them: a butterfly of Chan merges
    over the warp (three shuffles per step), then with several warps `red[3, warps]` in shared
    memory, one barrier, and every thread merging the warps' triples in warp order (so every
    thread ends with the same bits). `name` names the shared array and the let variables."""
    if threads % WARP or not 0 < threads <= 1024:
        raise ScheduleError(f"Chan combine of {moments[1].name}: {threads} threads; use a multiple of 32 up to 1024")
    _check_moments(moments)
    zero = Const(0, dt.int32)
    ft = moments[0].dtype
    own: Moments = (moments[0][zero], moments[1][zero], moments[2][zero])
    steps: list[Stmt] = []
    mask = WARP // 2
    while mask >= 1:
        other: Moments = (Var(f"{name}_count{mask}", ft, "value"), Var(f"{name}_mean{mask}", ft, "value"),
                          Var(f"{name}_m2{mask}", ft, "value"))
        # the lane whose `mask` bit is clear is operand a on both lanes of the pair
        low = lane % (2 * mask) < mask
        a: Moments = (select(low, own[0], other[0]), select(low, own[1], other[1]), select(low, own[2], other[2]))
        b: Moments = (select(low, other[0], own[0]), select(low, other[1], own[1]), select(low, other[2], own[2]))
        step = chan_merge(moments, a, b, f"{name}{mask}")
        for var, x in reversed(list(zip(other, own))):
            assert isinstance(var, Var)
            step = LetStmt(var, warp_shuffle("shfl_xor", x, mask), step)
        steps.append(step)
        mask //= 2
    warp_stage = seq(*steps)
    warps = threads // WARP
    if warps == 1:
        return warp_stage
    red = Buffer(name, ft, (3, warps), "shared", tensor=f"{moments[1].tensor}.block")
    w = Var(f"{name}_warp", dt.int32)
    which = [Const(i, dt.int32) for i in range(3)]
    warp_w: Moments = (red[which[0], w + 1], red[which[1], w + 1], red[which[2], w + 1])
    block_stage = seq(
        IfThenElse(lane % WARP == 0, seq(*(BufferStore(red, (i, lane // WARP), x) for i, x in zip(which, own)))),
        Barrier(),
        *(BufferStore(buf, (zero,), red[i, zero]) for i, buf in zip(which, moments)),
        For(w, 0, warps - 1, "unroll", chan_merge(moments, own, warp_w, name)),
    )
    return seq(warp_stage, Allocate(red, block_stage))


__all__ = ["COMBINERS", "WARP", "Moments", "allreduce", "chan_allreduce", "chan_merge", "warp_allreduce"]
