"""Online statistics: two reductions of a row computed in ONE pass over it.

A row too long for registers is read from global memory once per pass (`fuse_rows` with
cache="online" or "none"). Two pairs of reductions that the normalization family computes one
after the other fold into one pass, so such a row is read at most twice (statistics, output):

* **max, then sum of exp** (softmax, log-softmax): `m = max_c a(c)`, `s = Σ_c exp(h(c) - m)`.
  A running max and a sum rescaled by exp(m_old - m_new) whenever the max grows (Milakov &
  Gimelshein, "Online normalizer calculation for softmax", 2018). Per chunk of columns
  (row_chunks.py): the chunk's max first, then one rescale and the chunk's exps, so a chunk of
  E columns costs E + 1 exps instead of 2E.
* **sum, then sum of squared deviations** (layer norm's mean and variance): `S = Σ_c h(c)`,
  `Q = Σ_c (h(c) - μ)²` where μ is a row value known once S is (layer norm: μ = S·(1/n)). One
  pass computes the moments (n, mean, M2 = Σ (h - mean)²) of h: per chunk, the chunk's mean and
  M2 from its registers, merged into the thread's running moments by Chan's update (one
  division per chunk, not per column: Welford 1962; Chan, Golub & LeVeque 1979); the threads'
  moments are combined the same way (cross_thread.chan_allreduce). Then S = n·mean, and
  `Q = M2 + n·(mean - μ)²`, which is exact for any μ (the sum of squares about μ is the sum
  about the mean plus n times the squared distance of the means), so the recognition need not
  prove that μ is S/n; with layer norm's μ the correction is a few ulps. Unlike E[h²] - E[h]²,
  nothing here subtracts two large sums: rows of 1000 + N(0, 1) keep their variance.

Recognition is structural, never by name: expressions are hash-consed, so "the same h" is one
node, and a pair is two consecutive passes of the row group (`fuse_rows`' list of per-column
expressions, in program order) of different stages, the first being the last pass of its stage.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from ...ir import dtype as dt
from ...ir.dtype import DType
from ...ir.expr import (
    Binary,
    Call,
    Const,
    Expr,
    Reduce,
    Var,
    binary,
    call,
    compare,
    free_vars,
    reduce_identity,
    select,
    walk,
)
from ...ir.stmt import Buffer, BufferStore, LetStmt, Stmt, seq
from ...ir.tensor import ComputeOp, Tensor
from .row_chunks import Chunk, ColumnWalk
from ..schedule.cross_thread import allreduce, chan_allreduce, chan_merge

Pass = tuple[Tensor, Expr, "Reduce | None"]
# a fresh one-thread register array: (label, dtype, elements) -> Buffer (allocated by the caller)
NewLocal = Callable[[str, DType, int], Buffer]

ZERO = Const(0, dt.int32)


def max_sum_exp_pair(passes: Sequence[Pass], i: int, values: dict[Tensor, Buffer],
                     copies: Mapping[Expr, Expr] | None = None) -> tuple[Tensor, Reduce, Expr] | None:
    """(stage, Reduce, h) when pass i is a stage `m = max_c a(c)` (the whole stage) and pass i+1
    a sum `Σ_c exp(h(c) - m)` with h free of m: the pair one pass computes with a running max
    and a rescaled sum. `copies` maps the register of a row value that is a statistic itself
    (a keepdim max `m'[r, 0] = m[r]`, which a loss saves for its backward and then reads) to
    the statistic's: the sum may subtract either."""
    if i + 1 >= len(passes):
        return None
    t, _, r = passes[i]
    t2, expr2, r2 = passes[i + 1]
    op = t.op
    assert isinstance(op, ComputeOp)
    if r is None or r2 is None or r.combiner != "max" or r2.combiner != "sum" or not isinstance(op.body, Reduce):
        return None
    if not r.acc_dtype.is_float or r2.acc_dtype != r.acc_dtype or t2 is t:
        return None
    m = values[t][ZERO]
    same = [m] + [k for k, v in (copies or {}).items() if v is m]
    if not (isinstance(expr2, Call) and expr2.name == "exp" and isinstance(expr2.args[0], Binary)
            and expr2.args[0].op == "-" and any(expr2.args[0].b is e for e in same) and expr2.dtype == r2.acc_dtype):
        return None
    h = expr2.args[0].a
    if any(_reads(h, e) for e in same):
        return None
    return t2, r2, h


