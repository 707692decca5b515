"""The cost of the one-kernel attention (the online contraction), fitted on H200 timings.

The planner ranks the tilings of the tensor-core kernels (wgmma on sm_90, mma.sync) with this,
and the kernels against the SIMT form and the unfused per-kernel plans. A launch takes the sum
over its blocks of a block's cost in SM-microseconds, over the SMs:

    block cost = F + t · (key tiles the block visits) + m · (of them, tiles with the per-element guard)

at the blocks per SM the kernel runs at: with k blocks resident an SM runs them together, each
taking k times its cost, so k blocks finish every k · cost (fewer when the launch has fewer
blocks than the SMs' slots). `attention_workload` puts that on the
cost model's `chain` term (a block's serial path, paid once per round of resident blocks on the
busiest SM: rounds · k · cost ≈ blocks / SMs · cost, with the last round's tail), so `predict`
gives the launch's time with its waves, beside the tensor-core, DRAM and L2 terms of the same
work.

(F, t, m) come from a table of fits per tiling and occupancy (`BLOCK_COST`), each from the
measurements it cites; a tiling or occupancy the table lacks takes the formula

    t = ((tensor FLOPs of a tile / the SM's tensor rate) / EFFICIENCY[form] + TILE_US[form]
         + score elements of a tile · SOFTMAX_INSTRUCTIONS / (FP32 lanes · clock)) · occupancy penalty
    F = FIXED_TILES · t,   m = GUARD_SHARE · t      (all times UNMEASURED: an extrapolation)

fitted on the same measurements (docs/attention.md, "The cost model of the tilings"): the
wgmma efficiency, per-tile cost and exposed softmax instructions from the three two-point fits
at two blocks per SM, the mma.sync ones from its four timed tilings, the penalty of fewer
resident warpgroups from the 128 x 64 kernel at one block per SM. The formula reproduces the
table's entries within 26%; the table is what ranks the measured tilings.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir.target import Target
from .analysis import RANDOM_COST
from .model import Workload

SM90_FIT_SMS = 132          # the H200 the fits were measured on (a launch: Σ block costs / 132)

# (form, head-dim class, rows, key tile, warp rows (mma.sync; 0 for wgmma), blocks per SM,
# overlapped) -> (F, t, m) in SM-µs on an H200. The head-dim class is 64 for d <= 64, 128 for
# d <= 128 (d = 96 is priced as 128), else d. Sources (benchmarks/RESULTS.md; B = 16384 / S,
# H = 2048 / d, fp16). A block's cost is taken as the time over the model's block slots: with
# `blocks` blocks, k per SM and 132 SMs, the busiest SM runs ceil(blocks / 132) blocks in
# ceil(. / k) rounds of k, so time = rounds · k · cost (16 rounds x 2 for 4096 blocks at k = 2):
#   wgmma, plain form, the tilings the planner takes (attention.py, stop 23, attention_fp16_h200_s23.json,
#   a least-squares line over S = 1k .. 16k, not causal; m from the 8k causal row):
#     d = 128, 128 x 64, 2 blocks/SM: 2048 blocks of 16 .. 256 tiles: 306 / 569 / 1026 / 1988 / 3889 us
#       (t 0.933, F 4.2, within 2% of each); m = 0.2 t (the guard's share of a tile's SASS: ~80 of
#       ~420 instructions per thread)
#     d = 64, 128 x 128, 2 blocks/SM: 4096 blocks of 8 .. 128 tiles: 377 / 621 / 1195 / 2283 / 4476 us
#       (t 1.068, F 3.24, within 5%); 8k causal 1255 us (32.5 tiles, 1 guarded): m 1.26, which holds
#       the causal launch's tail as much as the guard
#   wgmma, plain form, fits of attention_tilings.py --wgmma (stop 22 / 23; "The tiling under a mask
#   that skips key tiles" in docs/attention.md), made as time · 132 / blocks, here times the
#   blocks' share of the model's slots (2048 / 132 = 15.5 of 16: 0.97):
#     d = 128, 128 x 64, 1 block/SM (133 registers): 8k causal 1394.3 us with F, m as at 2 blocks
#     d = 128, 128 x 128, 1 block/SM: 4k 1165, 8k 2188.4, 8k causal 1202.5
#     d = 64, 128 x 64, 2 blocks/SM: 4k 1340, 8k 2580.5, 8k causal 1460.8
#   the rest likewise (one point each, and mma.sync: 0.97, or 62.06 / 63 for 8192 blocks at 3 per SM)
#   wgmma, one point each (S = 4096, not causal; F from the prologue and epilogue bytes against the
#   d = 64 128 x 128 fit, or FIXED_TILES · t; m = GUARD_SHARE · t, or the d = 64 fits' m / t = 1.2):
#     d = 64, 64 x 64 asking 4 blocks/SM: 1319 us over 8192 blocks of 64 tiles (64 rounds of 4 blocks)
#     d = 64, 128 x 64 overlapped, 2 blocks/SM: 1415 us over 4096 blocks of 64 tiles
#     d = 128, 128 x 128 overlapped, 1 block/SM: 1285 us over 2048 blocks of 32 tiles
#   mma.sync (attention_tilings.py --s 4096; F, m as for one point):
#     d = 64, 128 x 64, 32 rows per warp, 2 blocks/SM (249 registers): 1786 us, 4096 blocks of 64 tiles
#     d = 64, 64 x 64, 16 rows per warp, 3 blocks/SM (165 registers): 1959 us, 8192 blocks of 64 tiles
#     d = 128, 64 x 64, 16 rows per warp, 2 blocks/SM (243 registers): 1839 us, 4096 blocks of 64 tiles
#     d = 128, 64 x 32, 16 rows per warp, 2 blocks/SM: 2013 us, 4096 blocks of 128 tiles
BlockKey = tuple[str, int, int, int, int, int, bool]
BLOCK_COST: dict[BlockKey, tuple[float, float, float]] = {
    ("wgmma", 128, 128, 64, 0, 2, False): (4.20, 0.9332, 0.1866),
    ("wgmma", 128, 128, 64, 0, 1, False): (3.563, 1.278, 0.2556),
    ("wgmma", 128, 128, 128, 0, 1, False): (8.873, 1.9986, 1.3285),
    ("wgmma", 64, 128, 128, 0, 2, False): (3.24, 1.0676, 1.26),
    ("wgmma", 64, 128, 64, 0, 2, False): (3.142, 0.6051, 1.590),
    ("wgmma", 64, 64, 64, 0, 4, False): (1.62, 0.2967, 0.356),
    ("wgmma", 64, 128, 64, 0, 2, True): (2.919, 0.6452, 0.1291),
    ("wgmma", 128, 128, 128, 0, 1, True): (9.939, 2.1993, 0.4399),
    ("mma.sync", 64, 128, 64, 32, 2, False): (3.685, 0.8147, 0.1629),
    ("mma.sync", 64, 64, 64, 16, 3, False): (2.049, 0.4537, 0.0907),
    ("mma.sync", 128, 64, 64, 16, 2, False): (3.792, 0.8389, 0.1678),
    ("mma.sync", 128, 64, 32, 16, 2, False): (2.143, 0.4740, 0.0948),
}

# The formula (module docstring), fitted on the table's measured entries. wgmma at two blocks of
# two warpgroups per SM: d = 128 128 x 64 (t = 0.9526), d = 64 128 x 128 (1.088) and d = 64 128 x 64
# (0.624). The first two share their tensor FLOPs per tile (4.19 MFLOP, 0.56 us at the H200's
# 7.49 TFLOP/s per SM) and differ in score elements (8192 / 16384): 0.135 us per 8192 elements
# (4.2 instructions per element left exposed at 128 lanes x 1.98 GHz); the first and third differ
# in FLOPs alone: 0.3286 us per 0.28 us at the peak, 0.852 of it; what is left, 0.16 us, is a key
# tile's own cost (its barrier, the ring's wait and refill, the rescale of O). mma.sync: its two
# pairs of timed tilings (d = 128 64 x 64 / 64 x 32, d = 64 128 x 64 / 64 x 64) give 0.41 and 0.45
# of the wgmma peak with 0.111 and 0.081 us per tile: 0.43 and 0.096 (on sm_8x, where mma.sync is
# the native path, its efficiency scaled as the GEMM model scales it: 0.9 / 0.6). The formula puts
# the one-point fits within 26% (d = 64 64 x 64: 0.392 against 0.311).
EFFICIENCY = {"wgmma": 0.852, "mma.sync": 0.43}
TILE_US = {"wgmma": 0.16, "mma.sync": 0.096}
MMA_SYNC_SM8X_SCALE = 0.9 / 0.6
SOFTMAX_INSTRUCTIONS = 4.2
# fewer than FULL_WARPS warps resident per SM hide less of the wgmma and load latency: the 128 x 64
# d = 128 kernel ran 1.38x slower per tile at 8 warps (1 block) than the formula at 16 (2 blocks);
# linear in the missing warps between (4 warps: 1.57)
FULL_WARPS = 16
PENALTY_AT_HALF = 0.38
# a tiling (or occupancy) the table lacks is priced at the formula times this: the formula's own
# error on the fits (up to 26%, 15% on the mma.sync pair it was not fitted on) taken against the
# extrapolation, so a measured tiling keeps its place unless an unmeasured one is predicted
# clearly faster
UNMEASURED = 1.15
FIXED_TILES = 4.52          # F / t of the four two-point fits: 3.86, 4.44, 4.60, 5.19
GUARD_SHARE = 0.2           # m / t: the guard's share of a tile's SASS


def head_dim_class(widest: int) -> int:
    return 64 if widest <= 64 else 128 if widest <= 128 else widest


@dataclass(frozen=True)
class Tiling:
    """One tiling of the tensor-core attention kernel."""

    form: str                 # "wgmma" or "mma.sync"
    rows: int                 # query rows per block
    key_tile: int
    warp_rows: int = 0        # mma.sync: rows per warp (16 or 32); 0 for wgmma
    overlap: bool = False     # wgmma: the overlapped form

    @property
    def warps(self) -> int:
        return self.rows // 16 if self.form == "wgmma" else self.rows // self.warp_rows

    @property
    def threads(self) -> int:
        return 32 * self.warps


def block_cost_entry(tiling: Tiling, widest: int, blocks_per_sm: int) -> tuple[float, float, float] | None:
    """The table's (F, t, m) for the tiling at that occupancy, or None."""
    key = (tiling.form, head_dim_class(widest), tiling.rows, tiling.key_tile, tiling.warp_rows, blocks_per_sm,
           tiling.overlap)
    return BLOCK_COST.get(key)


