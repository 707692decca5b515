"""The warpgroup statements of the loop-nest IR (Hopper, sm_90a): wgmma and its fences.

Part of tecc.ir.stmt (which re-exports every name here); this module is their reference manual.
`WarpgroupMatrixMultiply` and its shared operands (`SharedMatrix`) are defined here; the fences,
commit and wait groups and setmaxnreg are instructions, rows of tecc.ir.instructions.

**Warpgroup-collective.** A warpgroup is 4 consecutive warps whose first warp's index is a
multiple of 4 (threads 128w .. 128w + 127 of the block). `WarpgroupMatrixMultiply`,
`WarpgroupFence`, `WarpgroupCommit` and `WarpgroupWait` are executed by all 128 threads of a
warpgroup together (never under a condition that splits a warpgroup).

**Asynchronous.** A wgmma only *starts* at its statement: it reads A and B from shared memory
(through matrix descriptors, tecc.ir.descriptor) and its accumulator registers at some time
before it completes, and writes D then. The thread's wgmmas since its last `WarpgroupCommit`
form one group at that commit; `WarpgroupWait(n)` waits until at most the `n` most recent
groups are pending. Reading or writing an accumulator of a pending wgmma is a race (undefined
on a GPU); so is leaving a wgmma unwaited at the end of the kernel. Consecutive wgmmas on the
same accumulator need no wait between them (the hardware chains them).

**Fences.** `WarpgroupFence` (wgmma.fence) must come before the first wgmma and between any
other write of its accumulator registers and a wgmma reading them. Shared memory written by
ordinary stores is seen by wgmma (the *async proxy*) only after a `__syncthreads()` and an
`AsyncProxyFence` (fence.proxy.async): the emulator reports a wgmma reading stores that no proxy
fence followed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .descriptor import DescriptorError, MatrixDescriptor
from .dtype import DType
from .errors import DTypeError
from .expr import Expr, as_expr, const_int, index_expr
from .intrinsics import PTX_STORAGE, IntrinsicError, MatrixIntrinsic, lookup
from .matrix_stmt import FragmentRef
from .stmt_nodes import Buffer, Stmt


@dataclass(frozen=True, eq=False)
class SharedMatrix:
    """One wgmma operand in shared memory: the tile whose descriptor has start address
    `buffer`'s storage element `start` (an element offset into the buffer as laid out
    physically, the same in every thread of the warpgroup) and the static fields `descriptor`.
    Tile element (row, col) is at `descriptor.offset(start, row, col)`; for A rows are m and
    columns k, for B rows are n and columns k."""

    buffer: Buffer
    start: Expr
    descriptor: MatrixDescriptor

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", index_expr(self.start))
        b, d = self.buffer, self.descriptor
        if b.scope != "shared":
            raise DescriptorError(f"{d}: describes shared memory, {b.name} is {b.scope}")
        if b.dtype.bytes != d.element_bytes:
            raise DTypeError(f"{d}: describes {d.element_bytes}-byte elements, {b.name} is {b.dtype}")
        if b.layout != d.layout:
            raise DescriptorError(
                f"{d}: buffer {b.name} has layout {b.layout}, but the descriptor's swizzle is {d.layout}; give the "
                "buffer the descriptor's layout so that its plain accesses and wgmma agree on where elements live")
        start = const_int(self.start)
        if start is not None and (start * d.element_bytes) % 16:
            raise DescriptorError(f"{d}: the start of {b.name} (element {start}) must be 16-byte aligned")

    def check_tile(self, rows: int, cols: int, what: str) -> None:
        """DescriptorError unless a rows x cols tile at a constant start lies inside the buffer."""
        span, start = self.buffer.static_span(), const_int(self.start)
        if span is None or start is None:
            return
        last = max(int(self.descriptor.offset(start, r, c)) for r in range(rows) for c in range(cols))
        if last >= span:
            raise DescriptorError(f"{what}: the {rows} x {cols} tile of {self.descriptor} at element {start} "
                                  f"reaches past the {span} elements of {self.buffer.name}")


@dataclass(frozen=True, eq=False)
class WarpgroupMatrixMultiply(Stmt):
    """wgmma.mma_async by the warpgroup, with the wgmma row `intrinsic` (m64nNk16): D = A . B +
    (D if `scale_d` else 0), where B (16 x N, described as its N x 16 transpose) is read from
    shared memory through `b`, A (64 x 16) through `a` when it is a SharedMatrix or from the
    threads' registers when it is a FragmentRef (the row's operand 'a': 8 elements per thread,
    the register form of the ISA, as FlashAttention-3 feeds P to P·V), and D is the warpgroup's
    accumulator fragment (each thread's N / 2 f32 registers at `d`, laid out by the row's map).
    Products are exact and summed in f32. Asynchronous: see the module docstring; a register A
    is read at some time before the wgmma completes too, so its registers must not be written
    until a `WarpgroupWait` covers it."""

    intrinsic: str
    d: FragmentRef
    a: SharedMatrix | FragmentRef
    b: SharedMatrix
    scale_d: Expr

    def __post_init__(self) -> None:
        row = lookup(self.intrinsic)
        if row.kind != "wgmma":
            raise IntrinsicError(f"WarpgroupMatrixMultiply needs a wgmma row of the intrinsic table, {row.name} is {row.kind}")
        object.__setattr__(self, "scale_d", as_expr(self.scale_d))
        if not self.scale_d.dtype.is_bool:
            raise DTypeError(f"{row.name}: scale_d must be bool, got {self.scale_d.dtype}")
        self.d.check(row, row.operand("d"), "accumulator")
        m, n, k = row.shape
        if isinstance(self.a, FragmentRef):
            self.a.check(row, row.operand("a"), "register operand A")
        for role, ref, rows in (("A", self.a, m), ("B", self.b, n)):
            if not isinstance(ref, SharedMatrix):
                continue
            want: DType = PTX_STORAGE[row.operand_type(role.lower())]
            if ref.buffer.dtype != want:
                raise DTypeError(f"{row.name}: operand {role} must be {want}, {ref.buffer.name} is {ref.buffer.dtype}")
            if row.k_major_only and ref.descriptor.major != "K":
                raise DescriptorError(f"{row.name}: operand {role} ({ref.descriptor}) must be K-major; the ISA has "
                                      f"no transpose for .{row.operand_type(role.lower())} inputs")
            ref.check_tile(rows, k, f"{row.name} operand {role}")

    @property
    def row(self) -> MatrixIntrinsic:
        return lookup(self.intrinsic)

    @property
    def a_in_registers(self) -> bool:
        return isinstance(self.a, FragmentRef)
