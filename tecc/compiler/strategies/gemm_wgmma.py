"""gemm_wgmma: float16/bfloat16 contractions on Hopper's warpgroup tensor cores (wgmma.mma_async);
gemm_wgmma_tf32 (end of the file): float32 ones as tf32 (wgmma.m64nNk8), only with allow_tf32;
gemm_wgmma_fp8 (gemm_wgmma_fp8.py): fp8 ones.

The first rung of the Hopper ladder: "wgmma + cp.async ring, 128B swizzle". It serves what
gemm_tensor_core serves (the same guard: C[b.., i, j] = epilogue(Σ_k A · B), A and B both
float16 or both bfloat16, every index one axis) on sm_90 only -- wgmma exists on sm_90a alone
(sm_8x has no wgmma, sm_100 replaced it) -- with the primitives (`apply`):
`tensorize(stage, intrinsic="wgmma", block, warps=(4·BM/64, 1), k_tile=64)`, `stage_operand` of
each operand, `pipeline(k_tile, stages, producer)`, and for the TMA rung `warp_specialize`,
`persistent` and `epilogue` (tecc/passes/schedule/tensorize_wgmma.py, ring.py, tma.py). A separate strategy rather than a
`path` dimension of gemm_tensor_core because its space, register and shared-memory accounting
and cost are different (no warp grid, no ldmatrix, BK fixed by the swizzle, a ring whose depth
loses one stage to the wgmma in flight); the planner ranks both by predicted time, and explain
shows the best of each.

Point: BM ∈ {64, 128} (1 or 2 consumer warpgroups), BN ∈ {64, 128, 256}, stages ∈ 2..5, with
stages · (BM + BN) · 64 · 2 bytes of ring (+ 1024 bytes of alignment slack) within the opt-in
shared-memory limit, "split" S (split-K, offered and priced by gemm_split.py where the output has
few tiles); and load ∈ {"cp.async", "tma"}, the rung:
- "cp.async" (the first rung): every thread issues 16-byte cp.async copies into the ring, one
  __syncthreads and proxy fence per k tile (tensorize_wgmma.py);
- "tma" (the second rung): warp specialization -- one producer warpgroup issues a TMA tile copy
  per operand and k tile into an mbarrier ring (expect-tx on full barriers), the consumer
  warpgroups wait on them and release stages through empty barriers, setmaxnreg moves registers
  to the consumers (ring.py, tma.py). Offered only when both operands suit TMA
  (`tma_refusal_for`: every index a plain loop variable -- no implicit-GEMM gather, no
  padding; a view merging consecutive dimensions of a contiguous buffer, X[i // T, i % T, k]
  of x.view(B·T, C), counts as its merged dimension, which the tensor map merges too (tma.py)
  --, strides fixed at compile time, rows a multiple of 16 bytes); otherwise the point is
  not in the space and explain says why.

Workload for the cost model (the structure of gemm_tensor_core's, fitted there on an H200; the
wgmma constants are assumed until this path is timed):
- tensor: the padded tile FLOPs at WGMMA_FRACTION of the dense tensor peak (the table's peak is
  wgmma's; gemm_tensor_core prices mma.sync on sm_90 at 0.6 of it);
- global: A once per column tile, B once per row tile through L2; DRAM the panels each wave of
  resident blocks spans (gemm_tensor_core.wave_dram_bytes);
- shared: wgmma reads its A (64 x 64 per warpgroup) and B (BN x 64) tiles from shared memory
  once per k tile per warpgroup, in 128-byte wavefronts (the 128B swizzle is conflict-free),
  plus the ring's writes; no ldmatrix instructions and no A/B fragment registers;
- chain (`wgmma_sm_chain`: one SM's round of resident blocks): per k tile a block's wgmmas at
  the SM's tensor rate (its warpgroups span all four schedulers) or its shared-pipe wavefronts
  when more, then a stall: with P = 1 wgmma group in flight the barrier, fence and refill issue
  overlap the running group and stall only for what exceeds it; with P = 0 (2 stages) they and
  the wgmma's drain are serial; plus the loaded global latency the D = S - 1 - P tiles ahead do
  not cover. The tensor pipe idles only while every resident block stalls at once;
- registers: BN / 2 f32 accumulators, addressing and the copy state (as gemm_tensor_core), and
  the two 64-bit descriptors; ptxas stayed at or below this estimate on every tested point.
- the TMA rung differs in: no per-thread copy instructions or copy addresses (the producer
  thread's few instructions per k tile are off the consumers' issue slots), no __syncthreads or
  proxy fence per k tile (TMA_SYNC_CYCLES for the mbarrier wait and release instead of
  WGMMA_SYNC_CYCLES), S - 1 tiles ahead (the refill does not wait for this iteration's wgmma),
  one more warpgroup per block (128 threads), and with two consumer warpgroups the registers of
  __launch_bounds__(384): 168 per thread at launch, the consumers raised to 232 by setmaxnreg.
- a TMA point carries two more knobs, each a rung of the ladder the space enumerates (so a sweep
  can turn each off and show what it buys):
  "epilogue": "registers" (each thread stores its accumulator elements to global memory) or
  "tma" (through a 128B-swizzled shared staging tile of BM x BN output elements, written out by
  TMA stores; epilogue.py), offered where the output can take a tensor map
  (`tma_store_refusal_for`), its staging tile counted in the shared-memory budget; where it
  cannot (rows not a multiple of 16 bytes: a vocabulary of 50,257 logits), "threads" instead
  (the same staging tile, copied out by the consumer threads' element stores, whole runs of a
  row per warp store, at THREAD_COPY_BYTES_PER_CYCLE, or under the next tile's k loop in the
  persistent grid without split-K);
  "persistent": 0 (one block per output tile) or the SM count (rung 4: blocks loop over the
  tiles in a grouped order, step 5).
- the per-tile fixed cost (`tile_fixed_cycles`), in the chain relative to one block per tile
  with the register epilogue (whose cost the k-loop constants already carry, as
  gemm_tensor_core's fitted ones do; that baseline adds nothing): the ring's fill (a k tile's
  loaded latency before the first wgmma) and the epilogue. From registers the consumers store
  the tile at REGISTER_EPILOGUE_BYTES_PER_CYCLE (4-byte pieces, half-used sectors; fitted to the
  ~4.5 us per 128x256 tile the H200 timings of 4096^3 and 8192^3 imply); through staging they
  write shared memory two columns per store (a wavefront per 128 bytes), meet at a named barrier, and the
  TMA unit reads the tile at SMEM_WAVEFRONT_BYTES per cycle before the block may exit (its
  global writes drain behind). In the persistent grid the producer fills the next tile's stages
  during the epilogue (the fill is paid once per block) and, with the TMA epilogue, the staging
  tile is read out under the next tile's k loop (only its writes and barrier stay exposed); the
  busiest block runs ceil(tiles / P) tiles, which is also what prices the tail.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Any, Iterable

from ...ir.descriptor import DESCRIPTOR_ALIGNMENT
from ...ir.target import Target
from ..cost.analysis import KernelInfo
from ..cost.model import Workload
from ..cost.occupancy import occupancy
from .gemm_tensor_core import (
    ADDRESSING,
    LOADED_LATENCY_CYCLES,
    SMEM_WEIGHT,
    GemmTensorCore,
    GemmTensorCoreTF32,
    mma_view,
    copy_sizes,
    gemm_view,
    output_stageable,
    output_traffic,
    run_time_stride_note,
    staged_output_bytes,
    wave_dram_bytes,
    worth_staging,
)
from .gemm_epilogue_cost import epilogue_math_cycles, epilogue_math_note
from .gemm_split import (split_chain, split_handover_cycles, split_in_one_wave, split_label, split_note, split_of,
                         split_parts, split_registers, split_traffic, wgmma_split_sum)
from .registry import Point, Strategy, register

BLOCK_M = (64, 128)
# 192: a wave of 128 x 192 tiles fills the SMs where 128 x 256 leaves them half idle or needs
# split-K (GPT-2's 768 x 3072 weight gradients: 96 tiles instead of 72; TMA rings only)
BLOCK_N = (64, 128, 192, 256)
# Listed in the order the planner takes among equal predictions (the sort is stable): 4 stages
# keep two tiles loading while one wgmma group runs (the design point), 3 one, 5 three; 2 stages
# must wait for every wgmma group.
STAGES = (4, 3, 5, 2)
K_TILE = 64
WARPGROUP = 128
# wgmma's share of the dense tensor peak of the target's table (the peak is wgmma's own); the
# chain prices the stalls of the non-specialized ring separately. Assumed, not fitted: cuBLAS
# reaches ~0.7 of the peak at 4096^3 on an H200 with TMA, warp specialization and persistence.
WGMMA_FRACTION = 0.8
WGMMA_ARCH = 90
SMEM_WAVEFRONT_BYTES = 128.0
# A block's barrier, proxy fence and refill issue per k tile (gemm_tensor_core's SYNC_CYCLES, 400,
# also holds the ldmatrix pipeline refill, which wgmma has not). Assumed, not fitted.
WGMMA_SYNC_CYCLES = 300.0
# A 2-stage ring waits for all its wgmmas each k tile (wait_group 0): the wgmma's latency from
# issue to completion is then paid per tile. Assumed (about one m64n256k16's latency), not fitted.
WGMMA_DRAIN_CYCLES = 128.0
# The TMA ring's per-k-tile synchronization on the consumers' path: an mbarrier try_wait that
# usually finds its phase complete, and one arrive per warp. Assumed, not fitted.
TMA_SYNC_CYCLES = 60.0
LOADS = ("cp.async", "tma")
EPILOGUES = ("tma", "registers")   # the TMA rung's epilogue knob; the planner prefers "tma" among equals
# Where TMA cannot store the output (rows not a multiple of 16 bytes): the staging tile copied out
# by the consumer threads instead ("threads"), beside the register epilogue.
UNALIGNED_EPILOGUES = ("threads", "registers")
# Output bytes per cycle one SM's consumers store from their wgmma fragments (4-byte pieces, 8
# rows per warp instruction: half of each 32-byte sector). Fitted: 8192^3 and 4096^3 on an H200
# differ by 0.93 us per k tile and leave ~4.5 us per 128x256 fp16 tile (~8900 cycles at 1.98 GHz),
# of which ~LOADED_LATENCY_CYCLES is the ring's fill.
REGISTER_EPILOGUE_BYTES_PER_CYCLE = 8.0
# The staged epilogue's fence.proxy.async, named barrier and store issue. Assumed, not fitted.
TMA_STORE_SYNC_CYCLES = 200.0
# Output bytes per cycle one SM's consumer threads copy from the staging tile to global memory
# (epilogue "threads"): a warp's store is 32 adjacent elements of a row, 64 bytes of 2-byte outputs
# over two or three 32-byte sectors, behind a 64-byte shared load. Assumed, not fitted.
THREAD_COPY_BYTES_PER_CYCLE = 32.0
PRODUCER_THREADS = 128
TMA_LAUNCH_REGISTERS = 168   # 65536 / 384 rounded down to 8: two consumer warpgroups and the producer


def load_of(point: Point) -> str:
    """The point's rung: "cp.async" (plans made before the TMA rung have no "load") or "tma"."""
    return str(point.get("load", "cp.async"))


