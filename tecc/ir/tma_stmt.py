"""TMA tile copies of the loop-nest IR (sm_90): a box of a global tensor copied into shared
memory by the Tensor Memory Accelerator, described by a tensor map.

Part of tecc.ir.stmt (which re-exports every name here); this module is their reference manual.

**A tensor map** (`TensorMap`) describes how the TMA unit sees one global buffer of the kernel:
its rank, element type, the size of the box one copy moves, and the shared-memory swizzle the
copy writes. Its global part (the base address, every dimension and every stride) is *not* in
the IR: the host encodes it at each launch from the argument it binds to the buffer
(cuTensorMapEncodeTiled, `tecc.runtime.tensor_map`), so one compiled kernel serves every shape
of a symbolic dimension. The encoded map (a 128-byte, 64-byte-aligned `CUtensorMap`) reaches the
kernel as a `const __grid_constant__` by-value parameter after the kernel's ordinary
parameters, in the order `tensor_maps(func)` lists them (first use in the body).

Requirements the map checks (PTX ISA / CUDA driver API, cuTensorMapEncodeTiled): rank 1..5;
the innermost dimension is contiguous (unit stride), every other stride a multiple of 16 bytes
(checked by the host at launch, since strides may be symbolic); box sizes 1..256 elements per
dimension, the box's innermost extent a multiple of 16 bytes; with the 128-byte swizzle the
innermost extent is at most 128 bytes.

**Merged dimensions** (`merge`): a map may see runs of consecutive dimensions of the buffer as
one dimension each (`merge` gives how many buffer dimensions each map dimension spans, outermost
first): the run's extents multiplied, its innermost stride. That is the same addressing exactly
when the run's strides chain, stride[d] == extent[d + 1] · stride[d + 1] (a row-major buffer's
always do; constant strides are checked here, run-time ones when the map is encoded), and it is
how a GEMM reads an operand viewed from a tensor of higher rank (x.view(B·T, C) of a contiguous
[B, T, C]: the map is [B·T, C], so a box of rows crosses the T boundary as one box). The copy's
coordinates are the map's (one per map dimension: a merged dimension's is the flat index).

**A tensor copy** (`TensorCopy`, cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::
complete_tx::bytes) copies the box whose first element sits at global coordinates `coords` (one
per dimension, outermost first as everywhere in tecc; they may be negative or run past the end)
into shared memory at `dst[dst_indices]`, the box's elements in row-major order from there, as
the destination buffer's layout places them. Elements outside the tensor arrive as zeros. The
copy is asynchronous (the async proxy): when all of the box has landed, its full byte count
(`bytes`, out-of-bounds elements included) completes as transactions on `bar`, so the thread
that expects the bytes announces exactly `bytes` with `BarrierExpectTx`. The destination may
be read only after a `BarrierWait` on the phase it completes. Issued by one thread.

The swizzle: "128B" is the hardware's XOR of byte-address bits [4, 7) with bits [7, 10), which
is tecc's `Swizzle(3, log2(16 / element bytes), 3)` on element offsets when the destination
starts at a multiple of 1024 bytes (codegen aligns such buffers); the destination must carry
that layout. "none" writes the box densely and the destination has no layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

from .errors import DTypeError
from .expr import Expr, const_int, index_expr
from .intrinsics import IntrinsicError
from .layout import Layout, Swizzle, coordinates, row_major
from .mbarrier_stmt import MAX_TX_BYTES, BarrierRef
from .stmt_nodes import Buffer, PrimFunc, Stmt, iter_stmts

TMA_SWIZZLES = ("none", "128B")
MAX_BOX = 256          # elements per box dimension (cuTensorMapEncodeTiled: boxDim[i] <= 256)
MAX_RANK = 5
TMA_ALIGN = 16         # bytes: box innermost extent, global strides, global base address
SWIZZLE_BYTES = {"128B": 128}
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap); alignment 64


def swizzle_layout(swizzle: str, element_bytes: int) -> Swizzle | None:
    """tecc's element-offset layout of a TMA swizzle mode for elements of `element_bytes`."""
    if swizzle == "none":
        return None
    base = {1: 4, 2: 3, 4: 2, 8: 1}[element_bytes]
    return Swizzle(3, base, 3)


