"""Scatter-add: a tensor accumulated at data-dependent positions.

    dW = tc.scatter_add((V, D), (N, D), at=lambda i, j: (idx[i], j), value=lambda i, j: dY[i, j])

is `dW = zeros((V, D)); for (i, j) in range(N) x range(D): dW[idx[i], j] += dY[i, j]` -- embedding
backward, `index_put(accumulate=True)` (with `init=` the tensor added to), `scatter_add` along a
dimension. Every point of the domain `over` adds `value` at position `at`; positions may repeat.

**What it is.** A `ScatterOp` is a compute (a `ComputeOp` subclass) whose body says the same thing
gather-wise, for every output element p:

    dW[v, j] = sum(where(index_ok(idx[i], V) & (idx[i] == v), dY[i, j], 0) for i in range(N))

Each output dimension whose position is a domain axis of the same extent (`j` above) *binds*
that axis; the other domain axes (`i`) are summed, and every other output dimension gives an
equation (`idx[i] == v`). So a scatter is an ordinary reduction to every layer below: lowering,
the emulator, the planner and its strategies treat it as one, and that form is deterministic (each
output sums its matches in domain order). The planner may instead realize it with atomics
(`scatter_atomic`, chosen by cost unless the build is deterministic: docs/semantics.md, "Atomics").

**Bounds.** A data-dependent position (one that reads a tensor) is checked (`IndexCheck`): out of
range it is an error of the program, on both targets, never wrapped. An affine position is proved
in bounds with islpy when the scatter is made (ShapeError with a witness otherwise); any other
position is checked like a data-dependent one.

**Precision.** The sums accumulate in float32 for float16 / bfloat16 / fp8 outputs (then round
once), in the output's dtype otherwise; `init` is added in the accumulator's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from . import dtype as dt
from .dtype import DType, DTypeLike
from .errors import DTypeError, ShapeError
from .expr import (
    Const,
    Expr,
    ExprLike,
    IterVar,
    Reduce,
    ReduceAxis,
    TensorRead,
    Var,
    as_expr,
    cast,
    compare,
    index_expr,
    logical_and,
    select,
    substitute,
    to_shape,
    walk,
)
from .index_checks import IndexCheck
from .tensor import ComputeOp, Tensor, axis_names, check_bounds, check_name, fresh_compute_name


@dataclass(frozen=True, eq=False)
class ScatterOp(ComputeOp):
    """`name[at(x)] += value(x)` for every x of the domain (`domain`: its axes), added to `init`
    (a tensor of the output's shape) or to zeros. `body` (ComputeOp's) is the same sum written
    per output element; `at` and `value` keep the scatter's own form for autodiff and printing."""

    domain: tuple[IterVar, ...]
    at: tuple[Expr, ...]
    value: Expr
    init: Tensor | None

    def describe(self) -> str:
        pos = ", ".join(str(e) for e in self.at)
        over = ", ".join(f"{a.name} in range({a.extent})" for a in self.domain)
        base = f" (added to {self.init.name})" if self.init is not None else ""
        return f"{self.name}[{pos}] += {self.value} for {over}{base}"


def accumulator_dtype(d: DType) -> DType:
    """The dtype a scatter into `d` sums in: float32 for the 16-bit and 8-bit floats."""
    return dt.float32 if d in (dt.float16, dt.bfloat16) + dt.FP8_DTYPES else d


def data_dependent(e: Expr) -> bool:
    """Whether `e` reads a tensor or buffer (its value depends on data, not only on indices)."""
    from .expr import BufferLoad

    return any(isinstance(n, (TensorRead, BufferLoad)) for n in walk(e))


def scatter_add(shape: Sequence[ExprLike] | ExprLike, over: Sequence[ExprLike] | ExprLike,
                at: Callable[..., ExprLike | Sequence[ExprLike]], value: Callable[..., ExprLike], *,
                init: Tensor | None = None, dtype: DTypeLike | None = None, name: str | None = None) -> Tensor:
    """A tensor of `shape` (zeros, or `init`) to which every point x of the domain `over` adds
    `value(*x)` at position `at(*x)` (one index per dimension of `shape`); see the module
    docstring. `dtype`: the output's dtype (default: the value's). Data-dependent positions must
    be integers (int32/int64) in range: an index outside the output is an error, negative ones
    included (wrap them first if they follow torch's convention)."""
    shp = to_shape(shape)
    dom = to_shape(over)
    nm = check_name("scatter_add", name) if name is not None else fresh_compute_name("scatter")
    axes = tuple(IterVar(n, index_expr(0), s, dt.int64 if s.dtype == dt.int64 else dt.int32)
                 for n, s in zip(axis_names(value, len(dom), nm), dom))
    positions = _positions(nm, at(*axes), len(shp))
    val = _value(nm, value(*axes))
    out_dtype = dt.as_dtype(dtype) if dtype is not None else val.dtype
    if not (out_dtype.is_float or out_dtype.is_int):
        raise DTypeError(f"scatter_add {nm}: cannot accumulate {out_dtype} values; cast them to an integer or "
                         "float dtype")
    if init is not None:
        _check_init(nm, init, shp, out_dtype)
    for e in positions + (val,):
        check_bounds(nm, e)
    checked = tuple(_needs_check(nm, d, ix, shp[d]) for d, ix in enumerate(positions))
    acc = accumulator_dtype(out_dtype)
    out_axes, mapping, summed, bound = _bind(positions, axes, shp, checked)
    conditions: list[Expr] = []
    for d, ix in enumerate(positions):
        if d in bound:
            continue
        where = substitute(ix, mapping)
        if checked[d]:
            conditions.append(IndexCheck(where, shp[d], nm, d))
        conditions.append(compare("==", where, out_axes[d]))
    source = cast(substitute(val, mapping), acc)
    if conditions:
        source = select(logical_and(*conditions), source, Const(0, acc))
    total = Reduce("sum", source, tuple(summed)) if summed else source
    if init is not None:
        total = cast(TensorRead(init, out_axes), acc) + total
    body = cast(total, out_dtype)
    op = ScatterOp(nm, out_axes, body, axes, positions, cast(val, out_dtype), init)
    return Tensor(op, shp, out_dtype)


