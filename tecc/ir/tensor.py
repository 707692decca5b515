"""Tensor expressions: placeholders, computes, and the checks made while they are built.

A program is a DAG of tensors. A `placeholder` is an input; a `compute` defines every element of
a new tensor by an index expression over its axes, possibly with reductions. Shapes and dtypes
are inferred and checked as expressions are built: the wrong number of indices, a non-integer
index, a reduction axis used outside its reduction, or an index that leaves a tensor's bounds
somewhere in the iteration domain (proved with islpy where the index is affine) raise
`ShapeError` / `DTypeError` naming the tensor and the index.
"""

from __future__ import annotations

import inspect
import itertools
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence, Union

from . import dtype as dt
from .dtype import DType, DTypeLike
from .errors import DTypeError, InvalidNameError, ShapeError
from .expr import (
    Expr,
    ExprLike,
    IterVar,
    Reduce,
    ReduceAxis,
    Select,
    TensorRead,
    Var,
    as_expr,
    const_int,
    free_vars,
    index_expr,
    postorder,
    to_shape,
    walk,
)

_counter = itertools.count()


@dataclass(frozen=True, eq=False)
class PlaceholderOp:
    """An input tensor. `strides` None means row-major contiguous; otherwise one stride per
    dimension (ints, or 'stride' variables the kernel receives)."""

    name: str
    shape: tuple[Expr, ...]
    dtype: DType
    strides: tuple[Expr, ...] | None = None

    @property
    def input_tensors(self) -> tuple["Tensor", ...]:
        return ()


@dataclass(frozen=True, eq=False)
class ComputeOp:
    """`name[axes] = body` for every point of the axes' ranges."""

    name: str
    axes: tuple[IterVar, ...]
    body: Expr

    # the body never changes: what is read off it is computed once (the region search asks
    # every stage of a model's program many times)
    @cached_property
    def input_tensors(self) -> tuple["Tensor", ...]:
        seen: dict[int, Tensor] = {}
        for n in walk(self.body):
            if isinstance(n, TensorRead):
                seen.setdefault(id(n.tensor), n.tensor)
            if isinstance(n, IterVar):
                continue
        return tuple(seen.values())

    @cached_property
    def reductions(self) -> tuple[Reduce, ...]:
        return tuple(n for n in walk(self.body) if isinstance(n, Reduce))

    def describe(self) -> str:
        """The compute as it reads: `C[i, j] = body` (a ScatterOp says `W[idx[i], j] += ...`)."""
        return f"{self.name}[{', '.join(a.name for a in self.axes)}] = {self.body}"


Operation = Union[PlaceholderOp, ComputeOp]


class Tensor:
    """A tensor of a program: its name, shape, dtype and the operation that defines it.

    Index it with one integer expression per dimension to read an element inside a compute."""

    __slots__ = ("op", "name", "shape", "dtype", "__weakref__")

    def __init__(self, op: Operation, shape: tuple[Expr, ...], dtype: DType) -> None:
        self.op = op
        self.name = op.name
        self.shape = shape
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_placeholder(self) -> bool:
        return isinstance(self.op, PlaceholderOp)

    def __getitem__(self, indices: Any) -> Expr:
        if not isinstance(indices, tuple):
            indices = (indices,)
        shown = f"{self.name}[{', '.join(str(i) for i in indices)}]"
        if len(indices) != self.ndim:
            raise ShapeError(
                f"tensor {self.name} has {self.ndim} dimension{'s' if self.ndim != 1 else ''} "
                f"(shape [{', '.join(str(s) for s in self.shape)}]) but {shown} gives {len(indices)} "
                f"ind{'ices' if len(indices) != 1 else 'ex'}"
            )
        out: list[Expr] = []
        for pos, ix in enumerate(indices):
            if isinstance(ix, (slice, type(Ellipsis))) or ix is None:
                raise ShapeError(
                    f"index {pos} of {shown}: tecc tensors are read one element at a time; "
                    "use an axis variable (e.g. the arguments of compute's lambda), not a slice"
                )
            if isinstance(ix, Expr):
                if not ix.dtype.is_int:
                    if any(isinstance(n, TensorRead) for n in walk(ix)):
                        raise DTypeError(
                            f"index {pos} of {shown} reads a tensor and is {ix.dtype} ({ix}); a data-dependent "
                            "index must be the value of an integer tensor (int32 or int64)")
                    raise DTypeError(
                        f"index {pos} of {shown} is a {ix.dtype} expression ({ix}); indices must be integers "
                        "(use tc.cast(x, 'int32') if that is what you mean)"
                    )
            elif isinstance(ix, bool) or not isinstance(ix, int):
                raise DTypeError(f"index {pos} of {shown} is {type(ix).__name__} {ix!r}; indices must be integers")
            e = index_expr(ix)
            c, dim = const_int(e), const_int(self.shape[pos])
            if c is not None and (c < 0 or (dim is not None and c >= dim)):
                raise ShapeError(
                    f"index {pos} of {shown} is {c}, outside dimension {pos} of {self.name} "
                    f"(size {self.shape[pos]})"
                )
            out.append(e)
        return TensorRead(self, tuple(out))

    def __repr__(self) -> str:
        shape = ", ".join(str(s) for s in self.shape)
        kind = "placeholder" if self.is_placeholder else "compute"
        return f"Tensor({self.name}: {self.dtype.name}[{shape}], {kind})"

    def __str__(self) -> str:
        if isinstance(self.op, ComputeOp):
            return self.op.describe()
        return repr(self)

    # Tensors are identities: the Expr operators do not apply to whole tensors.
    def __bool__(self) -> bool:
        return True


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_name(what: str, name: object) -> str:
    """`name` when it is an ASCII identifier, else InvalidNameError. A name becomes part of the
    CUDA C, of islpy's set strings, of dump and artifact file names and of the `kernel/stage`
    addresses of schedules, so `A/B`, `../x`, `Ä` or `a b` would each break one of them."""
    if isinstance(name, str) and _NAME.fullmatch(name):
        return name
    shown = repr(name) if isinstance(name, str) else f"a {type(name).__name__}"
    suggestion = re.sub(r"[^A-Za-z0-9_]", "_", name) if isinstance(name, str) else ""
    if not suggestion.strip("_"):
        suggestion = "X"
    elif suggestion[0].isdigit():
        suggestion = "t_" + suggestion
    raise InvalidNameError(
        f"{what} name {shown} is not an ASCII identifier (letters, digits and _, not starting with a digit); "
        f"names become CUDA C identifiers, file names and schedule addresses. Rename it, e.g. {suggestion!r}")


