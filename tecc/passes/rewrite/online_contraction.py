"""Online contraction: a contraction over the axis of a (max, Σ exp) row statistic, in ONE pass.

The chain this rewrite recognises (attention is one instance; softmax followed by a contraction
is another) is, for every row r (any number of row axes) and a "key" axis j of extent N:

    m[r]    = max_j s(r, j)                              a stage whose body is that Reduce
    l[r]    = Σ_j exp(s(r, j) - m[r])                    the same s, the same extent N
    O[r, c] = g(Σ_j exp(s(r, j) - m[r]) · v(r, j, c), m[r], l[r], ..)

where s is ANY expression of (r, j): a contraction Σ_d Q[.., d]·K[.., j, d] times a scale, a
plain read X[r, j], a `where(mask, s, -inf)` (a -inf contributes exp(-inf) = 0), an additive
bias; grouped heads are only index expressions (K[b, h // G, j, d]). v is free of m and l.
The weights of the contraction may be dropped by a mask drawn from tc.rand (the chain's
`dropout`, tecc.ir.online_dropout): each kernel evaluates the keep condition at the term's row
and key and contracts `keep ? p : 0`; l sums every p, the scale 1/(1 - p) is in the output.
Outputs of shape r may be any expression of m and l (the log-sum-exp m + log l), and m and l
may be outputs themselves.

Precondition (algebraic, why one pass is exact): for any two maxima m_old ≤ m_new,

    exp(s - m_new) = exp(s - m_old) · exp(m_old - m_new)

so a sum of exp(s - m_old) over the keys seen so far becomes the sum of exp(s - m_new) by one
multiplication by α = exp(m_old - m_new), and so does every partial Σ exp(s - m_old)·v(c),
which is linear in the exps. Walking j in tiles with a running max m, a running sum l and a
partial output acc[c], each tile rescales (l, acc) by α and adds its own terms; at the end m is
the max over all keys, l = Σ_j exp(s - m) and acc[c] = Σ_j exp(s - m)·v(c) exactly as the
program defines them (Milakov & Gimelshein 2018; Dao et al., "FlashAttention", 2022). The S×N
matrix s is never stored: the kernel's memory is O(rows·C) and one tile of s per block.

What `online_chain` refuses, with the condition that fails (ScheduleError): no stage that is a
max over one axis; no sum whose summand is exp(s - m) of that max's own s (a sum of exp without
the max, or of exp(s - c) for another c); no output contracting exp(s - m) against a v over
the same key axis (a contraction over a different axis, or of another summand); m or l read at
another row; a Reduce inside v or inside a row output; an intermediate stage that is also an
output (the S×N scores, which the rewrite would have to write); an output of another shape.

The kernel (`online_contraction`): a block holds `rows_per_block` consecutive query rows (the
last row axis; threadIdx.y) of one head (the leading row axes, flattened onto blockIdx.y) and
`threads` lanes per row (threadIdx.x). The key axis is walked in tiles of `threads` keys:
each lane computes one s(r, j) of the tile (its contraction over d serially) into shared
memory, a barrier, then every lane of the row reads the row's tile (a broadcast), takes its
max, rescales and accumulates the columns c = k·T + tx it owns (K = ceil(C / T) registers). SIMT only: no tensor cores, no staging of K/V tiles
shared between rows of a head (docs/attention.md lists what is left).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Sequence

from ...ir import dtype as dt
from ...ir.arith import logical_and
from ...ir.errors import ScheduleError
from ...ir.online_chain import ChainParts, find_chain, row_index
from ...ir.expr import (
    Binary,
    Cast,
    Const,
    Expr,
    Reduce,
    TensorRead,
    Var,
    binary,
    cast,
    compare,
    const_int,
    reduce_identity,
    select,
    size_product,
    substitute,
)
from ...ir.stmt import (
    Allocate,
    Barrier,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    KernelCall,
    LetStmt,
    Module,
    PrimFunc,
    Stmt,
    seq,
)
from ...ir.tensor import Tensor
from ...ir.visitor import ExprMutator, SubexpressionReplacer
from ..lower import COMBINE, Program, Signature, collect_program, kernel_params, signature
from ..names import identifier
from .online_stats import rescale


@dataclass
class OnlineChain(ChainParts):
    """A recognised chain (tecc.ir.online_chain.ChainParts: its parts in canonical variables) and
    the program it was found in, whose buffers and names the kernels take."""

    program: Program


def online_chain(args: Sequence[Tensor]) -> OnlineChain:
    """The chain of the program `args` (module docstring; the search is tecc.ir.online_chain's),
    or ScheduleError naming the failing condition."""
    prog = collect_program(args)
    outputs = {id(a) for a in args if not a.is_placeholder}
    parts = find_chain(prog.order, outputs)
    return OnlineChain(program=prog, **{f.name: getattr(parts, f.name) for f in fields(ChainParts)})


# gridDim.y is at most 65535 (CUDA C++ Programming Guide, "Technical Specifications")
MAX_GRID_Y = 65535


class ExpressionLowering:
    """Expressions with TensorReads and Reduce nodes -> loads and serial reduction loops."""

    def __init__(self, buffers: dict[Tensor, Buffer], unique: Callable[[str], str]) -> None:
        self.buffers = buffers
        self.unique = unique
        self.allocs: list[Buffer] = []

    def value(self, e: Expr) -> tuple[list[Stmt], Expr]:
        stmts: list[Stmt] = []
        outer = self

        class _Reads(ExprMutator):
            def visit_TensorRead(self, n: TensorRead) -> Expr:  # noqa: N802
                idx = tuple(self.visit(i) for i in n.indices)
                return outer.buffers[n.tensor][idx]

            def visit_Reduce(self, r: Reduce) -> Expr:  # noqa: N802
                return outer.reduce(r, stmts)

        return stmts, _Reads().visit(e)

    def reduce(self, r: Reduce, stmts: list[Stmt]) -> Expr:
        unique = self.unique
        acc = Buffer(unique("dot_acc"), r.acc_dtype, (1,), "local", tensor="dot.acc")
        self.allocs.append(acc)
        zero = Const(0, dt.int32)
        loops = {ax: Var(unique(ax.name), dt.int32) for ax in r.axes}
        mapping: dict[Var, Expr] = {ax: v for ax, v in loops.items()}
        inner, src = self.value(substitute(r.source, mapping))
        body: Stmt = seq(*inner, BufferStore(acc, (zero,), binary(COMBINE[r.combiner], acc[zero],
                                                                   cast(src, r.acc_dtype))))
        for ax in reversed(r.axes):
            body = For(loops[ax], ax.lo, ax.extent, "serial", body)
        stmts.append(BufferStore(acc, (zero,), reduce_identity(r.combiner, r.acc_dtype)))
        stmts.append(body)
        return cast(acc[zero], r.dtype)


def head_indices(flat: Expr, heads: Sequence[Expr]) -> tuple[Expr, ...]:
    """The leading row axes' indices of the flattened head index `flat` (row-major)."""
    idx: list[Expr] = []
    rest: Expr = flat
    for i, extent in enumerate(reversed(heads)):
        idx.append(rest if i == len(heads) - 1 else rest % extent)
        rest = rest // extent
    return tuple(reversed(idx))


def online_contraction(args: Sequence[Tensor], threads: int = 32, rows_per_block: int = 4,
                       name: str | None = None) -> Module:
    """The module of ONE kernel computing the chain `args` (module docstring): `rows_per_block`
    rows per block, `threads` lanes per row (a tile of `threads` keys per step)."""
    chain = online_chain(args)
    c_const = _checked_columns(chain, threads, rows_per_block)
    sig = signature(chain.program)
    buffers, unique = sig.buffers, sig.unique
    T, BR = threads, rows_per_block
    K = -(-c_const // T)
    zero = Const(0, dt.int32)

    bx = Var(unique("query_block"), dt.int32)
    by = Var(unique("head"), dt.int32)
    tx = Var(unique("tx"), dt.int32)
    ty = Var(unique("ty"), dt.int32)
    tile = Var(unique("tile"), dt.int32)
    jj = Var(unique("jj"), dt.int32)
    kk = Var(unique("k"), dt.int32)
    # blockIdx.y: the leading row axes (b, h), flattened; blockIdx.x: a block of BR consecutive
    # query rows (the last row axis) of that head, so the rows of a block read the same keys
    heads, queries = chain.rows[:-1], chain.rows[-1]
    n_heads = size_product(heads)
    if (const_int(n_heads) or 0) > MAX_GRID_Y:
        raise ScheduleError(f"online_contraction: {const_int(n_heads)} heads (the leading row axes) exceed the "
                            f"grid's y extent {MAX_GRID_Y}")
    query: Expr = bx * BR + ty
    row_idx = head_indices(by, heads) + (query,)
    row_ok = compare("<", query, queries)
    at_row = dict(zip(chain.row, row_idx))

    ft_m = chain.m.op.body.acc_dtype  # type: ignore[union-attr]
    l_red = chain.l.op.body  # type: ignore[union-attr]
    assert isinstance(l_red, Reduce)
    ft_l = l_red.acc_dtype
    ft_o = chain.contraction.acc_dtype
    score_dt = chain.score.dtype
    s_tile = Buffer(unique("s_tile"), score_dt, (BR, T), "shared", tensor="s.shared")
    m_run = Buffer(unique("m_run"), ft_m, (1,), "local", tensor=f"{chain.m.name}.running")
    m_new = Buffer(unique("m_new"), ft_m, (1,), "local", tensor=f"{chain.m.name}.new")
    l_run = Buffer(unique("l_run"), ft_l, (1,), "local", tensor=f"{chain.l.name}.running")
    acc = Buffer(unique("o_acc"), ft_o, (K,), "local", tensor=f"{chain.output.name}.acc")
    lower = ExpressionLowering(buffers, unique)

    # the tile's scores: lane tx computes key tile·T + tx (-inf past the keys or the rows)
    j_lane = tile * T + tx
    s_stmts, s_val = lower.value(substitute(chain.score, {**at_row, chain.key: j_lane}))
    ident = reduce_identity("max", score_dt)
    fill = IfThenElse(logical_and(row_ok, compare("<", j_lane, chain.keys)),
                      seq(*s_stmts, BufferStore(s_tile, (ty, tx), s_val)),
                      BufferStore(s_tile, (ty, tx), ident))

    s_at = s_tile[ty, jj]
    running_m = cast(m_new[zero], chain.m.dtype)
    tile_max = BufferStore(m_new, (zero,), binary("max", m_new[zero], cast(s_at, ft_m)))
    alpha = rescale(m_run[zero], m_new[zero])  # exp(m_old - m_new), 1 while both are -inf

    # exp(s - m) at the running max; a -inf score (masked, or past the keys) contributes 0
    weight = SubexpressionReplacer({chain.score: s_at, chain.m_value: running_m}).visit(chain.weight)
    weight = select(compare("==", s_at, ident), Const(0, weight.dtype), weight)
    p = Var(unique("p"), weight.dtype, "value")
    j_key = tile * T + jj
    col = kk * T + tx
    v_stmts, v_val = lower.value(substitute(chain.value, {**at_row, chain.key: j_key, chain.column: col}))
    keep_stmts, kept = _kept_weight(chain, lower, p, {**at_row, chain.key: j_key})
    p_v = _contraction_term(chain, kept, v_val)
    accumulate = LetStmt(p, weight, seq(
        BufferStore(l_run, (zero,), l_run[zero] + cast(p, ft_l)),
        *keep_stmts,
        For(kk, 0, K, "unroll", IfThenElse(compare("<", col, chain.columns), seq(
            *v_stmts, BufferStore(acc, (kk,), acc[kk] + cast(p_v, ft_o))))),
    ))
    scale = Var(unique("alpha"), ft_m, "value")
    tile_body = seq(
        fill,
        Barrier(),
        BufferStore(m_new, (zero,), m_run[zero]),
        For(jj, 0, T, "serial", tile_max),
        LetStmt(scale, alpha, seq(
            BufferStore(l_run, (zero,), l_run[zero] * cast(scale, ft_l)),
            For(kk, 0, K, "unroll", BufferStore(acc, (kk,), acc[kk] * cast(scale, ft_o))),
        )),
        For(jj, 0, T, "serial", IfThenElse(logical_and(row_ok, compare("<", j_key, chain.keys)), accumulate)),
        BufferStore(m_run, (zero,), m_new[zero]),
        Barrier(),
    )
    n_tiles = (chain.keys + (T - 1)) // T

    # the end: the statistics are final; outputs of the row (lane 0), the contraction output
    final: dict[Expr, Expr] = {chain.m_value: cast(m_run[zero], chain.m.dtype), chain.l_value: cast(l_run[zero], chain.l.dtype)}
    finish: list[Stmt] = []
    for t, row_value in chain.row_outputs:
        st, val = lower.value(SubexpressionReplacer(final).visit(substitute(row_value, at_row)))
        finish.append(IfThenElse(compare("==", tx, zero), seq(*st, BufferStore(buffers[t], row_index(t, row_idx),
                                                                              cast(val, t.dtype)))))
    out_body = SubexpressionReplacer({**final, chain.contraction: cast(acc[kk], chain.contraction.dtype)}).visit(chain.output_body)
    st, val = lower.value(substitute(out_body, {**at_row, chain.column: col}))
    out = buffers[chain.output]
    finish.append(For(kk, 0, K, "unroll", IfThenElse(compare("<", col, chain.columns), seq(
        *st, BufferStore(out, row_idx + (col,), cast(val, chain.output.dtype))))))

    body: Stmt = seq(
        BufferStore(m_run, (zero,), reduce_identity("max", ft_m)),
        BufferStore(l_run, (zero,), Const(0, ft_l)),
        For(kk, 0, K, "unroll", BufferStore(acc, (kk,), Const(0, ft_o))),
        For(tile, 0, n_tiles, "serial", tile_body),
        IfThenElse(row_ok, seq(*finish)),
    )
    for buf in reversed([m_run, m_new, l_run, acc, *lower.allocs]):
        body = Allocate(buf, body)
    body = Allocate(s_tile, body)
    body = For(bx, 0, (queries + (BR - 1)) // BR, "blockIdx.x",
               For(ty, 0, BR, "threadIdx.y", For(tx, 0, T, "threadIdx.x", body)))
    if heads:
        body = For(by, 0, n_heads, "blockIdx.y", body)

    return _one_kernel_module(chain, sig, body, name)


def _kept_weight(chain: OnlineChain, lower: ExpressionLowering, p: Var,
                 at_key: dict[Var, Expr]) -> tuple[list[Stmt], Expr]:
    """The weight p as the contraction takes it: p, or 0 where the dropout drops the key at
    `at_key` (Σ_j keep·p·v; l sums every p, the dropout's scale is in the output)."""
    if chain.dropout is None:
        return [], p
    stmts, keep = lower.value(substitute(chain.dropout.keep, at_key))
    return stmts, select(keep, p, Const(0, p.dtype))


def _checked_columns(chain: OnlineChain, threads: int, rows_per_block: int) -> int:
    """The output's constant column extent, or ScheduleError when the block shape or the columns
    do not fit the SIMT kernel."""
    if threads % 32 or threads <= 0 or rows_per_block < 1 or threads * rows_per_block > 1024:
        raise ScheduleError(f"online_contraction: threads={threads} must be a multiple of 32 and threads·"
                            f"rows_per_block={threads * rows_per_block} at most 1024")
    c_const = const_int(chain.columns)
    if c_const is None:
        raise ScheduleError(f"online_contraction: the output's column extent {chain.columns} must be a constant "
                            "(each lane keeps its columns' partial sums in registers)")
    return c_const


def _one_kernel_module(chain: OnlineChain, sig: Signature, body: Stmt, name: str | None) -> Module:
    """The module of the one kernel whose body is `body`, its parameters those it uses."""
    prog = chain.program
    params = kernel_params(body, [sig.buffers[a] for a in prog.args], (), sig.scalars)
    kname = sig.unique(f"{chain.output.name}_online_kernel")
    mname = identifier(name or next(a.name for a in reversed(prog.args) if not a.is_placeholder))
    attrs: tuple[tuple[str, object], ...] = (
        ("online_contraction", (chain.m.name, chain.l.name, chain.output.name)),)
    kernel = PrimFunc(kname, params, body, attrs)
    module_params = tuple(sig.buffers[a] for a in prog.args) + tuple(sig.scalars)
    return Module(mname, module_params, (kernel,), (KernelCall(kname, params),), ())


def _contraction_term(chain: OnlineChain, p: Expr, v: Expr) -> Expr:
    """The contraction's summand with the weight replaced by `p` (keeping the program's operand
    order and any cast of the weight)."""
    src = substitute(chain.contraction.source, {chain.contraction.axes[0]: chain.key})
    assert isinstance(src, Binary)
    a, b = src.a, src.b
    if a is chain.weight or (isinstance(a, Cast) and a.a is chain.weight):
        return binary("*", cast(p, a.dtype), v)
    return binary("*", v, cast(p, b.dtype))


__all__ = ["MAX_GRID_Y", "ExpressionLowering", "OnlineChain", "head_indices", "online_chain", "online_contraction"]
