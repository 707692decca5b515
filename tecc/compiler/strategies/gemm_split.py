"""Split-K on the tensor-core GEMM strategies: which parts a point is offered with and what the
hand-over of the partial tiles costs (the `split_k` primitive, tecc/passes/schedule/split_k.py:
each of S blocks runs C = K tiles / S of an output tile, stores its float32 partial tile, and the
last of them to arrive sums the S partials in split order and runs the epilogue).

A point's "split" is S (absent: 1). Its workload is that of tiles x S blocks of C k tiles each,
plus (`split_traffic`) the partials through L2 -- S stores of BM x BN floats per tile, S - 1
loads by the last part -- and to DRAM the share of L2 they fill, the hand-over's latency
(`split_handover_cycles`: a fence, the atomic, the barriers; the workload's block latency,
exposed whatever the bound) and the last part's sum on its SM's chain (`split_sum_cycles`).

The sum is latency-bound, not bandwidth-bound, wherever the accumulators leave few registers:
each thread reads (S - 1) x E floats at L2 (E accumulators), and ptxas keeps only as many loads
in flight as registers are free beside them and the TMA-store epilogue's staging addresses
(BN / 4, which ptxas computes at the kernel's start and keeps live). H200, device time
(benchmarks/gemm_small.py), 1024 x 1024 x 8192 fp16:

  128 x 256 split 4, persistent, TMA-store epilogue (3 stages)   42.7 us  (predicted 41.6)
  the same, its epilogue's thread index read again (`opaque`)    45.6 us  (predicted 33.2)
  128 x 256 split 4, one block per part, register epilogue       37.1 us  (predicted 35.9)
  64 x 128 unsplit, persistent (the best unsplit point)          39.6 us  (predicted 47.7)
  cuBLAS                                                          25.6 us

Its sm_90a SASS: 128 accumulators and the 64 hoisted staging addresses under setmaxnreg's 232
left ~18 registers, ~16 loads in flight, 28 rounds of an L2 round trip for its 384 loads per
thread (SPLIT_ROUND_CYCLES is fitted there). Reading the thread index again after the sum freed
those registers but cost ~25 integer instructions per staged element on the critical path
(3732 epilogue instructions per thread against 519), and the kernel ran slower: split_k.py keeps
the addresses hoisted, and this model their registers. The register epilogue needs no staging
tile, so its ring keeps 4 stages (the TMA-store point's 64 KB staging tile leaves room for 3)
and its sum all the free registers: the planner picks it. 1024 x 1024 x 4096's 128 x 128 split 2
(64 accumulators and 32 staging addresses: its 64 loads in two rounds) took 20.1 us hoisted
(predicted 20.1) and 23.05 re-read, the 64 x 128 unsplit point 20.5-20.6.
"""

from __future__ import annotations

import math

from ...ir.target import Target
from .registry import Point

# The parts S a point may divide each output tile's k tiles into, offered only where the output
# tiles are fewer than SPLIT_TILES_PER_SM x SMs (more tiles than that keep every SM busy without
# it), each part keeps MIN_SPLIT_K_TILES k tiles and the parts divide the k tiles evenly (no part
# runs zero-filled tiles past K).
SPLITS = (2, 3, 4, 6, 8)
SPLIT_TILES_PER_SM = 2
MIN_SPLIT_K_TILES = 2
# The hand-over of a split's float32 partial tile: what one SM moves to and from L2 per cycle
# at most (CostParameters.l2_bytes_per_clock_per_sm: the stores, and the sum's floor), and the
# fence, atomic and barriers around the arrival count (a __threadfence waits for the group's
# stores to reach L2: about one L2 round trip, and the atomic another). Assumed, not fitted: the
# two measured split points cannot separate them from the sum's rounds.
SPLIT_L2_BYTES_PER_CYCLE = 64.0
SPLIT_SYNC_CYCLES = 1200.0
# The last part's sum: one L2 round trip per round of loads a thread keeps in flight (loaded
# latency plus the adds; fitted to the 128 x 256 split-4 TMA-store kernel, 12.5 us of hand-over
# where the k loop, fill, epilogue and launch are priced as in the unsplit kernels: 28 rounds),
# and the registers a consumer thread holds besides its accumulators and the epilogue's staging
# addresses while it sums (addressing, the tile loop, the counter; read off that kernel's SASS:
# 232 - 128 - 64 - 22 = 18 registers for loads).
SPLIT_ROUND_CYCLES = 790.0
SPLIT_LIVE_REGISTERS = 22
# What setmaxnreg.inc gives each consumer thread of a wgmma block with two consumer warpgroups
# and a TMA producer (gemm_wgmma.tma_registers: 168 at launch, 232 for the consumers).
TMA_CONSUMER_REGISTERS = 232


