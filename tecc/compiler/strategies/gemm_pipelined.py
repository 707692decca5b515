"""gemm_pipelined: fp32 contractions with the SGEMM kernel structure (issue 6).

Point: block tile BM × BN (32, 64 or 128 each, at least 32 threads), k-tile BK (8 or 16). Every thread owns an 8 × 8
register tile made of four 4 × 4 quadrants 64/2 apart (rows ty·4 + {0..3} and BM/2 + ty·4 + ...,
same for columns), the layout of CUTLASS's SIMT SGEMM: at one k a thread reads its 8 values of A
and 8 of B as two 16-byte shared loads each (LDS.128), and the lanes of a warp read distinct
consecutive 16-byte words of B's row (conflict-free) and broadcast A's.

Schedule (primitives, recorded in the Plan):
  split i → (block, quadrant 2, thread BM/8, 4), j likewise, k → (k-tile, BK)
  reorder  block, thread, k-tile, k, quadrant_i, 4_i, quadrant_j, 4_j; bind; cache_write C local
  cache_read A and B into shared at the k-tile loop, copied as float4 chunks (vector_copy 4:
    LDG.128 + STS.128); an operand contiguous along k (A, and Bᵀ written as B[j, k]) is stored
    transposed ([k][i], storage_transpose) and padded by 4 words (conflict-free transposed
    stores, rows stay 16-byte aligned), so the compute reads it along i/j
  double_buffer the k-tile loop: tile k+1 is loaded into registers while tile k is computed
  unroll k and the register tile (64 accumulators + 16 fragments stay in registers)
  split-K (point "split" = S > 1, only when the output has < 2 x SMs tiles): split k into S
    parts of whole k-tiles, rfactor the part loop (partials C_rf[s, i, j] + a combine kernel,
    tecc/passes/schedule/rfactor.py) and bind it to blockIdx.z like a batch axis

The workload is `gemm`'s for the same tiles (the cost model's helpers), corrected for what this
template changes: 4× fewer copy instructions (16-byte chunks), conflict-free shared reads, and the
global latency of a k-tile overlapped with its compute.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Any, Iterable

from ...ir.errors import ScheduleError
from ...ir.target import Target
from ..cost.analysis import KernelInfo
from ..cost.model import Workload
from ..cost.traffic import buffer_bytes
from ..cost.warp import shared_wavefronts
from ..cost.analysis import Access, Affine
from .gemm import Gemm, operands
from .registry import Point, Strategy, register

BLOCKS = (32, 64, 128)  # 32 only with a 128 partner or 64: at least a warp of 8 x 8 thread tiles
MIN_THREADS = 32
SPLITS = (1, 2, 3, 4, 6, 8, 16)  # split-K parts (rfactor of the k loop onto blockIdx.z)
MIN_SPLIT_TILES = 4  # a split keeps at least this many k-tiles (the pipeline's prologue is one of them)
COMBINE_THREADS = 256
BKS = (8, 16)  # k-tile 32 with 128x128 needs 32 prefetch registers: 1 block/SM, measured 0.70 of cuBLAS
QUADRANT = 4  # a thread's register tile is 2 × 2 quadrants of QUADRANT × QUADRANT
# Registers per thread of the kernel (the partial kernel with split-K) as ptxas (NVRTC, sm_90)
# allocates them, per (BM, BN, BK): (no edge, edge-guarded). "Edge-guarded": M or N not a
# multiple of the block tile, or a k tail (K not a multiple of BK; with split-K a last part
# shorter than the others). ptxas squeezes several clean tiles to 127-128 registers (4 blocks of
# 4 warps / 2 of 8 per SM) and cannot once the guards are in: 64x128 and 128x64 at k-tile 16 go
# from 128 to 139, one block per SM fewer. The sum of parts the `gemm` strategy uses (64 + 16
# + 22 + copy values) was 9% low in the median and put 30% of the points on the wrong side of
# 128. Fitted on 1024^3, 2048^3 and 127x4096x1023 (clean values: the median of the
# unguarded points; guarded: of the guarded ones); checked on 1000^3 (M, N and k edges at once),
# 4096^3, 8192^3, 4096x1024x4096, 8192x64x8192 and batched 32x512^3 (docs/cost-model.md, "Registers of gemm_pipelined").
PTXAS_REGISTERS = {
    (32, 64, 8): (130, 139), (32, 64, 16): (167, 167), (32, 128, 8): (127, 136), (32, 128, 16): (155, 162),
    (64, 32, 8): (141, 139), (64, 32, 16): (161, 165), (64, 64, 8): (128, 130), (64, 64, 16): (135, 130),
    (64, 128, 8): (127, 128), (64, 128, 16): (128, 139), (128, 32, 8): (135, 129), (128, 32, 16): (159, 157),
    (128, 64, 8): (127, 128), (128, 64, 16): (128, 139), (128, 128, 8): (124, 127), (128, 128, 16): (127, 127),
}


def pipelined_registers(bm: int, bn: int, bk: int, guarded: bool) -> dict[str, int]:
    """Registers per thread by part: the accumulator tile, the fragments and the prefetch
    registers of the next tile are counted; the rest (addresses, loop state, guards) is what
    ptxas's count (PTXAS_REGISTERS) leaves."""
    copy = bk * (bm + bn) * 64 // (bm * bn)
    total = PTXAS_REGISTERS[(bm, bn, bk)][1 if guarded else 0]
    parts = {"accumulators": 64, "fragments": 16, "copy": copy}
    parts["addressing and guards" if guarded else "addressing"] = total - sum(parts.values())
    return parts


