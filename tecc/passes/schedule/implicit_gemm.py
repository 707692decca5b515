"""implicit_gemm: a contraction stage seen as a GEMM, whatever its index structure.

`tensorize` builds a tiled tensor-core kernel over a GEMM: C[m, n] = Σ_k A[m, k] · B[k, n]. This
module finds that GEMM in a lowered contraction whose loops and indices are more general than a
matrix product, and describes how each element of the GEMM's operands is found in memory. A plain
matrix product is the case where every group below has one axis; a convolution written as a
tensor expression (NHWC, NCHW, stride, dilation, padding through `where`, 1x1, conv1d/3d) is
the general case. Nothing here is keyed by an op's name: only by which loop variables index what.

The stage, as lowered (tensorize is the first primitive applied to it):

    for s1: for s2: ...                          # spatial loops
      acc[0] = 0
      for r1: for r2: ...                        # reduction loops, nested, one update inside
        acc[0] = acc[0] + term
      C[s1, s2, ..] = epilogue(acc[0])

with term `float32(x * y)` or `float32(x) * float32(y)`, and each multiplicand a read of a
float16/bfloat16 input (or float32: the tf32 intrinsic, which tensorize takes only when named), optionally under `where(cond, read, 0)` (zero padding; casts may sit
either side of the `where`). Each index of a read must be affine in the loop variables
(Σ coefficient · variable + constant, integer coefficients).

The GEMM view (the axes are grouped, not the loops rewritten):
- batch axes: spatial variables that index both operands (a batched GEMM's b);
- row axes (M-like): spatial variables that index only the first operand A (n, p, q of a conv);
- column axes (N-like): spatial variables that index only the second operand B (f of a conv);
- reduction axes (K): every reduction variable (c, r, s of a conv).
B is the operand indexed by the output's innermost axis (so consecutive accumulator columns are
consecutive outputs); A the other. M, N, K are the products of the groups' extents; a row m is
unflattened into its axes by div/mod, outermost first (the first axis takes the quotient, the
innermost `m % extent`), and so are a column n and a reduction index k.

Groups are flattened in an order chosen for the operands' memory: each group is sorted by the
flat-address coefficient of its axes in the operand that reads it (outermost = largest stride),
so the group's innermost axis is the operand's contiguous one when it has one (c of NHWC
activations: k = (r·S + s)·C + c). K is read by both operands; its order is the one that gives
the longer 16-byte copies (A's order first on a tie).

Gathered loads (no materialized im2col): `OperandView.at(values)` is the operand's element for
given values of the loop variables (the original indices with each variable replaced by its
unflattened expression) and its predicate (the `where` condition, substituted the same way).
A tile is copied with `copy` elements per cp.async when a run of consecutive indices of the
tile's contiguous group is contiguous in memory and uniformly in or out of bounds
(`contiguous_copy`): the innermost axes of the group with strides 1, e0, e0·e1, ... and absent
from the `where` condition, whose extent product is a multiple of the copy, and every other
stride and the constant offset multiples of it (so copies are aligned). NHWC with C % 8 == 0
gets 16-byte copies; C = 3 and NCHW activations (whose contiguous axis q·stride + s·dil mixes a
row and a reduction axis) get guarded element loads (zero where out of range). An operand with
run-time strides (strides="any") is laid out as a slice of a wider row-major array would be
(`assumed_strides`), and its copies carry the launch condition that makes them correct
(`stride_condition`), which the kernel tests (tile_staging.py, `TileStaging.dispatch`); its
`transposed` form is the same read laid out as a view with the unit stride on another
dimension (w.t()), in the other orientation, with that view's copies and condition
(`transposed_operand`).

Refused (ScheduleError naming the condition): a read that is not affine, a spatial axis that
indexes neither operand, a reduction axis that indexes only one, no row or no column axis (a
depthwise convolution, where every output axis indexes the activations: a memory-bound stencil,
not a GEMM), a batch axis under a `where`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Binary, BufferLoad, Cast, Const, Expr, Select, Var, const_int, free_vars, size_product, substitute, walk
from ...ir.stmt import Allocate, Buffer, BufferStore, For, PrimFunc, Seq, Stmt
from ..simplify import Bounds, Simplifier, linear_form

Axis = tuple[Var, Expr]  # (loop variable, extent)


@dataclass(frozen=True)
class Operand:
    """One multiplicand seen as a GEMM operand (A: rows × k, B: k × columns).

    load: the read as lowered (indices in the loop variables); guard: its `where` condition, or
    None. k_last: the operand's shared tile is [outer][k] (its memory runs along k), else
    [k][outer]. copy: elements per cp.async copy along the tile's contiguous dimension, 0 for
    guarded element loads. assumes: for an operand with run-time strides, the launch condition
    on them under which `copy` holds (`stride_condition`); None when `copy` holds always.
    transposed: for an operand with run-time strides, the same read in the other orientation
    with the copies and launch condition of a view whose unit stride is on another dimension
    (A = w.t(): k_last flipped, copies along the rows); None when no such view gets copies."""

    role: str            # "A" (rows) or "B" (columns)
    buffer: Buffer
    k_last: bool
    load: BufferLoad
    guard: Expr | None
    copy: int
    assumes: Expr | None = None
    # an operand with run-time strides: the other orientation's copy form, for views whose unit
    # stride is on another dimension (a transposed view, `transposed_operand`), or None
    transposed: "Operand | None" = None
    along: int = -1      # the buffer dimension the copies run along (unit stride): -1, the innermost

    def at(self, values: Mapping[Var, Expr]) -> tuple[tuple[Expr, ...], Expr | None]:
        """The element's indices and its `where` predicate (None: always in range) for the loop
        variables' values."""
        mapping = dict(values)
        indices = tuple(substitute(ix, mapping) for ix in self.load.indices)
        return indices, (substitute(self.guard, mapping) if self.guard is not None else None)