def split_of(point: Point) -> int:
    """The point's split-K parts (1: none; plans made before split-K have no "split")."""
    return int(point.get("split", 1))


def split_sum_cycles(point: Point, accumulators: int, in_flight: float) -> float:
    """Cycles the last part of an output tile spends reading the S - 1 other partials at L2
    and summing them (module docstring): each thread's (S - 1) x `accumulators` loads in rounds
    of `in_flight` loads, one SPLIT_ROUND_CYCLES each, and never faster than the SM's L2
    bandwidth."""
    splits = split_of(point)
    if splits == 1:
        return 0.0
    partial = int(point["bm"]) * int(point["bn"]) * 4.0
    rounds = math.ceil((splits - 1) * accumulators / max(in_flight, 1.0))
    return max((splits - 1) * partial / SPLIT_L2_BYTES_PER_CYCLE, rounds * SPLIT_ROUND_CYCLES)


def wgmma_sum_in_flight(point: Point, accumulators: int, register_budget: int, staging: int = 0) -> float:
    """Loads a wgmma consumer thread keeps in flight while it sums: the registers of
    `register_budget` (setmaxnreg's 232 for two consumer warpgroups, else ptxas's 255) that its
    accumulators, the TMA-store epilogue's `staging` addresses and SPLIT_LIVE_REGISTERS leave;
    an element in flight holds S registers, S - 1 of them loads (its own term is a copy of its
    accumulator)."""
    splits = split_of(point)
    free = max(splits, register_budget - accumulators - staging - SPLIT_LIVE_REGISTERS)
    return free * (splits - 1) / splits


def wgmma_split_sum(target: Target, point: Point, groups: int = 0) -> float:
    """Cycles the last part of a gemm_wgmma split point's output tile spends summing the
    partials: a consumer thread's accumulators, and the loads in flight the registers leave --
    TMA_CONSUMER_REGISTERS with two consumer warpgroups on the TMA ring, else the target's
    per-thread limit --, less the TMA-store epilogue's BN / 4 staging addresses, which ptxas
    computes at the kernel's start and keeps live through the sum (module docstring)."""
    bm, bn = int(point["bm"]), int(point["bn"])
    groups = groups or bm // 64
    accumulators = bm * bn // (64 * groups) // 2
    budget = TMA_CONSUMER_REGISTERS if point.get("load") == "tma" and groups == 2 else target.max_registers_per_thread
    # BN / 4 as fitted (SPLIT_ROUND_CYCLES); the epilogue stages column pairs now and ptxas keeps
    # BN / 8 addresses live: to be re-fitted on the GPU before the sum is priced with them
    staging = bn // 4 if point.get("epilogue") == "tma" else 0
    return split_sum_cycles(point, accumulators, wgmma_sum_in_flight(point, accumulators, budget, staging))


