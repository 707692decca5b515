"""transpose_tile: a permutation of axes whose output's fastest axis reads a slow axis of the input,
through a padded shared-memory tile.

Found by index structure, not by name. The *transposed operand* X is a read whose every
dimension is indexed by at most one output axis with coefficient 1 (a permutation of axes,
possibly with constant offsets and broadcast axes), whose fastest (last) dimension is indexed by
an output axis u that is not the output's fastest axis v, while v indexes a slower dimension of
X: `Y[i, j] = X[j, i]`, `x.permute(0, 2, 1)`, NCHW -> NHWC. Any element type; the rest of the
expression (a cast, a scale, a read of another operand at the output's index) is computed as
usual. With one thread per output (elementwise) the lanes of a warp, consecutive in v, read X
with a stride of a whole row: 32 lines per warp load, and at 4096² ~3x the tensor's bytes from
DRAM (a sector is evicted before its other 7 elements are read).

The schedule is made of the existing primitives (the classic tiled transpose):

  split     u by (tile TU, threads TY): thread row ty takes rows ty, ty + TY, ... of the tile;
            v by (tile TV, threads TX[, vector V])
  reorder   the other output axes, the u tile, the v tile, then threadIdx.y, threadIdx.x, the rows
            of a thread (and its V consecutive outputs)
  fuse      every block loop into one, bound to blockIdx.x (no 65535 limit of blockIdx.y/z for a
            batch of many small matrices); with symbolic sizes the v tiles go on blockIdx.x, the u
            tiles on blockIdx.y and the other axes (fused) on blockIdx.z (a fused symbolic extent
            is a division by a parameter, which the legality check of bind cannot see through)
  cache_read X into shared memory at the block loop: the TV x TU box of X (rows along v, X's
            contiguous dimension along u), copied cooperatively, consecutive threads on
            consecutive elements of X's rows (whole 128-byte lines for TU x itemsize >= 128)
  storage_align the tile's rows by `pad` elements: the smallest pad with which the compute's
            column reads (lanes on consecutive v, i.e. consecutive rows of the tile) and the
            copy's row writes hit distinct banks (`best_pad`; 1 element for a 32-wide tile of
            1-, 2- or 4-byte elements: a row of 33 elements puts lane l on bank l·33·s/4)
  unroll    the rows of a thread and the copy's steps (its loads all in flight before the
            barrier); vectorize V = 2 consecutive 16-bit outputs (one 4-byte store per lane,
            whole 128-byte lines per warp)

Each element is read from DRAM once and written once: the predicted DRAM traffic is the tensor's
bytes twice (compulsory), where elementwise's was ~3x more. The Workload prices the copy's and
the stores' sectors and lines per warp (tecc.compiler.cost.warp), the shared wavefronts of both
phases (bank conflicts counted), a barrier per block, the loads a thread has in flight, and the
issue of ~COPY_INSTRUCTIONS per copied and ~STORE_INSTRUCTIONS per stored element.

Not done: 16-byte copies into the tile (the padded rows are not 16-byte aligned: a swizzled tile
would allow them), 1-byte vector stores (the emitter vectorizes 16- and 32-bit buffers only).
"""

from __future__ import annotations

from itertools import product
from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import Access, KernelInfo
from ..cost.model import Workload
from ..cost.traffic import compulsory_bytes
from ..cost.warp import WARP, global_cost, lane_offsets, shared_wavefronts
from .registry import Point, Strategy, register

TILES = (16, 32, 64, 128)     # TU (along X's contiguous axis) and TV (along the output's)
LINE_BYTES = 128              # a tile row narrower than a line is offered only for a narrower extent
THREAD_ROWS = (1, 2, 4, 8, 16, 32)
MAX_PAD = 32                  # pads tried by best_pad (elements)
# issued instructions per element (estimates, per thread): the copy's address, bounds select,
# LDG, STS; the compute's LDS, STG (one per vector) and its address
COPY_INSTRUCTIONS = 5.0
STORE_INSTRUCTIONS = 3.0
SETUP_INSTRUCTIONS = 30.0     # per thread: the block's tile origin (div/mod of blockIdx.x), barrier, exit
# registers: the addresses and indices, the copy's loaded values (packed 4 bytes to a register: all
# in flight before the barrier) and a stored value or two; at or within 10 of ptxas's count on the
# 4096² fp32 and fp16 points (sm_90, NVRTC 13), above it where it matters (many copies per thread)
ADDRESSING_REGISTERS = 16


