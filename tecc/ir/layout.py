"""Layouts: functions from coordinates to offsets, built from shapes and strides, and their algebra.

Where an element lives is a function of its coordinate: a row-major tile sends (r, c) to r * 64 + c,
a ring stage adds whole tiles, an mma fragment sends (lane, register element) to a (row, col) of the
operand's tile, a copy loop sends (thread, iteration) to the tile element the thread moves, a TMA
box sends an element index to its coordinates in the tensor. tecc writes all of them as one kind
of object (the idea CuTe made standard, in tecc's own formulation), so that they can be composed,
multiplied, divided and swizzled instead of each being hand-written index arithmetic, and so that
codegen (on index Exprs) and the emulator (on NumPy arrays) evaluate the very same objects.

**A layout** is a shape and a stride of the same nesting (`Layout((4, 8), (8, 1))`; a mode may be
a tuple of sub-modes: `Layout(((2, 4), 8), ((32, 8), 1))`). Its value at a coordinate, one
integer per leaf mode, is the sum of coordinate times stride. tecc's conventions:
- modes are listed outermost first, as tecc's buffer shapes are;
- a single integer `i` (an *index*) stands for the coordinate that enumerates the shape in
  row-major order (the last leaf fastest, like a C array): `L(i)` for `Layout((4, 8), (8, 1))` is
  `i`. A coordinate may mix the two: one index per top-level mode, each enumerating that mode's
  sub-modes in row-major order (`L(lane, element)` of a fragment);
- the outermost sub-mode of an index is not reduced modulo its extent (`i // inner`, never
  `i // inner % n`): an index past the end continues along it, which is what a hand-written
  `lane // 4` means and keeps the emitted arithmetic as short;
- a stride is an int (the layout's values are offsets) or a `Coord` (its values are coordinates
  of a tile, e.g. (row, col)), all of one kind in a layout.

Evaluation uses only `+`, `*`, `//` and `%` on non-negative values, so it works on Python ints,
NumPy integer arrays (vectorized, for the emulator) and tecc index Exprs (for codegen); strides of
0 and 1 add no term and no multiply, so the Expr reads as one would write it.

**Operations** (each is a function on layouts; the laws are tested in tests/test_layout_algebra.py):
- `coalesce(L)`: the fewest modes with the same function on indices;
- `compose(A, B)`: `A(B(i))`, a layout of B's shape (B's values index A's domain);
- `complement(A, n)`: the layout that, beside A, fills [0, n) (the other tiles of a tiling);
- `product(A, B)`: A repeated as B lays the copies out, (copy, element) -> offset;
  `blocked_product` regroups it per dimension (a grid of tiles);
- `divide(A, T)`: A split by the tiler T, (tile, element) -> offset; `tile_divide` splits each
  dimension by a tile size (which tile, element in the tile);
- `partition(tile, threads, vector)`: the split of a tile among threads, round-robin over
  `vector`-element chunks, (thread, (iteration, element)) -> (row, col, ...) or offsets;
- `Swizzle`: an XOR function on offsets; `compose(swizzle, L)` is a `SwizzledLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Sequence, Union, overload

from .errors import TeccError

IntTuple = Union[int, tuple["IntTuple", ...]]
Index = Any  # a Python int, a NumPy integer array or an integer Expr


class LayoutError(TeccError):
    """A layout's parameters are illegal, an operation is not defined on the layouts given, or a
    layout does not fit the buffer it is attached to; the message names the layouts."""


@dataclass(frozen=True)
class Coord:
    """A point of a multi-dimensional codomain, as the stride of a layout whose values are tile
    coordinates: `Coord(0, 2)` steps two columns. Adds to Coords, multiplies by ints."""

    parts: tuple[int, ...]

    def __init__(self, *parts: int) -> None:
        object.__setattr__(self, "parts", tuple(int(p) for p in parts))

    def __add__(self, other: Coord) -> Coord:
        return Coord(*(a + b for a, b in zip(self.parts, other.parts)))

    def __mul__(self, k: int) -> Coord:
        return Coord(*(a * k for a in self.parts))

    __rmul__ = __mul__

    @property
    def is_zero(self) -> bool:
        return not any(self.parts)

    def __str__(self) -> str:
        return "[" + ", ".join(str(p) for p in self.parts) + "]"


Stride = Union[int, Coord, tuple["Stride", ...]]
Leaf = Union[int, Coord]
# how an index splits into leaf coordinates (see _plan, _flat_plan)
Plan = Union[None, tuple[tuple[int, int, Any, int], ...]]
Flat = tuple[tuple[int, int, tuple[int, ...]], ...]
MEMO_ENTRIES = 1 << 16  # int evaluations a layout remembers


# ---- int tuples ----------------------------------------------------------------------------------

def size(shape: IntTuple) -> int:
    """The number of coordinates of a shape (the product of its leaves)."""
    return shape if isinstance(shape, int) else prod(size(s) for s in shape)


def flatten(t: Any) -> tuple[Any, ...]:
    """The leaves of a nested tuple, outermost first."""
    if not isinstance(t, tuple):
        return (t,)
    return tuple(leaf for x in t for leaf in flatten(x))


def _text(t: Any) -> str:
    if isinstance(t, tuple):
        return "(" + ", ".join(_text(x) for x in t) + ")"
    return str(t)


def _nest(modes: Sequence[tuple[int, Leaf]]) -> tuple[IntTuple, Stride]:
    """(shape, stride) of modes listed outermost first: one mode stays a leaf, more make a tuple."""
    if len(modes) == 1:
        return modes[0]
    return tuple(s for s, _ in modes), tuple(d for _, d in modes)


# ---- layouts -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """A function from coordinates to offsets (or tile coordinates): see the module docstring.

    `terms` (optional) is the order in which evaluation adds the leaves' terms, a permutation of
    the leaf positions (default: outermost first). It changes no value, only how an evaluated
    Expr reads, so a layout can reproduce the index arithmetic a kernel was written with; the
    operations below return layouts in the default order."""

    shape: IntTuple
    stride: Stride
    terms: tuple[int, ...] = ()
    # derived in __post_init__ for evaluation (not part of the value)
    _plan: Plan = field(init=False, repr=False, compare=False)
    _mode_plans: tuple[Plan, ...] = field(init=False, repr=False, compare=False)
    _order: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _columns: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _offset: bool = field(init=False, repr=False, compare=False)
    _flat: tuple[Flat, ...] = field(init=False, repr=False, compare=False)
    _flat_whole: Flat = field(init=False, repr=False, compare=False)
    _memo: dict[tuple[int, ...], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check(self.shape, self.stride)
        if self.terms and sorted(self.terms) != list(range(len(flatten(self.shape)))):
            raise LayoutError(f"layout {self}: terms {self.terms} must order its {len(flatten(self.shape))} leaves")
        strides = flatten(self.stride)
        kinds = {type(d) for d in strides}
        ranks = {len(d.parts) for d in strides if isinstance(d, Coord)}
        if len(kinds) > 1 or len(ranks) > 1:
            raise LayoutError(f"layout {self}: its strides must all be ints or all Coords of one rank")
        # what evaluation needs, computed once: how an index splits into leaf coordinates (the
        # whole shape's plan, and each top-level mode's), and the strides per dimension, in the
        # order the terms are added
        modes = self.shape if isinstance(self.shape, tuple) else (self.shape,)
        order = self.terms or tuple(range(len(strides)))
        columns = ([[d.parts[k] for d in strides] for k in range(len(strides[0].parts))]
                   if isinstance(strides[0], Coord) else [list(strides)])
        object.__setattr__(self, "_plan", _plan(self.shape))
        object.__setattr__(self, "_mode_plans", tuple(_plan(m) for m in modes))
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_columns", tuple(tuple(c[k] for k in order) for c in columns))
        object.__setattr__(self, "_offset", not isinstance(strides[0], Coord))
        # on Python ints, nested splits equal flat ones ((i % 32) // 4 == (i // 4) % 8): one
        # (divisor, modulus, strides per dimension) per leaf, for the fast path
        per_leaf = list(zip(*columns)) if columns else []
        flat_modes, start = [], 0
        for m in modes:
            n = len(flatten(m))
            flat_modes.append(_flat_plan(m, per_leaf[start:start + n]))
            start += n
        object.__setattr__(self, "_flat", tuple(flat_modes))
        object.__setattr__(self, "_flat_whole", _flat_plan(self.shape, per_leaf))
        object.__setattr__(self, "_memo", {})

    def _check(self, shape: Any, stride: Any) -> None:
        if isinstance(shape, tuple):
            if not isinstance(stride, tuple) or len(stride) != len(shape) or not shape:
                raise LayoutError(f"layout {_text(self.shape)}:{_text(self.stride)}: the stride must have the "
                                  "shape's nesting (one stride per mode, sub-modes alike)")
            for s, d in zip(shape, stride):
                self._check(s, d)
            return
        if isinstance(shape, bool) or not isinstance(shape, int) or shape < 1:
            raise LayoutError(f"layout {_text(self.shape)}:{_text(self.stride)}: every extent must be a "
                              f"positive int, got {shape!r}")
        if isinstance(stride, bool) or not isinstance(stride, (int, Coord)):
            raise LayoutError(f"layout {_text(self.shape)}:{_text(self.stride)}: a stride must be an int or "
                              f"a Coord, got {stride!r}")

    # ---- structure -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The number of coordinates (the domain's size)."""
        return size(self.shape)

    @property
    def rank(self) -> int:
        """The number of top-level modes."""
        return len(self.shape) if isinstance(self.shape, tuple) else 1

    def __getitem__(self, mode: int) -> Layout:
        """Top-level mode `mode` as a layout of its own."""
        if not isinstance(self.shape, tuple):
            if mode in (0, -1):
                return self
            raise LayoutError(f"layout {self} has one mode, not {mode + 1}")
        assert isinstance(self.stride, tuple)
        return Layout(self.shape[mode], self.stride[mode])

    def leaves(self) -> list[tuple[int, Leaf]]:
        """(extent, stride) of every leaf mode, outermost first."""
        return list(zip(flatten(self.shape), flatten(self.stride)))

    @property
    def is_offset(self) -> bool:
        """Whether the values are offsets (int strides) rather than coordinates."""
        return self._offset

    def offset_leaves(self, what: str) -> list[tuple[int, int]]:
        """(extent, stride) of every leaf mode of a layout of offsets; LayoutError naming `what`
        (the operation) for one of coordinates."""
        out = [(s, d) for s, d in self.leaves() if isinstance(d, int)]
        if len(out) != len(self.leaves()):
            raise LayoutError(f"{what}: the layout {self} has coordinate strides; it needs int strides")
        return out

    @property
    def cosize(self) -> int:
        """One past the largest offset (int strides, none negative): the span of memory it touches."""
        leaves = self.offset_leaves(f"cosize of {self}")
        if any(d < 0 for _, d in leaves):
            raise LayoutError(f"layout {self}: cosize needs non-negative strides")
        return 1 + sum((s - 1) * d for s, d in leaves)

    # ---- evaluation ------------------------------------------------------------------------------
    def __call__(self, *coord: Any) -> Any:
        """The value at a coordinate: one index (row-major over the whole shape), or one index or
        nested tuple per top-level mode. Offsets for int strides, a tuple (one entry per
        dimension) for Coord strides."""
        if all(type(c) is int for c in coord):
            # passes check fragment layouts at every (thread, element), several times per build
            hit = self._memo.get(coord)
            if hit is None:
                hit = self._ints(coord)
                if len(self._memo) < MEMO_ENTRIES:
                    self._memo[coord] = hit
            return hit
        leaves: list[Index] = []
        if len(coord) == 1 and not isinstance(coord[0], tuple):
            _split(coord[0], self._plan, self.shape, leaves)
        else:
            if len(coord) == 1:
                coord = coord[0]
            if len(coord) != len(self._mode_plans):
                raise LayoutError(f"layout {self}: a coordinate of {len(coord)} entries for {self.rank} modes")
            shapes = self.shape if isinstance(self.shape, tuple) else (self.shape,)
            for c, plan, s in zip(coord, self._mode_plans, shapes):
                _split(c, plan, s, leaves)
        ordered = [leaves[k] for k in self._order] if self.terms else leaves
        if self._offset:
            return _dot(ordered, self._columns[0])
        return tuple(_dot(ordered, column) for column in self._columns)

    def _ints(self, coord: tuple[int, ...]) -> Any:
        """`self(*coord)` for Python-int indices (one, or one per top-level mode)."""
        plans = (self._flat_whole,) if len(coord) == 1 else self._flat
        if len(coord) != len(plans):
            raise LayoutError(f"layout {self}: a coordinate of {len(coord)} entries for {self.rank} modes")
        out = [0] * len(self._columns)
        for c, plan in zip(coord, plans):
            for div, mod, strides in plan:
                x = c // div
                if mod:
                    x %= mod
                for k, d in enumerate(strides):
                    out[k] += x * d
        return out[0] if self._offset else tuple(out)

    def __str__(self) -> str:
        return f"{_text(self.shape)}:{_text(self.stride)}"


