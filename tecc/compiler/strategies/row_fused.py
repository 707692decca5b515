"""row_fused: a reduce→elementwise graph sharing the row as ONE kernel (tecc.passes.rewrite.fuse_rows).

A graph-level strategy (registry.GraphStrategy, `RowFused`): it rewrites every stage of the
program into one kernel, so the planner prices its point (`workload`: `fused_workload` for one
row reduction, the one the cost model's honesty loop measured; `row_point_workload` for a group
kept in registers; `chunked_workload` for a row re-read in chunks; `column_workload` for a group
with column reductions, whose blocks walk the rows and a combine kernel folds their column
sums: `_column_choice`) against the per-kernel plans
of the stages and against the other rewrites that claim the program (split_rows,
split_row_group), and realizes the cheapest (docs/memory-bound.md, docs/cost-model.md).

Its guard and point (the guard refuses a group whose fused kernel would move no fewer global
bytes than the stage kernels: the criterion of the issue that introduced it):
* unfused bytes: every kernel reads its operands and writes its stage; a reduction stage that
  reads a row once per consumer re-reads it (softmax: X three times, two row temporaries);
* fused bytes: each input once, each output once (cache="registers"), or the row once per
  reduction pass plus once for the outputs (cache="none", whose re-reads mostly hit L2);
* constraints: the row's cached inputs take K = ceil(C / threads) registers each per thread;
  keep K·inputs ≤ MAX_ROW_REGISTERS so the kernel stays under ~128 registers per thread (two
  1024-thread blocks or more per SM), and threads a multiple of 32 up to 1024;
* the thread count: the fewest threads that keep K ≤ TARGET_PER_THREAD elements (8 independent
  loads in flight per thread are enough to cover DRAM latency at full occupancy on sm_80/sm_90;
  for 16-bit rows that is one 16-byte load: 32 KiB in flight per SM at 2048 threads, above the
  ~25 KiB Little's law asks of an H200 at 4.8 TB/s × ~650 ns / 132 SMs), but at least
  MIN_THREADS so a block's reduction tree is short relative to its loads. For 16-bit rows that
  measured 48-74% of copy bandwidth (H200, 2026 run 1: one 16-byte load per thread is too
  little in flight), so a 16-bit row takes TARGET_BYTES // itemsize = 16 elements per thread
  (two 16-byte loads) and fuse_rows asks for fewer resident blocks (1536 of 2048 threads)
  so that ptxas has the ~40 registers that one-register-per-element caching needs; a row of
  LONG_ROW_COLUMNS columns or more takes twice the elements per thread (16 float32, 32 16-bit:
  four 16-byte loads) and so half the threads: on an H200 (2026-11-21, DRAM-sized inputs)
  16384 x 8192 bf16 softmax ran at 82% of copy with 512 threads x 16 and 87% with 256 x 32,
  layer norm 92% -> 97%, RMS norm 97% either way; float32 softmax 93% with 1024 x 8 and 99%
  with 512 x 16, layer norm 97% -> 98%. At 4096 columns the same change was mixed (bf16
  softmax 86% -> 93% but layer norm 97% -> 94%; float32 softmax 98% -> 97%), so it stays there;
* the vector width: 16 bytes (float4, or 8 bf16/fp16 as one uint4) when the row length allows,
  else the widest that divides it;
* a row whose registers overflow what one resident block leaves a thread (64 K / threads) takes
  half the threads (`fit_row_registers`: 50,304 logits at 512 threads, not 1024), and 4-byte
  vectors when it fills most of them;
* a row past the register budget (or of symbolic length) is re-read once per pass; where the
  group has a max / sum-of-exp or a sum / sum-of-squared-deviations pair (softmax, layer norm)
  the pair is one pass (cache="online": running max, Welford moments), so the row is read twice.
  Its walk (`choose_long_row`) takes 16-byte vectors when the row length allows and chunks of
  LONG_ROW_BYTES per thread: U loads issued before any is used.
"""

from __future__ import annotations

from typing import Any, Sequence

from ...ir.errors import ScheduleError
from ...ir.evaluate import evaluate_int
from ...ir.expr import Expr, TensorRead, Var, const_int, const_product, free_vars, walk
from ...ir.tensor import Tensor
from ...ir.target import Target
from ...passes.rewrite.fuse_rows import (COLUMN_KERNEL_REGISTERS, ROW_KERNEL_REGISTERS, SM_REGISTERS, SM_THREADS, fuse_rows,
                                         row_group)
from ...passes.rewrite.row_columns import MAX_COLUMN_BLOCKS_PER_SM
from ...passes.rewrite.row_passes import one_hot_sums
from ...passes.rewrite.row_prefetch import ASYNC_BYTES, stage_bytes
from ...passes.schedule.cross_thread import WARP
from ..cost.analysis import DEFAULT_SIZE, KernelInfo
from ..cost.model import Workload, predict
from ..pipeline import first_without_spills
from ..plan import Plan, Step
from ..program import Program, resolve_target
from ..rankings import by_structure
from .registry import GraphStrategy, Point, register
from .row_fused_cost import (
    ColumnWalk,
    RowFusedChoice,
    chunked_workload,
    column_workload,
    fused_workload,
    row_point_workload,
)

