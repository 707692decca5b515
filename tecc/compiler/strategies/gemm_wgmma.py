"""gemm_wgmma: float16/bfloat16 contractions on Hopper's warpgroup tensor cores (wgmma.mma_async).

The first rung of the Hopper ladder: "wgmma + cp.async ring, 128B swizzle". It serves what
gemm_tensor_core serves (the same guard: C[b.., i, j] = epilogue(Σ_k A · B), A and B both
float16 or both bfloat16, every index one axis) on sm_90 only -- wgmma exists on sm_90a alone
(sm_8x has no wgmma, sm_100 replaced it) -- with one Plan step,
`tensorize(stage, intrinsic="wgmma", block, warps=(4·BM/64, 1), k_tile=64, stages)`
(tecc/passes/schedule/tensorize_wgmma.py builds the kernel). A separate strategy rather than a
`path` dimension of gemm_tensor_core because its space, register and shared-memory accounting
and cost are different (no warp grid, no ldmatrix, BK fixed by the swizzle, a ring whose depth
loses one stage to the wgmma in flight); the planner ranks both by predicted time, and explain
shows the best of each.

Point: BM ∈ {64, 128} (1 or 2 consumer warpgroups), BN ∈ {64, 128, 256}, stages ∈ 2..5, with
stages · (BM + BN) · 64 · 2 bytes of ring (+ 1024 bytes of alignment slack) within the opt-in
shared-memory limit; and load ∈ {"cp.async", "tma"}, the rung:
- "cp.async" (the first rung): every thread issues 16-byte cp.async copies into the ring, one
  __syncthreads and proxy fence per k tile (tensorize_wgmma.py);
- "tma" (the second rung): warp specialization -- one producer warpgroup issues a TMA tile copy
  per operand and k tile into an mbarrier ring (expect-tx on full barriers), the consumer
  warpgroups wait on them and release stages through empty barriers, setmaxnreg moves registers
  to the consumers (tensorize_wgmma_tma.py). Offered only when both operands suit TMA
  (`tma_refusal_for`: every index a plain loop variable -- no implicit-GEMM gather, no
  padding --, strides fixed at compile time, rows a multiple of 16 bytes); otherwise the
  point is not in the space and explain says why.

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
- a TMA point may carry "persistent": P (rung 4: P blocks loop over the output tiles in a
  grouped order, tensorize_wgmma_tma.py step 5). The space does not enumerate it yet and the
  workload prices it as one block per tile: it is reached by an explicit plan or
  `benchmarks/gemm.py --sweep --sweep-strategy gemm_wgmma --load tma --persistent` until it is
  timed.
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
    copy_sizes,
    gemm_view,
    output_stageable,
    output_traffic,
    staged_output_bytes,
    wave_dram_bytes,
    worth_staging,
)
from .registry import Point, Strategy, register

BLOCK_M = (64, 128)
BLOCK_N = (64, 128, 256)
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
PRODUCER_THREADS = 128
TMA_LAUNCH_REGISTERS = 168   # 65536 / 384 rounded down to 8: two consumer warpgroups and the producer


def load_of(point: Point) -> str:
    """The point's rung: "cp.async" (plans made before the TMA rung have no "load") or "tma"."""
    return str(point.get("load", "cp.async"))


