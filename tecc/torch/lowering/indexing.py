"""Data-dependent indices: embedding and its backward, gather, scatter, scatter_add, index
(advanced indexing), index_put, index_select.

A read at a tensor's value is an ordinary tecc read whose index reads another tensor
(`W[idx[i], j]`, docs/semantics.md "Data-dependent indices"): lowering guards it with an index
check, so an index outside the table is an error of the program (the emulator raises; on the GPU
the read is skipped and the runtime raises OutOfBoundsError), never a read of other memory.

Accumulating writes are `tc.scatter_add`: the planner realizes them with atomics or as a sum per
output element, chosen by cost, and only the second under `build(..., deterministic=True)`,
which the backend asks for when torch's deterministic algorithms are on.

Writes that overwrite (`scatter`, `index_put(accumulate=False)`) have no accumulating form. They
are written gather-wise: each output element looks for the LAST position of the index tensor
(in its row-major order) that names it, and takes that position's value, or keeps `self`'s.
That is what ATen's CPU kernels do (they write in order, so the last write wins); on CUDA torch
leaves the winner of repeated indices unspecified, and tecc's choice is one of torch's allowed
results. The search is a max-reduction over the index positions per output element, so its cost
is (output elements) x (index positions): an index of one position per row (a one-hot, the
cross-entropy gradient's `scatter`) is elementwise; a larger product than `PUT_LIMIT` is left to
ATen. An index value outside `self` names no element and is ignored there (ATen raises).

Index conventions follow torch: `index`, `index_put` and `index_select` wrap negative indices
(`x[-1]`), `embedding`, `gather` and `scatter` do not (a negative index is out of range).
"""

from __future__ import annotations

from typing import Any, Sequence

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.expr import Const, Expr, ExprLike, const_product
from ...ir.scatter import scatter_add
from ...ir.tensor import Tensor, reduce_axis
from .context import LoweringContext, Unsupported, broadcast_read, constant, static_int

# overwriting writes: the largest (output elements) x (index positions) searched gather-wise
PUT_LIMIT = 1 << 28


