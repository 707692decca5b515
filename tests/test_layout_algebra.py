"""The laws of tecc's layout algebra (tecc.ir.layout), checked on generated layouts.

A layout is a function; each operation is specified by what it computes, so each law compares an
operation's result with the nested evaluation it stands for, at every coordinate: composition is
`a(b(i))`, coalescing keeps the function, products and divisions evaluate as the layouts they
combine, a swizzle is a bijection (its own inverse) on its blocks, and the three evaluators
(Python ints, NumPy arrays for the emulator, index Exprs for codegen) agree.
Extents and strides are powers of two where an operation needs divisibility (composition,
complement), as every tile in a kernel is.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tecc.ir import dtype as dt
from tecc.ir.evaluate import evaluate_int
from tecc.ir.expr import Var
from tecc.ir.intrinsics import TABLE
from tecc.ir.layout import (
    Coord,
    Layout,
    LayoutError,
    Swizzle,
    SwizzledLayout,
    blocked_product,
    coalesce,
    complement,
    compose,
    coordinates,
    divide,
    partition,
    product,
    row_major,
    tile_divide,
)

pow2 = st.sampled_from([1, 2, 4, 8])
stride = st.integers(0, 40)


def _shape_size(shape: Any) -> int:
    return shape if isinstance(shape, int) else int(np.prod([_shape_size(s) for s in shape]))


@st.composite
def _nested(draw: Any, extent: Any, depth: int) -> Any:
    if depth == 0 or draw(st.booleans()):
        return draw(extent)
    return tuple(draw(_nested(extent, depth - 1)) for _ in range(draw(st.integers(1, 3))))


def shapes(extent: Any = st.integers(1, 5)) -> Any:
    """A flat or nested shape of 1..3 modes, at most 256 coordinates (every law is checked at each)."""
    return _nested(extent, 2).filter(lambda s: _shape_size(s) <= 256)


def _strides_like(draw: Any, shape: Any, leaf: Any) -> Any:
    if isinstance(shape, tuple):
        return tuple(_strides_like(draw, s, leaf) for s in shape)
    return draw(leaf)


@st.composite
def layouts(draw: Any, extent: Any = st.integers(1, 5), strides: Any = stride) -> Layout:
    shape = draw(shapes(extent))
    return Layout(shape, _strides_like(draw, shape, strides))


@st.composite
def pow2_layouts(draw: Any) -> Layout:
    """Power-of-two extents and strides: composition with these is always defined."""
    return draw(layouts(pow2, st.sampled_from([0, 1, 2, 4, 8, 16, 32])))


@st.composite
def compact_layouts(draw: Any) -> Layout:
    """A compact layout (a bijection onto [0, size)) of power-of-two extents, modes in any order."""
    extents = draw(st.lists(pow2, min_size=1, max_size=3))
    order = draw(st.permutations(range(len(extents))))
    strides = [0] * len(extents)
    span = 1
    for k in reversed(order):  # the last of `order` is the fastest
        strides[k] = span
        span *= extents[k]
    return Layout(tuple(extents), tuple(strides))


def values(layout: Any) -> list[Any]:
    return [layout(i) for i in range(layout.size)]


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_coalesce_keeps_the_function(a: Layout) -> None:
    c = coalesce(a)
    assert values(c) == values(a), f"{a} coalesced to {c}"
    assert len(c.leaves()) <= len(a.leaves())


@settings(max_examples=150, deadline=None)
@given(pow2_layouts(), pow2_layouts())
def test_composition_evaluates_as_the_nested_function(a: Layout, b: Layout) -> None:
    try:
        r = compose(a, b)
    except LayoutError as err:
        # refused only when b's leaves really carry across a mode boundary of a
        assert "overlap" in str(err)
        return
    assert [r(i) for i in range(b.size)] == [a(b(i)) for i in range(b.size)], f"compose({a}, {b}) = {r}"


@settings(max_examples=100, deadline=None)
@given(pow2_layouts(), pow2_layouts(), pow2_layouts())
def test_composition_is_associative(a: Layout, b: Layout, c: Layout) -> None:
    assume(max(values(c)) < b.size)  # c's values index b's domain (past it, (a o b) continues on its own)
    try:
        left, right = compose(compose(a, b), c), compose(a, compose(b, c))
    except LayoutError:
        return  # an inner composition is refused (overlapping modes): nothing to compare
    assert [left(i) for i in range(c.size)] == [right(i) for i in range(c.size)] == [a(b(c(i))) for i in range(c.size)]


def test_composition_refuses_strides_that_cut_a_mode_and_modes_that_carry() -> None:
    with pytest.raises(LayoutError, match="does not divide"):
        compose(Layout((4, 6), (7, 1)), Layout(3, 4))
    with pytest.raises(LayoutError, match="overlap"):  # 1 + 1 carries out of a's inner mode of 2
        compose(Layout((4, 2), (16, 1)), Layout((2, 2), (1, 1)))
    # where a keeps its stride across the sum, overlapping modes compose fine
    r = compose(Layout(8, 1), Layout((2, 2), (1, 1)))
    assert [r(i) for i in range(4)] == [0, 1, 1, 2]


@settings(max_examples=150, deadline=None)
@given(pow2_layouts(), pow2_layouts())
def test_composition_is_refused_only_when_it_is_not_the_nested_function(a: Layout, b: Layout) -> None:
    try:
        compose(a, b)
    except LayoutError:
        # then no layout of b's leaf structure can be a(b(i)) leaf by leaf: some sum carries
        per_leaf = [compose(a, Layout(n, d)) for n, d in b.leaves()]
        coords = [[leaf(j) for j in range(n)] for leaf, (n, _) in zip(per_leaf, b.leaves())]
        sums = {tuple(c): sum(v) for c, v in zip(itertools.product(*[range(n) for n, _ in b.leaves()]),
                                                 itertools.product(*coords))}
        nested = {c: a(sum(j * d for j, (_, d) in zip(c, b.leaves()))) for c in sums}
        assert sums != nested


@settings(max_examples=100, deadline=None)
@given(compact_layouts(), st.data())
def test_complement_fills_what_a_sub_layout_leaves(full: Layout, data: Any) -> None:
    leaves = full.leaves()
    keep = data.draw(st.lists(st.sampled_from(range(len(leaves))), min_size=1, unique=True))
    a = Layout(tuple(leaves[k][0] for k in keep), tuple(leaves[k][1] for k in keep))
    rest = complement(a, full.size)
    both = Layout((rest.shape, a.shape), (rest.stride, a.stride))
    assert sorted(values(both)) == list(range(full.size)), f"complement({a}, {full.size}) = {rest}"


@settings(max_examples=100, deadline=None)
@given(compact_layouts(), compact_layouts())
def test_product_repeats_the_tile_as_the_second_layout_says(a: Layout, b: Layout) -> None:
    p = product(a, b)
    rest = complement(a, a.size * b.cosize)
    for copy, element in itertools.product(range(b.size), range(a.size)):
        assert p(copy, element) == a(element) + rest(b(copy))
    assert sorted(values(p)) == list(range(a.size * b.size))  # compact tiles, compact copies: a bijection


def test_blocked_product_makes_the_matrix_of_tiles() -> None:
    tile, grid = row_major((2, 4)), row_major((3, 2))
    m = blocked_product(tile, grid)
    for gr, r, gc, c in itertools.product(range(3), range(2), range(2), range(4)):
        # tiles are contiguous, in the grid's row-major order; inside a tile, row-major
        assert m((gr, r), (gc, c)) == (gr * 2 + gc) * 8 + r * 4 + c


@settings(max_examples=100, deadline=None)
@given(pow2_layouts(), compact_layouts())
def test_divide_evaluates_as_the_tiler_inside_the_layout(a: Layout, tiler: Layout) -> None:
    try:
        d = divide(a, tiler)
        rest = complement(tiler, a.size)
    except LayoutError:
        return  # the tiler's span does not divide a's modes: refused, nothing to check
    for t, e in itertools.product(range(rest.size), range(tiler.size)):
        assert d(t, e) == a(rest(t) + tiler(e))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_tile_divide_splits_each_dimension(rows: int, cols: int, tr: int, tc: int) -> None:
    a = row_major((rows * tr, cols * tc))
    d = tile_divide(a, (tr, tc))
    for i, j in itertools.product(range(rows * tr), range(cols * tc)):
        assert d((i // tr, j // tc), (i % tr, j % tc)) == a(i, j)


@pytest.mark.parametrize("shape,threads,vector", [((64, 32), 128, 8), ((16, 64), 32, 4), ((8, 8), 64, 1),
                                                  ((128, 64), 256, 8), ((4, 4, 8), 16, 2)])
def test_partition_is_the_round_robin_split_of_the_tile(shape: tuple[int, ...], threads: int, vector: int) -> None:
    p = partition(shape, threads, vector)
    per_thread = int(np.prod(shape)) // (threads * vector)
    seen = set()
    for tx, u, v in itertools.product(range(threads), range(per_thread), range(vector)):
        at = p(tx, (u, v))
        flat = ((u * threads + tx) * vector) + v
        assert at == tuple(int(x) for x in np.unravel_index(flat, shape)), (tx, u, v, at)
        seen.add(at)
    assert len(seen) == int(np.prod(shape))
    with pytest.raises(LayoutError, match="cover it evenly"):
        partition(shape, threads * 3, vector)


def test_partition_gives_copy_loop_indices_as_exprs() -> None:
    tx, u = Var("tx"), Var("u")
    row, col = partition((64, 32), 128, 8)(tx, (u, 0))
    assert (str(row), str(col)) == ("tx // 4 + u * 32", "tx % 4 * 8")


def test_partition_of_a_swizzled_tile_gives_its_physical_offsets() -> None:
    swizzle = Swizzle(3, 3, 3)
    tile = compose(swizzle, row_major((64, 64)))
    p, coords = partition(tile, 128, 8), partition((64, 64), 128, 8)
    assert isinstance(p, SwizzledLayout)
    for tx, u, v in itertools.product(range(0, 128, 7), range(4), range(8)):
        r, c = coords(tx, (u, v))
        assert p(tx, (u, v)) == swizzle.apply(r * 64 + c)
    tx_, u_ = Var("tx"), Var("u")
    assert str(p(tx_, (u_, 0))) == "tx * 8 + u * 1024 ^ (tx * 8 + u * 1024) // 64 % 8 * 8"


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(1, 3))
def test_swizzle_is_a_bijection_and_its_own_inverse_on_whole_periods(bits: int, base: int, extra: int,
                                                                      periods: int) -> None:
    s = Swizzle(bits, base, bits + extra)
    n = s.period * periods
    image = s.apply(np.arange(n))
    assert sorted(image.tolist()) == list(range(n))
    assert (s.apply(image) == np.arange(n)).all()
    for block in range(periods):  # each period block onto itself
        assert set(image[block * s.period:(block + 1) * s.period].tolist()) == set(
            range(block * s.period, (block + 1) * s.period))


@settings(max_examples=100, deadline=None)
@given(pow2_layouts(), pow2_layouts(), st.integers(0, 3), st.integers(0, 3))
def test_a_swizzle_composes_with_layouts_associatively(a: Layout, b: Layout, bits: int, base: int) -> None:
    s = Swizzle(bits, base, 3)
    sa = compose(s, a)
    assert isinstance(sa, SwizzledLayout)
    assert [sa(i) for i in range(a.size)] == [s.apply(a(i)) for i in range(a.size)]
    try:
        left = compose(sa, b)
    except LayoutError:
        return  # b's modes overlap in a: refused as for a plain layout
    assert [left(i) for i in range(b.size)] == [s.apply(a(b(i))) for i in range(b.size)]


def _expr_value(value: Any, env: dict[Var, int]) -> Any:
    if isinstance(value, tuple):
        return tuple(_expr_value(v, env) for v in value)
    return value if isinstance(value, int) else evaluate_int(value, env)


@settings(max_examples=100, deadline=None)
@given(layouts(), st.data())
def test_int_numpy_and_expr_evaluations_agree(a: Layout, data: Any) -> None:
    i = Var("i", dt.int32)
    symbolic = a(i)
    vectorized = np.broadcast_to(a(np.arange(a.size)), (a.size,))
    for k in range(a.size):
        assert a(k) == vectorized[k] == _expr_value(symbolic, {i: k})
    # a coordinate per top-level mode, as codegen passes (lane, element)
    if a.rank > 1:
        x = tuple(Var(f"x{m}", dt.int32) for m in range(a.rank))
        point = tuple(data.draw(st.integers(0, a[m].size - 1)) for m in range(a.rank))
        assert _expr_value(a(*x), dict(zip(x, point))) == a(*point)


@settings(max_examples=100, deadline=None)
@given(shapes(st.integers(1, 4)))
def test_coordinate_layouts_give_each_dimension(shape: Any) -> None:
    flat = shape if isinstance(shape, tuple) else (shape,)
    flat = tuple(s if isinstance(s, int) else int(np.prod(s)) for s in flat)
    c = coordinates(flat)
    for k in range(c.size):
        assert c(k) == tuple(int(x) for x in np.unravel_index(k, flat))


@pytest.mark.parametrize("name,role", [(name, op.role) for name, row in TABLE.items() for op in row.operands])
def test_fragment_layouts_take_ints_arrays_and_exprs(name: str, role: str) -> None:
    op = TABLE[name].operand(role)
    threads = TABLE[name].threads
    lane, e = Var("lane", dt.int32), Var("e", dt.int32)
    rows, cols = op.layout(lane, e)
    grid = op.layout(np.arange(threads)[:, None], np.arange(op.elements)[None, :])
    for t, k in itertools.product(range(0, threads, 5), range(op.elements)):
        want = op.layout(t, k)
        assert (evaluate_int(rows, {lane: t, e: k}), evaluate_int(cols, {lane: t, e: k})) == want
        assert tuple(int(np.broadcast_to(g, (threads, op.elements))[t, k]) for g in grid) == want


def test_layouts_print_as_shape_and_stride() -> None:
    assert str(Layout((4, (2, 8)), (16, (8, 1)))) == "(4, (2, 8)):(16, (8, 1))"
    assert str(Layout((8, 4), (Coord(1, 0), Coord(0, 2)))) == "(8, 4):([1, 0], [0, 2])"
    assert str(compose(Swizzle(3, 3, 3), row_major((64, 64)))) == "swizzle(3, 3, 3) o ((64, 64):(64, 1))"


def test_malformed_layouts_are_refused() -> None:
    with pytest.raises(LayoutError, match="nesting"):
        Layout((4, 8), 1)
    with pytest.raises(LayoutError, match="positive"):
        Layout((4, 0), (1, 1))
    with pytest.raises(LayoutError, match="all be ints or all Coords"):
        Layout((4, 8), (Coord(1, 0), 1))