def transposed_operand(info: KernelInfo) -> tuple[Access, str, str] | str:
    """(X, u, v): the transposed operand, the output axis that indexes its fastest dimension and
    the output's fastest axis; or why the kernel has none."""
    if info.reduction:
        return "the kernel has a reduction"
    if len(info.spatial) < 2:
        return "needs at least two output axes"
    spatial = [name for name, _ in info.spatial]
    v = spatial[-1]
    found: list[tuple[Access, str]] = []
    for x in info.reads:
        if len(x.per_dim) < 2 or any(d is None for d in x.per_dim) or x.buffer in info.strided_inputs:
            continue
        axes = [_axis(d, spatial) for d in x.per_dim]
        if any(a == "?" for a in axes) or len({a for a in axes if a}) != len([a for a in axes if a]):
            continue  # not a permutation (an axis scaled, two in one dimension, one in two)
        u = axes[-1]
        if u and u != v and v in axes:
            found.append((x, u))
    if not found:
        return ("needs a read that permutes the output axes with the output's fastest axis on a slower dimension "
                "of the input (a transpose)")
    if len(found) > 1:
        return "more than one transposed read (one is staged in shared memory)"
    x, u = found[0]
    if sum(1 for a in info.reads if a.buffer == x.buffer) > 1:
        return f"{x.buffer} is read at more than one index"
    return x, u, v


def _axis(d: Any, spatial: list[str]) -> str:
    """The output axis a dimension's affine index is (coefficient 1 and a constant), "" for a
    constant, "?" for anything else."""
    coeff = [(name, c) for name, c in d.coeff if c]
    if not coeff:
        return ""
    if len(coeff) == 1 and coeff[0][1] == 1 and coeff[0][0] in spatial:
        return str(coeff[0][0])
    return "?"


def _vector_width(info: KernelInfo, v: str, tv: int) -> int:
    """V consecutive outputs per thread: 2 for a 16-bit output whose fastest extent is a constant
    multiple of the tile (no split guard inside the vector: one 4-byte store per lane, which the
    emitter proves aligned), else 1."""
    extent = dict(info.spatial)[v]
    if info.write.itemsize == 2 and extent % tv == 0 and not info.symbolic:
        return 2
    return 1


def box(info: KernelInfo, u: str, v: str, tu: int, tv: int) -> tuple[int, int]:
    """(BU, BV): the extents of the tile of X that cache_read stages, along u and v: the tile, or
    the axis's extent where that is smaller (cache_read's box is the largest tile; a symbolic
    extent is taken at the size planned for)."""
    ext = dict(info.spatial)
    return min(tu, ext[u]), min(tv, ext[v])


