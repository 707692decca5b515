"""The workloads of row_fused's kernels (what each makes the GPU do, for the cost model) and the
choice they price: one block per row over a row reduction (`fused_workload`, the kernel the cost
model's honesty loop measured), a row group kept in registers (`row_point_workload`), a row
re-read in chunks (`chunked_workload`), and a group with column reductions whose blocks walk the
rows (`column_workload`). split_rows and split_row_group price the row kernel they replace with
them too. row_fused.py chooses the point; this module only prices it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...ir.expr import Expr
from ...ir.target import Target
from ...passes.rewrite.fuse_rows import COLUMN_KERNEL_REGISTERS
from ...passes.rewrite.row_columns import COMBINE_COLUMNS, COMBINE_ROWS
from ...passes.schedule.cross_thread import WARP
from ..cost.analysis import KernelInfo
from ..cost.model import Workload
from ..cost.traffic import compulsory_bytes
from ..plan import Plan
from .registry import Point


@dataclass
class RowFusedChoice:
    plan: Plan
    threads: int
    cache: str
    fused_bytes_per_row: float
    unfused_bytes_per_row: float
    reason: str
    vector: int = 1
    rows_per_block: int = 1
    unroll: int = 1
    reductions: int = 1
    stages: int = 1
    passes: int = 1           # reads of the row (1 with cache="registers")
    arrays: int = 1           # row inputs
    itemsize: int = 4         # their narrowest element size
    elementwise: bool = False  # the group has row outputs of shape rows + (C,)
    walk: ColumnWalk | None = None  # a group with column reductions: its blocks walking the rows
    # plans to take, in order, where ptxas spills the planned kernel (row_fused's compile check,
    # `RowFused.space`): the straight-line walk's counterpart (every step tested, or straight)
    fallbacks: tuple[Plan, ...] = ()
    # the kernels of the reduction stages computed once per row, without a walk (sums over a
    # one-hot row: row_algebra.delta_sum); their arithmetic is not the fused kernel's
    closed: tuple[str, ...] = ()


@dataclass
class ColumnWalk:
    """The row blocks of a group with column reductions (`_column_choice`): `blocks` blocks, each
    walking the rows with `sums` column accumulators of `elements` values per thread (in
    registers, "local", or shared memory: `where`), `resident` per SM, the next row loaded ahead
    into registers or shared memory (`into`; None: not), `words` registers per thread for the
    row arrays and the sums kept in registers, `smem` shared bytes per block (row_fused's
    `column_options`); `rows` the row extents (symbolic ones are priced at the program's sizes),
    `columns` the row length."""

    blocks: int
    sums: int
    elements: int
    resident: int
    into: str | None
    where: str
    words: int
    smem: int
    rows: tuple[Expr, ...]
    columns: int


# Latencies of the one-row kernel's serial path (cycles; sm_80/sm_90 microbenchmarks, approximate)
GLOBAL_LATENCY_CYCLES = 550.0      # CostParameters.global_latency_cycles
SHUFFLE_CYCLES = 30.0              # one __shfl_xor_sync round trip
BARRIER_CYCLES = 40.0              # CostParameters.barrier_cycles
FADD_LATENCY_CYCLES = 4.0
TREE_INSTRUCTIONS = 40.0           # per warp: two 5-step shuffle trees, the shared hand-off, the store


def row_point_workload(n_rows: int, columns: int, itemsize: int, vector: int, threads: int, rows_per_block: int,
                       arrays: int, reductions: int, stages: int, bytes_per_row: float) -> Workload:
    """What fuse_rows(cache="registers") does for `n_rows` rows of `columns` at a point: T
    `threads` per row (one block per row), or one warp per row and `rows_per_block` rows per
    block. Each thread loads K = ceil(C / (T·V)) V-wide pieces (all in flight), each reduction
    is a shuffle tree plus, above one warp, a shared hand-off and a barrier. The terms that
    separate the points are the block count (launch and retire: CostParameters.block_cycles)
    and the registers the cached row takes (occupancy)."""
    t, w = threads, rows_per_block
    k = -(-columns // (t * vector))
    elements = k * vector
    warps = n_rows * t / WARP
    tree = TREE_INSTRUCTIONS / 2 + (TREE_INSTRUCTIONS / 2 if t > WARP else 0.0)
    instr_warp = 2.0 * k + elements * (1.0 + stages) + reductions * tree
    chain = (GLOBAL_LATENCY_CYCLES + elements * FADD_LATENCY_CYCLES * reductions
             + reductions * (5 * SHUFFLE_CYCLES + (BARRIER_CYCLES + 5 * SHUFFLE_CYCLES if t > WARP else 0.0)))
    return Workload(
        blocks=-(-n_rows // w), threads=t * w,
        registers={"addressing": 12, "row cache": elements * arrays, "accumulators": 2 * max(reductions, 1)},
        smem_bytes=4 * 32 if t > WARP else 0, dram_bytes=n_rows * bytes_per_row, l2_bytes=n_rows * bytes_per_row,
        global_wavefronts=n_rows * bytes_per_row / 128.0, instructions=warps * instr_warp,
        bytes_in_flight=float(elements * itemsize), ilp=float(vector), chain_cycles=chain,
        notes=[f"{k} load(s) of {vector} per thread, {t} threads per row, {w} row(s) per block"])


def fused_workload(info: KernelInfo, point: dict[str, Any], target: Target) -> Workload:
    """What fuse_rows' kernel for ONE row reduction (`info`: the unfused kernel, one output per
    row) does at `point` (threads T, cache, vector V, unroll U): one block per row, each thread
    loads K = ceil(C / (T·V)) V-wide pieces of the row (all independent and unrolled with
    cache="registers"; with "none" / "online" the chunked walk of row_chunks.py, U pieces issued
    before any is used, so U in flight), sums them, then a warp shuffle tree, a shared-memory
    hand-off between warps and a second tree. Multi-pass groups (softmax) are not priced here:
    the benchmark measures a row sum."""
    t, v = int(point["threads"]), int(point.get("vector", 1))
    u = int(point.get("unroll", 1))
    cache = str(point.get("cache", "registers"))
    rows = info.outputs
    columns = info.reduce_extent
    x_size = max((a.itemsize for a in info.reads), default=4)
    k = -(-columns // (t * v))
    in_flight_loads = max(1, k if cache == "registers" else min(k, u))   # an empty row (k = 0) still launches
    warps = rows * t / 32
    instr_warp = k * (2.0 + v * (1.0 + info.flops_per_iteration)) + TREE_INSTRUCTIONS
    chain = (-(-k // in_flight_loads) * GLOBAL_LATENCY_CYCLES + k * v * FADD_LATENCY_CYCLES
             + 2 * 5 * SHUFFLE_CYCLES + 2 * BARRIER_CYCLES)
    row_bytes = rows * columns * x_size
    regs = {"addressing": 12, "row cache" if cache == "registers" else "values": in_flight_loads * v,
            "accumulators": 2}
    return Workload(
        blocks=rows, threads=t, registers=regs, smem_bytes=4 * 32, flops=info.flops,
        fma_ops=float(info.iterations * info.flops_per_iteration),
        special_ops=float(info.iterations * info.special_per_iteration),
        dram_bytes=compulsory_bytes(info), l2_bytes=row_bytes + rows * info.write.itemsize,
        global_wavefronts=row_bytes / 128.0 + rows, instructions=warps * instr_warp,
        bytes_in_flight=float(in_flight_loads * v * x_size), ilp=float(v), chain_cycles=chain,
        notes=[f"one block per row, {k} load(s) of {v} per thread, cache {cache}"])


def chunked_workload(n_rows: int, columns: int, choice: RowFusedChoice, point: Point, flops: float,
                     special_ops: float, arith_instructions: float = 0.0) -> Workload:
    """What fuse_rows(cache="none" / "online") does for `n_rows` rows of `columns`: one block of T
    threads per row; each of the choice's `passes` reads of the row walks it in chunks of U
    V-wide loads per thread, all issued before any is used (row_chunks.py), so U·V elements in
    flight; a pass ends in a block reduction (two shuffle trees and a shared hand-off) before the
    next can start, which nothing else on the SM hides when the rows are fewer than the SMs.
    `arith_instructions`: the thread-level arithmetic of the stage kernels it replaces
    (analysis.INSTRUCTION_COST: an exp is ~8), issued on the `n_rows` SMs that hold a row."""
    t, v, u = int(point["threads"]), int(point.get("vector", 1)), int(point.get("unroll", 1))
    k = -(-columns // (t * v))                     # V-wide loads per thread per pass
    passes, reductions = choice.passes, max(choice.reductions, 1)
    warps = n_rows * t / WARP
    instr_warp = passes * 2.0 * k + k * v * passes + reductions * TREE_INSTRUCTIONS
    chain = (passes * -(-k // max(u, 1)) * GLOBAL_LATENCY_CYCLES + k * v * FADD_LATENCY_CYCLES * reductions
             + reductions * (2 * 5 * SHUFFLE_CYCLES + 2 * BARRIER_CYCLES))
    data = n_rows * choice.fused_bytes_per_row
    return Workload(
        blocks=n_rows, threads=t, registers={"addressing": 16, "values": u * v, "accumulators": 3 * reductions},
        smem_bytes=4 * 32 * reductions, flops=flops, special_ops=special_ops, dram_bytes=data, l2_bytes=data,
        global_wavefronts=data / 128.0 + n_rows, instructions=warps * instr_warp + arith_instructions / WARP,
        bytes_in_flight=float(u * v * choice.itemsize), ilp=float(v), chain_cycles=chain,
        notes=[f"one block per row, {passes} read(s) of the row in chunks of {u} x {v}, cache {choice.cache}"])


def column_workload(choice: RowFusedChoice, columns: int, rows: int) -> Workload:
    """What fuse_rows does for a group with column reductions (`choice.walk`) over `rows` rows of
    `columns`: S = walk.blocks blocks of T threads (one wave: `walk.resident` per SM), each
    walking ceil(rows / S) rows with the row in registers (and, with the next row loaded ahead,
    its loads in flight during this row's reductions and barriers), adding each row's values
    into its columns' sums; then S partial rows per column reduction written, and a combine
    kernel (`then`: blocks of 32 columns x 32 partial rows) folding them. The row's bytes move
    once; the block's serial path is its rows' reduction trees and barriers, plus a load latency
    per row without the next row ahead."""
    walk = choice.walk
    assert walk is not None
    t, v, s = choice.threads, choice.vector, walk.blocks
    ahead = walk.into is not None
    per_block = -(-rows // s)
    k = -(-columns // (t * v))
    elements = walk.elements
    reductions = max(choice.reductions, 1)
    partials = float(s * columns * 4 * walk.sums)
    data = rows * choice.fused_bytes_per_row + partials
    tree = TREE_INSTRUCTIONS / 2 + (TREE_INSTRUCTIONS / 2 if t > WARP else 0.0)
    instr_warp = per_block * (2.0 * k * choice.arrays + elements * (1.0 + choice.stages + walk.sums)
                              + reductions * tree)
    per_row = (elements * FADD_LATENCY_CYCLES * reductions + BARRIER_CYCLES
               + reductions * (5 * SHUFFLE_CYCLES + (BARRIER_CYCLES + 5 * SHUFFLE_CYCLES if t > WARP else 0.0)))
    chain = GLOBAL_LATENCY_CYCLES + per_block * (per_row + (0.0 if ahead else GLOBAL_LATENCY_CYCLES))
    combine_blocks = -(-columns // COMBINE_COLUMNS)
    combine_loads = -(-s // COMBINE_ROWS)
    folded = partials + columns * 4 * walk.sums
    combine = Workload(
        blocks=combine_blocks, threads=COMBINE_COLUMNS * COMBINE_ROWS,
        registers={"addressing": 16, "partials": combine_loads * walk.sums}, smem_bytes=4 * COMBINE_COLUMNS * COMBINE_ROWS,
        dram_bytes=folded, l2_bytes=folded, global_wavefronts=folded / 128.0,
        instructions=combine_blocks * COMBINE_ROWS * (2.0 * combine_loads + 8) * walk.sums,
        bytes_in_flight=float(4 * combine_loads * walk.sums), chain_cycles=GLOBAL_LATENCY_CYCLES + BARRIER_CYCLES,
        notes=[f"the combine kernel: {s} partial rows of {walk.sums} column sum(s) folded in a fixed order"])
    return Workload(
        blocks=s, threads=t, registers={"kernel": COLUMN_KERNEL_REGISTERS, "row arrays and column sums": walk.words},
        smem_bytes=4 * 32 + walk.smem, smem_opt_in=walk.smem > 0, dram_bytes=data, l2_bytes=data,
        global_wavefronts=data / 128.0, instructions=s * t / WARP * instr_warp,
        bytes_in_flight=float(elements * choice.itemsize * choice.arrays * (2 if ahead else 1)),
        ilp=float(v), chain_cycles=chain, then=combine,
        notes=[f"{s} blocks of {t} threads walking {per_block} rows each, {k} load(s) of {v} per thread and row, "
               f"column sums in {'registers' if walk.where == 'local' else 'shared memory'}"
               + (f", the next row loaded ahead into {walk.into}" if ahead else "")])


__all__ = ["BARRIER_CYCLES", "FADD_LATENCY_CYCLES", "GLOBAL_LATENCY_CYCLES", "SHUFFLE_CYCLES", "TREE_INSTRUCTIONS",
           "ColumnWalk", "RowFusedChoice", "chunked_workload", "column_workload", "fused_workload", "row_point_workload"]
