"""gemm: contractions C[i, j] = Σ_k A[.., k] · B[k, ..] with shared-memory and register tiling.

Point: block tile BM × BN, thread tile TM × TN (each thread accumulates TM·TN outputs in
registers), k-tile BK, thread-tile layout, staging, padding, unroll:

  layout "contiguous"  thread (ty, tx) owns rows ty·TM .. ty·TM+TM-1 (its outputs are adjacent)
  layout "strided"     thread (ty, tx) owns rows ty, ty + BM/TM, ...  (lanes read adjacent rows:
                       conflict-free shared reads, coalesced stores)
  staging "shared"     per k-tile the block copies A[BM × BK] and B[BK × BN] into shared memory
                       (cache_read + compute_at at the k-tile loop; barriers inserted)
  staging "none"       operands are read from global memory (through L1) at every k step
  pad                  storage_align of A's shared tile (a column walk over rows of BK words)
  unroll               unroll the k step and the thread tile loops (registers for the tile)

Schedule: split i into (i_block, i_thread, i_tile) (or (i_block, i_tile, i_thread) for the
strided layout), same for j, split k by BK; reorder to block, thread, k-tile, k-step, tile; bind
blocks and threads; cache_write the accumulator to registers; cache_read A and B into shared at
the k-tile loop; unroll.

Not expressible yet with the primitives: vectorized (16-byte) global→shared copies and shared
reads chosen by the schedule (the emitter vectorizes only `vectorize` loops; ptxas may still merge
adjacent shared loads), double buffering / cp.async pipelining (gemm_pipelined has the first;
16-bit operands go to gemm_tensor_core: mma, ldmatrix, cp.async through `tensorize`).
"""

from __future__ import annotations

from itertools import product
from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import Access, KernelInfo
from ..cost.model import Workload
from ..cost.traffic import buffer_bytes, compulsory_bytes
from ..cost.warp import WARP, global_cost, shared_wavefronts
from .registry import Point, Strategy, register

BLOCK = (16, 32, 64, 128)
THREAD = (1, 2, 4, 8)
BK = (8, 16, 32)
LAYOUTS = ("contiguous", "strided")
# registers besides the accumulators and fragments: pointers, tile indices, loop counters, the
# copy's addresses and values (fit to ptxas reports, docs/cost-model.md)
ADDRESSING_REGISTERS = 22
COPY_INSTRUCTIONS = 6.0     # per copied element per thread: address, bounds, LDG, STS
# staging "none": every k step waits for its TM + TN loads from L1/L2, about this many cycles
# each (one block of 4-8 warps per SM has nothing to hide them with). Fitted to the tuner's
# H200 run of a 100x512x256 matmul (docs/tuning.md): 16x32 tiles, thread 2x1 measured 26.1 us
# (200 cycles per k step), thread 4x1 47.2 us (360 cycles per k step); the model had 6 us for both
GLOBAL_STEP_LOAD_CYCLES = 70.0


