"""mbarriers in the loop-nest IR (sm_90): shared-memory barriers with phases, and the bulk
asynchronous copy that completes on one.

Part of tecc.ir.stmt (which re-exports every name here); this module is their reference manual.
`BarrierRef` names a barrier; `BarrierInit`, `BarrierArrive`, `BarrierExpectTx` and `BarrierWait`
are instructions, rows of tecc.ir.instructions (each one PTX instruction on a barrier).

**An mbarrier** is a 64-bit object in shared memory (`BarrierRef`: element `index` of a 1-D
int64 shared buffer). It counts down a *phase*: `BarrierInit(bar, count)` sets the expected
arrival count to `count`, the phase to 0 and the transaction count to 0. Each `BarrierArrive`
counts one arrival; `BarrierExpectTx(bar, bytes)` (mbarrier.arrive.expect_tx) adds `bytes` to
the transaction count and arrives; an asynchronous copy that names the barrier (`BulkCopy`)
subtracts its bytes when its data has landed. The phase *completes* when all `count` arrivals
happened and the transaction count is back to 0: the phase number goes up by one and the
arrival count is re-armed for the next phase. `BarrierWait(bar, parity)` (a try_wait.parity
loop) returns once the phase of parity `parity` (0 or 1) has completed, i.e. while the current
phase's parity differs from `parity`; data that bulk copies wrote under that phase may then be
read by the waiting thread. A wait on a phase nothing can complete any more is a deadlock.

Initialization is done by one thread; the others may use the barrier after a `__syncthreads()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import dtype as dt
from .errors import DTypeError
from .expr import Expr, const_int, index_expr
from .intrinsics import IntrinsicError
from .stmt_nodes import Buffer, Stmt

BULK_COPY_ALIGN = 16  # cp.async.bulk: size and both addresses multiples of 16 bytes
MAX_ARRIVALS = (1 << 20) - 1
MAX_TX_BYTES = (1 << 20) - 1


@dataclass(frozen=True, eq=False)
class BarrierRef:
    """The mbarrier at element `index` of `buffer` (a 1-D int64 shared buffer of barriers)."""

    buffer: Buffer
    index: Expr

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", index_expr(self.index))
        b = self.buffer
        if b.scope != "shared" or b.dtype != dt.int64 or b.ndim != 1 or b.layout is not None:
            raise IntrinsicError(f"mbarrier {b.name}: barriers live in a 1-D int64 shared buffer without a layout, "
                                 f"got a {b.scope} {b.dtype}[{', '.join(str(s) for s in b.shape)}]")
        i, n = const_int(self.index), const_int(b.shape[0])
        if i is not None and n is not None and not 0 <= i < n:
            raise IntrinsicError(f"mbarrier {b.name}[{i}] is outside the buffer's {n} barriers")

    def __str__(self) -> str:
        return f"{self.buffer.name}[{self.index}]"


@dataclass(frozen=True, eq=False)
class BulkCopy(Stmt):
    """cp.async.bulk global -> shared with mbarrier::complete_tx: copy `bytes` contiguous bytes
    (a multiple of 16, both addresses 16-byte aligned) from `src[src_indices]` to
    `dst[dst_indices]` in the async proxy; when they have landed, `bytes` transactions complete
    on `bar`. The destination may be read only after a `BarrierWait` on the phase it completes
    (the expecting thread announces the bytes with `BarrierExpectTx`). Issued by one thread."""

    dst: Buffer
    dst_indices: tuple[Expr, ...]
    src: Buffer
    src_indices: tuple[Expr, ...]
    bytes: int
    bar: BarrierRef

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst_indices", tuple(index_expr(i) for i in self.dst_indices))
        object.__setattr__(self, "src_indices", tuple(index_expr(i) for i in self.src_indices))
        where = f"cp.async.bulk {self.src.name} -> {self.dst.name}"
        if self.dst.scope != "shared" or self.src.scope != "global":
            raise IntrinsicError(f"{where}: copies global -> shared, got {self.src.scope} -> {self.dst.scope}")
        if self.dst.dtype != self.src.dtype:
            raise DTypeError(f"{where}: source is {self.src.dtype}, destination {self.dst.dtype}")
        if isinstance(self.bytes, bool) or not isinstance(self.bytes, int) or self.bytes <= 0 \
                or self.bytes % BULK_COPY_ALIGN or self.bytes > MAX_TX_BYTES:
            raise IntrinsicError(f"{where}: copies a positive multiple of {BULK_COPY_ALIGN} bytes, not {self.bytes!r}")
        for buf, idx in ((self.dst, self.dst_indices), (self.src, self.src_indices)):
            if len(idx) != buf.ndim:
                raise IntrinsicError(f"{where}: {len(idx)} indices for the {buf.ndim} dimensions of {buf.name}")

    @property
    def elements(self) -> int:
        return self.bytes // self.dst.dtype.bytes
