"""elementwise: kernels without a reduction, coalesced and vectorized, blocked or grid-stride.

Point: threads per block, vector width V (the innermost axis split by V and vectorized: one
8/16-byte access per lane where the emitter can prove alignment, else an unrolled run of V),
and either `items` vector groups per thread (blocked: block b covers items·threads groups, item
u of thread t is group (b·items + u)·threads + t, so each item's warp access stays contiguous) or
a fixed grid of `grid` blocks that strides over the output (grid-stride loop).

Schedule: split(inner axis, V) → fuse the rest with the outer part → split into
(blocks, items, threads) or (rounds, grid, threads) → reorder so the thread loop is outside the
per-thread loop → bind → vectorize / unroll."""

from __future__ import annotations

from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import RANDOM_SHARED_SAVING, KernelInfo
from ..cost.model import Workload
from ._simple import simple_workload
from .registry import Point, Strategy, register

THREADS = (64, 128, 256, 512, 1024)
VECTORS = (1, 2, 4, 8)      # 8: 16-bit elements only (16 bytes)
ITEMS = (1, 2, 4)
GRID_WAVES = (1, 2, 4)      # grid-stride: this many full waves of blocks


def vector_provable(info: KernelInfo, vector: int) -> bool:
    """Whether the emitter can prove the V-wide accesses aligned: the innermost extent is a
    constant multiple of V and every buffer read along it is row-major with unit stride."""
    if vector == 1:
        return True
    inner, extent = info.spatial[-1]
    if extent % vector or inner in info.symbolic or info.strided_inputs:
        return False
    if any(s for s, _ in info.assumed):
        return False
    # one element size for every access, and a width the emitter turns into one access of at
    # most 16 bytes (codegen/vectorize.py: float2/float4 for 32-bit, 2/4/8 elements for 16-bit).
    # A read of one element for the whole kernel (a scalar tensor: tc.rand's int64 seed) is no
    # vector access: it does not count.
    sizes = {info.write.itemsize} | {a.itemsize for a in info.reads if a.offset is not None and a.offset.vars}
    if len(sizes) != 1:
        return False
    (size,) = sizes
    return size in (2, 4) and vector * size <= 16


class Elementwise(Strategy):
    name = "elementwise"
    description = "coalesced elementwise: vector width, items per thread, blocked or grid-stride"

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if info.reduction:
            return "the kernel has a reduction"
        if not info.spatial:
            return "a 0-d output (nothing to spread over threads)"
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        inner = info.spatial[-1][1]
        # widest first: the planner's sort is stable, so at equal predicted time (every point of
        # a large elementwise kernel is DRAM-bound) the fewer, wider accesses win the tie
        for v in sorted(VECTORS, reverse=True):
            if v > 1 and inner < v:
                continue
            if v == 8 and not vector_provable(info, v):
                continue
            for t in THREADS:
                for items in ITEMS:
                    yield {"threads": t, "vector": v, "mode": "blocked", "items": items}
                per_sm = min(max(1, target.max_threads_per_sm // t), target.max_blocks_per_sm)
                for waves in GRID_WAVES:
                    grid = waves * target.sm_count * per_sm
                    if grid * t * v < info.outputs:      # otherwise it is the blocked mapping
                        yield {"threads": t, "vector": v, "mode": "grid_stride", "grid": grid}

    def _blocks(self, info: KernelInfo, point: Point, target: Target) -> int | None:
        return int(point["grid"]) if point["mode"] == "grid_stride" else None

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        v = int(point["vector"])
        provable = vector_provable(info, v)
        blocks = self._blocks(info, point, target)
        items = int(point.get("items", 1))
        if blocks is not None:
            items = max(1, -(-info.outputs // (blocks * int(point["threads"]) * v)))
        w = simple_workload(info, target, threads=int(point["threads"]), vector=v if provable else 1,
                            items=items * (1 if provable else v), blocks=blocks,
                            grid_stride=blocks is not None)
        if not provable and v > 1:
            w.notes.append(f"vector {v} not provably aligned: emitted as {v} scalar accesses")
        self._price_arithmetic(info, w, shared_random=provable and v % 4 == 0)
        return w

    @staticmethod
    def _price_arithmetic(info: KernelInfo, w: Workload, shared_random: bool = False) -> None:
        """Replace simple_workload's one instruction per FP op by the IR's issued-instruction
        count (analysis.INSTRUCTION_COST: a precise sinf is ~40, not 1; a bf16<->fp32 convert
        is 1), so that where the arithmetic, not DRAM, bounds the kernel (bf16 sin: twice the
        elements per byte of fp32) the `issue` term sees it and ranks points by how many
        instructions and warps they give the schedulers."""
        arith = info.arith_instructions_per_iteration
        if arith is None:
            return
        if shared_random:  # one Philox call per four elements of a tc.rand (codegen/philox.py)
            arith -= info.random_per_iteration * RANDOM_SHARED_SAVING
        extra = arith - info.flops_per_iteration
        if extra > 0:
            w.instructions += extra * info.outputs / 32
        per_element = w.instructions * 32 / max(info.outputs, 1)
        w.notes.append(f"issue: ~{per_element:.1f} instructions/element ({arith:.0f} arithmetic incl. "
                       f"intrinsics and conversions, the rest loads, stores, index and loop math)")

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        loops = sch.get_loops(info.stage)[:len(info.spatial)]
        v = int(point["vector"])
        t = int(point["threads"])
        if point["mode"] != "grid_stride":
            schedule_blocked(sch, loops, t, v, int(point["items"]))
            return
        inner_vec = None
        if v > 1:
            outer, inner_vec = sch.split(loops[-1], v)
            loops = loops[:-1] + [outer]
        fused = loops[0]
        for lp in loops[1:]:
            fused = sch.fuse(fused, lp)
        grid = int(point["grid"])
        rounds, g, th = sch.split(fused, factors=[None, grid, t])
        sch.reorder(g, th, rounds)
        sch.bind(g, "blockIdx.x")
        sch.bind(th, "threadIdx.x")
        if inner_vec is not None:
            sch.vectorize(inner_vec)

    def describe(self, point: Point) -> str:
        if point["mode"] == "grid_stride":
            return (f"elementwise(grid-stride, grid={point.get('grid', '?')}, threads={point['threads']}, "
                    f"vector={point['vector']})")
        return f"elementwise(threads={point['threads']}, vector={point['vector']}, items/thread={point['items']})"


def schedule_blocked(sch: Any, loops: list[Any], threads: int, vector: int = 1, items: int = 1) -> None:
    """The blocked mapping of a loop nest (the module docstring): the innermost loop split by
    `vector` and vectorized, the rest fused, `items` vector groups per thread of `threads`.
    Also what other strategies use for a kernel of their own that is elementwise."""
    inner_vec = None
    if vector > 1:
        outer, inner_vec = sch.split(loops[-1], vector)
        loops = loops[:-1] + [outer]
    fused = loops[0]
    for lp in loops[1:]:
        fused = sch.fuse(fused, lp)
    if items > 1:
        b, u, th = sch.split(fused, factors=[None, items, threads])
        sch.reorder(b, th, u)
        sch.bind(b, "blockIdx.x")
        sch.bind(th, "threadIdx.x")
        sch.unroll(u)
    else:
        b, th = sch.split(fused, factors=[None, threads])
        sch.bind(b, "blockIdx.x")
        sch.bind(th, "threadIdx.x")
    if inner_vec is not None:
        sch.vectorize(inner_vec)


register(Elementwise())