# the part the fits were measured on (an H200: the H100 table's SMs and clock): its dense fp16
# tensor rate per SM and FP32 lanes per microsecond, for scaling a fit to another part
FIT_TENSOR_RATE_PER_SM = 989.4e12 / 132
FIT_LANES_PER_US = 128 * 1980.0


def _formula(tiling: Tiling, depth: int, columns: int, blocks_per_sm: int, rate_per_sm: float,
             lanes_per_us: float, native_mma_sync: bool) -> float:
    """t of the formula (module docstring), SM-µs per key tile."""
    efficiency = EFFICIENCY[tiling.form] * (MMA_SYNC_SM8X_SCALE if native_mma_sync else 1.0)
    flops = 2.0 * tiling.rows * tiling.key_tile * (depth + columns)
    t = (flops / max(rate_per_sm, 1.0) * 1e6 / efficiency + TILE_US[tiling.form]
         + tiling.rows * tiling.key_tile * SOFTMAX_INSTRUCTIONS / lanes_per_us)
    warps = tiling.warps * max(blocks_per_sm, 1)
    if tiling.form == "wgmma" and warps < FULL_WARPS:
        t *= 1.0 + PENALTY_AT_HALF * (FULL_WARPS - warps) / (FULL_WARPS / 2)
    return t