THREAD_CHOICES = (64, 128, 256, 512, 1024)
TARGET_PER_THREAD = 8
TARGET_BYTES = 32
MIN_THREADS = 64
MAX_ROW_REGISTERS = 64
LONG_ROW_COLUMNS = 8192
VECTOR_BYTES = 16


def _itemsize(t: Tensor) -> int:
    return t.dtype.bits // 8


def choose_point(columns: int | None, cached_inputs: int, itemsize: int = 4) -> tuple[int, str]:
    """threads and cache for a row of `columns` elements of `itemsize` bytes (None: symbolic)."""
    if columns is None:
        return 256, "none"
    target = max(TARGET_PER_THREAD, TARGET_BYTES // itemsize)
    if columns >= LONG_ROW_COLUMNS:
        target *= 2
    for t in THREAD_CHOICES:
        if t < MIN_THREADS and columns > t:
            continue
        k = -(-columns // t)
        if k <= target or t == THREAD_CHOICES[-1]:
            if k * max(cached_inputs, 1) <= MAX_ROW_REGISTERS:
                return t, "registers"
            return t, "none"
    return THREAD_CHOICES[-1], "none"


def choose_vector(columns: int | None, itemsize: int) -> int:
    """The widest vector (elements) of at most VECTOR_BYTES that divides the row length."""
    if columns is None:
        return 1
    v = max(1, VECTOR_BYTES // itemsize)
    while v > 1 and columns % v:
        v //= 2
    return min(v, 8)


# Registers one thread may hold (the ISA's limit) and the row kernel's own beside its row arrays
# (fuse_rows.ROW_KERNEL_REGISTERS). A row array taking more than ROW_CAP_SHARE of the thread's
# registers walks its row with only the last step testing the row's end (fuse_rows'
# whole_steps) and takes 4-byte vectors, one register per access. With a test at every step
# ptxas issued the cross-entropy's 25 loads of its row of 50,304 bf16 logits (512 threads x 100
# registers, 8-byte vectors) one after another, each converted before the next was issued
# (1183 us on an H200, slower than the forward and backward as two kernels); the straight-line
# walk issues them together. 16-byte accesses need four aligned consecutive registers each,
# 8-byte ones two: with the straight-line walk ptxas (sm_90) spilled 56 B (fp32 float2) and
# 32 B (bf16 4 x bf16); float and bf16x2 accesses compile without spills, every load of the row
# in flight (2432 / 2736 instructions per row).
THREAD_REGISTERS = 255
ROW_CAP_SHARE = 0.75
NARROW_BYTES = 4


def _row_words(columns: int, threads: int, vector: int, arrays: int) -> int:
    return -(-columns // (threads * vector)) * vector * max(arrays, 1)


def _thread_cap(threads: int) -> int:
    return min(THREAD_REGISTERS, SM_REGISTERS // threads)


def fills_registers(columns: int, threads: int, vector: int, arrays: int) -> bool:
    """Whether the row arrays take more than ROW_CAP_SHARE of what one resident block leaves a
    thread (the rows whose walk is straight-line code, with 4-byte vectors)."""
    return _row_words(columns, threads, vector, arrays) > ROW_CAP_SHARE * _thread_cap(threads)


def fit_row_registers(columns: int, threads: int, vector: int, arrays: int, itemsize: int) -> tuple[int, int]:
    """(threads, vector) for a row kept in registers: `threads` halved while the row arrays (one
    register per element, `arrays` of them) and the kernel's own registers exceed what one
    resident block leaves a thread (64 K / threads, at most 255): at 1024 threads a thread has
    64, so a cross-entropy over 50,304 logits (52 per thread) spilled at 1024 threads and fits
    512 (100 of 128). A row that fills the registers (fills_registers) gets 4-byte vectors."""
    while (threads // 2 >= MIN_THREADS
           and _row_words(columns, threads, vector, arrays) + ROW_KERNEL_REGISTERS > _thread_cap(threads)
           and _row_words(columns, threads // 2, vector, arrays) + ROW_KERNEL_REGISTERS <= _thread_cap(threads // 2)):
        threads //= 2
    narrow = max(1, NARROW_BYTES // itemsize)
    if vector > narrow and columns % narrow == 0 and fills_registers(columns, threads, vector, arrays):
        vector = narrow
    return threads, vector


# A 16-bit row of more elements per thread than this keeps them converted to float32
# (fuse_rows' float_rows): ptxas has no registers left to keep converted copies across the
# passes' barriers, so each pass converts again (the cross-entropy over 50,304 bf16 logits, 100
# per thread: 3432 -> 3136 instructions, sm_90). Up to 32 per thread (the forward softmax, layer
# and RMS norm at 1024-8192 columns) the SASS is the same either way, so their kernels stay as
# measured. Row kernels with column reductions always take it (_column_choice).
FLOAT_ROWS_ELEMENTS = 32


# A re-read row's walk (fuse_rows cache="none"/"online", tecc/passes/rewrite/row_chunks.py): each thread
# issues a chunk of LONG_ROW_BYTES before using any of it. Rows that take this form are long
# (> 64 K elements) and few blocks may share the GPU (64 rows: 64 blocks on 132 SMs), so each SM
# needs more bytes in flight than at full occupancy: 1024 threads × 64 B = 64 KiB per block,
# against ~25 KiB per SM that Little's law asks at 4.8 TB/s × ~650 ns / 132 SMs. MAX_UNROLL
# bounds the chunk's registers when the vector is narrow (symbolic rows take V = 1).
LONG_ROW_BYTES = 64
MAX_UNROLL = 8


def choose_long_row(columns: int | None, itemsize: int) -> tuple[int, int]:
    """(vector, unroll) of the chunked walk of a re-read row of `columns` elements of
    `itemsize` bytes (None: symbolic, whose alignment cannot be proved: V = 1)."""
    vector = choose_vector(columns, itemsize)
    return vector, max(1, min(MAX_UNROLL, LONG_ROW_BYTES // (vector * itemsize)))


def _walks_rows_along_their_last_axis(group: Any) -> bool:
    """Every read inside a reduction uses the reduction axis only in its last index: the row is
    then contiguous in memory, which the one-block-per-row kernel needs to read it coalesced. A
    contraction (B[k, j] in a matmul) or a reduction over a middle axis is left to the planner.
    A gather, a read whose last index is read from memory (the target's log-probability
    Y[r, t[r]] of a loss summed over the rows r), reads one element per step whatever the
    mapping: it walks no row."""
    for t in group.reductions:
        for r in t.op.reductions:
            axis = r.axes[0]
            for node in walk(r.source):
                if not isinstance(node, TensorRead):
                    continue
                if node.indices and any(isinstance(n, TensorRead) for n in walk(node.indices[-1])):
                    continue  # a gather (docstring)
                uses = [axis in free_vars(i) for i in node.indices]
                if any(uses[:-1]):
                    return False
    return not _contracts(group)


def _contracts(group: Any) -> bool:
    """Whether a reduction of the group is a contraction: two or more reads along the reduced
    axis, each indexed by some but not all of the row axes, and not by the same ones (A[i, k] and
    B[j, k] of C[i, j] = Σ_k A·Bᵀ). Each read is then reused across the rows the other indexes,
    which the tiled contraction strategies exploit and one block per row does not; a row vector
    broadcast into a row reduction (bias[k] beside X[r, k]) is no contraction."""
    for t in group.reductions:
        rows = set(t.op.axes)
        for r in t.op.reductions:
            axis = r.axes[0]
            subsets = {frozenset(v for v in rows if any(v in free_vars(i) for i in node.indices))
                       for node in walk(r.source)
                       if isinstance(node, TensorRead) and any(axis in free_vars(i) for i in node.indices)}
            if len(subsets) >= 2 and all(s and s != rows for s in subsets):
                return True
    return False


def _online_walk(tensors: Sequence[Tensor], threads: int) -> tuple[int, int]:
    """(pairs, reads) of fuse_rows(cache="online"): how many reduction passes it folds into the
    pass before them, and how many of its passes read the row from global memory (0, 0 where it
    refuses the group)."""
    try:
        (kernel,) = fuse_rows(tensors, threads, "online").kernels
    except ScheduleError:
        return 0, 0
    attrs = dict(kernel.attrs)
    return int(attrs.get("online_pairs", 0)), int(attrs.get("row_reads", 0))  # type: ignore[call-overload]


def _online_pairs(tensors: Sequence[Tensor], threads: int) -> int:
    """How many reduction passes fuse_rows(cache="online") folds into the pass before them."""
    return _online_walk(tensors, threads)[0]


# A row that fills the registers (fills_registers) leaves one block per SM: the SM's loads stop
# while that block reduces, computes and stores its row (each all-reduce a barrier). Where the
# chunked walk reads the row only once anyway -- statistics alone (a loss's forward saving
# max and log-sum-exp: the max and the sum of exp one online pass), or passes that compute from
# indices and row values before the one pass that reads the row (the loss's backward: the
# one-hot's row sum, then dX) -- caching buys no read and the row streams instead, in chunks of
# LONG_ROW_BYTES per thread, STREAM_THREADS per block: the cross-entropy's forward over 50,304
# bf16 logits took 61-62 registers at 512 and 1024 threads (ptxas, sm_90), so two blocks per SM
# at 512, one at 1024.
STREAM_THREADS = 512


def streams_once(tensors: Sequence[Tensor], columns: int, threads: int, vector: int, arrays: int) -> str | None:
    """The chunked walk's cache ("online" or "none") for a row kept in registers at `threads` x
    `vector` when the row fills the registers and that walk reads it once (above); else None."""
    if not fills_registers(columns, threads, vector, arrays):
        return None
    pairs, reads = _online_walk(tensors, STREAM_THREADS)
    if reads != 1:
        return None
    return "online" if pairs else "none"


def propose(tensors: Sequence[Tensor], target: Target | str | None = None) -> RowFusedChoice | None:
    """row_fused's point for the program `tensors` (what its space holds: one point, chosen by the
    rules of the module docstring and, for several rows per block, by predicted time on `target`),
    or None when it is not a row group or the rewrite would not move fewer global bytes. The
    planner weighs it against the other strategies; split_rows and split_row_group price the
    kernel they replace with it."""
    found = _choice(tensors, resolve_target(target))
    return found if isinstance(found, RowFusedChoice) else None


def _choice(tensors: Sequence[Tensor], target: Target) -> RowFusedChoice | str:
    """The RowFusedChoice, or why the program is not row_fused's."""
    try:
        group = row_group(tensors)
    except ScheduleError as exc:
        return str(exc).splitlines()[0]
    if not _walks_rows_along_their_last_axis(group):
        return "a reduction reads its row along another axis than the last, or contracts (the tiled strategies' business)"
    if group.column_reductions:
        return _column_choice(group, target)
    columns = const_int(group.columns)
    width = columns if columns is not None else 4096  # a symbolic row: bytes per row for the comparison
    row_inputs = list(group.row_inputs)
    sizes = {_itemsize(t) for t in row_inputs}
    itemsize = min(sizes) if sizes else 4
    threads, cache = choose_point(columns, len(row_inputs), itemsize)
    # 16-byte accesses (codegen/vectorize.py: float4, or 8 half-precision elements as a uint4)
    # when every row input has one element size
    vector = choose_vector(columns, itemsize) if cache == "registers" and len(sizes) == 1 else 1
    wide = vector
    if cache == "registers" and columns is not None:
        threads, vector = fit_row_registers(columns, threads, vector, len(row_inputs), itemsize)
    unroll = 1
    streamed = None
    if cache == "registers" and columns is not None and len(sizes) == 1:
        streamed = streams_once(tensors, columns, threads, vector, len(row_inputs))
        if streamed is not None:
            cache, threads = streamed, STREAM_THREADS
    if cache != "registers":
        long_vector, unroll = choose_long_row(columns, itemsize)
        vector = long_vector if len(sizes) == 1 else 1
    # bytes per row, fused: inputs once (cache="none": once per reduction pass + once for outputs)
    # a sum over a one-hot row is computed once per row, without a walk (row_algebra.delta_sum)
    closed = one_hot_sums(group)
    walked = len(group.reductions) - len(closed)
    passes = 1 if cache == "registers" or streamed else walked + (1 if group.elementwise else 0)
    if cache == "none" and not streamed:
        # a row too long for registers: a max and a following sum of exp(· - max) share one
        # pass (running max with a rescaled sum), one read of the row fewer per pair
        pairs = _online_pairs(tensors, threads)
        if pairs:
            cache, passes = "online", passes - pairs
    row_in = sum(_itemsize(t) * width for t in row_inputs)
    outs = sum(_itemsize(t) * (width if t in group.elementwise else 1) for t in group.program.args
               if not t.is_placeholder)
    fused = row_in * passes + outs
    # unfused: every stage kernel reads the row inputs it touches (at least once each) and writes its
    # result; downstream stages read the row temporaries
    stages = len(group.reductions) + len(group.elementwise)
    unfused = row_in * stages + outs + sum(4 * 2 for _ in group.reductions)
    if stages > 1 and fused >= unfused:
        return f"fused, the rows would move {fused:.0f} B/row, no fewer than the {unfused:.0f} B/row of the stage kernels"
    rows_per_block, priced = 1, ""
    n_rows = const_product(group.rows)
    if cache == "registers" and columns is not None and n_rows is not None:
        arrays = max(len(row_inputs), 1)
        rows_per_block, priced = choose_rows_per_block(n_rows, columns, itemsize, vector, threads, arrays,
                                                       walked, stages, fused, target)
    step_args: dict[str, Any] = {"threads": WARP if rows_per_block > 1 else threads, "cache": cache}
    if vector > 1:
        step_args["vector"] = vector
    if rows_per_block > 1:
        step_args["rows_per_block"] = rows_per_block
    if cache == "registers" and itemsize == 2 and columns is not None and \
            -(-columns // (threads * vector)) * vector > FLOAT_ROWS_ELEMENTS:
        step_args["float_rows"] = True
    if unroll > 1:
        step_args["unroll"] = unroll
    layout = (f"{rows_per_block} rows per block, one warp each" if rows_per_block > 1 else f"{threads} threads")
    if unroll > 1:
        layout += f", chunks of {unroll} vectors"
    if streamed:
        layout += " (the row read once either way: streamed, not cached in registers that leave one block per SM)"
    plan = Plan((Step("fuse_rows", step_args),), "row_fused",
                f"{stages} stage(s) sharing rows of {group.columns} in one kernel: {fused:.0f} B/row "
                f"instead of {unfused:.0f} B/row unfused; {layout}, row cache {cache}, vector {vector}" + priced)
    fallbacks: tuple[Plan, ...] = ()
    if (cache == "registers" and columns is not None and rows_per_block == 1
            and fills_registers(columns, threads, vector, len(row_inputs))
            and columns % (threads * vector)):
        plan, fallbacks = straight_walk(plan, wide_vector(columns, itemsize, vector, wide))
    if cache == "registers" and sum(t.is_placeholder for t in group.program.args) > MANY_INPUTS:
        fallbacks += tuple(without_occupancy(p) for p in (plan, *fallbacks))
    return RowFusedChoice(plan, int(step_args["threads"]), cache, fused, unfused, plan.reason, vector,
                          rows_per_block, unroll, walked, stages, passes, max(len(row_inputs), 1),
                          itemsize, bool(group.elementwise), fallbacks=fallbacks,
                          closed=tuple(sorted(f"{t.name}_kernel" for t in closed)))


# A row group reading more tensors than this (GPT-2's backward: each layer norm's dx recomputed in
# the kernel of the next, through the residual gradient, reads its gradient and input rows, two
# row statistics, two sums and the weight) keeps more addresses and values live than
# min_blocks_per_sm's estimate of the kernel's own registers: at 768 columns and 128 threads those
# kernels spilled 20-88 bytes under the requested occupancy (2 to 5 layer norms carried; one
# layer norm backward, 7 inputs, did not). Their plans carry a fallback without the request,
# taken where ptxas spills the first (`pipeline.first_without_spills`).
MANY_INPUTS = 8


def without_occupancy(plan: Plan) -> Plan:
    """`plan` (one fuse_rows step) without the kernel's request for resident blocks."""
    (step,) = plan.steps
    return Plan((Step("fuse_rows", {**step.args, "occupancy": False}),), plan.strategy,
                plan.reason + "; no occupancy request (ptxas spilled under it)")


def wide_vector(columns: int, itemsize: int, vector: int, wide: int) -> int:
    """The 8-byte vector a row filling the registers took before its walk was straight-line
    code (`vector` where it was not narrowed from `wide`)."""
    eight = max(1, 8 // itemsize)
    return eight if vector < wide and eight <= wide and columns % eight == 0 else vector


def straight_walk(plan: Plan, vector: int) -> tuple[Plan, tuple[Plan, ...]]:
    """`plan` (one fuse_rows step) with the straight-line walk (whole_steps), and the plan with
    every step tested at `vector`: the build falls back to it where ptxas spills the first
    (`pipeline.first_without_spills`; the straight-line walk hoists every load of the row, which
    a row filling the register cap may not afford: the forward RMS norm over 50,304 bf16 columns
    spilled 12 bytes at 512 threads x 100 registers where the cross-entropy's row of the same
    size did not)."""
    (step,) = plan.steps
    args = {k: v for k, v in step.args.items() if k != "whole_steps"}
    straight = Plan((Step("fuse_rows", {**args, "whole_steps": True}),), plan.strategy,
                    plan.reason + "; only the last step of each thread's walk tests the row's end")
    every = {**args, "vector": vector} if vector > 1 else {k: v for k, v in args.items() if k != "vector"}
    fallback = Plan((Step("fuse_rows", every),), plan.strategy,
                    plan.reason.replace(f"vector {args.get('vector', 1)}", f"vector {vector}")
                    + "; every step tests the row's end (the straight-line walk spilled)")
    return straight, (fallback,)


# A group with column reductions (a normalization's backward with dγ, dβ: row_columns.py) keeps
# its row AND one accumulator per column reduction in registers through the rows its block walks,
# at most MAX_COLUMN_BLOCKS_PER_SM resident blocks per SM (row_columns.py says why).
# Registers per thread for the row arrays and column accumulators of such a group: half of
# MAX_ROW_REGISTERS, since the backward's expressions keep more values live (ptxas, sm_90: layer
# norm's backward at 64 threads x 16 bf16 elements spilled at 96 registers; at 8 elements per
# thread every width from 768 to 8192, fp32 and bf16, compiled in 48-64 registers without spills).
MAX_COLUMN_ROW_REGISTERS = 32


def _column_choice(group: Any, tgt: Target) -> RowFusedChoice | str:
    """The row-fused plan for a row group with column reductions: the fewest threads (at least
    MIN_THREADS) whose cached row and column sums fit MAX_COLUMN_ROW_REGISTERS per thread, and
    row_blocks = SMs x resident blocks (at most MAX_COLUMN_BLOCKS_PER_SM, at most one per row):
    one wave whose blocks each walk the rows, as evenly as the row count allows (S is the fewest
    blocks with the same rows per block: fewer partial rows to fold).

    Each block loads its next row ahead (prefetch, loaded while this row's reductions and
    barriers run) whenever that keeps the resident blocks: a block without it has loads in
    flight only between a row's start and its first reduction, so narrow rows (a few KiB per row
    and block) kept too little in flight to reach DRAM bandwidth (layer norm's backward at
    8192 x 768 ran at 2.2 TB/s, bf16 at 8192 x 4096 at 2.4 TB/s). The form is the first of
    `column_options` that reaches the most resident blocks: the next row in a second set of
    registers beside the sums (768-1024 columns: 128 threads, 80 registers, 4 blocks), else
    staged in shared memory by cp.async with the sums in registers (4096 columns: 512 threads,
    64 registers and 64 KiB (fp32) per block, 2 blocks; 8192: 1024 threads, 1 block), else with
    the sums in shared memory too. Why not, when the row is symbolic or too long."""
    columns = const_int(group.columns)
    if columns is None:
        return "the row has column reductions and a symbolic length (their sums need a fixed set of columns per thread)"
    row_inputs = list(group.row_inputs)
    sizes = {_itemsize(t) for t in row_inputs}
    itemsize = min(sizes) if sizes else 4
    vector = choose_vector(columns, itemsize) if len(sizes) == 1 else 1
    row_arrays, sums = max(len(row_inputs), 1), len(group.column_reductions)
    target_elements = max(TARGET_PER_THREAD, TARGET_BYTES // itemsize)
    point = _column_point(columns, vector, row_arrays + sums, target_elements)
    if point is None:
        point = _column_point(columns, vector, 2 * row_arrays, target_elements)
        if point is None:
            return (f"the row of {columns} columns and its column sums do not fit {MAX_COLUMN_ROW_REGISTERS} registers "
                    "per thread at any thread count")
    threads, elements = point
    fits = [(where, into, min(column_resident(threads, words, where, smem, tgt), MAX_COLUMN_BLOCKS_PER_SM), words, smem)
            for where, into, words, smem in column_options(elements, threads, vector, row_inputs, sums)]
    best = max(f[2] for f in fits)
    if best == 0:
        return f"no block of {threads} threads keeping the row and its column sums fits an SM of {tgt.arch}"
    where, into, resident, words, smem = next(f for f in fits if f[2] == best)
    prefetch = into is not None
    row_blocks = tgt.sm_count * resident
    n_rows = const_product(group.rows)
    if n_rows is not None:
        row_blocks = max(1, min(row_blocks, n_rows))
        if n_rows:  # no rows: one block, which writes the column sums' identities
            row_blocks = -(-n_rows // -(-n_rows // row_blocks))  # as many rows per block, fewer blocks
    names = ", ".join(t.name for t in group.column_reductions)
    step_args: dict[str, Any] = {"threads": threads, "cache": "registers"}
    if vector > 1:
        step_args["vector"] = vector
    step_args["row_blocks"] = row_blocks
    if where == "shared":
        step_args["column_sums"] = "shared"
    if prefetch:
        step_args["prefetch"] = True
    if into == "shared":
        step_args["prefetch_into"] = "shared"
    if itemsize == 2:  # 16-bit rows: each element converted once per row, not once per pass
        step_args["float_rows"] = True
    row_bytes = sum(_itemsize(t) * columns for t in row_inputs) + sum(
        _itemsize(t) * columns for t in group.elementwise)
    reason = (f"{len(group.reductions) + len(group.elementwise) + len(group.row_values)} stage(s) sharing rows of "
              f"{group.columns} in one kernel ({row_bytes} B/row) and the column reduction(s) {names} summed in "
              f"{'registers' if where == 'local' else 'shared memory'} by {row_blocks} blocks ({tgt.sm_count} SMs x "
              f"{resident}) walking the rows{AHEAD[into]}, then folded "
              f"by a combine kernel; {threads} threads, {elements} elements per row array per thread, vector {vector}")
    plan = Plan((Step("fuse_rows", step_args),), "row_fused", reason)
    fallbacks: tuple[Plan, ...] = ()
    if columns % (threads * vector):
        # the walk testing every step, falling back to the straight-line walk where that spills
        # (fp32 rows of 2051, 5000 and 8191 spilled 8, 4 and 172 bytes on sm_90 with every step
        # tested, none straight; at 768 the straight walk took 321 instructions per row, not 293)
        straight, _ = straight_walk(plan, vector)
        fallbacks = (straight,)
    stages = len(group.reductions) + len(group.elementwise)
    return RowFusedChoice(plan, threads, "registers", float(row_bytes), float(row_bytes), plan.reason, vector,
                          reductions=len(group.reductions), stages=stages, arrays=row_arrays, itemsize=itemsize,
                          elementwise=bool(group.elementwise), fallbacks=fallbacks,
                          walk=ColumnWalk(row_blocks, sums, elements, resident, into, where, words, smem,
                                          tuple(group.rows), columns))


def column_resident(threads: int, words: int, where: str, shared_bytes: int, tgt: Any) -> int:
    """Resident blocks per SM of a column-reduction row kernel whose row arrays (and, with
    `where` "local", column sums) take `words` registers per thread beside
    COLUMN_KERNEL_REGISTERS, and whose block takes `shared_bytes` of shared memory (the sums
    with `where` "shared", the next row's stages): 0 when not one block fits."""
    n = 0
    while (threads * (n + 1) <= SM_THREADS
           and SM_REGISTERS // (threads * (n + 1)) >= words + COLUMN_KERNEL_REGISTERS
           and (shared_bytes == 0 or (shared_bytes <= tgt.smem_per_block_optin
                                      and (n + 1) * shared_bytes <= tgt.smem_per_sm))):
        n += 1
    return n


AHEAD = {None: "", "registers": ", each loading its next row ahead into registers",
         "shared": ", each staging its next row in shared memory by cp.async"}


def column_options(elements: int, threads: int, vector: int, row_inputs: Sequence[Tensor],
                   sums: int) -> list[tuple[str, str | None, int, int]]:
    """The forms of a column-reduction row kernel, preferred first: (where the column sums
    live, where the next row is loaded ahead (None: not), registers per thread for the row
    arrays and the sums kept in registers, shared bytes per block). The next row in registers
    where it keeps the most resident blocks beside the sums (768-1024 columns: ptxas issued those
    loads before the row's reductions); else staged in shared memory by cp.async (4096 columns:
    in registers ptxas issued the loads past both reductions' barriers, and the backward ran no
    faster than without them), which a thread's vectors of 2 bytes cannot take (cp.async moves 4,
    8 or 16 bytes); else the sums too in shared memory; else nothing ahead."""
    arrays = max(len(row_inputs), 1)
    stage = stage_bytes(threads, vector, -(-elements // vector), [_itemsize(t) for t in row_inputs])
    sums_smem = sums * elements * threads * 4
    staged = all(vector * _itemsize(t) in ASYNC_BYTES for t in row_inputs)
    options: list[tuple[str, str | None, int, int]] = [("local", "registers", elements * (2 * arrays + sums), 0)]
    if staged:
        options += [("local", "shared", elements * (arrays + sums), stage),
                    ("shared", "shared", elements * arrays, stage + sums_smem)]
    options += [("shared", "registers", elements * 2 * arrays, sums_smem), ("local", None, elements * (arrays + sums), 0)]
    return options


def _column_point(columns: int, vector: int, arrays: int, target_elements: int) -> tuple[int, int] | None:
    """(threads, elements per array per thread): the fewest threads (at least MIN_THREADS) whose
    `arrays` register arrays fit MAX_COLUMN_ROW_REGISTERS, preferring at most `target_elements`."""
    fits = [t for t in THREAD_CHOICES if t >= MIN_THREADS
            and -(-columns // (t * vector)) * vector * arrays <= MAX_COLUMN_ROW_REGISTERS]
    if not fits:
        return None
    threads = next((t for t in fits if -(-columns // (t * vector)) * vector <= target_elements), fits[-1])
    return threads, -(-columns // (threads * vector)) * vector


# a warp per row is taken over the one-block-per-row point only when predicted this much faster:
# at a tie (both DRAM-bound) the measured point stays
ROWS_PER_BLOCK_MARGIN = 0.9
ROWS_PER_BLOCK_TIE = 0.02
ROWS_PER_BLOCK_CHOICES = (2, 4, 8, 16)


def choose_rows_per_block(n_rows: int, columns: int, itemsize: int, vector: int, threads: int, arrays: int,
                          reductions: int, stages: int, bytes_per_row: float,
                          target: Target | str | None = None) -> tuple[int, str]:
    """1 (one block of `threads` per row) or W rows per block of one warp each, whichever the
    cost model predicts faster (the warp point only when the row still fits MAX_ROW_REGISTERS
    at 32 threads), with the predictions for the plan's reason."""
    tgt = resolve_target(target)
    k_warp = -(-columns // (WARP * vector)) * vector
    if threads == WARP or k_warp * arrays > MAX_ROW_REGISTERS:
        return 1, ""
    base = predict(row_point_workload(n_rows, columns, itemsize, vector, threads, 1, arrays, reductions, stages,
                                      bytes_per_row), tgt)
    costs = {w: predict(row_point_workload(n_rows, columns, itemsize, vector, WARP, w, arrays, reductions, stages,
                                           bytes_per_row), tgt) for w in ROWS_PER_BLOCK_CHOICES}
    costs = {w: c for w, c in costs.items() if c.ok and c.total < ROWS_PER_BLOCK_MARGIN * base.total}
    if not costs:
        return 1, ""
    # among the points within ROWS_PER_BLOCK_TIE of the best, the fewest blocks: the block term
    # is fitted on one kernel (CostParameters.block_cycles) and the others do not add to it
    fastest = min(c.total for c in costs.values())
    best = max(w for w, c in costs.items() if c.total <= fastest * (1 + ROWS_PER_BLOCK_TIE))
    best_cost = costs[best]
    return best, (f"; predicted {best_cost.total * 1e6:.1f} us ({best_cost.bound}-bound) vs "
                  f"{base.total * 1e6:.1f} us ({base.bound}-bound) for one block of {threads} per row")


def fused_points(columns: int) -> list[dict[str, Any]]:
    """The (threads, cache, vector) points of a one-reduction row kernel of `columns` columns
    that fuse_rows accepts: what the honesty loop measures (propose picks one of them)."""
    out: list[dict[str, Any]] = []
    for t in THREAD_CHOICES:
        for v in (1, 2, 4):
            if columns % v:
                continue
            out.append({"threads": t, "cache": "registers", "vector": v})
        out.append({"threads": t, "cache": "none", "vector": 1})
    return out


def describe_point(point: dict[str, Any]) -> str:
    extra = "".join(f", {k}={point[k]}" for k in ("rows_per_block", "unroll", "row_blocks", "column_sums", "prefetch",
                                                 "prefetch_into", "whole_steps")
                    if k in point)
    return f"row_fused(threads={point['threads']}, cache={point['cache']}, vector={point.get('vector', 1)}{extra})"


def _program_choice(program: Program) -> RowFusedChoice | str:
    return program.memo("row_fused/choice", lambda: _choice(program.args, program.target))


def _program_plan(program: Program) -> Plan:
    """The choice's plan, or where ptxas spills its kernel for the build's arch the first of its
    fallbacks that does not (RowFusedChoice.fallbacks: the straight-line walk's counterpart;
    `pipeline.first_without_spills`: no compile without fallbacks, nor without NVRTC, and the
    plan itself where every one spills); memoized per program, and its position among the
    fallbacks per structure (`rankings.by_structure`: a model's layers compile it once)."""
    choice = _program_choice(program)
    assert isinstance(choice, RowFusedChoice)
    plans = (choice.plan, *choice.fallbacks)
    if len(plans) < 2:
        return choice.plan

    def first() -> int:   # the position of the plan taken: it serves the programs of this structure
        found = first_without_spills(program.args, plans, program.compile_arch, program.name, lowered=program.module)
        return next(n for n, plan in enumerate(plans) if plan is found)

    return program.memo("row_fused/plan", lambda: plans[by_structure(program, "row_fused/plan", first)])


def _rows_at(rows: Sequence[Expr], sizes: dict[str, int]) -> int:
    """The row count at the program's sizes (a symbolic one without a size at DEFAULT_SIZE)."""
    n = 1
    for e in rows:
        env = {v: int(sizes.get(v.name, DEFAULT_SIZE)) for v in walk(e) if isinstance(v, Var)}
        n *= evaluate_int(e, env)
    return max(n, 1)


def row_kernel_info(program: Program) -> KernelInfo:
    """The facts of the program's first reduction kernel (the row shape and the row length at the
    program's sizes), which the one-block-per-row kernels are priced on."""
    for kernel in program.kernels:
        info = program.info(kernel)
        if info.reduction:
            return info
    return program.info(program.kernels[0])


class RowFused(GraphStrategy):
    """The registry's face of this module: guard, its one point, its workload, the fuse_rows step."""

    name = "row_fused"
    description = ("a row group (reductions over the rows' last axis, elementwise outputs of the row shape) as one "
                   "kernel: one block (or one warp) per row, the row kept in registers or re-read in chunks")

    def guard(self, program: Program) -> str | None:
        found = _program_choice(program)
        return found if isinstance(found, str) else None

    def space(self, program: Program) -> list[Point]:
        return [dict(_program_plan(program).steps[0].args)]

    def workload(self, program: Program, point: Point) -> Workload:
        choice = _program_choice(program)
        assert isinstance(choice, RowFusedChoice)
        if choice.walk is not None:
            return column_workload(choice, choice.walk.columns, _rows_at(choice.walk.rows, program.sizes))
        info = row_kernel_info(program)
        n_rows, columns = info.outputs, max(info.reduce_extent, 1)
        one_reduction = choice.reductions == 1 and not choice.elementwise
        if one_reduction and int(point.get("rows_per_block", 1)) == 1:
            return fused_workload(info, point, program.target)   # the benchmarked row kernel
        if point["cache"] == "registers":
            return row_point_workload(n_rows, columns, choice.itemsize, int(point.get("vector", 1)),
                                      int(point["threads"]), int(point.get("rows_per_block", 1)), choice.arrays,
                                      choice.reductions, choice.stages, choice.fused_bytes_per_row)
        infos = [program.info(k) for k in program.kernels if k not in choice.closed]
        flops = sum(i.flops for i in infos)
        special = float(sum(i.iterations * i.special_per_iteration for i in infos))
        arith = float(sum(i.iterations * (i.arith_instructions_per_iteration or i.flops_per_iteration) for i in infos))
        return chunked_workload(n_rows, columns, choice, point, flops, special, arith)

    def apply(self, sch: Any, program: Program, point: Point) -> None:
        sch.fuse_rows(**point)

    def reason(self, program: Program, point: Point, resources: Any = None) -> str:
        return _program_plan(program).reason

    def describe(self, point: Point) -> str:
        return describe_point(point)


register(RowFused())


__all__ = ["RowFused", "RowFusedChoice", "chunked_workload", "choose_long_row", "choose_point", "choose_rows_per_block",
           "column_options", "column_resident", "column_workload", "describe_point", "fills_registers",
           "fit_row_registers", "fused_points", "fused_workload", "propose", "row_kernel_info", "row_point_workload",
           "straight_walk"]
