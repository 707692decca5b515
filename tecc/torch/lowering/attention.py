"""Scaled dot-product attention (the flash, efficient, cudnn and CPU-flash ops and their
backwards) as tensor expressions.

The forward is written in the form docs/attention.md gives, so the online-contraction rewrite
recognises it by structure: scores `S = Σ_d q·k · scale`, a mask as `where(keep, S, -inf)` (or an
additive bias), the row max `m`, `e = exp(S - m)`, the row sum `l`, the output `Σ_j e·v / l` and
the log-sum-exp `m + log l` as a row output. Grouped heads read `k[b, h // G, j, d]`.

The backward recomputes the probabilities from the saved log-sum-exp, `P = exp(S - lse)` (the
scores' contraction and mask written inside P's expression), and is the usual five contractions:
`D = rowsum(dO·O)`, `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P·(dP - D)`, `dQ = Σ_j (scale·dS)·K`,
`dK = Σ_i (scale·dS)ᵀ·Q` (the heads of a group summed for dK and dV): the FlashAttention-2 form
tc.grad writes (tecc.ir.autodiff_online), which the online_backward strategy takes as its
tensor-core kernels for 16-bit operands on sm_80+ (no (rows x keys) buffer). Everything
accumulates in float32 and rounds once to the inputs' dtype, as torch's kernels.

Attention dropout (dropout_p > 0 inside the op) is not lowered: such a node runs as ATen.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.arith import binary, compare
from ...ir.expr import Binary, Cast, Compare, Const, Expr, ExprLike, Not, Select, TensorRead, substitute
from ...ir.tensor import ComputeOp, Tensor, reduce_axis
from ...ir.visitor import ExprMutator
from ...passes.simplify import linear_form
from .context import LoweringContext, Unsupported, broadcast_read, constant, static_int


class Filler:
    """An output of an attention op that tecc does not compute (the random-generator state of a
    dropout that is off, cumulative sequence lengths, a debug mask): made by torch at run time
    as zeros of the node's shape and dtype (graph.py), or None where the op returns None."""

    def __init__(self, position: int) -> None:
        self.position = position


def _check(q: Any, k: Any, v: Any, dropout_p: Any) -> tuple[Tensor, Tensor, Tensor]:
    if not all(isinstance(t, Tensor) and t.ndim == 4 for t in (q, k, v)):
        raise Unsupported("attention of other than 4-dimensional query, key and value tensors")
    if dropout_p not in (0, 0.0):
        raise Unsupported("attention with dropout inside the op (dropout_p > 0) is not lowered")
    if not q.dtype.is_float:
        raise Unsupported(f"attention of {q.dtype}")
    return q, k, v


