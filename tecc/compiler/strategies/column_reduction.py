"""column_reduction: a reduction over a column or middle axis as a split reduction
(tecc.passes.rewrite.split_reduce): consecutive threads on consecutive outputs (coalesced), the reduced
axis spread over the threads of a block and over blocks, combined in shared memory and, when
split over blocks, by the last block of each column block to finish (one kernel).

A graph-level strategy (registry.GraphStrategy, `ColumnReduction`): the rewrite replaces the
program's kernel (and may add a temporary and a second kernel), so the planner prices its point
(`split_workload`: the blocks, the coalesced row reads, the partials and their combine) against
the per-kernel plans of the program (the `reduction` strategy's one thread per output) and
realizes the cheaper.

Choice of the point (constants with the fact they rest on). Two families:

**Two waves of 256-thread blocks** (the point of the 4096/8192-column plans, measured at 90-98%
of copy bandwidth for bf16 and 98-106% for float32, H200, 2026-11-21):
* THREADS_X = 32 outputs per block: one warp row reads one contiguous run of 32 elements (128 B
  for float32: one L2 line per warp load);
* THREADS_Y = 8 threads share an output (256-thread blocks: 8 per SM at full occupancy on
  sm_80/sm_90, 2048 threads per SM);
* splits S: enough blocks for WAVES full waves (blocks ≥ WAVES · SMs · 8), but each thread
  reduces at least MIN_ROWS rows, so the partials (S · outputs · 4 bytes) stay ≤ 1/MIN_ROWS ·
  1/THREADS_Y of the input's elements: under 1% extra traffic;
* UNROLL_BYTES = 32 bytes of rows in flight per thread (8 float32 or 16 bf16 loads: 64 KiB in
  flight per SM, ~2.5× what Little's law asks of an H200: 4.8 TB/s × ~650 ns / 132 SMs).
* outputs per thread V (16-bit sources only): one output per lane reads 32 × 2 = 64 bytes per
  warp instruction, which measured 63-67% of copy bandwidth for bf16 column sums of 4096/8192
  columns (H200, 2026-11-21), where float32 (128 bytes per warp) ran at 98-100% with the same
  blocks. V adjacent outputs per thread make each row read one V-wide load (32·V·2 bytes per
  warp). V is the widest of 16 bytes that divides the output's last extent and still fills
  WAVES waves with at most MAX_SPLITS blocks along the reduced axis; none: V = 1.

**One wave of big blocks** (small inputs, few outputs). threads_y = ONE_WAVE_THREADS_Y = 32
(1024-thread blocks, 2 per SM), V = ONE_WAVE_OUTPUTS = 4 adjacent outputs per thread (16-byte
float32 / 8-byte bf16 loads; the widest of 4, 2 that divides the last extent, none: the two-wave
point stays), unroll = ONE_WAVE_UNROLL = 4, and S the power of two that puts one wave of threads
on the GPU (SMs × 2048), at most MAX_SPLITS and N / (32 · MIN_ROWS). It is chosen when the input
is at most ONE_WAVE_MAX_BYTES = 64 MiB (≤ ~14 µs of DRAM time: a wave boundary and the ramp of
the blocks are ≥ 10% of the op), or when the two-wave point reads under WARP_READ_BYTES per
warp instruction (16-bit, V = 1: too few outputs for a wider V to fill two waves) or needs the
full MAX_SPLITS. Measured (H200, 2026-11-21, % of copy bandwidth, benchmarks/column_one_pass.py;
the two-wave points as planned before, with their combine kernel; the one-wave points in one
pass; "first" is the first kernel of the two-kernel form alone):

    16384 x 1024 bf16 col_sum   two-wave (8, 64, u16, V1): 59-60%      one wave (32, 32, u4, V4): 74-75%
                                (16, 64, u4, V4): 73% (first 88-91%)   (16, 32, u8, V4): 75%
    16 x 1024 x 1024 bf16 mean  two-wave (8, 4, u16, V1):  62%         (16, 4, u4, V4): 77-78%, (32, 2): 76-77%
    16384 x 1024 f32 col_sum    two-wave (8, 64, u8, V1):  78-79%      (32, 32, u4, V4): 85-87%, (16, 64): 85%
    16 x 1024 x 1024 f32 mean   two-wave (8, 4, u8, V1):   82%         (32, 2, u4, V4): 86%, (16, 4): 86-87%

(threads_y, splits, unroll, V). Fewer, bigger blocks pay the one-pass tail (below) fewer times:
the best first kernel (16, 64: 88-91%, the point the two-kernel sweep found) is not the best
one-pass kernel (32, 32). 32 for every dtype is within a point of each row's best.

**Combining.** With S > 1 the partials are combined by the last block to finish
(`combine="last_block"`, one kernel) or by a second kernel (`"kernel"`). The second launch cost
~2-3 µs of a ~13 µs op at 1024 columns: the one-pass form gained 2-4 points there (bf16 col
13.0-13.3 µs one pass vs 13.4-13.6 two kernels at (16, 64); f32 col 20.2-20.4 vs 20.9-21.1).
The one pass instead costs every block a tail (a barrier, a fence and an atomic round trip,
another barrier) before it retires, which adds up over the waves of a two-wave grid. On the
measured two-wave points (same first kernel; run-to-run noise ~0.3 µs) it was: S = 32 / 16 / 8
(col_sum at 4096/8192) from 0.2 µs slower to 0.8 µs faster; S = 4 / 2 (mid_mean) from 0.2 µs
faster (bf16 16 x 1024 x 4096) to 1.8 µs slower (bf16 16 x 1024 x 8192: 69.3-69.7 µs vs
67.6-68.1). So: one pass for the one-wave points, and for two-wave points
with S >= ONE_PASS_MIN_SPLITS = 8 (where the combine kernel's S-long chain per output costs
most); else the two-kernel form, as the 4096/8192-column mid_mean plans were measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ...ir.errors import ScheduleError
from ...ir.expr import const_int
from ...ir.target import Target
from ...ir.tensor import Tensor
from ...passes.rewrite.split_reduce import reduction_over_one_axis, uncoalesced_read
from ..cost.analysis import KernelInfo
from ..cost.model import Workload
from ..cost.traffic import compulsory_bytes
from ..plan import Plan, Step
from ..program import Program
from .registry import ChosenPointStrategy, Point, register

THREADS_X = 32
THREADS_Y = 8
WAVES = 2
MIN_ROWS = 16
UNROLL_BYTES = 32
DEFAULT_SMS = 132            # an H100/H200 SXM when no Target is given
SM_THREADS = 2048
MAX_SPLITS = 64              # the combine's chain of partials per output (64 measured at 83-88%)
VECTOR_BYTES = 16
WARP_READ_BYTES = 128        # a warp row read below this (bf16 at V = 1) is what V > 1 fixes
ONE_WAVE_OUTPUTS = 4         # V of the one-wave point (measured best for bf16 and float32)
ONE_WAVE_THREADS_Y = 32      # 1024-thread blocks (module docstring: within a point of the best)
ONE_WAVE_UNROLL = 4
SOLO_UNROLL_BYTES = 128      # rows in flight per thread of a block alone on its SM (solo_unroll)
ONE_WAVE_MAX_BYTES = 64 << 20  # inputs up to this take the one-wave point (1024 columns: 32/64 MiB)
ONE_PASS_MIN_SPLITS = 8      # two-wave points combine in one pass from this many splits


@dataclass
class ColumnChoice:
    plan: Plan
    threads_x: int
    threads_y: int
    splits: int
    reason: str
    outputs_per_thread: int = 1
    combine: str = "kernel"  # or "last_block" (one kernel; choose_combine)


@dataclass(frozen=True)
class ColumnPoint:
    """One point of split_reduce's space: threads_y, splits, unroll, outputs per thread."""

    threads_y: int
    splits: int
    unroll: int
    outputs_per_thread: int
    family: str  # "two waves" or "one wave" (module docstring)