def online_max_sum(a: Expr, h: Expr, columns: ColumnWalk, row: tuple[Expr, ...], m_acc: Buffer, s_acc: Buffer,
                   new_local: NewLocal, tx: Var, threads: int, stage: str, blocks: tuple[str, str]) -> list[Stmt]:
    """One pass over the row for `m = max a` (into m_acc) and `s = Σ exp(h - m)` (into s_acc),
    both all-reduced over the block (`blocks`: their shared arrays' names; `stage` names m's
    registers):

        m_acc = -inf; s_acc = 0
        per chunk: m_chunk = max of a over the chunk; m_new = max(m_acc, m_chunk)
                   s_acc = s_acc·exp(m_acc - m_new) + Σ_chunk exp(h - m_new); m_acc = m_new
        m_own = m_acc; <allreduce m_acc, max>; s_acc = s_acc·exp(m_own - m_acc); <allreduce s_acc, +>

    exp(old - new) is taken as 1 when the two are equal, so a thread that has seen no column
    (or only -inf) keeps s = 0 instead of 0·exp(-inf + inf) = NaN. A column of -inf (a masked
    score) adds exp(-inf - m) = 0 also while the running max is still -inf (a causal row's
    masked tail, all of one thread's columns): where h is the max's own a, each chunk subtracts
    0 instead of a max of -inf (all its columns are -inf then), one select per chunk; otherwise
    each -inf column adds 0 by a select of its own. Without either, exp(-inf + inf) = NaN
    spreads to the whole row through the block's reduction."""
    ft = m_acc.dtype
    m_new, m_own, m_chunk = (new_local(f"{stage}_{k}", ft, 1) for k in ("new", "own", "chunk"))
    minus_inf = reduce_identity("max", ft)

    def term(ch: Chunk) -> Expr:
        if h is a:
            shift = select(compare("==", m_new[ZERO], minus_inf), Const(0.0, ft), m_new[ZERO])
            return call("exp", ch.value(h) - shift)
        value = ch.value(h)
        return select(compare("==", value, minus_inf), Const(0.0, ft), call("exp", value - m_new[ZERO]))

    def chunk(ch: Chunk) -> Stmt:
        if ch.elements == 1:
            chunk_max: list[Stmt] = [BufferStore(m_new, (ZERO,), binary("max", m_acc[ZERO], ch.value(a)))]
        else:
            chunk_max = [BufferStore(m_chunk, (ZERO,), minus_inf),
                         ch.each(BufferStore(m_chunk, (ZERO,), binary("max", m_chunk[ZERO], ch.value(a)))),
                         BufferStore(m_new, (ZERO,), binary("max", m_acc[ZERO], m_chunk[ZERO]))]
        return seq(
            *chunk_max,
            BufferStore(s_acc, (ZERO,), s_acc[ZERO] * rescale(m_acc[ZERO], m_new[ZERO])),
            ch.each(BufferStore(s_acc, (ZERO,), s_acc[ZERO] + term(ch))),
            BufferStore(m_acc, (ZERO,), m_new[ZERO]),
        )

    return [
        BufferStore(m_acc, (ZERO,), reduce_identity("max", ft)),
        BufferStore(s_acc, (ZERO,), reduce_identity("sum", ft)),
        columns.loop([a, h], row, chunk),
        *allreduce_max_sum(m_acc, s_acc, m_own, tx, threads, blocks),
    ]


def rescale(old: Expr, new: Expr) -> Expr:
    """exp(old - new), the factor that moves a sum of exp(· - old) to exp(· - new); 1 when the
    two are equal, so -inf against -inf (nothing seen yet) gives 1, not exp(NaN)."""
    return select(compare("==", old, new), Const(1.0, old.dtype), call("exp", old - new))


def allreduce_max_sum(m_acc: Buffer, s_acc: Buffer, m_own: Buffer, tx: Var, threads: int,
                      blocks: tuple[str, str]) -> list[Stmt]:
    """The threads' (max, Σ exp(· - max)) pairs combined over the block: the max all-reduced,
    each thread's sum moved to it, the sums all-reduced (`m_own` keeps the thread's own max)."""
    return [
        BufferStore(m_own, (ZERO,), m_acc[ZERO]),
        allreduce(m_acc, "max", tx, threads, blocks[0]),
        BufferStore(s_acc, (ZERO,), s_acc[ZERO] * rescale(m_own[ZERO], m_acc[ZERO])),
        allreduce(s_acc, "+", tx, threads, blocks[1]),
    ]


def merge_max_sum(m_acc: Buffer, s_acc: Buffer, m_new: Buffer, m: Expr, s: Expr, name: str) -> Stmt:
    """Fold the pair (m, s) -- the max of some columns and the sum of exp(· - m) over them, a
    block's partial statistics -- into the running pair (m_acc, s_acc): both sums moved to the
    larger max, then added. `name` prefixes the let variables that hold m and s."""
    m_var, s_var = Var(f"{name}_max", m.dtype, "value"), Var(f"{name}_sum", s.dtype, "value")
    return LetStmt(m_var, m, LetStmt(s_var, s, seq(
        BufferStore(m_new, (ZERO,), binary("max", m_acc[ZERO], m_var)),
        BufferStore(s_acc, (ZERO,), s_acc[ZERO] * rescale(m_acc[ZERO], m_new[ZERO])
                    + s_var * rescale(m_var, m_new[ZERO])),
        BufferStore(m_acc, (ZERO,), m_new[ZERO]),
    )))


