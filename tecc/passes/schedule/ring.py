"""The k-tile loop of a tensorized kernel: how operand tiles reach shared memory while the tensor
cores work on earlier ones (the layer the `pipeline`, `pipeline_fragments` and
`warp_specialize` primitives choose).

The family supplies the compute of one k tile (`compute_tile`: fragment loads and mma.sync, or
wgmmas with P groups left in flight), what must precede the barrier that publishes a tile
(`publish`: wgmma reads through the async proxy, so a proxy fence), and what pins the
accumulators after the loop (`drain`). A family whose compute reads registers until it
completes (wgmma's register X) alternates two register sets: two k tiles per trip (`k_loop`).

- Unpipelined (tensorize alone): one buffer; per k tile a barrier (every warp is done with the
  previous tile), the loads, their wait, the barrier that publishes them, the compute.
- cp.async ring (`pipeline(loop, S)`): D tiles are loaded ahead, one commit group each, before
  the loop; iteration kt waits until at most D - 1 groups are in flight (tile kt has landed),
  publishes, barriers (every thread's copies are visible; every warp is done with the tile D
  stages back), refills stage (kt + D) % S, commits (a group even when empty, so "D - 1 most
  recent" always means the tiles after kt), and computes stage kt. mma.sync computes
  synchronously, so D = S - 1; wgmma reads shared memory until its group is waited for, so with
  P groups in flight D = S - 1 - P (tensorize_wgmma.py, step 3). The emulator proves the rings
  race-free; element loads land in the refilled stage after the compute.
- Pipelined fragments (`pipeline_fragments`, mma.sync): two fragment sets, k step s in set s % 2
  (an even number of steps per tile); while the mma of step s run, the ldmatrix of step s + 1
  fill the other set; the ring's wait (S - 2) and barrier come before the last step, whose next
  fragments are step 0 of tile kt + 1, and tile kt + S is issued right after that barrier into
  stage kt % S (every warp has read all of it by then), so the prologue fills all S stages.
  docs/tensor-cores.md draws the loop.
- TMA ring (`pipeline(loop, S, producer="tma")`, wgmma): thread 0 issues each tile as TMA box
  copies completing on an mbarrier full[s] (tma.py); every thread waits on full[kt % S] for
  parity (kt / S) % 2, then the barrier frees the stage D back for thread 0's refill. TMA and
  wgmma are both async-proxy accesses ordered by the mbarrier: no proxy fence.
- Warp-specialized (`warp_specialize`): a producer warpgroup's thread issues the TMA loads into
  the ring, consumer warpgroups wait on full[], compute, and release the stage through an
  arrival on empty[] once its wgmmas completed (tma.py's docstring has the protocol); the one
  __syncthreads is after the barriers' initialization. In a persistent grid both roles loop over
  the block's tiles and the ring's phases run on across them (`ring_index`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ...ir import dtype as dt
from ...ir.expr import Const, Expr, Var, const_int
from ...ir.intrinsics import WARPGROUP_SIZE
from ...ir.stmt import (
    AsyncCommit,
    AsyncProxyFence,
    AsyncWait,
    Barrier,
    BarrierArrive,
    BarrierExpectTx,
    BarrierInit,
    BarrierRef,
    BarrierWait,
    Buffer,
    BufferStore,
    BulkWait,
    For,
    IfThenElse,
    SetMaxRegisters,
    Stmt,
    TensorMap,
    TensorMapPrefetch,
    seq,
)
from .implicit_gemm import Operand
from .split_k import SplitReduction
from .tile_kernel import TileSchedule, int32, int32_shape

PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = {2: 232}   # consumer warpgroups -> setmaxnreg.inc target (tma.py, "roles")


def ring_fill(tiles: int, load: Callable[[int], Stmt | None]) -> list[Stmt]:
    """The fill of a cp.async ring before its loop: tile s's copies (`load(s)`, which guards a
    tile that may be past the end, or is None for one known to be) and a commit, for s <
    `tiles`: one commit group per tile even when it is empty, so that the loop's wait counts stay
    uniform. The GEMM's rings (`Pipeline.ring_prologue`) and the attention kernel's K/V ring
    (passes/rewrite/online_mma_loop.py) fill this way."""
    out: list[Stmt] = []
    for s in range(tiles):
        load_s = load(s)
        if load_s is not None:
            out.append(load_s)
        out.append(AsyncCommit())
    return out


def ring_step(lookahead: int, publish: Sequence[Stmt], ahead: Expr, tiles: Expr, refill: Stmt,
              guarded: bool = True) -> list[Stmt]:
    """The head of iteration kt of a cp.async ring that keeps `lookahead` tiles ahead of the one
    computed, one commit group per tile: wait until tile kt has landed (at most lookahead - 1
    later groups in flight), `publish` (what must precede the barrier: wgmma reads through the
    async proxy, so a proxy fence), the barrier (every thread's copies of tile kt are visible;
    every warp is done with the stage tile `ahead` refills, computed lookahead iterations ago),
    the refill when `ahead` < `tiles` (always, not `guarded`: copies that zero-fill past the end),
    and its commit (a group even when empty). The compute of tile kt follows. The GEMM's ring
    (`Pipeline.copy_ring`) and the attention kernels' rings (passes/rewrite/online_mma_loop.py,
    the backward's) are this loop."""
    return [AsyncWait(max(lookahead - 1, 0)), *publish, Barrier(),
            IfThenElse(ahead < tiles, refill) if guarded else refill, AsyncCommit()]


