"""gemm_pipelined: fp32 contractions with the SGEMM kernel structure (issue 6).

Point: block tile BM × BN (64 or 128 each), k-tile BK (8 or 16). Every thread owns an 8 × 8
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

The workload is `gemm`'s for the same tiles (the cost model's helpers), corrected for what this
template changes: 4× fewer copy instructions (16-byte chunks), conflict-free shared reads, and the
global latency of a k-tile overlapped with its compute.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import KernelInfo
from ..cost.model import Workload
from ..cost.warp import shared_wavefronts
from .gemm import Gemm, operands
from .registry import Point, Strategy, register

BLOCKS = (64, 128)
BKS = (8, 16)  # k-tile 32 with 128x128 needs 32 prefetch registers: 1 block/SM, measured 0.70 of cuBLAS
QUADRANT = 4  # a thread's register tile is 2 × 2 quadrants of QUADRANT × QUADRANT


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
        if len(info.spatial) != 2 or len(info.reduction) != 1:
            return "needs exactly two spatial axes and one reduction axis"
        if operands(info) is None:
            return "needs one read indexed by (i, k) and one by (k, j)"
        if any(x.itemsize != 4 for x in info.reads):
            return "float32 operands only"
        (_, m), (_, n) = info.spatial
        if m < 64 or n < 64:
            return "needs M and N of at least 64 (one 64x64 block tile)"
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        (_, m), (_, n) = info.spatial
        k = info.reduction[0][1]
        for bm, bn, bk in product(BLOCKS, BLOCKS, BKS):
            if bm > 2 * m or bn > 2 * n or bk > max(k, 8):
                continue
            yield {"bm": bm, "bn": bn, "bk": bk}

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        bm, bn, bk = int(point["bm"]), int(point["bn"]), int(point["bk"])
        base = Gemm().workload(info, {"bm": bm, "bn": bn, "tm": 8, "tn": 8, "bk": bk, "layout": "contiguous",
                                      "staging": "shared", "pad": 1, "unroll": True}, target)
        threads = base.threads
        copy_per_thread = (bm * bk + bk * bn) / threads
        k = info.reduction[0][1]
        ktiles = -(-k // bk)
        # gemm's count has 6 instructions per copied element; a 16-byte chunk costs about 6 for 4
        saved = ktiles * copy_per_thread * 6.0 * 0.75 * base.blocks * threads / 32
        regs = dict(base.registers)
        regs["copy"] = int(copy_per_thread)          # the prefetch registers of the next tile
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
                       registers=regs, notes=notes)

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        bm, bn, bk = int(point["bm"]), int(point["bn"]), int(point["bk"])
        i, j, k = sch.get_loops(info.stage)[:3]
        bi, qi, ty, ii = sch.split(i, factors=[None, 2, bm // (2 * QUADRANT), QUADRANT])
        bj, qj, tx, ji = sch.split(j, factors=[None, 2, bn // (2 * QUADRANT), QUADRANT])
        ko, ki = sch.split(k, bk)
        sch.reorder(bi, bj, ty, tx, ko, ki, qi, ii, qj, ji)
        sch.bind(bi, "blockIdx.y")
        sch.bind(bj, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.cache_write(info.stage, "local")
        pair = operands(info)
        assert pair is not None
        for which, access in enumerate(pair):
            cache = sch.cache_read(info.stage, access.tensor, "shared")
            sch.vector_copy(cache, 4)
            if _k_contiguous(info, which):
                sch.storage_transpose(cache)
                sch.storage_align(cache, 4)
            sch.compute_at(cache, ko)
        sch.double_buffer(ko)
        for loop in (ki, qi, ii, qj, ji):
            sch.unroll(loop)

    def describe(self, point: Point) -> str:
        return (f"gemm_pipelined(block {point['bm']}x{point['bn']}, thread 8x8 in 4x4 quadrants, "
                f"k-tile {point['bk']}, float4 copies, register double buffer)")


register(GemmPipelined())