@dataclass(frozen=True)
class Contraction:
    """The matched stage: C[..] = epilogue(Σ_k A · B) over the groups of axes (module docstring)."""

    batch: tuple[Axis, ...]               # outermost first
    rows: tuple[Axis, ...]                # M-like axes, outermost first (flattening order)
    cols: tuple[Axis, ...]                # N-like axes
    ks: tuple[Axis, ...]                  # reduction axes
    a: Operand
    b: Operand
    acc: Buffer                            # the lowered accumulator (float32[1], local)
    store: BufferStore                     # C[..] = epilogue(acc[0])

    @property
    def m(self) -> Expr:
        return size_product([e for _, e in self.rows])

    @property
    def n(self) -> Expr:
        return size_product([e for _, e in self.cols])

    @property
    def kext(self) -> Expr:
        return size_product([e for _, e in self.ks])

    @property
    def i(self) -> Var:
        """The innermost row axis (the row axis of a plain GEMM)."""
        return self.rows[-1][0]

    @property
    def j(self) -> Var:
        return self.cols[-1][0]

    @property
    def k(self) -> Var:
        return self.ks[-1][0]


def unflatten(axes: Sequence[Axis], flat: Expr) -> dict[Var, Expr]:
    """Each axis's index for the flat index `flat` of the group (outermost axis first, row-major):
    the innermost is flat % extent, the outermost takes what is left undivided. One axis: flat."""
    out: dict[Var, Expr] = {}
    rest = flat
    for n, (v, ext) in enumerate(reversed(axes)):
        if n == len(axes) - 1:
            out[v] = rest
        else:
            out[v] = rest % ext
            rest = rest // ext
    return out


# ---- the address structure of an operand --------------------------------------------------------

@dataclass(frozen=True)
class Stride:
    """A flat-address stride: its exact value when constant, and the constant factor it surely has."""

    exact: int | None
    factor: int


@dataclass(frozen=True)
class Layout:
    """An operand's flat address as Σ coeff[v] · v + const over loop variables (by name)."""

    coeff: Mapping[str, Stride]
    const: Stride
    guard_vars: frozenset[str]


def _times(s: Stride, k: int) -> Stride:
    return Stride(None if s.exact is None else s.exact * k, abs(s.factor * k))


def _plus(a: Stride, b: Stride) -> Stride:
    from math import gcd

    return Stride(None if a.exact is None or b.exact is None else a.exact + b.exact, gcd(a.factor, b.factor))


