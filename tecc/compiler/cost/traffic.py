"""Memory traffic of the simple mappings: one thread per output element (or per vector of them).

Used by the naive, elementwise and generic-reduction strategies. For each global read of the
kernel, the lanes of a warp take consecutive output elements (the fused spatial index, `vector`
elements per lane); the reduction loop runs inside the thread. From the affine offsets:

  warp instructions  outputs / (32 · vector) per reduction iteration (a read that does not
                     depend on the reduction variables is loaded once per thread)
  sectors, lines     of one warp instruction (tecc.compiler.cost.warp.global_cost)
  L2 bytes           sectors · 32 per instruction, divided by the reuse of a sector over
                     consecutive reduction iterations (its stride in bytes below 32: the L1 keeps it)
  L1 wavefronts      lines per instruction; a scattered read of a map (several lines, one sector
                     of each: a permute's strided lanes) SCATTERED_LINE_CYCLES per line
  DRAM bytes         every buffer once (compulsory), plus the L2 traffic beyond that in
                     proportion to how much of the reused footprint does not fit in half of L2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ...ir.target import Target
from .analysis import Access, Affine, KernelInfo, row_major_strides
from .warp import WARP, global_cost, lane_offsets

# L1/shared pipe cycles per line of a scattered warp read (several lines, one 32-byte sector of
# each) in a kernel without a reduction loop, where a coalesced line takes one. Fitted to the H200
# times of elementwise permutes (transposes_h200_s24.json, transposes_near_h200_s25.json,
# docs/memory-bound.md "Transposes"): at one cycle per line their predictions were 0.47-0.79 of
# the measured times wherever the L1 term bound them (each such line misses L1 and is a separate
# request to L2), which ranked elementwise ahead of a tiled transpose that the H200 ran
# 1.3-1.4x faster; at two, the 18 times are predicted at 0.60-1.54 (geometric mean 1.04).
# Reduction loops keep one cycle (not measured; a thread's row reuses its sectors in L1).
SCATTERED_LINE_CYCLES = 2.0


@dataclass
class Traffic:
    l2_bytes: float = 0.0
    dram_bytes: float = 0.0
    wavefronts: float = 0.0
    load_instructions: float = 0.0
    sectors_per_request: float = 0.0      # of the main read, for explain
    worst_lines: int = 0
    sector_bytes_per_lane: float = 0.0    # DRAM-level bytes one lane's loads request per iteration


def unravel_lanes(info: KernelInfo, vector: int, lane_stride: int = 1) -> dict[str, list[int]]:
    """Values of each spatial variable in the 32 lanes when lane l takes the flat output index
    l · lane_stride · vector (row-major over the spatial loops)."""
    out: dict[str, list[int]] = {v: [] for v, _ in info.spatial}
    for lane in range(WARP):
        flat = lane * lane_stride * vector
        for v, e in reversed(info.spatial):
            out[v].append(flat % max(e, 1))
            flat //= max(e, 1)
    return out


def buffer_bytes(a: Access) -> int:
    n = a.itemsize
    for d in a.dims:
        n *= d
    return n


def footprint_bytes(info: KernelInfo, a: Access) -> int:
    """The bytes of `a`'s buffer the kernel can touch: the whole buffer, except for a gather
    (`W[idx[i], j]`), which touches at most one element per value of its index variables -- a
    32-byte sector each unless the affine part walks the row with unit stride -- so an embedding
    of 8192 tokens reads 8192 rows, not the 50257 of its table."""
    whole = buffer_bytes(a)
    if a.offset is not None or a.gathered is None:
        return whole
    extents = dict(info.spatial + info.reduction)
    count = 1
    for v in set(a.gathered.vars) | a.gather_vars:
        count *= extents.get(v, 1)
    contiguous = any(abs(c) == 1 for _, c in a.gathered.coeff)
    return min(whole, count * (a.itemsize if contiguous else max(a.itemsize, 32)))


def compulsory_bytes(info: KernelInfo) -> float:
    seen: dict[str, int] = {}
    for a in info.reads:
        seen[a.buffer] = max(seen.get(a.buffer, 0), footprint_bytes(info, a))
    return float(sum(seen.values()) + info.outputs * info.write.itemsize)


def dram_from_l2(info: KernelInfo, l2_bytes: float, target: Target) -> float:
    """Compulsory bytes, plus the re-read traffic that misses in L2."""
    base = compulsory_bytes(info)
    extra = max(0.0, l2_bytes - base)
    footprint = sum(footprint_bytes(info, a) for a in {a.buffer: a for a in info.reads}.values())
    usable = 0.5 * target.l2_bytes
    miss = 0.0 if footprint <= usable else 1.0 - usable / footprint
    return base + extra * miss


def gathered_cost(a: Access, lanes: dict[str, list[int]], vector: int) -> tuple[int, int]:
    """(sectors, lines) of one warp instruction of a gather (`W[idx[i], j]`): the lanes that
    share the values of the gather's variables read one unknown row, at the affine offsets of the
    other dimensions; different rows are taken to be different lines (random indices into a
    large table). So a warp along the affine fastest axis of one row is as coalesced as a plain
    row read, and a warp spread over rows pays a sector (or more) per row."""
    assert a.gathered is not None
    groups: dict[tuple[int, ...], list[int]] = {}
    offsets = lane_offsets(a.gathered, lanes)
    for lane in range(WARP):
        key = tuple(lanes[v][lane] if v in lanes else 0 for v in sorted(a.gather_vars))
        groups.setdefault(key, []).append(offsets[lane])
    sectors = lines = 0
    for group in groups.values():
        s, ln = global_cost(group, a.itemsize, vector)
        sectors += s
        lines += ln
    return sectors, lines


def split_lane_offsets(a: Access, lanes: Mapping[str, Sequence[int]], shift: str = "") -> list[int]:
    """The element offset each lane reads where the access's indices are affine or an affine
    index // or % a constant (`Access.split_dims`: a view that merges or splits dimensions, e.g.
    the heads of [B, H, S, D] read as [B, S, H·D]), with the variable `shift` one past the lane's
    value (the next element of a vector)."""
    strides = row_major_strides(a.dims)
    moved = {v: [x + 1 for x in vals] for v, vals in lanes.items() if v == shift}
    at = {**lanes, **moved}
    out = [0] * WARP
    for (inner, op, c), st in zip(a.split_dims, strides):
        values = lane_offsets(Affine(inner.coeff, inner.const), at)
        for lane, x in enumerate(values):
            out[lane] += st * (x // c if op == "//" else x % c if op == "%" else x)
    return out


def one_thread_per_output(info: KernelInfo, target: Target, vector: int = 1) -> Traffic:
    """The traffic of one thread per output (`vector` consecutive outputs each), found once per
    KernelInfo, Target and vector (every point of the simple strategies asks): the Traffic is
    shared, its reader must not change it."""
    memo: dict[tuple[int, int], tuple[Target, Traffic]] = info.__dict__.setdefault("_one_thread_traffic", {})
    hit = memo.get((id(target), vector))
    if hit is None or hit[0] is not target:
        hit = memo[(id(target), vector)] = (target, _one_thread_per_output(info, target, vector))
    return hit[1]


def _one_thread_per_output(info: KernelInfo, target: Target, vector: int = 1) -> Traffic:
    lanes = unravel_lanes(info, vector)
    reduce_vars = {v for v, _ in info.reduction}
    vec_var = info.spatial[-1][0] if info.spatial else ""
    warps = info.outputs / (WARP * vector)
    t = Traffic()
    for a in info.reads:
        known = a.offset if a.offset is not None else a.gathered
        if a.offset is not None:
            vec = vector if abs(a.offset.get(vec_var)) == 1 else 1
            sectors, lines = global_cost(lane_offsets(a.offset, lanes), a.itemsize, vec)
        elif a.gathered is not None:
            vec = vector if abs(a.gathered.get(vec_var)) == 1 else 1
            sectors, lines = gathered_cost(a, lanes, vec)
        elif a.split_dims:
            offsets = split_lane_offsets(a, lanes)
            unit = [o + 1 for o in offsets] == split_lane_offsets(a, lanes, vec_var)
            vec = vector if unit else 1
            sectors, lines = global_cost(offsets, a.itemsize, vec)
        else:
            sectors, lines = WARP, WARP
        if a.split_dims:
            uses_reduce = bool(set().union(*a.index_vars) & reduce_vars)
            loads_per_lane = 1 if vec == vector else vector
        else:
            uses_reduce = known is None or bool((set(known.vars) | a.gather_vars) & reduce_vars)
            loads_per_lane = 1 if (known is not None and abs(known.get(vec_var)) == 1) else vector
        per_thread = info.reduce_extent if uses_reduce else 1
        instr = warps * per_thread * loads_per_lane
        reuse = 1.0
        if uses_reduce and a.offset is not None and info.reduction:
            stride = abs(a.offset.get(info.reduction[-1][0])) * a.itemsize
            if 0 < stride < 32:
                reuse = 32.0 / stride
        t.l2_bytes += instr * sectors * 32 / reuse
        scattered = not info.reduction and a.offset is not None and 1 < lines and sectors <= lines
        t.wavefronts += instr * lines * (SCATTERED_LINE_CYCLES if scattered else 1.0)
        t.load_instructions += instr
        if uses_reduce or not info.reduction:
            t.sector_bytes_per_lane += sectors * 32 / WARP
        t.worst_lines = max(t.worst_lines, lines)
        if a is max(info.reads, key=buffer_bytes):
            t.sectors_per_request = sectors
    w_sectors, w_lines = (global_cost(lane_offsets(info.write.offset, lanes), info.write.itemsize, vector)
                          if info.write.offset is not None else (WARP, WARP))
    t.l2_bytes += warps * w_sectors * 32
    t.wavefronts += warps * w_lines
    t.dram_bytes = dram_from_l2(info, t.l2_bytes, target)
    return t


__all__ = ["SCATTERED_LINE_CYCLES", "Traffic", "compulsory_bytes", "footprint_bytes", "gathered_cost", "dram_from_l2", "one_thread_per_output", "unravel_lanes", "buffer_bytes"]