def operands(info: KernelInfo) -> tuple[Access, Access] | None:
    """(A, B): the read indexed by the row axis i and the one indexed by the column axis j, the
    last two spatial axes (a leading batch axis, when there is one, may index both). With a
    reduction only reads under it count (those indexed by a reduction axis): an epilogue's
    `bias[j]`, read once per output by the store, is not an operand."""
    if len(info.spatial) < 2:
        return None
    i, j = info.spatial[-2][0], info.spatial[-1][0]
    reduce_vars = {v for v, _ in info.reduction}
    under = [x for x in info.reads if x.offset is not None and (not reduce_vars or set(x.offset.vars) & reduce_vars)]
    a = [x for x in under if i in x.offset.vars and j not in x.offset.vars]  # type: ignore[union-attr]
    b = [x for x in under if j in x.offset.vars and i not in x.offset.vars]  # type: ignore[union-attr]
    if len(a) != 1 or len(b) != 1:
        return None
    return a[0], b[0]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class Gemm(Strategy):
    name = "gemm"
    description = "contraction: block tile, thread tile, k-tile, shared staging, unroll"
    priority = 1

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if info.kind != "contraction":
            return f"not a contraction (kind {info.kind})"
        if len(info.spatial) != 2 or len(info.reduction) != 1:
            return "needs exactly two spatial axes and one reduction axis"
        if operands(info) is None:
            return "needs one read indexed by (i, k) and one by (k, j)"
        if any(x.itemsize != 4 for x in operands(info) or ()):
            return "float32 operands only (16-bit operands: gemm_tensor_core)"
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        (_, m), (_, n) = info.spatial
        k = info.reduction[0][1]
        for bm, bn, tm, tn, bk, layout in product(BLOCK, BLOCK, THREAD, THREAD, BK, LAYOUTS):
            if tm > bm or tn > bn or bm > 2 * max(m, 16) or bn > 2 * max(n, 16) or bk > max(k, 4):
                continue
            threads = (bm // tm) * (bn // tn)
            if threads < 32 or threads > 1024 or threads % 32:
                continue
            if layout == "strided" and tm == 1 and tn == 1:
                continue
            for staging in ("shared", "none"):
                if staging == "none":
                    if bk != BK[0] or layout != "contiguous" or (tm, tn) == (1, 1):
                        continue
                    yield {"bm": bm, "bn": bn, "tm": tm, "tn": tn, "bk": bk, "layout": layout,
                           "staging": "none", "pad": 0, "unroll": True}
                    continue
                for pad in (0, 1):
                    yield {"bm": bm, "bn": bn, "tm": tm, "tn": tn, "bk": bk, "layout": layout,
                           "staging": "shared", "pad": pad, "unroll": True}

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        bm, bn, tm, tn, bk = (int(point[x]) for x in ("bm", "bn", "tm", "tn", "bk"))
        pad = int(point["pad"])
        strided = point["layout"] == "strided"
        (iv, m), (jv, n) = info.spatial
        kv, k = info.reduction[0]
        a, b = self._operands(info)
        tx, ty = bn // tn, bm // tm
        threads = tx * ty
        blocks = _ceil(m, bm) * _ceil(n, bn)
        ktiles = _ceil(k, bk)
        lane_x = [lane % tx for lane in range(WARP)]
        lane_y = [(lane // tx) % ty for lane in range(WARP)]
        rows = [y if strided else y * tm for y in lane_y]        # the row of the thread's tile element 0
        cols = [x if strided else x * tn for x in lane_x]
        a_row = abs(a.offset.get(iv)) if a.offset else k
        b_row = abs(b.offset.get(kv)) if b.offset else n
        fma = float(m * n * k)
        regs = {"accumulators": tm * tn, "fragments": tm + tn, "addressing": ADDRESSING_REGISTERS}
        notes: list[str] = []
        if point["staging"] == "shared":
            smem = (bm * (bk + pad) + bk * bn) * 4
            # copies: flattened boxes, consecutive threads on consecutive columns
            a_copy = [(l // bk) * a_row + l % bk for l in range(WARP)]
            b_copy = [(l // bn) * b_row + l % bn for l in range(WARP)]
            a_sec, a_lines = global_cost(a_copy, 4)
            b_sec, b_lines = global_cost(b_copy, 4)
            a_instr = blocks * ktiles * bm * bk / WARP
            b_instr = blocks * ktiles * bk * bn / WARP
            l2 = (a_instr * a_sec + b_instr * b_sec) * 32 + m * n * 4
            gwf = a_instr * a_lines + b_instr * b_lines
            a_store, _ = shared_wavefronts([(l // bk) * (bk + pad) + l % bk for l in range(WARP)])
            b_store, _ = shared_wavefronts([(l // bn) * bn + l % bn for l in range(WARP)])
            # compute reads per k step: TM words of A (column of the tile), TN of B (row)
            a_rd, a_deg = shared_wavefronts([r * (bk + pad) for r in rows])
            b_vec = 4 if (not strided and tn % 4 == 0) else (2 if (not strided and tn % 2 == 0) else 1)
            b_rd, b_deg = shared_wavefronts(cols, b_vec)
            warps = blocks * threads / WARP
            reads = warps * k * (tm * a_rd + (tn // b_vec) * b_rd)
            swf = a_instr * a_store + b_instr * b_store + reads
            degree = max(a_deg, b_deg)
            copy_per_thread = (bm * bk + bk * bn) / threads
            instr_thread = ktiles * (copy_per_thread * COPY_INSTRUCTIONS + 2 + 2) + k * (tm * tn + tm + tn / b_vec + 1)
            in_flight = copy_per_thread * 4
            latency = ktiles * (550.0 + 2 * 40.0) / 2
            regs["copy"] = int(min(copy_per_thread, 8))
            chain = 0.0
            if degree > 1:
                notes.append(f"shared reads {degree}-way bank conflicted")
        else:
            smem = 0
            a_lane = [r * a_row for r in rows]
            b_lane = [c for c in cols]
            a_sec, a_lines = global_cost(a_lane, 4)
            b_sec, b_lines = global_cost(b_lane, 4, 1)
            warps = blocks * threads / WARP
            a_instr = warps * k * tm
            b_instr = warps * k * tn
            # L1 keeps a sector over the 8 consecutive k steps that read it (A along k); B rows are new
            l2 = (a_instr * a_sec / 8 + b_instr * b_sec) * 32 / max(1, min(ty, 4)) + m * n * 4
            gwf = a_instr * a_lines + b_instr * b_lines
            swf = 0.0
            degree = 1
            instr_thread = k * (tm * tn + tm + tn + 2)
            in_flight = (tm + tn) * 4 * 2
            latency = 0.0
            chain = k * (tm + tn) * GLOBAL_STEP_LOAD_CYCLES
        dram = compulsory_bytes(info)
        footprint = buffer_bytes(a) + buffer_bytes(b)
        if footprint > 0.5 * target.l2_bytes:
            dram += (l2 - dram) * (1 - 0.5 * target.l2_bytes / footprint)
        c_store_lines = global_cost([r * n + c for r, c in zip(rows, cols)], 4)[1]
        gwf += blocks * threads / WARP * tm * tn * c_store_lines
        return Workload(
            blocks=blocks, threads=threads, registers=regs, smem_bytes=smem, flops=2 * fma, fma_ops=fma,
            dram_bytes=dram, l2_bytes=l2, global_wavefronts=gwf, smem_wavefronts=swf,
            bank_conflict=float(degree), instructions=blocks * threads / WARP * instr_thread,
            bytes_in_flight=in_flight, ilp=float(tm * tn), block_latency_cycles=latency, chain_cycles=chain,
            notes=notes,
            tile_loop=point["staging"] == "shared")

    def _operands(self, info: KernelInfo) -> tuple[Access, Access]:
        cached = getattr(self, "_cache", None)
        if cached is None or cached[0] is not info:
            pair = operands(info)
            assert pair is not None
            self._cache = (info, pair)
        return self._cache[1]

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        bm, bn, tm, tn, bk = (int(point[x]) for x in ("bm", "bn", "tm", "tn", "bk"))
        i, j, k = sch.get_loops(info.stage)[:3]
        if point["layout"] == "strided":
            bi, ii, ti = sch.split(i, factors=[None, tm, bm // tm])
            bj, ji, tj = sch.split(j, factors=[None, tn, bn // tn])
        else:
            bi, ti, ii = sch.split(i, factors=[None, bm // tm, tm])
            bj, tj, ji = sch.split(j, factors=[None, bn // tn, tn])
        ko, ki = sch.split(k, bk)
        sch.reorder(bi, bj, ti, tj, ko, ki, ii, ji)
        sch.bind(bi, "blockIdx.y")
        sch.bind(bj, "blockIdx.x")
        sch.bind(ti, "threadIdx.y")
        sch.bind(tj, "threadIdx.x")
        sch.cache_write(info.stage, "local")
        if point["staging"] == "shared":
            pair = operands(info)
            assert pair is not None
            a, b = pair
            ca = sch.cache_read(info.stage, a.tensor, "shared")
            if int(point["pad"]):
                sch.storage_align(ca, int(point["pad"]))
            sch.compute_at(ca, ko)
            cb = sch.cache_read(info.stage, b.tensor, "shared")
            sch.compute_at(cb, ko)
        if point.get("unroll", True):
            sch.unroll(ki)
            sch.unroll(ii)
            sch.unroll(ji)

    def describe(self, point: Point) -> str:
        if point["staging"] == "none":
            return (f"gemm(block {point['bm']}x{point['bn']}, thread {point['tm']}x{point['tn']}, "
                    f"{point['layout']}, operands from global)")
        return (f"gemm(block {point['bm']}x{point['bn']}, thread {point['tm']}x{point['tn']}, k-tile {point['bk']}, "
                f"{point['layout']}, shared staging, pad {point['pad']})")


register(Gemm())
