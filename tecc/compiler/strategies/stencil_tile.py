"""stencil_tile: a sum over a window of shifted reads of one operand (a depthwise convolution).

Found by index structure, not by name: a sum whose *stencil operand* X is read at affine indices
where every reduction axis appears only shifted against an output axis (`X[n, p·σ + r·δ - π,
q·σ + s·δ - π, c]`: r slides along p, s along q) and every output axis indexes X, so each
element of X feeds a bounded window of outputs. The other reads (the filter `W[r, s, c]`) may
use any axes. A depthwise convolution (groups = channels) is the case in point: no axis is
summed across channels, so it is no matrix product (implicit_gemm declines it) but a stencil:
R·S multiply-adds per output, memory-bound.

The generic `reduction` schedule gives one thread per output and re-reads the R·S inputs of its
window from global memory (through L1). This schedule gives each block a tile of outputs and
stages the tile's input *halo* in shared memory once, with the existing primitives:

  split     the lane axis (the output's innermost axis: channels in NHWC) by TX threads, the
            innermost window axis (q) by TY threads, the next window axis (p) by TP outputs per
            thread (serial, unrolled)
  reorder   the block loops outside, then threadIdx.y, threadIdx.x, the thread's TP outputs, the
            window loops; fuse the block loops other than the lane's and the window's into one
  bind      lane tile → blockIdx.x, window tile → blockIdx.y, the rest → blockIdx.z
  cache_read X into shared memory at the innermost block loop: the box is the halo,
            (TP·σ + (R-1)·δ) × ((TY-1)·σ + (S-1)·δ + 1) × TX for NHWC, copied cooperatively,
            consecutive threads on consecutive elements of X's contiguous dimension (16-byte
            chunks -- 8 halves, 4 floats -- where the lane axis is X's contiguous dimension and
            TX, C are multiples of the chunk; 4 elements where they are multiples of 4),
            zero-filled outside X (the padding)
  unroll    the window loops and the TP outputs

Each input element is read from global memory once per block (the halo overlap between blocks is
(R-1)·δ rows and columns), and R·S times from shared memory. Workload: that traffic, R·S shared
loads and FMAs per output, the copy's instructions, a barrier per block.
"""

from __future__ import annotations

from itertools import product
from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import Access, KernelInfo
from ..cost.model import Workload
from ..cost.traffic import compulsory_bytes
from ..cost.warp import WARP, global_cost, shared_wavefronts
from .registry import Point, Strategy, register

LANES = (16, 32, 64)        # threads along the lane axis (channels)
ROWS = (1, 2, 4, 8)         # threads along the innermost window axis
PER_THREAD = (1, 2, 4)      # outputs per thread along the next window axis
COPY_INSTRUCTIONS = 6.0     # per copied element (chunk) per thread: address, bounds, LDG, STS
OUTPUT_INSTRUCTIONS = 8.0   # per output: the accumulator, the guard, the address and the store


def stencil_operand(info: KernelInfo) -> tuple[Access, list[str]] | None:
    """(X, window axes): the read whose every dimension is affine, indexed by every output axis,
    and in which every reduction axis appears only together with an output axis (a shift);
    the window axes are those output axes, outermost first. None where there is no such read."""
    if not info.reduction or info.combiner != "sum" or len(info.spatial) < 2:
        return None
    spatial = [v for v, _ in info.spatial]
    reduce_vars = {v for v, _ in info.reduction}
    found = None
    for x in info.reads:
        if not x.per_dim or any(d is None for d in x.per_dim) or len(x.per_dim) != len(x.index_vars):
            continue
        used = set().union(*x.index_vars)
        if not set(spatial) <= used or not reduce_vars <= used:
            continue
        window: list[str] = []
        ok = True
        for vs in x.index_vars:
            r = vs & reduce_vars
            s = [v for v in spatial if v in vs]
            if r and len(s) != 1:
                ok = False  # a reduction axis alone in a dimension: summed across X, a contraction
                break
            if r:
                window.append(s[0])
        if ok and window and found is None:
            found = (x, sorted(set(window), key=spatial.index))
        elif ok and window:
            return None  # two stencil operands: not this schedule
    return found