def _plan(shape: IntTuple) -> Plan:
    """How an index splits in `shape`: None for a leaf (the index is the coordinate), else per
    sub-mode (inner, extent, its plan, its leaves): coordinate (index // inner) % extent, the
    outermost without the modulo (extent 0)."""
    if not isinstance(shape, tuple):
        return None
    sizes = [size(s) for s in shape]
    inner = prod(sizes)
    out = []
    for k, s in enumerate(shape):
        inner //= sizes[k]
        out.append((inner, sizes[k] if k > 0 else 0, _plan(s), len(flatten(s))))
    return tuple(out)


def _flat_plan(shape: IntTuple, strides: Sequence[tuple[int, ...]]) -> Flat:
    """(divisor, modulus or 0 for none, strides) per leaf of `shape`, leaf coordinate
    (index // divisor) % modulus, the outermost unreduced."""
    leaves = flatten(shape)
    out = []
    for k, (n, d) in enumerate(zip(leaves, strides)):
        out.append((prod(leaves[k + 1:]), n if k > 0 else 0, d))
    return tuple(out)


def _split(index: Index, plan: Plan, shape: IntTuple, out: list[Index]) -> None:
    """Append the leaf coordinates of `index` (an index, or a nested tuple) in `shape` to `out`,
    outermost first; a size-1 mode inside gives 0 without arithmetic."""
    if plan is None:
        out.append(index)
        return
    if isinstance(index, tuple):
        assert isinstance(shape, tuple)
        if len(index) != len(shape):
            raise LayoutError(f"coordinate {index} does not match shape {_text(shape)}")
        for i, (_, _, sub, _), s in zip(index, plan, shape):
            _split(i, sub, s, out)
        return
    assert isinstance(shape, tuple)
    for (inner, extent, sub, leaves), s in zip(plan, shape):
        if extent == 1:
            out += [0] * leaves
            continue
        c = index if inner == 1 else index // inner
        _split(c % extent if extent else c, sub, s, out)


