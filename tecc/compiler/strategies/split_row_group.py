"""split_row_group: softmax, layer norm, RMS norm over few long rows as two kernels of S blocks per
row (tecc.passes.rewrite.split_row_group): partial statistics per chunk, then a kernel that combines them
and writes its chunk of the outputs.

Like split_rows (its counterpart for one-reduction programs) this rewrites the whole program, so
it is proposed over the program (`propose`); build(plan="auto") asks it after split_rows and
before row_fused, and keeps today's plans for everything it declines.

When (all must hold; `propose` puts the numbers in the plan's reason):
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

No prediction gates the choice: the cost model prices one block per row by Little's law over
the SMs it uses (64 rows x 1024 threads x 64 B = 4 MiB in flight, 7.6 TB/s at 550 ns) and does
not see what holds that kernel at 50-64% of copy; the rule is the structural one above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ...ir.errors import ScheduleError
from ...ir.expr import size_product
from ...ir.tensor import Tensor
from ...passes.rewrite.fuse_rows import row_group
from ...passes.lower import lower
from ...passes.rewrite.split_row_group import row_statistics
from ..cost.analysis import analyze_kernel
from ..cost.model import predict
from ..plan import Plan, Step
from .row_fused import fused_workload
from .row_fused import propose as propose_row_fused
from .split_rows import THREADS, WAVES, size_value, choose_splits, chunk_elements

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


def propose(tensors: Sequence[Tensor], target: Any = None,
            sizes: Mapping[str, int] | None = None) -> SplitRowGroupChoice | None:
    """The two-kernel plan for a row group over rows too few to fill the GPU, or None (see the
    module docstring for when)."""
    try:
        group = row_group(tensors)
    except ScheduleError:
        return None
    if not group.elementwise:
        return None
    sizes = dict(sizes or {})
    rows, columns = size_value(size_product(group.rows), sizes), size_value(group.columns, sizes)
    if rows is None or columns is None or rows == 0 or columns == 0:
        return None  # symbolic without sizes, or nothing to split: today's plan
    from ..planner import resolve_target  # the planner imports the strategies: imported when called

    tgt = resolve_target(target)
    fused = propose_row_fused(tensors, tgt)
    if fused is None or fused.cache == "registers":
        return None
    try:
        kind = row_statistics(tensors).kind
    except ScheduleError:
        return None
    point = dict(fused.plan.steps[0].args)
    row_threads = int(point["threads"])
    info = analyze_kernel(lower(list(tensors)).kernels[0], sizes)
    row_cost = predict(fused_workload(info, point, tgt), tgt)
    per_sm = max(row_cost.occupancy.blocks_per_sm, 1)
    slots = WAVES * tgt.sm_count * per_sm
    if rows >= tgt.sm_count:  # every SM has a row: the split measured slower (module docstring)
        return None

    # the long-row walk row_fused chose: 16-byte vectors where the row allows, U in flight
    vector, unroll = int(point.get("vector", 1)), int(point.get("unroll", 1))
    tile = THREADS * vector * unroll
    splits = choose_splits(rows, columns, tile, tgt)
    if splits < 2:
        return None
    chunk = chunk_elements(columns, splits, tile)
    # the row inputs' element size (the vector's bytes), as row_fused takes it
    itemsize = min((t.dtype.bits // 8 for t in group.program.args
                    if t.is_placeholder and len(t.shape) == len(group.rows) + 1), default=4)
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


__all__ = ["SplitRowGroupChoice", "propose"]
