"""reduction: kernels with a reduction that is not a contraction (row, column, generic).

Two mappings, one point space:

* `thread` (column / generic): one thread per output element, the spatial axes fused over
  `threads`-thread blocks, the innermost reduction loop split by `unroll` and unrolled. Coalesced
  when consecutive outputs read consecutive addresses (a column reduction such as a sum over a
  middle axis); for a row reduction every lane walks its own row (uncoalesced).
* `row_staged` (row: the reduced axis is the unit-stride axis of the main read): a block of
  `threads` rows walks the row in tiles of `tile` columns; each tile is first copied into
  shared memory by all threads of the block, consecutive threads taking consecutive columns
  (coalesced), then each thread reduces its row from shared memory. `pad` pads the shared rows
  (storage_align) so the column walk of 32 threads hits 32 different banks.

Not expressible yet with the schedule primitives: a warp- or block-cooperative reduction of one
row (warp shuffles / a shared-memory tree, i.e. rfactor + cross-thread reduction); the row
mapping above is the best one-thread-per-row form. The block-per-row forms are graph-level
rewrites (row_fused: one block per row; split_rows: a grid over few long rows or a full
reduction), which the planner's region search (compiler/region_search.py) offers for a row
reduction inside a larger program, its row group or the reduction alone, and weighs against
this strategy's points.
"""

from __future__ import annotations

from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import Access, KernelInfo
from ..cost.model import Workload
from ..cost.traffic import buffer_bytes, compulsory_bytes
from ..cost.warp import WARP, global_cost, shared_wavefronts
from ._simple import simple_workload
from .registry import Point, Strategy, register

THREADS = (32, 64, 128, 256, 512)
UNROLL = (1, 2, 4, 8)
TILES = (8, 16, 32, 64)
PADS = (0, 1)
COPY_INSTRUCTIONS = 7.0     # per copied element: address, bounds test, LDG, STS, loop
REDUCE_INSTRUCTIONS = 3.0   # per reduced element besides the arithmetic: LDS, address, loop


COPY_IN_FLIGHT = 16         # copy loads a thread keeps in flight (nvcc's unrolled copy loop)
GLOBAL_LATENCY_CYCLES = 550.0   # CostParameters.global_latency_cycles
BARRIER_CYCLES = 40.0           # CostParameters.barrier_cycles
LDS_LATENCY_CYCLES = 30.0       # shared load latency (sm_80/90 microbenchmarks: ~23-33 cycles)
FADD_LATENCY_CYCLES = 4.0       # dependent FADD


