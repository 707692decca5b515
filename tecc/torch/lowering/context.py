"""What every ATen lowering shares: torch dtypes and sizes as tecc's, scalars as constants, reads
with broadcasting, and the `Unsupported` signal that sends a node to ATen.

A lowering turns one FX node into tensor expressions. Its tensor arguments arrive as tecc
`Tensor`s (placeholders, or computes of earlier nodes), its scalars as Python numbers or, for a
symbolic size (`SymInt`), as a tecc integer expression over `tc.var`s. It returns a Tensor, or a
tuple of them for ops with several results. Every compute it makes is named after its FX node,
so the IR dumps and the node -> kernel map read like the graph.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import sympy
import torch
import torch._prims  # noqa: F401 - registers torch.ops.prims (convert_element_type, iota, fma)

from ...ir import dtype as dt
from ...ir.dtype import DType
from ...ir.expr import Const, Expr, ExprLike, const_int
from ...ir.ops import cast
from ...ir.philox import rand
from ...ir.tensor import Tensor, compute, var

aten = torch.ops.aten
prims = torch.ops.prims


class Unsupported(Exception):
    """This node cannot be lowered (the reason says why): it runs as ATen inside the compiled
    graph, or raises TeccError under fallback="error". Not a TeccError: it is a decision, not
    a failure."""


# torch dtypes tecc computes with; any other (int8, uint8, complex, ...) runs as ATen
_DTYPES: dict[torch.dtype, DType] = {
    torch.float32: dt.float32, torch.float16: dt.float16, torch.bfloat16: dt.bfloat16,
    torch.float64: dt.float64, torch.int32: dt.int32, torch.int64: dt.int64, torch.bool: dt.bool_,
}


def tecc_dtype(d: torch.dtype) -> DType:
    """The tecc dtype of a torch dtype, or Unsupported."""
    found = _DTYPES.get(d)
    if found is None:
        raise Unsupported(f"dtype {d} has no tecc equivalent")
    return found


def torch_dtype_of(d: DType) -> torch.dtype:
    """The torch dtype of a tecc dtype."""
    for t, mine in _DTYPES.items():
        if mine == d:
            return t
    raise Unsupported(f"tecc dtype {d} has no torch equivalent here")


class Sizes:
    """Symbolic sizes: each sympy symbol of torch's shape environment (s0, s1, ...) is one
    `tc.var`, shared by every program of a compiled graph, so that a kernel's size parameters
    and the runtime's shape arithmetic name the same sizes."""

    def __init__(self) -> None:
        self.vars: dict[sympy.Symbol, Any] = {}

    def var_of(self, symbol: sympy.Symbol) -> Any:
        found = self.vars.get(symbol)
        if found is None:
            found = self.vars[symbol] = var(f"size_{symbol.name}")
        return found

    def expr(self, value: Any) -> ExprLike:
        """An int, a SymInt or a sympy expression as an int or a tecc integer expression."""
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, torch.SymInt):
            node_expr = value.node.expr
            if node_expr.is_number:
                return int(node_expr)
            return self._from_sympy(node_expr)
        if isinstance(value, sympy.Expr):
            return int(value) if value.is_number else self._from_sympy(value)
        if isinstance(value, Expr):
            return value
        raise Unsupported(f"size {value!r} ({type(value).__name__}) is not an integer")

    def _from_sympy(self, e: sympy.Expr) -> Any:
        if isinstance(e, sympy.Symbol):
            return self.var_of(e)
        if isinstance(e, sympy.Integer):
            return int(e)
        args = [self._from_sympy(a) for a in e.args]
        name = type(e).__name__
        if isinstance(e, sympy.Add):
            out = args[0]
            for a in args[1:]:
                out = out + a
            return out
        if isinstance(e, sympy.Mul):
            out = args[0]
            for a in args[1:]:
                out = out * a
            return out
        if isinstance(e, sympy.Pow) and e.args[1].is_Integer and int(e.args[1]) > 0:
            out = args[0]
            for _ in range(int(e.args[1]) - 1):
                out = out * args[0]
            return out
        if name in ("FloorDiv", "CleanDiv"):
            return args[0] // args[1]
        if name in ("Mod", "PythonMod"):
            return args[0] % args[1]
        if name == "CeilDiv":
            return (args[0] + args[1] - 1) // args[1]
        raise Unsupported(f"symbolic size {e} ({name}) is not an expression tecc writes")

    def shape(self, sizes: Sequence[Any]) -> tuple[ExprLike, ...]:
        return tuple(self.expr(s) for s in sizes)