def split_handover_cycles(point: Point, accumulators: int = 0, in_flight: float = 1.0) -> tuple[float, float]:
    """(latency a work unit of a split point exposes after storing its partial tile: the
    arrival handshake, which nothing in the block overlaps; cycles the last split of an output
    tile adds to its SM's chain: `split_sum_cycles` for threads of `accumulators` float32
    accumulators keeping `in_flight` loads in flight). The epilogue stays counted for every unit
    (tile_fixed_cycles): the other splits store their partial tile instead, about as much."""
    if split_of(point) == 1:
        return 0.0, 0.0
    return SPLIT_SYNC_CYCLES, split_sum_cycles(point, accumulators, in_flight)


def split_publish_cycles(point: Point) -> float:
    """Cycles a part spends storing its float32 partial tile: coalesced (each warp store writes
    128 contiguous bytes), at SPLIT_L2_BYTES_PER_CYCLE."""
    return int(point["bm"]) * int(point["bn"]) * 4.0 / SPLIT_L2_BYTES_PER_CYCLE


def split_registers(accumulators: int, element_loads: bool) -> int:
    """Registers the sum of the partial tiles adds per thread of a wgmma kernel (the partials'
    addresses and the loads ptxas issues ahead). ptxas, sm_90a, 1000 x 1000 x K, 4 stages,
    S = 2 and 4: with cp.async copies (K = 1024) 0-10 more than unsplit; with element-loaded
    operands (K = 1023) 128 x 128 took 185 -> 238 / 255, about one more register per
    accumulator, the other tiles no more."""
    return accumulators + 8 if element_loads else 12