@dataclass(frozen=True, eq=False)
class TensorMap:
    """How the TMA unit sees global buffer `buffer` (a parameter of the kernel): boxes of
    `box` elements (one size per dimension, outermost first) written with `swizzle`."""

    buffer: Buffer
    box: tuple[int, ...]
    swizzle: str = "none"
    merge: tuple[int, ...] = ()   # buffer dimensions per map dimension (module docstring); (): one each

    def __post_init__(self) -> None:
        object.__setattr__(self, "box", tuple(self.box))
        object.__setattr__(self, "merge", tuple(self.merge))
        b = self.buffer
        where = f"tensor map of {b.name}"
        if b.scope != "global":
            raise IntrinsicError(f"{where}: TMA copies from a global buffer, not a {b.scope} one")
        if self.merge and (sum(self.merge) != b.ndim or min(self.merge) < 1):
            raise IntrinsicError(f"{where}: merge {self.merge} does not cover the {b.ndim} dimensions of the buffer "
                                 "with runs of at least one")
        if not 1 <= self.rank <= MAX_RANK or len(self.box) != self.rank:
            raise IntrinsicError(f"{where}: a box of {len(self.box)} sizes for a {self.rank}-dimensional map; TMA takes "
                                 f"rank 1..{MAX_RANK} with one box size per dimension")
        if self.swizzle not in TMA_SWIZZLES:
            raise IntrinsicError(f"{where}: swizzle {self.swizzle!r} is not one of {TMA_SWIZZLES}")
        if b.dtype.bytes not in (1, 2, 4, 8):
            raise DTypeError(f"{where}: TMA copies 1, 2, 4 or 8-byte elements, not {b.dtype}")
        for n in self.box:
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BOX:
                raise IntrinsicError(f"{where}: box sizes must be integers in [1, {MAX_BOX}], got {self.box}")
        inner = self.box[-1] * b.dtype.bytes
        if inner % TMA_ALIGN:
            raise IntrinsicError(f"{where}: the box's innermost extent is {inner} bytes; TMA needs a multiple of "
                                 f"{TMA_ALIGN}")
        limit = SWIZZLE_BYTES.get(self.swizzle)
        if limit is not None and inner > limit:
            raise IntrinsicError(f"{where}: with the {self.swizzle} swizzle the box's innermost extent may be at most "
                                 f"{limit} bytes, got {inner}")
        if b.strides is not None and len(b.strides) and str(b.strides[-1]) != "1":
            raise IntrinsicError(f"{where}: TMA needs a contiguous innermost dimension, the buffer's stride is "
                                 f"{b.strides[-1]}")
        if b.strides is not None and self.merge:   # constant strides are checked here, others at encoding
            shape, strides = [const_int(x) for x in b.shape], [const_int(x) for x in b.strides]
            d = unchained(self.spans, shape, strides)
            if d is not None and None not in (shape[d + 1], strides[d], strides[d + 1]):
                raise IntrinsicError(f"{where}: merges dimensions {d} and {d + 1}, whose strides {b.strides[d]} and "
                                     f"{b.strides[d + 1]} do not chain (stride[d] == extent[d + 1] * stride[d + 1])")

    @property
    def spans(self) -> tuple[int, ...]:
        """Buffer dimensions per map dimension, outermost first (1 each without a merge)."""
        return self.merge or (1,) * self.buffer.ndim

    @property
    def rank(self) -> int:
        """The map's dimensions (the coordinates of a copy)."""
        return len(self.spans)

    @property
    def name(self) -> str:
        """The kernel parameter's name."""
        return f"{self.buffer.name}_tmap"

    @property
    def bytes(self) -> int:
        """Bytes one copy moves (and completes on its mbarrier), out-of-bounds elements included."""
        return prod(self.box) * self.buffer.dtype.bytes

    @property
    def layout(self) -> Swizzle | None:
        """The swizzle the copies write with, which the shared buffer must carry."""
        return swizzle_layout(self.swizzle, self.buffer.dtype.bytes)

    @property
    def box_coordinates(self) -> Layout:
        """The box as a layout: element index k (row-major) -> its coordinates in the box, which
        added to a copy's `coords` are where in the tensor element k comes from."""
        return coordinates(self.box)

    @property
    def box_layout(self) -> Layout:
        """Box coordinates -> element offset from the shared destination's start, before the
        buffer's swizzle: the box lands densely, in row-major order."""
        return row_major(self.box)

    def __str__(self) -> str:
        merged = f", merge {'+'.join(str(n) for n in self.merge)}" if any(n > 1 for n in self.merge) else ""
        return f"{self.name}(box {'x'.join(str(n) for n in self.box)}, swizzle {self.swizzle}{merged})"

    def check_transfer(self, where: str, shared: Buffer, indices: tuple[Expr, ...], coords: tuple[Expr, ...],
                       into_shared: bool) -> None:
        """IntrinsicError / DTypeError unless a box of this map can move between the tensor's
        coordinates `coords` and `shared[indices]..` (into shared memory: TensorCopy; out of
        it: TensorStore): the shared end in shared memory, of the tensor's dtype, indexed in
        each of its dimensions, laid out as this map's swizzle writes; a coordinate per
        dimension of the tensor."""
        if shared.scope != "shared":
            verb = "copies into" if into_shared else "stores from"
            raise IntrinsicError(f"{where}: {verb} shared memory, not {shared.scope}")
        if shared.dtype != self.buffer.dtype:
            src, dst = (self.buffer, shared) if into_shared else (shared, self.buffer)
            raise DTypeError(f"{where}: source is {src.dtype}, destination {dst.dtype}")
        if len(indices) != shared.ndim:
            raise IntrinsicError(f"{where}: {len(indices)} indices for the {shared.ndim} dimensions of {shared.name}")
        if len(coords) != self.rank:
            raise IntrinsicError(f"{where}: {len(coords)} coordinates for the {self.rank}-dimensional tensor map")
        if shared.layout != self.layout:
            role = "destination" if into_shared else "source"
            raise IntrinsicError(f"{where}: the {role}'s layout {shared.layout} is not the {self.swizzle} "
                                 f"swizzle's {self.layout}; give the shared buffer that layout")


