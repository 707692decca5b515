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
               block of [S][rows/64][64][64]. tf32 (4-byte elements): boxes of 32 floats (128
               bytes) instead of 64 halves; a register-loaded X (tensorize_wgmma.py, "tf32") as
               rows/32 boxes of (32 k, 32) into [S][rows/32][32][32], which its fragment loads
               read through the same swizzle. The tensor map's 128B swizzle writes exactly the
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
4. epilogue    consumers: wgmma.wait_group 0, then either tensorize_wgmma's epilogue
               (`epilogue="registers"`: each thread stores its fragment elements to global
               memory, guarded) or, with `epilogue="tma"`, through shared memory: each consumer
               warpgroup writes its 64 rows of epilogue-applied values (bias, relu, the cast:
               the stage's own expression, other tensors read at their indices) into a staging
               tile C_stage[BN/W][BM/8][8][W] (W = 128 bytes of output elements; the row split
               in its multiple of 8 and the rest keeps the former outside the swizzle's XOR in
               codegen) in the 128B swizzle -- a warp's stores of one fragment element then hit
               8 rows in 8 different 16-byte chunks: conflict-free --, then fence.proxy.async, a named
               barrier of its 128 threads (bar.sync 1 + warpgroup, 128: the other warpgroup and
               the producer do not take part), and its thread 0 issues BN/W TMA stores of
               (64, W) boxes through the output's tensor map (encoded at launch like the
               loads'; the TMA unit clips the box at M and N, so no predicate) and commits
               them as one bulk group. Before the warpgroup writes the staging tile again
               (the next tile of a persistent block) its thread 0 waits wait_group.read 0 and
               the warpgroup meets at the named barrier, so the store drains under the next
               tile's k loop; the last wait is at the end of the consumer role.
               `tma_store_refusal` says when the output cannot take a tensor map (then the
               register epilogue is kept and the summary says why).
5. persistent  (optional, `persistent=P`) P blocks instead of one per output tile: block b
               handles tiles b, b + P, b + 2P, ... in both roles, the ring's phases running on
               across tiles (k tile kt of the block's i-th tile is ring entry i · k_tiles + kt),
               so the producer loads the next tile's first stages while the consumers run this
               tile's epilogue. Tiles are numbered in a grouped order: GROUP_M row tiles side by
               side sweep the column tiles together (then the next group), so the blocks running
               at one time share panels of A and B in L2.

The emulator runs the threads in lockstep in program order; the producer's branch comes first
in each iteration, so every wait is satisfied by what precedes it in program order, and a
forgotten release (no arrive on `empty`) is reported as a deadlock.
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, size_product, substitute
from ...ir.intrinsics import WARPGROUP_SIZE, lookup
from ...ir.tma_stmt import SWIZZLE_BYTES, TMA_ALIGN, swizzle_layout
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
    BulkCommit,
    BulkWait,
    For,
    IfThenElse,
    LetStmt,
    NamedBarrier,
    PrimFunc,
    SetMaxRegisters,
    Stmt,
    TensorCopy,
    TensorMap,
    TensorStore,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupWait,
    seq,
)
from ...ir.descriptor import MatrixDescriptor
from .implicit_gemm import unflatten
from .tensorize import Contraction, Operand, Tiling, _ceil_div, _int, _ReplaceAccumulator, _shape, grouped_tile
from .tensorize_wgmma import ROW_BYTES, _WarpgroupEmitter

PRODUCER_REGISTERS = 40
GROUP_M = 8            # row tiles per group of the persistent grid's tile order
MAX_PERSISTENT = 2**31 - 1
CONSUMER_REGISTERS = {2: 232}   # consumer warpgroups -> setmaxnreg.inc target (module docstring, step 1)
EPILOGUES = ("registers", "tma")  # step 4: fragments straight to global memory, or staged + TMA store


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


def tma_store_refusal(c: Contraction) -> str | None:
    """Why the stage's output cannot be written by TMA stores from a staging tile (step 4), or
    None: the output a global buffer indexed by plain loop variables -- batch axes, then the row
    axis, then the column axis innermost --, contiguous rows of a multiple of 16 bytes known at
    compile time, elements of 2 or 4 bytes."""
    out = c.store.buffer
    if out.scope != "global":
        return f"the output {out.name} is a {out.scope} buffer"
    if out.dtype.bytes not in (2, 4):
        return f"the output's {out.dtype} elements are not 2 or 4 bytes"
    if len(c.rows) != 1 or len(c.cols) != 1:
        return "its rows or columns are several axes"
    batch = [v for v, _ in c.batch]
    indices = c.store.indices
    if tuple(indices) != (*batch, c.i, c.j) or not all(isinstance(ix, Var) for ix in indices):
        return "it is not indexed [batch.., row, column] by plain loop variables"
    if out.strides is not None:
        if str(out.strides[-1]) != "1":
            return f"its innermost stride is {out.strides[-1]} (TMA needs contiguous rows)"
        for s in out.strides[:-1]:
            if not isinstance(s, Const) or (int(s.value) * out.dtype.bytes) % TMA_ALIGN:
                return f"its stride {s} is not a compile-time multiple of {TMA_ALIGN} bytes"
    elif len(out.shape) > 1:
        row = out.shape[-1]
        if not isinstance(row, Const) or (int(row.value) * out.dtype.bytes) % TMA_ALIGN:
            return (f"its rows of {row} elements are not a compile-time multiple of {TMA_ALIGN} bytes "
                    "(TMA's stride alignment)")
    return None


class _TmaEmitter(_WarpgroupEmitter):
    def __init__(self, func: PrimFunc, c: Contraction, intrinsic: str, t: Tiling, release: bool,
                 persistent: int = 0, group_m: int = GROUP_M, epilogue: str = "registers") -> None:
        super().__init__(func, c, intrinsic, t, None)
        self.consumers = self.groups
        self.mn_box = ROW_BYTES // c.a.buffer.dtype.bytes   # columns of an MN-major box: one 128-byte row
        self.store_refusal = tma_store_refusal(c) if epilogue == "tma" else None
        if self.store_refusal is None and epilogue == "tma" and self.swap:
            self.store_refusal = "the accumulators hold Cᵀ (tf32's swapped form)"
        self.store_staged = epilogue == "tma" and self.store_refusal is None
        if self.store_staged:
            out = c.store.buffer
            width = SWIZZLE_BYTES["128B"] // out.dtype.bytes   # output elements per 128-byte staging row
            self.stage_width = width
            # [column chunk][row / 8][row % 8][column]: the 8-row period of the swizzle its own
            # dimension, so that codegen keeps the row's multiple of 8 outside the XOR
            self.staging = Buffer(f"{out.name}_stage", out.dtype, _shape(t.bn // width, t.bm // 8, 8, width), "shared",
                                  tensor=f"{out.tensor}.stage", layout=swizzle_layout("128B", out.dtype.bytes))
            box = tuple(64 if ix is c.i else width if ix is c.j else 1 for ix in c.store.indices)
            self.out_map = TensorMap(out, box, "128B")
        self.release = release  # False only in tests: the deadlock the emulator must report
        self.persistent, self.group_m = persistent, group_m
        self.block_id, self.tile_iter = Var("block_id"), Var("tile_iter")
        self.full = Buffer("full_bar", dt.int64, _shape(t.stages), "shared")
        self.empty = Buffer("empty_bar", dt.int64, _shape(t.stages), "shared")
        self.maps = {op.role: self.tensor_map(op) for op in (c.a, c.b)}

    def summary(self) -> str:
        t = self.t
        grid = (f", persistent over {self.persistent} blocks in groups of {self.group_m} row tiles"
                if self.persistent else "")
        if self.store_staged:
            epilogue = ", epilogue through shared memory + TMA store"
        elif self.store_refusal is not None:
            epilogue = f", epilogue from registers (no TMA store: {self.store_refusal})"
        else:
            epilogue = ""
        return (f"{self.row} block {t.bm}x{t.bn} consumer warpgroups {self.consumers} + TMA producer warpgroup "
                f"k_tile {t.bk} stages {t.stages}{self.form()} (mbarrier ring, wgmma groups in flight 1{grid}{epilogue})")

    # step 1: roles -------------------------------------------------------------------------------
    def kernel(self) -> PrimFunc:
        c, t = self.c, self.t
        body: Stmt = self.pipeline()
        staging = (self.staging,) if self.store_staged else ()
        for buf in (self.shared["A"], self.shared["B"], *staging, self.full, self.empty, *self.fragments):
            body = Allocate(buf, body)
        threads = t.threads + WARPGROUP_SIZE
        body = For(self.tx, _int(0), _int(threads), "threadIdx.x", body)
        if self.persistent:
            body = For(self.block_id, _int(0), _int(self.persistent), "blockIdx.x", body)
            return PrimFunc(self.func.name, self.func.params, body,
                            self.func.attrs + (("tensorize", self.summary()),))
        body = For(self.bx, _int(0), _ceil_div(c.n, t.bn), "blockIdx.x", body)
        body = For(self.by, _int(0), _ceil_div(c.m, t.bm), "blockIdx.y", body)
        if c.batch:
            body = For(self.bz, _int(0), size_product([ext for _, ext in c.batch]), "blockIdx.z", body)
        return PrimFunc(self.func.name, self.func.params, body, self.func.attrs + (("tensorize", self.summary()),))

    # step 2: TMA loads ---------------------------------------------------------------------------
    def shared_buffer(self, op: Operand) -> Buffer:
        if not (self.x_registers and op is self.x):
            return super().shared_buffer(op)
        # a tf32 X from registers, k outermost: [S][outer / 32][BK][32], the boxes the tensor map
        # writes in its 128B swizzle (4-byte elements: Swizzle(3, 2, 3)); the fragment loads read
        # it through the same layout
        width = ROW_BYTES // op.buffer.dtype.bytes
        layout = self.operand_descriptor(op).layout if op.k_last else \
            MatrixDescriptor("K", "128B", 16, 1024, op.buffer.dtype.bytes).layout
        return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype,
                      _shape(self.t.stages, self.extent(op) // width, self.t.bk, width), "shared",
                      tensor=f"{op.buffer.tensor}.shared", layout=layout)

    def shared_index(self, op: Operand, stage: Expr, r: Expr, col: Expr) -> tuple[Expr, ...]:
        if not (self.x_registers and op is self.x):
            return super().shared_index(op, stage, r, col)
        width = ROW_BYTES // op.buffer.dtype.bytes
        return stage, col // width, r, col % width

    def tensor_map(self, op: Operand) -> TensorMap:
        outer = self.t.bm if op.role == "A" else self.t.bn
        box = []
        for ix in op.load.indices:
            if ix is self.c.k:
                box.append(self.k_tile)
            elif ix in (self.c.i, self.c.j):
                box.append(outer if op.k_last else self.mn_box)
            else:
                box.append(1)
        return TensorMap(op.buffer, tuple(box), "128B")

    def tile_copies(self, op: Operand, stage: Expr, k_tile: Expr, bar: BarrierRef) -> list[Stmt]:
        c, t = self.c, self.t
        outer0 = self.by * t.bm if op.role == "A" else self.bx * t.bn
        outer = t.bm if op.role == "A" else t.bn
        dst = self.shared[op.role]
        zero = _int(0)
        copies: list[Stmt] = []
        for block in range(1 if op.k_last else outer // self.mn_box):
            coords = []
            for ix in op.load.indices:
                if ix is c.k:
                    coords.append(k_tile * self.k_tile)
                elif ix in (c.i, c.j):
                    coords.append(outer0 + self.mn_box * block)
                else:
                    assert isinstance(ix, Var)  # tma_refusal: every index is a plain loop variable
                    coords.append(self.batch_index[ix.name])
            indices = (stage, zero, zero) if op.k_last else (stage, _int(block), zero, zero)
            copies.append(TensorCopy(dst, indices, self.maps[op.role], tuple(coords), bar))
        return copies

    # step 3b: the persistent grid ------------------------------------------------------------------
    def tiles(self) -> Expr:
        c, t = self.c, self.t
        total = _ceil_div(c.m, t.bm) * _ceil_div(c.n, t.bn)
        return total * size_product([ext for _, ext in c.batch]) if c.batch else total

    def for_each_tile(self, body: Stmt) -> Stmt:
        """`body` once per output tile of this block (the persistent grid: tiles block_id,
        block_id + P, ...), with block_row / block_col / block_batch bound to the tile in the
        grouped order: GROUP_M row tiles side by side sweep the column tiles together, so the
        blocks running at one time share A's row panels and B's column panels in L2."""
        if not self.persistent:
            return body
        c, t = self.c, self.t
        rows, cols = _ceil_div(c.m, t.bm), _ceil_div(c.n, t.bn)
        tile = self.block_id + self.tile_iter * self.persistent
        per_batch = rows * cols
        local = tile % per_batch if c.batch else tile
        row, col = grouped_tile(local, rows, cols, self.group_m)
        bound = LetStmt(self.by, row, LetStmt(self.bx, col, body))
        if c.batch:
            bound = LetStmt(self.bz, tile // per_batch, bound)
        count = (self.tiles() - self.block_id + (self.persistent - 1)) // self.persistent
        return For(self.tile_iter, _int(0), count, "serial", bound)

    def ring_index(self, kt: Expr) -> Expr:
        """The ring's running k-tile count: k tiles of earlier tiles of this block, then kt."""
        return self.tile_iter * self.k_tiles + kt if self.persistent else kt

    # step 3: the mbarrier ring -------------------------------------------------------------------
    def pipeline(self) -> Stmt:
        t = self.t
        S = t.stages
        thread = self.tx % WARPGROUP_SIZE
        producer = self.warpgroup == self.consumers
        warps = 4 * self.consumers
        init = IfThenElse(self.tx == 0, seq(
            *[BarrierInit(BarrierRef(self.full, Const(s, dt.int32)), _int(1)) for s in range(S)],
            *[BarrierInit(BarrierRef(self.empty, Const(s, dt.int32)), _int(warps)) for s in range(S)],
            AsyncProxyFence()))   # the initialized barriers, visible to the TMA unit (async proxy)
        elements = lookup(self.row).operand("d").elements
        zero = self.unrolled("zero", elements, lambda z: BufferStore(self.frag_c, (z,), Const(0.0, dt.float32)))
        tile_bytes = self.maps["A"].bytes * (1 if self.c.a.k_last else t.bm // self.mn_box) + \
            self.maps["B"].bytes * (1 if self.c.b.k_last else t.bn // self.mn_box)

        def produce(kt: Var) -> Stmt:
            g = self.ring_index(kt)
            stage = g % S
            full = BarrierRef(self.full, stage)
            return IfThenElse(thread == 0, seq(
                BarrierWait(BarrierRef(self.empty, stage), (g // S + 1) % 2),
                BarrierExpectTx(full, _int(tile_bytes)),
                *self.tile_copies(self.c.a, stage, kt, full),
                *self.tile_copies(self.c.b, stage, kt, full)))

        def consume(kt: Expr, registers: int = 0) -> Stmt:
            g = self.ring_index(kt)
            stage = g % S
            release = IfThenElse((g > 0) & (self.lane == 0),
                                 BarrierArrive(BarrierRef(self.empty, (g + (S - 1)) % S)))
            return seq(
                BarrierWait(BarrierRef(self.full, stage), (g // S) % 2),
                self.load_x(stage, registers) if self.x_registers else None,
                WarpgroupFence(),
                self.compute_set(stage, registers),
                WarpgroupCommit(),
                WarpgroupWait(1),
                release if self.release else None)

        if self.x_registers:
            # two k tiles per trip, each with its own X register set (tensorize_wgmma.py, "tf32")
            pair = Var("k_pair")
            consume_loop: Stmt = For(pair, _int(0), (self.k_tiles + 1) // 2, "serial", seq(
                consume(2 * pair, 0), IfThenElse(2 * pair + 1 < self.k_tiles, consume(2 * pair + 1, 1))))
        else:
            consume_loop = For(self.kt, _int(0), self.k_tiles, "serial", consume(self.kt))
        load_tile = Var("load_tile")
        producer_role = seq(
            SetMaxRegisters(PRODUCER_REGISTERS, False) if self.consumers in CONSUMER_REGISTERS else None,
            self.for_each_tile(For(load_tile, _int(0), self.k_tiles, "serial", produce(load_tile))))
        consumer_role = seq(
            SetMaxRegisters(CONSUMER_REGISTERS[self.consumers], True) if self.consumers in CONSUMER_REGISTERS else None,
            self.for_each_tile(seq(
                zero,
                consume_loop,
                WarpgroupWait(0, (self.frag_c,)),
                self.staged_epilogue() if self.store_staged else self.epilogue())),
            # the last tile's stores must have read the staging tile before the block exits
            IfThenElse(thread == 0, BulkWait(0)) if self.store_staged else None)
        return seq(init, Barrier(), IfThenElse(producer, producer_role, consumer_role))

    # step 4: the epilogue through shared memory and TMA stores -----------------------------------
    def staged_epilogue(self) -> Stmt:
        c, t = self.c, self.t
        thread = self.tx % WARPGROUP_SIZE
        width = self.stage_width
        row0 = self.warpgroup * 64

        def element(e: Var) -> Stmt:
            r, col = self.c_map(thread, e)
            row = self.by * t.bm + row0 + r
            column = self.bx * t.bn + col
            values: dict[Var, Expr] = {v: self.batch_index[v.name] for v, _ in c.batch}
            values.update(unflatten(c.rows, row))
            values.update(unflatten(c.cols, column))
            value = substitute(_ReplaceAccumulator(c.acc, self.frag_c[e]).visit(c.store.value), values)
            local = row0 + r
            store = BufferStore(self.staging, (col // width, local // 8, local % 8, col % width), value)
            # the guard keeps the epilogue's own reads (a bias at the column...) in bounds; the
            # TMA store clips the staged tile's out-of-range rows and columns itself
            return IfThenElse((row < c.m) & (column < c.n), store)
        writes = self.unrolled("stage_e", int(lookup(self.row).operand("d").elements), element)

        def copies() -> Stmt:
            out: list[Stmt] = []
            for chunk in range(t.bn // width):
                coords = []
                for ix in c.store.indices:
                    if ix is c.i:
                        coords.append(self.by * t.bm + row0)
                    elif ix is c.j:
                        coords.append(self.bx * t.bn + chunk * width)
                    else:
                        assert isinstance(ix, Var)
                        coords.append(self.batch_index[ix.name])
                out.append(TensorStore(self.staging, (_int(chunk), row0 // 8, _int(0), _int(0)), self.out_map,
                                       tuple(coords)))
            return seq(*out, BulkCommit())
        # one named barrier per consumer warpgroup, id 1 + warpgroup (0 is __syncthreads')
        sync = NamedBarrier(self.warpgroup + 1, WARPGROUP_SIZE)
        return seq(
            IfThenElse(thread == 0, BulkWait(0)) if self.persistent else None,   # the previous tile's store read it
            sync if self.persistent else None,
            writes,
            AsyncProxyFence(),    # the staged values, visible to the TMA unit (async proxy)
            sync,
            IfThenElse(thread == 0, copies()))


def tensorize_wgmma_tma(func: PrimFunc, stage: str, c: Contraction, intrinsic: str, tiling: Tiling,
                        release: bool = True, persistent: int = 0, group_m: int = GROUP_M,
                        epilogue: str = "registers") -> PrimFunc:
    """The warp-specialized TMA kernel (module docstring); the caller checked the tiling.
    `persistent` > 0: that many blocks loop over the output tiles in the grouped order of
    `group_m` row tiles (step 5). `epilogue`: "registers" or "tma" (through a shared staging
    tile and TMA stores, step 4; the register epilogue where the output cannot take them)."""
    reason = tma_refusal(c, tiling)
    if reason is not None:
        raise ScheduleError(f"tensorize({stage}, wgmma, producer='tma'): {reason}; "
                            "use producer='threads' (cp.async by every thread)")
    if persistent < 0 or persistent > MAX_PERSISTENT or group_m < 1:
        raise ScheduleError(f"tensorize({stage}, wgmma, producer='tma'): persistent must be 0 (one block per tile) "
                            f"or 1..{MAX_PERSISTENT} blocks and group_m positive, got {persistent} and {group_m}")
    if epilogue not in EPILOGUES:
        raise ScheduleError(f"tensorize({stage}, wgmma, producer='tma'): epilogue {epilogue!r} is not one of "
                            f"{EPILOGUES}")
    return _TmaEmitter(func, c, intrinsic, tiling, release, persistent, group_m, epilogue).kernel()


__all__ = ["EPILOGUES", "tensorize_wgmma_tma", "tma_refusal", "tma_store_refusal"]
