"""transpose_tile: a permutation of axes whose output's fastest axis reads a slow axis of the input,
through a shared-memory tile (padded, or swizzled with 16-byte copies).

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
            consecutive elements (or 16-byte chunks) of X's rows
  the tile  padded rows (storage_align by `best_pad`, element copies, V = 1 or 2 16-bit outputs
            per store), or for 1- and 2-byte elements a swizzle (vector_copy of 16 bytes,
            storage_swizzle, rows padded to a power of two where the box is narrower than the
            tile, V outputs of 8 or 16 bytes per store): tecc.compiler.strategies.transpose_geometry
  unroll    the rows of a thread and the copy's steps (its loads all in flight before the
            barrier); vectorize the V outputs of a thread

Each element is read from DRAM once and written once: the predicted DRAM traffic is the tensor's
bytes twice (compulsory), where elementwise's was ~3x more. The Workload prices the copy's and
the stores' sectors and lines per warp (tecc.compiler.cost.warp), every warp memory instruction at
least LSU_CYCLES of the L1/shared pipe, the shared wavefronts of both phases (bank conflicts
counted), the overlap lost between that pipe and DRAM (OVERLAP_LOSS), a barrier per block, the
loads a thread has in flight, and the issue of ~COPY_INSTRUCTIONS per copy chunk and
~LOAD_INSTRUCTIONS per stored element. Both constants come from the H200 log of the padded tiles
(docs/cost-model.md, "Overlap"): a 2-byte element copied and stored alone costs the pipe twice
what a 16-byte copy does per byte, so 16- and 8-bit transposes take the swizzled tile.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import Access, KernelInfo
from ..cost.model import Workload
from ..cost.traffic import compulsory_bytes
from ..cost.warp import WARP, global_cost, lane_offsets
from ...codegen.vectorize import vector_widths
from ...ir.dtype import as_dtype
from .registry import Point, Strategy, register
from .transpose_geometry import WIDE_BYTES, TileShape, best_pad, phase_wavefronts, wide_tile

TILES = (16, 32, 64, 128)     # TU (along X's contiguous axis) and TV (along the output's)
LINE_BYTES = 128              # a tile row narrower than a line is offered only for a narrower extent
THREAD_ROWS = (1, 2, 4, 8, 16, 32)
WIDE_THREAD_ROWS = (8, 16, 32, 64, 128)   # TY of the wide points (TX = TV / V is 2..8 there)
WIDE_ROW_GROUPS = (2, 4, 8)   # TX of a wide point: row groups a warp reads, at most the 8 chunk positions of 128 B
STORE_BYTES = (8, 16)         # a wide point's outputs per thread and store: 8 or 16 bytes
# issued instructions per element (estimates, per thread): the copy's address, bounds select,
# LDG, STS; the compute's LDS, STG (one per vector) and its address
COPY_INSTRUCTIONS = 5.0      # per copy chunk: address, bounds select, LDG, STS
LOAD_INSTRUCTIONS = 2.0      # per output: its LDS from the tile and the LDS's address
STORE_INSTRUCTIONS = 1.0     # per row of V outputs: the STG (its address is the row's)
# the L1/shared pipe takes every warp-level memory instruction for 2 SM cycles at least, however few
# bytes it moves: the H200 log of the fp8 8192² transpose (benchmarks/RESULTS.md), whose 1-byte
# copies and stores ran at 2.0 cycles per memory instruction per SM where one wavefront each
# predicted half the time (docs/memory-bound.md, "Transposes")
LSU_CYCLES = 2.0
# the fraction of the smaller of the DRAM and L1/shared times that does not overlap the other
# (Workload.overlap_loss): 0.1-0.4 over the 8192² / 4096² fp32 and fp16 points of that log, 0.2 taken
OVERLAP_LOSS = 0.2
SETUP_INSTRUCTIONS = 30.0     # per thread: the block's tile origin (div/mod of blockIdx.x), barrier, exit
# The DRAM rate a tiled transpose reaches by the shape of its block (Workload.dram_efficiency),
# fitted to the H200 log of 14 transposes x 5-6 tilings each (benchmarks/RESULTS.md, common ops,
# docs/memory-bound.md "Transposes"), where every point was predicted DRAM-bound within a few
# percent of the others and the planner's pick ran at 75-94% of copy while the best tiling ran at
# 94-99%: relative to the best point of 8 warps in the same transpose, blocks of 2 warps measured
# a median 0.955 of its rate, 4 warps 0.96, 16 warps 0.92 (BLOCK_WARPS_RATE; 8 warps was the
# best or within 2% of the best in every transpose), and at equal warps a thread's longer serial
# walk (its copy chunks plus its stored rows, `serial`) lost about SERIAL_LOSS per doubling above
# SERIAL_STEPS (32x32 tiles of 8 warps over 64x32 / 32x64 ones of 2 warps: 0.96-1.09 vs
# 0.89-0.96 of copy, fp32). The physics is not modeled (DRAM page locality of many small tiles in
# flight is the likeliest cause); the fit picks the measured best of 12 of the 14 transposes.
BLOCK_WARPS_RATE = {2: 0.955, 4: 0.96, 8: 1.0}
WIDE_BLOCK_RATE = 0.92        # 16 warps and more
SERIAL_LOSS = 0.04
SERIAL_STEPS = 8
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


def block_rate(threads: int, serial: int) -> float:
    """The fraction of the DRAM rate a transpose block of `threads` threads reaches when each of
    its threads issues `serial` memory instructions one after another (copy chunks and stored
    rows): BLOCK_WARPS_RATE, less SERIAL_LOSS per doubling of `serial` above SERIAL_STEPS."""
    warps = threads // WARP
    rate = BLOCK_WARPS_RATE.get(warps, WIDE_BLOCK_RATE if warps > 8 else BLOCK_WARPS_RATE[2])
    return 1.0 / (1.0 / rate + SERIAL_LOSS * max(0.0, math.log2(serial / SERIAL_STEPS)))


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


def _wide_copy(info: KernelInfo, x: Access, u: str) -> int:
    """C: the elements of X a wide copy moves per lane (16 bytes), or 0 where the tile is copied
    an element at a time: 4- and 8-byte elements (scalar copies already move 128 bytes per warp),
    symbolic sizes, and rows of X that are not a whole number of chunks (a chunk would straddle
    two rows and lose its alignment)."""
    copy = WIDE_BYTES // x.itemsize
    if x.itemsize > 2 or info.symbolic or not x.dtype or copy not in vector_widths(as_dtype(x.dtype)):
        return 0
    return copy if dict(info.spatial)[u] % copy == 0 else 0


def _wide_points(info: KernelInfo, x: Access, u: str, v: str, copy: int) -> Iterable[Point]:
    """The swizzled-tile points: V outputs of 8 or 16 bytes per thread and store, TX = TV / V
    row groups per warp (2..8, one chunk position each), TY thread rows; both phases
    conflict-free (`wide_tile`)."""
    ext = dict(info.spatial)
    out = info.write
    for tu, tv, store_bytes, ty in product(TILES, TILES, STORE_BYTES, WIDE_THREAD_ROWS):
        vector = store_bytes // out.itemsize
        if (vector < 2 or not out.dtype or vector not in vector_widths(as_dtype(out.dtype)) or tv % vector
                or ext[v] % vector or tv >= 2 * ext[v]):
            continue  # whole vectors: the split guard of an edge tile decides a vector's lanes at once
        tx = tv // vector
        threads = tx * ty
        if tx not in WIDE_ROW_GROUPS or threads % WARP or not 64 <= threads <= 1024 or tu % ty:
            continue
        if (tu > ext[u] and tu >= 2 * ext[u]) or (tu * x.itemsize < LINE_BYTES and tu < ext[u]):
            continue  # rows of whole 128-byte lines where the extent allows, at most half of them idle
        if tv * out.itemsize < LINE_BYTES and tv < ext[v]:
            continue
        if tu * tv * x.itemsize > 16 * 1024:
            continue
        bu, bv = box(info, u, v, tu, tv)
        tile = wide_tile(bu, bv, tu, tx, ty, vector, x.itemsize)
        if tile is not None:
            yield {"tu": tu, "tv": tv, "ty": ty, "vector": vector, "pad": tile.pad, "copy": copy, "bits": tile.bits}


def tile_of(info: KernelInfo, x: Access, u: str, v: str, point: Point) -> TileShape:
    """The tile a point stages (padded rows, or a swizzle with 16-byte copies)."""
    tu, tv, ty, vector, pad = (int(point[k]) for k in ("tu", "tv", "ty", "vector", "pad"))
    bu, bv = box(info, u, v, tu, tv)
    return TileShape(bu, bv, tv // vector, ty, vector, int(point.get("copy", 1)), pad, int(point.get("bits", 0)),
                     x.itemsize)


class TransposeTile(Strategy):
    name = "transpose_tile"
    description = ("permutation of axes (transpose): the input tile staged in shared memory (padded rows, or a "
                   "swizzle with 16-byte copies), both sides coalesced")
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
        copy = _wide_copy(info, x, u)
        if copy:
            yield from _wide_points(info, x, u, v, copy)

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        found = transposed_operand(info)
        assert not isinstance(found, str)
        x, u, v = found
        tile = tile_of(info, x, u, v, point)
        tu, tv = int(point["tu"]), int(point["tv"])
        ext = dict(info.spatial)
        tx, vector, threads = tile.tx, tile.vector, tile.threads
        blocks = -(-ext[u] // tu) * -(-ext[v] // tv)
        for name, e in info.spatial:
            if name not in (u, v):
                blocks *= e
        warps = blocks * threads / WARP
        rows = tu // tile.ty                                 # rows of the tile per thread
        per_row = tile.bu // tile.copy                       # copy chunks per row of the box
        copies = -(-per_row * tile.bv // threads)            # copy steps per thread
        assert x.offset is not None
        # the copy: chunk l of the flattened BV x BU box, row l // (BU / C) along v
        copy_lanes = [(lane // per_row) * x.offset.get(v) + (lane % per_row) * tile.copy for lane in range(WARP)]
        copy_sectors, copy_lines = global_cost(copy_lanes, x.itemsize, tile.copy)
        copy_instr = warps * copies
        # the compute: lane (tx, ty) stores outputs (ty + r·TY, tx·V .. tx·V + V - 1)
        xs, ys = _warp_lanes(tx)
        lanes = {u: ys, v: [c * vector for c in xs]}
        store_instr = warps * rows
        l2 = copy_instr * copy_sectors * 32.0
        # every warp memory instruction holds the L1/shared pipe LSU_CYCLES at least
        wavefronts = copy_instr * max(copy_lines, LSU_CYCLES)
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
            wavefronts += instr * max(lines, LSU_CYCLES)
            if access is not info.write:
                loads += vector / width
        writes, w_degree = tile.copy_wavefronts()
        reads, r_degree = tile.read_wavefronts()
        degree = max(w_degree, r_degree)
        smem_wavefronts = copy_instr * max(writes, LSU_CYCLES) + store_instr * max(reads, vector * LSU_CYCLES)
        per_row_instr = vector * (LOAD_INSTRUCTIONS + loads + info.flops_per_iteration) + STORE_INSTRUCTIONS
        per_thread = copies * COPY_INSTRUCTIONS + rows * per_row_instr + SETUP_INSTRUCTIONS
        copy_bytes = tile.copy * x.itemsize
        if tile.copy > 1:
            registers = {"addressing": ADDRESSING_REGISTERS, "copy": copies * copy_bytes // 4,
                         "values": vector + -(-vector * info.write.itemsize // 4)}
            notes = [f"{tv}x{tu} tile of {x.buffer} in shared memory through {tile.swizzle}, copied in "
                     f"{copy_bytes}-byte chunks; {vector} outputs per store"]
        else:
            registers = {"addressing": ADDRESSING_REGISTERS, "copy": -(-copies * x.itemsize // 4), "values": 2 * vector}
            notes = [f"{tv}x{tu} tile of {x.buffer} staged in shared memory (rows padded by {tile.pad}); a warp's copy "
                     f"load touches {copy_lines} line(s) of 128 B"]
        if degree > 1:
            notes.append(f"shared accesses {degree}-way bank conflicted")
        return Workload(
            blocks=blocks, threads=threads, registers=registers,
            smem_bytes=tile.smem_elements() * x.itemsize,
            flops=info.flops, fma_ops=float(info.outputs * info.flops_per_iteration),
            dram_bytes=compulsory_bytes(info), l2_bytes=l2, global_wavefronts=wavefronts,
            smem_wavefronts=smem_wavefronts, bank_conflict=float(degree), instructions=warps * per_thread,
            # the copy's loads (unrolled) are all issued before the barrier
            bytes_in_flight=float(copies * max(copy_bytes, copy_sectors * 32 / WARP)), ilp=float(rows),
            block_latency_cycles=550.0 + 40.0, overlap_loss=OVERLAP_LOSS,
            dram_efficiency=block_rate(threads, copies + rows), notes=notes)

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        found = transposed_operand(info)
        assert not isinstance(found, str)
        x, u, v = found
        tile = tile_of(info, x, u, v, point)
        tu, tv, ty, vector = int(point["tu"]), int(point["tv"]), tile.ty, tile.vector
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
        if tile.pad:
            sch.storage_align(cache, tile.pad)
        layout = tile.swizzle
        if layout is not None:
            sch.vector_copy(cache, tile.copy)
            sch.storage_swizzle(cache, layout.bits, layout.base, layout.shift)
        sch.compute_at(cache, block)
        if tile.bu * tile.bv // tile.copy > tile.threads:
            # the copy's steps (the loop outside its vector of C elements): every load issued before the barrier
            sch.unroll(sch.get_loops(cache)[-2 if tile.copy > 1 else -1])
        sch.unroll(rows)
        for lp in inner:
            sch.vectorize(lp)

    def describe(self, point: Point) -> str:
        tx = f"{int(point['tv']) // int(point['vector'])}x{point['ty']}"
        vector = f", {point['vector']} outputs per store" if int(point["vector"]) > 1 else ""
        if int(point.get("copy", 1)) > 1:
            pad = f", rows padded by {point['pad']}" if int(point["pad"]) else ""
            return (f"transpose_tile(tile {point['tv']}x{point['tu']}, threads {tx}, {point['copy']}-element copies "
                    f"into a swizzled tile ({point['bits']} bits{pad}){vector})")
        return f"transpose_tile(tile {point['tv']}x{point['tu']}, threads {tx}, shared rows padded by {point['pad']}{vector})"


register(TransposeTile())

__all__ = ["TransposeTile", "best_pad", "block_rate", "box", "phase_wavefronts", "tile_of", "transposed_operand"]