@dataclass(frozen=True, eq=False)
class TensorCopy(Stmt):
    """cp.async.bulk.tensor: the box of `map` at global coordinates `coords` into
    `dst[dst_indices]..`, completing `map.bytes` transactions on `bar` (module docstring)."""

    dst: Buffer
    dst_indices: tuple[Expr, ...]
    map: TensorMap
    coords: tuple[Expr, ...]
    bar: BarrierRef

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst_indices", tuple(index_expr(i) for i in self.dst_indices))
        object.__setattr__(self, "coords", tuple(index_expr(i) for i in self.coords))
        m = self.map
        where = f"TMA copy {m.buffer.name} -> {self.dst.name}"
        m.check_transfer(where, self.dst, self.dst_indices, self.coords, into_shared=True)
        if m.bytes > MAX_TX_BYTES:
            raise IntrinsicError(f"{where}: a box of {m.bytes} bytes exceeds the mbarrier's transaction count")

    @property
    def bytes(self) -> int:
        return self.map.bytes


@dataclass(frozen=True, eq=False)
class TensorStore(Stmt):
    """cp.async.bulk.tensor (shared -> global): the box of `map` at global coordinates `coords`
    from `src[src_indices]..`, clipped at the tensor's edges, in the issuing thread's open bulk
    group (module docstring)."""

    src: Buffer
    src_indices: tuple[Expr, ...]
    map: TensorMap
    coords: tuple[Expr, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "src_indices", tuple(index_expr(i) for i in self.src_indices))
        object.__setattr__(self, "coords", tuple(index_expr(i) for i in self.coords))
        m = self.map
        where = f"TMA store {self.src.name} -> {m.buffer.name}"
        m.check_transfer(where, self.src, self.src_indices, self.coords, into_shared=False)

    @property
    def bytes(self) -> int:
        return self.map.bytes


def tensor_maps(func: PrimFunc) -> tuple[TensorMap, ...]:
    """The tensor maps `func`'s TMA copies and stores use, in order of first use: the kernel's by-value
    parameters after its ordinary ones. Each map's buffer must be one of `func`'s parameters."""
    seen: dict[int, TensorMap] = {}
    for s in iter_stmts(func.body):
        if isinstance(s, (TensorCopy, TensorStore)) and id(s.map) not in seen:
            if not any(p is s.map.buffer for p in func.params):
                raise IntrinsicError(f"kernel {func.name}: the tensor map of {s.map.buffer.name} describes a buffer "
                                     "that is not a parameter of the kernel")
            seen[id(s.map)] = s.map
    names = [m.name for m in seen.values()]
    if len(set(names)) != len(names):
        raise IntrinsicError(f"kernel {func.name}: two tensor maps of one buffer ({names}); use one map per buffer")
    return tuple(seen.values())


def unchained(spans: Sequence[int], shape: Sequence[int | None], strides: Sequence[int | None]) -> int | None:
    """The first dimension d that `spans` merges with d + 1 (TensorMap.merge) although stride[d]
    is not shape[d + 1] · stride[d + 1] (or one of them is unknown: None), or None when every
    merged run chains."""
    d = 0
    for n in spans:
        for e in range(d, d + n - 1):
            outer, size, inner = strides[e], shape[e + 1], strides[e + 1]
            if outer is None or size is None or inner is None or outer != size * inner:
                return e
        d += n
    return None


def merged_geometry(spans: Sequence[int], shape: Sequence[int], strides: Sequence[int]
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The map's dimensions and strides (elements, outermost first) of an array of `shape` and
    `strides` whose runs of `spans` dimensions are merged (their strides chain: `unchained`)."""
    dims: list[int] = []
    out: list[int] = []
    d = 0
    for n in spans:
        dims.append(prod(shape[d:d + n]))
        out.append(strides[d + n - 1])
        d += n
    return tuple(dims), tuple(out)