def _dot(coords: Sequence[Index], strides: Sequence[int]) -> Any:
    """sum(coordinate * stride), skipping strides of 0 and multiplies by 1 and adding the terms of
    int coordinates as one constant at the end."""
    total: Any = None
    constant = 0  # the terms of Python-int coordinates, added once, last
    for c, d in zip(coords, strides):
        if d == 0:
            continue
        term = c if d == 1 else c * d
        if isinstance(term, int):
            constant += term
            continue
        total = term if total is None else total + term
    if total is None:
        return constant
    return total + constant if constant else total


def row_major(shape: IntTuple) -> Layout:
    """The compact row-major layout of a shape (flat or nested): index i -> i."""
    leaves = flatten(shape)
    strides = [prod(leaves[k + 1:]) for k in range(len(leaves))]
    it = iter(strides)

    def rebuild(s: IntTuple) -> Stride:
        return tuple(rebuild(x) for x in s) if isinstance(s, tuple) else next(it)
    return Layout(shape, rebuild(shape))


def coordinates(shape: Sequence[int]) -> Layout:
    """The layout of a tile's coordinates: index i (row-major) -> (i0, i1, ...) of a tile of `shape`."""
    n = len(shape)
    units = tuple(Coord(*(1 if j == k else 0 for j in range(n))) for k in range(n))
    return Layout(tuple(shape), units)