def _warp_lanes(tx: int) -> tuple[list[int], list[int]]:
    """(threadIdx.x, threadIdx.y) of the 32 lanes of a block's first warp."""
    return [lane % tx for lane in range(WARP)], [lane // tx for lane in range(WARP)]


def _shared_words(elements: list[int], itemsize: int) -> list[int]:
    return [e * itemsize // 4 for e in elements]


def phase_wavefronts(bu: int, tx: int, vector: int, pad: int, itemsize: int) -> tuple[int, int, int]:
    """(wavefronts of one warp's copy store, of one warp's column reads (all V of them), worst
    conflict degree) for a tile of rows of BU + pad elements: the copy writes consecutive elements
    of the flattened tile, the compute reads element (tx·V + q, ty) of it."""
    row = bu + pad
    writes, worst = shared_wavefronts(_shared_words([(l // bu) * row + l % bu for l in range(WARP)], itemsize))
    xs, ys = _warp_lanes(tx)
    reads = 0
    for q in range(vector):
        wf, degree = shared_wavefronts(_shared_words([(x * vector + q) * row + y for x, y in zip(xs, ys)], itemsize))
        reads += wf
        worst = max(worst, degree)
    return writes, reads, worst


def best_pad(bu: int, tx: int, vector: int, itemsize: int) -> int:
    """The smallest pad (elements) that gives both phases their fewest wavefronts."""
    costs = {pad: phase_wavefronts(bu, tx, vector, pad, itemsize) for pad in range(MAX_PAD + 1)}
    return min(costs, key=lambda p: (costs[p][0] + costs[p][1], p))


class TransposeTile(Strategy):
    name = "transpose_tile"
    description = "permutation of axes (transpose): the input tile staged in padded shared memory, both sides coalesced"
    priority = 1

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        found = transposed_operand(info)
        return found if isinstance(found, str) else None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        found = transposed_operand(info)
        assert not isinstance(found, str)
        x, u, v = found
        ext = dict(info.spatial)
        for tu, tv, ty in product(TILES, TILES, THREAD_ROWS):
            if any(t > 2 * max(ext[a], TILES[0]) and t > TILES[0] for t, a in ((tu, u), (tv, v))):
                continue  # a tile twice the extent leaves half its threads idle
            if any(t * size < LINE_BYTES and t < ext[a] for t, a, size in ((tu, u, x.itemsize),
                                                                          (tv, v, info.write.itemsize))):
                continue  # the copy's rows and the stores' rows are whole lines where the extents allow
            if tu * tv * x.itemsize > 16 * 1024:
                continue  # at most 16 KiB of tile: several blocks per SM overlap each other's barrier
            vector = _vector_width(info, v, tv)
            tx = tv // vector
            threads = tx * ty
            if tu % ty or tx < 8 or threads % WARP or not 64 <= threads <= 1024:
                continue
            bu, _ = box(info, u, v, tu, tv)
            yield {"tu": tu, "tv": tv, "ty": ty, "vector": vector, "pad": best_pad(bu, tx, vector, x.itemsize)}

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        tu, tv, ty, vector, pad = (int(point[k]) for k in ("tu", "tv", "ty", "vector", "pad"))
        found = transposed_operand(info)
        assert not isinstance(found, str)
        x, u, v = found
        ext = dict(info.spatial)
        tx = tv // vector
        threads = tx * ty
        blocks = -(-ext[u] // tu) * -(-ext[v] // tv)
        for name, e in info.spatial:
            if name not in (u, v):
                blocks *= e
        warps = blocks * threads / WARP
        rows = tu // ty                                      # rows of the tile per thread
        bu, bv = box(info, u, v, tu, tv)
        copies = -(-bu * bv // threads)                      # copy steps per thread
        assert x.offset is not None
        # the copy: element l of the flattened BV x BU box, row l // BU along v
        copy_lanes = [(l // bu) * x.offset.get(v) + l % bu for l in range(WARP)]
        copy_sectors, copy_lines = global_cost(copy_lanes, x.itemsize)
        copy_instr = warps * copies
        # the compute: lane (tx, ty) stores outputs (ty + r·TY, tx·V .. tx·V + V - 1)
        xs, ys = _warp_lanes(tx)
        lanes = {u: ys, v: [c * vector for c in xs]}
        store_instr = warps * rows
        l2 = copy_instr * copy_sectors * 32.0
        wavefronts = copy_instr * copy_lines
        loads = 0.0
        for access in info.reads + (info.write,):
            if access is x:
                continue
            if access.offset is None:
                sectors = lines = WARP
                width = 1
            else:
                width = vector if abs(access.offset.get(v)) == 1 else 1
                sectors, lines = global_cost(lane_offsets(access.offset, lanes), access.itemsize, width)
            instr = store_instr * vector / width
            l2 += instr * sectors * 32.0
            wavefronts += instr * lines
            if access is not info.write:
                loads += vector / width
        writes, reads, degree = phase_wavefronts(bu, tx, vector, pad, x.itemsize)
        smem_wavefronts = copy_instr * writes + store_instr * reads
        per_output = STORE_INSTRUCTIONS + loads + info.flops_per_iteration
        per_thread = copies * COPY_INSTRUCTIONS + rows * vector * per_output + SETUP_INSTRUCTIONS
        notes = [f"{tv}x{tu} tile of {x.buffer} staged in shared memory (rows padded by {pad}); a warp's copy load "
                 f"touches {copy_lines} line(s) of 128 B"]
        if degree > 1:
            notes.append(f"shared accesses {degree}-way bank conflicted")
        return Workload(
            blocks=blocks, threads=threads,
            registers={"addressing": ADDRESSING_REGISTERS, "copy": -(-copies * x.itemsize // 4), "values": 2 * vector},
            smem_bytes=bv * (bu + pad) * x.itemsize,
            flops=info.flops, fma_ops=float(info.outputs * info.flops_per_iteration),
            dram_bytes=compulsory_bytes(info), l2_bytes=l2, global_wavefronts=wavefronts,
            smem_wavefronts=smem_wavefronts, bank_conflict=float(degree), instructions=warps * per_thread,
            # the copy's loads (unrolled) are all issued before the barrier
            bytes_in_flight=float(copies * max(x.itemsize, copy_sectors * 32 / WARP)), ilp=float(rows),
            block_latency_cycles=550.0 + 40.0, notes=notes)

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        tu, tv, ty, vector, pad = (int(point[k]) for k in ("tu", "tv", "ty", "vector", "pad"))
        found = transposed_operand(info)
        assert not isinstance(found, str)
        x, u, v = found
        names = [name for name, _ in info.spatial]
        loops = dict(zip(names, sch.get_loops(info.stage)[:len(names)]))
        bu, rows, thread_y = sch.split(loops[u], factors=[None, tu // ty, ty])
        inner: list[Any] = []
        if vector > 1:
            bv, thread_x, lane = sch.split(loops[v], factors=[None, tv // vector, vector])
            inner = [lane]
        else:
            bv, thread_x = sch.split(loops[v], factors=[None, tv])
        others = [loops[name] for name in names if name not in (u, v)]
        sch.reorder(*others, bu, bv, thread_y, thread_x, rows, *inner)
        if info.symbolic:
            # a fused loop over a symbolic extent divides by it: not affine, so bind could not
            # prove its iterations independent; the tiles go on x, y and z instead
            block = bv
            if others:
                rest = others[0]
                for lp in others[1:]:
                    rest = sch.fuse(rest, lp)
                sch.bind(rest, "blockIdx.z")
            sch.bind(bu, "blockIdx.y")
            sch.bind(bv, "blockIdx.x")
        else:
            block = others[0] if others else bu
            for lp in others[1:] + ([bu] if others else []) + [bv]:
                block = sch.fuse(block, lp)
            sch.bind(block, "blockIdx.x")
        sch.bind(thread_y, "threadIdx.y")
        sch.bind(thread_x, "threadIdx.x")
        cache = sch.cache_read(info.stage, x.tensor, "shared")
        if pad:
            sch.storage_align(cache, pad)
        sch.compute_at(cache, block)
        bu, bv = box(info, u, v, tu, tv)
        if bu * bv > tv // vector * ty:
            sch.unroll(sch.get_loops(cache)[-1])  # the copy's steps: every load issued before the barrier
        sch.unroll(rows)
        for lp in inner:
            sch.vectorize(lp)

    def describe(self, point: Point) -> str:
        vector = f", {point['vector']} outputs per store" if int(point["vector"]) > 1 else ""
        return (f"transpose_tile(tile {point['tv']}x{point['tu']}, threads {int(point['tv']) // int(point['vector'])}"
                f"x{point['ty']}, shared rows padded by {point['pad']}{vector})")


register(TransposeTile())
