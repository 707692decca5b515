"""tensorize on Hopper, warp-specialized: a producer warpgroup loads tiles with TMA into an
mbarrier ring, consumer warpgroups run wgmma (tensorize_wgmma(..., producer="tma")).

The same matching, block tiling, 128B-swizzled shared tiles, descriptors and epilogue as
tensorize_wgmma.py (this emitter subclasses its emitter); the loads and the ring differ:

1. roles       BM/64 consumer warpgroups (warpgroup g computes rows 64g .. 64g + 63, as before)
               and one more warpgroup, the producer, of which one thread issues every load. The
               block has 128 · (BM/64 + 1) threads. With two consumer warpgroups (384 threads,
               168 registers each at launch) the producer gives registers back
               (setmaxnreg.dec 40) and the consumers take them (setmaxnreg.inc 232):
               128 · 40 + 256 · 232 = 384 · 168.
2. loads       one TMA tile copy per operand and k tile (tecc/ir/tma_stmt.py): a K-major operand
               (A[b?, i, k], B[b?, j, k]) as one box of (rows, 64) into [S][rows][64]; an MN-major
               operand (A[b?, k, i], B[b?, k, j]) as rows/64 boxes of (64, 64), one per 64-column
               block of [S][rows/64][64][64]. The tensor map's 128B swizzle writes exactly the
               layout the descriptors read, and its zero fill is the M/N/K edge handling (no
               predicates). Only operands whose every index is a plain loop variable (a batch,
               the row/column, the k axis) qualify: an implicit-GEMM gather keeps cp.async.
3. ring        S stages, barriers full[S] (count 1: the producer's expect-tx) and empty[S]
               (count 4 · BM/64: one arrival per consumer warp). Iteration kt, in one k loop
               whose body branches on the role (warpgroup-uniform, no __syncthreads in it):

                 producer thread:  wait empty[kt % S] for parity (kt / S + 1) % 2
                                     (stage free: its previous tile's wgmmas completed; on a
                                      fresh barrier parity 1 counts as completed, so the first
                                      S waits return at once)
                                   expect_tx(full[kt % S], bytes of both tiles)
                                   TMA A and B tiles of k tile kt into stage kt % S
                 consumers:        wait full[kt % S] for parity (kt / S) % 2   (tile kt landed)
                                   wgmma.fence; BK/16 wgmmas; commit; wgmma.wait_group 1
                                   lane 0 of each warp: arrive empty[(kt - 1) % S]
                                     (tile kt - 1's wgmmas of this warp completed)

               TMA writes and wgmma reads are both async-proxy accesses ordered by the
               mbarriers, so no proxy fence sits in the loop; the barriers' initialization is
               made visible to the async proxy (fence.proxy.async) before the one __syncthreads.
               The producer runs up to S tiles ahead of the slowest consumer warpgroup.
4. epilogue    consumers: wgmma.wait_group 0, then tensorize_wgmma's epilogue.

The emulator runs the threads in lockstep in program order; the producer's branch comes first
in each iteration, so every wait is satisfied by what precedes it in program order, and a
forgotten release (no arrive on `empty`) is reported as a deadlock.
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, size_product
from ...ir.intrinsics import WARPGROUP_SIZE, lookup
from ...ir.stmt import (
    Allocate,
    AsyncProxyFence,
    Barrier,
    BarrierArrive,
    BarrierExpectTx,
    BarrierInit,
    BarrierRef,
    BarrierWait,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    PrimFunc,
    SetMaxRegisters,
    Stmt,
    TensorCopy,
    TensorMap,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupWait,
    seq,
)
from .tensorize import Contraction, Operand, Tiling, _ceil_div, _int, _shape
from .tensorize_wgmma import K_TILE, _WarpgroupEmitter

PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = {2: 232}   # consumer warpgroups -> setmaxnreg.inc target (module docstring, step 1)


def tma_refusal(c: Contraction, tiling: Tiling | None = None) -> str | None:
    """Why the contraction's operands cannot be loaded by TMA tile copies, or None when they can
    (module docstring, step 2): every index a plain loop variable, no where(), a contiguous
    innermost dimension, and two different buffers (one tensor map each)."""
    if c.a.buffer is c.b.buffer:
        return f"A and B are the same buffer {c.a.buffer.name} (one tensor map per buffer)"
    for op in (c.a, c.b):
        reason = _operand_refusal(c, op)
        if reason is not None:
            return f"operand {op.role} ({op.buffer.name}): {reason}"
    return None


def _operand_refusal(c: Contraction, op: Operand) -> str | None:
    if op.guard is not None:
        return "its read is under a where() (padding): TMA has no per-element predicate"
    outer = c.rows if op.role == "A" else c.cols
    if len(outer) != 1 or len(c.ks) != 1:
        return "its rows or its reduction are several axes (an implicit GEMM gathers them)"
    axes = {c.k: "k", outer[0][0]: "outer"}
    axes.update({v: "batch" for v, _ in c.batch})
    seen: set[Var] = set()
    for ix in op.load.indices:
        if not isinstance(ix, Var) or ix not in axes or ix in seen:
            return f"index {ix} is not a plain loop variable (TMA copies boxes of plain coordinates)"
        seen.add(ix)
    if c.k not in seen or outer[0][0] not in seen:
        return "it is not indexed by both its row/column axis and k"
    last = op.load.indices[-1]
    if last not in (c.k, outer[0][0]):
        return "its innermost dimension is a batch axis"
    strides = op.buffer.strides
    if strides is not None and len(strides) and str(strides[-1]) != "1":
        return f"its innermost stride is {strides[-1]}, TMA needs a contiguous innermost dimension"
    return None


class _TmaEmitter(_WarpgroupEmitter):
    def __init__(self, func: PrimFunc, c: Contraction, intrinsic: str, t: Tiling, release: bool) -> None:
        super().__init__(func, c, intrinsic, t, None)
        self.consumers = t.bm // 64
        self.release = release  # False only in tests: the deadlock the emulator must report
        self.full = Buffer("full_bar", dt.int64, _shape(t.stages), "shared")
        self.empty = Buffer("empty_bar", dt.int64, _shape(t.stages), "shared")
        self.maps = {op.role: self.tensor_map(op) for op in (c.a, c.b)}

    def summary(self) -> str:
        t = self.t
        return (f"{self.row} block {t.bm}x{t.bn} consumer warpgroups {self.consumers} + TMA producer warpgroup "
                f"k_tile {t.bk} stages {t.stages} (mbarrier ring, wgmma groups in flight 1)")

    # step 1: roles -------------------------------------------------------------------------------
    def kernel(self) -> PrimFunc:
        c, t = self.c, self.t
        body: Stmt = self.pipeline()
        for buf in (self.shared["A"], self.shared["B"], self.full, self.empty, *self.fragments):
            body = Allocate(buf, body)
        threads = t.threads + WARPGROUP_SIZE
        body = For(self.tx, _int(0), _int(threads), "threadIdx.x", body)
        body = For(self.bx, _int(0), _ceil_div(c.n, t.bn), "blockIdx.x", body)
        body = For(self.by, _int(0), _ceil_div(c.m, t.bm), "blockIdx.y", body)
        if c.batch:
            body = For(self.bz, _int(0), size_product([ext for _, ext in c.batch]), "blockIdx.z", body)
        return PrimFunc(self.func.name, self.func.params, body, self.func.attrs + (("tensorize", self.summary()),))

    # step 2: TMA loads ---------------------------------------------------------------------------
    def tensor_map(self, op: Operand) -> TensorMap:
        outer = self.t.bm if op.role == "A" else self.t.bn
        box = []
        for ix in op.load.indices:
            if ix is self.c.k:
                box.append(K_TILE)
            elif ix in (self.c.i, self.c.j):
                box.append(outer if op.k_last else 64)
            else:
                box.append(1)
        return TensorMap(op.buffer, tuple(box), "128B")

    def tile_copies(self, op: Operand, stage: Expr, k_tile: Expr, bar: BarrierRef) -> list[Stmt]:
        c, t = self.c, self.t
        outer0 = self.by * t.bm if op.role == "A" else self.bx * t.bn
        outer = t.bm if op.role == "A" else t.bn
        dst = self.shared[op.role]
        zero = _int(0)
        copies = []
        for block in range(1 if op.k_last else outer // 64):
            coords = []
            for ix in op.load.indices:
                if ix is c.k:
                    coords.append(k_tile * K_TILE)
                elif ix in (c.i, c.j):
                    coords.append(outer0 + 64 * block)
                else:
                    coords.append(self.batch_index[ix.name])
            indices = (stage, zero, zero) if op.k_last else (stage, _int(block), zero, zero)
            copies.append(TensorCopy(dst, indices, self.maps[op.role], tuple(coords), bar))
        return copies

    # step 3: the mbarrier ring -------------------------------------------------------------------
    def pipeline(self) -> Stmt:
        t = self.t
        S = t.stages
        thread = self.tx % WARPGROUP_SIZE
        producer = self.warpgroup == self.consumers
        warps = 4 * self.consumers
        init = IfThenElse(self.tx == 0, seq(
            *[BarrierInit(BarrierRef(self.full, Const(s, dt.int32)), 1) for s in range(S)],
            *[BarrierInit(BarrierRef(self.empty, Const(s, dt.int32)), warps) for s in range(S)],
            AsyncProxyFence()))   # the initialized barriers, visible to the TMA unit (async proxy)
        elements = lookup(self.row).operand("d").elements
        zero = self.unrolled("zero", elements, lambda z: BufferStore(self.frag_c, (z,), Const(0.0, dt.float32)))
        tile_bytes = self.maps["A"].bytes * (1 if self.c.a.k_last else t.bm // 64) + \
            self.maps["B"].bytes * (1 if self.c.b.k_last else t.bn // 64)

        def produce(kt: Var) -> Stmt:
            stage = kt % S
            full = BarrierRef(self.full, stage)
            return IfThenElse(thread == 0, seq(
                BarrierWait(BarrierRef(self.empty, stage), (kt // S + 1) % 2),
                BarrierExpectTx(full, tile_bytes),
                *self.tile_copies(self.c.a, stage, kt, full),
                *self.tile_copies(self.c.b, stage, kt, full)))

        def consume(kt: Var) -> Stmt:
            stage = kt % S
            release = IfThenElse((kt > 0) & (self.lane == 0),
                                 BarrierArrive(BarrierRef(self.empty, (kt + (S - 1)) % S)))
            return seq(
                BarrierWait(BarrierRef(self.full, stage), (kt // S) % 2),
                WarpgroupFence(),
                self.compute(stage),
                WarpgroupCommit(),
                WarpgroupWait(1),
                release if self.release else None)
        load_tile = Var("load_tile")
        producer_role = seq(
            SetMaxRegisters(PRODUCER_REGISTERS, False) if self.consumers in CONSUMER_REGISTERS else None,
            For(load_tile, _int(0), self.k_tiles, "serial", produce(load_tile)))
        consumer_role = seq(
            SetMaxRegisters(CONSUMER_REGISTERS[self.consumers], True) if self.consumers in CONSUMER_REGISTERS else None,
            zero,
            For(self.kt, _int(0), self.k_tiles, "serial", consume(self.kt)),
            WarpgroupWait(0, (self.frag_c,)),
            self.epilogue())
        return seq(init, Barrier(), IfThenElse(producer, producer_role, consumer_role))


def tensorize_wgmma_tma(func: PrimFunc, stage: str, c: Contraction, intrinsic: str, tiling: Tiling,
                        release: bool = True) -> PrimFunc:
    """The warp-specialized TMA kernel (module docstring); the caller checked the tiling."""
    reason = tma_refusal(c, tiling)
    if reason is not None:
        raise ScheduleError(f"tensorize({stage}, wgmma, producer='tma'): {reason}; "
                            "use producer='threads' (cp.async by every thread)")
    return _TmaEmitter(func, c, intrinsic, tiling, release).kernel()


__all__ = ["tensorize_wgmma_tma", "tma_refusal"]
