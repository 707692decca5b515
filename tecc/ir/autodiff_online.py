"""The gradient of an online-softmax chain in the FlashAttention-2 form (docs/training.md, "The
backward of attention").

`tc.grad(O, wrt)` asks `online_gradient` first. When O is the output of the chain that
tecc.ir.online_chain finds by structure (rows r, key axis j, score s(r, j), row max m, row sum
l = Σ_j exp(s - m), O[r, c] = Σ_j exp(s - m)·v(r, j, c) / l, a cast allowed), the backward
program is written as (Dao, "FlashAttention-2", 2023, Algorithm 2):

    lse[r]   = m[r] + log l[r]                       a second output of the forward, saved
    Δ[r]     = Σ_c dO[r, c]·O[r, c]                  O: the forward's output, saved
    P[r, j]  = exp(s(r, j) - lse[r])                 the probabilities, recomputed
    dP[r, j] = Σ_c dO[r, c]·v(r, j, c)
    dS[r, j] = P[r, j]·(dP[r, j] - Δ[r])
    dv       = the reverse mode of Y[r, c] = Σ_j P[r, j]·v(r, j, c) with cotangent dO, P a constant:
               dV[.., j, c] = Σ_r P[r, j]·dO[r, c] (summed over the G query heads of a K/V head)
    ds       = the reverse mode of the score stage s(r, j) with cotangent dS: for s = scale·Σ_d Q·K
               dQ = Σ_j scale·dS·K, dK = Σ_r scale·dS·Q; a mask where(c, s, -inf) passes dS where
               c holds; an additive bias gets dS itself

Why it is exact: with P = exp(s - m)/l, O = Σ_j P·v. For the weights e = exp(s - m),
∂O[r, c]/∂e[r, j] = (v(r, j, c) - O[r, c]) / l, so the adjoint of e is (dP - Δ)/l and that of s
is e·(dP - Δ)/l = P·(dP - Δ) = dS; m cancels (O does not change when every s of a row shifts by
the same amount, so the gradient through the max is zero) and exp(s - m)/l = exp(s - lse).
With dropout on the weights (the chain's `dropout`: O = Σ_j D·P·v, D = keep·scale), dV's
contraction weight is D·P and dP = D·Σ_c dO·v (`keep` regenerated from tc.rand's seed, offset and
index, never stored); Δ is unchanged (Σ_c dO·O = Σ_j P·dP).
Memory: the program holds [rows, keys] stages (P, dP, dS), but build() turns it into kernels
that keep them in registers (tecc.passes.rewrite.online_backward): O(rows·C) memory.

What is refused (the reason is kept in `Gradients.form` and the generic reverse mode is used):
no online chain (the recognizer's reason); an output that is not Σ_j exp(s - m)·v / l up to a
cast (O = acc·2, an unnormalized contraction, depends on m); a score or value holding a
reduction inside another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from . import dtype as dt
from .errors import ScheduleError
from .expr import Binary, Cast, Const, Expr, Reduce, TensorRead, Var, call, cast, select, substitute, walk
from .online_chain import ChainParts, find_chain
from .ops import sum as reduce_sum
from .tensor import Tensor, compute, placeholder, reduce_axis


@dataclass(frozen=True)
class OnlineGradient:
    """The FlashAttention-2 form of the gradient (module docstring)."""

    saved: tuple[Tensor, ...]          # placeholders of the backward: the forward's output O, its lse
    forward_outputs: tuple[Tensor, ...]  # what the forward computes for them: O itself, the lse stage
    cotangent: Tensor
    grads: dict[int, Tensor]           # id(input) -> its gradient, for the inputs s or v read
    form: str


def _strip_casts(e: Expr) -> Expr:
    while isinstance(e, Cast) and e.dtype.is_float and e.a.dtype.is_float:
        e = e.a
    return e


def _normalized(parts: ChainParts) -> str | None:
    """Why the output is not Σ_j exp(s - m)·v / l (a cast allowed around either), or None."""
    body = _strip_casts(parts.output_body)
    if isinstance(body, Binary) and body.op == "/" and _strip_casts(body.b) is parts.l_value:
        total = _strip_casts(body.a)
        if parts.dropout is not None:  # Σ_j keep·w·v · scale (tecc.ir.online_chain's canonical form)
            if not (isinstance(total, Binary) and total.op == "*" and isinstance(total.b, Const)):
                return f"the output {parts.output.name} is {parts.output_body}, not the dropout's Σ_j keep·P·v·scale"
            total = _strip_casts(total.a)
        if total is parts.contraction:
            return None
    return (f"the output {parts.output.name} is {parts.output_body}, not Σ_j exp(s - {parts.m.name})·v / "
            f"{parts.l.name} (a cast allowed): its gradient is not the softmax's")


def _nested(e: Expr) -> bool:
    return any(isinstance(n, Reduce) and any(isinstance(k, Reduce) for k in walk(n.source)) for n in walk(e))


def online_chain(output: Tensor, order: Sequence[Tensor]) -> ChainParts | str:
    """The online-softmax chain whose contraction output is `output`, in the form whose gradient
    online_gradient writes, or why not (module docstring). `order`: the forward's tensors,
    producers first."""
    try:
        parts = find_chain([t for t in order if not t.is_placeholder], {id(output)})
    except ScheduleError as exc:
        return str(exc).removeprefix("online_contraction: ")
    if parts.output is not output:
        return f"{output.name} is not the chain's contraction output"
    why = _normalized(parts)
    if why is not None:
        return why
    if _nested(parts.score) or any(isinstance(n, Reduce) for n in walk(parts.value)):
        return "the score or the value holds a reduction inside another"
    return parts


def online_gradient(output: Tensor, wrt: Sequence[Tensor], order: Sequence[Tensor], name: Callable[[str], str],
                    cotangent_name: str | None,
                    backward: Callable[[Tensor, Sequence[Tensor], Tensor, Sequence[Tensor]], tuple[Tensor, ...]]
                    ) -> OnlineGradient | str:
    """The FlashAttention-2 form of d`output`/d`wrt`, or why not (module docstring). `order`:
    the forward's tensors, producers first; `name(want)`: a tensor name not taken yet;
    `backward(stage, wrt, cotangent, constants)`: tecc.ir.autodiff's reverse mode."""
    parts = online_chain(output, order)
    if isinstance(parts, str):
        return parts
    acc = parts.score.dtype if parts.score.dtype == dt.float64 else dt.float32
    rows, keys, columns = parts.rows, parts.keys, parts.columns
    m, l = parts.m, parts.l

    def at_row(e: Expr, r: Sequence[Expr], j: Expr | None = None, c: Expr | None = None) -> Expr:
        mapping: dict[Var, Expr] = dict(zip(parts.row, r))
        if j is not None:
            mapping[parts.key] = j
        if c is not None:
            mapping[parts.column] = c
        return substitute(e, mapping)

    lse_forward = compute(rows, lambda *r: cast(m[r], acc) + call("log", cast(l[r], acc)), name=name(f"{output.name}_lse"))
    saved_o = placeholder(output.shape, output.dtype, name=output.name)
    saved_lse = placeholder(rows, lse_forward.dtype, name=lse_forward.name)
    d_out = placeholder(output.shape, output.dtype, name=cotangent_name or name(f"d{output.name}"))

    def delta_body(*r: Var) -> Expr:
        c = reduce_axis(columns, name="c")
        return reduce_sum(cast(d_out[(*r, c)], acc) * cast(saved_o[(*r, c)], acc), axis=c)

    delta = compute(rows, delta_body, name=name(f"{output.name}_delta"))
    probs = compute(tuple(rows) + (keys,), lambda *rj: call("exp", cast(at_row(parts.score, rj[:-1], rj[-1]), acc)
                                                           - saved_lse[rj[:-1]]), name=name(f"{output.name}_probs"))

    def dprobs_body(*rj: Var) -> Expr:
        c = reduce_axis(columns, name="c")
        return reduce_sum(cast(d_out[(*rj[:-1], c)], acc) * cast(at_row(parts.value, rj[:-1], rj[-1], c), acc), axis=c)

    dprobs = compute(tuple(rows) + (keys,), dprobs_body, name=name(f"d{output.name}_probs"))
    drop = parts.dropout
    if drop is not None:   # dP = keep·dP_dropped·scale: the mask regenerated from tc.rand, never stored
        dropped = dprobs
        dprobs = compute(tuple(rows) + (keys,), lambda *rj: select(
            at_row(drop.keep, rj[:-1], rj[-1]), dropped[rj] * Const(drop.scale, acc), Const(0.0, acc)),
            name=name(f"d{output.name}_kept"))
    dscores = compute(tuple(rows) + (keys,), lambda *rj: probs[rj] * (dprobs[rj] - delta[rj[:-1]]),
                      name=name(f"d{output.name}_scores"))

    grads: dict[int, Tensor] = {}
    score_inputs = _read_inputs(parts.score, wrt)
    if score_inputs:
        scores = compute(tuple(rows) + (keys,), lambda *rj: at_row(parts.score, rj[:-1], rj[-1]),
                         name=name(f"{output.name}_scores"))
        for x, g in zip(score_inputs, backward(scores, score_inputs, dscores, ())):
            grads[id(x)] = g
    value_inputs = _read_inputs(parts.value, wrt)
    if value_inputs:
        def contraction(*rc: Var) -> Expr:
            j = reduce_axis(keys, name="j")
            weight: Expr = probs[(*rc[:-1], j)]
            if drop is not None:  # dV = Σ_r keep·P·scale·dO: the forward's dropped weights
                weight = select(at_row(drop.keep, rc[:-1], j), weight * Const(drop.scale, acc), Const(0.0, acc))
            return reduce_sum(weight * cast(at_row(parts.value, rc[:-1], j, rc[-1]), acc), axis=j)

        mixed = compute(tuple(rows) + (columns,), contraction, name=name(f"{output.name}_mixed"))
        for x, g in zip(value_inputs, backward(mixed, value_inputs, d_out, (probs,))):
            grads[id(x)] = _added(grads[id(x)], g, name) if id(x) in grads else g
    form = (f"online contraction ({m.name}, {l.name}, {output.name}) in the FlashAttention-2 form: the forward saves "
            f"{output.name} and its log-sum-exp {saved_lse.name}; the backward recomputes P = exp(s - lse) and takes "
            f"dS = P·(dP - Δ) with Δ = Σ_c d{output.name}·{output.name}")
    return OnlineGradient((saved_o, saved_lse), (output, lse_forward), d_out, grads, form)


def _read_inputs(e: Expr, wrt: Sequence[Tensor]) -> list[Tensor]:
    """The tensors of `wrt` that `e` reads, in `wrt`'s order."""
    read = {id(n.tensor) for n in walk(e) if isinstance(n, TensorRead)}
    return [x for x in wrt if id(x) in read]


def _added(a: Tensor, b: Tensor, name: Callable[[str], str]) -> Tensor:
    """a + b for an input read both by the score and by the value (self-attention on one tensor)."""
    wide = dt.float64 if a.dtype == dt.float64 else dt.float32

    def total(*xs: Var) -> Expr:
        return cast(cast(a[xs], wide) + cast(b[xs], wide), a.dtype)
    return compute(a.shape, total, name=name(a.name))


__all__ = ["OnlineGradient", "online_chain", "online_gradient"]