def split_chunk(k: int, bk: int, split: int) -> int:
    """The k extent of one of `split` parts: whole k-tiles, so only the last part can need the
    k-tail guard (the zero-filled shared tiles make its extra steps add 0)."""
    return -(-(-(-k // bk)) // split) * bk


def _batch_leads(info: KernelInfo) -> bool:
    """True when the batch axis (the first spatial one) indexes dimension 0 of A, B and C and
    nothing else, so that one batch element is one ordinary GEMM. The epilogue's reads (a
    `bias[j]`, a `scale[b]`: read once per output by the store, not under the reduction) may
    index the batch axis anywhere or not at all: they broadcast, and the store reads them at
    the output's own indices."""
    b = info.spatial[0][0]
    pair = operands(info)
    if pair is None:
        return False
    for x in pair + (info.write,):
        if len(x.index_vars) != 3 or x.index_vars[0] != frozenset({b}):
            return False
        if any(b in v for v in x.index_vars[1:]):
            return False
    return True


def _one_matrix(info: KernelInfo) -> KernelInfo:
    """`info` of a batched GEMM seen as one of its matrices: the batch axis dropped, and with it
    every dimension it alone indexes (dimension 0 of A, B and C; an epilogue read's `b`)."""
    b = info.spatial[0][0]

    def one(x: Access) -> Access:
        offset = (None if x.offset is None
                  else Affine(tuple((v, c) for v, c in x.offset.coeff if v != b), x.offset.const))
        keep = [d for d, vs in enumerate(x.index_vars) if vs != frozenset({b})]
        return replace(x, offset=offset, index_vars=tuple(x.index_vars[d] for d in keep),
                       per_dim=tuple(x.per_dim[d] for d in keep) if x.per_dim else x.per_dim,
                       dims=tuple(x.dims[d] for d in keep) if x.dims else x.dims)

    return replace(info, spatial=info.spatial[1:], reads=tuple(one(x) for x in info.reads), write=one(info.write))


def _broadcast_bytes(info: KernelInfo) -> float:
    """Bytes of the reads the batch axis does not index (an epilogue's `bias[j]`): one batch
    element's workload counts them once, and the batch shares them (DRAM reads them once)."""
    b = info.spatial[0][0]
    seen = {x.buffer: buffer_bytes(x) for x in info.reads if not any(b in vs for vs in x.index_vars)}
    return float(sum(seen.values()))


def _k_contiguous(info: KernelInfo, which: int) -> bool:
    """True when operand `which` (0: A, 1: B) is contiguous along the reduction axis."""
    pair = operands(info)
    assert pair is not None
    x = pair[which]
    kv = info.reduction[0][0]
    return x.offset is not None and abs(x.offset.get(kv)) == 1


class GemmPipelined(Strategy):
    name = "gemm_pipelined"
    description = "SGEMM: 8x8 thread tiles in quadrants, float4 copies, transposed A tile, register double buffer"
    priority = 2

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if info.kind != "contraction":
            return f"not a contraction (kind {info.kind})"
        if len(info.spatial) not in (2, 3) or len(info.reduction) != 1:
            return "needs two spatial axes (three with a leading batch axis) and one reduction axis"
        if operands(info) is None:
            return "needs one read indexed by (i, k) and one by (k, j)"
        if any(x.itemsize != 4 for x in operands(info) or ()):
            return "float32 operands only (16-bit operands: gemm_tensor_core)"
        if len(info.spatial) == 3 and not _batch_leads(info):
            return "a batch axis must index only the leading dimension of A, B and the output"
        (_, m), (_, n) = info.spatial[-2:]
        if m < 32 or n < 32:
            return "needs M and N of at least 32 (one 32-wide block tile)"
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        (_, m), (_, n) = info.spatial[-2:]
        k = info.reduction[0][1]
        for bm, bn, bk in product(BLOCKS, BLOCKS, BKS):
            # a tile twice the matrix's extent leaves half its lanes idle (N = 64 in a 128 tile)
            if (bm >= 2 * m and bm > BLOCKS[0]) or (bn >= 2 * n and bn > BLOCKS[0]) or bk > max(k, 8):
                continue
            if (bm // 8) * (bn // 8) < MIN_THREADS:
                continue
            yield {"bm": bm, "bn": bn, "bk": bk}
            if len(info.spatial) != 2:
                continue  # a batch already fills blockIdx.z
            tiles = -(-m // bm) * -(-n // bn)
            for split in SPLITS[1:]:
                chunk = split_chunk(k, bk, split)
                # only shapes short of blocks: the partials cost 2 x split x M x N x 4 bytes
                if chunk < MIN_SPLIT_TILES * bk or -(-k // chunk) != split or tiles >= 2 * target.sm_count:
                    continue
                yield {"bm": bm, "bn": bn, "bk": bk, "split": split}

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        split = int(point.get("split", 1))
        if split > 1:
            return self._split_workload(info, point, target, split)
        if len(info.spatial) == 3:
            # a batch of independent GEMMs side by side on blockIdx.z: one matrix's workload,
            # every total times the batch (per-block and per-thread figures unchanged); the
            # epilogue's broadcast reads come from DRAM once for the whole batch
            batch = info.spatial[0][1]
            one = self.workload(_one_matrix(info), point, target)
            dram = one.dram_bytes * batch - (batch - 1) * _broadcast_bytes(info)
            return replace(one, blocks=one.blocks * batch, flops=one.flops * batch, fma_ops=one.fma_ops * batch,
                           dram_bytes=dram, l2_bytes=one.l2_bytes * batch,
                           global_wavefronts=one.global_wavefronts * batch,
                           smem_wavefronts=one.smem_wavefronts * batch, instructions=one.instructions * batch)
        bm, bn, bk = int(point["bm"]), int(point["bn"]), int(point["bk"])
        base = Gemm().workload(info, {"bm": bm, "bn": bn, "tm": 8, "tn": 8, "bk": bk, "layout": "contiguous",
                                      "staging": "shared", "pad": 1, "unroll": True}, target)
        threads = base.threads
        copy_per_thread = (bm * bk + bk * bn) / threads
        k = info.reduction[0][1]
        ktiles = -(-k // bk)
        # gemm's count has 6 instructions per copied element; a 16-byte chunk costs about 6 for 4
        saved = ktiles * copy_per_thread * 6.0 * 0.75 * base.blocks * threads / 32
        (_, m), (_, n) = info.spatial[-2:]
        guarded = m % bm != 0 or n % bn != 0 or k % bk != 0 or bool(point.get("short_last_part"))
        regs = pipelined_registers(bm, bn, bk, guarded)
        notes = [x for x in base.notes if "bank" not in x] + ["k-tile loads overlap the compute (double buffer)"]
        # shared reads per k step and warp: two LDS.128 of A (rows ty*4.., broadcast within the
        # warp's two rows) and two of B (lanes tx*4.., consecutive 16-byte words), cost.warp's count
        tx = bn // 8
        lanes = range(32)
        a_rd, _ = shared_wavefronts([((lane // tx) % (bm // 8)) * 4 for lane in lanes], 4)
        b_rd, _ = shared_wavefronts([(lane % tx) * 4 for lane in lanes], 4)
        warps = base.blocks * threads / 32
        stores = base.blocks * ktiles * (bm * bk + bk * bn) / 32 / 4 * 2
        smem = warps * k * 2 * (a_rd + b_rd) + stores
        return replace(base, smem_wavefronts=smem, instructions=max(base.instructions - saved, base.fma_ops / 32),
                       bank_conflict=1.0, block_latency_cycles=base.block_latency_cycles / ktiles,
                       registers=regs, notes=notes, k_extent=ktiles * bk)

    def _split_workload(self, info: KernelInfo, point: Point, target: Target, split: int) -> Workload:
        """Split-K: `split` GEMMs of K/split side by side on blockIdx.z (each a tile grid of the
        output), writing float32 partials that a second kernel sums (`then`)."""
        (_, m), (_, n) = info.spatial
        kv, k = info.reduction[0]
        chunk = split_chunk(k, int(point["bk"]), split)
        one = self.workload(replace(info, reduction=((kv, chunk),)),
                            {"bm": point["bm"], "bn": point["bn"], "bk": point["bk"],
                             "short_last_part": k != split * chunk}, target)
        partials = float(split * m * n * 4)
        combine = Workload(
            blocks=-(-m * n // COMBINE_THREADS), threads=COMBINE_THREADS,
            registers={"addressing": 14, "values": min(split, 4), "accumulators": 1},
            flops=float(split * m * n), fma_ops=float(split * m * n),
            dram_bytes=partials + m * n * 4, l2_bytes=partials + m * n * 4,
            global_wavefronts=(split + 1) * m * n / 32.0,
            instructions=m * n / 32.0 * (4.0 * split + 12.0),
            bytes_in_flight=32.0 * min(split, 4), ilp=1.0,
            notes=[f"combine: sums {split} partials per output"])
        return replace(one, blocks=one.blocks * split, flops=one.flops * split, fma_ops=one.fma_ops * split,
                       dram_bytes=one.dram_bytes + partials - m * n * 4, l2_bytes=one.l2_bytes * split + partials,
                       global_wavefronts=one.global_wavefronts * split,
                       smem_wavefronts=one.smem_wavefronts * split, instructions=one.instructions * split,
                       notes=one.notes + [f"split-K: {split} parts of k {chunk} on blockIdx.z"], then=combine)

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        bm, bn, bk = int(point["bm"]), int(point["bn"]), int(point["bk"])
        split = int(point.get("split", 1))
        stage: Any = info.stage
        loops = sch.get_loops(stage)
        batch = loops[0] if len(info.spatial) == 3 else None
        i, j, k = loops[len(info.spatial) - 2:len(info.spatial) + 1]
        if split > 1:
            # split-K: the k loop's outer part becomes a parallel axis of partial results
            # (rfactor), bound to blockIdx.z like a batch; a second kernel sums the parts
            if batch is not None:
                raise ScheduleError("gemm_pipelined: split-K of a batched matmul is not supported")
            part, k = sch.split(k, factors=[None, split_chunk(info.reduction[0][1], bk, split)])
            stage = sch.rfactor(part)
            batch = part
        pair = operands(info)
        assert pair is not None
        tiles = [(access.tensor, 4, _k_contiguous(info, which)) for which, access in enumerate(pair)]
        schedule_tiles(sch, stage, batch, i, j, k, tiles, bm, bn, bk)

    def describe(self, point: Point) -> str:
        split = int(point.get("split", 1))
        parts = f", split-K {split} + combine kernel" if split > 1 else ""
        return (f"gemm_pipelined(block {point['bm']}x{point['bn']}, thread 8x8 in 4x4 quadrants, "
                f"k-tile {point['bk']}{parts}, float4 copies, register double buffer)")


def schedule_tiles(sch: Any, stage: Any, batch: Any, i: Any, j: Any, k: Any, operand_tiles: list[tuple[str, int, bool]],
                   bm: int, bn: int, bk: int) -> None:
    """The SGEMM schedule over loops (batch,) i, j, k of `stage` (module docstring), shared with
    gemm_implicit: `operand_tiles` = (tensor, copy width, contiguous along k) for A, then B."""
    bi, qi, ty, ii = sch.split(i, factors=[None, 2, bm // (2 * QUADRANT), QUADRANT])
    bj, qj, tx, ji = sch.split(j, factors=[None, 2, bn // (2 * QUADRANT), QUADRANT])
    ko, ki = sch.split(k, bk)
    sch.reorder(bi, bj, ty, tx, ko, ki, qi, ii, qj, ji)
    if batch is not None:
        sch.bind(batch, "blockIdx.z")
    sch.bind(bi, "blockIdx.y")
    sch.bind(bj, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    local = sch.cache_write(stage, "local")
    for tensor, width, k_contiguous in operand_tiles:
        cache = sch.cache_read(stage, tensor, "shared")
        if width > 1:
            sch.vector_copy(cache, width)
        if k_contiguous:
            sch.storage_transpose(cache)
            sch.storage_align(cache, 4)
        sch.compute_at(cache, ko)
    # past K both shared tiles hold the copies' zero fill: the k-tail guard leaves the FFMAs
    # (proved from the fill conditions; must precede double_buffer, while each copy is one store)
    sch.unguard_reduction_tail(local)
    sch.double_buffer(ko)
    # the shared tiles are zero-filled outside A and B: the register tile's edge lanes need
    # no guard in the k loop, only at the store to C
    sch.guard_writeback_only(local)
    for loop in (ki, qi, ii, qj, ji):
        sch.unroll(loop)


register(GemmPipelined())