def var(name: str, dtype: DTypeLike = "int32") -> Var:
    """A symbolic size, e.g. `M = tc.var("M")`; bound at call time from the arguments' shapes."""
    return Var(check_name("size", name), dt.as_dtype(dtype), "size")


def placeholder(shape: Sequence[ExprLike] | ExprLike, dtype: DTypeLike = "float32", name: str | None = None,
                strides: Sequence[ExprLike] | str | None = None) -> Tensor:
    """An input tensor. `strides=None` expects a contiguous row-major array; `strides="any"`
    accepts any strides (they become kernel parameters); a tuple fixes them."""
    shp = to_shape(shape)
    d = dt.as_dtype(dtype)
    nm = check_name("placeholder", name) if name is not None else f"placeholder_{next(_counter)}"
    st: tuple[Expr, ...] | None
    if strides is None:
        st = None
    elif strides == "any":
        st = tuple(Var(f"{nm}_stride{i}", dt.int64 if any(s.dtype == dt.int64 for s in shp) else dt.int32,
                       "stride") for i in range(len(shp)))
    elif isinstance(strides, str):
        raise ShapeError(f"placeholder {nm}: strides must be None, 'any' or a tuple, got {strides!r}")
    else:
        st = tuple(index_expr(s) for s in strides)
        if len(st) != len(shp):
            raise ShapeError(f"placeholder {nm}: {len(st)} strides for {len(shp)} dimensions")
    return Tensor(PlaceholderOp(nm, shp, d, st), shp, d)


def reduce_axis(dom: ExprLike | tuple[ExprLike, ExprLike], name: str = "k") -> ReduceAxis:
    """A reduction axis over range(extent) or range(lo, hi)."""
    check_name("reduce_axis", name)
    if isinstance(dom, tuple):
        if len(dom) != 2:
            raise ShapeError(f"reduce_axis {name}: give an extent or a (lo, hi) pair, got {dom!r}")
        lo, hi = index_expr(dom[0]), index_expr(dom[1])
        extent = hi - lo
    else:
        lo, extent = index_expr(0), index_expr(dom)
    c = const_int(extent)
    if c is not None and c < 0:
        raise ShapeError(f"reduce_axis {name}: the range is empty with a negative extent ({extent})")
    d = dt.int64 if dt.int64 in (lo.dtype, extent.dtype) else dt.int32
    return ReduceAxis(name, lo, extent, d)


def fresh_compute_name(base: str) -> str:
    """A name for an unnamed compute: `base_<n>`, n counting every one made."""
    return f"{base}_{next(_counter)}"


