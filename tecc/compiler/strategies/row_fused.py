"""row_fused: a reduce→elementwise graph sharing the row as ONE kernel (tecc.passes.rewrite.fuse_rows).

This strategy is a *graph* rewrite, not a schedule of one lowered kernel, so it is planned over
the whole program (`propose`) rather than through the per-kernel registry API; the planner calls
`propose(tensors, target)` before planning kernel by kernel and keeps the result when it moves
fewer global bytes than the unfused kernels (the hook is described in docs/memory-bound.md).

Cost (the issue's criterion: fewer global bytes under the register / shared-memory limits):
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
  half the threads (`fit_row_registers`: 50,304 logits at 512 threads, not 1024), and 8-byte
  vectors when it fills most of them;
* a row past the register budget (or of symbolic length) is re-read once per pass; where the
  group has a max / sum-of-exp or a sum / sum-of-squared-deviations pair (softmax, layer norm)
  the pair is one pass (cache="online": running max, Welford moments), so the row is read twice.
  Its walk (`choose_long_row`) takes 16-byte vectors when the row length allows and chunks of
  LONG_ROW_BYTES per thread: U loads issued before any is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ...ir.errors import ScheduleError
from ...ir.expr import TensorRead, const_int, free_vars, walk
from ...ir.tensor import Tensor
from ...ir.target import Target
from ...passes.rewrite.fuse_rows import (COLUMN_KERNEL_REGISTERS, ROW_KERNEL_REGISTERS, SM_REGISTERS, SM_THREADS, fuse_rows,
                                         row_group)
from ...passes.rewrite.row_columns import MAX_COLUMN_BLOCKS_PER_SM
from ...passes.schedule.cross_thread import WARP
from ..cost.analysis import KernelInfo
from ..cost.model import Workload
from ..cost.traffic import compulsory_bytes
from ..plan import Plan, Step

THREAD_CHOICES = (64, 128, 256, 512, 1024)
TARGET_PER_THREAD = 8
TARGET_BYTES = 32
MIN_THREADS = 64
MAX_ROW_REGISTERS = 64
LONG_ROW_COLUMNS = 8192
VECTOR_BYTES = 16


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
# (fuse_rows.ROW_KERNEL_REGISTERS); a row array taking more than ROW_CAP_SHARE of the thread's
# registers takes 8-byte vectors: ptxas (sm_90) spilled the cross-entropy forward + backward at
# 512 threads x 100 registers of row with 16-byte vectors (8 B fp32 float4, 4 B bf16 uint4; each
# 16-byte access needs four aligned consecutive registers) and not with 8-byte ones.
THREAD_REGISTERS = 255
ROW_CAP_SHARE = 0.75


def fit_row_registers(columns: int, threads: int, vector: int, arrays: int, itemsize: int) -> tuple[int, int]:
    """(threads, vector) for a row kept in registers: `threads` halved while the row arrays (one
    register per element, `arrays` of them) and the kernel's own registers exceed what one
    resident block leaves a thread (64 K / threads, at most 255): at 1024 threads a thread has
    64, so a cross-entropy over 50,304 logits (52 per thread) spilled at 1024 threads and fits
    512 (100 of 128). A row that takes most of the thread's registers gets 8-byte vectors."""
    def words(t: int, v: int) -> int:
        return -(-columns // (t * v)) * v * max(arrays, 1)

    def cap(t: int) -> int:
        return min(THREAD_REGISTERS, SM_REGISTERS // t)

    while (threads // 2 >= MIN_THREADS and words(threads, vector) + ROW_KERNEL_REGISTERS > cap(threads)
           and words(threads // 2, vector) + ROW_KERNEL_REGISTERS <= cap(threads // 2)):
        threads //= 2
    narrow = max(1, 8 // itemsize)
    if vector > narrow and columns % narrow == 0 and words(threads, vector) > ROW_CAP_SHARE * cap(threads):
        vector = narrow
    return threads, vector


# A 16-bit row of more elements per thread than this keeps them converted to float32
# (fuse_rows' float_rows): ptxas has no registers left to keep converted copies across the
# passes' barriers, so each pass converts again (the cross-entropy over 50,304 bf16 logits, 100
# per thread: 3432 -> 3136 instructions, sm_90). Up to 32 per thread (the forward softmax, layer
# and RMS norm at 1024-8192 columns) the SASS is the same either way, so their kernels stay as
# measured. Row kernels with column reductions always take it (propose_with_columns).
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
    contraction (B[k, j] in a matmul) or a reduction over a middle axis is left to the planner."""
    for t in group.reductions:
        for r in t.op.reductions:
            axis = r.axes[0]
            for node in walk(r.source):
                if not isinstance(node, TensorRead):
                    continue
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


def _online_pairs(tensors: Sequence[Tensor], threads: int) -> int:
    """How many reduction passes fuse_rows(cache="online") folds into the pass before them."""
    try:
        (kernel,) = fuse_rows(tensors, threads, "online").kernels
    except ScheduleError:
        return 0
    return int(dict(kernel.attrs).get("online_pairs", 0))  # type: ignore[call-overload]


def propose(tensors: Sequence[Tensor], target: Any = None) -> RowFusedChoice | None:
    """The row-fused plan for the program `tensors`, or None when it is not a row group or the
    rewrite would not move fewer global bytes."""
    try:
        group = row_group(tensors)
    except ScheduleError:
        return None
    if not _walks_rows_along_their_last_axis(group):
        return None
    if group.column_reductions:
        return propose_with_columns(group, target)
    columns = const_int(group.columns)
    width = columns if columns is not None else 4096  # a symbolic row: bytes per row for the comparison
    row_inputs = [t for t in group.program.args if t.is_placeholder and len(t.shape) == len(group.rows) + 1]
    sizes = {_itemsize(t) for t in row_inputs}
    itemsize = min(sizes) if sizes else 4
    threads, cache = choose_point(columns, len(row_inputs), itemsize)
    # 16-byte accesses (codegen/vectorize.py: float4, or 8 half-precision elements as a uint4)
    # when every row input has one element size
    vector = choose_vector(columns, itemsize) if cache == "registers" and len(sizes) == 1 else 1
    if cache == "registers" and columns is not None:
        threads, vector = fit_row_registers(columns, threads, vector, len(row_inputs), itemsize)
    unroll = 1
    if cache != "registers":
        long_vector, unroll = choose_long_row(columns, itemsize)
        vector = long_vector if len(sizes) == 1 else 1
    # bytes per row, fused: inputs once (cache="none": once per reduction pass + once for outputs)
    passes = 1 if cache == "registers" else len(group.reductions) + (1 if group.elementwise else 0)
    if cache == "none":
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
        return None
    rows_per_block, priced = 1, ""
    n_rows = _const_rows(group)
    if cache == "registers" and columns is not None and n_rows is not None:
        arrays = max(len(row_inputs), 1)
        rows_per_block, priced = choose_rows_per_block(n_rows, columns, itemsize, vector, threads, arrays,
                                                       len(group.reductions), stages, fused, target)
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
    plan = Plan((Step("fuse_rows", step_args),), "row_fused",
                f"{stages} stage(s) sharing rows of {group.columns} in one kernel: {fused:.0f} B/row "
                f"instead of {unfused:.0f} B/row unfused; {layout}, row cache {cache}, vector {vector}" + priced)
    return RowFusedChoice(plan, int(step_args["threads"]), cache, fused, unfused, plan.reason, vector,
                          rows_per_block)


# A group with column reductions (a normalization's backward with dγ, dβ: row_columns.py) keeps
# its row AND one accumulator per column reduction in registers through the rows its block walks,
# at most MAX_COLUMN_BLOCKS_PER_SM resident blocks per SM (row_columns.py says why).
# Registers per thread for the row arrays and column accumulators of such a group: half of
# MAX_ROW_REGISTERS, since the backward's expressions keep more values live (ptxas, sm_90: layer
# norm's backward at 64 threads x 16 bf16 elements spilled at 96 registers; at 8 elements per
# thread every width from 768 to 8192, fp32 and bf16, compiled in 48-64 registers without spills).
MAX_COLUMN_ROW_REGISTERS = 32


def propose_with_columns(group: Any, target: Any = None) -> RowFusedChoice | None:
    """The row-fused plan for a row group with column reductions: the fewest threads (at least
    MIN_THREADS) whose cached row and column sums fit MAX_COLUMN_ROW_REGISTERS per thread, and
    row_blocks = SMs x resident blocks (at most MAX_COLUMN_BLOCKS_PER_SM, at most one per row):
    one wave whose blocks each walk the rows, as evenly as the row count allows (S is the fewest
    blocks with the same rows per block: fewer partial rows to fold).

    Each block loads its next row ahead (prefetch: a second set of row registers, loaded while
    this row's reductions and barriers run) whenever that keeps the resident blocks: a block
    without it has loads in flight only between a row's start and its first reduction, so
    narrow rows (a few KiB per row and block) kept too little in flight to reach DRAM bandwidth
    (layer norm's backward at 8192 x 768 ran at 2.2 TB/s, bf16 at 8192 x 4096 at 2.4 TB/s).
    The column sums stay in registers when the second row set fits beside them at the same
    residency (768-1024 columns: 128 threads, 80 registers, 4 blocks), else they move to shared
    memory (4096 columns: 512 threads, 64 registers, 2 blocks; 8192: 1024 threads, 1 block).
    Without a residency-preserving form the plan has no prefetch. None when the row is
    symbolic or too long."""
    from ..planner import resolve_target  # the planner imports the strategies: imported when called

    columns = const_int(group.columns)
    if columns is None:
        return None
    tgt = resolve_target(target)
    row_inputs = [t for t in group.program.args if t.is_placeholder and len(t.shape) == len(group.rows) + 1]
    sizes = {_itemsize(t) for t in row_inputs}
    itemsize = min(sizes) if sizes else 4
    vector = choose_vector(columns, itemsize) if len(sizes) == 1 else 1
    row_arrays, sums = max(len(row_inputs), 1), len(group.column_reductions)
    target_elements = max(TARGET_PER_THREAD, TARGET_BYTES // itemsize)
    point = _column_point(columns, vector, row_arrays + sums, target_elements)
    if point is None:
        point = _column_point(columns, vector, 2 * row_arrays, target_elements)
        if point is None:
            return None
    threads, elements = point
    options = [  # (where the sums live, prefetch, the row words per thread), preferred first
        ("local", True, elements * (2 * row_arrays + sums)),
        ("shared", True, elements * 2 * row_arrays),
        ("local", False, elements * (row_arrays + sums)),
    ]
    fits = [(where, ahead, column_resident(threads, words, where, sums * elements * threads * 4, tgt))
            for where, ahead, words in options]
    best = max(min(n, MAX_COLUMN_BLOCKS_PER_SM) for _, _, n in fits)
    if best == 0:
        return None
    where, prefetch, resident = next((w, a, min(n, MAX_COLUMN_BLOCKS_PER_SM)) for w, a, n in fits
                                     if min(n, MAX_COLUMN_BLOCKS_PER_SM) == best)
    row_blocks = tgt.sm_count * resident
    n_rows = _const_rows(group)
    if n_rows is not None:
        row_blocks = max(1, min(row_blocks, n_rows))
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
    if itemsize == 2:  # 16-bit rows: each element converted once per row, not once per pass
        step_args["float_rows"] = True
    row_bytes = sum(_itemsize(t) * columns for t in row_inputs) + sum(
        _itemsize(t) * columns for t in group.elementwise)
    reason = (f"{len(group.reductions) + len(group.elementwise) + len(group.row_values)} stage(s) sharing rows of "
              f"{group.columns} in one kernel ({row_bytes} B/row) and the column reduction(s) {names} summed in "
              f"{'registers' if where == 'local' else 'shared memory'} by {row_blocks} blocks ({tgt.sm_count} SMs x "
              f"{resident}) walking the rows{', each loading its next row ahead' if prefetch else ''}, then folded "
              f"by a combine kernel; {threads} threads, {elements} elements per row array per thread, vector {vector}")
    plan = Plan((Step("fuse_rows", step_args),), "row_fused", reason)
    return RowFusedChoice(plan, threads, "registers", float(row_bytes), float(row_bytes), reason, vector)


def column_resident(threads: int, words: int, where: str, shared_bytes: int, tgt: Any) -> int:
    """Resident blocks per SM of a column-reduction row kernel whose row arrays (and, with
    `where` "local", column sums) take `words` registers per thread beside
    COLUMN_KERNEL_REGISTERS, and with "shared" `shared_bytes` of sums per block: 0 when not one
    block fits."""
    n = 0
    while (threads * (n + 1) <= SM_THREADS
           and SM_REGISTERS // (threads * (n + 1)) >= words + COLUMN_KERNEL_REGISTERS
           and (where == "local" or (shared_bytes <= tgt.smem_per_block_optin
                                     and (n + 1) * shared_bytes <= tgt.smem_per_sm))):
        n += 1
    return n


def _column_point(columns: int, vector: int, arrays: int, target_elements: int) -> tuple[int, int] | None:
    """(threads, elements per array per thread): the fewest threads (at least MIN_THREADS) whose
    `arrays` register arrays fit MAX_COLUMN_ROW_REGISTERS, preferring at most `target_elements`."""
    fits = [t for t in THREAD_CHOICES if t >= MIN_THREADS
            and -(-columns // (t * vector)) * vector * arrays <= MAX_COLUMN_ROW_REGISTERS]
    if not fits:
        return None
    threads = next((t for t in fits if -(-columns // (t * vector)) * vector <= target_elements), fits[-1])
    return threads, -(-columns // (threads * vector)) * vector


def _const_rows(group: Any) -> int | None:
    n = 1
    for e in group.rows:
        c = const_int(e)
        if c is None:
            return None
        n *= c
    return n


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


# a warp per row is taken over the one-block-per-row point only when predicted this much faster:
# at a tie (both DRAM-bound) the measured point stays
ROWS_PER_BLOCK_MARGIN = 0.9
ROWS_PER_BLOCK_TIE = 0.02
ROWS_PER_BLOCK_CHOICES = (2, 4, 8, 16)


def choose_rows_per_block(n_rows: int, columns: int, itemsize: int, vector: int, threads: int, arrays: int,
                          reductions: int, stages: int, bytes_per_row: float, target: Any = None) -> tuple[int, str]:
    """1 (one block of `threads` per row) or W rows per block of one warp each, whichever the
    cost model predicts faster (the warp point only when the row still fits MAX_ROW_REGISTERS
    at 32 threads), with the predictions for the plan's reason."""
    from ..cost.model import predict
    from ..planner import resolve_target  # the planner imports the strategies: imported when called

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


# Latencies of the one-row kernel's serial path (cycles; sm_80/sm_90 microbenchmarks, approximate)
GLOBAL_LATENCY_CYCLES = 550.0      # CostParameters.global_latency_cycles
SHUFFLE_CYCLES = 30.0              # one __shfl_xor_sync round trip
BARRIER_CYCLES = 40.0              # CostParameters.barrier_cycles
FADD_LATENCY_CYCLES = 4.0
TREE_INSTRUCTIONS = 40.0           # per warp: two 5-step shuffle trees, the shared hand-off, the store


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
    in_flight_loads = k if cache == "registers" else max(1, min(k, u))
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


def describe_point(point: dict[str, Any]) -> str:
    return f"row_fused(threads={point['threads']}, cache={point['cache']}, vector={point.get('vector', 1)})"


__all__ = ["RowFusedChoice", "choose_long_row", "choose_point", "choose_rows_per_block", "column_resident",
           "describe_point", "fit_row_registers", "fused_points",
           "fused_workload", "propose", "row_point_workload"]