# ---- the algebra ---------------------------------------------------------------------------------

def coalesce(layout: Layout) -> Layout:
    """The same function on [0, size) with the fewest modes: size-1 modes dropped, and a mode
    merged into the one outside it when that one's stride is exactly the inner mode's extent
    times its stride (the two then count as one)."""
    return _coalesce(layout, keep_outermost=False)


def _coalesce(layout: Layout, keep_outermost: bool) -> Layout:
    """`coalesce`; with `keep_outermost` the outermost mode stays even when its extent is 1, so
    that indices past the end still continue along it (what composition relies on). Merging
    keeps that continuation: the merged mode steps by the inner stride, as the two did."""
    modes: list[tuple[int, Leaf]] = []
    for k, (s, d) in enumerate(layout.leaves()):
        if s == 1 and not (keep_outermost and k == 0):
            continue
        if modes:
            outer_s, outer_d = modes[-1]
            if outer_d == d * s:
                modes[-1] = (outer_s * s, d)
                continue
        modes.append((s, d))
    if not modes:
        zero: Leaf = 0 if layout.is_offset else flatten(layout.stride)[0] * 0
        return Layout(1, zero)
    shape, stride = _nest(modes)
    return Layout(shape, stride)


def _compose_mode(a: Layout, n: int, d: int) -> list[tuple[int, Leaf]]:
    """A restricted to {d * j : j < n}, as modes outermost first (the leaf of B being n:d).
    Walks A's modes from the fastest: modes that d steps over whole are skipped, then modes
    are taken until n values are covered; A's outermost mode extends without bound."""
    if n == 1:
        return [(1, a.leaves()[-1][1] * 0)]
    fastest = list(reversed(_coalesce(a, keep_outermost=True).leaves()))
    if d == 0:
        return [(n, fastest[0][1] * 0)]
    out: list[tuple[int, Leaf]] = []
    rest_n, rest_d = n, d
    for k, (s, stride) in enumerate(fastest):
        if k == len(fastest) - 1:
            out.append((rest_n, stride * rest_d))
            break
        if rest_d >= s:
            if rest_d % s:
                raise LayoutError(f"compose({a}, {n}:{d}): the stride {d} does not step over mode {s} of the "
                                  "first layout a whole number of times")
            rest_d //= s
            continue
        if s % rest_d:
            raise LayoutError(f"compose({a}, {n}:{d}): the stride {d} does not divide mode {s} of the first layout")
        available = s // rest_d
        take = min(available, rest_n)
        if take == available and rest_n % available:
            raise LayoutError(f"compose({a}, {n}:{d}): {n} values do not fill mode {s} of the first layout "
                              "a whole number of times")
        out.append((take, stride * rest_d))
        rest_n //= take
        rest_d = 1
        if rest_n == 1:
            break
    return list(reversed(out))


