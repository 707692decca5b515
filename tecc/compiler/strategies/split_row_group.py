"""split_row_group: softmax, layer norm, RMS norm over few long rows as two kernels of S blocks per
row (tecc.passes.rewrite.split_row_group): partial statistics per chunk, then a kernel that combines them
and writes its chunk of the outputs.

A graph-level strategy (registry.GraphStrategy, `SplitRowGroup`), like split_rows (its
counterpart for one-reduction programs): the planner prices its point (`group_split_workload`:
the statistics kernel, the output kernel as its `then`) against row_fused's one block per row and
the per-kernel plans, and realizes the cheapest.

Its guard (all must hold; the plan's reason gives the numbers):
* the program is a row group whose reductions are one pass of partial statistics (one
  reduction, a max and a sum of exp(· - max), a sum and a sum of squared deviations:
  passes/rewrite/split_row_group.py) and that has elementwise outputs (a group of statistics only reads
  its row once: split_rows' business for a single reduction, row_fused's otherwise);
* row_fused takes it and its one-block-per-row kernel re-reads the row (cache "online" or
  "none": a row too long for registers). The split then reads the row twice too, so it moves no
  more bytes; a row kept in registers is read once and keeps its measured plan;
* the rows leave SMs idle: fewer rows than SMs (one block per row). 64 rows are 64 blocks on
  132 SMs: half the GPU idles and each busy SM has one block of 1024 threads, whose reduction
  phases leave DRAM idle. Measured on an H200 (2026-11-21, DRAM-sized inputs, % of copy, one
  block per row -> split): 16 x 262144 fp32 softmax 23 -> 59, layer norm 25 -> 57, RMS norm 30 ->
  65, bf16 15 -> 52, 27 -> 61, 35 -> 69; 64 x 131072 fp32 57 -> 65, 51 -> 59, 63 -> 65, bf16 39 ->
  49, 54 -> 55, 69 -> 63 (RMS norm in bf16 loses); 256 x 131072 (every SM busy) the split lost
  1-6 points everywhere (fp32 softmax 63 -> 59, bf16 layer norm 62 -> 56), which is why the
  bound is the SM count and not the WAVES x resident-blocks slots split_rows uses;
* the row is long enough to split: at least 2 chunks of MIN_CHUNK elements (`choose_splits`).

The point follows split_rows' (constants and the facts behind them in strategies/split_rows.py):
THREADS = 256 per block; the chunked walk of row_fused's long rows (`choose_long_row`: 16-byte
vectors when every row input has one element size and the row is a multiple of them, U = 64
bytes of loads in flight per thread); S = `choose_splits` (two waves of 256-thread blocks over
all rows, chunks of at least MIN_CHUNK elements, whole rounds of T·V·U); the output kernel
uses the same S.

The ranking: the cost model prices one block per row by Little's law over the SMs it uses and
its arithmetic on them (16 rows: 16 SMs of one 1024-thread block, 1.9 TB/s by Little's law at
64 B in flight per thread, the split predicted ~2x faster, measured 2.5-3.5x); at 64 rows (4 MiB
in flight, 7.6 TB/s at 550 ns) it predicts both DRAM-bound and charges the split its second
launch, 1.1-1.2x the row kernel, where the split measured 1.02-1.26x faster (5 of the 6 rows
above). So the strategy's margin is MARGIN = 1.25: its point is ranked at its predicted time /
1.25, the largest gap measured between the model and the H200 in the regime its guard admits
(bf16 softmax, 64 x 131072: predicted 1.2x slower, measured 1.26x faster).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ...ir.errors import ScheduleError
from ...ir.expr import size_product
from ...ir.target import Target
from ...ir.tensor import Tensor
from ...passes.rewrite.fuse_rows import row_group
from ...passes.rewrite.split_row_group import row_statistics
from ..cost.model import Workload, predict
from ..plan import Plan, Step
from ..program import Program, resolve_target
from .registry import ChosenPointStrategy, Point, register
from .row_fused import propose as propose_row_fused
from .row_fused import row_kernel_info
from .row_fused_cost import BARRIER_CYCLES, GLOBAL_LATENCY_CYCLES, SHUFFLE_CYCLES, TREE_INSTRUCTIONS, fused_workload
from .split_rows import THREADS, WAVES, size_value, choose_splits, chunk_elements

# the measured bias of the model against the split in the regime the guard admits (module docstring)
MARGIN = 1.25

STATISTICS = {"reduction": "one reduction", "max_sum_exp": "max and sum of exp",
              "welford": "Welford moments (n, mean, M2)"}


@dataclass
class SplitRowGroupChoice:
    plan: Plan
    threads: int
    splits: int
    vector: int
    unroll: int
    chunk: int
    statistics: str
    slots: int
    reason: str


def propose(tensors: Sequence[Tensor], target: Target | str | None = None,
            sizes: Mapping[str, int] | None = None) -> SplitRowGroupChoice | None:
    """split_row_group's point for a row group over rows too few to fill the GPU, or None when its
    guard declines (module docstring; whether it is taken is the planner's ranking)."""
    found = _choice(Program.of(tensors, target=resolve_target(target), sizes=sizes))
    return found if isinstance(found, SplitRowGroupChoice) else None


def _program_choice(program: Program) -> SplitRowGroupChoice | str:
    return program.memo("split_row_group/choice", lambda: _choice(program))


def _choice(program: Program) -> SplitRowGroupChoice | str:
    """The SplitRowGroupChoice, or why split_row_group does not take the program."""
    tensors = program.args
    try:
        group = row_group(tensors)
    except ScheduleError as exc:
        return str(exc).splitlines()[0]
    if not group.elementwise:
        return "the row group has no elementwise outputs (one read of the row: split_rows' or row_fused's)"
    sizes = program.sizes
    rows, columns = size_value(size_product(group.rows), sizes), size_value(group.columns, sizes)
    if rows is None or columns is None:
        return "the row count or length is symbolic and no size is given for it"
    if rows == 0 or columns == 0:
        return "nothing to split: an empty row or no rows"
    tgt = program.target
    fused = propose_row_fused(tensors, tgt)
    if fused is None or fused.cache == "registers":
        return "one block per row keeps the row in registers (read once)" if fused is not None else \
            "row_fused does not take the program"
    try:
        kind = row_statistics(tensors).kind
    except ScheduleError as exc:
        return str(exc).splitlines()[0]
    point = dict(fused.plan.steps[0].args)
    row_threads = int(point["threads"])
    info = row_kernel_info(program)
    row_cost = predict(fused_workload(info, point, tgt), tgt)
    per_sm = max(row_cost.occupancy.blocks_per_sm, 1)
    slots = WAVES * tgt.sm_count * per_sm
    if rows >= tgt.sm_count:  # every SM has a row: the split measured slower (module docstring)
        return f"{rows} rows give every one of the {tgt.sm_count} SMs a row"

    # the long-row walk row_fused chose: 16-byte vectors where the row allows, U in flight
    vector, unroll = int(point.get("vector", 1)), int(point.get("unroll", 1))
    tile = THREADS * vector * unroll
    splits = choose_splits(rows, columns, tile, tgt)
    if splits < 2:
        return f"the rows of {columns} are too short for two chunks"
    chunk = chunk_elements(columns, splits, tile)
    # the row inputs' element size (the vector's bytes), as row_fused takes it
    itemsize = min((t.dtype.bits // 8 for t in group.row_inputs), default=4)
    reason = (f"{rows} row(s) of {columns} fill {rows} of the {slots} block slots of {WAVES} waves ({tgt.sm_count} "
              f"SMs x {per_sm} blocks of {row_threads}) of the one-block-per-row kernel, which leaves "
              f"{tgt.sm_count - rows} of {tgt.sm_count} SMs idle and re-reads its row (cache {fused.cache}): {splits} blocks of {THREADS} "
              f"threads per row over chunks of {chunk} ({unroll} x {vector * itemsize}-byte loads in flight per "
              f"thread) write partial statistics ({STATISTICS[kind]}), then {splits} blocks per row combine them "
              f"and write their chunk of the outputs; the row is read twice, as before, by {rows * splits} blocks "
              f"instead of {rows}")
    args = {"threads": THREADS, "splits": splits, "vector": vector, "unroll": unroll}
    plan = Plan((Step("split_row_group", args),), "split_row_group", reason)
    return SplitRowGroupChoice(plan, THREADS, splits, vector, unroll, chunk, kind, slots, reason)


def group_split_workload(program: Program, point: Point) -> Workload:
    """What split_row_group does at `point`: rows·S blocks of T threads walk their chunk once
    (U·V elements in flight per thread), fold it into partial statistics, a block reduction, and
    store them; then (`then`) rows·S blocks combine the row's S partials, walk their chunk again
    and write its outputs. The arithmetic is the unfused kernels': the reductions' in the first
    kernel, the elementwise outputs' in the second."""
    t, s = int(point["threads"]), int(point["splits"])
    v, u = int(point.get("vector", 1)), int(point.get("unroll", 1))
    info = row_kernel_info(program)
    rows, columns = max(info.outputs, 1), max(info.reduce_extent, 1)
    itemsize = max(1, min((a.itemsize for a in info.reads), default=4))
    infos = [program.info(k) for k in program.kernels]
    chunk = chunk_elements(columns, s, t * v * u)
    k = -(-chunk // (t * v))                  # V-wide loads per thread
    blocks = rows * s
    warps = blocks * t / 32
    row_bytes = rows * columns * itemsize
    outputs = sum(i.outputs * i.write.itemsize for i in infos if not i.reduction)
    partials = blocks * 3 * 4.0
    chain = -(-k // max(u, 1)) * GLOBAL_LATENCY_CYCLES + 2 * 5 * SHUFFLE_CYCLES + 2 * BARRIER_CYCLES

    def arithmetic(reducing: bool) -> float:
        return sum(i.iterations * (i.arith_instructions_per_iteration or i.flops_per_iteration)
                   for i in infos if bool(i.reduction) == reducing) / 32.0

    second = Workload(
        blocks=blocks, threads=t, registers={"addressing": 16, "values": u * v, "statistics": 6},
        smem_bytes=4 * 32, special_ops=float(sum(i.iterations * i.special_per_iteration for i in infos if not i.reduction)),
        dram_bytes=row_bytes + outputs + partials * s, l2_bytes=row_bytes + outputs + partials * s,
        global_wavefronts=(row_bytes + outputs) / 128.0 + blocks * s,
        instructions=warps * (3.0 * k + TREE_INSTRUCTIONS) + arithmetic(False),
        bytes_in_flight=float(u * v * itemsize), ilp=float(v), chain_cycles=chain + GLOBAL_LATENCY_CYCLES,
        notes=[f"{s} blocks per row combine {s} partials and write their chunk of {chunk}"])
    return Workload(
        blocks=blocks, threads=t, registers={"addressing": 16, "values": u * v, "statistics": 6},
        smem_bytes=4 * 3 * 32, special_ops=float(sum(i.iterations * i.special_per_iteration for i in infos if i.reduction)),
        dram_bytes=row_bytes + partials, l2_bytes=row_bytes + partials, global_wavefronts=row_bytes / 128.0 + blocks,
        instructions=warps * (2.0 * k + TREE_INSTRUCTIONS) + arithmetic(True), bytes_in_flight=float(u * v * itemsize),
        ilp=float(v), chain_cycles=chain, then=second,
        notes=[f"{s} blocks per row over chunks of {chunk}, {u} x {v} in flight per thread, partial statistics"])


class SplitRowGroup(ChosenPointStrategy):
    """The registry's face of this module: guard, its one point, `group_split_workload`, the step."""

    name = "split_row_group"
    description = ("softmax / norms over rows too few to fill the GPU as two kernels of S blocks per row: "
                   "partial statistics per chunk, then the outputs")
    margin = MARGIN

    choice_type = SplitRowGroupChoice

    def choose(self, program: Program) -> Any:
        return _program_choice(program)

    def workload(self, program: Program, point: Point) -> Workload:
        return group_split_workload(program, point)

    def apply(self, sch: Any, program: Program, point: Point) -> None:
        sch.split_row_group(**point)


register(SplitRowGroup())


__all__ = ["MARGIN", "SplitRowGroup", "SplitRowGroupChoice", "group_split_workload", "propose"]
