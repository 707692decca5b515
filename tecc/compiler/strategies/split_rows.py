"""split_rows: few long rows (or a full reduction) as a two-stage grid reduction
(tecc.passes.rewrite.split_rows): S blocks per row over contiguous chunks, the partials combined by a
second small kernel, or, for small inputs, by the last of a row's blocks to finish (one kernel).

A graph-level strategy (registry.GraphStrategy, `SplitRows`): the rewrite replaces the program's
kernel by one or two kernels and temporaries, so the planner prices its point (`split_workload`)
against row_fused's one block per row and the per-kernel plans, and realizes the cheapest.

When (the first two are its guard, the third the planner's ranking; the plan's reason gives the
numbers):
* rows alone cannot fill the GPU: fewer rows than WAVES waves of the one-block-per-row kernel
  row_fused would make (SMs × its resident blocks per SM, from the cost model's occupancy);
  many rows keep their register-cached, measured row kernels whatever the model says;
* the rows cannot keep DRAM busy: the cost model prices the one-block-per-row kernel
  (`row_fused.fused_workload` at the point row_fused proposes) and its DRAM rate is capped by
  Little's law (bytes in flight / latency) below the achievable bandwidth. R blocks of one row
  each run on R SMs: 8 rows x 1024 threads x 64 B = 512 KiB in flight, ~0.95 TB/s; 64 rows
  already keep 4 MiB in flight and run at copy speed (H200: 4.26 TB/s, the split 4.20);
* the split pays: the planner ranks its point at its predicted time (`split_workload`, the
  combine as its `then`) over the strategy's margin, SPLIT_TOLERANCE: taken where it is predicted
  at most that much slower than the row kernel (why not a strict win: see the constant).
For a full reduction or one over several axes no row kernel competes (row_fused declines them;
the per-kernel planner's reduction strategy declines a 0-d output, leaving one thread per
output): the guard still asks Little's law of one block per row, the best one-pass form, and the
planner weighs the split against the per-kernel plans.

The point (constants with the fact they rest on):
* THREADS = 256 per block: 8 resident blocks per SM on sm_80/sm_90 (2048 threads), a 3-step
  shared stage in the block reduction;
* vector V: 16 bytes per load (float4, 8 bf16 as a uint4) where `vector_allowed` holds (rows
  read through flat views, whatever their length; else the innermost reduced extent a multiple
  of V, or a single row), else the widest that is;
* unroll U: UNROLL_BYTES = 64 bytes of loads in flight per thread (four 16-byte loads; the
  round loop stays rolled and kernel 1 asks for 8 blocks per SM, so ptxas keeps it at 32
  registers): 8 x 256 x 64 B x 132 SMs = 17 MB in flight, far above what Little's law asks of an
  H200 (4.8 TB/s x ~550 ns = 2.6 MB). Measured on an H200 (benchmarks/split_rows.py, rows of
  8 x 16M, 1 x 64M, 64 x 1M and 8192^2 reduced whole): four loads beat two by 2.2-3.7% and one
  by 3.6-5.4% in fp32; in bf16 two by -0.7 to +3.3% and one by 3.7-4.4%;
* splits S: WAVES = 2 waves of 256-thread blocks over all rows (2 x 132 x 8 = 2112 blocks on an
  H100/H200), but chunks of at least MIN_CHUNK = 4096 elements (16 KiB of fp32: the block's
  launch, reduction tree and partial store stay small next to its loads); a power of two when
  that makes every chunk full (no guarded loop), and the chunk rounded to whole rounds of
  T·V·U elements, then S = ceil(N / chunk), so no block is empty.

**Combining** (`choose_combine`; the rule was set from the two-kernel measurements below and
split_reduce's one-pass ones, then measured for split_rows on the H200, 2026-11-21, RESULTS.md
"Final checks": bf16 2 x (3M+7) 730 -> 1509 GB/s, full 4096 x 4099 +5%, the other one-pass
picks within +-3% of the two kernels, bf16 16 x 1M 3% slower). The partials are
combined by the last of a row's S blocks to finish (`combine="last_block"`, one kernel; plan
step `split_rows(..., combine="last_block")`) when both hold:
* S >= ONE_PASS_MIN_SPLITS = 8 (column_reduction's constant): split_reduce's one pass measured
  up to 1.8 us slower than its two kernels at S <= 4 on two-wave grids, and from 0.2 us slower
  (within the ~0.3 us run-to-run noise) to 0.8 us faster at S >= 8 (H200, 2026-11-21,
  strategies/column_reduction.py "Combining"). The benchmark shapes below plan S = 64-2050;
* the second launch (CostParameters.launch_s = 2.5 us, what the model charges a kernel;
  split_reduce measured its combine kernel at ~2.5 us of a ~13 us op) is at least
  ONE_PASS_LAUNCH_SHARE = 10% of the input's DRAM time at the achievable bandwidth (0.9 of peak),
  i.e. that time is at most 25 us: inputs up to ~103 MiB on an H200 (4.32 TB/s), ~72 MiB on the
  sm_90 reference H100 (3.02 TB/s).
Facts (H200, two kernels, benchmarks/RESULTS.md "split_rows", % of copy; the time over copy
speed in brackets, estimated from the GB/s): the small inputs lose 2-5 us, about the second
launch plus its combine: 2 x (3M+7) fp32 76% (~2.7 us) / bf16 62% (~3.4 us), full 4096 x 4099
85% (~3.1 us) / 64% (~5.4 us), 16 x 1M 87% / 76%, 32 x 1M bf16 86%; the large ones are at copy
speed already: 8 x 16M 106% / 100%, 1 x 64M 101% / 94%, full 8192^2 101% / 94%, 32 x 1M fp32
95%. Above the threshold the one pass can gain at most the same ~2-3 us (<= 2-8% of >= 25 us),
and split_reduce measured the one pass both faster and up to 1.8 us slower at that scale, so
"never slower" cannot be argued there: those inputs keep the measured two-kernel plans. Below
it the second launch is >= 10% of the op, and the one pass replaces it by an exposed tail of the
last block (its fence, the atomic round trip, a fence, S / T coherent loads from L2, a block
reduction: ~1-1.5 us by the model's latencies) plus a fence-and-atomic tail in every block,
hidden by the other 7 resident blocks (17 MB in flight against the 2.6 MB Little's law needs).
Choices (H200; the same on the sm_90 reference except 32 x 1M, not split there):
8 x 16M, 1 x 64M, full 8192^2, 32 x 1M fp32, 8 x (4M+3) fp32: "kernel" (fp32 and bf16 where
listed without a dtype); 2 x (3M+7), 16 x 1M, full 4096 x 4099, 32 x 1M bf16, 8 x (4M+3) bf16:
"last_block". The gate above prices the two-kernel form, so the one pass changes how the
programs the split already takes combine, never which programs are split; `split_cost` and the
reason give the one-pass prediction (`split_workload(..., combine="last_block")`). The one-pass
kernel's grid is (rows, S) where the two-kernel form's is rows·S (tecc/passes/rewrite/split_rows.py), so
with several rows its blocks are dispatched row-interleaved (chunk s of every row, then s + 1):
the same chunks and bytes in flight, another order; also unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ...ir.errors import ScheduleError
from ...ir.evaluate import evaluate_int
from ...ir.expr import Expr, free_vars, size_product
from ...ir.target import Target
from ...ir.tensor import Tensor
from ...passes.rewrite.split_rows import (
    COMBINE_THREADS,
    flat_views,
    noncontiguous_read,
    row_reduction,
    vector_allowed,
)
from ..cost.analysis import KernelInfo
from ..cost.model import DEFAULT_PARAMETERS, Cost, CostParameters, Workload, predict
from ..cost.traffic import compulsory_bytes
from ..plan import Plan, Step
from ..program import Program, resolve_target
from .column_reduction import ONE_PASS_MIN_SPLITS
from .registry import ChosenPointStrategy, Point, register
from .row_fused import choose_point, choose_vector
from .row_fused import propose as propose_row_fused
from .row_fused_cost import (
    BARRIER_CYCLES,
    FADD_LATENCY_CYCLES,
    GLOBAL_LATENCY_CYCLES,
    SHUFFLE_CYCLES,
    TREE_INSTRUCTIONS,
    fused_workload,
)

THREADS = 256
WAVES = 2
MIN_CHUNK = 4096
UNROLL_BYTES = 64
VECTOR_BYTES = 16
# The split is taken when predicted at most this much slower than one block per row whose DRAM
# rate is capped by Little's law: that cap (bytes in flight / CostParameters.dram_latency_s, 550 ns)
# is optimistic near the edge. On an H200, 32 rows of 1M (2 MiB in flight) ran at 3.14 TB/s fp32
# and 2.57 TB/s bf16 -- 665-815 ns of loaded latency -- where the model gave 3.8 TB/s and a tie
# (0.98 / 1.06); the split measured 1.23x / 1.29x faster (benchmarks/split_rows.py).
SPLIT_TOLERANCE = 1.1
WARP = 32
# combine="last_block" when the second launch would be at least this share of the op's DRAM time
# (module docstring, "Combining")
ONE_PASS_LAUNCH_SHARE = 0.1
# the one pass's tail in every block: the leader's fence waits for its partial store to be
# acknowledged and its atomic is an L2 round trip, then a barrier; the last block of a row then
# fences again, reads its partials at L2 and runs a second block reduction. Estimates from the
# latencies above, not measured.
ONE_PASS_TAIL_CYCLES = 2 * GLOBAL_LATENCY_CYCLES + BARRIER_CYCLES
ONE_PASS_COMBINE_CYCLES = 2 * GLOBAL_LATENCY_CYCLES + 2 * 5 * SHUFFLE_CYCLES + BARRIER_CYCLES


@dataclass
class SplitRowsChoice:
    plan: Plan
    threads: int
    splits: int
    vector: int
    unroll: int
    chunk: int
    split_cost: Cost
    row_cost: Cost
    reason: str
    combine: str = "kernel"  # or "last_block" (one kernel; choose_combine)


def size_value(e: Expr, sizes: Mapping[str, int]) -> int | None:
    """`e` with the given sizes, or None when a size it needs is not given."""
    env = {}
    for v in free_vars(e):
        if v.name not in sizes:
            return None
        env[v] = int(sizes[v.name])
    return evaluate_int(e, env)


def chunk_elements(columns: int, splits: int, tile: int) -> int:
    """The chunk split_rows gives each block: whole rounds of `tile` = T·V·U elements."""
    return -(-columns // (splits * tile)) * tile


def choose_splits(rows: int, columns: int, tile: int, target: Target, threads: int = THREADS) -> int:
    """Blocks per row (see the module docstring)."""
    resident = max(1, min(target.max_threads_per_sm // threads, target.max_blocks_per_sm))
    wanted = WAVES * target.sm_count * resident
    splits = max(1, min(-(-wanted // max(rows, 1)), columns // MIN_CHUNK))
    if splits == 1:
        return 1
    power = 1 << (splits.bit_length() - 1)
    if columns % (power * tile) == 0:
        return power  # every chunk full: the unguarded loop only
    # whole rounds of `tile` per chunk, the nearest to columns / splits but at least MIN_CHUNK
    rounds = max(round(columns / (splits * tile)), -(-MIN_CHUNK // tile), 1)
    return -(-columns // (rounds * tile))


def choose_combine(input_bytes: float, splits: int, target: Target,
                   params: CostParameters = DEFAULT_PARAMETERS) -> str:
    """How the S partials of a row are combined (module docstring, "Combining"): by the last of
    the row's blocks ("last_block", one kernel) where the second launch (params.launch_s) would
    be at least ONE_PASS_LAUNCH_SHARE of the input's DRAM time and S >= ONE_PASS_MIN_SPLITS,
    else by a second kernel ("kernel")."""
    if splits < ONE_PASS_MIN_SPLITS:
        return "kernel"
    dram_s = input_bytes / (params.dram_efficiency * target.dram_bandwidth)
    return "last_block" if params.launch_s >= ONE_PASS_LAUNCH_SHARE * dram_s else "kernel"


def split_workload(info: KernelInfo, rows: int, columns: int, itemsize: int, threads: int, splits: int,
                   vector: int, unroll: int, combine: str = "kernel") -> Workload:
    """What split_rows does: rows·S blocks of T threads, each thread k = chunk / (T·V) V-wide
    loads (U in flight), V accumulator chains, a shuffle tree plus a shared stage, one partial
    store per block; then (as `then`) one block per row combining its S partials, or, with
    combine="last_block", no second kernel but a tail in every block (ONE_PASS_TAIL_CYCLES,
    plus ONE_PASS_COMBINE_CYCLES for the last block's combine, charged to every block: an
    overestimate of a term that is ~0.3 us at two waves)."""
    t, v, u, s = threads, vector, unroll, splits
    chunk = chunk_elements(columns, s, t * v * u)
    k = chunk // (t * v)
    blocks = rows * s
    warps = blocks * t / WARP
    acc_bytes = 4
    partials = rows * s * acc_bytes
    instr_warp = k * (3.0 + v * (1.0 + info.flops_per_iteration)) + TREE_INSTRUCTIONS
    chain = (-(-k // u) * GLOBAL_LATENCY_CYCLES + k * FADD_LATENCY_CYCLES
             + 2 * 5 * SHUFFLE_CYCLES + BARRIER_CYCLES)
    words = max(1, u * v * itemsize // 4)
    data = compulsory_bytes(info) - rows * info.write.itemsize
    t2 = min(COMBINE_THREADS, -(-s // WARP) * WARP)
    steps = -(-s // t2)
    second = Workload(
        blocks=rows, threads=t2, registers={"addressing": 12, "partials": steps, "accumulator": 1},
        smem_bytes=4 * (t2 // WARP), dram_bytes=partials + rows * info.write.itemsize,
        l2_bytes=partials + rows * info.write.itemsize, global_wavefronts=partials / 128.0 + rows,
        instructions=rows * (t2 / WARP) * (3.0 * steps + TREE_INSTRUCTIONS),
        bytes_in_flight=float(steps * acc_bytes), chain_cycles=GLOBAL_LATENCY_CYCLES + 2 * 5 * SHUFFLE_CYCLES
        + BARRIER_CYCLES, notes=[f"one block of {t2} per row combines {s} partials"])
    notes = [f"{s} chunk(s) of {chunk} per row, {k} load(s) of {v} per thread, {u} in flight"]
    one_pass = combine == "last_block"
    if one_pass:
        notes.append(f"the last of a row's {s} blocks combines its partials (one kernel)")
    return Workload(
        blocks=blocks, threads=t, registers={"addressing": 16, "loads in flight": words, "accumulators": v},
        smem_bytes=4 * (t // WARP) * (2 if one_pass else 1) + (4 if one_pass else 0), flops=info.flops,
        fma_ops=float(info.iterations * info.flops_per_iteration),
        special_ops=float(info.iterations * info.special_per_iteration), dram_bytes=data + partials,
        l2_bytes=data + partials, global_wavefronts=data / 128.0 + blocks, instructions=warps * instr_warp,
        bytes_in_flight=float(u * v * itemsize), ilp=float(v), chain_cycles=chain,
        block_latency_cycles=ONE_PASS_TAIL_CYCLES + ONE_PASS_COMBINE_CYCLES if one_pass else 0.0,
        then=None if one_pass else second, notes=notes)


def propose(tensors: Sequence[Tensor], target: Target | str | None = None,
            sizes: Mapping[str, int] | None = None) -> SplitRowsChoice | None:
    """split_rows' point for a one-reduction program whose rows cannot fill the GPU, or None when
    its guard declines (module docstring; whether it is taken is the planner's ranking)."""
    program = Program.of(tensors, target=resolve_target(target), sizes=sizes)
    found = _program_choice(program)
    return found if isinstance(found, SplitRowsChoice) else None


def _program_choice(program: Program) -> SplitRowsChoice | str:
    return program.memo("split_rows/choice", lambda: _choice(program))


def _choice(program: Program) -> SplitRowsChoice | str:
    """The SplitRowsChoice, or why split_rows does not take the program."""
    tensors = program.args
    try:
        stage, red = row_reduction(tensors)
        read = noncontiguous_read(tensors)
    except ScheduleError as exc:
        return str(exc).splitlines()[0]
    if read is not None:
        return read
    sizes = program.sizes
    rows_expr = size_product(stage.shape)
    extents = [ax.extent for ax in red.axes]
    rows, columns = size_value(rows_expr, sizes), size_value(size_product(extents), sizes)
    if rows is None or columns is None:
        return "the row count or length is symbolic and no size is given for it"
    if rows == 0 or columns == 0:
        return "nothing to split: an empty row or no rows"
    tgt = program.target
    inputs = [t for t in tensors if t.is_placeholder]
    widest = max((t.dtype.bits // 8 for t in inputs), default=4)
    narrowest = min((t.dtype.bits // 8 for t in inputs), default=4)
    info = program.info(program.kernels[0])

    # one block per row, the kernel the split replaces: row_fused's own point where it takes the
    # program, else (several reduced axes, a 0-d output) the point it would choose for such a row
    fused = propose_row_fused(tensors, tgt)
    if fused is not None:
        point = dict(fused.plan.steps[0].args)
    else:
        row_threads, cache = choose_point(columns, 1, narrowest)
        point = {"threads": row_threads, "cache": cache,
                 "vector": choose_vector(columns, narrowest) if cache == "registers" else 1}
    row_threads = int(point["threads"]) * int(point.get("rows_per_block", 1))
    row_cost = predict(fused_workload(info, point, tgt), tgt)
    slots = WAVES * tgt.sm_count * max(row_cost.occupancy.blocks_per_sm, 1)
    if rows >= slots:
        return f"{rows} rows fill the {slots} block slots of {WAVES} waves of one block per row"
    # Little's law: the rate the rows' bytes in flight can sustain, against what DRAM gives
    achievable = DEFAULT_PARAMETERS.dram_efficiency * tgt.dram_bandwidth
    little = float(row_cost.details.get("dram_rate", achievable))
    if little >= achievable:
        return (f"one block per row keeps enough bytes in flight for DRAM ({_rate(little)} by Little's law, "
                f"{_rate(achievable)} achievable)")

    flat = bool(flat_views(tensors))
    vector = min(8, max(1, VECTOR_BYTES // widest))
    while vector > 1 and not vector_allowed(rows_expr, extents, vector, flat):
        vector //= 2
    unroll = max(1, UNROLL_BYTES // (vector * widest))
    tile = THREADS * vector * unroll
    splits = choose_splits(rows, columns, tile, tgt)
    if splits == 1:
        return f"the rows of {columns} are too short for two chunks of {MIN_CHUNK} elements"
    input_bytes = compulsory_bytes(info)
    combine = choose_combine(input_bytes, splits, tgt)
    split_cost = predict(split_workload(info, rows, columns, widest, THREADS, splits, vector, unroll, combine), tgt)
    chunk = chunk_elements(columns, splits, tile)
    dram_us = input_bytes / (DEFAULT_PARAMETERS.dram_efficiency * tgt.dram_bandwidth) * 1e6
    how = ({"kernel": "by a second kernel", "last_block": "by the last of the row's blocks to finish (one kernel)"}
           [combine] + f" (the second launch ~{DEFAULT_PARAMETERS.launch_s * 1e6:.1f} us against "
           f"{dram_us:.1f} us of DRAM time, {splits} partials)")
    reason = (f"{rows} row(s) of {columns} elements fill {rows} of the {slots} block slots of {WAVES} waves "
              f"({tgt.sm_count} SMs x {row_cost.occupancy.blocks_per_sm} blocks of {row_threads}), whose loads in "
              f"flight sustain {_rate(little)} by Little's law of the {_rate(achievable)} DRAM "
              f"gives: "
              f"{splits} blocks of {THREADS} threads per row, chunks of {chunk}, {unroll} x {vector * widest}-byte "
              f"loads in flight per thread, partials combined {how}; predicted "
              f"{split_cost.total * 1e6:.1f} us ({split_cost.bound}-bound) vs {row_cost.total * 1e6:.1f} us "
              f"({row_cost.bound}-bound) for one block of {row_threads} per row")
    args: dict[str, Any] = {"threads": THREADS, "splits": splits, "vector": vector, "unroll": unroll}
    if combine != "kernel":  # the default is left out, as Schedule records it
        args["combine"] = combine
    plan = Plan((Step("split_rows", args),), "split_rows", reason)
    return SplitRowsChoice(plan, THREADS, splits, vector, unroll, chunk, split_cost, row_cost, reason, combine)


class SplitRows(ChosenPointStrategy):
    """The registry's face of this module: guard, its one point, `split_workload`, the split_rows step."""

    name = "split_rows"
    description = ("few long rows (or a full reduction) as a grid reduction: S blocks per row over contiguous "
                   "chunks, the partials combined by a second kernel or by the row's last block")
    # the row kernel's Little's-law rate is optimistic near the edge (SPLIT_TOLERANCE): the split is
    # ranked at its predicted time / 1.1
    margin = SPLIT_TOLERANCE

    choice_type = SplitRowsChoice

    def choose(self, program: Program) -> Any:
        return _program_choice(program)

    def workload(self, program: Program, point: Point) -> Workload:
        info = program.info(program.kernels[0])
        widest = max((t.dtype.bits // 8 for t in program.tensors if t.is_placeholder), default=4)
        return split_workload(info, max(info.outputs, 1), max(info.reduce_extent, 1), widest,
                              int(point["threads"]), int(point["splits"]), int(point["vector"]), int(point["unroll"]),
                              str(point.get("combine", "kernel")))

    def apply(self, sch: Any, program: Program, point: Point) -> None:
        sch.split_rows(**point)


register(SplitRows())


def _rate(bytes_per_s: float) -> str:
    """A bandwidth for the reason text: TB/s, or GB/s below 0.1 TB/s (a full reduction's single
    row reads 0.00x TB/s)."""
    return f"{bytes_per_s / 1e12:.2f} TB/s" if bytes_per_s >= 1e11 else f"{bytes_per_s / 1e9:.1f} GB/s"


__all__ = ["SplitRows", "SplitRowsChoice", "choose_combine", "choose_splits", "chunk_elements", "propose", "split_workload"]