def _shape(info: KernelInfo) -> tuple[str, str | None, str | None]:
    """(lane axis, row axis, per-thread axis): the output's innermost axis; the innermost window
    axis other than the lane; the window axis outside that (None where missing)."""
    found = stencil_operand(info)
    assert found is not None
    _, window = found
    lane = info.spatial[-1][0]
    rest = [v for v in window if v != lane]
    row = rest[-1] if rest else None
    outer = rest[-2] if len(rest) >= 2 else None
    return lane, row, outer


def _halo(x: Access, axis: str | None, tile: int, info: KernelInfo) -> int:
    """Elements of X's dimension indexed by `axis` that a tile of `tile` outputs reads."""
    if axis is None:
        return 1
    ext = dict(info.reduction)
    for d in x.per_dim:
        if d is not None and d.get(axis):
            span = abs(d.get(axis)) * (tile - 1) + 1
            span += sum(abs(c) * (ext[v] - 1) for v, c in d.coeff if v in ext)
            return span
    return tile


def _window_rows(x: Access, axis: str | None, tp: int, info: KernelInfo) -> tuple[int, int]:
    """(distinct rows of X that TP consecutive outputs along `axis` read, rows one output reads),
    (0, 0) where the axis is missing."""
    if axis is None or tp <= 1:
        return 0, 0
    ext = dict(info.reduction)
    for d in x.per_dim:
        if d is not None and d.get(axis):
            taps = [(abs(c), ext[v]) for v, c in d.coeff if v in ext]
            one = 1
            for _, e in taps:
                one *= e
            span = sum(c * (e - 1) for c, e in taps)
            stride = abs(d.get(axis))
            return min(tp * one, (tp - 1) * stride + span + 1), one
    return 0, 0


