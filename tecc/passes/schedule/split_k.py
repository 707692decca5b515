"""Split-K of a tensorized kernel: the k tiles of each output tile divided among S blocks, whose
float32 partial tiles the last of them to finish sums in a fixed order, in the same kernel (the
layer the `split_k` primitive chooses).

A GEMM with few output tiles (1000³ in 64 x 128 tiles is 128 tiles for 132 SMs, one warpgroup
each) leaves SMs idle or forces small tiles; splitting K multiplies the blocks by S while the
tiles stay large. Split s of an output tile runs k tiles s·C .. s·C + C - 1, C = ⌈⌈K/BK⌉/S⌉
(tile_kernel.py: `k_base`, `k_index`; every split runs C k tiles, and those past K are zero-filled
like the last partial one, so they add exactly 0). The blocks of an output tile are
blockIdx.z = batch·S + s in a grid of one block per tile, or S consecutive work units of the
persistent grid (they run at one time). Then, per output tile and hand-over group -- the block,
or in the warp-specialized kernel each consumer warpgroup, since its producer warpgroup takes no
part in a block barrier --, the handshake of last_block.py:

    partials[tile, s, e, t] = acc[e]       every thread t of the group, every accumulator element
                                           e: a warp's store writes 128 contiguous bytes
    sync                                   __syncthreads, or bar.sync 1 + g, 128 (warpgroup g)
    leader (thread 0 of the group):
        thread_fence()                     release: the group's partials, then its count
        arrived[g] = atomic_add(arrivals[tile · G + g], 1)
        if arrived[g] == S - 1: thread_fence()   acquire: the other splits' partials
    sync                                   arrived[g] is uniform in the group after it
    if arrived[g] == S - 1:                the last split to arrive
        acc[e] = p_0 + p_1 + ... + p_{S-1}  p_s = acc[e] for its own split, load_cg(partials
                                           [tile, s, e, t]) for the others (read at L2)
        <the epilogue as without split-K: registers, staged or TMA stores, bias, cast ...>
        leader: arrivals[tile · G + g] = 0  zero again for the next launch (and the next
                                           tile of a persistent block)

**The reduction order is fixed**: s = 0, 1, ..., S - 1 from the left, whichever split arrives
last, and a split's own term is its registers, the same bits it stored. So the result is
bit-identical run to run and for any arrival order; it differs from the unsplit sum by float
rounding only (S partial sums of C k tiles each, added at the end). No block waits for another
(the last one finds the others done), so no co-residency is assumed and nothing can deadlock.

`partials` (float32, [tiles, S, E, threads], E accumulator elements per thread) and `arrivals`
(int32, zero_init: the host zeroes it once, the last split resets it) are global temporaries the
primitive makes once and keeps in the record, so that every later primitive's kernel names the
same buffers (the module lists them as temporaries).
"""

from __future__ import annotations

from typing import Callable

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, atomic_add, const_int, load_cg, select, size_product, thread_fence
from ...ir.intrinsics import WARPGROUP_SIZE, lookup
from ...ir.stmt import Barrier, Buffer, BufferStore, Evaluate, IfThenElse, NamedBarrier, Stmt, seq
from .epilogue import KernelEpilogue
from .tile_kernel import TileSchedule, ceil_div, int32, int32_shape


def hand_over_groups(record: TileSchedule) -> int:
    """The most groups of a block that hand over their partials on their own: a wgmma kernel's
    consumer warpgroups (each of them when warp-specialized), else the block."""
    return record.threads // WARPGROUP_SIZE if record.row.startswith("wgmma") else 1


def accumulator_elements(record: TileSchedule) -> int:
    """float32 accumulators per thread: the wgmma D fragment, or the mma.sync warp's TM x TN
    tiles of 4 (tensorize.py / tensorize_wgmma.py `fragment_buffers`)."""
    if record.row.startswith("wgmma"):
        return int(lookup(record.row).operand("d").elements)
    return 4 * record.tm * record.tn


def split_buffers(record: TileSchedule, splits: int, taken: Callable[[str], bool]) -> tuple[Buffer, Buffer]:
    """The partial tiles and the arrival counters of a split of `record` into `splits`, named
    after the stage's output (a name `taken` says is in use gets a number)."""
    c = record.contraction
    out = c.store.buffer

    def unique(name: str) -> str:
        n, candidate = 0, name
        while taken(candidate):
            n += 1
            candidate = f"{name}{n}"
        return candidate
    tiles = ceil_div(c.m, record.bm) * ceil_div(c.n, record.bn)
    if c.batch:
        tiles = size_product([ext for _, ext in c.batch]) * tiles
    partials = Buffer(unique(f"{out.name}_partials"), dt.float32,
                      (tiles, int32(splits), int32(accumulator_elements(record)), int32(record.threads)), "global",
                      tensor=f"{out.tensor}.partials")
    arrivals = Buffer(unique(f"{out.name}_arrivals"), dt.int32, (tiles * hand_over_groups(record),), "global",
                      tensor=f"{out.tensor}.arrivals", zero_init=True)
    return partials, arrivals