def mma_split_registers(accumulators: int, splits: int) -> int:
    """The same for an mma.sync kernel: ptxas issues the S - 1 partials' loads ahead up to about
    40 registers. sm_80, 1000 x 1000 x 1024 / 1023, 4 stages (unsplit -> S = 2 -> S = 4):
    32 accumulators 87 -> 92 -> 128, 64: 124 -> 128 -> 165 and 160 -> 162 -> 193, 128 (64 x 64
    warp tiles): 214 -> 255 -> 255 with 264 bytes spilled."""
    return min(40, (splits - 1) * accumulators // 2) + 4


def split_traffic(point: Point, tiles: int, threads: int, target: Target) -> tuple[float, float, float]:
    """(L2 bytes, DRAM bytes, warp instructions) the hand-over of a split point adds over its
    `tiles` output tiles of `threads` threads: every part stores its float32 partial tile (a
    warp store covers 128 bytes) and the last reads the S - 1 others (a load and an add per
    element). The partials stay in L2 while they fit; the share of L2 they fill is assumed
    written back to DRAM."""
    splits = split_of(point)
    if splits == 1:
        return 0.0, 0.0, 0.0
    partial = int(point["bm"]) * int(point["bn"]) * 4.0
    stored = tiles * splits * partial
    l2 = stored + tiles * (splits - 1) * partial
    dram = stored * min(1.0, stored / max(target.l2_bytes, 1))
    elements = partial / 4.0 / threads   # accumulators per thread
    instructions = tiles * threads / 32.0 * elements * (splits + 2.0 * (splits - 1))
    return l2, dram, instructions


def split_parts(k_tiles: int, output_tiles: int, target: Target) -> tuple[int, ...]:
    """The split-K parts a point over `output_tiles` tiles with `k_tiles` k tiles is offered
    with: 1, and each of SPLITS that divides the k tiles into parts of MIN_SPLIT_K_TILES or more,
    where the output tiles are fewer than SPLIT_TILES_PER_SM per SM."""
    if output_tiles >= SPLIT_TILES_PER_SM * target.sm_count:
        return (1,)
    return (1,) + tuple(s for s in SPLITS if k_tiles % s == 0 and k_tiles // s >= MIN_SPLIT_K_TILES)


def split_in_one_wave(point: Point, tiles: int, smem_bytes: int, target: Target) -> bool:
    """Whether a split point's work units (`tiles` output tiles x S parts) run in one wave: at
    most one per block slot of the SMs, counting the slots the block's shared memory leaves
    (`smem_bytes`). Beyond one wave the hand-over is no longer paid once: the part that arrives
    last sums and runs the epilogue, so it starts its next unit late and is the last to arrive
    again, and `split_chain` (fitted on one-wave points only) prices every later round far too
    low. H200, device time (benchmarks/gemm_small.py --weight-grads 6, bf16, float32 out):
    768 x 3072 x 8192 in 128 x 192 tiles, 96 tiles on 132 SMs -- unsplit 67.4 us; split 4 (384
    units, predicted 72.5-81.0) 82.2-97.1 us; split 8 (predicted 81.9) 233 us, against cuBLAS
    59.3; 768 x 768 x 8192 in 64 x 192 tiles split 8 (384 units) 65.5-66.4 us against 28.1-29.2
    for the one-wave split 2 and 128 x 192 split 4 points. The one-wave points the split model
    was fitted on (1024 x 1024 x 8192, 1024 x 1024 x 4096) are all offered as before."""
    if split_of(point) == 1:
        return True
    slots = max(1, target.smem_per_sm // max(smem_bytes + target.smem_reserved_per_block, 1))
    return tiles * split_of(point) <= target.sm_count * slots


def split_label(point: Point) -> str:
    """What `describe` says of a split point ('' unsplit)."""
    return f", split-K {split_of(point)} (the last part sums the partials)" if split_of(point) > 1 else ""


def split_note(point: Point, tiles: int, k_tiles: int, l2: float, reduce: float) -> str:
    """explain's line for a split point: the parts, the hand-over (`reduce`: the last part's sum,
    split_sum_cycles) and the partials' traffic."""
    splits = split_of(point)
    return (f"split-K {splits}: {tiles} output tiles x {splits} parts of {k_tiles} k tiles; each part stores its "
            f"float32 partial tile ({SPLIT_SYNC_CYCLES:.0f} cycles of handshake), the last sums the others in split "
            f"order ({reduce:.0f} cycles: its loads in flight are what the accumulators leave of the registers): "
            f"{l2 / 1e6:.1f} MB through L2")


def split_chain(point: Point, main: float, per_tile: float, once: float, base: float, fill: float,
                units: int, reduce: float) -> float:
    """A wgmma SM chain (gemm_wgmma.wgmma_sm_chain) of a split point: `main` the k loop of one
    part, `per_tile` / `once` / `base` the per-tile fixed cycles of the point, once per block
    and of the baseline, `fill` the ring's fill in `per_tile`, `units` the busiest persistent
    block's work units (0: one block per unit), `reduce` the last part's sum (split_sum_cycles). Each part stores its float32 partial tile
    (coalesced) where the epilogue was; the last part of a tile then sums the S partials and runs
    the epilogue, which the k-loop constants were not set on: added whole, in a persistent block
    for 1 / S of its units on average plus one whole at its end (the tail), else on every round's
    critical path (the handshake's latency is the workload's block latency, exposed whatever the
    bound). The baseline the k-loop constants hold is one per output tile: 1 / S of it per part
    (and its `share` as the whole tile's k loop would have it)."""
    splits = split_of(point)
    share = min(1.0, main * splits / base) if base > 0 else 1.0
    round_ = main + (fill + split_publish_cycles(point) - base / splits) * share
    last = per_tile - fill + reduce
    if units:
        return units * (round_ + last / splits) + once * share + last * (1.0 - 1.0 / splits)
    return round_ + last


__all__ = ["MIN_SPLIT_K_TILES", "SPLITS", "SPLIT_TILES_PER_SM", "TMA_CONSUMER_REGISTERS", "mma_split_registers",
           "split_chain", "split_handover_cycles", "split_in_one_wave", "split_label", "split_note", "split_of", "split_parts",
           "split_publish_cycles", "split_registers", "split_sum_cycles", "split_traffic", "wgmma_split_sum",
           "wgmma_sum_in_flight"]
