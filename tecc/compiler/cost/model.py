"""The analytic cost model: a Workload (what one strategy point makes the GPU do) → a Cost.

A strategy describes a point of its space as a `Workload`: launch shape, FLOPs, bytes at each
level of the memory hierarchy (derived from the kernel's affine accesses and the tile shapes:
`tecc.compiler.cost.analysis`, `tecc.compiler.cost.warp`), shared-memory bytes and wavefronts
(bank conflicts included), registers per thread with their breakdown, instructions, and the
parallelism a thread exposes (bytes of independent loads in flight, independent FMA chains).
`predict` turns it into time with every term visible:

    occupancy  blocks/SM from threads, registers, shared memory (cuda_occupancy.h's formula)
    waves      ceil(blocks / (blocks/SM · SMs)); the busiest SM runs ceil(blocks / SMs) blocks
    dram       DRAM bytes / min(efficiency · peak, Little's law: bytes in flight / latency); the
               efficiency is CostParameters.dram_efficiency x Workload.dram_efficiency
    l2         bytes requested from L2 (32-byte sectors) / L2 bandwidth
    l1/shared  wavefronts through the SM's L1/shared-memory datapath (one 128-byte wavefront per
               clock per SM; a bank-conflicted access costs one wavefront per conflicting word)
    tensor     tensor-core FLOPs on the busiest SM / (the rate the instruction reaches per SM ·
               min(1, warps / (2 · schedulers))): mma.sync needs about two warps per scheduler
               to keep the tensor pipe busy (Workload.tensor_flops, Workload.tensor_rate)
    fma        FP32 FMAs on the busiest SM / (lanes · clock · efficiency(warps · ILP)); a tile
               loop (SGEMM) is also capped by tile_loop_efficiency(warps, k extent of a block
               slot), each round of resident blocks at its own warps
    issue      warp instructions on the busiest SM / (schedulers · clock)
    special    SFU operations on the busiest SM / (16 lanes · 4 partitions · clock)
    blocks     block scheduling: blocks on the busiest SM · cycles per block launch
    chain      a block's serial critical path (Workload.chain_cycles: latencies that nothing
               inside the block overlaps), paid once per round of resident blocks on the
               busiest SM: however many warps other blocks add, a block cannot finish sooner
    serial     device-wide serialized work (Workload.serial_cycles: atomics to one address)
    latency    exposed latency: rounds · per-block critical path / resident blocks
    overlap    Workload.overlap_loss · min(dram, l1/shared): what a kernel whose bytes each take
               several memory instructions loses of the two pipes' overlap (0 unless it says)
    launch     the fixed launch overhead
    then       a second kernel of the same point (split-K's combine), predicted on its own

    predicted = launch + max(dram, l2, l1/shared, tensor, fma, issue, special, blocks, chain, serial)
                + latency + overlap (+ then)

Hard constraints (threads per block, registers per thread and per block, shared memory without
opt-in, a block that does not fit on an SM) reject a point with the reason.

`CostParameters` holds the few constants that are not in the Target (latencies, achievable
fractions); docs/cost-model.md gives their sources and how they were checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ...ir.target import KiB, Target
from .occupancy import Occupancy, occupancy


@dataclass(frozen=True)
class CostParameters:
    """Model constants that are not limits of the target.

    dram_efficiency: achievable / peak DRAM bandwidth (a large device-to-device copy reaches
      about 0.9 of peak on A100/H100; KINDS.md measured 3.0 of 3.35 TB/s on the lent H100).
    dram_latency_s: loaded DRAM latency for Little's law (~500-600 ns on A100/H100,
      microbenchmarks: Jia et al. "Dissecting the Ampere GPU architecture", Chips and Cheese H100).
    l2_bandwidth_factor: L2→SM bandwidth / DRAM bandwidth (~2x on A100/H100, same sources).
    l2_bytes_per_clock_per_sm: what one SM can pull from L2 (64 B/clk).
    global_latency_cycles: a global load's latency as the k-tile loop sees it (L2/DRAM mix).
    barrier_cycles: __syncthreads() plus the shared-memory round trip around it.
    fma_latency_cycles: dependent FFMA latency (4 cycles on sm_80/90).
    launch_s: launch overhead seen by back-to-back event timing of one kernel.
    block_cycles: cost of launching and retiring one block on an SM (the CTA scheduler), paid
      per block on the busiest SM; fitted to the 2026-11-21 H200 run (docs/cost-model.md):
      a 64-thread one-element-per-thread kernel over 2^26 elements took 725 us, 180 cycles/block.
    tile_loop_warps, tile_loop_fill_k: the rate of an SGEMM tile loop (LDS latency and a barrier
      per k-tile in every warp) on an SM running w warps, whose block slots each cover K steps of
      k (a block's k extent times the rounds of blocks the slot runs):
      (1 - exp(-w / tile_loop_warps)) · K / (K + tile_loop_fill_k) of the FP32 / issue peak
      (`tile_loop_efficiency`). The first factor is the chance that a scheduler finds a ready warp
      when each stalls independently; the second prices a slot's start and end (prologue load,
      pipeline fill, write-back, blocks finishing unevenly) as a fixed amount of k-loop work,
      which a short split-K part (128-512 steps of k) cannot amortize. Fitted (in-sample, a grid
      search on the log error) to the H200 kernel times of benchmarks/RESULTS.md, issue 6 fifth
      pass: the 21 split-K points and the 4 large unsplit picks, each fed ptxas's register count
      (docs/cost-model.md, "Short k loops"). It replaces the third pass's warps / 22 line, which
      was fitted on per-call times that held ~45 us of host time. Strategies opt in with
      Workload.tile_loop and Workload.k_extent.
    tile_loop_alone: with fewer warps than schedulers (w < 4) the first factor is at least
      w / schedulers x this, though never above the exponential's value at one warp per
      scheduler: a warp that has a scheduler to itself issues about this share of its cycles
      (its own LDS latency and barrier hidden by its 8 x 8 tile's independent FMAs, no other
      warp contending for the shared-memory pipe), where the exponential -- fitted at 8-16 warps
      on the contention of warps that share schedulers -- extrapolates 2 warps to 0.21. Fitted
      on the one such point timed: the fp32 batch 3 x 1000 x 130 x 257 with a column bias,
      gemm_pipelined 128 x 32 (120 blocks of 2 warps, one per SM), 22.2 us on the H200
      (benchmarks/common_ops.py, 2026-11-26) where the model said 46.7 (issue-bound at 0.11):
      at 0.6 its FMA term is about the measured kernel time (its issue term stays 1.5x above:
      the instruction count of 64-thread blocks). The cap keeps every point of 4 warps or more
      at its fitted price (one warp per scheduler was not timed alone).
    tile_loop_line_warps: the third pass's rule, efficiency = warps / 22, kept for tile loops
      that give no k extent: the `gemm` strategy's single-buffered kernel, of which no point was
      timed by kernel time since, so nothing to re-fit it on."""

    dram_efficiency: float = 0.90
    dram_latency_s: float = 550e-9
    l2_bandwidth_factor: float = 2.0
    l2_bytes_per_clock_per_sm: float = 64.0
    global_latency_cycles: float = 550.0
    barrier_cycles: float = 40.0
    fma_latency_cycles: float = 4.0
    launch_s: float = 2.5e-6
    block_cycles: float = 180.0
    sfu_lanes_per_sm: float = 16.0 * 4
    tile_loop_warps: float = 8.6
    tile_loop_fill_k: float = 208.0
    tile_loop_line_warps: float = 22.0
    tile_loop_alone: float = 0.6


DEFAULT_PARAMETERS = CostParameters()


@dataclass
class Workload:
    """What one strategy point makes the GPU do (totals over the whole launch unless named
    per thread / per block)."""

    blocks: int
    threads: int
    registers: dict[str, int]                # per thread: name -> count (accumulators, fragments, addressing)
    smem_bytes: int = 0                      # per block, static
    flops: float = 0.0                       # useful floating-point ops (an FMA counts 2)
    fma_ops: float = 0.0                     # FP32 FMA/ADD/MUL instructions x lanes (thread-level)
    special_ops: float = 0.0                 # SFU operations (thread-level)
    dram_bytes: float = 0.0                  # expected DRAM traffic
    l2_bytes: float = 0.0                    # requested from L2 (sector-rounded)
    global_wavefronts: float = 0.0           # L1 wavefronts of global accesses (warp-level)
    smem_wavefronts: float = 0.0             # shared-memory wavefronts (warp-level, conflicts included)
    bank_conflict: float = 1.0               # worst shared-memory conflict degree among the accesses
    instructions: float = 0.0                # warp instructions issued
    bytes_in_flight: float = 4.0             # per thread: independent global load bytes in flight
    ilp: float = 1.0                         # per thread: independent FMA chains
    block_latency_cycles: float = 0.0        # per block: critical path of latencies not overlapped inside it
    # per block: a serial chain of latencies (a load, a barrier, a dependent reduce, per tile or
    # per k step) that bounds the block's time from below whatever the throughput: the `chain`
    # term, rounds of resident blocks x chain_cycles (0: the strategy claims no such chain)
    chain_cycles: float = 0.0
    notes: list[str] = field(default_factory=list)
    # a barrier-synchronized shared-memory tile loop (SGEMM): its FMA and issue rates are also
    # capped by tile_loop_efficiency(resident warps, k extent), priced per round of resident blocks
    tile_loop: bool = False
    k_extent: int = 0                        # per block: the k extent its tile loop covers (0: not given)
    then: "Workload | None" = None           # a second kernel launched after this one (split-K's combine)
    tensor_flops: float = 0.0                # FLOPs issued to tensor cores (padded tiles included)
    tensor_rate: float = 0.0                 # FLOP/s the matrix instruction reaches on the whole GPU
    # the kernel's shared buffers may exceed 48 KiB: the emitter then declares them as dynamic
    # shared memory and the runtime opts in (up to Target.smem_per_block_optin)
    smem_opt_in: bool = False
    # device-wide serialized work in clocks, whatever the parallelism: the atomic additions to
    # the most contended address (a scatter's repeated index), which its L2 slice applies one
    # after another (the `serial` term)
    serial_cycles: float = 0.0
    # the part of the L1/shared pipe's time that does not overlap the DRAM transfers: this fraction
    # of the smaller of the dram and l1/shared terms is added to the prediction (the `overlap`
    # term; 0: the two overlap perfectly, the max() alone). A memory-bound kernel whose every byte
    # takes several warp memory instructions (a tiled transpose: global load, shared store, shared
    # load, global store) measured 0.1-0.4 of it on the H200 (docs/cost-model.md, "Overlap")
    overlap_loss: float = 0.0
    # the chain (chain_cycles) already holds the block's global load latency (a ring's fill and
    # the stages it does not cover: the tensor-core GEMMs), so the latency term adds only the
    # block's own block_latency_cycles, not another global load per round
    latency_in_chain: bool = False
    # the fraction of the achievable DRAM rate (CostParameters.dram_efficiency x peak) that this
    # point's access pattern reaches, where a strategy has measured it to depend on the point
    # (a tiled transpose's block shape: strategies/transpose_tile.py); 1: the rate alone
    dram_efficiency: float = 1.0

    @property
    def register_count(self) -> int:
        return sum(self.registers.values())


@dataclass
class Cost:
    """The prediction for one Workload: every term in seconds, the total, and the facts behind it."""

    total: float
    terms: dict[str, float]
    bound: str
    occupancy: Occupancy
    waves: int
    tail: float                              # useful fraction of the last wave's slots
    registers: int
    smem_bytes: int
    rejected: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.rejected is None

    def breakdown(self) -> str:
        parts = [f"{k} {_us(v)}" for k, v in self.terms.items() if v > 0]
        return ", ".join(parts)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def reject_reason(w: Workload, target: Target) -> str | None:
    """The first hard constraint `w` breaks on `target`, or None."""
    regs = w.register_count
    if w.threads > target.max_threads_per_block:
        return f"{w.threads} threads per block > {target.max_threads_per_block}"
    if w.threads < 1 or w.blocks < 0:
        return "empty block"
    if w.smem_opt_in and w.smem_bytes > target.smem_per_block_optin:
        return (f"smem {w.smem_bytes / KiB:.0f} KiB > {target.smem_per_block_optin // KiB} KiB, the most a block "
                f"may opt in to on {target.arch}")
    if not w.smem_opt_in and w.smem_bytes > target.smem_per_block:
        return (f"smem {w.smem_bytes / KiB:.0f} KiB > {target.smem_per_block // KiB} KiB without opt-in "
                "(static __shared__ arrays cannot opt in)")
    if regs > target.max_registers_per_thread:
        return f"registers {regs} per thread > {target.max_registers_per_thread} (would spill)"
    if regs * w.threads > target.registers_per_block:
        return f"registers {regs} x {w.threads} threads = {regs * w.threads} > {target.registers_per_block} per block"
    return None


def predict(w: Workload, target: Target, params: CostParameters = DEFAULT_PARAMETERS) -> Cost:
    """The Cost of `w` on `target` (see the module docstring for every term)."""
    regs = _alloc_registers(w.register_count)
    occ = occupancy(target, w.threads, regs, w.smem_bytes)
    reason = reject_reason(w, target)
    if reason is None and occ.blocks_per_sm == 0:
        reason = f"a block does not fit on an SM ({occ.limiter})"
    if reason is not None:
        return Cost(math.inf, {}, "rejected", occ, 0, 0.0, regs, w.smem_bytes, rejected=reason)
    sms = target.sm_count
    clock = target.clock_hz
    blocks = max(w.blocks, 1)
    warps_per_block = -(-w.threads // target.warp_size)
    per_sm_blocks = -(-blocks // sms)                       # blocks the busiest SM runs
    resident = min(occ.blocks_per_sm, per_sm_blocks)        # of them at once
    rounds = -(-per_sm_blocks // resident)
    waves = -(-blocks // (occ.blocks_per_sm * sms))
    tail = blocks / (waves * occ.blocks_per_sm * sms)
    share = per_sm_blocks / blocks                          # fraction of all work on the busiest SM
    active_warps = resident * warps_per_block
    sms_used = min(sms, blocks)

    # DRAM: bandwidth, or Little's law when too few bytes are in flight to cover the latency
    in_flight = sms_used * active_warps * target.warp_size * w.bytes_in_flight
    # (a kernel that loads nothing, a constant fill, only stores: no latency bound then)
    latency_rate = in_flight / params.dram_latency_s if in_flight > 0 else math.inf
    dram_rate = min(params.dram_efficiency * w.dram_efficiency * target.dram_bandwidth, latency_rate)
    t_dram = w.dram_bytes / dram_rate if w.dram_bytes else 0.0
    l2_rate = min(params.l2_bandwidth_factor * target.dram_bandwidth,
                  sms_used * params.l2_bytes_per_clock_per_sm * clock,
                  2.0 * latency_rate)
    t_l2 = w.l2_bytes / l2_rate if w.l2_bytes else 0.0
    t_lsu = (w.global_wavefronts + w.smem_wavefronts) * share / clock
    if w.tile_loop and w.k_extent <= 0:
        # the single-buffered tile loop (`gemm`) also issues its shared loads only between the
        # barriers its warps wait at: its line caps the shared pipe too. Without this, gemm's 4x4
        # thread tiles were priced l1-bound at 80 us at 1024^3 and ranked above split-K
        # gemm_pipelined (83-89 us measured), while the gemm tiles timed at the small shapes ran
        # 1.0-3x their prediction (RESULTS.md first/second pass). The double-buffered fit
        # (k_extent given) was made without it.
        t_lsu /= max(min(1.0, active_warps / params.tile_loop_line_warps), 1e-3)
    # FP32 pipe: one warp FFMA per scheduler per clock on 128-lane SMs, needing
    # fma_latency independent FMAs in flight per scheduler to stay busy
    def fma_efficiency(warps: int) -> float:
        eff = min(1.0, warps * w.ilp / (target.schedulers_per_sm * params.fma_latency_cycles))
        if w.tile_loop:
            eff = min(eff, tile_loop_efficiency(warps, w.k_extent * rounds, params, target.schedulers_per_sm))
        return eff

    def issue_efficiency(warps: int) -> float:
        eff = min(1.0, warps / (2.0 * target.schedulers_per_sm))
        if w.tile_loop:
            # the stalls that idle the FP32 pipe (LDS latency, barriers) idle the issue slots too
            eff = min(eff, tile_loop_efficiency(warps, w.k_extent * rounds, params, target.schedulers_per_sm))
        return eff

    if w.tile_loop:
        # a tile loop's rate depends on the warps of the blocks running together, so each round
        # of resident blocks is priced at its own warps: a last round of 1 block where 3 ran
        # before takes a round's time, not a quarter of one (wave quantization per SM)
        # (the rounds - 1 full rounds are alike: one phase of `rounds - 1` repeats, priced once)
        last = per_sm_blocks - (rounds - 1) * resident
        phases = [(resident / per_sm_blocks, resident * warps_per_block, rounds - 1), (last / per_sm_blocks,
                                                                                      last * warps_per_block, 1)]
    else:
        phases = [(1.0, active_warps, 1)]           # one rate for the SM's whole share

    def pipe_time(at_peak: float, efficiency: Callable[[int], float]) -> float:
        """The busiest SM's work (`at_peak`: its time at full rate) over `phases`: (share of the
        work, warps running it, how many such phases)."""
        total = 0.0
        for part, warps, repeats in phases:
            if repeats:
                # repeated addition, as the sum over every round gave (the same float, so the
                # same ranking: tests/test_planning_time.py)
                term = at_peak * part / max(efficiency(warps), 1e-3)
                for _ in range(repeats):
                    total += term
        return total

    fma_eff = fma_efficiency(active_warps)
    t_fma = pipe_time(w.fma_ops * share / (target.fp32_lanes_per_sm * clock), fma_efficiency)
    t_issue = pipe_time(w.instructions * share / (target.schedulers_per_sm * clock), issue_efficiency)
    t_tensor = 0.0
    if w.tensor_flops > 0:
        if w.tensor_rate <= 0:
            raise ValueError("Workload.tensor_flops needs tensor_rate (the instruction's FLOP/s on the target)")
        tensor_eff = min(1.0, active_warps / (2.0 * target.schedulers_per_sm))
        t_tensor = w.tensor_flops * share / (w.tensor_rate / sms) / max(tensor_eff, 1e-3)
    t_special = w.special_ops * share / (params.sfu_lanes_per_sm * clock)
    loads = 0.0 if w.latency_in_chain else params.global_latency_cycles
    t_latency = rounds * (w.block_latency_cycles + loads) / clock / resident
    t_blocks = per_sm_blocks * params.block_cycles / clock
    t_chain = rounds * w.chain_cycles / clock
    terms = {"dram": t_dram, "l2": t_l2, "l1/shared": t_lsu, "tensor": t_tensor, "fma": t_fma, "issue": t_issue,
             "special": t_special, "blocks": t_blocks, "chain": t_chain, "serial": w.serial_cycles / clock}
    bound = max(terms, key=lambda k: terms[k])
    t_overlap = w.overlap_loss * min(t_dram, t_lsu)
    total = params.launch_s + terms[bound] + t_latency + t_overlap
    terms = dict(terms, latency=t_latency, launch=params.launch_s)
    if t_overlap:
        terms["overlap"] = t_overlap
    if w.then is not None:
        # the next kernel waits for this one (same stream): its whole predicted time is added
        after = predict(w.then, target, params)
        terms["then"] = after.total
        total += after.total
    details = {"blocks": blocks, "threads": w.threads, "resident_blocks": resident, "rounds": rounds,
               "active_warps_per_sm": active_warps, "dram_rate": dram_rate, "fma_efficiency": fma_eff,
               "bytes_in_flight_per_thread": w.bytes_in_flight, "flops": w.flops, "dram_bytes": w.dram_bytes,
               "l2_bytes": w.l2_bytes, "bank_conflict": w.bank_conflict, "registers": dict(w.registers)}
    return Cost(total, terms, bound, occ, waves, tail, regs, w.smem_bytes, None, details)


def tile_loop_efficiency(warps: int, k_extent: int, params: CostParameters = DEFAULT_PARAMETERS,
                         schedulers: int = 4) -> float:
    """Fraction of the FP32 / issue peak an SGEMM tile loop reaches with `warps` warps on the SM
    (of `schedulers` warp schedulers) when a block slot runs `k_extent` steps of k (0: not given,
    the third pass's warps / 22 line); CostParameters says why."""
    if k_extent <= 0:
        return warps / params.tile_loop_line_warps
    eff = 1.0 - math.exp(-warps / params.tile_loop_warps)
    if warps < schedulers:   # a scheduler to each warp (CostParameters.tile_loop_alone)
        one_each = 1.0 - math.exp(-schedulers / params.tile_loop_warps)
        eff = max(eff, min(one_each, warps / schedulers * params.tile_loop_alone))
    return eff * k_extent / (k_extent + params.tile_loop_fill_k)


def _alloc_registers(regs: int) -> int:
    """ptxas allocates registers per thread in multiples of 8 on sm_80+ (cuda_occupancy.h's
    register allocation unit of 256 per warp)."""
    return max(8, -(-regs // 8) * 8)


__all__ = ["Cost", "CostParameters", "DEFAULT_PARAMETERS", "Workload", "predict", "reject_reason", "tile_loop_efficiency"]
