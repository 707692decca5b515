"""Scalar expressions: the nodes shared by tensor expressions and the loop-nest IR, how they are
built, and the walks over them. Every pass imports them from here.

The parts live in their own modules, layered so that none imports one above it:
- expr_nodes.py: the node classes and their meaning (the reference manual: floor division,
  wrapping, NaN rules, the intrinsics);
- arith.py: building nodes with dtype promotion and constant folding (`binary`, `cast`, ...),
  which the operators of `Expr` use;
- expr_visitor.py: the expression visitor and mutator (`substitute` below uses them);
- this module: the walks (`free_vars`, `walk`, `substitute`) and shapes (`to_shape`,
  `size_product`), and the one place that gathers the names.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from . import dtype as dt
from .errors import DTypeError, ShapeError
from .arith import (
    as_expr, atomic_add, atomic_add_pair, binary, call, cast, compare, load_cg, logical_and, opaque, select, thread_fence,
    warp_shuffle,
)
from .expr_nodes import (
    APPROX_INTRINSICS, ATOMIC_DTYPES, ATOMIC_INTRINSICS, FLOAT_INTRINSICS, INTRINSICS, MEMORY_INTRINSICS, OPAQUE_INTRINSICS, REDUCERS,
    WARP_INTRINSICS, Binary,
    BufferLoad, Builders, Call, Cast, Compare, Const, Expr, ExprLike, IterVar, Not, Reduce, ReduceAxis,
    Select, TensorRead, Var, const_int, index_expr, reduce_identity,
)
from .expr_visitor import VarSubstituter


def free_vars(e: Expr) -> set[Var]:
    """Every Var that occurs in `e` (reduce axes included, their domains too). Each node's set is
    found once and kept on it (nodes never change; a hash-consed subexpression is asked often)."""
    return set(frozen_free_vars(e))


def frozen_free_vars(e: Expr) -> frozenset[Var]:
    """`free_vars` as the node keeps it (no copy: for a reader that only tests or intersects)."""
    try:
        return e._vars
    except AttributeError:
        # a variable's own domain (an IterVar's lo and extent), a read's indices, else the children
        return _kept_union(e, "_vars", lambda n: (n.lo, n.extent) if isinstance(n, IterVar) else n.children,
                           lambda n: frozenset((n,)) if isinstance(n, Var) else None)


def buffers_read(e: Expr) -> frozenset[Any]:
    """The buffers of every BufferLoad in `e` (found once per node and kept on it)."""
    try:
        return e._bufs
    except AttributeError:
        return _kept_union(e, "_bufs", lambda n: n.children,
                           lambda n: frozenset((n.buffer,)) if isinstance(n, BufferLoad) else None)


def _kept_union(e: Expr, attr: str, kids_of: Callable[[Expr], Sequence[Expr]],
                own: Callable[[Expr], frozenset[Any] | None]) -> frozenset[Any]:
    """A set per node, kept on it as `attr`: the union of its `kids_of` nodes' sets and its `own`
    items; found bottom-up without recursion, each node once (nodes never change)."""
    stack = [e]
    while stack:
        n = stack[-1]
        if hasattr(n, attr):
            stack.pop()
            continue
        kids = kids_of(n)
        missing = [k for k in kids if not hasattr(k, attr)]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        found: frozenset[Any] = (frozenset().union(*(getattr(k, attr) for k in kids)) if len(kids) != 1
                                 else getattr(kids[0], attr))
        mine = own(n)
        if mine:
            found = found | mine
        object.__setattr__(n, attr, found)
    return getattr(e, attr)  # type: ignore[no-any-return]


def substitute(e: Expr, mapping: dict[Var, Expr]) -> Expr:
    """`e` with each variable in `mapping` replaced by its expression."""
    return VarSubstituter(mapping).visit(e)


def postorder(roots: Sequence[Any], children: Callable[[Any], Iterable[Any]]) -> list[Any]:
    """The nodes of a DAG reached from `roots`, each once and after its `children` (a depth-first
    post-order, children in their given order), found without recursion: a walk that takes the
    nodes in this order recurses through one node at a time (a model's program reaches back
    through every layer, deeper than Python's stack allows under torch.compile, where each call
    also counts against the interpreter's C recursion limit)."""
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(list(children(node))))
    return order


def walk(e: Expr) -> Iterable[Expr]:
    """Every node of `e`, each once, parents before children."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        yield n
        if isinstance(n, TensorRead):
            stack.extend(reversed(n.indices))
        else:
            stack.extend(reversed(n.children))


def size_product(extents: Sequence[Expr]) -> Expr:
    """The product of sizes (a shape's element count, a row-major stride), left to right.
    Constant factors multiply as Python ints and the product is int64 where it leaves int32:
    a size widens, it never wraps as kernel arithmetic does (docs/semantics.md), so a caller can
    see that a tensor has 2^31 elements or more and index it with 64-bit offsets."""
    total: Expr = Const(1, dt.int32)
    for e in extents:
        a, b = const_int(total), const_int(e)
        total = index_expr(a * b) if a is not None and b is not None else total * e
    return total


def const_product(extents: Sequence[ExprLike]) -> int | None:
    """The product of sizes that are all integer constants, or None when one is not (a symbolic
    size): a shape's static element count."""
    total = 1
    for e in extents:
        c = const_int(e)
        if c is None:
            return None
        total *= c
    return total


def to_shape(shape: Sequence[ExprLike] | ExprLike) -> tuple[Expr, ...]:
    """Normalize a shape given as ints / integer expressions."""
    dims: Sequence[ExprLike] = (shape,) if isinstance(shape, (int, float, Expr)) else shape
    if not isinstance(dims, (tuple, list)):
        raise DTypeError(f"a shape is an int, a size expression or a tuple of them, got {type(shape).__name__} "
                         f"{shape!r}")
    out = tuple(index_expr(s) for s in dims)
    elements = 1
    for s in out:
        c = const_int(s)
        if c is not None and c < 0:
            raise ShapeError(f"a dimension cannot be negative, got {c} in shape {tuple(str(x) for x in out)}")
        elements *= c if c is not None else 1
    if elements >= 2**63:
        # a flat element offset is an int64 in the generated code (and in NumPy)
        raise ShapeError(f"the shape {tuple(str(x) for x in out)} has {elements} elements, more than an int64 "
                         "offset can address (2**63); use smaller dimensions")
    return out


__all__ = [
    "APPROX_INTRINSICS", "ATOMIC_DTYPES", "ATOMIC_INTRINSICS", "Binary", "BufferLoad", "Builders", "Call", "Cast", "Compare", "Const", "Expr",
    "ExprLike", "FLOAT_INTRINSICS", "INTRINSICS", "IterVar", "MEMORY_INTRINSICS", "Not", "OPAQUE_INTRINSICS",
    "REDUCERS", "Reduce",
    "ReduceAxis", "Select", "TensorRead", "Var", "WARP_INTRINSICS", "as_expr", "atomic_add", "atomic_add_pair", "binary", "call",
    "cast", "compare", "const_int", "const_product", "buffers_read", "free_vars", "frozen_free_vars", "index_expr", "load_cg", "logical_and", "opaque", "reduce_identity",
    "postorder", "select", "size_product", "substitute", "thread_fence", "to_shape", "walk", "warp_shuffle",
]