def layout_of(per_dim: Sequence[tuple[Mapping[str, int], int]], dims: Sequence[int | None],
              guard_vars: frozenset[str] = frozenset(), dim_strides: Sequence[Stride] | None = None) -> Layout:
    """The Layout of a row-major buffer of extents `dims` (None: symbolic) read at indices
    `per_dim` (each {variable: coefficient}, constant); `dim_strides`: each dimension's stride
    instead of the row-major ones (a buffer with run-time strides: `assumed_strides`)."""
    strides: list[Stride] = []
    exact: int | None = 1
    factor = 1
    for d in reversed(dims):
        strides.append(Stride(exact, factor))
        exact = None if exact is None or d is None else exact * d
        factor = factor * d if d is not None else factor
    strides.reverse()
    if dim_strides is not None:
        strides = list(dim_strides)
    coeff: dict[str, Stride] = {}
    const = Stride(0, 0)
    for (terms, c), st in zip(per_dim, strides):
        for v, k in terms.items():
            piece = _times(st, k)
            coeff[v] = _plus(coeff[v], piece) if v in coeff else piece
        if c:
            const = _plus(const, _times(st, c))
    return Layout(coeff, const, guard_vars)


COPY_BYTES = (16, 8, 4)  # the sizes of cp.async


# ---- run-time strides: the layout a fast kernel assumes, and the launch condition it needs -------
# A buffer declared with strides="any" has its strides as kernel parameters, known only at launch.
# Its element loads are always correct (they address through the stride variables). Its 16-byte
# copies are correct when the innermost stride is 1 and every other stride is a multiple of the
# copy (the runtime aligns base pointers to 16 bytes: runtime/marshal.py DEFAULT_ALIGNMENT): what a
# slice of a wider row-major array (torch's x[:, :K]) has. The planner and tensorize lay such an
# operand out as if that held (`assumed_strides`), and the kernel tests it at launch
# (`stride_condition`, a uniform branch between the copy and the element-load main loops).

