"""The workload of the simple mappings (one thread per output, or per `vector` × `items` of
them), shared by the naive, elementwise and generic-reduction strategies. Not a strategy."""

from __future__ import annotations

from ...ir.target import Target
from ..cost.analysis import KernelInfo
from ..cost.model import Workload
from ..cost.traffic import one_thread_per_output

# Warp instructions per output element that are not loads or arithmetic: the index
# decomposition of the fused spatial index (a div/mod pair per extra dimension costs ~10
# instructions for a symbolic extent, ~3 for a constant), the bounds guard and the store.
STORE_OVERHEAD = 4.0
INDEX_COST_SYMBOLIC = 10.0
INDEX_COST_CONSTANT = 3.0
LOOP_OVERHEAD = 2.0        # compare + branch + induction per loop iteration not unrolled
# A thread's serial reduction loop (one thread per output): its loads, LOADS_IN_FLIGHT at a time
# (nvcc's own unrolling of the loop, as the bytes in flight below assume), each round a global
# latency (CostParameters.global_latency_cycles), and one dependent combine per element (FFMA
# latency). What bounds a reduction over few outputs, where no other thread hides it.
LOADS_IN_FLIGHT = 4
GLOBAL_LATENCY_CYCLES = 550.0
COMBINE_LATENCY_CYCLES = 4.0


def simple_workload(info: KernelInfo, target: Target, *, threads: int, vector: int = 1, unroll: int = 1,
                    items: int = 1, blocks: int | None = None, fused_index: bool = True,
                    grid_stride: bool = False) -> Workload:
    """`threads` per block; each thread computes `items` groups of `vector` consecutive outputs
    (its reduction loop unrolled `unroll` times); `blocks` fixed (grid-stride) or enough to cover."""
    per_thread = vector * items
    if blocks is None:
        blocks = max(1, -(-info.outputs // (threads * per_thread)))
    traffic = one_thread_per_output(info, target, vector)
    iterations = float(info.iterations)
    fma_per_iter = 1.0 if info.kind == "contraction" else float(info.flops_per_iteration)
    fma_ops = iterations * fma_per_iter + info.outputs * info.epilogue_flops
    special = iterations * info.special_per_iteration
    # instructions: loads + arithmetic + loop overhead per iteration, index/store per output
    dims = max(0, len(info.spatial) - 1)
    index_cost = dims * (INDEX_COST_SYMBOLIC if info.symbolic else INDEX_COST_CONSTANT)
    loop = LOOP_OVERHEAD / max(unroll, 1) if info.reduction else 0.0
    instr_thread = (traffic.load_instructions * 32 / max(info.outputs / vector, 1) * 1.0
                    + fma_per_iter * info.reduce_extent * vector + loop * info.reduce_extent * vector
                    + (index_cost + STORE_OVERHEAD + info.epilogue_flops) * vector / max(vector, 1)
                    + (LOOP_OVERHEAD if grid_stride or items > 1 else 0.0))
    instructions = instr_thread * info.outputs / (vector * 32)
    reads = max(1, len(info.reads))
    # bytes a thread has in flight at the DRAM level: the sectors its loads request (an
    # uncoalesced lane pulls a whole 32-byte sector), times the independent loads nvcc keeps in
    # flight: 4 iterations of a reduction loop (its default unrolling; an explicit unroll adds
    # none measurably, 2026-11-21 run), or the unrolled items of an elementwise thread
    if info.reduction:
        in_flight = traffic.sector_bytes_per_lane * min(info.reduce_extent, 4)
        ilp = float(vector)
    else:
        in_flight = traffic.sector_bytes_per_lane * (items if not grid_stride else 1)
        ilp = float(vector * (items if not grid_stride else 1))
    live_items = 1 if grid_stride else items
    regs = {"addressing": 10 + 2 * reads + (4 if info.symbolic else 0),
            "values": reads * vector * (min(unroll, 8) if info.reduction else live_items),
            "accumulators": vector if info.reduction else 0,
            "index": 2 * dims if fused_index else 0}
    notes = []
    if traffic.worst_lines > 4:
        notes.append(f"uncoalesced: a warp load touches {traffic.worst_lines} lines of 128 B")
    chain = 0.0
    if info.reduction:
        extent = info.reduce_extent * items
        chain = -(-extent // LOADS_IN_FLIGHT) * GLOBAL_LATENCY_CYCLES + extent * COMBINE_LATENCY_CYCLES
    return Workload(
        blocks=blocks, threads=threads, registers=regs, smem_bytes=0, flops=info.flops, fma_ops=fma_ops,
        special_ops=special, dram_bytes=traffic.dram_bytes, l2_bytes=traffic.l2_bytes,
        global_wavefronts=traffic.wavefronts, instructions=instructions, bytes_in_flight=in_flight,
        ilp=ilp, chain_cycles=chain, notes=notes)


__all__ = ["simple_workload"]