def copy_width(x: Access, tx: int) -> int:
    """Elements per chunk of the halo copy along the channels: 16 bytes (8 halves, 4 floats)
    where TX and C are multiples of it, else 4 elements where they are multiples of 4, else 1."""
    for width in (16 // max(x.itemsize, 1), 4):
        if width > 1 and tx % width == 0 and x.dims[-1] % width == 0:
            return width
    return 1


class StencilTile(Strategy):
    name = "stencil_tile"
    description = "window sum over shifted reads (depthwise conv): output tile per block, input halo in shared memory"
    priority = 1

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if info.symbolic:
            return "symbolic sizes"
        if stencil_operand(info) is None:
            return ("needs one read indexed by every output axis in which each reduction axis only shifts an output "
                    "axis (a stencil)")
        lane, row, _ = _shape(info)
        if row is None:
            return "needs a window axis besides the output's innermost axis"
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        lane, row, outer = _shape(info)
        ext = dict(info.spatial)
        for tx, ty, tp in product(LANES, ROWS, PER_THREAD):
            if tx > 2 * max(ext[lane], 8) and tx > LANES[0]:
                continue
            if row is not None and ty > 2 * ext[row]:
                continue
            if tp > 1 and (outer is None or tp > ext[outer]):
                continue
            if not 64 <= tx * ty <= 1024:
                continue
            yield {"tx": tx, "ty": ty, "tp": tp}

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        tx, ty, tp = int(point["tx"]), int(point["ty"]), int(point["tp"])
        found = stencil_operand(info)
        assert found is not None
        x, _ = found
        lane, row, outer = _shape(info)
        assert row is not None
        taps = 1
        for _, e in info.reduction:
            taps *= e
        tiles = {lane: tx, row: ty}
        if outer is not None:
            tiles[outer] = tp
        blocks = 1
        for v, e in info.spatial:
            blocks *= -(-e // tiles.get(v, 1))
        threads = tx * ty
        halo = 1
        for d in x.per_dim:
            assert d is not None
            axes = [v for v in tiles if d.get(v)]
            halo *= _halo(x, axes[0], tiles[axes[0]], info) if axes else 1
        lane_contiguous = any(d is not None and d.get(lane) == 1 for d in x.per_dim[-1:])
        vector = copy_width(x, tx) if lane_contiguous else 1
        copy_elems = float(blocks * halo)
        outputs = float(info.outputs)
        # the copy: consecutive threads on consecutive elements of the box's last dimension
        inner = tx if lane_contiguous else _halo(x, lane, tx, info)
        row_stride = x.dims[-1]
        lanes = [(l // max(1, inner // vector)) * row_stride + (l % max(1, inner // vector)) * vector for l in range(WARP)]
        sectors, lines = global_cost(lanes, x.itemsize, vector)
        copy_instr = copy_elems / vector / WARP
        others = [a for a in info.reads if a is not x]
        # the other reads (the filter) are small and shared by the block: L1 hits after the first
        l2 = copy_instr * sectors * 32 + sum(float(a.itemsize) * blocks * tx * taps / max(1, ty) for a in others)
        l2 += outputs * info.write.itemsize
        # a thread's TP outputs along the outer window axis share window rows: with the loops
        # unrolled the compiler loads each distinct shared element once (NVVM's CSE: 18 shared
        # loads for 4 outputs of a 3x3 window) and each filter element once
        rows = _window_rows(x, outer, tp, info)
        loads_per_output = taps / (rows[1] or 1) * rows[0] / tp if rows[1] else taps
        reads_wf, degree = shared_wavefronts([l for l in range(WARP)])
        smem_wf = outputs * loads_per_output / WARP * reads_wf + copy_instr * 1.0
        per_thread_instr = (halo / vector / threads) * COPY_INSTRUCTIONS + tp * (
            loads_per_output + taps + len(others) * taps / tp + OUTPUT_INSTRUCTIONS)
        instructions = blocks * threads / WARP * per_thread_instr
        regs = {"addressing": 20, "accumulators": tp, "values": min(taps, 8), "copy": vector}
        return Workload(
            blocks=blocks, threads=threads, registers=regs, smem_bytes=halo * x.itemsize,
            flops=info.flops, fma_ops=float(info.iterations * info.flops_per_iteration) / 2,
            dram_bytes=compulsory_bytes(info), l2_bytes=l2,
            global_wavefronts=copy_instr * lines + outputs / WARP * (1 + len(others) * taps / tp),
            smem_wavefronts=smem_wf, bank_conflict=float(degree), instructions=instructions,
            bytes_in_flight=float(max(1.0, halo / threads) * x.itemsize), ilp=float(tp),
            block_latency_cycles=550.0 + 2 * 40.0,
            notes=[f"halo of {halo} elements staged per block for {tx * ty * tp} outputs"])

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        tx, ty, tp = int(point["tx"]), int(point["ty"]), int(point["tp"])
        found = stencil_operand(info)
        assert found is not None
        x, _ = found
        lane, row, outer = _shape(info)
        assert row is not None
        loops = sch.get_loops(info.stage)
        names = [v for v, _ in info.spatial]
        spatial = dict(zip(names, loops[:len(names)]))
        window = loops[len(names):]
        lb, lt = sch.split(spatial[lane], factors=[None, tx])
        rb, rt = sch.split(spatial[row], factors=[None, ty])
        blocks_rest = []
        per_thread = []
        for v in names:
            if v in (lane, row):
                continue
            if v == outer and tp > 1:
                ob, ot = sch.split(spatial[v], factors=[None, tp])
                blocks_rest.append(ob)
                per_thread.append(ot)
            else:
                blocks_rest.append(spatial[v])
        sch.reorder(*blocks_rest, rb, lb, rt, lt, *per_thread, *window)
        fused = blocks_rest[0] if blocks_rest else None
        for lp in blocks_rest[1:]:
            fused = sch.fuse(fused, lp)
        if fused is not None:
            sch.bind(fused, "blockIdx.z")
        sch.bind(rb, "blockIdx.y")
        sch.bind(lb, "blockIdx.x")
        sch.bind(rt, "threadIdx.y")
        sch.bind(lt, "threadIdx.x")
        cache = sch.cache_read(info.stage, x.tensor, "shared")
        lane_contiguous = x.per_dim[-1] is not None and x.per_dim[-1].get(lane) == 1
        if lane_contiguous and copy_width(x, tx) > 1:
            sch.vector_copy(cache, copy_width(x, tx))
        sch.compute_at(cache, lb)
        for lp in (*per_thread, *window):
            sch.unroll(lp)

    def describe(self, point: Point) -> str:
        return (f"stencil_tile({point['tx']} lanes x {point['ty']} rows x {point['tp']} per thread, "
                "input halo staged in shared memory)")


register(StencilTile())