def formula_cost(tiling: Tiling, depth: int, columns: int, blocks_per_sm: int, target: Target,
                 dtype: str = "float16") -> tuple[float, float, float]:
    """(F, t, m) of the formula (module docstring) in SM-µs, for head dims `depth` (scores) and
    `columns` (output) on `target`."""
    rate = target.tensor_flops.get(dtype, target.tensor_flops.get("float16", 0.0)) / target.sm_count
    lanes_per_us = target.fp32_lanes_per_sm * target.clock_hz / 1e6
    t = _formula(tiling, depth, columns, blocks_per_sm, rate, lanes_per_us, target.sm < 90) * UNMEASURED
    return FIXED_TILES * t, t, GUARD_SHARE * t


def block_cost(tiling: Tiling, depth: int, columns: int, blocks_per_sm: int, target: Target,
               dtype: str = "float16") -> tuple[tuple[float, float, float], str]:
    """(F, t, m) for the tiling at `blocks_per_sm`, and where it came from: the table's fit
    ("fit"; on a part other than the H200 scaled by the formula's ratio between the two), else
    the formula ("formula")."""
    entry = block_cost_entry(tiling, max(depth, columns), blocks_per_sm)
    if entry is None:
        return formula_cost(tiling, depth, columns, blocks_per_sm, target, dtype), "formula"
    rate = target.tensor_flops.get(dtype, target.tensor_flops.get("float16", 0.0)) / target.sm_count
    lanes_per_us = target.fp32_lanes_per_sm * target.clock_hz / 1e6
    here = _formula(tiling, depth, columns, blocks_per_sm, rate, lanes_per_us, target.sm < 90)
    there = _formula(tiling, depth, columns, blocks_per_sm, FIT_TENSOR_RATE_PER_SM, FIT_LANES_PER_US, False)
    scale = here / there
    if abs(scale - 1.0) < 1e-3:   # the H200 itself (its figures rounded in the table)
        return entry, "fit"
    return (entry[0] * scale, entry[1] * scale, entry[2] * scale), f"fit x {scale:.2f} for {target.arch}"