class _Heads:
    """Sizes and the grouped-head map h -> h // G of one attention problem."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, scale: Any) -> None:
        self.batch, self.heads, self.rows, self.depth = q.shape
        self.kv_heads, self.keys, self.vdepth = k.shape[1], k.shape[2], v.shape[3]
        h, hk = static_int(self.heads), static_int(self.kv_heads)
        if self.heads is self.kv_heads or (h is not None and h == hk):
            self.group = 1
        elif h is not None and hk is not None and hk > 0 and h % hk == 0:
            self.group = h // hk
        else:
            raise Unsupported("grouped heads whose group size is not a constant")
        if scale is None:
            e = static_int(self.depth)
            if e is None:
                raise Unsupported("attention with a symbolic head dim and no scale")
            scale = 1.0 / math.sqrt(e)
        self.scale = scale

    def kv(self, h: Expr) -> ExprLike:
        return h if self.group == 1 else h // self.group


def _f32(x: Expr) -> Expr:
    return te.cast(x, dt.float32)


def _score_fn(q: Tensor, k: Tensor, heads: _Heads, causal: bool, mask: Any) -> Callable[..., Expr]:
    """(b, h, i, j) -> the masked score S[b, h, i, j] in float32, as one expression (the sum over
    the head dim inside it)."""
    shape = (heads.batch, heads.heads, heads.rows, heads.keys)
    d = reduce_axis(heads.depth, "d")
    scale = constant(heads.scale, dt.float32) if not isinstance(heads.scale, Expr) else _f32(heads.scale)
    ninf = constant(-math.inf, dt.float32)

    def raw(b: Expr, h: Expr, i: Expr, j: Expr) -> Expr:
        return te.sum(_f32(q[b, h, i, d]) * _f32(k[b, heads.kv(h), j, d]), d) * scale

    keep = additive_keep(mask) if isinstance(mask, Tensor) and not mask.dtype.is_bool else None

    def masked(s: Expr, b: Expr, h: Expr, i: Expr, j: Expr) -> Expr:
        if causal:
            s = te.where(j <= i, s, ninf)
        if keep is not None:
            s = te.where(keep((b, h, i, j), shape), s, ninf)
        elif isinstance(mask, Tensor):
            m = broadcast_read(mask, (b, h, i, j), shape)
            s = te.where(m, s, ninf) if mask.dtype.is_bool else s + _f32(m)
        return s

    score = lambda b, h, i, j: masked(raw(b, h, i, j), b, h, i, j)  # noqa: E731
    score.raw, score.masked, score.shape = raw, masked, shape  # type: ignore[attr-defined]
    return score


def additive_keep(mask: Tensor) -> Callable[[Sequence[Expr], Sequence[ExprLike]], Expr] | None:
    """For a float mask computed in the graph as `where(keep, 0, -inf)` (or `where(not keep, -inf,
    0)`, torch's conversion of a boolean mask for its fused SDPA ops) with `keep` a function of
    the indices alone (what transformers builds for SDPA under torch.compile: the causal mask
    from `arange` and `le`): (score index, score shape) -> `keep` there, as an index expression.
    Softmax(S + mask) is then softmax(where(keep, S, -inf)): the mask inside the scores, whose
    masked key blocks the online kernels skip, instead of a stored [B, 1, L, S] tensor read at
    every score and every key block computed. The two differ only where a masked score is itself
    +inf or NaN. A finite masked value (MASKED_AT_MOST or below: transformers' -65504) is taken
    as -inf where `keep` holds on the diagonal of a square mask (no row masked whole); they then
    differ only where a masked score exceeds its row's largest kept score by |value| - 104 or
    more (whose exp eager does not round to 0). None for any other mask."""
    op = mask.op
    if type(op) is not ComputeOp:
        return None
    body = op.body
    while isinstance(body, Cast):
        body = body.a
    if not isinstance(body, Select):
        return None
    chosen = (_constant(body.a), _constant(body.b))
    if chosen[0] == 0.0 and chosen[1] is not None and chosen[1] <= MASKED_AT_MOST:
        masked, kept_when = chosen[1], True
    elif chosen[1] == 0.0 and chosen[0] is not None and chosen[0] <= MASKED_AT_MOST:
        masked, kept_when = chosen[0], False      # torch's where(logical_not(keep), -inf, 0)
    else:
        return None
    try:
        cond = _IndexOnly().visit(body.cond)
    except _ReadsData:
        return None
    cond = _int32_compares(cond if kept_when else _negated(cond))
    if masked != -math.inf and not _keeps_the_diagonal(cond, op.axes, mask.shape):
        return None

    def keep(idx: Sequence[Expr], shape: Sequence[ExprLike]) -> Expr:
        offset = len(idx) - mask.ndim
        at = [Const(0, ax.dtype) if static_int(n) == 1 and static_int(shape[offset + d]) != 1 else idx[offset + d]
              for d, (ax, n) in enumerate(zip(op.axes, mask.shape))]
        return substitute(cond, dict(zip(op.axes, at)))
    return keep


# a float mask's value for a masked score, at most: -inf, or a finite stand-in for it (transformers
# writes torch.finfo(float16).min, -65504) that exp() takes to 0 next to any kept score within
# |value| - 104 of it (float32's exp underflows below -103.97)
MASKED_AT_MOST = -1.0e4


class _ReadsData(Exception):
    pass


def _keeps_the_diagonal(cond: Expr, axes: Sequence[Any], shape: Sequence[ExprLike]) -> bool:
    """Whether `cond` over a square (rows, keys) mask holds at key = row, so that no row is
    masked whole: with a finite masked value eager's softmax of a row masked whole is uniform
    over it, where the -inf form's is not."""
    if len(axes) < 2 or static_int(shape[-1]) is None or static_int(shape[-1]) != static_int(shape[-2]):
        return False
    return _holds(substitute(cond, {axes[-1]: axes[-2]}))


def _holds(cond: Expr) -> bool:
    """Whether `cond` is true at every point: a comparison whose sides differ by a constant, or a
    conjunction (disjunction) of such."""
    if isinstance(cond, Binary) and cond.op in ("&", "|"):
        a, b = _holds(cond.a), _holds(cond.b)
        return (a and b) if cond.op == "&" else (a or b)
    if isinstance(cond, Compare) and cond.a.dtype.is_int and cond.b.dtype.is_int:
        terms, diff = linear_form(binary("-", cond.a, cond.b))
        if any(terms.values()):
            return False
        return {"<": diff < 0, "<=": diff <= 0, ">": diff > 0, ">=": diff >= 0, "==": diff == 0, "!=": diff != 0}[cond.op]
    return False


_OPPOSITE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def _negated(cond: Expr) -> Expr:
    """`not cond`, a double negation or a comparison turned around rather than wrapped."""
    if isinstance(cond, Not):
        return cond.a
    if isinstance(cond, Compare) and not cond.a.dtype.is_float:
        return compare(_OPPOSITE[cond.op], cond.a, cond.b)
    return ~cond


def _int32_compares(cond: Expr) -> Expr:
    """`cond` with each comparison of int64 index arithmetic (`arange` is int64: `int64(j) <=
    int64(i)`) made on the int32 index variables, as the masks the online kernels bound their key
    loops by are written."""
    if isinstance(cond, Binary) and cond.op in ("&", "|") and cond.dtype.is_bool:
        return binary(cond.op, _int32_compares(cond.a), _int32_compares(cond.b))
    if isinstance(cond, Compare):
        a, b = _int32(cond.a), _int32(cond.b)
        if a is not None and b is not None:
            return compare(cond.op, a, b)
    return cond


def _int32(e: Expr) -> Expr | None:
    """Int64 index arithmetic that neither grows nor wraps (casts of int32 values, int32-range
    constants, + - min max of those: a bound on a dimension's index) in int32, or None."""
    if e.dtype == dt.int32:
        return e
    if isinstance(e, Cast) and e.dtype == dt.int64 and e.a.dtype == dt.int32:
        return e.a
    if isinstance(e, Const) and e.dtype == dt.int64 and -(1 << 30) <= int(e.value) < (1 << 30):
        return Const(int(e.value), dt.int32)
    if isinstance(e, Binary) and e.op in ("+", "-", "min", "max"):
        a, b = _int32(e.a), _int32(e.b)
        if a is not None and b is not None:
            return binary(e.op, a, b)
    return None


class _IndexOnly(ExprMutator):
    """An expression with every read of an elementwise compute replaced by its body at the read's
    indices; _ReadsData where it reads an input or a reduction (data, not indices)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        op = e.tensor.op
        if type(op) is not ComputeOp or op.reductions or self.depth > 64:
            raise _ReadsData(e.tensor.name)
        idx = [self.visit(i) for i in e.indices]
        self.depth += 1
        try:
            return self.visit(substitute(op.body, dict(zip(op.axes, idx))))
        finally:
            self.depth -= 1


def _constant(e: Expr, depth: int = 8) -> float | None:
    """The value of `e` when it is a constant: a literal, a cast of one, or a read of a compute
    whose body is one (a `scalar_tensor`)."""
    while isinstance(e, Cast):
        e = e.a
    if isinstance(e, Const):
        return float(e.value)
    if isinstance(e, TensorRead) and depth > 0 and isinstance(e.tensor.op, ComputeOp):
        return _constant(e.tensor.op.body, depth - 1)
    return None


def _scores(ctx: LoweringContext, q: Tensor, k: Tensor, heads: _Heads, causal: bool, mask: Any) -> Tensor:
    """The (masked) scores S[b, h, i, j] in float32: the contraction a stage, the mask another."""
    fn = _score_fn(q, k, heads, causal, mask)
    scores = ctx.compute(fn.shape, fn.raw, "_scores")  # type: ignore[attr-defined]
    if not causal and mask is None:
        return scores
    return ctx.compute(fn.shape, lambda b, h, i, j: fn.masked(scores[b, h, i, j], b, h, i, j),  # type: ignore[attr-defined]
                       "_masked")


def attention_forward(ctx: LoweringContext, q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Any,
                      scale: Any) -> tuple[Tensor, Tensor]:
    """(output, log-sum-exp [B, H, L]) of softmax(q·kᵀ·scale + mask)·v."""
    heads = _Heads(q, k, v, scale)
    s = _scores(ctx, q, k, heads, causal, mask)
    rows = (heads.batch, heads.heads, heads.rows)
    j1, j2, j3 = (reduce_axis(heads.keys, n) for n in ("j1", "j2", "j3"))
    m = ctx.compute(rows, lambda b, h, i: te.max(s[b, h, i, j1], j1), "_max")
    e = ctx.compute(s.shape, lambda b, h, i, j: te.exp(s[b, h, i, j] - m[b, h, i]), "_exp")
    total = ctx.compute(rows, lambda b, h, i: te.sum(e[b, h, i, j2], j2), "_sum")
    out_dtype = ctx.out_dtype(0)
    out = ctx.compute(rows + (heads.vdepth,), lambda b, h, i, c: te.cast(
        te.sum(e[b, h, i, j3] * _f32(v[b, heads.kv(h), j3, c]), j3) / total[b, h, i], out_dtype))
    lse = ctx.compute(rows, lambda b, h, i: m[b, h, i] + te.log(total[b, h, i]), "_lse")
    return out, lse


def _lse_as_node(ctx: LoweringContext, lse: Tensor, position: int) -> Any:
    """The log-sum-exp in the layout the op returns: [B, H, L], padded to a multiple of 32 rows
    (efficient attention; the padding is 0), or [B, H, L, 1] (cudnn); an empty one when the op
    was not asked for it."""
    shape = ctx.out_shape(position)
    rows = lse.shape[2]
    if len(shape) == 4:
        return ctx.compute(shape, lambda b, h, i, one: lse[b, h, i], "_lse_out")
    if shape[2] is rows or static_int(shape[2]) == static_int(rows):
        return lse
    if static_int(shape[2]) == 0:
        return Filler(position)
    zero = constant(0, dt.float32)
    return ctx.compute(shape, lambda b, h, i: te.where(i < rows, lse[b, h, i], zero),
                       "_lse_out")


def _fillers(ctx: LoweringContext, values: dict[int, Any]) -> tuple[Any, ...]:
    count = len(ctx.meta)
    return tuple(values[p] if p in values else Filler(p) for p in range(count))


# ---- the ops --------------------------------------------------------------------------------------
def lower_flash_cpu(ctx: LoweringContext, q: Any, k: Any, v: Any, dropout_p: Any = 0.0, is_causal: bool = False,
                    *, attn_mask: Any = None, scale: Any = None) -> tuple[Any, ...]:
    q, k, v = _check(q, k, v, dropout_p)
    out, lse = attention_forward(ctx, q, k, v, is_causal, attn_mask, scale)
    return out, lse


def lower_flash(ctx: LoweringContext, q: Any, k: Any, v: Any, dropout_p: Any = 0.0, is_causal: bool = False,
                return_debug_mask: bool = False, *, scale: Any = None) -> tuple[Any, ...]:
    q, k, v = _check(q, k, v, dropout_p)
    out, lse = attention_forward(ctx, q, k, v, is_causal, None, scale)
    return _fillers(ctx, {0: out, 1: _lse_as_node(ctx, lse, 1), 4: q.shape[2], 5: k.shape[2]})


def lower_efficient(ctx: LoweringContext, q: Any, k: Any, v: Any, attn_bias: Any, compute_log_sumexp: bool,
                    dropout_p: Any = 0.0, is_causal: bool = False, *, scale: Any = None) -> tuple[Any, ...]:
    q, k, v = _check(q, k, v, dropout_p)
    out, lse = attention_forward(ctx, q, k, v, is_causal, attn_bias, scale)
    return _fillers(ctx, {0: out, 1: _lse_as_node(ctx, lse, 1)})


def lower_cudnn(ctx: LoweringContext, q: Any, k: Any, v: Any, attn_bias: Any, compute_log_sumexp: bool,
                dropout_p: Any = 0.0, is_causal: bool = False, return_debug_mask: bool = False, *,
                scale: Any = None) -> tuple[Any, ...]:
    q, k, v = _check(q, k, v, dropout_p)
    out, lse = attention_forward(ctx, q, k, v, is_causal, attn_bias, scale)
    return _fillers(ctx, {0: out, 1: _lse_as_node(ctx, lse, 1), 4: q.shape[2], 5: k.shape[2]})


def attention_backward(ctx: LoweringContext, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, causal: bool, mask: Any, scale: Any) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention_forward (module docstring)."""
    heads = _Heads(q, k, v, scale)
    # P = exp(S - lse) with S written inside it (the contraction and the mask one expression):
    # the form tc.grad gives an online contraction's backward (tecc.ir.autodiff_online), which
    # the online_backward strategy recognises, so no (rows x keys) stage is stored on the GPU
    score = _score_fn(q, k, heads, causal, mask)
    shape = (heads.batch, heads.heads, heads.rows, heads.keys)
    G = heads.group

    def lse_at(b: Expr, h: Expr, i: Expr) -> Expr:
        return _f32(lse[b, h, i, 0] if lse.ndim == 4 else lse[b, h, i])

    p = ctx.compute(shape, lambda b, h, i, j: te.exp(score(b, h, i, j) - lse_at(b, h, i)), "_probs")
    c1 = reduce_axis(heads.vdepth, "c1")
    rows = (heads.batch, heads.heads, heads.rows)
    delta = ctx.compute(rows, lambda b, h, i: te.sum(_f32(grad[b, h, i, c1]) * _f32(out[b, h, i, c1]), c1), "_delta")
    c2 = reduce_axis(heads.vdepth, "c2")
    dp = ctx.compute(shape, lambda b, h, i, j: te.sum(_f32(grad[b, h, i, c2]) * _f32(v[b, heads.kv(h), j, c2]), c2),
                     "_dprobs")
    ds = ctx.compute(shape, lambda b, h, i, j: p[b, h, i, j] * (dp[b, h, i, j] - delta[b, h, i]), "_dscores")
    scale_f = constant(heads.scale, dt.float32) if not isinstance(heads.scale, Expr) else _f32(heads.scale)

    j = reduce_axis(heads.keys, "j")
    dq = ctx.compute(q.shape, lambda b, h, i, d: te.cast(
        te.sum(ds[b, h, i, j] * scale_f * _f32(k[b, heads.kv(h), j, d]), j), ctx.out_dtype(0)), "_dq")

    def over_group(body: Callable[[Expr, Expr], Expr]) -> Expr:
        i = reduce_axis(heads.rows, "i")
        if G == 1:
            return te.sum(body(None, i), i)  # type: ignore[arg-type]
        g = reduce_axis(G, "g")
        return te.sum(body(g, i), [g, i])

    def head(hk: Expr, g: Expr | None) -> ExprLike:
        return hk if g is None else hk * G + g

    dk = ctx.compute(k.shape, lambda b, hk, jj, d: te.cast(over_group(
        lambda g, i: ds[b, head(hk, g), i, jj] * scale_f * _f32(q[b, head(hk, g), i, d])), ctx.out_dtype(1)), "_dk")
    dv = ctx.compute(v.shape, lambda b, hk, jj, c: te.cast(over_group(
        lambda g, i: p[b, head(hk, g), i, jj] * _f32(grad[b, head(hk, g), i, c])), ctx.out_dtype(2)), "_dv")
    return dq, dk, dv


def _tensors(*xs: Any) -> Sequence[Tensor]:
    if not all(isinstance(x, Tensor) for x in xs):
        raise Unsupported("an attention backward with a non-tensor operand")
    return xs


def lower_flash_cpu_backward(ctx: LoweringContext, grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                             dropout_p: Any, is_causal: bool, *, attn_mask: Any = None,
                             scale: Any = None) -> tuple[Any, ...]:
    _check(q, k, v, dropout_p)
    g, q, k, v, o, l = _tensors(grad, q, k, v, out, lse)
    return attention_backward(ctx, g, q, k, v, o, l, is_causal, attn_mask, scale)


def lower_flash_backward(ctx: LoweringContext, grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                         cum_seq_q: Any, cum_seq_k: Any, max_q: Any, max_k: Any, dropout_p: Any, is_causal: bool,
                         philox_seed: Any, philox_offset: Any, *, scale: Any = None) -> tuple[Any, ...]:
    _check(q, k, v, dropout_p)
    g, q, k, v, o, l = _tensors(grad, q, k, v, out, lse)
    return attention_backward(ctx, g, q, k, v, o, l, is_causal, None, scale)


def lower_efficient_backward(ctx: LoweringContext, grad: Any, q: Any, k: Any, v: Any, attn_bias: Any, out: Any,
                             lse: Any, philox_seed: Any, philox_offset: Any, dropout_p: Any,
                             grad_input_mask: Any, is_causal: bool = False, *, scale: Any = None) -> tuple[Any, ...]:
    _check(q, k, v, dropout_p)
    if attn_bias is not None and grad_input_mask and len(grad_input_mask) > 3 and grad_input_mask[3]:
        raise Unsupported("the gradient of an attention bias")
    g, q, k, v, o, l = _tensors(grad, q, k, v, out, lse)
    dq, dk, dv = attention_backward(ctx, g, q, k, v, o, l, is_causal, attn_bias, scale)
    return dq, dk, dv, None


def lower_cudnn_backward(ctx: LoweringContext, grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                         philox_seed: Any, philox_offset: Any, attn_bias: Any, cum_seq_q: Any, cum_seq_k: Any,
                         max_q: Any, max_k: Any, dropout_p: Any, is_causal: bool, *,
                         scale: Any = None) -> tuple[Any, ...]:
    _check(q, k, v, dropout_p)
    g, q, k, v, o, l = _tensors(grad, q, k, v, out, lse)
    return attention_backward(ctx, g, q, k, v, o, l, is_causal, attn_bias, scale)