def _tensor(x: Any, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise Unsupported(f"{what} is not a tensor")
    return x


def _index_tensor(t: Any, what: str) -> Tensor:
    t = _tensor(t, what)
    if not t.dtype.is_int:
        raise Unsupported(f"{what} of dtype {t.dtype} (a boolean mask selects a data-dependent number of "
                          "elements; tecc indexes with int32/int64 tensors only)")
    return t


def _wrapped(v: Expr, size: ExprLike) -> Expr:
    """torch's negative-index convention: -1 is the last element."""
    length = te.cast(size, v.dtype) if isinstance(size, Expr) else size
    return te.where(v < 0, v + length, v)


def _same(a: ExprLike, b: ExprLike) -> bool:
    """Whether two sizes are the same (the same expression, or equal constants)."""
    return a is b or (static_int(a) is not None and static_int(a) == static_int(b))


def _dim(x: Tensor, dim: int) -> int:
    if x.ndim == 0:
        raise Unsupported("indexing a 0-dimensional tensor along a dimension")
    return dim % x.ndim


def _sum_dtype(d: dt.DType) -> dt.DType:
    if d.is_bool:
        raise Unsupported("accumulating bool values")
    return d


# ---- embedding ---------------------------------------------------------------------------------
def lower_embedding(ctx: LoweringContext, weight: Any, indices: Any, padding_idx: int = -1,
                    scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """out[*i, j] = weight[indices[*i], j] (padding_idx only changes the backward)."""
    w, idx = _tensor(weight, "embedding's weight"), _index_tensor(indices, "embedding's indices")
    if w.ndim != 2:
        raise Unsupported("an embedding table that is not 2-dimensional")
    return ctx.compute(ctx.out_shape(), lambda *o: w[idx[tuple(o[:-1])], o[-1]])


def lower_embedding_dense_backward(ctx: LoweringContext, grad: Any, indices: Any, num_weights: Any,
                                   padding_idx: int, scale_grad_by_freq: bool) -> Tensor:
    """dW[v, j] = Σ over positions i with indices[i] = v (and v ≠ padding_idx) of grad[i, j],
    divided by the count of v among the indices when scale_grad_by_freq: a tc.scatter_add."""
    g, idx = _tensor(grad, "embedding_dense_backward's grad"), _index_tensor(indices, "its indices")
    shape = ctx.out_shape()
    out = ctx.out_dtype()
    lead = idx.ndim

    def keep(i: Sequence[Expr]) -> Expr | None:
        return None if padding_idx < 0 else idx[tuple(i)] != constant(padding_idx, idx.dtype)

    def value(*x: Expr) -> Expr:
        v = te.cast(g[x], out)
        kept = keep(x[:lead])
        return v if kept is None else te.where(kept, v, constant(0, out))

    domain = tuple(idx.shape) + (shape[1],)
    summed = scatter_add(shape, domain, at=lambda *x: (idx[tuple(x[:lead])], x[lead]), value=value, dtype=out,
                         name=ctx.name("_sum" if scale_grad_by_freq else ""))
    if not scale_grad_by_freq:
        return summed
    counts = scatter_add((shape[0],), tuple(idx.shape), at=lambda *x: (idx[x],),
                         value=lambda *x: Const(1, dt.int32), dtype=dt.int32, name=ctx.name("_counts"))
    return ctx.compute(shape, lambda v, j: te.where(counts[v] > 0, summed[v, j] / te.cast(counts[v], out),
                                                  summed[v, j]))


# ---- gather, scatter, scatter_add --------------------------------------------------------------
def lower_gather(ctx: LoweringContext, x: Any, dim: int, index: Any, sparse_grad: bool = False) -> Tensor:
    """out[p] = x[p with dimension dim replaced by index[p]] (out has index's shape)."""
    x, index = _tensor(x, "gather's input"), _index_tensor(index, "gather's index")
    if x.ndim == 0:  # the index can only be 0
        return ctx.compute(ctx.out_shape(), lambda *p: x[()])
    d = _dim(x, dim)

    def body(*p: Expr) -> Expr:
        at = list(p)
        at[d] = index[p]
        return x[tuple(at)]

    return ctx.compute(ctx.out_shape(), body)


def lower_scatter_add(ctx: LoweringContext, x: Any, dim: int, index: Any, src: Any) -> Tensor:
    """out = x; out[p with dim → index[p]] += src[p] for p over index's shape: a tc.scatter_add."""
    x, index = _tensor(x, "scatter_add's input"), _index_tensor(index, "its index")
    if x.ndim == 0:
        raise Unsupported("a scatter into a 0-dimensional tensor")
    d = _dim(x, dim)
    out = _sum_dtype(ctx.out_dtype())

    def at(*p: Expr) -> tuple[Expr, ...]:
        pos = list(p)
        pos[d] = index[p]
        return tuple(pos)

    def value(*p: Expr) -> Expr:
        return te.cast(src[p], out) if isinstance(src, Tensor) else constant(src, out)

    return scatter_add(ctx.out_shape(), tuple(index.shape), at=at, value=value, init=x, dtype=out, name=ctx.name())


def lower_scatter(ctx: LoweringContext, x: Any, dim: int, index: Any, src: Any) -> Tensor:
    """out = x; out[p with dim → index[p]] = src[p] (or the scalar src) for p over index's shape;
    the last position naming an element wins (module docstring)."""
    return _Overwrite(ctx, x, dim, index, src).lower(ctx, "set")


def lower_scatter_reduce(ctx: LoweringContext, x: Any, dim: int, index: Any, src: Any, *, reduce: str) -> Tensor:
    """scatter with reduce="add" (a scatter_add) or "multiply" (each element times the product of
    the values naming it, searched gather-wise as an overwriting scatter is)."""
    if reduce == "add":
        return lower_scatter_add(ctx, x, dim, index, src)
    if reduce == "multiply":
        return _Overwrite(ctx, x, dim, index, src).lower(ctx, "multiply")
    raise Unsupported(f"scatter with reduce={reduce!r}")


class _Overwrite:
    """A scatter searched gather-wise (module docstring): for output element p, the index
    positions (p with dim → k) whose value is p's coordinate along dim."""

    def __init__(self, ctx: LoweringContext, x: Any, dim: int, index: Any, src: Any) -> None:
        self.x, self.index = _tensor(x, "scatter's input"), _index_tensor(index, "scatter's index")
        if self.x.ndim == 0:
            raise Unsupported("a scatter into a 0-dimensional tensor")
        self.d = _dim(self.x, dim)
        self.src = src
        self.out = ctx.out_dtype()
        self.shape = ctx.out_shape()
        _check_search(self.shape, [self.index.shape[self.d]])
        # the other dimensions of index may be shorter than x's: only those positions are written
        self.shorter = [e for e in range(self.x.ndim) if e != self.d and not _same(self.index.shape[e], self.x.shape[e])]

    def inside(self, p: Sequence[Expr]) -> Expr | None:
        cond: Expr | None = None
        for e in self.shorter:
            c = p[e] < self.index.shape[e]
            cond = c if cond is None else cond & c
        return cond

    def at(self, p: Sequence[Expr], k: ExprLike) -> tuple[Expr, ...]:
        pos = list(p)
        pos[self.d] = k  # type: ignore[call-overload]
        return tuple(pos)

    def named(self, p: Sequence[Expr], k: ExprLike) -> Expr:
        """Whether index position (p with dim → k) names element p (reads guarded by `inside`)."""
        guard = self.inside(p)
        index = self.index
        read = index[self.at(p, k)]
        if guard is not None:
            read = te.where(guard, read, constant(-1, index.dtype))
        return read == te.cast(p[self.d], index.dtype)

    def value(self, p: Sequence[Expr], k: ExprLike) -> Expr:
        if isinstance(self.src, Tensor):
            return te.cast(self.src[self.at(p, k)], self.out)
        return constant(self.src, self.out)

    def guarded(self, p: Sequence[Expr], found: Expr) -> Expr:
        guard = self.inside(p)
        return found if guard is None else guard & found

    def lower(self, ctx: LoweringContext, combine: str) -> Tensor:
        x, one = self.x, static_int(self.index.shape[self.d]) == 1
        if combine == "multiply":
            unit = constant(1, self.out)

            def product(*p: Expr) -> Expr:
                if one:
                    factor = te.where(self.guarded(p, self.named(p, 0)), self.value(p, 0), unit)
                else:
                    k = reduce_axis(self.index.shape[self.d], "k")
                    factor = te.prod(te.where(self.guarded(p, self.named(p, k)), self.value(p, k), unit), [k])
                return te.cast(x[p], self.out) * factor

            return ctx.compute(self.shape, product)
        if one:  # one position per row (a one-hot): elementwise
            return ctx.compute(self.shape, lambda *p: te.where(self.guarded(p, self.named(p, 0)), self.value(p, 0),
                                                               x[p]))

        def last(*p: Expr) -> Expr:
            k = reduce_axis(self.index.shape[self.d], "k")
            return te.max(te.where(self.named(p, k), te.cast(k, dt.int64), constant(-1, dt.int64)), [k])

        winner = ctx.compute(self.shape, last, "_last")
        return ctx.compute(self.shape, lambda *p: te.where(self.guarded(p, winner[p] >= 0),
                                                           self.value(p, te.maximum(winner[p], 0)), x[p]))


def _check_search(shape: Sequence[ExprLike], positions: Sequence[ExprLike]) -> None:
    outputs, searched = const_product(shape), const_product(positions)
    if outputs is None or searched is None:
        raise Unsupported("an overwriting scatter over symbolic sizes (its gather-wise search has no bound)")
    if searched > 1 and outputs * searched > PUT_LIMIT:  # one position: a comparison per element, no search
        raise Unsupported(f"an overwriting scatter searching {searched} index positions for each of {outputs} "
                          f"elements (over {PUT_LIMIT}; lowering/indexing.py)")


# ---- advanced indexing: index, index_put, index_select -----------------------------------------
def _broadcast(shapes: Sequence[Sequence[ExprLike]]) -> tuple[ExprLike, ...]:
    """torch's broadcast of the index tensors' shapes (trailing dimensions align)."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[ExprLike] = []
    for position in range(rank):
        size: ExprLike = 1
        for s in shapes:
            k = position - (rank - len(s))
            if k < 0:
                continue
            if static_int(size) == 1:
                size = s[k]
        out.append(size)
    return tuple(out)


class Advanced:
    """x[indices] under torch's advanced indexing: the index tensors (None for a dimension taken
    whole) broadcast to one shape B; when the indexed dimensions are adjacent, B replaces them in
    place, otherwise B comes first and the other dimensions follow in order."""

    def __init__(self, x: Tensor, indices: Sequence[Any]) -> None:
        if len(indices) > x.ndim:
            raise Unsupported("more indices than dimensions")
        self.x = x
        self.indices: list[Tensor | None] = [None if t is None else _index_tensor(t, "an index")
                                             for t in indices] + [None] * (x.ndim - len(indices))
        self.indexed = [d for d, t in enumerate(self.indices) if t is not None]
        if not self.indexed:
            raise Unsupported("indexing with no index tensor")
        self.b_shape = _broadcast([t.shape for t in self.indices if t is not None])
        first, last = self.indexed[0], self.indexed[-1]
        self.adjacent = self.indexed == list(range(first, last + 1))
        rest = [d for d in range(x.ndim) if d not in self.indexed]
        self.b_at = first if self.adjacent else 0       # where B starts in the result
        self.rest = rest
        before = [d for d in rest if d < first] if self.adjacent else []
        after = [d for d in rest if d not in before]
        self.result_dims: list[int | None] = [*before, *([None] * len(self.b_shape)), *after]
        self.shape = tuple(x.shape[d] for d in before) + self.b_shape + tuple(x.shape[d] for d in after)

    def b_part(self, r: Sequence[Expr]) -> tuple[Expr, ...]:
        return tuple(r[self.b_at: self.b_at + len(self.b_shape)])

    def position(self, r: Sequence[Expr]) -> tuple[Expr, ...]:
        """The element of x that result element r reads (negative indices wrapped)."""
        b = self.b_part(r)
        pos: list[Expr | None] = [None] * self.x.ndim
        for slot, d in enumerate(self.result_dims):
            if d is not None:
                pos[d] = r[slot]
        for d in self.indexed:
            t = self.indices[d]
            assert t is not None
            pos[d] = _wrapped(broadcast_read(t, b, self.b_shape), self.x.shape[d])
        return tuple(p for p in pos if p is not None)

    def result_index(self, b: Sequence[Expr], p: Sequence[Expr]) -> tuple[Expr, ...]:
        """The result element at index position b whose other dimensions are x's element p's."""
        out: list[Expr] = []
        b_iter = iter(b)
        for d in self.result_dims:
            out.append(next(b_iter) if d is None else p[d])
        return tuple(out)


def lower_index(ctx: LoweringContext, x: Any, indices: Any) -> Tensor:
    adv = Advanced(_tensor(x, "index's input"), list(indices))
    return ctx.compute(ctx.out_shape(), lambda *r: adv.x[adv.position(r)])


def lower_index_select(ctx: LoweringContext, x: Any, dim: int, index: Any) -> Tensor:
    x = _tensor(x, "index_select's input")
    d = _dim(x, dim) if x.ndim else 0
    idx = _index_tensor(index, "index_select's index")
    if idx.ndim > 1:
        raise Unsupported("index_select with a multi-dimensional index")
    if x.ndim == 0:
        return ctx.compute((), lambda: x[()])

    def body(*o: Expr) -> Expr:
        at = list(o)
        at[d] = _wrapped(idx[(o[d],)] if idx.ndim else idx[()], x.shape[d])
        return x[tuple(at)]

    return ctx.compute(ctx.out_shape(), body)


def lower_index_put(ctx: LoweringContext, x: Any, indices: Any, values: Any, accumulate: bool = False) -> Tensor:
    """x with x[indices] = values (+= with accumulate: a tc.scatter_add; otherwise the last
    position naming an element wins, module docstring)."""
    adv = Advanced(_tensor(x, "index_put's input"), list(indices))
    out = ctx.out_dtype()
    vals = values if isinstance(values, Tensor) else None
    if vals is None and not isinstance(values, (int, float, bool)):
        raise Unsupported("index_put of values that are neither a tensor nor a scalar")

    def value(r: Sequence[Expr]) -> Expr:
        if vals is None:
            return constant(values, out)
        return te.cast(broadcast_read(vals, r, adv.shape), out)

    if accumulate:
        return scatter_add(ctx.out_shape(), adv.shape, at=lambda *r: adv.position(r), value=lambda *r: value(r),
                           init=adv.x, dtype=_sum_dtype(out), name=ctx.name())
    _check_search([adv.x.shape[d] for d in adv.indexed], adv.b_shape)
    b_shape = adv.b_shape

    def last(*q: Expr) -> Expr:
        axes = [reduce_axis(s, f"b{n}") for n, s in enumerate(b_shape)]
        hit: Expr | None = None
        for d, coordinate in zip(adv.indexed, q):
            t = adv.indices[d]
            assert t is not None
            c = _wrapped(broadcast_read(t, axes, b_shape), adv.x.shape[d]) == te.cast(coordinate, t.dtype)
            hit = c if hit is None else hit & c
        assert hit is not None
        linear: Expr = constant(0, dt.int64)
        for a, s in zip(axes, b_shape):
            linear = linear * te.cast(s, dt.int64) + te.cast(a, dt.int64)
        found = te.where(hit, linear, constant(-1, dt.int64))
        return te.max(found, axes) if axes else found

    winner = ctx.compute(tuple(adv.x.shape[d] for d in adv.indexed), last, "_last")

    def body(*p: Expr) -> Expr:
        w = winner[tuple(p[d] for d in adv.indexed)]
        at = te.maximum(w, 0)
        b: list[Expr] = []
        for s in reversed(b_shape):
            b.append(at % te.cast(s, dt.int64))
            at = at // te.cast(s, dt.int64)
        return te.where(w >= 0, value(adv.result_index(b[::-1], p)), adv.x[p])

    return ctx.compute(ctx.out_shape(), body)


__all__ = ["Advanced", "PUT_LIMIT", "lower_embedding", "lower_embedding_dense_backward", "lower_gather", "lower_index",
           "lower_index_put", "lower_index_select", "lower_scatter", "lower_scatter_add", "lower_scatter_reduce"]
