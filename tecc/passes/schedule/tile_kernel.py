"""The tiled tensor-core kernel: what the tensor-core primitives decided, and the base of the
code that emits the kernel from it.

Every tensor-core primitive (tensor_core.py: tensorize, stage_operand, pipeline,
pipeline_fragments, warp_specialize, split_k, tile_order, persistent, epilogue) is a pass over one
kernel that records its decision in the kernel's `TileSchedule` (attr "tensor_core") and emits
the kernel again from the whole record, so each step's dump shows the kernel it leaves. The
emitter is a stack of layers, one module and one concern each:

  TileKernel      tile_kernel.py      the block tile: grid, threads, names, batch indices, tile order
  TileStaging     tile_staging.py     operand tiles in shared memory: layouts, copies, element loads
  KernelEpilogue  epilogue.py         the fused tail: from registers, staged, or TMA stores
  SplitReduction  split_k.py          split-K: the partial tiles handed over, summed by the last part
  Pipeline        ring.py             the k-tile loop: unpipelined, cp.async ring, TMA ring, warp-specialized
  MmaKernel       tensorize.py        mma.sync: fragments, ldmatrix, mma (the intrinsic-table row)
  WgmmaKernel     tensorize_wgmma.py  wgmma: shared operands through descriptors, a register X (tf32)

Each layer reads the record (`self.t`), the matched contraction (`self.c`, implicit_gemm.py) and
the intrinsic-table row (`self.row`), and calls the layers above and below through methods whose
meaning its docstring states; a layer never tests which family it is in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ...ir import dtype as dt
from ...ir.arith import binary
from ...ir.expr import Const, Expr, Var, size_product
from ...ir.stmt import Allocate, Buffer, For, LetStmt, PrimFunc, Stmt
from .implicit_gemm import Contraction

LAYOUTS = ("swizzle", "none")      # an operand tile's shared layout (stage_operand)
PRODUCERS = ("cp.async", "tma")    # who fills the ring (pipeline)
EPILOGUES = ("registers", "staged", "tma", "threads")   # how the outputs leave (epilogue)
GROUP_M = 8                        # row tiles per group of the persistent grid's order


def int32(value: int) -> Expr:
    """An int32 constant (indices, extents)."""
    return Const(value, dt.int32)


def int32_shape(*dims: int) -> tuple[Expr, ...]:
    """A buffer shape of int32 constants."""
    return tuple(int32(d) for d in dims)


def ceil_div(a: Expr, b: int) -> Expr:
    """⌈a / b⌉ for a non-negative index `a` and a positive constant `b`."""
    return (a + (b - 1)) // b


def persistent_trips(units: Expr, block: Expr, blocks: int) -> Expr:
    """The work units block `block` of a persistent grid of `blocks` blocks takes when block p
    runs units p, p + P, p + 2P, ..: ⌈(units - p) / P⌉ (the GEMM's output tiles, `for_each_tile`;
    the attention kernel's (query block, head) items, passes/rewrite/online_mma_loop.py)."""
    return ceil_div(units - block, blocks)


def plus(index: Expr, offset: Expr | int) -> Expr:
    """index + offset, left as it is for the constant offset 0 (the first fragment set)."""
    if isinstance(offset, int) and offset == 0:
        return index
    return index + offset


def grouped_tile(local: Expr, rows: Expr, cols: Expr, group_m: int) -> tuple[Expr, Expr]:
    """(row tile, column tile) of tile number `local` of a rows x cols grid in the grouped order:
    group_m row tiles side by side sweep the column tiles together (column by column, the rows of
    the group fastest), then the next group (the last one may be shorter), so the blocks running
    at one time share A's row panels and B's column panels in L2 (the order of CUTLASS's and
    Triton's grouped GEMM tile schedulers)."""
    group = group_m * cols
    first_row = (local // group) * group_m
    height = binary("min", rows - first_row, int32(group_m))
    inner = local % group
    return first_row + inner % height, inner // height


@dataclass(frozen=True)
class BlockTile:
    """The block tile tensorize maps onto the intrinsic row: BM x BN outputs over a grid of
    warps_m x warps_n warps, k tiles of BK (what the tile checks of tensorize.py and
    tensorize_wgmma.py read; a TileSchedule has the same fields)."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int
    bk: int

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


@dataclass(frozen=True)
class TileSchedule:
    """What the tensor-core primitives decided for one tensorized stage (tensor_core.py). The
    fields after `bk` start at the kernel `tensorize` alone makes: operands copied element by
    element into plain shared tiles, one buffer (no ring), registers epilogue, one block per
    output tile. `lookahead` and `release` exist for tests only (a ring built one tile too far
    ahead; a warp-specialized ring without its releases: the emulator must report both)."""

    source: PrimFunc = field(repr=False, compare=False)   # the kernel as lowered: every step re-emits from it
    stage: str
    row: str                          # the intrinsic-table row (mma.sync or wgmma)
    contraction: Contraction = field(repr=False, compare=False)
    bm: int
    bn: int
    warps_m: int
    warps_n: int
    bk: int
    layouts: tuple[tuple[str, str], ...] = ()   # (operand role, layout) of each staged operand
    stages: int = 1                   # ring depth; 1: one buffer, copied before each k tile
    producer: str = "cp.async"
    fragment_pipeline: bool = False   # mma.sync: two fragment sets across the k steps (pipeline_fragments)
    warp_specialized: bool = False
    epilogue: str = "registers"
    group_m: int = 0                  # > 0: tiles in the grouped order (tile_order, persistent)
    persistent: int = 0               # > 0: that many blocks loop over the tiles
    lookahead: int | None = None
    release: bool = True
    splits: int = 1                   # > 1: the k tiles split among that many blocks (split_k.py)
    # split_k's global temporaries (the float32 partial tiles, the per-tile arrival counters),
    # made once by the primitive so that every later step's kernel names the same buffers
    split_buffers: tuple[Buffer, ...] = field(default=(), repr=False, compare=False)

    @property
    def threads(self) -> int:
        """Threads computing the tile (a warp-specialized kernel adds its producer warpgroup)."""
        return 32 * self.warps_m * self.warps_n

    @property
    def tm(self) -> int:
        return self.bm // self.warps_m // 16

    @property
    def tn(self) -> int:
        return self.bn // self.warps_n // 8

    @property
    def staged_output(self) -> bool:
        return self.epilogue == "staged"

    def layout(self, role: str) -> str | None:
        """The operand's staging layout, None while it is not staged."""
        return dict(self.layouts).get(role)

    def __str__(self) -> str:
        parts = [f"{self.stage}: {self.row} block {self.bm}x{self.bn} warps {self.warps_m}x{self.warps_n} "
                 f"k_tile {self.bk}"]
        if self.layouts:
            parts.append("staged " + ", ".join(f"{role} ({layout})" for role, layout in self.layouts))
        if self.stages > 1:
            parts.append(f"pipeline {self.stages} stages ({self.producer})"
                         + (" fragments pipelined" if self.fragment_pipeline else ""))
        if self.warp_specialized:
            parts.append("warp-specialized")
        if self.splits > 1:
            parts.append(f"split-K {self.splits}")
        if self.persistent:
            parts.append(f"persistent {self.persistent} blocks (group_m {self.group_m})")
        elif self.group_m:
            parts.append(f"tile order group_m {self.group_m}")
        if self.epilogue != "registers":
            parts.append(f"epilogue {self.epilogue}")
        return "; ".join(parts)


class TileKernel:
    """The block tile of a tensorized stage: blocks over (batch, row tiles, column tiles), one
    threadIdx.x loop, the warp coordinates, the batch indices of the block, loop names kept
    unique, and the order the output tiles are visited in (tile_order, persistent). The layers
    above fill the body (`dispatch`), its buffers (`buffers`) and the summary."""

    # set by the family's fragment_buffers: the accumulator fragments and their layout map
    # (lane, element) -> (row, column)
    frag_c: Buffer
    c_map: Callable[[Any, Any], tuple[Any, Any]]
    # the wgmma kernels' warpgroup index, consumer warpgroups (tensorize_wgmma.py)
    warpgroup: Expr
    consumers: int

    def __init__(self, schedule: TileSchedule) -> None:
        t = self.t = schedule
        self.func, self.c, self.row = schedule.source, schedule.contraction, schedule.row
        c = self.c
        # names that meet a parameter's are made distinct by unique_names before codegen
        self.bz, self.by, self.bx = Var("block_batch"), Var("block_row"), Var("block_col")
        self.tx, self.kt = Var("thread"), Var("k_tile")
        self.lane, warp = self.tx % 32, self.tx // 32
        self.warp_m, self.warp_n = warp // t.warps_n, warp % t.warps_n
        self.k_tiles = ceil_div(c.kext, t.bk)
        # split-K (split_k.py): block_split takes k tiles k_base .. k_base + k_tiles - 1 of each
        # output tile, every split as many (those past K are zero-filled and add nothing)
        self.split: Expr = Const(0, dt.int32)
        self.k_base: Expr = Const(0, dt.int32)
        if t.splits > 1:
            self.k_tiles = ceil_div(self.k_tiles, t.splits)
            self.split = Var("block_split")
            self.k_base = self.split * self.k_tiles
        self.block_id, self.tile_iter = Var("block_id"), Var("tile_iter")
        self.fragments = self.fragment_buffers()
        # batch indices of this block (several batch axes share blockIdx.z, unflattened)
        self.batch_index: dict[str, Expr] = {}
        rest: Expr = self.bz
        for n, (bv, ext) in enumerate(reversed(c.batch)):
            last = n == len(c.batch) - 1
            self.batch_index[bv.name] = rest if last else rest % ext
            rest = rest // ext
        self.names: dict[str, int] = {}

    def fragment_buffers(self) -> tuple[Buffer, ...]:
        """The per-lane fragment buffers (the family's: mma.sync or wgmma); `frag_c` holds the
        accumulators, laid out by `c_map`."""
        raise NotImplementedError

    def fresh_var(self, name: str) -> Var:
        """A loop variable named uniquely in the kernel (primitives address loops by name): the
        second `copy_a` is `copy_a1`."""
        n = self.names.get(name, 0)
        self.names[name] = n + 1
        return Var(name if n == 0 else f"{name}{n}")

    def unrolled(self, name: str, extent: int, body: Callable[[Var], Stmt]) -> Stmt:
        """An unrolled loop whose variable is named uniquely in the kernel (`fresh_var`)."""
        v = self.fresh_var(name)
        return For(v, int32(0), int32(extent), "unroll", body(v))

    def kernel(self) -> PrimFunc:
        """The kernel: the main loops (`dispatch`) under their buffers' allocations, the thread
        loop and the grid; the attr "tensorize" says what was built. split_k's temporaries
        join the parameters after the lowered kernel's buffers."""
        body = self.dispatch()
        for buf in self.buffers():
            body = Allocate(buf, body)
        params = self.func.params
        if self.t.split_buffers:
            buffers = tuple(p for p in params if isinstance(p, Buffer))
            params = buffers + self.t.split_buffers + tuple(p for p in params if not isinstance(p, Buffer))
        return PrimFunc(self.func.name, params, self.grid(body), self.func.attrs + (("tensorize", self.summary()),))

    def dispatch(self) -> Stmt:
        raise NotImplementedError

    def buffers(self) -> list[Buffer]:
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError

    def block_threads(self) -> int:
        """Threads per block (the record's, plus a producer warpgroup when warp-specialized)."""
        return self.t.threads

    # ---- the grid and the order of the output tiles -------------------------------------------
    def grid(self, body: Stmt) -> Stmt:
        """`body` under the thread loop and the block loops: blockIdx.y over row tiles and .x over
        column tiles (.z over the batch); with a grouped tile order (`group_m`), one blockIdx.x
        over every output tile bound to (block_row, block_col) in that order; in a persistent
        grid, P blocks whose tiles the body loops over itself (`for_each_tile`)."""
        c, t = self.c, self.t
        threads = int32(self.block_threads())
        if t.persistent:
            return For(self.block_id, int32(0), int32(t.persistent), "blockIdx.x",
                       For(self.tx, int32(0), threads, "threadIdx.x", body))
        # blockIdx.z: the batch; with split-K the split, or (batch, split) with the split fastest
        z: Var = self.bz
        if t.splits > 1 and c.batch:
            z = Var("block_z")
            body = LetStmt(self.bz, z // t.splits, LetStmt(self.split, z % t.splits, body))
        elif t.splits > 1:
            assert isinstance(self.split, Var)
            z = self.split
        if t.group_m:
            rows, cols = ceil_div(c.m, t.bm), ceil_div(c.n, t.bn)
            tile = Var("block_tile")
            row, col = grouped_tile(tile, rows, cols, t.group_m)
            out: Stmt = For(self.tx, int32(0), threads, "threadIdx.x",
                            LetStmt(self.by, row, LetStmt(self.bx, col, body)))
            out = For(tile, int32(0), rows * cols, "blockIdx.x", out)
        else:
            out = For(self.tx, int32(0), threads, "threadIdx.x", body)
            out = For(self.bx, int32(0), ceil_div(c.n, t.bn), "blockIdx.x", out)
            out = For(self.by, int32(0), ceil_div(c.m, t.bm), "blockIdx.y", out)
        if c.batch or t.splits > 1:
            batches = size_product([ext for _, ext in c.batch]) if c.batch else int32(1)
            out = For(z, int32(0), batches * t.splits if t.splits > 1 else batches, "blockIdx.z", out)
        return out

    def tiles(self) -> Expr:
        """The output tiles of the grid (every batch's)."""
        c, t = self.c, self.t
        total = ceil_div(c.m, t.bm) * ceil_div(c.n, t.bn)
        return total * size_product([ext for _, ext in c.batch]) if c.batch else total

    def work_units(self) -> Expr:
        """What the persistent grid's blocks loop over: the output tiles, times the splits."""
        return self.tiles() * self.t.splits if self.t.splits > 1 else self.tiles()

    def output_tile_number(self) -> Expr:
        """The number of this block's output tile, batch-major then row tile then column tile
        (split_k's counters and partials are per output tile)."""
        c, t = self.c, self.t
        tile = self.by * ceil_div(c.n, t.bn) + self.bx
        if c.batch:
            tile = self.bz * (ceil_div(c.m, t.bm) * ceil_div(c.n, t.bn)) + tile
        return tile

    def k_index(self, kt: Expr) -> Expr:
        """The k tile of the operands that this block's k iteration `kt` loads (split-K: its
        split's first k tile onwards)."""
        return kt if self.t.splits == 1 else self.k_base + kt

    def for_each_tile(self, body: Stmt) -> Stmt:
        """`body` once per output tile of this block (the persistent grid: tiles block_id,
        block_id + P, ...), with block_row / block_col / block_batch bound to the tile in the
        grouped order: group_m row tiles side by side sweep the column tiles together, so the
        blocks running at one time share A's row panels and B's column panels in L2."""
        t = self.t
        if not t.persistent:
            return body
        c = self.c
        rows, cols = ceil_div(c.m, t.bm), ceil_div(c.n, t.bn)
        unit = self.block_id + self.tile_iter * t.persistent
        # split-K: the splits of one output tile are consecutive units (they run at one time)
        tile = unit // t.splits if t.splits > 1 else unit
        per_batch = rows * cols
        local = tile % per_batch if c.batch else tile
        row, col = grouped_tile(local, rows, cols, t.group_m)
        bound = LetStmt(self.by, row, LetStmt(self.bx, col, body))
        if c.batch:
            bound = LetStmt(self.bz, tile // per_batch, bound)
        if t.splits > 1:
            bound = LetStmt(self.split, unit % t.splits, bound)
        return For(self.tile_iter, int32(0), persistent_trips(self.work_units(), self.block_id, t.persistent), "serial",
                   bound)

    def ring_index(self, kt: Expr) -> Expr:
        """The ring's running k-tile count: k tiles of earlier tiles of this block, then kt."""
        return self.tile_iter * self.k_tiles + kt if self.t.persistent else kt


__all__ = ["EPILOGUES", "GROUP_M", "LAYOUTS", "PRODUCERS", "BlockTile", "TileKernel", "TileSchedule", "ceil_div",
           "grouped_tile", "int32", "int32_shape", "persistent_trips", "plus"]