def run_time_stride(innermost: bool, element_bytes: int) -> Stride:
    """A run-time stride as a fast kernel may assume it: 1 innermost, else an unknown multiple of
    16 bytes."""
    return Stride(1, 1) if innermost else Stride(None, max(1, COPY_BYTES[0] // element_bytes))


def unit_strides(buffer: Buffer, unit: int, element_bytes: int) -> list[Stride] | None:
    """Each dimension's stride as a copy loop for views whose run-time unit stride is on
    dimension `unit` may assume it (a transposed view: `unit` is not the innermost): that stride
    1, the other run-time strides unknown multiples of 16 bytes, constant strides as they are.
    None when `unit`'s stride is not a run-time one."""
    if buffer.strides is None or const_int(buffer.strides[unit]) is not None:
        return None
    out: list[Stride] = []
    for d, s in enumerate(buffer.strides):
        c = const_int(s)
        out.append(Stride(c, abs(c)) if c is not None else run_time_stride(d == unit, element_bytes))
    return out


def assumed_strides(buffer: Buffer, element_bytes: int) -> list[Stride] | None:
    """Each dimension's stride as a fast kernel may assume it (None for a row-major buffer): a
    constant stride exactly, a run-time one by `run_time_stride`. A constant innermost stride
    other than 1 allows no copies (cp.async reads contiguous elements of the innermost
    dimension): every stride is then given as unknown, so `contiguous_copy` proves none; so
    is a constant stride of 1 outside the innermost dimension beside a run-time innermost one."""
    if buffer.strides is None:
        return None
    last = len(buffer.strides) - 1
    inner = const_int(buffer.strides[last])
    if inner not in (None, 1) or (inner is None and any(const_int(s) == 1 for s in buffer.strides[:last])):
        return [Stride(None, 1) for _ in buffer.strides]
    out: list[Stride] = []
    for d, s in enumerate(buffer.strides):
        c = const_int(s)
        out.append(Stride(c, abs(c)) if c is not None else run_time_stride(d == last, element_bytes))
    return out


def stride_condition(buffer: Buffer, copy: int, unit: int = -1) -> Expr | None:
    """The launch condition under which copies of `copy` elements of `buffer` laid out by
    `assumed_strides` (or `unit_strides` for dimension `unit`) are correct: its run-time stride
    of dimension `unit` (the innermost by default) is 1 and each other run-time stride is a
    multiple of `copy` (or its dimension has size 1: that stride is never used). None when no
    stride is a run-time one."""
    if buffer.strides is None or copy <= 0:
        return None
    terms: list[Expr] = []
    last = unit % len(buffer.strides)
    for d, (n, s) in enumerate(zip(buffer.shape, buffer.strides)):
        size = const_int(n)
        if const_int(s) is not None or size == 1 or (d != last and copy == 1):
            continue
        term = (s == 1) if d == last else (s % copy == 0)
        terms.append(term if size is not None else (n == 1) | term)
    if not terms:
        return None
    cond = terms[0]
    for t in terms[1:]:
        cond = cond & t
    return cond


def copy_sizes_of(element_bytes: int) -> tuple[int, ...]:
    """Elements per 16-, 8- and 4-byte cp.async of elements of `element_bytes` (8, 4, 2 halves; 4, 2, 1 floats)."""
    return tuple(b // element_bytes for b in COPY_BYTES if b >= element_bytes)


def contiguous_copy(layout: Layout, group: Sequence[tuple[str, int | None]], element_bytes: int = 2) -> int:
    """Elements per cp.async copy along `group` (the axes of the tile's contiguous dimension,
    outermost first, with their extents): the run of innermost axes with strides 1, e0, e0·e1, ...
    that the `where` condition does not read gives consecutive flat group indices consecutive
    addresses; a copy of n elements needs n to divide the run (copies never straddle it, and the
    group's extent is a multiple of it) and every other stride and the constant offset to be
    multiples of n (aligned copies). 0: no copy is provable (guarded element loads)."""
    run = 1
    inner: set[str] = set()
    for name, ext in reversed(group):
        st = layout.coeff.get(name)
        if st is None or st.exact != run or name in layout.guard_vars or ext is None:
            break
        run *= ext
        inner.add(name)
    if not inner:
        return 0
    for n in copy_sizes_of(element_bytes):
        if run % n:
            continue
        others = [s for v, s in layout.coeff.items() if v not in inner] + [layout.const]
        if all(s.factor % n == 0 for s in others):
            return n
    return 0


def order_by_stride(group: Sequence[str], *layouts: Layout) -> list[str]:
    """`group` sorted outermost first by the flat-address stride in the first layout that reads
    the axis with a constant stride (largest first); the loop order where none does."""
    def key(name: str) -> tuple[int, ...]:
        out = []
        for lay in layouts:
            st = lay.coeff.get(name)
            out.append(-abs(st.exact) if st is not None and st.exact is not None else 0)
        return tuple(out)
    return sorted(group, key=key)


def gemm_order(rows: Sequence[str], cols: Sequence[str], ks: Sequence[str], a: Layout, b: Layout,
               extents: Mapping[str, int | None], element_bytes: int = 2,
               ) -> tuple[list[str], list[str], list[str], bool, bool, int, int]:
    """The flattening orders of the groups, each operand's orientation (k_last) and copy size in
    elements of `element_bytes` (the module docstring's rules). Shared by tensorize and the
    strategy's cost model."""
    rows_o, cols_o = order_by_stride(rows, a), order_by_stride(cols, b)
    best: tuple[int, int, list[str], bool, bool, int, int] | None = None
    for rank, ks_o in enumerate((order_by_stride(ks, a, b), order_by_stride(ks, b, a))):
        sides = []
        for lay, outer in ((a, rows_o), (b, cols_o)):
            along_k = contiguous_copy(lay, [(v, extents[v]) for v in ks_o], element_bytes)
            along_outer = contiguous_copy(lay, [(v, extents[v]) for v in outer], element_bytes)
            if along_k or along_outer:
                sides.append((along_k >= along_outer, max(along_k, along_outer)))
            else:
                sides.append((_k_last_without_copy(lay, outer, ks_o), 0))
        score = sides[0][1] + sides[1][1]
        if best is None or score > best[0]:
            best = (score, rank, ks_o, sides[0][0], sides[1][0], sides[0][1], sides[1][1])
    assert best is not None
    _, _, ks_o, a_k_last, b_k_last, a_copy, b_copy = best
    return rows_o, cols_o, ks_o, a_k_last, b_k_last, a_copy, b_copy


def _k_last_without_copy(lay: Layout, outer: Sequence[str], ks: Sequence[str]) -> bool:
    """Orientation of an operand loaded element by element: along the group of its smallest
    stride (consecutive threads then read nearby addresses); the outer group on a tie."""
    def smallest(names: Sequence[str]) -> float:
        vals = [abs(s.exact) for v in names if (s := lay.coeff.get(v)) is not None and s.exact is not None]
        return min(vals, default=float("inf"))
    return smallest(ks) < smallest(outer)


# ---- matching -----------------------------------------------------------------------------------

HALF_OPERANDS = (dt.float16, dt.bfloat16)
TENSOR_CORE_OPERANDS = (dt.float16, dt.bfloat16, dt.float32)  # float32: rounded to tf32 (tensorize)
WGMMA_OPERANDS = TENSOR_CORE_OPERANDS + dt.FP8_DTYPES  # fp8: Hopper's wgmma only (tensorize_wgmma)


def match_contraction(func: PrimFunc, stage: str, operand_dtypes: Sequence[dt.DType] = HALF_OPERANDS,
                      where: str = "", run_time_strides: bool = False) -> Contraction:
    """The contraction computed by `func` for `stage` as a GEMM, or a ScheduleError naming what differs.
    `operand_dtypes`: the multiplicands' allowed dtypes (tensor cores: 16-bit; the SIMT implicit
    GEMM of gemm_view.py: float32); `where` names the primitive in errors. `run_time_strides`:
    the caller takes operands whose strides are kernel parameters (each Operand's `assumes` is
    the launch condition of its copies); otherwise they are refused."""
    where = where or f"tensorize({stage})"
    loops: list[For] = []
    node: Stmt = func.body
    while isinstance(node, For):
        if node.kind != "serial":
            raise ScheduleError(f"{where}: loop {node.var.name} is already {node.kind}; tensorize must be the "
                                "first primitive applied to the stage's kernel")
        loops.append(node)
        node = node.body
    if not isinstance(node, Allocate) or len(loops) < 2:
        raise ScheduleError(f"{where}: expected the lowered loop nest (spatial loops, then the accumulator) of a "
                            "stage with at least two spatial axes and one reduction")
    acc = node.buffer
    body = node.body
    if not isinstance(body, Seq) or len(body.stmts) != 3:
        raise ScheduleError(f"{where}: expected init, one reduction loop nest and the store under the accumulator "
                            f"{acc.name} (a stage with one Reduce)")
    init, kloop, store = body.stmts
    if acc.dtype != dt.float32:
        raise ScheduleError(f"{where}: the accumulator {acc.name} is {acc.dtype}; tensor cores accumulate in float32 "
                            "(use float16/bfloat16 operands and a float16/bfloat16/float32 result)")
    if not (isinstance(init, BufferStore) and init.buffer is acc and isinstance(init.value, Const)
            and float(init.value.value) == 0.0):
        raise ScheduleError(f"{where}: the reduction must be a sum starting at 0 (tc.sum)")
    kloops: list[For] = []
    inner: Stmt = kloop
    while isinstance(inner, For):
        kloops.append(inner)
        inner = inner.body
    if not kloops or not isinstance(inner, BufferStore) or inner.buffer is not acc:
        raise ScheduleError(f"{where}: expected reduction loops whose innermost body updates {acc.name} and "
                            "nothing else")
    if not isinstance(store, BufferStore) or store.buffer.scope != "global":
        raise ScheduleError(f"{where}: expected the store of the stage to a global buffer after the reduction")
    if any(const_int(lp.min) != 0 for lp in loops + kloops):
        raise ScheduleError(f"{where}: every axis must start at 0")
    update = inner.value
    if not (isinstance(update, Binary) and update.op == "+" and isinstance(update.a, BufferLoad)
            and update.a.buffer is acc):
        raise ScheduleError(f"{where}: the reduction must be a sum (acc = acc + term), got {update}")
    (x, gx), (y, gy) = _multiplicands(where, update.b, operand_dtypes)
    spatial = [lp.var for lp in loops]
    if not _same_vars(store.indices, spatial):
        raise ScheduleError(f"{where}: the output {store.buffer.name} must be indexed by exactly its loop axes "
                            f"({', '.join(v.name for v in spatial)}), got [{', '.join(map(str, store.indices))}]; "
                            "the kernel must be as lowered (tensorize is the first primitive applied to it)")
    mixed_fp8 = {x.buffer.dtype, y.buffer.dtype} <= set(operand_dtypes) & set(dt.FP8_DTYPES)  # e4m3 x e5m2 rows
    if x.buffer.dtype != y.buffer.dtype and not mixed_fp8:
        raise ScheduleError(f"{where}: mixed operand dtypes {x.buffer.name}: {x.buffer.dtype}, {y.buffer.dtype} "
                            f"{y.buffer.name}; cast one so both are float16, both bfloat16 or both float32")
    for load in (x, y):
        if load.buffer.strides is not None and not run_time_strides:
            raise ScheduleError(f"{where}: operand {load.buffer.name} has run-time strides; tensorize needs a "
                                "contiguous row-major operand (copy it first)")
    axes = [(lp.var, lp.extent) for lp in loops]
    axes, red, (x, gx), (y, gy), store = _split_groups(where, axes, [(lp.var, lp.extent) for lp in kloops],
                                                       (x, gx), (y, gy), store)
    spatial = [v for v, _ in axes]
    # B is indexed by the output's innermost axis
    inner_axis = spatial[-1]
    reads_x, reads_y = _vars_of(x, gx), _vars_of(y, gy)
    if inner_axis in reads_x and inner_axis not in reads_y:
        (x, gx), (y, gy), reads_x, reads_y = (y, gy), (x, gx), reads_y, reads_x
    loads = {"A": (x, gx), "B": (y, gy)}
    layouts = {role: operand_layout(where, load, guard, spatial, [v for v, _ in red])
               for role, (load, guard) in loads.items()}
    batch: list[Var] = []
    rows: list[Var] = []
    cols: list[Var] = []
    for v in spatial:
        in_a, in_b = v in reads_x, v in reads_y
        group = batch if in_a and in_b else rows if in_a else cols if in_b else None
        if group is None:
            raise ScheduleError(f"{where}: output axis {v.name} indexes neither operand (a broadcast, not a "
                                "contraction); tensor cores need every output axis to index an operand")
        group.append(v)
    for k, _ in red:
        if k not in reads_x or k not in reads_y:
            raise ScheduleError(f"{where}: reduction axis {k.name} indexes only one operand; sum it first")
    if not rows or not cols:
        which = "row axis (an output axis indexing only the first operand)" if not rows else \
            "column axis (an output axis indexing only the second operand)"
        raise ScheduleError(
            f"{where}: no {which}: the output axes ({', '.join(v.name for v in spatial)}) index both operands or "
            f"only {'the second' if not rows else 'the first'}, so this is not a matrix product but a batched dot "
            "product or a stencil (a depthwise convolution is one): memory-bound, left to the SIMT strategies")
    for v in batch:
        if any(v.name in lay.guard_vars for lay in layouts.values()):
            raise ScheduleError(f"{where}: batch axis {v.name} is read by a where() condition; tensorize predicates "
                                "rows, columns and reduction indices only")
    every = axes + red
    extents = {v.name: const_int(e) for v, e in every}
    by_name = {v.name: (v, e) for v, e in every}
    rows_o, cols_o, ks_o, a_k_last, b_k_last, a_copy, b_copy = gemm_order(
        [v.name for v in rows], [v.name for v in cols], [k.name for k, _ in red],
        layouts["A"], layouts["B"], extents, x.buffer.dtype.bytes)
    a = Operand("A", x.buffer, a_k_last, x, gx, a_copy, stride_condition(x.buffer, a_copy))
    b = Operand("B", y.buffer, b_k_last, y, gy, b_copy, stride_condition(y.buffer, b_copy))
    reduction_axes = [k for k, _ in red]
    for role, outer in (("A", rows_o), ("B", cols_o)):
        op = a if role == "A" else b
        alt = transposed_operand(op, [(n, extents[n]) for n in outer], [(n, extents[n]) for n in ks_o],
                                 spatial, reduction_axes)
        if alt is not None:
            a, b = (replace(a, transposed=alt), b) if role == "A" else (a, replace(b, transposed=alt))
    return Contraction(tuple(by_name[v.name] for v in batch), tuple(by_name[n] for n in rows_o),
                       tuple(by_name[n] for n in cols_o), tuple(by_name[n] for n in ks_o), a, b, acc, store)


def transposed_operand(op: Operand, outer: Sequence[tuple[str, int | None]], ks: Sequence[tuple[str, int | None]],
                       spatial: Sequence[Var], reduction: Sequence[Var]) -> Operand | None:
    """The other orientation of an operand with run-time strides, for views whose unit stride is
    on another dimension than the one the operand's copies assume (a transposed view: A = w.t()
    has strides (1, M), so its k-major tile becomes an M-major one, copied along the rows): the
    first dimension other than the assumed one whose unit stride gives 16-, 8- or 4-byte copies
    along the group (k or the operand's rows/columns) the first orientation does not copy
    along, with their launch condition. None for a buffer without run-time strides, or when no
    such view gets copies."""
    buf = op.buffer
    if buf.strides is None:
        return None
    for unit in range(len(buf.strides) - 1):
        strides = unit_strides(buf, unit, buf.dtype.bytes)
        if strides is None:
            continue
        lay = operand_layout("", op.load, op.guard, spatial, reduction, strides)
        k_last = not op.k_last
        copy = contiguous_copy(lay, ks if k_last else outer, buf.dtype.bytes)
        if copy:
            return replace(op, k_last=k_last, copy=copy, assumes=stride_condition(buf, copy, unit), transposed=None,
                           along=unit)
    return None


Read = tuple[BufferLoad, Expr | None]


def _split_groups(where: str, axes: list[Axis], reduction: list[Axis], x: Read, y: Read,
                  store: BufferStore) -> tuple[list[Axis], list[Axis], Read, Read, BufferStore]:
    """Grouped contractions: an output axis v that one operand reads only as v // d (a grouped
    convolution's activations X[.., (f // Fg)·Cg + c] with filters W[.., c, f]) is split into
    v_group = v // d, which indexes both operands (a batch axis), and v_in = v % d, which indexes
    only the other (a column axis): v = v_group·d + v_in everywhere, the indices simplified with
    0 <= v_in < d. The extent of v must be a constant multiple of d. A view merging two
    dimensions of a tensor computed in the program reads it as X[v // d, v % d, ..]: the same
    split makes it X[v_group, v_in, ..], for a row or column axis and for a reduction axis (a
    weight gradient summed over batch x tokens), which then becomes two reduction axes."""
    for v, ext in list(axes) + list(reduction):
        spatial = any(v is a for a, _ in axes)
        divisors = {const_int(e.b) for load, guard in (x, y)
                    for ix in load.indices + ((guard,) if guard is not None else ())
                    for e in walk(ix) if isinstance(e, Binary) and e.op == "//" and e.a is v}
        if not divisors:
            continue
        d = divisors.pop()
        n = const_int(ext)
        if divisors or d is None or d <= 0 or n is None or n % d:
            raise ScheduleError(f"{where}: axis {v.name} is read divided by {d}; tensorize splits such an axis into "
                                "groups only by one constant that divides its constant extent")
        group, inner = Var(f"{v.name}_group"), Var(f"{v.name}_in")
        bounds = Bounds()
        bounds.var_bounds[group] = (0, n // d - 1)
        bounds.var_bounds[inner] = (0, d - 1)
        for a, e in axes + reduction:
            hi = const_int(e)
            bounds.var_bounds[a] = (0, None if hi is None else hi - 1)
        simplify = Simplifier(bounds)
        mapping: dict[Var, Expr] = {v: group * d + inner}

        def rewrite(e: Expr) -> Expr:
            return simplify.visit(substitute(e, mapping))

        def read(r: Read) -> Read:
            load, guard = r
            new = BufferLoad(load.buffer, tuple(rewrite(ix) for ix in load.indices))
            return new, (rewrite(guard) if guard is not None else None)
        x, y = read(x), read(y)
        store = BufferStore(store.buffer, tuple(substitute(ix, mapping) for ix in store.indices),
                            substitute(store.value, mapping))
        halves = [(group, Const(n // d, dt.int32)), (inner, Const(d, dt.int32))]
        if spatial:
            at = [a for a, _ in axes].index(v)
            axes = axes[:at] + halves + axes[at + 1:]
        else:
            at = [a for a, _ in reduction].index(v)
            reduction = reduction[:at] + halves + reduction[at + 1:]
        if any(v in _vars_of(*r) for r in (x, y)):
            raise ScheduleError(f"{where}: axis {v.name} is read both divided by {d} and otherwise; tensorize "
                                "splits an axis into groups only where that leaves v // d and v % d")
    return axes, reduction, x, y, store


def _vars_of(load: BufferLoad, guard: Expr | None) -> set[Var]:
    out: set[Var] = set()
    for ix in load.indices:
        out |= free_vars(ix)
    if guard is not None:
        out |= free_vars(guard)
    return out


def operand_layout(where: str, load: BufferLoad, guard: Expr | None, spatial: Sequence[Var],
                   reduction: Sequence[Var], strides: list[Stride] | None = None) -> Layout:
    """The flat-address Layout of an operand read (its where() condition's variables noted), or a
    ScheduleError from `where` when an index is not affine in the loop axes; `strides`: each
    dimension's stride instead of the buffer's (`assumed_strides` by default)."""
    known = set(spatial) | set(reduction)
    per_dim: list[tuple[dict[str, int], int]] = []
    for ix in load.indices:
        terms, const = linear_form(ix)
        if not all(isinstance(t, Var) and t in known for t in terms):
            raise ScheduleError(f"{where}: operand {load.buffer.name}[{', '.join(map(str, load.indices))}]: index "
                                f"{ix} is not affine in the loop axes (Σ integer · axis + constant); tensorize "
                                "gathers affine indices only")
        per_dim.append(({t.name: k for t, k in terms.items() if isinstance(t, Var)}, const))
    guard_vars = frozenset(v.name for v in free_vars(guard)) if guard is not None else frozenset()
    if not guard_vars <= {v.name for v in known}:
        raise ScheduleError(f"{where}: the where() condition of {load.buffer.name} reads {guard}, which is not a "
                            "function of the loop axes alone")
    if strides is None:
        strides = assumed_strides(load.buffer, load.buffer.dtype.bytes)
    return layout_of(per_dim, [const_int(d) for d in load.buffer.shape], guard_vars, strides)


def _same_vars(indices: Sequence[Expr], vars_: Sequence[Var]) -> bool:
    return len(indices) == len(vars_) and all(isinstance(a, Var) and a.name == b.name for a, b in zip(indices, vars_))


def _strip_cast(e: Expr) -> Expr:
    return e.a if isinstance(e, Cast) and e.dtype == dt.float32 else e


def _is_zero(e: Expr) -> bool:
    e = _strip_cast(e)
    return isinstance(e, Const) and float(e.value) == 0.0


def _multiplicands(where: str, term: Expr, operand_dtypes: Sequence[dt.DType] = HALF_OPERANDS
                   ) -> tuple[tuple[BufferLoad, Expr | None], tuple[BufferLoad, Expr | None]]:
    """The two half loads (and their where() conditions) of `float32(A * B)` or `float32(A) * float32(B)`."""
    term = _strip_cast(term)
    if not (isinstance(term, Binary) and term.op == "*"):
        raise ScheduleError(f"{where}: the summed term must be a product of two operands, got {term}")
    out = []
    for side in (term.a, term.b):
        side = _strip_cast(side)
        guard = None
        if isinstance(side, Select) and _is_zero(side.b):
            guard, side = side.cond, _strip_cast(side.a)
        if not isinstance(side, BufferLoad) or side.buffer.scope != "global":
            raise ScheduleError(f"{where}: multiplicand {side} is not a read of an input (fold scales into the "
                                "epilogue; casts to float32 and where(condition, read, 0) are allowed)")
        if side.buffer.dtype not in operand_dtypes:
            if side.buffer.dtype in dt.FP8_DTYPES:
                raise ScheduleError(f"{where}: operand {side.buffer.name} is {side.buffer.dtype}; fp8 contractions run "
                                    "only on Hopper's wgmma (sm_90, intrinsic='wgmma', both operands k-contiguous)")
            if tuple(operand_dtypes) in (HALF_OPERANDS, TENSOR_CORE_OPERANDS):
                raise ScheduleError(f"{where}: operand {side.buffer.name} is {side.buffer.dtype}; tensor-core "
                                    "mma needs float16 or bfloat16 operands (or float32 ones rounded to tf32)")
            raise ScheduleError(f"{where}: operand {side.buffer.name} is {side.buffer.dtype}; this kernel takes "
                                f"{' or '.join(map(str, operand_dtypes))} operands")
        out.append((side, guard))
    return out[0], out[1]


__all__ = ["HALF_OPERANDS", "TENSOR_CORE_OPERANDS", "WGMMA_OPERANDS",
           "Axis", "Contraction", "Layout", "Operand", "Stride", "assumed_strides", "run_time_stride", "contiguous_copy", "gemm_order",
           "layout_of", "match_contraction", "operand_layout", "order_by_stride", "stride_condition", "transposed_operand", "unflatten",
           "unit_strides"]