def check_splits(record: TileSchedule, splits: int, where: str) -> None:
    """ScheduleError unless `splits` can divide the record's k tiles (at least one k tile each
    where K is known)."""
    if not isinstance(splits, int) or splits < 2:
        raise ScheduleError(f"{where}: splits must be an integer of at least 2 (the blocks that share an output "
                            f"tile's k tiles), got {splits!r}")
    if record.splits > 1:
        raise ScheduleError(f"{where}: the k tiles are split already ({record.splits})")
    k_tiles = const_int(ceil_div(record.contraction.kext, record.bk))
    if k_tiles is not None and splits > k_tiles:
        raise ScheduleError(f"{where}: K = {record.contraction.kext} is {k_tiles} k tile(s) of {record.bk}; "
                            f"{splits} splits would leave a split without one")


class SplitReduction(KernelEpilogue):
    """The hand-over of split-K's partial tiles and their fixed-order sum before the epilogue
    (module docstring)."""

    def __init__(self, schedule: TileSchedule) -> None:
        super().__init__(schedule)
        t = self.t
        if t.splits > 1:
            self.partials, self.arrivals = t.split_buffers
            self.arrived = Buffer("split_arrived", dt.int32, int32_shape(hand_over_groups(t)), "shared",
                                  tensor=f"{t.stage}.arrived")

    def split_shared(self) -> list[Buffer]:
        """The shared buffers of the hand-over (the leaders' atomic results)."""
        return [self.arrived] if self.t.splits > 1 else []

    def split_summary(self) -> str:
        t = self.t
        if t.splits == 1:
            return ""
        return (f"; split-K {t.splits} ({self.k_tiles} k tiles each; the last split to arrive sums the float32 "
                "partials in split order)")

    def epilogue(self) -> Stmt:
        return self.after_reduction(super().epilogue())

    def staged_epilogue(self) -> Stmt:
        # The TMA-store epilogue's BN / 4 swizzled staging addresses stay as ptxas places them:
        # computed once at the kernel's start and live through the sum of the partials (fewer
        # loads in flight there). Derived instead from the thread index read again after the sum
        # (`opaque`), they cost ~25 integer instructions per element on the critical path (sm_90a
        # SASS of 1024 x 1024 x 8192, 128 x 256, S = 4: 3732 epilogue instructions per thread
        # against 519), and the H200 timed every such kernel ~3 us slower (42.7 -> 45.6 us; 1024
        # x 1024 x 4096's 128 x 128 split 2 20.1 -> 23.05; 1000^3 12.95 -> 15.95).
        return self.after_reduction(super().staged_epilogue())

    def after_reduction(self, finish: Stmt) -> Stmt:
        """`finish` (the epilogue) as it is, or with split-K after the hand-over, in the last
        split only, on the summed accumulators (module docstring)."""
        t = self.t
        if t.splits == 1:
            return finish
        # the warp-specialized kernel's producer warpgroup takes no part: a named barrier per
        # consumer warpgroup (id 1 + g, as the TMA-store epilogue's); else the block's barrier
        specialized = t.warp_specialized
        groups = self.consumers if specialized else 1
        size = t.threads // groups
        group: Expr = self.tx // size if groups > 1 else Const(0, dt.int32)
        sync = NamedBarrier(group + 1, size) if specialized else Barrier()
        leader = (self.tx % size == 0) if groups > 1 else (self.tx == 0)
        tile = self.output_tile_number()
        counter = tile * hand_over_groups(t) + group
        elements = const_int(self.frag_c.shape[0])
        assert elements is not None
        zero = Const(0, dt.int32)
        acc = self.frag_c

        def publish(e: Expr) -> Stmt:
            return BufferStore(self.partials, (tile, self.split, e, self.tx), acc[e])

        def total(e: Expr) -> Stmt:
            value: Expr | None = None
            for s in range(t.splits):   # the fixed order: split 0 first
                term = select(self.split == s, acc[e], load_cg(self.partials[tile, int32(s), e, self.tx]))
                value = term if value is None else value + term
            assert value is not None
            return BufferStore(acc, (e,), value)
        last = self.arrived[group] == t.splits - 1
        return seq(
            self.unrolled("split_store", elements, publish),
            sync,           # every partial of the group is stored before the leader's fence
            IfThenElse(leader, seq(
                Evaluate(thread_fence()),   # release: the group's partials, then its count
                BufferStore(self.arrived, (group,), atomic_add(self.arrivals[counter], 1)),
                IfThenElse(last, Evaluate(thread_fence())))),   # acquire: the other splits' partials
            sync,           # hands the count to the group: arrived[group] is uniform after it
            IfThenElse(last, seq(
                self.unrolled("split_sum", elements, total),
                finish,
                IfThenElse(leader, BufferStore(self.arrivals, (counter,), zero)))))   # zero for the next launch


__all__ = ["SplitReduction", "accumulator_elements", "check_splits", "hand_over_groups", "split_buffers"]