def shared_bytes(point: Point) -> int:
    """The ring's bytes plus the slack the kernel uses to align it to 1024 bytes (and the TMA
    ring's two mbarriers per stage)."""
    stages = int(point["stages"])
    barriers = 2 * 8 * stages if load_of(point) == "tma" else 0
    return stages * (int(point["bm"]) + int(point["bn"])) * K_TILE * 2 + DESCRIPTOR_ALIGNMENT + barriers


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
    analysis-level mirror of tensorize_wgmma_tma.tma_refusal, which tensorize checks again."""
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
        if not x.per_dim or any(d is None or len(d.coeff) != 1 or d.coeff[0][1] != 1 or d.const for d in x.per_dim):
            return f"operand {role} ({x.buffer}) is not indexed by plain loop variables (TMA copies boxes)"
        if len({d.coeff[0][0] for d in x.per_dim if d is not None}) != len(x.per_dim):
            return f"operand {role} ({x.buffer}) uses one loop variable in two dimensions"
        if len(x.dims) >= 2 and (x.dims[-1] * x.itemsize) % 16:
            return (f"operand {role} ({x.buffer}): rows of {x.dims[-1]} elements are not a multiple of 16 bytes "
                    "(TMA's stride alignment)")
    return None


def wgmma_registers(bm: int, bn: int, sizes: tuple[int, int] = (8, 8)) -> dict[str, int]:
    """Registers per thread; `sizes` as gemm_tensor_core.tile_registers."""
    threads = WARPGROUP * (bm // 64)
    copies = staged = 0
    for tile, size in ((bm * K_TILE, sizes[0]), (bn * K_TILE, sizes[1])):
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


def tma_registers(bm: int, bn: int) -> dict[str, int]:
    """Registers per thread of the TMA rung at launch: the consumers' accumulators, addressing
    and descriptors (no copy state); with two consumer warpgroups __launch_bounds__(384) and
    setmaxnreg make ptxas allocate the launch-bound cap (TMA_LAUNCH_REGISTERS) for all."""
    if bm // 64 == 2:
        return {"launch bound (setmaxnreg)": TMA_LAUNCH_REGISTERS}
    return {"accumulators": bn // 2, "addressing": ADDRESSING, "descriptors": 4}


def wgmma_sm_chain(target: Target, rate: float, point: Point, blocks: int, k_tiles: int,
                   registers: int, extra_smem: int = 0) -> tuple[float, int, float]:
    """Cycles one SM spends on one round of its resident blocks, the resident blocks, and the
    fraction of a k tile the tensor pipe idles (gemm_tensor_core.sm_chain's model, module
    docstring: the wgmma ring's stall is what its in-flight group does not cover)."""
    bm, bn, stages = (int(point[x]) for x in ("bm", "bn", "stages"))
    groups = bm // 64
    load = load_of(point)
    alloc = max(8, -(-registers // 8) * 8)
    threads = WARPGROUP * groups + (PRODUCER_THREADS if load == "tma" else 0)
    occ = occupancy(target, threads, alloc, shared_bytes(point) + extra_smem)
    resident = max(1, min(occ.blocks_per_sm, -(-blocks // target.sm_count)))
    per_clock = rate / target.sm_count / target.clock_hz
    wgmma = 2.0 * bm * bn * K_TILE / max(per_clock, 1e-9)
    wavefronts = (groups * (64 + bn) + bm + bn) * K_TILE * 2 / SMEM_WAVEFRONT_BYTES
    tile = max(wgmma, wavefronts * SMEM_WEIGHT)
    pending, ahead = in_flight(stages, load)
    if load == "tma":
        sync = max(0.0, TMA_SYNC_CYCLES - tile)
    else:
        sync = WGMMA_SYNC_CYCLES + WGMMA_DRAIN_CYCLES if pending == 0 else max(0.0, WGMMA_SYNC_CYCLES - tile)
    stall = sync + LOADED_LATENCY_CYCLES * math.exp(-max(ahead, 0) * tile * resident / LOADED_LATENCY_CYCLES)
    idle = (stall / (tile + stall)) ** resident
    return k_tiles * resident * tile / (1.0 - idle), resident, idle


class GemmWgmma(Strategy):
    name = "gemm_wgmma"
    description = "half-precision contraction on Hopper: wgmma.m64nNk16 from 128B-swizzled shared tiles, cp.async ring"
    priority = 4
    compile_checked = True  # a point ptxas spills, or whose wgmmas it serializes (C7515), is passed over

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if target.sm != WGMMA_ARCH:
            return f"{target.arch} has no wgmma (sm_90 only; sm_8x keeps mma.sync: gemm_tensor_core)"
        return GemmTensorCore().guard(info, target)

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        view = gemm_view(info)   # the GEMM's M and N (an implicit GEMM's axis groups, docs/conv.md)
        assert not isinstance(view, str)
        m, n = view.m, view.n
        loads = LOADS if tma_refusal_for(info) is None else LOADS[:1]
        stageable, itemsize = output_stageable(info, view), info.write.itemsize
        for load, bm, bn, stages, staged in product(loads, BLOCK_M, BLOCK_N, STAGES, (False, True)):
            if staged and (load == "tma" or not stageable or not worth_staging(bm, bn, view.k, 2, itemsize)):
                continue  # tensorize stages the output on the cp.async ring only
            if (bm >= 2 * m and bm > BLOCK_M[0]) or (bn >= 2 * n and bn > BLOCK_N[0]):
                continue  # a tile twice the matrix leaves half its warpgroups idle
            if deeper_than_the_k_loop(stages, -(-max(view.k, 1) // K_TILE), load):
                continue
            point = {"bm": bm, "bn": bn, "stages": stages, "load": load}
            if staged:
                point["staged_output"] = True
            if shared_bytes(point) + staged_output_bytes(point, itemsize) > target.smem_per_block_optin:
                continue
            yield point

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        bm, bn, stages = (int(point[x]) for x in ("bm", "bn", "stages"))
        load = load_of(point)
        bk = K_TILE
        groups = bm // 64
        threads = WARPGROUP * groups + (PRODUCER_THREADS if load == "tma" else 0)
        view = gemm_view(info)
        assert not isinstance(view, str)
        batch, m, n, k = view.batch, view.m, view.n, view.k
        row_tiles, col_tiles, k_tiles = -(-m // bm), -(-n // bn), -(-max(k, 1) // bk)
        blocks = batch * row_tiles * col_tiles
        a_bytes, b_bytes = 2.0 * m * k * batch, 2.0 * k * n * batch
        out_bytes = float(m * n * batch * info.write.itemsize)
        staged_out = bool(point.get("staged_output"))
        out_l2, out_wavefronts, out_smem = output_traffic(out_bytes, info.write.itemsize, staged_out)
        out_tile = staged_output_bytes(point, info.write.itemsize)
        l2 = a_bytes * col_tiles + b_bytes * row_tiles + out_l2
        sizes = copy_sizes(info) if load == "cp.async" else (0, 0)
        tiles = ((bm * bk, sizes[0]), (bn * bk, sizes[1]))
        copies = 0 if load == "tma" else sum(tile // size // threads for tile, size in tiles if size)
        staged = 0 if load == "tma" else sum(tile // threads for tile, size in tiles if not size)
        warps = blocks * groups * 4
        wgmma = blocks * groups * k_tiles * (bk // 16)
        # gathered (implicit GEMM) reduction indices: a div/mod pair per extra axis (gemm_tensor_core)
        if load == "tma":
            # consumers: a wait, the wgmmas and a release per k tile; the producer thread's
            # expect-tx and copies run on its own warp, outside the consumers' issue slots
            instructions = wgmma + blocks * k_tiles * groups * 4 * 8 + warps * (bn // 2) * (4 + info.epilogue_flops)
        else:
            instructions = (wgmma + blocks * k_tiles * groups * 4 * ((copies + staged) * (6 + 4 * view.gathered) + 12)
                            + warps * (bn // 2) * (4 + info.epilogue_flops))
        rate = target.tensor_flops.get("float16", 0.0) * WGMMA_FRACTION
        registers = wgmma_registers(bm, bn, sizes) if load == "cp.async" else tma_registers(bm, bn)
        chain, resident, idle = wgmma_sm_chain(target, rate, point, blocks, k_tiles, sum(registers.values()), out_tile)
        pending, ahead = in_flight(stages, load)
        # wgmma reads every warpgroup's A tile and the whole B tile once per k tile per warpgroup
        smem_reads = blocks * k_tiles * groups * (64 + bn) * bk * 2
        smem_writes = blocks * k_tiles * (bm + bn) * bk * 2
        ring = ("TMA producer warpgroup, mbarrier ring" if load == "tma" else "cp.async ring")
        notes = [f"wgmma.m64n{bn}k16 on {groups} warpgroup(s), {stages}-stage {ring} of 64-wide k tiles "
                 f"({ahead} ahead, {pending} wgmma group in flight)",
                 "A and B read by wgmma from 128B-swizzled shared tiles (no ldmatrix)",
                 f"{resident} block(s) per SM share the tensor pipe: idle {idle:.0%} of each k tile"]
        if staged_out:
            notes.append("output staged in a padded shared tile, stored in 16-byte chunks (whole lines per warp)")
        if point.get("persistent"):
            notes.append(f"persistent grid of {int(point['persistent'])} blocks (priced as one block per tile)")
        refusal = tma_refusal_for(info) if load == "cp.async" else None
        if refusal is not None:
            notes.append(f"the TMA rung is not offered: {refusal}")
        return Workload(
            blocks=blocks, threads=threads, registers=registers,
            smem_bytes=shared_bytes(point) + out_tile, smem_opt_in=True,
            flops=2.0 * m * n * k * batch, fma_ops=float(m * n * batch * max(info.epilogue_flops, 0)),
            tensor_flops=2.0 * blocks * bm * bn * k_tiles * bk, tensor_rate=rate,
            dram_bytes=wave_dram_bytes(info, target, point, batch, resident, l2 - out_l2 + out_bytes), l2_bytes=l2,
            global_wavefronts=(l2 - out_l2) / 128.0 + out_wavefronts,
            smem_wavefronts=(smem_reads + smem_writes) / SMEM_WAVEFRONT_BYTES + out_smem,
            instructions=instructions, bytes_in_flight=2.0 * (bm + bn) * bk / threads * max(ahead, 1),
            ilp=float(bn // 8), chain_cycles=chain, k_extent=k_tiles * bk, notes=notes)

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        bm = int(point["bm"])
        producer: dict[str, Any] = {"cp.async": {}, "tma": {"producer": "tma"}}[load_of(point)]
        if point.get("persistent"):  # not in the space yet: a plan or a sweep may ask for it (module docstring)
            producer["persistent"] = int(point["persistent"])
        if point.get("staged_output"):
            producer["staged_output"] = True
        sch.tensorize(info.stage, intrinsic="wgmma", block=(bm, int(point["bn"])), warps=(4 * (bm // 64), 1),
                      k_tile=K_TILE, stages=int(point["stages"]), **producer)

    def describe(self, point: Point) -> str:
        bm, bn, stages = (int(point[x]) for x in ("bm", "bn", "stages"))
        if load_of(point) == "tma":
            persistent = (f", persistent grid of {int(point['persistent'])} blocks in grouped tile order"
                          if point.get("persistent") else "")
            return (f"gemm_wgmma(wgmma.m64n{bn}k16 f32 accumulators, block {bm}x{bn}, {bm // 64} consumer "
                    f"warpgroup(s) + 1 TMA producer warpgroup, k-tile {K_TILE}, {stages} TMA stages{persistent}; "
                    "rung: wgmma + TMA + mbarrier ring, warp-specialized, 128B swizzle)")
        staged = ", output staged in shared memory" if point.get("staged_output") else ""
        return (f"gemm_wgmma(wgmma.m64n{bn}k16 f32 accumulators, block {bm}x{bn}, {bm // 64} warpgroup(s), "
                f"k-tile {K_TILE}, {stages} cp.async stages{staged}; rung: wgmma + cp.async ring, 128B swizzle)")


register(GemmWgmma())
