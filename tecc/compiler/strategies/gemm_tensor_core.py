"""gemm_tensor_core: float16/bfloat16 contractions on tensor cores through the tensor-core primitives;
gemm_tensor_core_tf32: float32 ones rounded to tf32, only when the build allows TF32.

The TF32 variant (`GemmTensorCoreTF32`, end of the file) is this strategy with the `Precision`
TF32: mma.m16n8k8, 4-byte elements, k tiles of 16 or 32 floats, the dense TF32 peak and 32-bit
fragment loads; its guard also needs `target.allow_tf32` (`build(..., allow_tf32=True)`), so a
float32 contraction is never put on tensor cores silently (docs/tensor-cores.md, "TF32").

Serves C[b.., i, j] = epilogue(Σ_k A · B) with A, B float16 or bfloat16 (the same dtype) on
sm_80 and later, and every contraction that is such a GEMM once its axes are grouped (an
implicit GEMM: a convolution written as a tensor expression, docs/conv.md): the rows are the
output axes that index only the first operand, the columns those that index only the second, K
all reduction axes (`gemm_view`, mirroring tecc/passes/schedule/implicit_gemm.py, which makes the
final decision when the step is applied: a point it refuses is passed over). A stage where no
output axis indexes only one operand (a depthwise convolution) is declined: a memory-bound
stencil, left to the SIMT strategies. `apply` is the list of primitives (docs/schedule.md,
"The tensor-core primitives"): `tensorize(stage, block, warps, k_tile)` (mma.m16n8k16 with
float32 accumulators, ldmatrix), `stage_operand` of each operand (cp.async into swizzled shared
tiles), `pipeline(k_tile, stages)` (the cp.async ring), and `pipeline_fragments` / `epilogue(stage,
"staged")` for the points that ask for them.

Point: block tile BM × BN ∈ {64, 128, 256}², a warp grid of 4 or 8 warps whose warp tile is
32..64 × 32..64, k-tile BK ∈ {32, 64}, stages ∈ {2, 3, 4}, the mainloop plain (its
fragments pipelined across k steps and k tiles, `pipeline_fragments`, only with `offer_pipelined`:
measured slower at the points taken), "split" S (split-K, offered and priced by gemm_split.py where
the output has few tiles), with stages · (BM + BN) · BK · 2 bytes of shared ring within the
target's opt-in limit: over 48 KiB the emitter declares the
ring as dynamic shared memory (codegen `dynamic_shared_bytes`) and the runtime opts the kernel
in at load (runtime/cuda.py), so the Workload says `smem_opt_in`.

Workload for the cost model:
- tensor: the padded tile FLOPs (every block computes its whole BM × BN × ceil(K/16)·16) at the
  rate mma.sync reaches on the target (MMA_SYNC_FRACTION of the dense tensor peak for the dtype);
- global: A is read once per column tile, B once per row tile (l2 bytes); DRAM the panels each
  wave of resident blocks spans (`wave_dram_bytes`: L2 serves the re-reads inside a wave);
  16-byte copies, S - 1 tiles in flight per thread;
- shared: per k16 step a warp issues TM + TN/2 ldmatrix.x4 (4 conflict-free wavefronts each) and
  the block writes its tiles once per k-tile;
- chain (`sm_chain`: one SM's round of resident blocks): per k tile each block's mma on its
  schedulers (or its shared-pipe wavefronts when more), then a stall for its barrier and the
  refill plus the global latency its S - 1 stages ahead do not cover; the tensor pipe idles
  only while every resident block stalls at once; the pipelined mainloop hides the ldmatrix
  refill part of that stall (PIPELINED_COVER_CYCLES, assumed). This is where two blocks of 4 warps beat one
  of 8 with the same warp tiles (measured 0.51 vs 0.43 of cuBLAS at 4096³), where the ring
  depth pays, and where 64 × 64 warp tiles (one ldmatrix wavefront per mma) beat 32 × 32 (two);
- registers: TM·TN·4 accumulators, TM·4 + TN·2 fragment registers, the k-invariant shared addresses, addressing and the copy
  loop's state (ADDRESSING + 4 per cp.async copy per thread per stage; ptxas's count was at or
  below this for every point compiled in tests/test_tensorize.py), plus two registers per element
  an operand without cp.async copies (odd K) stages through registers; over 255 is rejected;
- an implicit GEMM's gathered addresses: about 4 issued instructions (a div/mod pair by a
  constant) per reduction axis beyond one, per copy or element load and k tile (the row and
  column parts are k-invariant: GemmView.gathered).
- the pipelined mainloop: two fragment sets, and 23 + 3 per copy of addressing in place of
  24 + 4 (fitted to ptxas, tile_registers).
- an operand with run-time strides (strides="any"): priced as its copy loop (a slice of a wider
  tensor, what users pass), the kernel's transposed-view copy loop (w.t()) and element loop for
  other strides named in a note (`GemmView.launch_tested`, `GemmView.transposed_copies`,
  `run_time_stride_note`; docs/tensor-cores.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Any, Iterable

from ...ir.dtype import int32
from ...ir.expr import Const
from ...ir.target import Target
from ...passes.schedule.implicit_gemm import contiguous_copy, gemm_order, layout_of, run_time_stride
from ...passes.schedule.tile_kernel import GROUP_M
from ..cost.analysis import Access, KernelInfo
from ..cost.model import Workload
from ..cost.occupancy import occupancy
from ..cost.traffic import compulsory_bytes
from .gemm_split import (
    mma_split_registers,
    split_handover_cycles,
    split_label,
    split_note,
    split_of,
    split_parts,
    split_traffic,
)
from .registry import Point, Strategy, register

BLOCKS = (64, 128, 256)
WARP_GRIDS = ((2, 2), (1, 4), (4, 1), (2, 4), (4, 2))  # 4 or 8 warps
WARP_TILE = (32, 64)                                    # min, max of a warp's rows and columns
BKS = (32, 64)
STAGES = (2, 3, 4)
ADDRESSING = 24
PIPELINED_ADDRESSING = 23   # tile_registers with two fragment sets (pipeline_fragments)
# mma.sync's share of the dense tensor-core peak of the target's table: on sm_90 the peak is
# wgmma's; mma.sync issued from 4 schedulers reaches about 0.6 of it (CUTLASS's sm_80-style
# kernels on H100). On sm_8x mma.sync is the peak instruction. Assumed, not fitted here.
MMA_SYNC_FRACTION = {80: 0.9, 86: 0.9, 89: 0.9, 90: 0.6}
# Fitted to the 141 points (81 + 60) of benchmarks/tensor_core_points.py at 4096^3 and 2048^3 on
# an H200 (benchmarks/results/tensor_core_points_*_h200.json; RESULTS.md, "Tensor cores, third
# pass"): the model picks the fastest point at 4096^3 and one within 1% at 2048^3; rank
# correlation over all points 0.80 and 0.45 with ptxas's registers, 0.48 and 0.18 with
# tile_registers' estimate (what the planner has); predicted / measured 1.01 at 4096^3, 0.76 at 2048^3.
SYNC_CYCLES = 400.0             # a block's stall per k tile: its barrier and the ldmatrix pipeline refill
# The pipelined mainloop (pipeline_fragments) issues the next tile's first ldmatrix right
# after the barrier and the last k step's mma (on fragments loaded before it) next, so the refill
# part of SYNC_CYCLES -- a warp's first mma of a tile waiting on its ldmatrix -- is covered by up to
# one k step of the block's mma per scheduler; the barrier's own wait for the slowest warp stays.
# Half of SYNC_CYCLES is assumed to be the refill. Measured on the H200 (benchmarks/tensor_core_points.py
# --pipeline, fp16 4096^3 / 8192^3): the form gains only where few warps share an SM (128x256 of 8
# warps, 1 block/SM: 400 -> 361 us; 64x128: 413 -> 398 us) and loses at the best point, two blocks
# of 4 warps (343 -> 355 us; 3 stages 358 -> 347), so the planner does not offer it
# (GemmTensorCore.offer_pipelined); a plan names it (tensorize(..., fragment_pipeline=True)).
PIPELINED_COVER_CYCLES = 200.0
LOADED_LATENCY_CYCLES = 1100.0  # a stage's global load under a full GPU's traffic
SMEM_WEIGHT = 1.5               # shared-pipe cycles per wavefront of ldmatrix / cp.async writes under mma
MMA_FLOPS = 2 * 16 * 8 * 16     # one m16n8k16
LDMATRIX_WAVEFRONTS = 4     # an x4 reads four 8 x 8 matrices, one wavefront each when conflict-free


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def sm_chain(target: Target, rate: float, point: Point, blocks: int, k_tiles: int,
             registers: int, precision: "Precision | None" = None, extra_smem: int = 0) -> tuple[float, int, float]:
    """Cycles one SM spends on one round of its resident blocks (their k loops side by side), the
    resident blocks, and the fraction of a k tile the tensor pipe idles.

    Per k tile a block's warps issue their mma (on each scheduler: the block's warps there times
    TM·TN·BK/16 mma at the scheduler's share of `rate`) or, when more, the shared pipe's ldmatrix
    and stage writes (SMEM_WEIGHT cycles a wavefront); then the block stalls for its barrier and
    the ring's refill (SYNC_CYCLES), plus what of a stage's loaded global latency the S - 1 stages
    ahead do not cover. The pipe idles only while every resident block stalls at once: with r
    blocks and a stall of fraction f of each block's k tile, about f^r of the time. With the
    fragments pipelined (point["fragment_pipeline"]) one k step of the block's mma covers the
    ldmatrix refill part of that stall (PIPELINED_COVER_CYCLES).
    `precision`: the operands' (HALF unless given); `extra_smem`: shared bytes beyond the ring
    (a staged output tile)."""
    p = precision or HALF
    bm, bn, bk, stages = (int(point[x]) for x in ("bm", "bn", "bk", "stages"))
    wm, wn = int(point["warps_m"]), int(point["warps_n"])
    tm, tn = bm // wm // 16, bn // wn // 8
    alloc = max(8, -(-registers // 8) * 8)
    occ = occupancy(target, 32 * wm * wn, alloc, shared_bytes(point, p.operand_bytes) + extra_smem)
    resident = max(1, min(occ.blocks_per_sm, _ceil(blocks, target.sm_count)))
    per_clock = rate / target.sm_count / target.clock_hz / target.schedulers_per_sm
    mma_cycles = p.mma_flops / max(per_clock, 1e-9)
    warps_per_scheduler = max(1.0, wm * wn / target.schedulers_per_sm)
    steps = bk // p.k_step
    mma = warps_per_scheduler * tm * tn * steps * mma_cycles
    wavefronts = (p.fragment_wavefronts(tm, tn) * steps * wm * wn
                  + (bm + bn) * bk * p.operand_bytes / 128)
    tile = max(mma, wavefronts * SMEM_WEIGHT)
    # the loaded latency varies from stage to stage: the share a ring of S - 1 stages ahead leaves
    # exposed falls off smoothly with the mma time they cover (a hard max(0, ...) tied 3 and 4
    # stages, which measure 381 and 363 us at 4096^3)
    sync = SYNC_CYCLES
    if point.get("fragment_pipeline"):
        sync = SYNC_CYCLES - min(PIPELINED_COVER_CYCLES, mma / steps)
    stall = sync + LOADED_LATENCY_CYCLES * math.exp(-(stages - 1) * tile * resident / LOADED_LATENCY_CYCLES)
    idle = (stall / (tile + stall)) ** resident
    return k_tiles * resident * tile / (1.0 - idle), resident, idle


def wave_dram_bytes(info: KernelInfo, target: Target, point: Point, batch: int, resident: int, l2: float) -> float:
    """DRAM bytes: each wave of resident blocks (blockIdx.x over column tiles fastest; a
    persistent grid's tiles in the grouped order of GROUP_M row tiles) reads the A panels of the
    row tiles and the B panels of the column tiles it spans once; L2 serves the other blocks of
    the wave. At least the compulsory bytes, at most every block's panels.

    An implicit GEMM's panel is a gathered view of a smaller tensor: a 3x3 convolution's A panel
    of BM rows and K = 9·C columns reads about BM·C distinct input elements (each tap re-reads
    its neighbours' pixels, from L2). So a panel costs DRAM its operand's real bytes per view
    byte (`gather_ratio`: 1/9 for a 3x3 stride-1 convolution's activations, 1 for a GEMM or a
    1x1 convolution); counting the view's bytes made every 3x3 layer DRAM-bound at about 9x
    its input and tied the points of both tensor-core strategies there.

    An operand that fits in the usable half of L2 (traffic.dram_from_l2's share) stays there
    from one wave to the next: DRAM reads it once. Counted per wave, a 1x1 convolution's 32 KB
    of filters made the DRAM term of a tiling with one more wave 32 KB larger, and that 0.05%
    decided the plan between two points at the same DRAM bound, which the rank's tie-break (the
    shorter chain) should decide."""
    bm, bn = int(point["bm"]), int(point["bn"])
    view = gemm_view(info)
    assert not isinstance(view, str)
    m, n, k = view.m, view.n, view.k
    row_tiles, col_tiles = _ceil(m, bm), _ceil(n, bn)
    wave = target.sm_count * resident
    blocks = batch * row_tiles * col_tiles
    waves = _ceil(blocks, wave)
    rows = min(row_tiles * batch, _ceil(min(wave, blocks), col_tiles))
    cols = min(col_tiles, wave)
    if point.get("persistent") and rows < min(GROUP_M, row_tiles):
        # the persistent grid's grouped order: a wave spans GROUP_M row tiles and the column
        # tiles the wave covers over them (GPT-2's lm head, 64 x 197 tiles: B's 77 MB read 8
        # times, not once per row tile)
        rows = min(GROUP_M, row_tiles)
        cols = min(col_tiles, _ceil(min(wave, blocks), rows))
    streamed = 0.0
    for operand, panels, elements in ((view.a, rows * bm, m * k * batch), (view.b, cols * bn, k * n * batch)):
        per_operand = waves * 2.0 * k * panels * gather_ratio(operand, elements)
        whole = float(operand.itemsize * math.prod(operand.dims)) if operand.dims else per_operand
        streamed += min(per_operand, whole) if whole <= 0.5 * target.l2_bytes else per_operand
    out = float(m * n * batch * info.write.itemsize)
    return min(l2, max(compulsory_bytes(info), streamed + out))


def gather_ratio(operand: Access, view_elements: int) -> float:
    """The operand tensor's elements per element of its GEMM view (at most 1): what of a view
    panel's bytes come from DRAM (wave_dram_bytes)."""
    real = 1
    for d in operand.dims:
        real *= d
    if not operand.dims or view_elements <= 0:
        return 1.0
    return min(1.0, real / view_elements)


def ring_deeper_than_the_k_loop(stages: int, k_tiles: int) -> bool:
    """Whether a cp.async ring of `stages` (S - 1 k tiles loaded ahead) is deeper than a k loop
    of `k_tiles` needs: one stage fewer already loads every k tile ahead. Such a point costs only
    shared memory, hence resident blocks (resnet50's 1 x 1 convolutions over 64 channels, one k
    tile, took 4 stages: 128 KiB per block). gemm_wgmma's `deeper_than_the_k_loop` is its ring's."""
    return stages > 2 and stages - 2 >= k_tiles


def shared_bytes(point: Point, operand_bytes: int = 2) -> int:
    return int(point["stages"]) * (int(point["bm"]) + int(point["bn"])) * int(point["bk"]) * operand_bytes


@dataclass(frozen=True)
class Precision:
    """What the operands' dtype changes in the plan and the workload: the mma row (k per
    instruction), the peak of the target's table it runs at, bytes per element, the k tiles,
    and the fragment loads per k step of a warp with TM x TN mma tiles."""

    operand_bytes: int
    k_step: int
    rate_key: str          # the key of Target.tensor_flops
    intrinsic: str         # what the plan's tensorize step names ("auto": the row of the dtype)
    bks: tuple[int, ...]
    ldmatrix: bool         # fragments through ldmatrix.x4 (else one 32-bit shared load per element)

    @property
    def mma_flops(self) -> int:
        return 2 * 16 * 8 * self.k_step

    def fragment_loads(self, tm: int, tn: int) -> float:
        """Load instructions a warp issues per k step (tf32: as if every fragment took 32-bit loads;
        k-contiguous tiles take fewer, ldmatrix.x4 of b16 pairs)."""
        return tm + tn / 2 if self.ldmatrix else tm * 4 + tn * 2

    def fragment_wavefronts(self, tm: int, tn: int) -> float:
        """Shared wavefronts of those loads (conflict-free: 4 per x4, 1 per 32-bit load)."""
        return (tm + tn / 2) * LDMATRIX_WAVEFRONTS if self.ldmatrix else tm * 4 + tn * 2


HALF = Precision(2, 16, "float16", "auto", BKS, True)
# TF32: mma.m16n8k8, float32 tiles (k tiles of 16 or 32 floats: the same bytes per row as 32 and
# 64 halves), the dense TF32 peak of the target's table (half the 16-bit one on sm_80 and sm_90).
TF32 = Precision(4, 8, "tf32", "mma.m16n8k8.f32.tf32", (16, 32), False)


def tile_registers(bm: int, bn: int, wm: int, wn: int, bk: int, sizes: tuple[int, int] = (8, 8),
                   tf32: bool = False, pipelined: bool = False) -> dict[str, int]:
    """Registers per thread; `sizes`: elements per cp.async copy of A and B (0: the operand's
    elements are loaded through registers, two registers each); `tf32`: float32 tiles read by
    32-bit fragment loads (k steps of 8); `pipelined`: two fragment sets (pipeline_fragments)."""
    tm, tn = bm // wm // 16, bn // wn // 8
    threads = 32 * wm * wn
    copies = staged = 0
    for tile, size in ((bm * bk, sizes[0]), (bn * bk, sizes[1])):
        if size:
            copies += tile // size // threads
        else:
            staged += tile // threads
    parts = {"accumulators": tm * tn * 4, "fragments": tm * 4 + tn * 2, "addressing": ADDRESSING + 4 * copies}
    if pipelined:
        # two fragment sets, both live while the last k step's mma read one and the next tile's
        # first loads fill the other; ptxas then keeps fewer copy addresses live than in the
        # plain loop: PIPELINED_ADDRESSING + 3 per copy is at or above its count on the 12
        # pipelined 4096^3 points of tests/test_fragment_pipeline.py's fit and of 128x256 (sm_80 and sm_90,
        # 0-5 registers above on 5 of them), where the plain form's 4 per copy put the 128x128 point
        # of 64x64 warp tiles (ptxas: 250) over 255
        parts["fragments"] *= 2
        parts["addressing"] = PIPELINED_ADDRESSING + 3 * copies
    # the swizzled shared addresses of the ldmatrix of every k-step (A: one x4 per 16 rows, B: one
    # x4.trans per 16 columns) and of the staged stores, which no longer change with the k-tile
    # (codegen keeps the ring's stage outside the XOR) and so live across it: ptxas kept 2-10 more
    # registers than the parts above on the tested points, 14-16 more with staged elements
    parts["shared addresses"] = (tm + _ceil(tn, 2)) * (bk // 16) + staged // 2
    if staged:
        # the element and its guarded address: ptxas used 1.3-1.5 per element on the odd-K points
        parts["staged elements"] = 2 * staged
    if tf32:
        # the 32-bit fragment loads' swizzled addresses, invariant in the k loop: the XOR changes
        # with each k8 step and 16-byte chunk (k-contiguous tiles) or 32-byte group (k-major ones).
        # About one per A tile and per two B tiles per k8 step keeps the estimate at or above
        # ptxas's count on 16 of 18 points (9 tilings x 2 operand layouts at 4096^3, sm_90; at
        # most 5 below), and the points ptxas spilled are over 255 or left to the compile check
        parts["tf32 fragment addresses"] = (bk // 8) * (tm + tn // 2)
    return parts


@dataclass(frozen=True)
class GemmView:
    """The stage as a GEMM: batch × (M × K) · (K × N), and the halves per cp.async copy of A and B
    (0: element loads) in the orientation tensorize will choose (implicit_gemm.gemm_order)."""

    a: Access
    b: Access
    batch: int
    m: int
    n: int
    k: int
    copies: tuple[int, int]
    gathered: int = 0   # reduction axes beyond one: each costs a div/mod pair per copy or element per k tile
    k_last: tuple[bool, bool] = (True, True)   # whether A's and B's tiles are k-contiguous
    column_axes: int = 1   # output axes in the N group (one: the output's rows are contiguous runs of N)
    # whether A's and B's copies hold only under a launch-time test of their run-time strides
    # (strides="any"): the kernel then also holds an element-load main loop for other strides
    launch_tested: tuple[bool, bool] = (False, False)
    # elements per copy of A's and B's transposed views (unit stride on another dimension than
    # the innermost: implicit_gemm.transposed_operand), 0 where such a view gets no copies
    transposed_copies: tuple[int, int] = (0, 0)


def run_time_stride_note(view: GemmView, transposes: bool = True, k_major_only: bool = False) -> str | None:
    """What explain says of operands with run-time strides (tensorize's dispatch), or None.
    `transposes`: the kernel has copy loops for transposed views (16-bit operands; tf32's
    fragments have no ldmatrix .trans, fp8 and tf32 wgmma read K-major only). `k_major_only`
    (fp8 wgmma): an operand declared k-outermost is taken in its K-major view
    (tensorize_wgmma.k_major_views)."""
    if k_major_only and not all(view.k_last):
        names = [x.buffer for x, k_last in zip((view.a, view.b), view.k_last) if not k_last]
        return (f"run-time strides of {', '.join(names)} (declared k-outermost): the K-major view's cp.async copies "
                "(priced as the declared layout's) when the k stride is 1 and the others multiples of the copy (w.t()), "
                "tested at launch; other strides take the kernel's element-load main loop")
    tested = [t or bool(c) for t, c in zip(view.launch_tested, view.transposed_copies)]
    names = [x.buffer for x, t in zip((view.a, view.b), tested) if t]
    if not names:
        return None
    flipped = [x.buffer for x, c in zip((view.a, view.b), view.transposed_copies) if c]
    if transposes and flipped:
        return (f"run-time strides of {', '.join(names)}: cp.async copies (priced) when the innermost stride is 1 and "
                "the others multiples of the copy (a slice of a wider row-major array), transposed-view cp.async "
                f"copies of {', '.join(flipped)} when the unit stride is the other dimension's (w.t(): the tile stored "
                "in the other orientation in the same shared memory, read with the other ldmatrix or wgmma "
                "major-ness), tested at launch; other strides (odd row strides, a reversed innermost dimension) "
                "take the kernel's element-load main loop (slower: each element loaded and stored to shared "
                "memory, its latency exposed per k tile)")
    return (f"run-time strides of {', '.join(names)}: cp.async copies (priced) when the innermost stride is 1 and "
            "the others multiples of the copy (a slice of a wider row-major array), tested at launch; other strides "
            "(a transposed view, odd row strides) take the kernel's element-load main loop (slower: each element "
            "loaded and stored to shared memory, its latency exposed per k tile)")


def copy_sizes(info: KernelInfo) -> tuple[int, int]:
    """Halves per cp.async copy tensorize will use for A and B (8, 4, 2, or 0 for element loads):
    the GEMM view's (implicit_gemm.gemm_order)."""
    view = gemm_view(info)
    assert not isinstance(view, str)
    return view.copies


def gemm_view(info: KernelInfo) -> GemmView | str:
    """The GEMM view of a contraction (module docstring), or why there is none; found once per
    KernelInfo (frozen: every point of the GEMM strategies asks for it, several times)."""
    found: GemmView | str | None = info.__dict__.get("_gemm_view")
    if found is None:
        found = _gemm_view(info)
        object.__setattr__(info, "_gemm_view", found)
    return found


def _gemm_view(info: KernelInfo) -> GemmView | str:
    reduce_vars = {v for v, _ in info.reduction}
    under = [x for x in info.reads if reduce_vars & set().union(*x.index_vars)]
    if len(under) != 2:
        return f"needs two operands read under the reduction, found {len(under)}"
    inner = info.spatial[-1][0]
    reads = [set().union(*x.index_vars) for x in under]
    if inner not in reads[0] and inner not in reads[1]:
        return f"output axis {inner} indexes neither operand"
    # B: the operand the output's innermost axis indexes (alone, or the smaller one when both do)
    a, b = ((under[1], under[0]) if inner in reads[0] and (inner not in reads[1] or len(reads[0]) < len(reads[1]))
            else (under[0], under[1]))
    in_a, in_b = set().union(*a.index_vars), set().union(*b.index_vars)
    # an axis a read only through a non-affine index (f // group of a grouped convolution's
    # activations) that indexes B plainly is a column axis split by groups (tensorize splits it)
    plain_a = set().union(*(vs for vs, d in zip(a.index_vars, a.per_dim or (None,) * len(a.index_vars))
                            if d is not None))
    extents = dict(info.spatial) | dict(info.reduction)
    batch, rows, cols = 1, [], []
    for v, e in info.spatial:
        if v in in_a and v in in_b and v in plain_a:
            batch *= e
        elif v in in_a and v not in in_b:
            rows.append(v)
        elif v in in_b:
            cols.append(v)
        else:
            return f"output axis {v} indexes neither operand"
    if any(v not in in_a or v not in in_b for v in reduce_vars):
        return "every reduction axis must index both operands"
    if not rows or not cols:
        return ("no output axis indexes only " + ("the first" if not rows else "the second") + " operand: a batched "
                "dot product or stencil (a depthwise convolution is one), memory-bound; the SIMT strategies serve it")
    layouts = []
    element_bytes = 4 if a.dtype == "float32" else 2
    for x in (a, b):
        if x.per_dim and all(d is not None for d in x.per_dim):
            # strides="any": laid out as the fast kernel assumes them (implicit_gemm.assumed_strides)
            strides = ([run_time_stride(d == len(x.dims) - 1, element_bytes) for d in range(len(x.dims))]
                       if x.buffer in info.strided_inputs else None)
            layouts.append(layout_of([(dict(d.coeff), d.const) for d in x.per_dim if d is not None], list(x.dims),
                                     dim_strides=strides))
        else:
            layouts.append(layout_of([], []))  # no copy provable
    rows_o, cols_o, ks_o, a_k_last, b_k_last, a_copy, b_copy = gemm_order(
        rows, cols, [v for v, _ in info.reduction], layouts[0], layouts[1], {v: int(e) for v, e in extents.items()},
        element_bytes)
    flipped = []
    for x, outer, k_last in ((a, rows_o, a_k_last), (b, cols_o, b_k_last)):
        # the transposed view's copies (implicit_gemm.transposed_operand): the unit stride on
        # another dimension, copies along the group the first orientation does not copy along
        copy = 0
        if x.buffer in info.strided_inputs and x.per_dim and all(d is not None for d in x.per_dim):
            group = [(v, int(extents[v])) for v in (outer if k_last else ks_o)]
            for unit in range(len(x.dims) - 1):
                strides = [run_time_stride(d == unit, element_bytes) for d in range(len(x.dims))]
                lay = layout_of([(dict(d.coeff), d.const) for d in x.per_dim if d is not None], list(x.dims),
                                dim_strides=strides)
                copy = contiguous_copy(lay, group, element_bytes)
                if copy:
                    break
        flipped.append(copy)
    m = n = 1
    for v in rows:
        m *= extents[v]
    for v in cols:
        n *= extents[v]
    # the row and column parts of a gathered address do not change with the k tile (ptxas keeps
    # them in registers); the reduction axes are unflattened anew for every k tile
    gathered = len(info.reduction) - 1
    tested = (a.buffer in info.strided_inputs and a_copy > 0, b.buffer in info.strided_inputs and b_copy > 0)
    return GemmView(a, b, batch, m, n, info.reduce_extent, (a_copy, b_copy), gathered, (a_k_last, b_k_last),
                    len(cols), tested, (flipped[0], flipped[1]))


# ---- the epilogue's stores (tensorize step 6) ----------------------------------------------------
# In registers, a warp's store instruction writes two adjacent columns per lane (output_pair) of 8
# rows: 8 x 4 lanes x 2 elements, so each 128-byte line it touches gets 8 · itemsize useful bytes
# and a 32-byte sector at most that (half a sector for 16-bit outputs: L2 sees every sector
# written twice, DRAM write-back after both halves merged). Staged through shared memory
# (`staged_output`), each lane stores 16 contiguous bytes and a warp whole lines.
STAGED_OUTPUT_PAD_BYTES = 16


def output_stageable(info: KernelInfo, view: GemmView) -> bool:
    """Whether the staged epilogue can take this contraction's output (epilogue "staged"): one column
    axis, the output's innermost (copied out in 16-byte chunks where its extent is a whole number
    of them, else element by element: epilogue.copy_chunk)."""
    last = info.write.per_dim[-1] if info.write.per_dim else None
    inner = info.spatial[-1][0]
    return (view.column_axes == 1 and last is not None
            and dict(last.coeff) == {inner: 1} and info.write.itemsize in (2, 4))


# A staged output is offered where the block's output tile is at least this share of the bytes
# its k loop loads (a 1x1 convolution over 64 channels: 2/3; a 2048^3 GEMM's 128x128 tile: 1/32,
# where the two forms differ by less than the model resolves and only double the search).
STAGED_OUTPUT_MIN_SHARE = 1.0 / 8.0


def worth_staging(bm: int, bn: int, k: int, operand_bytes: int, itemsize: int, n: int = 0) -> bool:
    """Whether a BM x BN block's output is a large enough share of its traffic to offer staging,
    or its rows of `n` elements are not 16-byte multiples: the register epilogue then stores
    single elements of 8 rows per warp instruction (no column pairs), staging whole row runs."""
    if n and (n * itemsize) % 16:
        return True
    return bm * bn * itemsize >= STAGED_OUTPUT_MIN_SHARE * (bm + bn) * max(k, 1) * operand_bytes


def staged_output_bytes(point: Point, itemsize: int) -> int:
    """The shared tile of a staged output: BM rows of BN elements plus the 16-byte pad."""
    if not point.get("staged_output"):
        return 0
    return int(point["bm"]) * (int(point["bn"]) * itemsize + STAGED_OUTPUT_PAD_BYTES)


def output_traffic(out_bytes: float, itemsize: int, staged: bool, paired: bool = True) -> tuple[float, float, float]:
    """(L2 bytes requested, L1 global wavefronts, shared wavefronts) of writing `out_bytes` of
    output (the comment above): staged, whole lines plus a shared write and read of each byte;
    in registers, 8 · itemsize useful bytes per line and per 32-byte sector at most (4 · itemsize
    where the columns are not stored in pairs: an odd row length)."""
    if staged:
        return out_bytes, out_bytes / 128.0, 2.0 * out_bytes / 128.0
    useful = (8.0 if paired else 4.0) * itemsize
    return out_bytes * max(1.0, 32.0 / useful), out_bytes / useful, 0.0


def mma_view(info: KernelInfo, target: Target, instruction: str) -> Any:
    """The GEMM view of a contraction an mma.sync strategy may take on `target`, or why not (the
    part of the guard both precisions share; `instruction` names the mma the reason cites)."""
    if info.kind != "contraction":
        return f"not a contraction (kind {info.kind})"
    if target.sm < 80:
        return f"{target.arch} has no {instruction} (needs sm_80 or later)"
    if len(info.spatial) < 2 or not info.reduction:
        return "needs at least two spatial axes and a reduction axis"
    return gemm_view(info)


class GemmTensorCore(Strategy):
    name = "gemm_tensor_core"
    description = "half-precision contraction: mma.m16n8k16, cp.async ring, swizzled ldmatrix, fused epilogue"
    priority = 3
    compile_checked = True  # 200+ registers per thread: a point ptxas spills is passed over
    # the pipelined mainloop is a plan knob, not a point of the space: measured slower at the points
    # the planner takes (PIPELINED_COVER_CYCLES says where it gains); True puts both forms in the space
    offer_pipelined = False
    precision = HALF

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        view = mma_view(info, target, "mma.m16n8k16 with float32 accumulators")
        if isinstance(view, str):
            return view
        pair = (view.a, view.b)
        if any(x.dtype not in ("float16", "bfloat16") for x in pair):
            return "float16 or bfloat16 operands only"
        if pair[0].dtype != pair[1].dtype:
            return f"mixed operand dtypes ({pair[0].dtype}, {pair[1].dtype}): mma takes two of one 16-bit type"
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        view = gemm_view(info)
        assert not isinstance(view, str)
        m, n = view.m, view.n
        stageable, itemsize = output_stageable(info, view), info.write.itemsize
        for bm, bn, (wm, wn), bk, stages in product(BLOCKS, BLOCKS, WARP_GRIDS, self.precision.bks, STAGES):
            if (bm >= 2 * m and bm > BLOCKS[0]) or (bn >= 2 * n and bn > BLOCKS[0]):
                continue  # a tile twice the matrix leaves half its warps idle
            if not (WARP_TILE[0] <= bm // wm <= WARP_TILE[1] and WARP_TILE[0] <= bn // wn <= WARP_TILE[1]):
                continue
            worth = stageable and worth_staging(bm, bn, view.k, self.precision.operand_bytes, itemsize, n)
            pipelines = (False, True) if self.offer_pipelined and (bk // self.precision.k_step) % 2 == 0 else (False,)
            k_tiles = _ceil(max(view.k, 1), bk)
            splits = split_parts(k_tiles, view.batch * _ceil(m, bm) * _ceil(n, bn), target)
            for split, staged, pipelined in product(splits, (False, True) if worth else (False,), pipelines):
                if ring_deeper_than_the_k_loop(stages, _ceil(k_tiles, split)):
                    continue
                point = {"bm": bm, "bn": bn, "warps_m": wm, "warps_n": wn, "bk": bk, "stages": stages}
                if split > 1:
                    point["split"] = split
                if staged:
                    point["staged_output"] = True
                if pipelined:
                    point["fragment_pipeline"] = True
                smem = shared_bytes(point, self.precision.operand_bytes) + staged_output_bytes(point, itemsize)
                if smem > target.smem_per_block_optin:
                    continue
                yield point

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        bm, bn, bk, stages = (int(point[x]) for x in ("bm", "bn", "bk", "stages"))
        wm, wn = int(point["warps_m"]), int(point["warps_n"])
        view = gemm_view(info)
        assert not isinstance(view, str)
        batch, m, n, k = view.batch, view.m, view.n, view.k
        threads = 32 * wm * wn
        tm, tn = bm // wm // 16, bn // wn // 8
        splits = split_of(point)
        row_tiles, col_tiles = _ceil(m, bm), _ceil(n, bn)
        k_tiles = _ceil(_ceil(max(k, 1), bk), splits)    # per block (split-K: per part)
        tiles = batch * row_tiles * col_tiles            # output tiles
        blocks = tiles * splits
        warps = blocks * wm * wn
        p = self.precision
        k16 = k_tiles * bk // p.k_step    # mma k steps (k16, or k8 for tf32)
        a_bytes, b_bytes = p.operand_bytes * m * k * batch, p.operand_bytes * k * n * batch
        out_bytes = float(m * n * batch * info.write.itemsize)
        staged_out = bool(point.get("staged_output"))
        out_l2, out_wavefronts, out_smem = output_traffic(out_bytes, info.write.itemsize, staged_out, n % 2 == 0)
        l2 = a_bytes * col_tiles + b_bytes * row_tiles + out_l2
        sizes = view.copies
        copies = sum(tile // size // threads for tile, size in ((bm * bk, sizes[0]), (bn * bk, sizes[1])) if size)
        staged = sum(tile // threads for tile, size in ((bm * bk, sizes[0]), (bn * bk, sizes[1])) if not size)
        ldmatrix = warps * k16 * p.fragment_loads(tm, tn)
        mma = warps * k16 * tm * tn
        # an implicit GEMM's gathered addresses: a div/mod pair (about 4 instructions with constant
        # divisors) per extra reduction axis per copy or element load
        # tf32: one cvt.rna per fragment register loaded (ptxas keeps one per register, not per mma)
        converts = 0.0 if p.ldmatrix else ldmatrix
        split_l2, split_dram, split_instructions = split_traffic(point, tiles, threads, target)
        instructions = (mma + ldmatrix + converts + blocks * k_tiles * (wm * wn) * ((copies + staged) * (6 + 4 * view.gathered) + 8)
                        + tiles * wm * wn * tm * tn * 4 * (4 + info.epilogue_flops) + split_instructions)
        # float16 and bfloat16 have the same dense peak on every target in the table
        rate = target.tensor_flops.get(p.rate_key, 0.0) * MMA_SYNC_FRACTION.get(target.sm, 0.6)
        # operands with run-time strides: the element-load loop the kernel also holds stores
        # each element to shared memory at once, so the copy loop's registers are the kernel's
        pipelined = bool(point.get("fragment_pipeline"))
        registers = tile_registers(bm, bn, wm, wn, bk, sizes, tf32=not p.ldmatrix, pipelined=pipelined)
        if splits > 1:
            registers["split-K sum"] = mma_split_registers(tm * tn * 4, splits)
        chain, resident, idle = sm_chain(target, rate, point, blocks, k_tiles, sum(registers.values()), p,
                                         staged_output_bytes(point, info.write.itemsize))
        # the sum's loads in flight: what ptxas issues ahead (mma_split_registers, less its 4 others)
        sum_accumulators = tm * tn * 4
        handover, reduce = split_handover_cycles(point, sum_accumulators,
                                                 mma_split_registers(sum_accumulators, splits) - 4)
        chain += reduce   # the last part's sum of the partials, on every round's critical path
        notes = [f"{self.mma_name} {tm}x{tn} tiles per warp, {stages}-stage cp.async ring of {bk}-wide k tiles",
                 self.fragment_note,
                 f"{resident} block(s) per SM share the tensor pipe: idle {idle:.0%} of each k tile "
                 "(all resident blocks at their barrier or waiting for a stage at once)"]
        if staged_out:
            notes.append("output staged in a padded shared tile, stored in 16-byte chunks (whole lines per warp)")
        if splits > 1:
            notes.append(split_note(point, tiles, k_tiles, split_l2, reduce))
        if pipelined:
            notes.append("fragments pipelined: two fragment sets, the next k step's loads before this step's mma, "
                         "the ring's wait and barrier before the last k step (covered by its neighbours' mma)")
        stride_note = run_time_stride_note(view, transposes=p.operand_bytes == 2)
        if stride_note is not None:
            notes.append(stride_note)
        return Workload(
            blocks=blocks, threads=threads, registers=registers,
            smem_bytes=shared_bytes(point, p.operand_bytes) + staged_output_bytes(point, info.write.itemsize),
            smem_opt_in=True,
            flops=2.0 * m * n * k * batch, fma_ops=float(m * n * batch * max(info.epilogue_flops, 0)),
            tensor_flops=2.0 * blocks * bm * bn * k16 * p.k_step, tensor_rate=rate,
            dram_bytes=wave_dram_bytes(info, target, point, batch, resident, l2 - out_l2 + out_bytes) + split_dram,
            l2_bytes=l2 + split_l2, global_wavefronts=(l2 - out_l2 + split_l2) / 128.0 + out_wavefronts,
            smem_wavefronts=(warps * k16 * p.fragment_wavefronts(tm, tn)
                             + blocks * k_tiles * (bm + bn) * bk * p.operand_bytes / 128.0 + out_smem),
            instructions=instructions, bytes_in_flight=p.operand_bytes * (bm + bn) * bk / threads * (stages - 1),
            ilp=float(tm * tn), block_latency_cycles=handover,
            chain_cycles=chain, latency_in_chain=True, k_extent=k_tiles * bk, notes=notes)

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        stage = info.stage
        k_tiles = sch.tensorize(stage, self.precision.intrinsic, block=(int(point["bm"]), int(point["bn"])),
                                warps=(int(point["warps_m"]), int(point["warps_n"])), k_tile=int(point["bk"]))
        for operand in sch.gemm_operands(stage):
            sch.stage_operand(stage, operand)
        sch.pipeline(k_tiles, stages=int(point["stages"]))
        if point.get("fragment_pipeline"):
            sch.pipeline_fragments(k_tiles)
        if split_of(point) > 1:
            sch.split_k(stage, split_of(point))
        if point.get("staged_output"):
            sch.epilogue(stage, "staged")

    def describe(self, point: Point) -> str:
        bm, bn, wm, wn = (int(point[x]) for x in ("bm", "bn", "warps_m", "warps_n"))
        return (f"{self.name}({self.mma_name} f32 accumulators, block {bm}x{bn}, "
                f"{wm}x{wn} warps of {bm // wm}x{bn // wn}, k-tile {point['bk']}, {point['stages']} cp.async stages"
                f"{', output staged in shared memory' if point.get('staged_output') else ''}"
                f"{', fragments pipelined' if point.get('fragment_pipeline') else ''}"
                f"{split_label(point)})")


    mma_name = "mma.m16n8k16"
    fragment_note = "ldmatrix from swizzled shared tiles (conflict-free)"


class GemmTensorCoreTF32(GemmTensorCore):
    """float32 contractions on tensor cores with the operands rounded to tf32, only when the build
    allows it (`build(..., allow_tf32=True)` sets Target.allow_tf32): the same plan step with
    the intrinsic mma.m16n8k8.f32.tf32 named, priced at the target's dense TF32 peak. The SIMT
    float32 strategies (gemm, gemm_pipelined) still serve the stage, and the planner ranks them
    all by predicted time."""

    name = "gemm_tensor_core_tf32"
    description = ("float32 contraction with TF32 allowed: mma.m16n8k8 tf32, cp.async ring, swizzled ldmatrix / "
                   "32-bit fragment loads, fused epilogue")
    precision = TF32
    mma_name = "mma.m16n8k8.tf32"
    fragment_note = ("float32 operands rounded to tf32 (10 mantissa bits, cvt.rna) because the build allows TF32 "
                     "(allow_tf32=True); ldmatrix (k-contiguous tiles) or 32-bit fragment loads (k-major ones) from "
                     "swizzled shared tiles (conflict-free)")

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        view = mma_view(info, target, "mma.m16n8k8 tf32")
        if isinstance(view, str):
            return view
        if any(x.dtype != "float32" for x in (view.a, view.b)):
            return "float32 operands only (16-bit operands: gemm_tensor_core)"
        if not target.allow_tf32:
            return "TF32 is off: float32 contractions use tensor cores only with build(..., allow_tf32=True)"
        return None


register(GemmTensorCore())
register(GemmTensorCoreTF32())
