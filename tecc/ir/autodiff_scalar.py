"""Reverse mode on one scalar expression (tc.grad's step 2, tecc/ir/autodiff.py): the adjoint of
every differentiable read of a compute's body, given the body's adjoint, by the derivative rules
of docs/pytorch.md's table (`_local_adjoints`, `_call_derivative`). A read is differentiable when
it is a float read of an active tensor (one on a path from a requested input to the output);
reads are the leaves, each node is visited once, children's contributions are summed.
"""

from __future__ import annotations

import math

from .errors import GradientError
from .expr import Binary, Call, Cast, Const, Expr, Select, TensorRead, binary, call, cast, compare, postorder, select
from .philox import RandomUniform

def _differentiable_read(e: Expr, active: set[int]) -> bool:
    return isinstance(e, TensorRead) and e.dtype.is_float and id(e.tensor) in active


def _needs_gradient(body: Expr, active: set[int]) -> set[int]:
    """Ids of the float nodes of `body` below which a read of an active tensor lies."""
    needs: set[int] = set()
    for node in _postorder(body):
        if not node.dtype.is_float:
            continue
        if _differentiable_read(node, active):
            needs.add(id(node))
        elif not isinstance(node, TensorRead) and any(id(c) in needs for c in node.children):
            needs.add(id(node))
    return needs


def _postorder(body: Expr) -> list[Expr]:
    """The nodes of `body`, children before parents, each once; reads are leaves."""
    return postorder([body], lambda node: () if isinstance(node, TensorRead) else node.children)


LN2 = math.log(2.0)
TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _local_adjoints(node: Expr, g: Expr) -> list[tuple[Expr, Expr]]:
    """(child, adjoint contribution) of `node` with adjoint `g`: the derivative rules."""
    if isinstance(node, Binary):
        a, b, op = node.a, node.b, node.op
        if op == "+":
            return [(a, g), (b, g)]
        if op == "-":
            return [(a, g), (b, -g)]
        if op == "*":
            return [(a, g * b), (b, g * a)]
        if op == "/":
            return [(a, g / b), (b, -(g * node) / b)]
        if op in ("max", "min"):
            # the subgradient goes to the operand that was taken; a tie to the first (a)
            first = compare(">=" if op == "max" else "<=", a, b)
            return [(a, select(first, g, 0)), (b, select(first, 0, g))]
        if op == "pow":
            return [(a, g * _pow_derivative(a, b)), (b, g * node * call("log", a))]
        return []  # integer // % & | ^: no gradient
    if isinstance(node, Select):
        return [(node.a, select(node.cond, g, 0)), (node.b, select(node.cond, 0, g))]
    if isinstance(node, Cast):
        if node.a.dtype.is_float and node.dtype.is_float:
            # a widening cast (float16 -> float32) keeps its adjoint in the wider type: the
            # gradient is rounded once, where it is gathered onto the input (_cast_to), not per term
            return [(node.a, g if node.a.dtype.bits < node.dtype.bits else cast(g, node.a.dtype))]
        return []
    if isinstance(node, Call):
        return [(node.args[0], _call_derivative(node, g))] if node.args else []
    if isinstance(node, RandomUniform):
        return []  # a constant of (seed, offset, index): no gradient flows to its integer operands
    return []


def _pow_derivative(a: Expr, b: Expr) -> Expr:
    """d(a**b)/da = b·a**(b-1), with the common constant exponents written out."""
    if isinstance(b, Const):
        if b.value == 1.0:
            return Const(1.0, a.dtype)
        if b.value == 2.0:
            return a * 2.0
        if b.value == 0.5:
            return 0.5 / call("sqrt", a)
    return b * binary("pow", a, b - 1.0)


def _call_derivative(node: Call, g: Expr) -> Expr:
    x = node.args[0]
    name = node.name
    if name == "exp":
        return g * node
    if name == "exp2":
        return g * node * LN2
    if name == "log":
        return g / x
    if name == "log2":
        return g / (x * LN2)
    if name == "sqrt":
        return g * 0.5 / node
    if name == "rsqrt":
        return g * -0.5 * node * node * node
    if name == "sin":
        return g * call("cos", x)
    if name == "cos":
        return -(g * call("sin", x))
    if name == "tanh":
        return g * (1.0 - node * node)
    if name == "sigmoid":
        return g * node * (1.0 - node)
    if name == "erf":
        return g * TWO_OVER_SQRT_PI * call("exp", -(x * x))
    if name == "abs":
        return select(compare(">", x, 0), g, select(compare("<", x, 0), -g, 0))
    if name in ("floor", "ceil", "round"):
        return Const(0.0, x.dtype)  # piecewise constant
    raise GradientError(f"grad(): no derivative rule for {name}({x})")


def scalar_adjoints(body: Expr, seed: Expr, active: set[int]) -> dict[TensorRead, Expr]:
    """The adjoint of every differentiable read of `body` when `body`'s adjoint is `seed`."""
    needs = _needs_gradient(body, active)
    if id(body) not in needs:
        return {}
    adjoint: dict[int, Expr] = {id(body): seed}
    out: dict[TensorRead, Expr] = {}
    for node in reversed(_postorder(body)):
        g = adjoint.pop(id(node), None)
        if g is None:
            continue
        if isinstance(node, TensorRead):
            out[node] = g
            continue
        for child, contribution in _local_adjoints(node, g):
            if id(child) not in needs:
                continue
            prev = adjoint.get(id(child))
            adjoint[id(child)] = contribution if prev is None else prev + contribution
    return out


__all__ = ["scalar_adjoints"]
