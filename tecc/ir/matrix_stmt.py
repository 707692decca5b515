"""The matrix-fragment statements of the loop-nest IR: mma, ldmatrix and cp.async.

Part of tecc.ir.stmt (which re-exports every name here); this module is their reference manual.

**Warp-collective.** `MatrixMultiply` and `MatrixLoad` are executed by a whole warp together:
all 32 lanes of the warp must reach the statement (never under a lane-dependent condition),
each lane contributing its fragment registers (and, for ldmatrix, a row address). What a lane
holds is fixed by the intrinsic-table row the statement names (tecc.ir.intrinsics). Fragment
offsets are element offsets into per-lane `fragment` buffers and must be the same in every
lane of the warp (constants after unrolling, in practice).

**Asynchronous copies.** `AsyncCopy` starts a copy global -> shared that lands later; the
issuing thread's copies since its last `AsyncCommit` form one group at that commit;
`AsyncWait(n)` blocks the thread until at most its `n` most recent groups are still in flight.
Only then may the *issuing* thread read the destination; other threads of the block need a
`Barrier` after the wait as well (cp.async data is made visible to the block by the barrier).
Reading a destination before the wait that covers it is a race; so is leaving a copy
uncommitted or unwaited when the kernel ends. (`AsyncCommit` and `AsyncWait` are instructions,
rows of tecc.ir.instructions.)
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import DTypeError
from .expr import Expr, const_int, index_expr
from .intrinsics import FragmentOperand, IntrinsicError, MatrixIntrinsic, lookup
from .stmt_nodes import Buffer, Stmt

ASYNC_COPY_BYTES = (4, 8, 16)
ASYNC_CACHE = ("ca", "cg")  # cache at all levels / in L2 only (cg needs 16 bytes)


@dataclass(frozen=True, eq=False)
class FragmentRef:
    """The elements [offset, offset + operand.elements) of a per-lane fragment buffer: one
    operand of one matrix instruction, in every lane of the warp."""

    buffer: Buffer
    offset: Expr

    def __post_init__(self) -> None:
        object.__setattr__(self, "offset", index_expr(self.offset))

    def check(self, row: MatrixIntrinsic, operand: FragmentOperand, what: str) -> None:
        """IntrinsicError unless this slice can hold `operand` of `row`."""
        b = self.buffer
        if b.scope != "fragment" or b.fragment is None:
            raise IntrinsicError(f"{row.name}: {what} must be a fragment buffer, {b.name} is {b.scope}")
        held = lookup(b.fragment[0]).operand(b.fragment[1])
        # ldmatrix moves untyped 16-bit registers into whatever fragment its addresses describe;
        # an mma operand must hold exactly the layout and dtype of the row's operand.
        if row.kind in ("mma", "wgmma") and (not held.same_layout(operand) or b.dtype != operand.dtype):
            raise IntrinsicError(
                f"{row.name}: {what} {b.name} holds operand {b.fragment[1]} of {b.fragment[0]} ({b.dtype}), whose "
                f"layout or dtype differs from what {row.name} operand {operand.role} needs ({operand.dtype}); "
                "declare the buffer with a fragment of the same layout")
        size = const_int(b.shape[0])
        offset = const_int(self.offset)
        if offset is not None and size is not None and not 0 <= offset <= size - operand.elements:
            raise IntrinsicError(f"{row.name}: {what} {b.name}[{offset}:{offset + operand.elements}] is outside "
                                 f"the buffer's {size} elements")
        unit = operand.elements if row.kind in ("mma", "wgmma") else operand.elements_per_register
        if offset is not None and offset % unit:
            raise IntrinsicError(f"{row.name}: {what} offset {offset} into {b.name} must be a multiple of {unit} "
                                 "(fragments are whole registers)")


@dataclass(frozen=True, eq=False)
class MatrixMultiply(Stmt):
    """`d = a . b + c` by the warp, with the mma row `intrinsic` of tecc.ir.intrinsics: the
    m x k tile A and the k x n tile B (each spread over the warp's lanes as the row's layout maps
    say) are multiplied exactly, summed in the accumulator precision with the m x n tile C, and the
    result rounded to the accumulator type lands in D (which may be the same slice as C)."""

    intrinsic: str
    d: FragmentRef
    a: FragmentRef
    b: FragmentRef
    c: FragmentRef

    def __post_init__(self) -> None:
        row = lookup(self.intrinsic)
        if row.kind != "mma":
            raise IntrinsicError(f"MatrixMultiply needs an mma row of the intrinsic table, {row.name} is {row.kind}")
        for role in ("a", "b", "c", "d"):
            getattr(self, role).check(row, row.operand(role), f"operand {role}")

    @property
    def row(self) -> MatrixIntrinsic:
        return lookup(self.intrinsic)


@dataclass(frozen=True, eq=False)
class MatrixLoad(Stmt):
    """ldmatrix by the warp (row `intrinsic`): lane L < 8 * matrices gives, as `src[src_indices]`
    evaluated in that lane, the first of 8 contiguous 16-bit elements of row L of the stacked
    (8 * matrices) x 8 source tile (16-byte aligned after the buffer's layout); every lane then
    receives the elements the row's operand 'd' map assigns it, in `dst`, register by register.
    The indices the other lanes compute are ignored.

    32-bit elements (float32: tf32 operands) are moved as pairs of 16-bit ones, which is all
    ldmatrix sees: a row is then 4 contiguous elements (16 bytes), and register r of a lane (one
    element of `dst`, not two) is element (lane % 4) of row (lane // 4) of matrix r -- the b16
    pair (2t, 2t+1) of the 16-bit map. That is exactly the m16n8k8 tf32 A fragment of a
    k-contiguous tile (and two B fragments of an n-major one); `.trans` would split elements
    across lanes and is refused."""

    intrinsic: str
    dst: FragmentRef
    src: Buffer
    src_indices: tuple[Expr, ...]

    @property
    def pairs(self) -> bool:
        """Whether the elements are 32-bit, moved as b16 pairs (one element per register)."""
        return self.src.dtype.bytes == 4

    def __post_init__(self) -> None:
        row = lookup(self.intrinsic)
        if row.kind != "ldmatrix":
            raise IntrinsicError(f"MatrixLoad needs an ldmatrix row of the intrinsic table, {row.name} is {row.kind}")
        idx = tuple(index_expr(i) for i in self.src_indices)
        object.__setattr__(self, "src_indices", idx)
        if self.src.scope != "shared":
            raise IntrinsicError(f"{row.name} reads shared memory; {self.src.name} is {self.src.scope}")
        if len(idx) != self.src.ndim:
            raise IntrinsicError(f"{row.name}: {len(idx)} indices for the {self.src.ndim} dimensions of {self.src.name}")
        if self.src.dtype.bytes not in (2, 4) or (self.src.dtype.bytes == 4 and row.transpose):
            raise DTypeError(f"{row.name} moves 16-bit elements (or, without .trans, 32-bit ones as 16-bit pairs); "
                             f"{self.src.name} is {self.src.dtype}")
        if self.dst.buffer.dtype != self.src.dtype:
            raise DTypeError(f"{row.name}: destination {self.dst.buffer.name} is {self.dst.buffer.dtype} but the "
                             f"source {self.src.name} is {self.src.dtype}")
        dst = self.dst.buffer
        if dst.scope != "fragment" or dst.fragment is None:
            raise IntrinsicError(f"{row.name}: the destination must be a fragment buffer, {dst.name} is {dst.scope}")
        if not self.pairs:
            self.dst.check(row, row.operand("d"), "destination")
            return
        registers = row.operand("d").registers
        size, offset = const_int(dst.shape[0]), const_int(self.dst.offset)
        if offset is not None and size is not None and not 0 <= offset <= size - registers:
            raise IntrinsicError(f"{row.name}: destination {dst.name}[{offset}:{offset + registers}] is outside the "
                                 f"buffer's {size} elements (one 32-bit element per register)")

    @property
    def row(self) -> MatrixIntrinsic:
        return lookup(self.intrinsic)


@dataclass(frozen=True, eq=False)
class AsyncCopy(Stmt):
    """cp.async: copy `bytes` (4, 8 or 16) of contiguous elements from `src[src_indices]` (global)
    to `dst[dst_indices]` (shared) without blocking the thread; the copy lands at the
    `AsyncWait` that covers its group (see the module docstring). Where `predicate` is false the
    destination is zero-filled and the source is not read (the src-size 0 form), so a tile's
    out-of-range part needs no separate store. `cache` 'cg' bypasses L1 (16 bytes only), 'ca'
    caches at all levels. Both addresses must be aligned to `bytes`. `unit_stride_at_launch`: the
    source's innermost stride is a run-time one (a kernel parameter) that the kernel has tested
    to be 1 before it reaches this copy (a uniform branch on the launch's strides, as tensorize's
    dispatch makes); the emulator checks it at each copy. Without it the innermost stride must
    be 1 at compile time. `along`: the source dimension the copied elements run along (-1, the
    innermost, unless a transposed view's copies run along another dimension whose run-time
    stride the kernel tested to be 1: tensorize's MN-major copy loop); its stride is the one
    that must be 1 (at compile time, or tested at launch)."""

    dst: Buffer
    dst_indices: tuple[Expr, ...]
    src: Buffer
    src_indices: tuple[Expr, ...]
    bytes: int
    predicate: Expr | None = None
    cache: str = "cg"
    unit_stride_at_launch: bool = False
    along: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst_indices", tuple(index_expr(i) for i in self.dst_indices))
        object.__setattr__(self, "src_indices", tuple(index_expr(i) for i in self.src_indices))
        where = f"cp.async {self.src.name} -> {self.dst.name}"
        if self.dst.scope != "shared" or self.src.scope != "global":
            raise IntrinsicError(f"{where}: copies global -> shared, got {self.src.scope} -> {self.dst.scope}")
        if self.dst.dtype != self.src.dtype:
            raise DTypeError(f"{where}: source is {self.src.dtype}, destination {self.dst.dtype}")
        if self.bytes not in ASYNC_COPY_BYTES or self.bytes % self.dst.dtype.bytes:
            raise IntrinsicError(f"{where}: copies 4, 8 or 16 bytes (whole {self.dst.dtype} elements), not {self.bytes}")
        if self.cache not in ASYNC_CACHE or (self.cache == "cg" and self.bytes != 16):
            raise IntrinsicError(f"{where}: cache must be 'ca', or 'cg' for 16-byte copies; got {self.cache!r} for "
                                 f"{self.bytes} bytes")
        if not -self.src.ndim <= self.along < self.src.ndim:
            raise IntrinsicError(f"{where}: along={self.along} is not a dimension of {self.src.name} "
                                 f"({self.src.ndim} dimensions)")
        if self.along % self.src.ndim != self.src.ndim - 1 and not self.unit_stride_at_launch:
            raise IntrinsicError(f"{where}: a copy along dimension {self.along} of {self.src.name} (not its innermost) "
                                 "needs that dimension's run-time stride tested to be 1 at launch "
                                 "(unit_stride_at_launch)")
        for buf, idx, dim in ((self.dst, self.dst_indices, -1), (self.src, self.src_indices, self.along)):
            if len(idx) != buf.ndim:
                raise IntrinsicError(f"{where}: {len(idx)} indices for the {buf.ndim} dimensions of {buf.name}")
            stride = const_int(buf.strides[dim]) if buf.strides is not None else (1 if dim == -1 else None)
            if stride is None and buf is self.src and self.unit_stride_at_launch:
                continue  # a run-time stride the kernel tested to be 1 (the docstring)
            if stride != 1:
                assert buf.strides is not None
                what = "last stride" if dim % buf.ndim == buf.ndim - 1 else f"stride along dimension {dim}"
                raise IntrinsicError(f"{where}: the copied elements must be contiguous; {buf.name}'s {what} "
                                     f"is {buf.strides[dim]}" + ("" if stride is not None else
                                     " (a run-time stride: test it at launch and mark the copy unit_stride_at_launch)"))
        if self.predicate is not None and not self.predicate.dtype.is_bool:
            raise DTypeError(f"{where}: the predicate must be bool, got {self.predicate.dtype}")

    @property
    def elements(self) -> int:
        return self.bytes // self.dst.dtype.bytes