def _wanted_blocks(sms: int) -> int:
    return WAVES * sms * (SM_THREADS // (THREADS_X * THREADS_Y))


def choose_outputs_per_thread(outputs: int | None, last: int | None, reduced: int | None, itemsize: int,
                              sms: int = DEFAULT_SMS) -> int:
    """Adjacent outputs per thread (see the module docstring): 1 for 32-bit sources."""
    if outputs is None or last is None or reduced is None or itemsize >= 4:
        return 1
    most = min(MAX_SPLITS, max(1, reduced // (THREADS_Y * MIN_ROWS)))
    v = min(8, VECTOR_BYTES // itemsize)
    while v > 1:
        if last % v == 0 and -(-outputs // (THREADS_X * v)) * most >= _wanted_blocks(sms):
            return v
        v //= 2
    return 1


def choose_splits(outputs: int | None, reduced: int | None, sms: int = DEFAULT_SMS, outputs_per_thread: int = 1) -> int:
    """Blocks along the reduced axis for `outputs` outputs reduced over `reduced` elements."""
    if outputs is None or reduced is None:
        return 1
    blocks_x = max(1, -(-outputs // (THREADS_X * outputs_per_thread)))
    wanted = _wanted_blocks(sms)
    most = max(1, reduced // (THREADS_Y * MIN_ROWS))
    if outputs_per_thread > 1:
        most = min(most, MAX_SPLITS)
    return _power_of_two_splits(max(1, min(-(-wanted // blocks_x), most)), reduced, THREADS_Y)


def _power_of_two_splits(splits: int, reduced: int, threads_y: int) -> int:
    """`splits` rounded down to a power of two while it does not divide `reduced / threads_y`:
    a power of two divides power-of-two lengths, so split_reduce's row guard goes."""
    while reduced % (splits * threads_y) and splits & (splits - 1):
        splits &= splits - 1
    return splits


def one_wave_point(outputs: int, last: int, reduced: int, itemsize: int, sms: int = DEFAULT_SMS) -> ColumnPoint | None:
    """The one-wave point (module docstring) for these sizes, or None when no V > 1 divides the
    output's last extent (then the two-wave point stays)."""
    v = ONE_WAVE_OUTPUTS
    while v > 1 and last % v:
        v //= 2
    if v == 1:
        return None
    threads_y = ONE_WAVE_THREADS_Y
    blocks_x = max(1, -(-outputs // (THREADS_X * v)))
    wanted = -(-(sms * SM_THREADS) // (blocks_x * THREADS_X * threads_y))
    most = min(MAX_SPLITS, max(1, reduced // (threads_y * MIN_ROWS)))
    splits = _power_of_two_splits(max(1, min(wanted, most)), reduced, threads_y)
    return ColumnPoint(threads_y, splits, solo_unroll(blocks_x * splits, reduced, splits, threads_y, v, itemsize, sms),
                       v, "one wave")


def solo_unroll(blocks: int, reduced: int, splits: int, threads_y: int, v: int, itemsize: int, sms: int) -> int:
    """The one-wave point's unroll: ONE_WAVE_UNROLL, or, when the grid leaves every block an SM of
    its own (few rows: MIN_ROWS caps the splits below a wave), every row of a thread in flight at
    once, up to SOLO_UNROLL_BYTES per thread. Such a block has the SM's registers to itself
    (1024 threads x 64), so the wider unroll costs no residency; with 4 loads per round a thread
    of GPT-2's 8192 x 768 bf16 gradients (96 blocks, 16 rows per thread) waited out 4 rounds of
    DRAM latency, 3.1 MB in flight over the GPU."""
    rows = -(-reduced // (splits * threads_y))
    if blocks > sms or rows <= ONE_WAVE_UNROLL:
        return ONE_WAVE_UNROLL
    return max(ONE_WAVE_UNROLL, min(rows, SOLO_UNROLL_BYTES // (v * itemsize)))


def choose_point(outputs: int | None, last: int | None, reduced: int | None, itemsize: int,
                 sms: int = DEFAULT_SMS) -> ColumnPoint:
    """The split_reduce point for `outputs` outputs (last extent `last`) reduced over `reduced`
    elements of `itemsize` bytes: the one-wave point for inputs of at most ONE_WAVE_MAX_BYTES or
    where the two-wave point reads under WARP_READ_BYTES per warp instruction or needs
    MAX_SPLITS splits; else the two-wave point (module docstring)."""
    vector = choose_outputs_per_thread(outputs, last, reduced, itemsize, sms)
    splits = choose_splits(outputs, reduced, sms, vector)
    two_waves = ColumnPoint(THREADS_Y, splits, max(1, UNROLL_BYTES // (itemsize * vector)), vector, "two waves")
    if outputs is None or last is None or reduced is None:
        return two_waves
    small = outputs * reduced * itemsize <= ONE_WAVE_MAX_BYTES
    if not small and THREADS_X * vector * itemsize >= WARP_READ_BYTES and splits < MAX_SPLITS:
        return two_waves
    return one_wave_point(outputs, last, reduced, itemsize, sms) or two_waves


def choose_combine(point: ColumnPoint) -> str:
    """How the point's partials are combined (module docstring, "Combining")."""
    if point.splits == 1:
        return "kernel"  # nothing to combine: one kernel either way
    if point.family == "one wave" or point.splits >= ONE_PASS_MIN_SPLITS:
        return "last_block"
    return "kernel"


def propose(tensors: Sequence[Tensor], target: Target | None = None) -> ColumnChoice | None:
    """column_reduction's point for a one-reduction program whose reduced axis is not the
    unit-stride one (a column or middle-axis reduction), or None (what its space holds: the
    planner weighs it against the other plans of the program)."""
    found = _choice(tensors, target)
    return found if isinstance(found, ColumnChoice) else None


def _choice(tensors: Sequence[Tensor], target: Target | None) -> ColumnChoice | str:
    """The ColumnChoice, or why the program is not column_reduction's."""
    try:
        stage, red = reduction_over_one_axis(tensors)
        why = uncoalesced_read(tensors)
    except ScheduleError as exc:
        return str(exc).splitlines()[0]
    if why is not None:
        return why
    outputs: int | None = 1
    for e in stage.shape:
        c = const_int(e)
        outputs = outputs * c if (c is not None and outputs is not None) else None
    reduced = const_int(red.axes[0].extent)
    sms = target.sm_count if target is not None else DEFAULT_SMS
    itemsize = max(1, min(t.dtype.bits // 8 for t in tensors if t.is_placeholder)) if any(
        t.is_placeholder for t in tensors) else 4
    point = choose_point(outputs, const_int(stage.shape[-1]), reduced, itemsize, sms)
    combine = choose_combine(point)
    args: dict[str, Any] = {"threads_x": THREADS_X, "threads_y": point.threads_y, "splits": point.splits,
                            "unroll": point.unroll}
    if point.outputs_per_thread > 1:
        args["outputs_per_thread"] = point.outputs_per_thread
    if combine != "kernel":
        args["combine"] = combine
    step = Step("split_reduce", args)
    reason = (f"reduction of {stage.name} over {red.axes[0].extent} elements along a non-contiguous axis "
              f"({point.family}): {THREADS_X} x {point.outputs_per_thread} outputs x {point.threads_y} threads per "
              f"block, {point.splits} block(s) along the reduced axis"
              + {"last_block": ", combined by the last block to finish (one kernel)",
                 "kernel": ", combined by a second kernel" if point.splits > 1 else ""}[combine])
    plan = Plan((step,), "column_reduction", reason)
    return ColumnChoice(plan, THREADS_X, point.threads_y, point.splits, reason, point.outputs_per_thread, combine)


# the serial path of a block: a block reduction through shared memory (a barrier, TY partials per
# output), and with combine="last_block" the leader's fence, atomic round trip and fence, then the
# last block's coherent reads of the partials (latencies as in row_fused / split_rows)
GLOBAL_LATENCY_CYCLES = 550.0
BARRIER_CYCLES = 40.0


def split_workload(info: KernelInfo, point: Point, itemsize: int) -> Workload:
    """What split_reduce does at `point` for the one-reduction kernel `info` (its outputs O, the
    reduced extent N): ceil(O / (TX·V)) × S blocks of TX × TY threads; each thread reads
    ceil(N / (S·TY)) rows of V adjacent outputs (one V-wide load each, U in flight), a warp one
    contiguous run of TX·V elements per row; the TY partials of an output meet in shared memory;
    with S > 1 the S partials per output (float32) go through global memory and are combined by
    a second kernel (`then`) or by the last block of each column block (a tail in every block)."""
    tx, ty, s = int(point["threads_x"]), int(point["threads_y"]), int(point["splits"])
    u, v = int(point.get("unroll", 4)), int(point.get("outputs_per_thread", 1))
    combine = str(point.get("combine", "kernel"))
    outputs, reduced = max(info.outputs, 1), max(info.reduce_extent, 1)
    blocks_x = -(-outputs // (tx * v))
    blocks = blocks_x * s
    threads = tx * ty
    rows = -(-reduced // (s * ty))                    # rows a thread reads
    warps = blocks * threads / 32
    partials = 4.0 * s * outputs if s > 1 else 0.0
    data = compulsory_bytes(info)
    warp_row_bytes = tx * v * itemsize
    loads = info.outputs * info.reduce_extent / (tx * v)   # warp loads of the input
    instr_warp = rows * (2.0 + v * (1.0 + info.flops_per_iteration)) + 2.0 * rows / max(u, 1) + 20.0
    last = combine == "last_block" and s > 1
    chain = (-(-rows // max(u, 1)) * GLOBAL_LATENCY_CYCLES + rows * v * 4.0 + 2 * BARRIER_CYCLES
             + (3 * GLOBAL_LATENCY_CYCLES + BARRIER_CYCLES if last else 0.0))
    second = None
    if s > 1 and not last:
        combine_threads = 256
        second = Workload(
            blocks=-(-outputs // combine_threads), threads=combine_threads, registers={"addressing": 12, "values": 4},
            dram_bytes=partials + outputs * info.write.itemsize, l2_bytes=partials + outputs * info.write.itemsize,
            global_wavefronts=(partials + outputs * info.write.itemsize) / 128.0,
            instructions=outputs / 32 * (3.0 * s + 8.0), bytes_in_flight=4.0 * min(s, 4),
            chain_cycles=-(-s // 4) * GLOBAL_LATENCY_CYCLES, notes=[f"one thread per output folds {s} partials"])
    return Workload(
        blocks=blocks, threads=threads,
        registers={"addressing": 16, "values": -(-u * v * itemsize // 4), "accumulators": v},
        smem_bytes=4 * threads * v, flops=info.flops, fma_ops=float(info.iterations * max(info.flops_per_iteration, 1)),
        special_ops=float(info.iterations * info.special_per_iteration),
        dram_bytes=data + (2 * partials if s > 1 else 0.0), l2_bytes=data + (2 * partials if s > 1 else 0.0),
        global_wavefronts=loads * max(1.0, warp_row_bytes / 128.0) + blocks, instructions=warps * instr_warp,
        bytes_in_flight=float(u * v * itemsize), ilp=float(v), chain_cycles=chain, then=second,
        notes=[f"{blocks_x} x {s} blocks of {tx} x {ty}, {rows} rows of {v} output(s) per thread, {u} in flight"
               + (", the last block combines" if last else ", a combine kernel" if s > 1 else "")])


def _program_choice(program: Program) -> ColumnChoice | str:
    return program.memo("column_reduction/choice", lambda: _choice(program.args, program.target))


class ColumnReduction(ChosenPointStrategy):
    """The registry's face of this module: guard, its one point, `split_workload`, the split_reduce step."""

    name = "column_reduction"
    description = ("a reduction over a column or middle axis as a split reduction: consecutive threads on "
                   "consecutive outputs, the reduced axis over the threads of a block and over blocks")

    choice_type = ColumnChoice

    def choose(self, program: Program) -> Any:
        return _program_choice(program)

    def workload(self, program: Program, point: Point) -> Workload:
        info = next(program.info(k) for k in program.kernels if program.info(k).reduction)
        itemsize = min((t.dtype.bits // 8 for t in program.tensors if t.is_placeholder), default=4)
        return split_workload(info, point, max(itemsize, 1))

    def apply(self, sch: Any, program: Program, point: Point) -> None:
        sch.split_reduce(**point)


register(ColumnReduction())


__all__ = ["ColumnChoice", "ColumnPoint", "ColumnReduction", "split_workload", "choose_combine", "choose_outputs_per_thread", "choose_point",
           "choose_splits", "one_wave_point", "propose", "solo_unroll"]