def axis_names(fcompute: Callable[..., Any], ndim: int, name: str) -> list[str]:
    try:
        params = list(inspect.signature(fcompute).parameters.values())
    except (TypeError, ValueError):
        params = []
    if params and params[0].kind == inspect.Parameter.VAR_POSITIONAL:
        return [f"i{d}" for d in range(ndim)]
    if len(params) != ndim:
        raise ShapeError(
            f"compute {name} has {ndim} dimension{'s' if ndim != 1 else ''} but its function takes "
            f"{len(params)} argument{'s' if len(params) != 1 else ''}; give one axis argument per dimension"
        )
    return [check_name(f"axis (a parameter of the function of compute {name})", p.name) for p in params]


def compute(shape: Sequence[ExprLike] | ExprLike, fcompute: Callable[..., ExprLike], name: str | None = None) -> Tensor:
    """A tensor whose element at each point of `shape` is `fcompute(*axes)`."""
    shp = to_shape(shape)
    nm = check_name("compute", name) if name is not None else fresh_compute_name("compute")
    axes = tuple(
        IterVar(n, index_expr(0), s, dt.int64 if s.dtype == dt.int64 else dt.int32)
        for n, s in zip(axis_names(fcompute, len(shp), nm), shp)
    )
    body = fcompute(*axes)
    if isinstance(body, Tensor):
        raise ShapeError(f"compute {nm}: the function returned the whole tensor {body.name}; index it, e.g. {body.name}[i, j]")
    if not isinstance(body, (Expr, int, float, bool)):
        raise DTypeError(f"compute {nm}: the function returned {type(body).__name__}, not an expression")
    body_e = as_expr(body)
    _check_reduce_scoping(nm, body_e)
    check_bounds(nm, body_e)
    return Tensor(ComputeOp(nm, axes, body_e), shp, body_e.dtype)


def _check_reduce_scoping(name: str, body: Expr) -> None:
    """Every reduction axis must occur only inside a reduction over it."""

    def visit(e: Expr, bound: frozenset[ReduceAxis]) -> None:
        if isinstance(e, ReduceAxis):
            if e not in bound:
                raise ShapeError(
                    f"compute {name}: reduction axis {e.name} is used outside a reduction over it; "
                    f"wrap the expression that uses it in tc.sum/max/min/prod(..., axis={e.name})"
                )
            return
        if isinstance(e, Reduce):
            inner = bound | frozenset(e.axes)
            for ax in e.axes:
                visit(ax.lo, bound)
                visit(ax.extent, bound)
            visit(e.source, inner)
            return
        if isinstance(e, TensorRead):
            for i in e.indices:
                visit(i, bound)
            return
        for c in e.children:
            visit(c, bound)

    visit(body, frozenset())


def check_bounds(name: str, body: Expr) -> None:
    """Prove with islpy that affine reads stay inside their tensors, under the conditions of the
    `where`s that guard them; raise ShapeError with a witness point when they provably do not.
    A data-dependent index (`W[idx[i], j]`) is not affine: nothing is proved about it here, and
    lowering checks it at run time (index_checks.IndexCheck)."""

    from . import poly  # islpy is needed to build programs, not to run saved artifacts

    def visit(e: Expr, conds: tuple[Expr, ...]) -> None:
        if isinstance(e, Select):
            visit(e.cond, conds)
            visit(e.a, conds + (e.cond,))
            visit(e.b, conds + (~e.cond,))
            return
        if isinstance(e, TensorRead):
            for pos, (ix, dim) in enumerate(zip(e.indices, e.tensor.shape)):
                bad = poly.find_out_of_bounds(ix, dim, conds)
                if bad is not None:
                    raise ShapeError(
                        f"compute {name}: index {pos} of {e} ({ix}) leaves dimension {pos} of "
                        f"{e.tensor.name} (size {dim}) {bad}; guard it with tc.where or fix the index"
                    )
            for ix in e.indices:
                visit(ix, conds)
            return
        for c in e.children:
            visit(c, conds)

    visit(body, ())


def unused_free_vars(t: Tensor) -> set[Var]:
    """Variables of a compute's body other than its axes and reduction axes (size variables)."""
    if not isinstance(t.op, ComputeOp):
        return set()
    return {v for v in free_vars(t.op.body) if not isinstance(v, IterVar)}


def producers_first(outputs: Sequence[Tensor], stop: Callable[[Tensor], bool] | None = None) -> list[Tensor]:
    """Every tensor that `outputs` reach through their operations' inputs, each after the tensors
    it reads (expr.postorder: no recursion, inputs in their operation's order); a tensor for which
    `stop` holds is listed but its inputs are not followed. A walk that takes the tensors in this
    order recurses through one operation at a time (regions.cut, part_twins.signature)."""
    return postorder(outputs, lambda t: () if stop is not None and stop(t) else t.op.input_tensors)