def static_int(value: ExprLike) -> int | None:
    """The value of a size that is a constant, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, Expr):
        return const_int(value)
    return None


def constant(value: int | float | bool, d: DType) -> Expr:
    """A Python scalar as a constant of `d`, with torch's conversion: a float past the dtype's
    range becomes ±inf (tecc refuses such a Python constant; torch rounds it)."""
    if d.is_bool:
        return Const(bool(value), d)
    if d.is_int:
        if isinstance(value, float):
            if not math.isfinite(value):
                raise Unsupported(f"the constant {value} has no {d} value")
            value = int(value)  # truncation, as torch converts a float scalar for an int op
        return Const(dt.wrap_int(int(value), d), d)
    f = float(value)
    if math.isfinite(f) and abs(f) > dt.largest_finite(d) * (1 + 2.0 ** -(_mantissa_bits(d) + 1)):
        f = math.copysign(math.inf, f)
    return Const(f, d)


def _mantissa_bits(d: DType) -> int:
    return {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}.get(d.name, 3)


def as_value(x: Any, d: DType) -> Expr:
    """An operand as an expression of dtype `d`: an Expr cast, a Python scalar made a constant."""
    if isinstance(x, Expr):
        return cast(x, d)
    if isinstance(x, (bool, int, float)):
        return constant(x, d)
    raise Unsupported(f"operand {x!r} is not a scalar")


def broadcast_read(t: Tensor, idx: Sequence[Expr], out_shape: Sequence[ExprLike]) -> Expr:
    """`t` read at the output index `idx` under torch's broadcasting: trailing dimensions
    align, and a dimension of size 1 that the output widens is read at 0."""
    offset = len(idx) - t.ndim
    if offset < 0:
        raise Unsupported(f"{t.name} has more dimensions than the result it broadcasts to")
    indices: list[ExprLike] = []
    for d in range(t.ndim):
        size, out = static_int(t.shape[d]), static_int(out_shape[offset + d])
        indices.append(0 if size == 1 and out != 1 else idx[offset + d])
    return t[tuple(indices)]


class Namer:
    """Unique tecc names for the computes of one program, from FX node names."""

    def __init__(self) -> None:
        self.taken: set[str] = set()

    def __call__(self, base: str) -> str:
        import re

        name = re.sub(r"[^A-Za-z0-9_]", "_", base) or "t"
        if name[0].isdigit():
            name = "t_" + name
        cand, n = name, 0
        while cand in self.taken:
            n += 1
            cand = f"{name}_{n}"
        self.taken.add(cand)
        return cand


def memory_order(val: Any) -> tuple[int, ...] | None:
    """The dimensions of a channels_last tensor (4-d: N, H, W, C; 5-d: N, D, H, W, C) in the order
    of its memory, outermost first, or None for any other layout. tecc computes and stores such a
    tensor in that order (LoweringContext.compute), so that a channels_last model's stages are
    NHWC as eager's are."""
    if not isinstance(val, torch.Tensor) or val.ndim not in (4, 5):
        return None
    fmt = torch.channels_last if val.ndim == 4 else torch.channels_last_3d
    try:
        if val.is_contiguous() or not val.is_contiguous(memory_format=fmt):
            return None
    except Exception:  # noqa: BLE001 - a symbolic stride torch cannot decide: keep the logical order
        return None
    return (0, *range(2, val.ndim), 1)


def dense_order(val: Any) -> tuple[int, ...] | None:
    """The dimensions of a dense permutation of a row-major tensor by stride, outermost first
    (size-1 dimensions outermost, by position): (0, 2, 1, 3) for attention's output laid out
    (B, S, H, D), (1, 0) for a transposed matrix. None for a row-major tensor, one that is not
    dense (a slice) and one with symbolic sizes or strides (asking them would specialize their
    symbols)."""
    if not isinstance(val, torch.Tensor) or val.ndim < 2:
        return None
    sizes, strides = val.shape, val.stride()
    if not all(type(n) is int for n in (*sizes, *strides)) or 0 in sizes or val.is_contiguous():
        return None
    order = tuple(sorted(range(val.ndim), key=lambda d: (sizes[d] > 1, -strides[d], d)))
    if order == tuple(range(val.ndim)):
        return None
    expected = 1
    for d in reversed(order):
        if sizes[d] > 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order


def boundary_order(val: Any) -> tuple[int, ...] | None:
    """The memory order a program reads an input value in: channels_last's (`memory_order`), or,
    for a dense permutation whose last dimension is not of stride 1 (`dense_order`: a transposed
    matrix, the activation a weight's gradient reads as X^T; the (B, S, H) log-sum-exp of the CPU's
    attention), that order: the placeholder is its row-major tensor and the runtime passes the
    value permuted to it (no copy, where a row-major placeholder would copy it). None for any
    other layout: row-major, rows contiguous (read in place through stride parameters), not dense
    or symbolic (copied contiguous)."""
    order = memory_order(val)
    if order is not None:
        return order
    order = dense_order(val)
    return order if order is not None and val.stride()[-1] != 1 else None


def in_order(t: Tensor, order: Sequence[int], name: str) -> Tensor:
    """The logical tensor whose memory-ordered form is `t` (a view: an index expression)."""
    inverse = [order.index(d) for d in range(len(order))]
    shape = tuple(t.shape[inverse[d]] for d in range(len(order)))
    return compute(shape, lambda *i: t[tuple(i[order[k]] for k in range(len(order)))], name=name)