def welford_pair(passes: Sequence[Pass], i: int, col: Var) -> tuple[Tensor, Reduce, Expr] | None:
    """(stage, Reduce, μ) when pass i is a sum `Σ_c h(c)`, the last pass of its stage, and pass
    i+1 (another stage) a sum `Σ_c (h(c) - μ)²` -- `D·D` or `pow(D, 2)` with D = h - μ or μ - h,
    the same node h, μ free of the column -- both in one float accumulator type with no
    rounding between h and the square (h and D·D are already in it)."""
    if i + 1 >= len(passes):
        return None
    t, h, r = passes[i]
    t2, expr2, r2 = passes[i + 1]
    if r is None or r2 is None or t2 is t or r.combiner != "sum" or r2.combiner != "sum":
        return None
    ft = r.acc_dtype
    if not ft.is_float or r2.acc_dtype != ft or h.dtype != ft or expr2.dtype != ft:
        return None
    if not isinstance(expr2, Binary):
        return None
    if expr2.op == "*" and expr2.a is expr2.b:
        dev = expr2.a
    elif expr2.op == "pow" and isinstance(expr2.b, Const) and float(expr2.b.value) == 2.0:
        dev = expr2.a
    else:
        return None
    if not (isinstance(dev, Binary) and dev.op == "-"):
        return None
    if dev.a is h:
        mu = dev.b
    elif dev.b is h:
        mu = dev.a
    else:
        return None
    if col in free_vars(mu):
        return None
    return t2, r2, mu


def welford_moments(h: Expr, columns: ColumnWalk, row: tuple[Expr, ...], moments: tuple[Buffer, Buffer, Buffer],
                    new_local: NewLocal, tx: Var, threads: int, name: str, block: str) -> list[Stmt]:
    """One pass over the row leaving in every thread the moments (n, mean, M2) of h over the
    whole row (see the module docstring); `name` labels its registers, `block` is the shared
    array of the cross-thread combine:

        n = mean = M2 = 0
        per chunk of E columns: h_chunk[e] = h(e); c_mean = Σ h_chunk · (1/E)
                                c_M2 = Σ (h_chunk[e] - c_mean)²; Chan-merge (E, c_mean, c_M2)
        <chan_allreduce (n, mean, M2)>

    A thread with no column keeps (0, 0, 0); the merges keep it free of NaN."""
    count, mean, m2 = moments
    ft = mean.dtype
    own = (count[ZERO], mean[ZERO], m2[ZERO])
    h_chunk = new_local(f"{name}_h", ft, columns.unroll * columns.vector)
    c_sum = new_local(f"{name}_chunk_sum", ft, 1)
    c_m2 = new_local(f"{name}_chunk_m2", ft, 1)

    def chunk(ch: Chunk) -> Stmt:
        if ch.elements == 1:  # Welford's update: the chunk is (1, h, 0)
            return chan_merge(moments, own, (Const(1.0, ft), ch.value(h), Const(0.0, ft)), f"{name}_chunk")
        c_mean = Var(f"{name}_chunk_mean", ft, "value")
        dev = h_chunk[ch.slot] - c_mean
        return seq(
            BufferStore(c_sum, (ZERO,), Const(0.0, ft)),
            ch.each(seq(BufferStore(h_chunk, (ch.slot,), ch.value(h)),
                        BufferStore(c_sum, (ZERO,), c_sum[ZERO] + h_chunk[ch.slot]))),
            LetStmt(c_mean, c_sum[ZERO] * Const(1.0 / ch.elements, ft), seq(
                BufferStore(c_m2, (ZERO,), Const(0.0, ft)),
                ch.each(BufferStore(c_m2, (ZERO,), c_m2[ZERO] + dev * dev)),
                chan_merge(moments, own, (Const(float(ch.elements), ft), c_mean, c_m2[ZERO]), f"{name}_chunk"))),
        )

    return [
        *(BufferStore(b, (ZERO,), Const(0.0, ft)) for b in moments),
        columns.loop([h], row, chunk),
        chan_allreduce(moments, tx, threads, block),
    ]


def centered_sum(moments: tuple[Buffer, Buffer, Buffer], mu: Expr) -> Expr:
    """Σ (h - μ)² from the moments of h: M2 + n·(mean - μ)² (0 for an empty row, whatever μ)."""
    count, mean, m2 = (b[ZERO] for b in moments)
    shift = mean - mu
    return m2 + select(compare(">", count, Const(0.0, count.dtype)), count * shift * shift, Const(0.0, count.dtype))


def _reads(e: Expr, node: Expr) -> bool:
    return any(n is node for n in walk(e))


__all__ = ["allreduce_max_sum", "centered_sum", "max_sum_exp_pair", "merge_max_sum", "online_max_sum", "rescale",
           "welford_moments", "welford_pair"]
