"""scatter_atomic: a scatter (`tc.scatter_add`, or any masked sum with data-dependent matches)
realized with atomic additions (tecc.passes.rewrite.scatter_atomic) instead of as the reduction
it lowers to.

The lowered scatter is a reduction whose every output element scans the whole domain (embedding
backward: V·D outputs × N tokens); the reduction strategies price that form, and it is the one a
deterministic build keeps. This strategy prices the atomic form -- three kernels, each the
blocked elementwise mapping (`items` groups per thread of `threads`; the init and finish kernels
also 4-wide vectors along the output's rows when their length is a constant multiple of 4):

  init     the output (or its float32 accumulator) set to `init` or zero: |out| written
  adds     one atomic addition per domain point: the value's inputs read once, and at L2 each
           addition a read-modify-write of its element (one sector per 8 float32 lanes when the
           innermost domain loop walks the output's unit-stride axis, a sector per lane when not);
           the elements it touches come from and go back to DRAM (at most |out| of them)
  finish   the accumulator rounded to the output's dtype (16-bit outputs only)

Repeated indices serialize: the L2 slice that owns an element applies its additions one after
another. With the indices unknown until run time the model takes them uniform, so the busiest
element gets ceil(domain rows / matched positions) additions, each ATOMIC_SAME_ADDRESS_CYCLES
(an estimate of the L2 atomic unit's turnaround, not measured here
measures it: benchmarks/gather_scatter.py) -- the `serial` term.

The guard refuses deterministic builds (`Target.deterministic`): float atomics add in the order the
hardware picks, so their sums change in the last bits from run to run.
"""

from __future__ import annotations

from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import KernelInfo, ScatterFacts
from ..cost.model import Workload
from ..cost.traffic import buffer_bytes
from .elementwise import schedule_blocked
from .registry import Point, Strategy, register

THREADS = (128, 256, 512)
ITEMS = (1, 4)
VECTOR = 4
ATOMIC_SAME_ADDRESS_CYCLES = 4.0   # L2 clocks between two atomics on one element (estimate)
SECTOR = 32


def _flat_workload(elements: int, threads: int, per_thread: int, read_bytes: float, write_bytes: float,
                   itemsize: int, per_element_instructions: float) -> Workload:
    """`per_thread` elements per thread of a flat loop of `elements`: coalesced reads and writes."""
    blocks = max(1, -(-elements // (threads * per_thread)))
    moved = read_bytes + write_bytes
    return Workload(blocks=blocks, threads=threads, registers={"addressing": 14, "values": 2 + 2 * per_thread},
                    dram_bytes=moved, l2_bytes=moved, global_wavefronts=moved / 128.0,
                    instructions=elements / 32.0 * per_element_instructions,
                    bytes_in_flight=float(itemsize * per_thread), ilp=float(per_thread))


def flat_vector(info: KernelInfo) -> int:
    """The vector width of the init and finish kernels: VECTOR when the output's rows are a
    constant multiple of it (the emitter proves the alignment; otherwise it unrolls)."""
    inner, extent = info.spatial[-1]
    if inner in info.symbolic or any(inner == name for name, _ in info.assumed) or extent % VECTOR:
        return 1
    return VECTOR


class ScatterAtomic(Strategy):
    name = "scatter_atomic"
    description = "a scatter's matches added with atomics: init, one addition per domain point, finish"
    priority = 0

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if info.scatter is None:
            return "not a scatter (a masked sum whose output axes are matched by data-dependent equations)"
        if target.deterministic:
            return ("deterministic build: atomic float additions land in an order that changes run to run; "
                    "the scatter is summed per output element instead")
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        for t in THREADS:
            for items in ITEMS:
                yield {"threads": t, "items": items}

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        facts = info.scatter
        assert facts is not None
        threads, items = int(point["threads"]), int(point.get("items", 1))
        outputs = info.outputs
        acc = facts.acc_itemsize
        out_bytes = outputs * info.write.itemsize
        reads = {a.buffer: a for a in info.reads}
        value_bytes = float(sum(buffer_bytes(a) for a in reads.values()))
        flat = flat_vector(info) * items
        init = _flat_workload(outputs, threads, flat, 0.0, outputs * acc, acc, 6.0)
        adds = self._adds(info, facts, threads, items, value_bytes)
        if facts.finish:
            adds.then = _flat_workload(outputs, threads, flat, outputs * acc, out_bytes, acc, 6.0)
        init.then = adds
        init.notes.append(f"atomic scatter: {facts.points} additions into {outputs} elements "
                          f"(~{self._repeats(facts)} per element where indices repeat uniformly)")
        return init

    @staticmethod
    def _repeats(facts: ScatterFacts) -> int:
        """Additions per output element when the indices spread uniformly over the matched
        positions: each of them receives summed / matched of the scanned points."""
        return max(1, -(-facts.summed // max(1, facts.matched)))

    def _adds(self, info: KernelInfo, facts: ScatterFacts, threads: int, items: int, value_bytes: float) -> Workload:
        points = facts.points
        acc = facts.acc_itemsize
        touched = min(info.outputs, points)
        per_addition = acc if facts.coalesced else SECTOR
        l2 = value_bytes + 2.0 * points * per_addition
        dram = value_bytes + 2.0 * touched * acc
        w = Workload(blocks=max(1, -(-points // (threads * items))), threads=threads,
                     registers={"addressing": 16 + 2 * len(info.reads), "values": 4 * items},
                     dram_bytes=dram, l2_bytes=l2, global_wavefronts=l2 / 128.0,
                     instructions=points / 32.0 * (len(info.reads) + 8.0), bytes_in_flight=float(acc * items),
                     ilp=float(items))
        w.serial_cycles = self._repeats(facts) * ATOMIC_SAME_ADDRESS_CYCLES
        return w

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        from ..schedule import StageRV

        threads, items = int(point["threads"]), int(point.get("items", 1))
        init, adds, *finish = sch.scatter_atomic(info.stage)
        vector = flat_vector(info)
        for kernel in [init] + finish:
            schedule_blocked(sch, sch.get_loops(StageRV(kernel, info.stage)), threads, vector, items)
        schedule_blocked(sch, sch.get_loops(StageRV(adds, info.stage)), threads, 1, items)

    def describe(self, point: Point) -> str:
        return f"scatter_atomic(threads={point['threads']}, items/thread={point.get('items', 1)})"


register(ScatterAtomic())