def to_order(t: Tensor, order: Sequence[int], name: str) -> Tensor:
    """`in_order`'s inverse: the logical tensor `t` stored in `order` (its dimensions outermost
    first), the compute a program writes for an output eager lays out so (graph.py)."""
    inverse = [order.index(d) for d in range(len(order))]
    return compute(tuple(t.shape[d] for d in order), lambda *j: t[tuple(j[inverse[d]] for d in range(len(order)))],
                   name=name)


class RandomDraws:
    """The random numbers of one graph (lowering/random.py): each call of the compiled graph
    draws one 64-bit seed from torch's generator (the graph's seed node, graph.py), and every
    random node of the graph reads `tc.rand(shape, seed, offset)` at its own counter offset: the
    offsets of the nodes before it plus ceil(elements / 4) each, so that no two nodes of a call
    share a Philox counter. A node keeps its offset when it is lowered again (in its program)."""

    def __init__(self) -> None:
        self.offsets: dict[torch.fx.Node, ExprLike] = {}
        self.next: ExprLike = 0

    def offset(self, node: torch.fx.Node, elements: ExprLike) -> ExprLike:
        found = self.offsets.get(node)
        if found is None:
            found = self.offsets[node] = self.next
            self.next = self.next + (elements + 3) // 4
        return found


class LoweringContext:
    """The state of lowering one program: its sizes, its names, and the FX node being lowered
    (whose result metadata, `node.meta["val"]`, gives shapes and dtypes); for random ops, the
    graph's draws and a callable giving the program's seed placeholder."""

    def __init__(self, sizes: Sizes, namer: Namer | None = None, random: RandomDraws | None = None,
                 seed: Callable[[], Tensor] | None = None) -> None:
        self.sizes = sizes
        self.namer = namer or Namer()
        self.node: torch.fx.Node | None = None
        self.random = random
        self.seed = seed
        # a logical tensor computed in its memory order -> (the stored tensor, the order)
        self.stored: dict[int, tuple[Tensor, tuple[int, ...]]] = {}
        # a contraction operand's memory (its storage's FX node, offset, strides, sizes) -> its
        # zero-padded copy (matmul.py, _realigned)
        self.realigned: dict[tuple[Any, ...], Tensor] = {}

    # ---- the node being lowered ----------------------------------------------------------------
    @property
    def meta(self) -> Any:
        assert self.node is not None
        return self.node.meta.get("val")

    def out_meta(self, position: int | None = None) -> Any:
        val = self.meta
        if position is not None:
            val = val[position]
        if not isinstance(val, torch.Tensor):
            raise Unsupported(f"result {position if position is not None else ''} is not a tensor")
        return val

    def out_shape(self, position: int | None = None) -> tuple[ExprLike, ...]:
        return self.sizes.shape(self.out_meta(position).shape)

    def out_dtype(self, position: int | None = None) -> DType:
        return tecc_dtype(self.out_meta(position).dtype)

    def name(self, suffix: str = "") -> str:
        assert self.node is not None
        return self.namer(self.node.name + suffix)

    def compute(self, shape: Sequence[ExprLike], fcompute: Callable[..., ExprLike], suffix: str = "") -> Tensor:
        """A compute of the current node's name (with `suffix` for its helper stages). A result
        of the node's shape that eager lays out channels_last is computed in that memory order
        and returned as a view in the logical order (`memory_order`, `stored`)."""
        order = self._memory_order(shape)
        if order is None:
            return compute(tuple(shape), fcompute, name=self.name(suffix))
        inverse = [order.index(d) for d in range(len(order))]
        stored = compute(tuple(shape[d] for d in order),
                         lambda *j: fcompute(*(j[inverse[d]] for d in range(len(order)))),
                         name=self.name(suffix))
        logical = in_order(stored, order, self.name(suffix + "_logical"))
        self.stored[id(logical)] = (stored, order)
        return logical

    def laid_out(self, shape: Sequence[ExprLike]) -> bool:
        """Whether `compute` of `shape` stores it in another memory order than the logical one."""
        return self._memory_order(shape) is not None

    def _memory_order(self, shape: Sequence[ExprLike]) -> tuple[int, ...] | None:
        target = self.node.target if self.node is not None else None
        if self.node is None or getattr(target, "is_view", False):  # a view stays an index expression
            return None
        val = self.node.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else (val,)):
            order = memory_order(v)
            if order is not None and len(v.shape) == len(shape) and all(
                    static_int(a) == static_int(b) and static_int(a) is not None
                    for a, b in zip(self.sizes.shape(v.shape), shape)):
                return order
        return None

    def uniform(self, shape: Sequence[ExprLike], suffix: str = "_uniform") -> Tensor:
        """float32 uniforms in [0, 1) of `shape` for the current node, new every call of the
        graph (RandomDraws)."""
        if self.random is None or self.seed is None or self.node is None:
            raise Unsupported("random numbers outside a graph with a seed")
        elements: ExprLike = 1
        for s in shape:
            elements = elements * s
        offset = self.random.offset(self.node, elements)
        return rand(tuple(shape), self.seed(), offset, name=self.name(suffix))