def _check_no_carry(a: Layout, leaves: list[tuple[int, int]]) -> None:
    """LayoutError unless a(sum of b's leaf values) is the sum of a of each: composing leaf by
    leaf is exact only if no sum of b's leaf values carries across a boundary between two of a's
    (coalesced) modes, where a's stride changes. At boundary P (the span of the modes below it),
    a leaf n:d contributes at most 0 (d a multiple of P), d(n-1) (all its values below P), or
    P - d (it wraps past P); those maxima must stay below P."""
    spans = [s for s, _ in reversed(_coalesce(a, keep_outermost=True).leaves())][:-1]
    boundary = 1
    for s in spans:
        boundary *= s
        reach = 0
        for n, d in leaves:
            d = abs(d)
            if n > 1 and d % boundary:
                reach += d * (n - 1) if d * n <= boundary else boundary - d
        if reach >= boundary:
            raise LayoutError(f"compose({a}, ...): the second layout's modes overlap where the first changes stride "
                              f"(at offset {boundary}), so a(b(i)) is no layout of b's shape; tile b's modes apart")


@overload
def compose(a: Layout, b: Layout) -> Layout: ...


@overload
def compose(a: Swizzle | SwizzledLayout, b: Layout) -> SwizzledLayout: ...


def compose(a: Layout | Swizzle | SwizzledLayout, b: Layout) -> Layout | SwizzledLayout:
    """`a ∘ b`: the layout of b's shape whose value at i is a(b(i)). b's values (int strides)
    index a's domain. `a` may be a Layout, a Swizzle (giving a SwizzledLayout) or a
    SwizzledLayout (composing its layout). LayoutError when b's strides do not fit a's modes."""
    if isinstance(a, Swizzle):
        return SwizzledLayout(a, b)
    if isinstance(a, SwizzledLayout):
        return SwizzledLayout(a.swizzle, compose(a.layout, b), a.offset)
    leaves = b.offset_leaves(f"compose({a}, {b})")
    _check_no_carry(a, leaves)

    def walk(shape: IntTuple, stride: Stride) -> tuple[IntTuple, Stride]:
        if isinstance(shape, tuple):
            assert isinstance(stride, tuple)
            parts = [walk(s, d) for s, d in zip(shape, stride)]
            return tuple(p[0] for p in parts), tuple(p[1] for p in parts)
        assert isinstance(stride, int)
        return _nest(_compose_mode(a, shape, stride))
    shape, stride = walk(b.shape, b.stride)
    return Layout(shape, stride)