@dataclass(frozen=True)
class AttentionLaunch:
    """What one launch of the kernel does, as the strategies count it."""

    blocks: int               # query blocks x heads x key splits
    tiles: float              # key tiles a block visits (the mean over the blocks)
    guarded: float            # of them, with the per-element guard
    heads: int
    query_rows: int
    keys: int
    depth: int                # D (scores' head dim)
    columns: int              # C (the output's)
    itemsize: int             # bytes of a Q / K / V element
    kv_splits: int = 1


# Dropout on the weights (docs/training.md, "Dropout inside attention"): the mask's integer work
# per score element, issued beside the tile's fitted cost (UNMEASURED: added, not overlapped):
# a Philox4x32-10 call (RANDOM_COST, ~80 instructions) per four elements, and ~8 instructions per
# element for the keep bits, their shuffle and the select into P.
DROPOUT_INSTRUCTIONS = RANDOM_COST / 4 + 8.0
ISSUE_PER_CLOCK = 128       # thread instructions an SM issues per clock (4 schedulers x 32 lanes)
FIT_CLOCK_MHZ = 1980.0      # the H200 clock the SM-µs of the fits are in


def dropout_tile_us(tiling: Tiling) -> float:
    """The mask's extra SM-µs per key tile of a block (DROPOUT_INSTRUCTIONS per score element)."""
    return tiling.rows * tiling.key_tile * DROPOUT_INSTRUCTIONS / ISSUE_PER_CLOCK / FIT_CLOCK_MHZ