def tile_chain_cycles(tile: int) -> float:
    """The serial path of one staged tile in every block: the copy's loads (COPY_IN_FLIGHT at a
    time, one global latency per batch), the barrier, the thread's dependent walk over its row of
    the tile (one shared load latency, then one FADD per column), the barrier before the next copy
    overwrites the tile. With few warps per SM nothing else hides it (the second pass measured
    staged rows at 4 warps/SM 1.2-2.3x slower than the model's throughput terms)."""
    batches = -(-tile // COPY_IN_FLIGHT)
    return (batches * GLOBAL_LATENCY_CYCLES + 2 * BARRIER_CYCLES + LDS_LATENCY_CYCLES
            + tile * FADD_LATENCY_CYCLES)


def main_read(info: KernelInfo) -> Access | None:
    """The largest read that walks the reduced axis."""
    inner = info.reduction[-1][0] if info.reduction else None
    cands = [a for a in info.reads if a.offset is not None and inner in a.offset.vars]
    return max(cands, key=buffer_bytes, default=None)


def outputs_per_row(info: KernelInfo, x: Access) -> int | None:
    """How many consecutive outputs (the spatial axes fused row-major, as `apply` fuses them)
    share one row of `x` when its rows follow the outputs: x's offset skips the innermost spatial
    axes (their extents' product is the answer; 1 when it skips none) and takes the others
    row-major, each axis's coefficient the row stride times the extents inside it. None when
    not: a read that skips an outer axis (a weight broadcast over the batch, W[j, k] for
    out[i, j]) or takes the axes in another order. A block of `threads` outputs then stages
    the span of its rows, which with the fused index wrapping is up to the whole of x (a
    [1000, 64] tile per block for a 32 x 1000 output: 32x the shared memory and copy that
    `_row_staged` prices for `threads` rows)."""
    assert x.offset is not None
    shared = 1
    stride = 0
    inner = 1
    for var, extent in reversed(info.spatial):
        if extent == 1:
            continue
        coeff = x.offset.get(var)
        if stride == 0 and coeff == 0:
            shared *= extent
            continue
        if stride == 0:
            stride = coeff
        if coeff <= 0 or coeff != stride * inner:
            return None
        inner *= extent
    return shared


def stages_whole_rows(info: KernelInfo, x: Access, threads: int) -> bool:
    """Whether a block of `threads` outputs stages at most `threads` rows of x, as `_row_staged`
    prices it: x's rows follow the outputs (`outputs_per_row`) and a block holds whole groups of
    outputs sharing a row, or lies inside one."""
    per_row = outputs_per_row(info, x)
    return per_row is not None and (per_row % threads == 0 or threads % per_row == 0)


class Reduction(Strategy):
    name = "reduction"
    description = "row (shared-memory staged rows) / column / generic (one thread per output)"

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if not info.reduction:
            return "no reduction"
        if not info.spatial:
            return "a full reduction to one element (needs a cross-thread reduction: not expressible yet)"
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        for t in THREADS:
            for u in UNROLL:
                if u <= info.reduction[-1][1]:
                    yield {"mapping": "thread", "threads": t, "unroll": u}
        x = main_read(info)
        if info.reduce_kind == "row" and len(info.reduction) == 1 and x is not None:
            for t in THREADS:
                if not stages_whole_rows(info, x, t):
                    continue
                for w in TILES:
                    if w > 2 * info.reduction[-1][1]:
                        continue
                    for pad in PADS:
                        yield {"mapping": "row_staged", "threads": t, "tile": w, "pad": pad}

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        if point["mapping"] == "thread":
            return simple_workload(info, target, threads=int(point["threads"]), unroll=int(point["unroll"]))
        return self._row_staged(info, point, target)

    def _row_staged(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        t, w, pad = int(point["threads"]), int(point["tile"]), int(point["pad"])
        rows = info.outputs
        red_var, extent = info.reduction[-1]
        x = main_read(info)
        assert x is not None and x.offset is not None
        blocks = -(-rows // t)
        tiles = -(-extent // w)
        row_stride = next((abs(c) for v, c in x.offset.coeff if v != red_var and c), extent)
        # the copy: flattened (t rows x w columns) box, consecutive threads on consecutive columns
        copy_offsets = [(lane // w) * row_stride + lane % w for lane in range(WARP)]
        sectors, lines = global_cost(copy_offsets, x.itemsize)
        store_words = [((lane // w) * (w + pad) + lane % w) * x.itemsize // 4 for lane in range(WARP)]
        store_wf, _ = shared_wavefronts(store_words)
        read_words = [lane * (w + pad) * x.itemsize // 4 for lane in range(WARP)]
        read_wf, degree = shared_wavefronts(read_words)
        copy_instr = blocks * tiles * t * w / WARP
        read_instr = blocks * tiles * (t / WARP) * w
        other = [a for a in info.reads if a is not x]
        l2 = copy_instr * sectors * 32 + rows * info.write.itemsize + sum(buffer_bytes(a) for a in other)
        per_thread = tiles * (w * COPY_INSTRUCTIONS + w * (REDUCE_INSTRUCTIONS + info.flops_per_iteration) + 4)
        instructions = blocks * (t / WARP) * per_thread
        smem = t * (w + pad) * x.itemsize
        regs = {"addressing": 18, "copy in flight": min(w, 8), "accumulator": 1,
                "values": min(w, 8) if w <= 16 else 8}
        notes = [f"shared reads {degree}-way bank conflicted" if degree > 1 else "shared reads conflict-free"]
        return Workload(
            blocks=blocks, threads=t, registers=regs, smem_bytes=smem, flops=info.flops,
            fma_ops=float(info.iterations * info.flops_per_iteration),
            special_ops=float(info.iterations * info.special_per_iteration),
            dram_bytes=compulsory_bytes(info), l2_bytes=l2, global_wavefronts=copy_instr * lines,
            smem_wavefronts=copy_instr * store_wf + read_instr * read_wf, bank_conflict=float(degree),
            instructions=instructions, bytes_in_flight=float(min(w, COPY_IN_FLIGHT) * x.itemsize), ilp=1.0,
            block_latency_cycles=tiles * 2 * 40.0, chain_cycles=tiles * tile_chain_cycles(w), notes=notes)

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        loops = sch.get_loops(info.stage)
        spatial = loops[:len(info.spatial)]
        fused = spatial[0]
        for lp in spatial[1:]:
            fused = sch.fuse(fused, lp)
        b, th = sch.split(fused, factors=[None, int(point["threads"])])
        sch.bind(b, "blockIdx.x")
        sch.bind(th, "threadIdx.x")
        red = sch.get_loops(info.stage)[-1]
        if point["mapping"] == "thread":
            u = int(point["unroll"])
            if u > 1:
                _, inner = sch.split(red, u)
                sch.unroll(inner)
            return
        x = main_read(info)
        assert x is not None
        co, ci = sch.split(red, int(point["tile"]))
        cache = sch.cache_read(info.stage, x.tensor, "shared")
        if int(point["pad"]):
            sch.storage_align(cache, int(point["pad"]))
        sch.compute_at(cache, co)

    def describe(self, point: Point) -> str:
        if point["mapping"] == "thread":
            return f"reduction(thread per output, threads={point['threads']}, unroll={point['unroll']})"
        return (f"reduction(row staged in shared, rows/block={point['threads']}, tile={point['tile']}, "
                f"pad={point['pad']})")


register(Reduction())