def complement(a: Layout, n: int) -> Layout:
    """The layout R (offsets, modes outermost first) of the offsets in [0, n) that `a` does not
    reach, as steps over a's image: every offset below the cosize is a(i) + R(j) for exactly one
    (j, i) when a is injective and its strides, sorted, each divide the next extent times stride.
    The tiles a tiler leaves over (`divide`), the copies a product makes (`product`)."""
    modes = sorted((d, s) for s, d in a.offset_leaves(f"complement({a}, {n})") if s > 1)
    out: list[tuple[int, Leaf]] = []
    current = 1
    for d, s in modes:
        if d <= 0 or d % current:
            raise LayoutError(f"complement({a}, {n}): the strides must be positive and each a multiple of "
                              "the span of the modes below it")
        if d // current > 1:
            out.append((d // current, current))
        current = s * d
    rest = -(-n // current)
    if rest > 1 or not out:
        out.append((max(rest, 1), current))
    shape, stride = _nest(list(reversed(out)))
    return Layout(shape, stride)


def _concat(outer: Layout, inner: Layout) -> Layout:
    return Layout((outer.shape, inner.shape), (outer.stride, inner.stride))


def product(a: Layout, b: Layout) -> Layout:
    """a repeated as b lays out the copies: (copy, element) -> a(element) + the offset of copy
    b(copy) in units of a's span. The first mode says which copy, so an index walks a copy's
    elements fastest."""
    rest = compose(complement(a, a.size * b.cosize), b)
    return _concat(rest, a)


def blocked_product(a: Layout, b: Layout) -> Layout:
    """`product` regrouped per dimension: a tile `a` repeated over a grid `b` of the same rank
    gives dimension k = (grid index k, index in the tile k), e.g. a row-major 4x8 tile over a 2x3
    grid is the 8x24 matrix the tiles make, coordinate ((grid row, tile row), (grid col, tile col))."""
    if a.rank != b.rank:
        raise LayoutError(f"blocked_product({a}, {b}): the tile and the grid need the same rank")
    p = product(a, b)
    rest, tile = p[0], p[1]
    modes = [_concat(rest[k], tile[k]) for k in range(a.rank)]
    return Layout(tuple(m.shape for m in modes), tuple(m.stride for m in modes))


def divide(a: Layout, tiler: Layout) -> Layout:
    """a split by `tiler` (a layout of a's indices): (tile, element) -> a(tiler(element) + the
    start of tile `tile`), the tiles being what `complement` leaves over; tile first, so an index
    walks a tile's elements fastest."""
    rest = complement(tiler, a.size)
    return compose(a, _concat(rest, tiler))


def tile_divide(a: Layout, tile: Sequence[int]) -> Layout:
    """a's dimensions split by a tile of extents `tile` (one per top-level mode, contiguous):
    ((tile index per dimension), (element index per dimension)) -> a at (t0 * tile0 + e0, ...)."""
    if len(tile) != a.rank:
        raise LayoutError(f"tile_divide({a}, {tuple(tile)}): one tile extent per mode")
    parts = [divide(a[k], Layout(t, 1)) for k, t in enumerate(tile)]
    outer = Layout(tuple(p[0].shape for p in parts), tuple(p[0].stride for p in parts))
    inner = Layout(tuple(p[1].shape for p in parts), tuple(p[1].stride for p in parts))
    return _concat(outer, inner)


def thread_values(threads: int, per_thread: int, vector: int = 1) -> Layout:
    """The round-robin split of `threads * per_thread * vector` elements: (thread, (iteration,
    element)) -> index, chunk c of `vector` elements being iteration c // threads of thread
    c % threads (what a copy loop `for u: chunk = tx + threads * u` does)."""
    return Layout((threads, (per_thread, vector)), (vector, (threads * vector, 1)))


@overload
def partition(tile: Sequence[int] | Layout, threads: int, vector: int = 1) -> Layout: ...


@overload
def partition(tile: SwizzledLayout, threads: int, vector: int = 1) -> SwizzledLayout: ...


def partition(tile: Sequence[int] | Layout | SwizzledLayout, threads: int,
              vector: int = 1) -> Layout | SwizzledLayout:
    """How `threads` threads split a tile, `vector` contiguous elements at a time, round-robin
    (`thread_values`): a layout (thread, (iteration, element)) -> what the tile gives at that
    element. `tile` is a shape (the values are then (row, col, ...) coordinates) or the tile's
    layout (offsets, swizzled or not), whose index order the chunks follow. E.g.
    `partition((64, 32), 128, 8)(tx, (u, 0))` is the (row, col) where thread tx's u-th 8-element
    copy starts, `partition(compose(Swizzle(3, 3, 3), row_major((64, 64))), 128, 8)` the same
    split as swizzled offsets."""
    layout = tile if isinstance(tile, (Layout, SwizzledLayout)) else coordinates(tuple(tile))
    n, last = layout.size, flatten(layout.shape)[-1]
    if vector < 1 or last % vector or n % (vector * threads):
        raise LayoutError(f"partition of the tile {layout}: {threads} threads of {vector}-element chunks must "
                          "cover it evenly, chunks inside rows")
    return compose(layout, thread_values(threads, n // (vector * threads), vector))


# ---- swizzles ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Swizzle:
    """XOR swizzle of element offsets: `o ^ (((o // 2^(base+shift)) % 2^bits) * 2^base)`.

    Bits [base, base+bits) of the offset (which `2^base`-element chunk within a row of chunks)
    are XOR-ed with bits [base+shift, base+shift+bits) (which row). Elements inside a chunk of
    2^base stay contiguous and in order, and every block of `period` = 2^(base+bits+shift)
    elements maps onto itself, so the swizzle is a bijection on any buffer whose size is a
    multiple of that period, and its own inverse. For 16-bit tiles with 64-element rows,
    Swizzle(3, 3, 3) makes 16-byte chunks (8 elements) the unit and XORs the chunk index (0..7)
    with the row index mod 8.

    Why: shared memory has 32 banks of 4 bytes. A warp reading one column of 16-byte chunks from a
    tile whose rows are 128 bytes apart hits the same 4 banks eight times (an 8-way conflict:
    ldmatrix reads 8 such rows per matrix); XOR-ing the chunk index with the row index spreads the
    eight rows over all 32 banks while each 16-byte chunk stays contiguous.

    A shared `Buffer` may carry one as its `layout`: every access to it (loads, stores, ldmatrix
    row addresses, cp.async and TMA destinations) goes through it, on the logical flat offset
    (indices times strides). A swizzle is a function on offsets like a layout's values, so it
    composes with layouts (`compose(swizzle, L)`, a SwizzledLayout)."""

    bits: int
    base: int
    shift: int

    def __post_init__(self) -> None:
        if self.bits < 0 or self.base < 0 or self.shift < self.bits:
            raise LayoutError(
                f"Swizzle(bits={self.bits}, base={self.base}, shift={self.shift}): need bits >= 0, base >= 0 "
                "and shift >= bits (otherwise the XOR source overlaps the bits it changes and the map is "
                "not a bijection)")

    @property
    def period(self) -> int:
        """Elements in one block that the swizzle permutes within itself."""
        return 1 << (self.base + self.bits + self.shift)

    @property
    def contiguous(self) -> int:
        """Elements that stay contiguous and in order (one chunk)."""
        return 1 << self.base

    def moves_whole_periods(self, stride: int) -> bool:
        """Whether a term `i * stride` of an offset moves it by whole periods, so that
        `apply(x + i * stride) == apply(x) + i * stride` for every x >= 0: the swizzle reads and
        changes only the offset's bits below the period, which adding a multiple of the period
        leaves as they are. Codegen keeps such terms (the stage of a ring, say) outside the XOR,
        where they do not make the swizzle of the rest depend on the loop that advances them."""
        return stride % self.period == 0

    def apply(self, offset: Index) -> Index:
        """The physical offset of logical offset(s) `offset` (int, NumPy array or Expr)."""
        if self.bits == 0:
            return offset
        row = (offset // (1 << (self.base + self.shift))) % (1 << self.bits)
        return offset ^ (row * (1 << self.base))

    __call__ = apply

    def check_fits(self, buffer_name: str, elements: int) -> None:
        """LayoutError unless a buffer of `elements` elements is a whole number of periods."""
        if elements % self.period:
            raise LayoutError(
                f"shared buffer {buffer_name}: {self} permutes blocks of {self.period} elements but the buffer "
                f"holds {elements}; pad it to a multiple of {self.period} or use fewer swizzle bits")

    def __str__(self) -> str:
        return f"swizzle({self.bits}, {self.base}, {self.shift})"


@dataclass(frozen=True)
class SwizzledLayout:
    """`swizzle(offset + layout(coordinate))`: a layout whose offsets a swizzle then permutes, as
    a swizzled shared tile places its elements (`offset`: where the tile starts in the buffer,
    before the swizzle). Evaluates like a Layout; `compose(SwizzledLayout, L)` composes the inner
    layout, so composition stays associative."""

    swizzle: Swizzle
    layout: Layout
    offset: int = 0

    def __post_init__(self) -> None:
        if not self.layout.is_offset:
            raise LayoutError(f"{self.swizzle} of {self.layout}: a swizzle permutes offsets, not coordinates")

    @property
    def shape(self) -> IntTuple:
        return self.layout.shape

    @property
    def size(self) -> int:
        return self.layout.size

    def __call__(self, *coord: Any) -> Any:
        inner = self.layout(*coord)
        return self.swizzle.apply(inner + self.offset if self.offset else inner)

    def __str__(self) -> str:
        start = f"{self.offset} + " if self.offset else ""
        return f"{self.swizzle} o ({start}{self.layout})"