def epilogue_of(point: Point) -> str:
    """The point's epilogue: "registers" (plans made before the staged epilogue have none), "tma"
    or "threads"."""
    return str(point.get("epilogue", "registers"))


def staging_tile(point: Point) -> bool:
    """Whether the point's epilogue writes its outputs to the swizzled staging tile first."""
    return epilogue_of(point) in ("tma", "threads")


def aligned_slot(nbytes: int) -> int:
    """What a shared buffer takes in a kernel with wgmma descriptors: every buffer starts on a
    DESCRIPTOR_ALIGNMENT boundary (codegen's shared layout), so each takes whole 1024-byte slots."""
    return -(-nbytes // DESCRIPTOR_ALIGNMENT) * DESCRIPTOR_ALIGNMENT


def shared_bytes(point: Point, out_itemsize: int = 2) -> int:
    """The dynamic shared memory of the point's kernel, as codegen lays it out: the ring, the TMA
    ring's full and empty mbarrier arrays (one aligned slot each), the staging tile of the TMA
    epilogue, split-K's arrival counts (a slot), plus the slack the kernel uses to align the
    allocation's start to 1024 bytes."""
    stages = int(point["stages"])
    barriers = 2 * aligned_slot(8 * stages) if load_of(point) == "tma" else 0
    staging = int(point["bm"]) * int(point["bn"]) * out_itemsize if staging_tile(point) else 0
    handover = DESCRIPTOR_ALIGNMENT if split_of(point) > 1 else 0   # split-K's counts: their own aligned slot
    ring = stages * (int(point["bm"]) + int(point["bn"])) * K_TILE * 2
    return ring + DESCRIPTOR_ALIGNMENT + barriers + aligned_slot(staging) + handover


def tma_store_refusal_for(info: KernelInfo) -> str | None:
    """Why the output cannot be written by TMA stores from a staging tile, or None; the
    analysis-level mirror of epilogue.tma_store_refusal (which falls back to the
    register epilogue when it disagrees)."""
    w = info.write
    if w.itemsize not in (2, 4):
        return f"the output's {w.itemsize}-byte elements (TMA stores of 2 or 4 bytes here)"
    if w.buffer in info.strided_inputs:
        return f"the output {w.buffer} has strides that are kernel parameters"
    if not w.per_dim or any(d is None or len(d.coeff) != 1 or d.coeff[0][1] != 1 or d.const for d in w.per_dim):
        return f"the output {w.buffer} is not indexed by plain loop variables"
    if len(w.dims) >= 2 and (w.dims[-1] * w.itemsize) % 16:
        return f"the output's rows of {w.dims[-1]} elements are not a multiple of 16 bytes (TMA's stride alignment)"
    return None


def thread_store_refusal_for(info: KernelInfo) -> str | None:
    """Why the staging tile cannot be copied out by the threads (epilogue "threads"), or None;
    the analysis-level mirror of epilogue.thread_store_refusal."""
    if info.write.itemsize not in (2, 4):
        return f"the output's {info.write.itemsize}-byte elements (the staging tile's swizzle takes 2 or 4 bytes)"
    return None


def epilogues_for(info: KernelInfo) -> tuple[str, ...]:
    """The TMA rung's epilogues for this output: TMA stores where a tensor map can take it, else
    the threads' copy out of the staging tile where that can, and the registers always."""
    if tma_store_refusal_for(info) is None:
        return EPILOGUES
    return UNALIGNED_EPILOGUES if thread_store_refusal_for(info) is None else EPILOGUES[1:]


def tile_fixed_cycles(target: Target, point: Point, out_itemsize: int) -> tuple[float, float]:
    """(cycles each output tile adds to its SM's chain beyond its k loop, cycles paid once per
    block): the ring's fill and the epilogue (module docstring)."""
    bm, bn = int(point["bm"]), int(point["bn"])
    out_bytes = bm * bn * out_itemsize
    persistent = bool(point.get("persistent"))
    if staging_tile(point):
        # two adjacent columns per store (epilogue.py, staged_epilogue): 4 or 8 bytes per lane,
        # conflict-free under the swizzle, so a wavefront per 128 bytes the warp writes
        writes = out_bytes / SMEM_WAVEFRONT_BYTES + TMA_STORE_SYNC_CYCLES
        if epilogue_of(point) == "threads":
            # the consumers copy it out themselves: under the next tile's k loop in the persistent
            # grid without split-K (epilogue.deferred_copy), between k loops otherwise
            read_out = 0.0 if persistent and split_of(point) == 1 else out_bytes / THREAD_COPY_BYTES_PER_CYCLE
        else:
            read_out = 0.0 if persistent else out_bytes / SMEM_WAVEFRONT_BYTES
        epilogue = writes + read_out
    else:
        epilogue = out_bytes / REGISTER_EPILOGUE_BYTES_PER_CYCLE
    if persistent:
        return epilogue, LOADED_LATENCY_CYCLES
    return epilogue + LOADED_LATENCY_CYCLES, 0.0


def in_flight(stages: int, load: str = "cp.async") -> tuple[int, int]:
    """(wgmma groups left in flight, tiles loaded ahead) of a ring of `stages` (tensorize_wgmma;
    the TMA ring always keeps one group in flight and refills as soon as a stage is released)."""
    if load == "tma":
        return 1, stages - 1
    pending = 1 if stages >= 3 else 0
    return pending, stages - 1 - pending


def deeper_than_the_k_loop(stages: int, k_tiles: int, load: str = "cp.async") -> bool:
    """Whether a ring of `stages` is deeper than a k loop of `k_tiles` needs: one stage fewer
    already loads every k tile ahead and keeps as many wgmma groups in flight (with one k tile
    nothing is left to overlap). Such a point only costs shared memory, hence resident blocks:
    a 1x1 convolution over 64 channels (K = 64, one k tile) took 3 stages and 3 blocks per SM."""
    if stages <= 2:
        return False
    pending, _ = in_flight(stages, load)
    fewer_pending, fewer_ahead = in_flight(stages - 1, load)
    return fewer_ahead >= k_tiles and (fewer_pending == pending or k_tiles == 1)


def tma_refusal_for(info: KernelInfo) -> str | None:
    """Why the TMA rung cannot load this contraction's operands, or None (module docstring); the
    analysis-level mirror of tma.tma_refusal, which the pipeline primitive checks again."""
    view = gemm_view(info)
    if isinstance(view, str):
        return view
    if view.gathered or len(info.reduction) != 1:
        return "the reduction is several axes (an implicit GEMM gathers its operands; cp.async serves it)"
    for role, x in (("A", view.a), ("B", view.b)):
        if x.buffer in info.strided_inputs:
            return f"operand {role} ({x.buffer}) has strides that are kernel parameters (a tensor map needs them at launch)"
        if x.buffer == (view.b if role == "A" else view.a).buffer:
            return f"A and B are the same buffer {x.buffer} (one tensor map per buffer)"
        if x.split:
            return (f"operand {role} ({x.buffer}) is read through a view whose merged dimensions are not consecutive "
                    "dimensions of a row-major buffer in order (a strided or transposed merge: a TMA box needs its rows "
                    "to be one flat axis in memory)")
        if not x.per_dim or any(d is None or len(d.coeff) != 1 or d.coeff[0][1] != 1 or d.const for d in x.per_dim):
            return f"operand {role} ({x.buffer}) is not indexed by plain loop variables (TMA copies boxes)"
        if len({d.coeff[0][0] for d in x.per_dim if d is not None}) != len(x.per_dim):
            return f"operand {role} ({x.buffer}) uses one loop variable in two dimensions"
        k_dims = [n for n, d in zip(x.dims, x.per_dim) if d is not None and d.coeff[0][0] == info.reduction[0][0]]
        if k_dims and k_dims[0] != info.reduce_extent:
            return (f"operand {role} ({x.buffer}): its k dimension has {k_dims[0]} elements, the reduction "
                    f"{info.reduce_extent} (the last k tile's box would read past it)")
        if len(x.dims) >= 2 and (x.dims[-1] * x.itemsize) % 16:
            return (f"operand {role} ({x.buffer}): rows of {x.dims[-1]} elements are not a multiple of 16 bytes "
                    "(TMA's stride alignment)")
    return None


def wgmma_registers(bm: int, bn: int, sizes: tuple[int, int] = (8, 8), k_tile: int = K_TILE,
                    groups: int = 0) -> dict[str, int]:
    """Registers per thread; `sizes` as gemm_tensor_core.tile_registers, `k_tile` elements per
    128-byte row, `groups` the warpgroups (0: BM / 64)."""
    threads = WARPGROUP * (groups or bm // 64)
    copies = staged = 0
    for tile, size in ((bm * k_tile, sizes[0]), (bn * k_tile, sizes[1])):
        if size:
            copies += tile // size // threads
        else:
            staged += tile // threads
    parts = {"accumulators": bn // 2, "addressing": ADDRESSING + 4 * copies, "descriptors": 4}
    if staged:
        # the element and its guarded address, and the swizzled shared address of its store
        # (gemm_tensor_core's accounting; ptxas kept 150 at 64x64 with K = 1023, 255 at 128x256)
        parts["staged elements"] = 2 * staged
        parts["shared addresses"] = staged // 2
    return parts


def tma_registers(bm: int, bn: int, point: Point | None = None, groups: int = 0) -> dict[str, int]:
    """Registers per thread of the TMA rung at launch: the consumers' accumulators, addressing
    and descriptors (no copy state), the staging addresses of the TMA-store epilogue and the
    tile loop of the persistent grid; with two consumer warpgroups __launch_bounds__(384) and
    setmaxnreg make ptxas allocate the launch-bound cap (TMA_LAUNCH_REGISTERS) for all.
    (ptxas, 64 x BN, one consumer warpgroup: 117 at BN 128 and 214 at 256 with both; 154 at
    256 non-persistent; staging column pairs, 64 x 128 persistent: 103.)"""
    if (groups or bm // 64) == 2:   # the consumer warpgroups (tf32's Cᵀ form splits the columns)
        return {"launch bound (setmaxnreg)": TMA_LAUNCH_REGISTERS}
    parts = {"accumulators": bn // 2, "addressing": ADDRESSING, "descriptors": 4}
    if point is not None and staging_tile(point):
        parts["staging addresses"] = bn // 8    # one per staged column pair
    if point is not None and point.get("persistent"):
        parts["tile loop"] = 8
    return parts


def wgmma_sm_chain(target: Target, rate: float, point: Point, blocks: int, k_tiles: int,
                   registers: int, out_itemsize: int = 2, tiles: int = 0, k_tile: int = K_TILE,
                   groups: int = 0, extra_smem: int = 0, epilogue_math: float = 0.0) -> tuple[float, int, float]:
    """Cycles one SM spends on one round of its resident blocks, the resident blocks, and the
    fraction of a k tile the tensor pipe idles (gemm_tensor_core.sm_chain's model, module
    docstring: the wgmma ring's stall is what its in-flight group does not cover). `k_tile`:
    elements per 128-byte row (32 for tf32); `groups`: the warpgroups (0: BM / 64);
    `epilogue_math`: a fused epilogue's cycles per tile (gemm_epilogue_cost), exposed once per round."""
    bm, bn, stages = (int(point[x]) for x in ("bm", "bn", "stages"))
    groups = groups or bm // 64
    load = load_of(point)
    alloc = max(8, -(-registers // 8) * 8)
    threads = WARPGROUP * groups + (PRODUCER_THREADS if load == "tma" else 0)
    occ = occupancy(target, threads, alloc, shared_bytes(point, out_itemsize) + extra_smem)
    resident = max(1, min(occ.blocks_per_sm, -(-blocks // target.sm_count)))
    per_clock = rate / target.sm_count / target.clock_hz
    wgmma = 2.0 * bm * bn * k_tile / max(per_clock, 1e-9)
    wavefronts = (groups * (64 + bn) + bm + bn) * K_TILE * 2 / SMEM_WAVEFRONT_BYTES
    tile = max(wgmma, wavefronts * SMEM_WEIGHT)
    pending, ahead = in_flight(stages, load)
    if load == "tma":
        sync = max(0.0, TMA_SYNC_CYCLES - tile)
    else:
        sync = WGMMA_SYNC_CYCLES + WGMMA_DRAIN_CYCLES if pending == 0 else max(0.0, WGMMA_SYNC_CYCLES - tile)
    stall = sync + LOADED_LATENCY_CYCLES * math.exp(-max(ahead, 0) * tile * resident / LOADED_LATENCY_CYCLES)
    idle = (stall / (tile + stall)) ** resident
    main = k_tiles * resident * tile / (1.0 - idle)
    # the per-tile fixed cost (the fill, the epilogue), exposed once per round (the other
    # resident blocks' k loops run under the rest), priced relative to one block per tile with
    # the register epilogue: the k-loop constants above were set (like gemm_tensor_core's, which
    # has no such term) on kernels that paid that baseline, so the baseline adds nothing and the
    # other rungs add what they change. A k loop shorter than the baseline's fixed part carries
    # it only in proportion (`share`), and so do the changes: the chain stays positive
    per_tile, once = tile_fixed_cycles(target, point, out_itemsize)
    base, _ = tile_fixed_cycles(target, {**point, "epilogue": "registers", "persistent": 0}, out_itemsize)
    share = min(1.0, main / base) if base > 0 else 1.0
    persistent = bool(point.get("persistent"))
    per_block = -(-max(tiles, 1) // max(blocks, 1)) if persistent else 0   # the busiest block's tiles (work units)
    if split_of(point) > 1:
        fill = 0.0 if persistent else LOADED_LATENCY_CYCLES
        return split_chain(point, main, per_tile, once, base, fill, per_block,
                           wgmma_split_sum(target, point, groups)), resident, idle
    round_ = main + (per_tile - base) * share + epilogue_math
    return (per_block * round_ + once * share if persistent else round_), resident, idle


class GemmWgmma(Strategy):
    name = "gemm_wgmma"
    description = "half-precision contraction on Hopper: wgmma.m64nNk16 from 128B-swizzled shared tiles, cp.async ring"
    priority = 4
    compile_checked = True  # a point ptxas spills, or whose wgmmas it serializes (C7515), is passed over
    # the operands' precision: bytes per element, elements per 128-byte k tile, the wgmma's k, the
    # dense peak of the target's table it runs at, the plan's intrinsic
    element_bytes = 2
    k_tile = K_TILE
    k_step = 16
    rate_key = "float16"
    intrinsic = "wgmma"

    def warpgroups(self, info: KernelInfo, point: Point) -> int:
        """Consumer warpgroups of a block: one per 64 rows."""
        return int(point["bm"]) // 64

    def register_operand(self, info: KernelInfo) -> bool:
        """Whether the wgmma's A comes from registers loaded from shared memory (tf32 only)."""
        return False

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if target.sm != WGMMA_ARCH:
            return f"{target.arch} has no wgmma (sm_90 only; sm_8x keeps mma.sync: gemm_tensor_core)"
        return GemmTensorCore().guard(info, target)

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        view = gemm_view(info)   # the GEMM's M and N (an implicit GEMM's axis groups, docs/conv.md)
        assert not isinstance(view, str)
        m, n = view.m, view.n
        loads = LOADS if tma_refusal_for(info) is None else LOADS[:1]
        epilogues = epilogues_for(info)
        stageable, itemsize = output_stageable(info, view), info.write.itemsize
        for load, bm, bn, stages, staged in product(loads, BLOCK_M, BLOCK_N, STAGES, (False, True)):
            if staged and (load == "tma" or not stageable
                           or not worth_staging(bm, bn, view.k, self.element_bytes, itemsize, n)):
                continue  # tensorize stages the output on the cp.async ring (the TMA ring has its own epilogue)
            if (bm >= 2 * m and bm > BLOCK_M[0]) or (bn >= 2 * n and bn > BLOCK_N[0]):
                continue  # a tile twice the matrix leaves half its warpgroups idle
            if bn == 192 and load != "tma":
                continue  # measured slower than 128 on the cp.async ring (RESULTS.md, stop 29)
            k_tiles = -(-max(view.k, 1) // self.k_tile)
            tiles = view.batch * -(-m // bm) * -(-n // bn)
            for split in split_parts(k_tiles, tiles, target):
                if deeper_than_the_k_loop(stages, k_tiles // split, load):
                    continue
                point: Point = {"bm": bm, "bn": bn, "stages": stages, "load": load}
                if split > 1:
                    point["split"] = split
                if load == "cp.async":
                    if staged:
                        point["staged_output"] = True
                    smem = shared_bytes(point) + staged_output_bytes(point, itemsize)
                    if smem <= target.smem_per_block_optin and split_in_one_wave(point, tiles, smem, target):
                        yield point
                    continue
                for epilogue, persistent in product(epilogues, (target.sm_count, 0)):
                    rung = dict(point, epilogue=epilogue, persistent=persistent)
                    smem = shared_bytes(rung, info.write.itemsize)
                    if smem <= target.smem_per_block_optin and split_in_one_wave(rung, tiles, smem, target):
                        yield rung

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        bm, bn, stages = (int(point[x]) for x in ("bm", "bn", "stages"))
        load = load_of(point)
        bk = self.k_tile
        groups = self.warpgroups(info, point)
        wgmma_n = bm * bn // (64 * groups)
        threads = WARPGROUP * groups + (PRODUCER_THREADS if load == "tma" else 0)
        view = gemm_view(info)
        assert not isinstance(view, str)
        batch, m, n, k = view.batch, view.m, view.n, view.k
        splits = split_of(point)
        row_tiles, col_tiles = -(-m // bm), -(-n // bn)
        k_tiles = -(-(-(-max(k, 1) // bk)) // splits)   # per block (split-K: per part)
        tiles = batch * row_tiles * col_tiles           # output tiles
        blocks = tiles * splits                         # work units: a block each unless persistent
        persistent = int(point.get("persistent", 0))
        grid = persistent if persistent else blocks   # blocks launched
        a_bytes, b_bytes = self.element_bytes * m * k * batch, self.element_bytes * k * n * batch
        out_bytes = float(m * n * batch * info.write.itemsize)
        staged_out = bool(point.get("staged_output"))
        out_l2, out_wavefronts, out_smem = output_traffic(out_bytes, info.write.itemsize,
                                                          staged_out or staging_tile(point), n % 2 == 0)
        out_tile = staged_output_bytes(point, info.write.itemsize)
        l2 = a_bytes * col_tiles + b_bytes * row_tiles + out_l2
        sizes = copy_sizes(info) if load == "cp.async" else (0, 0)
        operand_tiles = ((bm * bk, sizes[0]), (bn * bk, sizes[1]))
        copies = 0 if load == "tma" else sum(tile // size // threads for tile, size in operand_tiles if size)
        staged = 0 if load == "tma" else sum(tile // threads for tile, size in operand_tiles if not size)
        warps = tiles * groups * 4   # the epilogue's: once per output tile
        wgmma = blocks * groups * k_tiles * (bk // self.k_step)
        # gathered (implicit GEMM) reduction indices: a div/mod pair per extra axis (gemm_tensor_core)
        if load == "tma":
            # consumers: a wait, the wgmmas and a release per k tile; the producer thread's
            # expect-tx and copies run on its own warp, outside the consumers' issue slots
            instructions = wgmma + blocks * k_tiles * groups * 4 * 8 + warps * (bn // 2) * (4 + info.epilogue_flops)
        else:
            instructions = (wgmma + blocks * k_tiles * groups * 4 * ((copies + staged) * (6 + 4 * view.gathered) + 12)
                            + warps * (wgmma_n // 2) * (4 + info.epilogue_flops))
        split_l2, split_dram, split_instructions = split_traffic(point, tiles, groups * WARPGROUP, target)
        instructions += split_instructions
        rate = target.tensor_flops.get(self.rate_key, 0.0) * WGMMA_FRACTION
        registers = (wgmma_registers(bm, bn, sizes, bk, groups) if load == "cp.async"
                     else tma_registers(bm, bn, point, groups))
        if splits > 1 and "launch bound (setmaxnreg)" not in registers:
            registers["split-K sum"] = split_registers(wgmma_n // 2, "staged elements" in registers)

        if "accumulators" in registers:   # the wgmma's N: the block's rows when tf32 computes Cᵀ
            registers["accumulators"] = wgmma_n // 2
        x_registers = self.register_operand(info)
        if x_registers:
            # per k tile each thread loads its A fragments (4 per k8 step) with 32-bit shared
            # loads and converts them (cvt.rna), into one of two register sets
            per_thread = 4 * (bk // self.k_step)
            instructions += blocks * k_tiles * groups * 4 * 2 * per_thread
            if "launch bound (setmaxnreg)" not in registers:   # else within the consumers' setmaxnreg share
                registers["register A (two sets)"] = 2 * per_thread
        chain, resident, idle = wgmma_sm_chain(target, rate, point, grid, k_tiles, sum(registers.values()),
                                               info.write.itemsize, blocks, bk, groups, out_tile,
                                               epilogue_math_cycles(info, bm, bn))
        pending, ahead = in_flight(stages, load)
        # wgmma reads every warpgroup's A tile and the whole B tile once per k tile per warpgroup
        smem_reads = blocks * k_tiles * groups * (64 + wgmma_n) * bk * self.element_bytes
        smem_writes = blocks * k_tiles * (bm + bn) * bk * self.element_bytes
        ring = ("TMA producer warpgroup, mbarrier ring" if load == "tma" else "cp.async ring")
        notes = [f"wgmma.m64n{wgmma_n}k{self.k_step} on {groups} warpgroup(s), {stages}-stage {ring} of {bk}-wide k "
                 f"tiles ({ahead} ahead, {pending} wgmma group in flight)", self.operand_note(info)[0],
                 f"{resident} block(s) per SM share the tensor pipe: idle {idle:.0%} of each k tile"]
        if load == "tma":
            per_tile, once = tile_fixed_cycles(target, point, info.write.itemsize)
            how = {"tma": "through a swizzled shared staging tile and TMA stores",
                   "threads": "through a swizzled shared staging tile copied out by the threads' stores"
                   }.get(epilogue_of(point), "from registers")
            fill = (f"the ring's fill ({once:.0f} cycles) once per block" if persistent
                    else "with the ring's fill")
            notes.append(f"epilogue {how}: {per_tile:.0f} cycles per output tile ({fill})")
            if epilogue_of(point) != "tma" and tma_store_refusal_for(info) is not None:
                notes.append(f"no TMA-store epilogue: {tma_store_refusal_for(info)}")
        math_note = epilogue_math_note(info, bm, bn, target, -(-blocks // target.sm_count))
        if math_note is not None:
            notes.append(math_note)
        if splits > 1:
            notes.append(split_note(point, tiles, k_tiles, split_l2, wgmma_split_sum(target, point, groups)))
        else:
            beyond = [s for s in split_parts(k_tiles, tiles, target)[1:] if not split_in_one_wave(
                {**point, "split": s}, tiles, shared_bytes({**point, "split": s}, info.write.itemsize), target)]
            if beyond:
                notes.append(f"split-K {', '.join(map(str, beyond))} not offered at this tile: {tiles} tiles x S parts "
                             "would not run in one wave of the SMs' block slots, where the part that sums is late "
                             "for its next unit every round (gemm_split.split_in_one_wave)")
        if persistent:
            units = "work units" if splits > 1 else "tiles"
            notes.append(f"persistent grid of {persistent} blocks over {blocks} {units} "
                         f"({-(-blocks // persistent)} on the busiest block)")
        if staged_out:
            notes.append("output staged in a padded shared tile, stored in 16-byte chunks (whole lines per warp)")
        refusal = tma_refusal_for(info) if load == "cp.async" else None
        if refusal is not None:
            notes.append(f"the TMA rung is not offered: {refusal}")
        stride_note = (run_time_stride_note(view, transposes=self.element_bytes == 2, k_major_only=self.element_bytes == 1)
                       if load == "cp.async" else None)
        if stride_note is not None:
            notes.append(stride_note)
        return Workload(
            blocks=grid, threads=threads, registers=registers,
            smem_bytes=shared_bytes(point, info.write.itemsize) + out_tile, smem_opt_in=True,
            flops=2.0 * m * n * k * batch, fma_ops=float(m * n * batch * max(info.epilogue_flops, 0)),
            tensor_flops=2.0 * blocks * bm * bn * k_tiles * bk, tensor_rate=rate,
            dram_bytes=wave_dram_bytes(info, target, point, batch, resident, l2 - out_l2 + out_bytes) + split_dram,
            l2_bytes=l2 + split_l2, global_wavefronts=(l2 - out_l2 + split_l2) / 128.0 + out_wavefronts,
            smem_wavefronts=(smem_reads + smem_writes) / SMEM_WAVEFRONT_BYTES + out_smem,
            instructions=instructions, bytes_in_flight=self.element_bytes * (bm + bn) * bk / threads * max(ahead, 1),
            block_latency_cycles=split_handover_cycles(point)[0] * (-(-blocks // grid) if persistent else 1),
            ilp=float(wgmma_n // 8), chain_cycles=chain, latency_in_chain=True, k_extent=k_tiles * bk, notes=notes)

    def operand_note(self, info: KernelInfo) -> tuple[str]:
        return ("A and B read by wgmma from 128B-swizzled shared tiles (no ldmatrix)",)

    def main_loop(self, sch: Any, info: KernelInfo, point: Point) -> None:
        """The primitives every wgmma point applies: tensorize, each operand staged, the ring
        (with its producer warpgroup for TMA) and the split of k."""
        stage = info.stage
        k_tiles = sch.tensorize(stage, self.intrinsic, block=(int(point["bm"]), int(point["bn"])),
                                warps=(4 * self.warpgroups(info, point), 1), k_tile=self.k_tile)
        for operand in sch.gemm_operands(stage):
            sch.stage_operand(stage, operand)
        sch.pipeline(k_tiles, stages=int(point["stages"]), producer=load_of(point))
        if load_of(point) == "tma":
            sch.warp_specialize(stage)
        if split_of(point) > 1:
            sch.split_k(stage, split_of(point))

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        stage = info.stage
        self.main_loop(sch, info, point)
        if load_of(point) == "tma":
            if point.get("persistent"):
                sch.persistent(stage, int(point["persistent"]))
            if epilogue_of(point) != "registers":
                sch.epilogue(stage, epilogue_of(point))
        elif point.get("staged_output"):
            sch.epilogue(stage, "staged")

    def describe(self, point: Point) -> str:
        bm, bn, stages = (int(point[x]) for x in ("bm", "bn", "stages"))
        split = split_label(point)
        if load_of(point) == "tma":
            persistent = (f", persistent grid of {int(point['persistent'])} blocks in grouped tile order"
                          if point.get("persistent") else "")
            if epilogue_of(point) == "tma":
                persistent += ", epilogue through shared memory + TMA store"
            elif epilogue_of(point) == "threads":
                persistent += ", epilogue through shared memory + the threads' stores"
            return (f"gemm_wgmma(wgmma.m64n{bn}k16 f32 accumulators, block {bm}x{bn}, {bm // 64} consumer "
                    f"warpgroup(s) + 1 TMA producer warpgroup, k-tile {K_TILE}, {stages} TMA stages{split}"
                    f"{persistent}; rung: wgmma + TMA + mbarrier ring, warp-specialized, 128B swizzle)")
        staged = ", output staged in shared memory" if point.get("staged_output") else ""
        return (f"gemm_wgmma(wgmma.m64n{bn}k16 f32 accumulators, block {bm}x{bn}, {bm // 64} warpgroup(s), "
                f"k-tile {K_TILE}, {stages} cp.async stages{staged}{split}; rung: wgmma + cp.async ring, 128B swizzle)")


register(GemmWgmma())


# ---- TF32 --------------------------------------------------------------------------------------

TF32_K_TILE = 32           # floats in a 128-byte swizzled row
TF32_SPLIT = (64, 128)     # the block side the warpgroups split (64 rows or columns each)
TF32_ACROSS = (64, 128, 256)


class GemmWgmmaTF32(GemmWgmma):
    """float32 contractions on Hopper's wgmma with the operands rounded to tf32, only when the
    build allows it (`build(..., allow_tf32=True)` sets Target.allow_tf32): wgmma.m64nNk8 .tf32
    at the target's dense TF32 peak (half the 16-bit one), k tiles of 32 floats (the same 128-byte
    rows, ring bytes and swizzle as gemm_wgmma's 64 halves).

    The ISA takes tf32 shared operands K-major only (no transpose immediates), so the form
    follows the operands' orientation (tensorize_wgmma.py, "tf32"):
    - A and B k-contiguous (C = A·Bᵀ): both from shared memory through descriptors;
    - A k-contiguous, B n-contiguous (the plain C = A·B): the kernel computes Cᵀ = Bᵀ·Aᵀ, the
      wgmma's A being the B tile loaded from shared memory into registers, its B the A tile; the
      warpgroups split the block's columns and the wgmma's N is its rows;
    - A m-contiguous, B k-contiguous: A from registers, B through its descriptor;
    - both with k outermost: not served (the guard says so; gemm_tensor_core_tf32 is).
    The register form costs each thread 4 shared loads and cvt.rna per k8 step and two sets of
    16 registers (one set is read by the wgmma group in flight). Both rungs, cp.async and the
    warp-specialized TMA ring (where `tma_refusal_for` allows). Priced with gemm_wgmma's model
    and constants (assumed, not fitted: untimed)."""

    name = "gemm_wgmma_tf32"
    description = ("float32 contraction with TF32 allowed on Hopper: wgmma.m64nNk8 tf32 (K-major shared operands, "
                   "register A or Cᵀ = Bᵀ·Aᵀ for the others), cp.async ring, 128B swizzle")
    element_bytes = 4
    k_tile = TF32_K_TILE
    k_step = 8
    rate_key = "tf32"
    intrinsic = "wgmma.tf32"

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if target.sm != WGMMA_ARCH:
            return f"{target.arch} has no wgmma (sm_90 only; sm_8x keeps mma.sync: gemm_tensor_core_tf32)"
        refusal = GemmTensorCoreTF32().guard(info, target)
        if refusal is not None:
            return refusal
        view = gemm_view(info)
        assert not isinstance(view, str)
        if not any(view.k_last):
            return ("both operands are stored with k outermost, and tf32 wgmma reads its shared operand K-major only "
                    "(gemm_tensor_core_tf32 serves it)")
        return None

    def swapped(self, info: KernelInfo) -> bool:
        view = gemm_view(info)
        assert not isinstance(view, str)
        return view.k_last[0] and not view.k_last[1]

    def warpgroups(self, info: KernelInfo, point: Point) -> int:
        return int(point["bn" if self.swapped(info) else "bm"]) // 64

    def register_operand(self, info: KernelInfo) -> bool:
        view = gemm_view(info)
        assert not isinstance(view, str)
        return not all(view.k_last)

    def operand_note(self, info: KernelInfo) -> tuple[str]:
        if self.swapped(info):
            return ("Cᵀ = Bᵀ·Aᵀ: B loaded from shared memory into registers as the wgmma's A (tf32 takes K-major "
                    "shared operands only), A read through its descriptor",)
        if self.register_operand(info):
            return "A loaded from shared memory into registers (m-contiguous), B read through its descriptor",
        return "A and B read by wgmma from 128B-swizzled K-major shared tiles",

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        view = gemm_view(info)
        assert not isinstance(view, str)
        swap = self.swapped(info)
        loads = LOADS if tma_refusal_for(info) is None else LOADS[:1]
        k_tiles = -(-max(view.k, 1) // self.k_tile)
        for load, side, across, stages in product(loads, TF32_SPLIT, TF32_ACROSS, STAGES):
            bm, bn = (across, side) if swap else (side, across)
            if (bm >= 2 * view.m and bm > 64) or (bn >= 2 * view.n and bn > 64):
                continue  # a tile twice the matrix leaves half its warpgroups idle
            if load == "tma" and side == 64 and self.register_operand(info):
                continue  # ptxas serializes its wgmmas (C7520: a compiler-inserted arrive on a divergent path)
            tiles = view.batch * -(-view.m // bm) * -(-view.n // bn)
            for split in split_parts(k_tiles, tiles, target):
                point = {"bm": bm, "bn": bn, "stages": stages, "load": load}
                if split > 1:
                    point["split"] = split
                smem = shared_bytes(point)
                if smem <= target.smem_per_block_optin and split_in_one_wave(point, tiles, smem, target):
                    yield point

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        self.main_loop(sch, info, point)   # tf32 points have no persistent or epilogue knob

    def describe(self, point: Point) -> str:
        bm, bn, stages = (int(point[x]) for x in ("bm", "bn", "stages"))
        rung = ("TMA stages; rung: wgmma + TMA + mbarrier ring, warp-specialized, 128B swizzle)" if load_of(point) == "tma"
                else "cp.async stages; rung: wgmma + cp.async ring, 128B swizzle)")
        split = split_label(point)
        return (f"gemm_wgmma_tf32(wgmma.m64nNk8 tf32 f32 accumulators, block {bm}x{bn}, k-tile {self.k_tile} floats, "
                f"{stages} {rung}{split}; operands rounded to tf32 because the build allows TF32")


register(GemmWgmmaTF32())