def _positions(name: str, found: object, ndim: int) -> tuple[Expr, ...]:
    items = tuple(found) if isinstance(found, (tuple, list)) else (found,)
    if len(items) != ndim:
        raise ShapeError(f"scatter_add {name}: at= gives {len(items)} ind{'ex' if len(items) == 1 else 'ices'} for an "
                         f"output of {ndim} dimension{'s' if ndim != 1 else ''}; give one per dimension")
    out = []
    for d, ix in enumerate(items):
        if isinstance(ix, Tensor):
            raise ShapeError(f"scatter_add {name}: position {d} is the whole tensor {ix.name}; index it, e.g. "
                             f"{ix.name}[i]")
        if isinstance(ix, Expr) and not ix.dtype.is_int:
            what = "a data-dependent index must be an integer tensor's value (int32 or int64)" if data_dependent(ix) \
                else "positions must be integers"
            raise DTypeError(f"scatter_add {name}: position {d} ({ix}) is {ix.dtype}; {what}")
        e = index_expr(ix)
        if any(isinstance(n, Reduce) for n in walk(e)):
            raise ShapeError(f"scatter_add {name}: position {d} ({e}) holds a reduction; compute it as a tensor first")
        out.append(e)
    return tuple(out)


def _value(name: str, found: object) -> Expr:
    if isinstance(found, Tensor):
        raise ShapeError(f"scatter_add {name}: value= returned the whole tensor {found.name}; index it, e.g. "
                         f"{found.name}[i, j]")
    if not isinstance(found, (Expr, int, float, bool)):
        raise DTypeError(f"scatter_add {name}: value= returned {type(found).__name__}, not an expression")
    val = as_expr(found)
    if any(isinstance(n, (Reduce, ReduceAxis)) for n in walk(val)):
        raise ShapeError(f"scatter_add {name}: the value holds a reduction ({val}); compute it as a tensor of its "
                         "own and scatter its elements")
    return val


def _check_init(name: str, init: Tensor, shape: tuple[Expr, ...], out_dtype: DType) -> None:
    if not isinstance(init, Tensor):
        raise ShapeError(f"scatter_add {name}: init= takes a tensor, got {type(init).__name__}")
    if len(init.shape) != len(shape) or any(a is not b for a, b in zip(init.shape, shape)):
        raise ShapeError(f"scatter_add {name}: init {init.name} has shape [{', '.join(map(str, init.shape))}], the "
                         f"output [{', '.join(map(str, shape))}]; they must be the same")
    if init.dtype != out_dtype:
        raise DTypeError(f"scatter_add {name}: init {init.name} is {init.dtype}, the output {out_dtype}; cast one")


def _needs_check(name: str, d: int, ix: Expr, extent: Expr) -> bool:
    """Whether position `d` is checked at run time: data-dependent or not affine. An affine
    position provably outside the output is a ShapeError now."""
    from . import poly

    if data_dependent(ix) or poly.affine_text(ix, poly._Names()) is None:
        return True
    bad = poly.find_out_of_bounds(ix, extent)
    if bad is not None:
        raise ShapeError(f"scatter_add {name}: position {d} ({ix}) leaves dimension {d} of {name} (size {extent}) "
                         f"{bad}; fix the index")
    return False


def _bind(positions: tuple[Expr, ...], axes: tuple[IterVar, ...], shape: tuple[Expr, ...],
          checked: tuple[bool, ...]) -> tuple[tuple[IterVar, ...], dict[Var, Expr], list[ReduceAxis], set[int]]:
    """The output's axes, the domain axes in terms of them (a bound axis is an output axis, the
    others reduction axes), the reduction axes and the bound output dimensions. An output dimension binds the domain axis it
    is positioned by when that axis has the same extent (hash-consed: the same node)."""
    bound: dict[IterVar, int] = {}
    for d, ix in enumerate(positions):
        if isinstance(ix, IterVar) and ix in axes and ix not in bound and ix.extent is shape[d] and not checked[d]:
            bound[ix] = d
    by_dim = {d: a for a, d in bound.items()}
    taken = {a.name for a in axes}
    out_axes = []
    for d, extent in enumerate(shape):
        if d in by_dim:
            n = by_dim[d].name
        else:
            n = f"p{d}"
            while n in taken:
                n += "_"
            taken.add(n)
        out_axes.append(IterVar(n, index_expr(0), extent, dt.int64 if extent.dtype == dt.int64 else dt.int32))
    mapping: dict[Var, Expr] = {}
    summed: list[ReduceAxis] = []
    for a in axes:
        if a in bound:
            mapping[a] = out_axes[bound[a]]
        else:
            r = ReduceAxis(a.name, a.lo, a.extent, a.dtype)
            mapping[a] = r
            summed.append(r)
    return tuple(out_axes), mapping, summed, set(by_dim)


__all__ = ["ScatterOp", "accumulator_dtype", "data_dependent", "scatter_add"]
