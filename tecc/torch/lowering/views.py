"""Views and data movement as index expressions: view/reshape, permute, expand, squeeze and
unsqueeze, slice, select, split, cat, constant padding, alias and clone.

None of them copies. Each is a compute whose element reads its source at a remapped index;
lowering inlines such elementwise computes into their readers, so a chain of views is one index
expression inside the kernel that finally reads the data. A reshape maps dimensions group by
group (the dimensions whose sizes multiply to the same product): splitting one dimension into
several is affine (`x[i·16 + j]`), merging several into one divides and takes remainders.
Graph outputs that are views are made by torch on the materialized base (graph.py), never by a
copy kernel.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from ...ir import ops as te
from ...ir.expr import Expr, ExprLike, Var
from ...ir.tensor import Tensor
from .context import LoweringContext, Unsupported, broadcast_read, constant, static_int


# ---- sizes as monomials (so that s0·16 and 16·s0 compare equal) --------------------------------
def _monomial(size: ExprLike) -> tuple[int, tuple[int, ...]] | None:
    """size = c · v1 · v2 · ... as (c, sorted ids of the v's); None for other expressions."""
    c = static_int(size)
    if c is not None:
        return c, ()
    if isinstance(size, Var):
        return 1, (id(size),)
    from ...ir.expr import Binary

    if isinstance(size, Binary) and size.op == "*":
        a, b = _monomial(size.a), _monomial(size.b)
        if a is None or b is None:
            return None
        return a[0] * b[0], tuple(sorted(a[1] + b[1]))
    return None


def _product(sizes: Sequence[ExprLike]) -> tuple[int, tuple[int, ...]] | None:
    c, vs = 1, ()
    for s in sizes:
        m = _monomial(s)
        if m is None:
            return None
        c, vs = c * m[0], tuple(sorted(vs + m[1]))
    return c, vs


def _grow_first(pa: tuple[int, tuple[int, ...]], pb: tuple[int, tuple[int, ...]]) -> bool:
    """Whether the first of two unequal products is the smaller one (the run to extend)."""
    va, vb = Counter(pa[1]), Counter(pb[1])
    if va == vb:
        return pa[0] < pb[0]
    if not va - vb:
        return True
    if not vb - va:
        return False
    return len(pa[1]) < len(pb[1])


def _groups(src: Sequence[ExprLike], dst: Sequence[ExprLike]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of source and destination dimensions with equal products (size-1 dimensions
    left out); None when the sizes do not line up."""
    a = [d for d, s in enumerate(src) if static_int(s) != 1]
    b = [d for d, s in enumerate(dst) if static_int(s) != 1]
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        ga, gb = [a[i]] if i < len(a) else [], [b[j]] if j < len(b) else []
        i, j = i + len(ga), j + len(gb)
        if not ga or not gb:
            return None
        while True:
            pa, pb = _product([src[d] for d in ga]), _product([dst[d] for d in gb])
            if pa is None or pb is None:
                if len(ga) == 1 and len(gb) == 1 and src[ga[0]] is dst[gb[0]]:
                    break
                return None
            if pa == pb:
                break
            if _grow_first(pa, pb):
                if i >= len(a):
                    return None
                ga.append(a[i])
                i += 1
            else:
                if j >= len(b):
                    return None
                gb.append(b[j])
                j += 1
        out.append((ga, gb))
    return out


def reshape_index(src: Sequence[ExprLike], dst: Sequence[ExprLike], idx: Sequence[Expr]) -> tuple[ExprLike, ...]:
    """The source index of destination element `idx` when `dst` is a row-major reshape of `src`."""
    groups = _groups(src, dst)
    if groups is None:
        raise Unsupported(f"a reshape of [{', '.join(map(str, src))}] to [{', '.join(map(str, dst))}] whose sizes do "
                          "not line up")
    out: list[ExprLike] = [0] * len(src)
    for ga, gb in groups:
        flat: ExprLike = 0
        for d in gb:
            flat = flat * dst[d] + idx[d] if not (isinstance(flat, int) and flat == 0) else idx[d]
        if len(ga) == 1:
            out[ga[0]] = flat
            continue
        stride: ExprLike = 1
        for pos in range(len(ga) - 1, -1, -1):
            d = ga[pos]
            value = flat if (isinstance(stride, int) and stride == 1) else flat // stride
            out[d] = value if pos == 0 else value % src[d]
            stride = stride * src[d]
    return tuple(out)


def _tensor(x: Any, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise Unsupported(f"{what} of a non-tensor")
    return x


def lower_view(ctx: LoweringContext, x: Any, size: Any = None, *rest: Any) -> Tensor:
    x = _tensor(x, "a view")
    shape = ctx.out_shape()
    if len(shape) == x.ndim and all(a is b or (static_int(a) is not None and static_int(a) == static_int(b))
                                    for a, b in zip(shape, x.shape)):
        return x
    return ctx.compute(shape, lambda *idx: x[reshape_index(x.shape, shape, idx)])


def lower_alias(ctx: LoweringContext, x: Any, *rest: Any, **kwargs: Any) -> Tensor:
    return _tensor(x, "an alias")


def lower_clone(ctx: LoweringContext, x: Any, **kwargs: Any) -> Tensor:
    x = _tensor(x, "a clone")
    return ctx.compute(x.shape, lambda *idx: x[idx])


def lower_permute(ctx: LoweringContext, x: Any, dims: Sequence[int]) -> Tensor:
    x = _tensor(x, "a permute")
    perm = [d % x.ndim for d in dims] if x.ndim else []
    if perm == list(range(x.ndim)):
        return x

    def body(*idx: Expr) -> Expr:
        src: list[Expr] = [idx[0]] * x.ndim
        for out_dim, in_dim in enumerate(perm):
            src[in_dim] = idx[out_dim]
        return x[tuple(src)]

    return ctx.compute(ctx.out_shape(), body)


def lower_transpose(ctx: LoweringContext, x: Any, d0: int = 0, d1: int = 1) -> Tensor:
    x = _tensor(x, "a transpose")
    if x.ndim < 2:
        return x
    perm = list(range(x.ndim))
    perm[d0 % x.ndim], perm[d1 % x.ndim] = perm[d1 % x.ndim], perm[d0 % x.ndim]
    return lower_permute(ctx, x, perm)


def lower_expand(ctx: LoweringContext, x: Any, size: Any = None, *rest: Any, **kwargs: Any) -> Tensor:
    x = _tensor(x, "an expand")
    shape = ctx.out_shape()
    return ctx.compute(shape, lambda *idx: broadcast_read(x, idx, shape))


def lower_reshape_like(ctx: LoweringContext, x: Any, *rest: Any, **kwargs: Any) -> Tensor:
    """squeeze / unsqueeze (and any op that only adds or drops size-1 dimensions)."""
    return lower_view(ctx, x)


def _normalized(value: Any, size: ExprLike, default: ExprLike) -> ExprLike:
    if value is None:
        return default
    if isinstance(value, Expr):
        return value
    n = static_int(size)
    if value < 0:
        if n is None:
            raise Unsupported("a negative slice bound on a symbolic dimension")
        value += n
    if n is not None:
        value = min(max(value, 0), n)
    return value


def lower_slice(ctx: LoweringContext, x: Any, dim: int = 0, start: Any = None, end: Any = None,
                step: int = 1) -> Tensor:
    x = _tensor(x, "a slice")
    dim %= x.ndim
    begin = _normalized(start, x.shape[dim], 0)
    if not isinstance(step, int) or step <= 0:
        raise Unsupported(f"slice step {step!r}")

    def body(*idx: Expr) -> Expr:
        src = list(idx)
        src[dim] = begin + idx[dim] * step if step != 1 else begin + idx[dim]
        return x[tuple(src)]

    return ctx.compute(ctx.out_shape(), body)


def lower_select(ctx: LoweringContext, x: Any, dim: int, index: Any) -> Tensor:
    x = _tensor(x, "a select")
    dim %= x.ndim
    at = _normalized(index, x.shape[dim], 0)

    def body(*idx: Expr) -> Expr:
        src = list(idx[:dim]) + [at] + list(idx[dim:])
        return x[tuple(src)]

    return ctx.compute(ctx.out_shape(), body)


def lower_split_with_sizes(ctx: LoweringContext, x: Any, sizes: Sequence[Any], dim: int = 0) -> tuple[Tensor, ...]:
    x = _tensor(x, "a split")
    dim %= x.ndim
    pieces = []
    offset: ExprLike = 0
    for position, size in enumerate(sizes):
        pieces.append(_piece(ctx, x, dim, offset, position))
        offset = offset + ctx.sizes.expr(size)
    return tuple(pieces)


def lower_split(ctx: LoweringContext, x: Any, split_size: Any, dim: int = 0) -> tuple[Tensor, ...]:
    x = _tensor(x, "a split")
    dim %= x.ndim
    step = ctx.sizes.expr(split_size)
    return tuple(_piece(ctx, x, dim, position * step, position) for position in range(len(ctx.meta)))


def _piece(ctx: LoweringContext, x: Tensor, dim: int, offset: ExprLike, position: int) -> Tensor:
    shape = ctx.out_shape(position)

    def body(*idx: Expr) -> Expr:
        src = list(idx)
        src[dim] = idx[dim] + offset if not (isinstance(offset, int) and offset == 0) else idx[dim]
        return x[tuple(src)]

    return ctx.compute(shape, body, f"_{position}")


def lower_cat(ctx: LoweringContext, tensors: Sequence[Any], dim: int = 0) -> Tensor:
    shape = ctx.out_shape()
    out = ctx.out_dtype()
    parts = [_tensor(t, "a cat") for t in tensors]
    parts = [t for t in parts if not (t.ndim == 1 and static_int(t.shape[0]) == 0)]  # torch skips empty 1-d
    if not parts:
        raise Unsupported("a cat of empty tensors")
    dim %= len(shape)
    starts: list[ExprLike] = []
    offset: ExprLike = 0
    for t in parts:
        starts.append(offset)
        offset = offset + t.shape[dim]

    def body(*idx: Expr) -> Expr:
        value: Expr | None = None
        for t, start in reversed(list(zip(parts, starts))):
            src = list(idx)
            src[dim] = idx[dim] - start if not (isinstance(start, int) and start == 0) else idx[dim]
            read = te.cast(t[tuple(src)], out)
            value = read if value is None else te.where(idx[dim] < start + t.shape[dim], read, value)
        assert value is not None
        return value

    return ctx.compute(shape, body)


def lower_constant_pad_nd(ctx: LoweringContext, x: Any, pad: Sequence[Any], value: Any = 0) -> Tensor:
    x = _tensor(x, "a pad")
    shape = ctx.out_shape()
    before: list[ExprLike] = [0] * x.ndim
    for pair in range(len(pad) // 2):
        before[x.ndim - 1 - pair] = ctx.sizes.expr(pad[2 * pair])
    fill = constant(value, x.dtype)

    def body(*idx: Expr) -> Expr:
        src: list[ExprLike] = []
        inside: list[Expr] = []
        for d in range(x.ndim):
            b = before[d]
            same = shape[d] is x.shape[d] or (static_int(shape[d]) is not None
                                                and static_int(shape[d]) == static_int(x.shape[d]))
            if isinstance(b, int) and b == 0 and same:
                src.append(idx[d])
                continue
            at = idx[d] - b
            src.append(at)
            inside.append((at >= 0) & (at < x.shape[d]))
        if not inside:
            return x[tuple(src)]
        cond = inside[0]
        for c in inside[1:]:
            cond = cond & c
        return te.where(cond, x[tuple(src)], fill)

    return ctx.compute(shape, body)


def lower_copy(ctx: LoweringContext, x: Any, src: Any, non_blocking: bool = False) -> Tensor:
    """The functional copy: src broadcast to x's shape, in x's dtype."""
    shape, d = ctx.out_shape(), ctx.out_dtype()
    if not isinstance(src, Tensor):
        return ctx.compute(shape, lambda *idx: constant(src, d))
    return ctx.compute(shape, lambda *idx: te.cast(broadcast_read(src, idx, shape), d))


def lower_slice_scatter(ctx: LoweringContext, x: Any, src: Any, dim: int = 0, start: Any = None, end: Any = None,
                        step: int = 1) -> Tensor:
    """x with src written over x[.., start:end:step, ..]."""
    x, src = _tensor(x, "a slice_scatter"), _tensor(src, "a slice_scatter")
    dim %= x.ndim
    begin = _normalized(start, x.shape[dim], 0)
    if not isinstance(step, int) or step <= 0:
        raise Unsupported(f"slice_scatter step {step!r}")
    count = src.shape[dim]

    def body(*idx: Expr) -> Expr:
        offset = idx[dim] - begin
        inside = (offset >= 0) & (offset < count * step)
        if step != 1:
            inside = inside & (offset % step == 0)
        at = list(idx)
        at[dim] = offset // step if step != 1 else offset
        return te.where(inside, te.cast(src[tuple(at)], x.dtype), x[idx])

    return ctx.compute(x.shape, body)


def lower_select_scatter(ctx: LoweringContext, x: Any, src: Any, dim: int, index: Any) -> Tensor:
    x, src = _tensor(x, "a select_scatter"), _tensor(src, "a select_scatter")
    dim %= x.ndim
    at = _normalized(index, x.shape[dim], 0)

    def body(*idx: Expr) -> Expr:
        rest = tuple(idx[:dim]) + tuple(idx[dim + 1:])
        return te.where(idx[dim] == at, te.cast(src[rest], x.dtype), x[idx])

    return ctx.compute(x.shape, body)


def lower_flip(ctx: LoweringContext, x: Any, dims: Sequence[int]) -> Tensor:
    x = _tensor(x, "a flip")
    flipped = {d % x.ndim for d in dims}

    def body(*idx: Expr) -> Expr:
        return x[tuple(x.shape[d] - 1 - i if d in flipped else i for d, i in enumerate(idx))]

    return ctx.compute(ctx.out_shape(), body)


def lower_repeat(ctx: LoweringContext, x: Any, repeats: Sequence[Any]) -> Tensor:
    """out[.., i, ..] = x[.., i % size, ..] (leading new dimensions dropped)."""
    x = _tensor(x, "a repeat")
    shape = ctx.out_shape()
    lead = len(shape) - x.ndim

    def body(*idx: Expr) -> Expr:
        return x[tuple(i if static_int(r) == 1 else i % x.shape[d]
                       for d, (i, r) in enumerate(zip(idx[lead:], list(repeats)[lead:])))]

    return ctx.compute(shape, body)


def lower_diagonal(ctx: LoweringContext, x: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
    """The diagonal of dimensions dim1, dim2 as the last dimension."""
    x = _tensor(x, "a diagonal")
    d1, d2 = dim1 % x.ndim, dim2 % x.ndim
    rest = [d for d in range(x.ndim) if d not in (d1, d2)]

    def body(*idx: Expr) -> Expr:
        src: list[ExprLike] = [0] * x.ndim
        for d, i in zip(rest, idx[:-1]):
            src[d] = i
        k = idx[-1]
        src[d1] = k - offset if offset < 0 else k
        src[d2] = k + offset if offset > 0 else k
        return x[tuple(src)]

    return ctx.compute(ctx.out_shape(), body)