def attention_workload(tiling: Tiling, launch: AttentionLaunch, registers: int, smem_bytes: int,
                       blocks_per_sm: int, target: Target, dtype: str = "float16",
                       note: str = "", dropout: bool = False) -> Workload:
    """The Workload of the tensor-core kernel at `tiling` for `launch`, its block cost on the chain
    term (module docstring); `registers` and `smem_bytes` per block (ptxas's, or the nominal ones)
    give the cost model the same occupancy as `blocks_per_sm`, the occupancy the cost is taken at."""
    (fixed, per_tile, per_guard), source = block_cost(tiling, launch.depth, launch.columns, blocks_per_sm, target,
                                                      dtype)
    if dropout:
        per_tile += dropout_tile_us(tiling)
        source += f"; + {dropout_tile_us(tiling):.3f} per tile for the dropout mask (unmeasured)"
    # the fits are SM-µs of the H200's SMs at 1.98 GHz: a block's serial path in cycles of the target
    cost_us = fixed + per_tile * launch.tiles + per_guard * launch.guarded
    # k resident blocks share the SM, each taking k times its cost; a launch with fewer blocks
    # than the SMs' slots leaves fewer together (a lone block on an SM: one cost)
    together = max(1, min(blocks_per_sm, -(-launch.blocks // target.sm_count)))
    chain_cycles = together * cost_us * 1e-6 * target.clock_hz
    tile_flops = 2.0 * tiling.rows * tiling.key_tile * (launch.depth + launch.columns)
    tensor_flops = launch.blocks * launch.tiles * tile_flops
    rate = target.tensor_flops.get(dtype, target.tensor_flops.get("float16", 0.0))
    kv_tile_bytes = tiling.key_tile * (launch.depth + launch.columns) * launch.itemsize
    q_bytes = launch.heads * launch.query_rows * launch.depth * launch.itemsize
    o_bytes = launch.heads * launch.query_rows * launch.columns * launch.itemsize
    kv_bytes = launch.heads * launch.keys * (launch.depth + launch.columns) * launch.itemsize
    l2 = launch.blocks * launch.tiles * kv_tile_bytes + q_bytes + o_bytes
    notes = [f"{tiling.form} {tiling.rows}x{tiling.key_tile}: block cost {fixed:.2f} + {per_tile:.3f} x "
             f"{launch.tiles:.1f} tiles + {per_guard:.3f} x {launch.guarded:.1f} guarded = {cost_us:.1f} SM-us at "
             f"{blocks_per_sm} block(s)/SM ({source})"]
    if note:
        notes.append(note)
    second = None
    if launch.kv_splits > 1:
        partials = 4.0 * launch.kv_splits * launch.heads * launch.query_rows * (launch.columns + 2)
        outputs = launch.heads * launch.query_rows * launch.columns
        second = Workload(
            blocks=max(1, -(-outputs // 256)), threads=256, registers={"combine": 32},
            dram_bytes=partials + o_bytes, l2_bytes=partials + o_bytes, global_wavefronts=(partials + o_bytes) / 128.0,
            instructions=outputs / 32 * (8.0 * launch.kv_splits + 16.0), bytes_in_flight=4.0 * launch.kv_splits,
            notes=[f"one thread per output combines {launch.kv_splits} partials"])
    return Workload(
        blocks=launch.blocks, threads=tiling.threads, registers={"ptxas": registers}, smem_bytes=smem_bytes,
        smem_opt_in=True, flops=tensor_flops, tensor_flops=tensor_flops, tensor_rate=rate,
        dram_bytes=q_bytes + kv_bytes + o_bytes, l2_bytes=l2, global_wavefronts=l2 / 128.0,
        # the ring keeps the next K/V tile in flight while this one is computed
        bytes_in_flight=kv_tile_bytes / tiling.threads, chain_cycles=chain_cycles, then=second, notes=notes)


# the SIMT form's serial path per key tile of one block (cycles): the lane's score (its K row's
# loads, issued together, then D dependent FMAs), two barriers around the shared tile of scores,
# and per key of the tile an exp and the K = ceil(C / 32) dependent FMAs of its columns (the
# latencies of cost/model.py's CostParameters; an estimate, not fitted: no SIMT tiling was timed
# since the tensor-core forms exist)
SIMT_LOAD_CYCLES = 550.0
SIMT_FMA_CYCLES = 4.0
SIMT_EXP_CYCLES = 20.0
SIMT_BARRIER_CYCLES = 40.0


def simt_workload(queries: int, keys: int, heads: int, depth: int, columns: int, itemsize: int, threads: int,
                  rows_per_block: int, score_wavefronts: float) -> Workload:
    """What the SIMT online contraction does (tecc.passes.rewrite.online_contraction): blocks of
    `rows_per_block` query rows × `threads` lanes; per key tile of `threads` keys a lane computes
    one score (D FMAs), then every lane walks the tile's keys: an exp each and the K columns it
    owns (K = ceil(C / threads) FMAs per key); K and V tiles come through L1/L2 for every row.

    The L1 term counts each warp's requests: `score_wavefronts` per warp and key tile for its
    scores (strategies/online_contraction.score_wavefronts: lane tx reads key tile·T + tx, so a
    contraction Σ_d Q·K[.., j, d] reads 32 different K rows per step of d, one wavefront each),
    and one per key and column chunk of V (a coalesced row piece). Counted as the L2 bytes over
    128 instead (every read coalesced), the GPT-2 shape (B 8, H 12, S 1024, d 64, bf16, causal) was
    predicted at 0.97 ms, l2-bound; its score reads alone are 64 x 32 wavefronts per warp and tile,
    ~26 ms over 132 SMs, the order of the form's measured 0.0017x of cuDNN (RESULTS.md, "Attention
    on tensor cores": ~590x cuDNN's time; cuDNN's forward at that shape: 46 us)."""
    blocks = -(-queries // rows_per_block) * heads
    tiles = -(-keys // threads)
    columns_per_lane = -(-columns // threads)
    lanes = blocks * rows_per_block * threads
    warps = lanes // 32
    fma_per_tile = depth + threads * (columns_per_lane + 2)
    fma_ops = float(lanes * tiles * fma_per_tile)
    special = float(lanes * tiles * threads)
    chain = tiles * (SIMT_LOAD_CYCLES + depth * SIMT_FMA_CYCLES + 2 * SIMT_BARRIER_CYCLES
                     + threads * (SIMT_EXP_CYCLES + columns_per_lane * SIMT_FMA_CYCLES))
    l2 = float(blocks * keys * (depth + columns) * itemsize)   # a block's rows share its K / V reads (L1)
    compulsory = float(heads * (queries * (depth + columns) + keys * (depth + columns)) * itemsize)
    wavefronts = float(warps * tiles) * (score_wavefronts + threads * columns_per_lane)
    return Workload(
        blocks=blocks, threads=threads * rows_per_block,
        registers={"addressing": 24, "partial output": columns_per_lane, "statistics": 4, "score": 8},
        smem_bytes=4 * threads * rows_per_block, flops=2.0 * heads * queries * keys * (depth + columns),
        fma_ops=fma_ops, special_ops=special, dram_bytes=compulsory, l2_bytes=l2 + compulsory,
        global_wavefronts=wavefronts, instructions=fma_ops * 1.5 / 32, bytes_in_flight=float(depth * itemsize),
        ilp=1.0, chain_cycles=chain,
        notes=[f"{tiles} key tiles of {threads} per block, {columns_per_lane} output column(s) per lane, "
               f"{score_wavefronts:.0f} L1 wavefronts per warp for a tile's scores"])


__all__ = ["AttentionLaunch", "BLOCK_COST", "EFFICIENCY", "FIXED_TILES", "GUARD_SHARE", "SOFTMAX_INSTRUCTIONS",
           "TILE_US", "Tiling", "attention_workload", "block_cost", "block_cost_entry", "formula_cost", "head_dim_class", "simt_workload"]