class Pipeline(SplitReduction):
    """The k-tile loop (module docstring)."""

    def __init__(self, schedule: TileSchedule) -> None:
        super().__init__(schedule)
        t = self.t
        if t.producer == "tma":
            self.full = Buffer("full_bar", dt.int64, int32_shape(t.stages), "shared")
            self.empty = Buffer("empty_bar", dt.int64, int32_shape(t.stages), "shared")

    def block_threads(self) -> int:
        return self.t.threads + (WARPGROUP_SIZE if self.t.warp_specialized else 0)

    def buffers(self) -> list[Buffer]:
        """The kernel's allocations, the last outermost: the operand tiles, the staged output,
        the element loads' registers, the ring's mbarriers, the fragments."""
        t = self.t
        out = [self.shared["A"], self.shared["B"]]
        if self.out_tile is not None:
            out.append(self.out_tile)
        if self.store_staged or self.store_threads:
            out.append(self.staging)
        if self.previous is not None:
            out.append(self.previous)
        out.extend(self.fetched.values())
        if t.producer == "tma":
            out.append(self.full)
        if t.warp_specialized:
            out.append(self.empty)
        out.extend(self.split_shared())
        out.extend(self.fragments)
        return out

    # ---- what the family supplies --------------------------------------------------------------
    def compute_tile(self, stage: Expr, registers: int, pending: int) -> Stmt:
        """The compute of the k tile in ring stage `stage` (`registers`: the register set of a
        register operand; `pending`: wgmma groups it may leave in flight)."""
        raise NotImplementedError

    def publish(self) -> list[Stmt]:
        """What makes the landed copies readable by the compute, before the block's barrier."""
        return []

    def drain(self) -> Stmt | None:
        """What pins the accumulators after the loop (None: nothing is in flight)."""
        return None

    def register_sets(self) -> int:
        """Register sets the compute alternates between k tiles (2: two k tiles per trip)."""
        return 1

    def k_steps(self) -> int:
        """mma.sync (pipelined fragments): intrinsic k steps per k tile."""
        raise NotImplementedError

    def fragment_loads(self, stage: Expr, kk: Expr, buffer: Expr | int) -> Stmt:
        """mma.sync (pipelined fragments): k step `kk`'s fragments of ring stage `stage` into set `buffer`."""
        raise NotImplementedError

    def mmas(self, buffer: Expr | int) -> Stmt:
        """mma.sync (pipelined fragments): one k step's mma from fragment set `buffer`."""
        raise NotImplementedError

    def ring_bytes(self) -> int:
        """TMA rings: the bytes of one stage (both operands' boxes)."""
        raise NotImplementedError

    def tile_copies(self, op: Operand, stage: Expr, k_tile: Expr, bar: BarrierRef) -> list[Stmt]:
        """TMA rings: the box copies of the operand's tile of `k_tile` into `stage`, completing on `bar`."""
        raise NotImplementedError

    def tma_maps(self) -> list[TensorMap]:
        """TMA rings: the tensor maps the kernel copies and stores through."""
        return []

    def ahead(self) -> int:
        """D: k tiles the ring loads ahead of the one computed."""
        return self.t.stages - 1

    def in_flight(self) -> int:
        """P: compute groups left in flight per k tile."""
        return 0

    # ---- the loops --------------------------------------------------------------------------------
    def pipeline(self) -> Stmt:
        """The main loop being built, by the record's pipeline (module docstring)."""
        t = self.t
        if t.warp_specialized:
            return self.specialized_ring()
        if t.producer == "tma":
            return self.tma_ring()
        if t.stages == 1:
            return self.unpipelined_loop()
        if t.fragment_pipeline:
            return self.pipelined_loop()
        return self.copy_ring()

    def zero_accumulators(self) -> Stmt:
        elements = const_int(self.frag_c.shape[0])
        assert elements is not None
        return self.unrolled("zero", elements, lambda z: BufferStore(self.frag_c, (z,), Const(0.0, dt.float32)))

    def k_loop(self, iteration: Callable[[Expr, int], Stmt], sets: int | None = None) -> Stmt:
        """The loop over k tiles, `iteration(kt, register set)` each; with two register sets, two
        k tiles per trip, the second guarded (the set written at tile kt was last read by tile
        kt - 2, complete since the wait of tile kt - 1)."""
        if (sets or self.register_sets()) == 2:
            pair = Var("k_pair")
            second = 2 * pair + 1
            return For(pair, int32(0), (self.k_tiles + 1) // 2, "serial", seq(
                iteration(2 * pair, 0),
                IfThenElse(second < self.k_tiles, iteration(second, 1))))
        return For(self.kt, int32(0), self.k_tiles, "serial", iteration(self.kt, 0))

    def unpipelined_loop(self) -> Stmt:
        """One buffer, loaded and published before each k tile is computed."""
        asynchronous = any(self.asynchronous(op) for op in (self.c.a, self.c.b))
        stage = int32(0)

        def iteration(kt: Expr, registers: int) -> Stmt:
            issue, finish = self.load_stage(stage, kt)
            return seq(
                Barrier(),              # every warp is done with the previous tile
                issue,
                finish,
                AsyncCommit() if asynchronous else None,
                AsyncWait(0) if asynchronous else None,
                *self.publish(),
                Barrier(),              # every thread's part of the tile is visible
                self.compute_tile(stage, registers, 0))
        zero = self.zero_accumulators()
        return seq(zero, self.k_loop(iteration, sets=1), self.drain(), self.epilogue())

    def ring_prologue(self, tiles: int) -> list[Stmt]:
        """The ring's fill before the k loop: tiles 0 .. `tiles` - 1 into stages of the same
        number, one commit group per tile even when K has fewer (a tile past a known K is not
        loaded; with a symbolic K each load is guarded), so the loop's wait counts stay uniform."""
        known = const_int(self.k_tiles)

        def load(s: int) -> Stmt | None:
            # built even when not kept: the copy loops' names count every load built
            issue, finish = self.load_stage(Const(s, dt.int32), Const(s, dt.int32))
            if known is None:
                return IfThenElse(Const(s, dt.int32) < self.k_tiles, seq(issue, finish))
            return seq(issue, finish) if s < known else None
        return ring_fill(tiles, load)

    def copy_ring(self) -> Stmt:
        """The cp.async ring (module docstring)."""
        t = self.t
        lookahead = self.ahead()
        zero = self.zero_accumulators()
        prologue = self.ring_prologue(lookahead)

        def iteration(kt: Expr, registers: int) -> Stmt:
            ahead = kt + lookahead
            issue, finish = self.load_stage(ahead % t.stages, ahead)
            stage = kt % t.stages
            return seq(
                *ring_step(lookahead, self.publish(), ahead, self.k_tiles, issue),
                self.compute_tile(stage, registers, self.in_flight()),
                # element loads land in the refilled stage (free since the barrier) after the compute
                IfThenElse(ahead < self.k_tiles, finish) if finish is not None else None,
            )
        loop = self.k_loop(iteration)
        return seq(zero, *prologue, loop, self.drain(), AsyncWait(0), self.epilogue())

    def pipelined_loop(self) -> Stmt:
        """The cp.async ring with the fragments pipelined across the k-tile boundary (module
        docstring). Before the last step of tile kt the S + kt groups committed leave at most
        S - 2 in flight once tile kt + 1 has landed."""
        t = self.t
        zero = self.zero_accumulators()
        prologue = self.ring_prologue(t.stages)
        steps = self.k_steps()
        first = seq(AsyncWait(t.stages - 1), Barrier(),   # tile 0 has landed, for every thread
                    self.fragment_loads(Const(0, dt.int32), Const(0, dt.int32), 0))
        ahead = self.kt + t.stages
        stage = self.kt % t.stages
        # cp.async copies are issued after the barrier; element loads are fetched into registers
        # at the top of the tile and stored to the freed stage after the barrier, so their
        # latency overlaps the first steps' mma
        copies: list[Stmt] = []
        fetches: list[Stmt] = []
        stores: list[Stmt] = []
        for op in (self.c.a, self.c.b):
            first_part, store = self.load_tile(op, stage, self.k_index(ahead) * t.bk)
            if store is None:
                copies.append(first_part)
            else:
                fetches.append(first_part)
                stores.append(store)
        refill = seq(*copies) if copies else None
        fetch = seq(*fetches) if fetches else None
        store_fetched = seq(*stores) if stores else None

        def step(kk: Var) -> Stmt:
            return seq(self.fragment_loads(stage, kk + 1, (kk + 1) % 2), self.mmas(kk % 2))
        fetched = IfThenElse(ahead < self.k_tiles, fetch) if fetch is not None else None
        inner = self.unrolled("k_step", steps - 1, step) if steps > 1 else None
        # the next tile's step 0 reads stage (kt + 1) % S, which no copy has written when K has
        # fewer than S tiles (an uninitialized read): load it only for a next tile then, and
        # always when K has S tiles or more (the last tile then reads a stale stage, unused)
        following = self.fragment_loads((self.kt + 1) % t.stages, Const(0, dt.int32), 0)
        known = const_int(self.k_tiles)
        if known is None or known < t.stages:
            following = IfThenElse(self.kt + 1 < self.k_tiles, following)
        last = seq(
            AsyncWait(t.stages - 2),   # tile kt + 1 has landed (at most S - 2 later groups in flight)
            Barrier(),                 # ... for every thread, and every warp is done with stage kt
            IfThenElse(ahead < self.k_tiles, refill) if refill is not None else None,
            AsyncCommit(),             # possibly empty, so the group count per tile is fixed
            IfThenElse(ahead < self.k_tiles, store_fetched) if store_fetched is not None else None,
            following,
            self.mmas((steps - 1) % 2),
        )
        loop = For(self.kt, int32(0), self.k_tiles, "serial", seq(fetched, inner, last))
        return seq(zero, *prologue, first, loop, AsyncWait(0), self.epilogue())

    # ---- the mbarrier rings ---------------------------------------------------------------------------
    def barrier_init(self, warps: int | None) -> Stmt:
        """Thread 0 prefetches the kernel's tensor maps (prefetch.tensormap: the TMA unit's first
        copy then finds its descriptor cached instead of fetching it from the parameter space
        after the barrier), arms full[s] (count 1: the issuing thread's expect-tx) and, for a
        warp-specialized ring, empty[s] (count `warps`: one arrival per consumer warp), then
        makes them visible to the TMA unit (async proxy)."""
        S = self.t.stages
        return IfThenElse(self.tx == 0, seq(
            *[TensorMapPrefetch(m) for m in self.tma_maps()],
            *[BarrierInit(BarrierRef(self.full, Const(s, dt.int32)), int32(1)) for s in range(S)],
            *([BarrierInit(BarrierRef(self.empty, Const(s, dt.int32)), int32(warps)) for s in range(S)]
              if warps is not None else []),
            AsyncProxyFence()))

    def tile_load(self, g: Expr, kt: Expr) -> Stmt:
        """Ring entry g (stage g % S) gets k tile kt of the block's tile: the expected bytes on
        full[g % S], then the TMA box copies completing there."""
        stage = g % self.t.stages
        full = BarrierRef(self.full, stage)
        return seq(BarrierExpectTx(full, int32(self.ring_bytes())),
                   *self.tile_copies(self.c.a, stage, kt, full),
                   *self.tile_copies(self.c.b, stage, kt, full))

    def tma_ring(self) -> Stmt:
        """The TMA ring without warp specialization (module docstring)."""
        t = self.t
        S, lookahead = t.stages, self.ahead()
        zero = self.zero_accumulators()
        known = const_int(self.k_tiles)
        prologue: list[Stmt] = []
        for s in range(lookahead):
            load = IfThenElse(self.tx == 0, self.tile_load(int32(s), int32(s)))
            if known is None:
                prologue.append(IfThenElse(int32(s) < self.k_tiles, load))
            elif s < known:
                prologue.append(load)

        def iteration(kt: Expr, registers: int) -> Stmt:
            ahead = kt + lookahead
            return seq(
                BarrierWait(BarrierRef(self.full, kt % S), (kt // S) % 2),   # tile kt landed
                Barrier(),     # every warpgroup's wgmmas of the tile D stages back are complete
                IfThenElse((ahead < self.k_tiles) & (self.tx == 0), self.tile_load(ahead, ahead)),
                self.compute_tile(kt % S, registers, self.in_flight()))
        loop = self.k_loop(iteration)
        return seq(self.barrier_init(None), Barrier(), zero, *prologue, loop, self.drain(), self.epilogue())

    def specialized_ring(self) -> Stmt:
        """The warp-specialized ring: a producer warpgroup and the consumer warpgroups, two loops
        (module docstring; tma.py has the protocol)."""
        t = self.t
        S = t.stages
        thread = self.tx % WARPGROUP_SIZE
        producer = self.warpgroup == self.consumers
        init = self.barrier_init(4 * self.consumers)
        zero = self.zero_accumulators()

        def produce(kt: Var) -> Stmt:
            g = self.ring_index(kt)
            return IfThenElse(thread == 0, seq(
                BarrierWait(BarrierRef(self.empty, g % S), (g // S + 1) % 2),   # stage free
                self.tile_load(g, kt)))

        def consume(kt: Expr, registers: int) -> Stmt:
            g = self.ring_index(kt)
            stage = g % S
            release = IfThenElse((g > 0) & (self.lane == 0),
                                 BarrierArrive(BarrierRef(self.empty, (g + (S - 1)) % S)))
            return seq(
                BarrierWait(BarrierRef(self.full, stage), (g // S) % 2),
                self.compute_tile(stage, registers, 1),
                release if t.release else None,
                # the threads' copy of the previous tile, while this k tile's wgmmas run
                self.deferred_copy(kt))

        consume_loop = self.k_loop(consume)
        load_tile = Var("load_tile")
        registers = self.consumers in CONSUMER_REGISTERS
        producer_role = seq(
            SetMaxRegisters(PRODUCER_REGISTERS, False) if registers else None,
            self.for_each_tile(For(load_tile, int32(0), self.k_tiles, "serial", produce(load_tile))))
        consumer_role = seq(
            SetMaxRegisters(CONSUMER_REGISTERS[self.consumers], True) if registers else None,
            self.for_each_tile(seq(
                zero,
                consume_loop,
                self.drain(),
                self.staged_epilogue() if self.store_staged or self.store_threads else self.epilogue())),
            self.final_copy(),
            # the last tile's stores must have read the staging tile before the block exits
            IfThenElse(thread == 0, BulkWait(0)) if self.store_staged else None)
        return seq(init, Barrier(), IfThenElse(producer, producer_role, consumer_role))


__all__ = ["CONSUMER_REGISTERS", "PRODUCER_REGISTERS", "Pipeline", "ring_fill", "ring_step"]
