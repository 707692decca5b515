"""The online contraction on tensor cores: both contractions of the chain as mma.sync tiles.

The chain is the one `online_chain` recognises (tecc.passes.rewrite.online_contraction: a row max
m, a row sum l of exp(s - m), and O = g(Σ_j exp(s - m)·v, m, l)). This module builds its
FlashAttention-2-shaped kernel (Dao, "FlashAttention-2", 2023) when both contractions fit the
m16n8k16 rows of the intrinsic table:

    s(r, j) = f(Σ_d Q[.., i, d] · K[.., j, d], r, j)     Q, K float16 or bfloat16, d a constant:
                                                         16, 32, 64, 96 or 128 (and 256 in the
                                                         Hopper form)
    v(r, j, c) = V[.., j, c]                             V float16 or bfloat16, c likewise

where the leading indices (`..`) are any expressions of the leading row axes (grouped heads
K[b, h // G, ..] are index expressions), and f is any elementwise expression of the contraction
(a scale, `where` masks, a bias, a boolean mask tensor). Anything else raises ScheduleError
naming the condition, and the SIMT kernel of online_contraction serves the chain instead.

The kernel. One block per (head, BM query rows); warp w owns `warp_rows` (16 or 32) of them,
one or two m16 tiles that share every K and V fragment the warp loads. Per block:

1. Q tile [BM][D] -> shared (16-byte cp.async, zero past the rows), then ldmatrix.x4 into A
   fragments that stay in registers for the whole key loop.
2. K and V tiles [BN][D], [BN][C] of consecutive keys stream through a ring of 2 stages in
   swizzled shared memory (tile_staging's `row_swizzle`, 16-byte cp.async zero-filling keys past the
   end); tile kt + 1 is in flight while tile kt is computed.
3. S = Q Kᵀ: mma.m16n8k16 into float32 C fragments (K is [n][k] in shared: plain ldmatrix
   gives the B fragments).
4. Each accumulator element, at (row, col) of the C fragment's layout map, becomes
   t = log2(e) · f(acc, row, key) (when the kept f is `acc · c`, c > 0, the fragment keeps the
   raw acc or -inf instead and the max is scaled once per row: each weight is then one FFMA and
   one ex2), so exp(s - m) = exp2(t - m₂) with m₂ = max t is one subtraction and one
   `exp2_approx` (ex2.approx.ftz.f32, one MUFU.EX2: relative error about 2^-22, far below the
   rounding of P to 16 bits that follows; subnormal weights flush to 0). Keys past the end are
   -inf. Elements that read tensors (a bias, a mask) are guarded by row and key bounds.
5. The running max m₂ and sum l per row: a lane holds rows g and g + 8 of its warp's 16 (g =
   lane // 4) at columns 2t, 2t+1 of each n8 tile; the row max is the lane's max, then two
   shfl_xor (1, 2) over the 4 lanes of the quad. l stays a per-lane partial sum (every lane of
   the quad rescales by the same α = exp2(m₂_old - m₂_new)) and is summed over the quad once,
   at the end. A max that is still -inf is used as 0, so exp2(-inf - 0) = 0 and no NaN appears.
6. P = exp2(t - m₂), rounded to V's dtype, is stored straight into the A fragment of the second
   mma: the m16n8 C layout of n8 tiles 2k and 2k + 1 is exactly the m16n8k16 A layout of k16
   step k (A element e < 4 is C element e of tile 2k, A element 4 + e is C element e of tile
   2k + 1; checked against the table when the kernel is built), so P never touches shared memory.
7. O = O·α + P V: V is [k][n] in shared, ldmatrix.x4.trans gives its B fragments.
8. Epilogue: l summed over the quad, m = m₂ · ln 2, and the output O[row, col] = g(acc, m, l)
   (the program's own expression, the cast included) and the row outputs (the log-sum-exp) by
   lane t = 0 of each quad, guarded by row < the query extent.

Precision: Q·K products are exact and summed in float32 (as the program's float32 sums); P is
rounded to V's 16-bit dtype before P·V (relative 2^-11 for float16, 2^-8 for bfloat16, so O is
off by at most that times max |v|, as in FlashAttention); the sum l is of the unrounded P.

Key tiles a mask makes fully -inf are not visited, and tiles every row keeps whole skip the
per-element guard: bounds derived from the affine conditions of the `where`s and proved with isl
(key_tiles.py). On the partial tiles each affine condition c·key + a·row + rest <= 0 is one
integer limit per m16 tile compared against the element's compile-time offsets, and the key-extent
test is left out where isl proves the visited keys inside (_Kernel.limited_guard: the guard's
registers decide whether the d = 128 Hopper kernel fits 2 blocks per SM; docs/attention.md "What a
guarded tile costs"); `peel_guarded` runs the partial tiles in a loop of their own.

The Hopper form (`wgmma=True`, sm_90a; docs/attention.md "The Hopper form"): one warpgroup per
64 query rows (warp 4w + v of warpgroup w owns rows 16v.. of its 64, the mma.sync form's m16
rows), Q [BM][D], K and V tiles in blocked swizzled shared tiles [stage][D / W][rows][W]
(W = min(D, 64) halves a row: the 128B, 64B or 32B swizzle) read by wgmma through descriptors
(Q and K K-major, V MN-major as the B of P·V). S = Q·Kᵀ is D/16 wgmma.m64n{BN}k16 into the
accumulator (scale-d false on the first), whose layout is the m16n8 C pattern per warp and n8
block, so steps 4-6 are the code above; P's fragment is the register A of wgmma.m64n{C}k16
(accumulator elements 8k..8k+7 are the A of k16 step k), and O += P·V is BN/16 such wgmmas.
Both groups are waited for in their iteration; the loop head is cp.async.wait_group 0,
fence.proxy.async (wgmma reads through the async proxy), barrier, then the next tile's copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import (
    Binary,
    Cast,
    Const,
    Expr,
    Reduce,
    TensorRead,
    Var,
    binary,
    call,
    cast,
    compare,
    const_int,
    free_vars,
    select,
    size_product,
    substitute,
    walk,
    warp_shuffle,
)
from ...ir.intrinsics import WARPGROUP_SIZE, WGMMA_N, lookup
from ...ir.target import target
from ...ir.stmt import (
    Allocate,
    AsyncCommit,
    AsyncProxyFence,
    AsyncWait,
    Barrier,
    Buffer,
    BufferStore,
    For,
    FragmentRef,
    IfThenElse,
    KernelCall,
    LetStmt,
    Module,
    PrimFunc,
    Stmt,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupMatrixMultiply,
    WarpgroupWait,
    seq,
)
from ...ir.tensor import PlaceholderOp, Tensor
from ...ir.visitor import SubexpressionReplacer
from ..lower import exprs_of, global_buffers, scalar_vars, signature
from ..substitute import substitute_stmt
from ..names import identifier
from ..schedule.tensorize import INTRINSICS, load_a_fragment, load_b_fragments
from ..schedule.tensorize_wgmma import wgmma_intrinsic
from .key_tiles import (
    affine_form,
    kept,
    kept_conditions,
    key_tile_bound,
    skipping_description,
    tiles_inside_keys,
    unmasked_tile_bound,
)
from .launch_order import block_grid, launch_order, work_item
from .mma_tiles import LOG2E, TileStaging, block_width, two_n8_tiles
from .mma_tiles import check_wgmma_relayout as _check_wgmma_relayout
from .mma_tiles import check_relayout as _check_relayout
from .mma_tiles import fold_log2e as _fold_log2e
from .online_contraction import MAX_GRID_Y, ExpressionLowering, OnlineChain, head_indices, online_chain

LN2 = math.log(2.0)
MAX_HEAD_DIM = 128   # mma.sync: the partial output, 4·C/8 floats per lane, and Q's fragments, D/2 registers
HOPPER_HEAD_DIMS = (16, 32, 64, 96, 128, 256)   # the wgmma form: Q stays in shared memory, 64-row tiles per warpgroup
STAGES = 2
OVERLAP_STAGES = 3   # the overlapped Hopper form reads tiles kt (V) and kt + 1 (K) while kt + 2 loads


@dataclass(frozen=True)
class TensorCoreChain:
    """An online chain whose two contractions run on tensor cores (module docstring)."""

    chain: OnlineChain
    scores: Reduce        # Σ_d Q·K inside chain.score
    depth: int            # D
    q: TensorRead         # Q[.., i, d]
    k: TensorRead         # K[.., j, d]
    v: TensorRead         # V[.., j, c]
    qk_intrinsic: str
    pv_intrinsic: str


def _half_read(e: Expr) -> TensorRead | None:
    if isinstance(e, Cast) and e.dtype == dt.float32:
        e = e.a
    if isinstance(e, TensorRead) and e.tensor.is_placeholder and e.dtype in (dt.float16, dt.bfloat16):
        return e
    return None


def _shape_dim(where: str, name: str, extent: Expr) -> int:
    n = const_int(extent)
    if n is None:
        raise ScheduleError(f"{where}: the contracted extent of {name} ({extent}) is symbolic; the tensor-core "
                            "form needs a constant (its fragments live in registers)")
    if n not in HOPPER_HEAD_DIMS:
        raise ScheduleError(f"{where}: the contracted extent of {name} is {n}; the tensor-core form needs one of "
                            f"{', '.join(map(str, HOPPER_HEAD_DIMS))} (mma.sync: up to {MAX_HEAD_DIM}; 256 on wgmma, sm_90 "
                            "only)")
    return n


def mma_sync_head_dims(tcc: "TensorCoreChain") -> str | None:
    """Why the mma.sync form cannot take the chain's head dims, or None: it keeps Q's fragments
    (D/2 registers) and the partial output (C/2 floats) per lane, which spill past 128; its
    tiles are swizzled by a power-of-two row width (row_swizzle), or padded (96: _Kernel.shared)."""
    columns = const_int(tcc.chain.columns)
    for what, n in (("scores", tcc.depth), ("output", columns)):
        if n is None or n > MAX_HEAD_DIM or (n & (n - 1) and n != 96):
            return (f"online_contraction_mma: the {what}' head dim is {n}; the mma.sync form takes a power of two from "
                    f"16 to {MAX_HEAD_DIM}, or 96 (256 runs on wgmma, sm_90)")
    return None


def _leading(where: str, read: TensorRead, chain: OnlineChain, tail: tuple[Expr, Expr]) -> None:
    """`read` must be indexed by expressions of the leading row axes, then exactly `tail`."""
    idx = read.indices
    if len(idx) < 2 or idx[-2] is not tail[0] or idx[-1] is not tail[1]:
        raise ScheduleError(f"{where}: {read.tensor.name} is read at [{', '.join(map(str, idx))}]; the tensor-core "
                            f"form needs [.., {tail[0]}, {tail[1]}] (a tile of whole rows)")
    allowed = set(chain.row[:-1])
    for e in idx[:-2]:
        if any(isinstance(v, Var) and v.kind != "size" and v not in allowed for v in free_vars(e)):
            raise ScheduleError(f"{where}: a leading index {e} of {read.tensor.name} depends on more than the "
                                "leading row axes (the block's heads)")


def tensor_core_chain(chain: OnlineChain) -> TensorCoreChain:
    """The chain's tensor-core form, or ScheduleError saying which condition fails."""
    where = "online_contraction_mma"
    reduces = list({id(n): n for n in walk(chain.score) if isinstance(n, Reduce)}.values())
    if len(reduces) != 1:
        raise ScheduleError(f"{where}: the scores hold {len(reduces)} contractions; the tensor-core form needs one "
                            "(s = f(Σ_d q·k))")
    (red,) = reduces
    assert isinstance(red, Reduce)
    if red.combiner != "sum" or len(red.axes) != 1 or const_int(red.axes[0].lo) != 0:
        raise ScheduleError(f"{where}: the scores' reduction is not one sum over an axis from 0")
    if red.acc_dtype != dt.float32:
        raise ScheduleError(f"{where}: the scores accumulate in {red.acc_dtype}; mma accumulates in float32")
    axis = red.axes[0]
    src = red.source
    if isinstance(src, Cast) and src.dtype == dt.float32:
        src = src.a
    if not (isinstance(src, Binary) and src.op == "*"):
        raise ScheduleError(f"{where}: the scores' summand {src} is not a product of two reads")
    reads = [_half_read(src.a), _half_read(src.b)]
    if any(r is None for r in reads):
        raise ScheduleError(f"{where}: the scores multiply {src.a} and {src.b}; the tensor-core form needs two "
                            "float16/bfloat16 input reads (float32 operands stay SIMT)")
    a, b = reads
    assert a is not None and b is not None
    query = chain.row[-1]
    q, k = (a, b) if any(x is query for x in a.indices) else (b, a)
    _leading(where, q, chain, (query, axis))
    _leading(where, k, chain, (chain.key, axis))
    if q.dtype != k.dtype:
        raise ScheduleError(f"{where}: Q is {q.dtype} and K is {k.dtype}; mma needs one dtype")
    depth = _shape_dim(where, "the scores", axis.extent)
    for t in (q.tensor, k.tensor):
        if const_int(t.shape[-1]) != depth:
            raise ScheduleError(f"{where}: {t.name}'s last extent {t.shape[-1]} is not the contracted {depth}")
    v = _half_read(chain.value)
    if v is None:
        raise ScheduleError(f"{where}: the contracted value {chain.value} is not a float16/bfloat16 input read")
    _leading(where, v, chain, (chain.key, chain.column))
    columns = _shape_dim(where, "the output", chain.columns)
    if const_int(v.tensor.shape[-1]) != columns:
        raise ScheduleError(f"{where}: {v.tensor.name}'s last extent is not the output's {columns} columns")
    for stat, what in ((chain.m, "max"), (chain.l, "sum")):
        acc = stat.op.body.acc_dtype  # type: ignore[union-attr]
        if acc != dt.float32:
            raise ScheduleError(f"{where}: the row {what} {stat.name} accumulates in {acc}; the kernel keeps float32")
    if chain.contraction.acc_dtype != dt.float32:
        raise ScheduleError(f"{where}: {chain.output.name} accumulates in {chain.contraction.acc_dtype}; mma "
                            "accumulates in float32")
    for t in (q.tensor, k.tensor, v.tensor):
        if isinstance(t.op, PlaceholderOp) and t.op.strides is not None:
            raise ScheduleError(f"{where}: {t.name} has strides; the tiles are copied as 16-byte pieces of contiguous "
                                "rows (pass a contiguous tensor)")
    return TensorCoreChain(chain, red, depth, q, k, v, INTRINSICS[q.dtype.name], INTRINSICS[v.dtype.name])


# ---- masked-tile skipping (key_tiles.py) -----------------------------------------------------------

def describe_skipping(args: Sequence[Tensor], rows: int, tile: int) -> str:
    """skipping_description of the chain `args` for blocks of `rows` query rows (`query_block`
    is the block index in the bound)."""
    chain = online_chain(args)
    tcc = tensor_core_chain(chain)
    block = Var("query_block", dt.int32)
    unmasked = None if _reads_inputs(tcc) else unmasked_tile_bound(chain, block, rows, tile)
    bound = key_tile_bound(chain, block, rows, tile)
    order = launch_order(chain, (tcc.k, tcc.v), block, rows, bound)[2]
    return skipping_description(chain, bound, unmasked) + (f"; {order}" if order else "")


def _reads_inputs(tcc: TensorCoreChain) -> bool:
    """Whether the scores read inputs besides the contraction's (a bias, a mask tensor)."""
    return any(isinstance(n, TensorRead) for n in walk(tcc.chain.score) if not _inside(n, tcc.scores))


# ---- the kernel ------------------------------------------------------------------------------------

def _check_pairs(qk: str) -> None:
    """The epilogue stores elements 2h and 2h + 1 of the C fragment of `qk` as one 2-element
    vector: they must be one row's columns c and c + 1, c even (the m16n8 C layout)."""
    c_map = lookup(qk).operand("c").layout
    for lane in range(32):
        for e in (0, 2):
            r, col = c_map(lane, e)
            if col % 2 or c_map(lane, e + 1) != (r, col + 1):
                raise ScheduleError(f"online_contraction_mma: elements {e}, {e + 1} of lane {lane} of the C fragment "
                                    f"of {qk} are not two adjacent columns of one row; the epilogue's paired stores "
                                    "need them")


def online_contraction_mma(args: Sequence[Tensor], rows_per_block: int = 64, key_tile: int = 64,
                           warp_rows: int = 16, name: str | None = None, wgmma: bool = False,
                           blocks_per_sm: int = 0, overlap: bool = False, plain_order: bool = False,
                           persistent: int = 0, kv_splits: int = 1, guard_every_tile: bool = False,
                           stages: int = STAGES, peel_guarded: bool = False, query_major: bool = False) -> Module:
    """The module of ONE tensor-core kernel computing the chain `args` (module docstring):
    `rows_per_block` query rows per block, `warp_rows` (16 or 32: one or two m16 tiles, which
    share every K and V fragment a warp loads) per warp, key tiles of `key_tile`.
    `wgmma`: the Hopper form (sm_90a; section "The Hopper form" of the module docstring): one
    warpgroup per 64 query rows, both contractions as wgmma, `warp_rows` ignored; `blocks_per_sm`
    > 0 asks for that many resident blocks (`__launch_bounds__`: ptxas caps the registers);
    `overlap`: S(kt + 1) and the softmax of tile kt + 1 while P(kt)·V is in flight, over a
    3-stage ring (_Kernel.overlapped_loop). `plain_order`: launch the blocks in the plain grid's
    order (query blocks, then heads) instead of _Kernel.grid's (for timing one against the other).
    `persistent` > 0 (the Hopper form, not overlapped): a grid of that many blocks (one per SM:
    132 on an H100/H200) looping over the (query block, head) work items, the longest first, the
    next item's loads under this one's epilogue (_Kernel.persistent_body). `kv_splits` > 1
    (split-KV, for few query rows over many keys): a third grid axis over that many chunks of the
    key tiles, each block writing float32 partial O, max and sum of its chunk, and a second kernel
    combining them (_Kernel.combine_kernel); not with `overlap` or `persistent`.
    `guard_every_tile`: every visited key tile carries the per-element guard, the leading ones
    that isl proves whole included (the same results; for timing what the guard costs against
    the plain kernel, which guards only the partial tiles). `stages` (the Hopper form, neither
    overlapped nor persistent): the depth of the K/V cp.async ring, 2 (tile kt + 1 loads while tile
    kt is computed) or 3 (tiles kt + 1 and kt + 2: two tiles of latency hidden instead of one).
    `peel_guarded` (not overlapped): the key loop split in two at the proven count of whole tiles,
    the whole tiles without the guard, then the partial ones with it, instead of one loop that
    branches per tile (the same results; ptxas allocates the two differently, and the planner
    takes whichever fits more blocks per SM). `query_major` (not persistent, which has that order):
    launch the blocks query block major over all heads, the longest first over the whole launch
    (launch_order.block_grid), instead of each head's query blocks in turn."""
    where = "online_contraction_mma"
    chain = online_chain(args)
    tc_chain = tensor_core_chain(chain)
    if isinstance(kv_splits, bool) or not isinstance(kv_splits, int) or not 1 <= kv_splits <= 65535:
        raise ScheduleError(f"{where}: kv_splits={kv_splits!r} must be 1 (no split) .. 65535 key chunks")
    if kv_splits > 1 and (overlap or persistent):
        raise ScheduleError(f"{where}: kv_splits with overlap or persistent is not built; take one")
    if query_major and (persistent or plain_order):
        raise ScheduleError(f"{where}: query_major is a launch order of the plain grid; the persistent form's work "
                            "items are already query block major, and plain_order is another order: take one")
    if wgmma:
        return _wgmma_module(tc_chain, rows_per_block, key_tile, name, blocks_per_sm, overlap, plain_order, persistent,
                             kv_splits, guard_every_tile, stages, peel_guarded, query_major)
    if blocks_per_sm or overlap or persistent or stages != STAGES:
        raise ScheduleError(f"{where}: blocks_per_sm, overlap, persistent and stages are options of the wgmma form "
                            "(wgmma=True)")
    not_sync = mma_sync_head_dims(tc_chain)
    if not_sync is not None:
        raise ScheduleError(not_sync)
    if warp_rows not in (16, 32):
        raise ScheduleError(f"{where}: warp_rows={warp_rows} must be 16 or 32 (one or two m16 tiles per warp)")
    if rows_per_block % warp_rows or not warp_rows <= rows_per_block <= 512 or rows_per_block // warp_rows > 16:
        raise ScheduleError(f"{where}: rows_per_block={rows_per_block} must be a multiple of warp_rows={warp_rows} "
                            "(one warp per warp_rows rows), at most 16 warps")
    if key_tile not in (16, 32, 64, 128):
        raise ScheduleError(f"{where}: key_tile={key_tile} must be 16, 32, 64 or 128")
    _check_relayout(tc_chain.qk_intrinsic, tc_chain.pv_intrinsic)
    kernel = _Kernel(tc_chain, rows_per_block, key_tile, warp_rows, name)
    kernel.plain_order = plain_order
    kernel.guard_every_tile = guard_every_tile
    kernel.peel_guarded = bool(peel_guarded)
    kernel.query_major = bool(query_major)
    kernel.splits = kv_splits
    return kernel.module()


class _Kernel(TileStaging):
    def __init__(self, tcc: TensorCoreChain, rows: int, key_tile: int, warp_rows: int, name: str | None,
                 warpgroup: bool = False) -> None:
        self.wg = warpgroup
        self.overlap = False       # the Hopper form's S(kt + 1) issued before P(kt)·V: set by _wgmma_module
        self.stages = STAGES
        self.tcc, self.chain = tcc, tcc.chain
        self.BM, self.BN = rows, key_tile
        self.WR, self.MT = warp_rows, warp_rows // 16   # rows and m16 tiles per warp
        self.warps = rows // warp_rows
        self.threads = 32 * self.warps
        self.D = tcc.depth
        self.C = const_int(tcc.chain.columns)
        self.name = name
        prog = tcc.chain.program
        sig = signature(prog)
        self.sig = sig
        self.buffers, self.unique = sig.buffers, sig.unique
        u = self.unique
        self.bx, self.by = Var(u("query_block"), dt.int32), Var(u("head"), dt.int32)
        self.tx, self.kt = Var(u("thread"), dt.int32), Var(u("key_tile"), dt.int32)
        self.pb = Var(u("persistent_block"), dt.int32)
        self.bz = Var(u("key_chunk"), dt.int32)
        self.order = ""   # the launch order of the blocks, for the plan (launch_order.py)
        self.plain_order = False
        self.guard_every_tile = False   # every visited tile guarded (timing the guard): set by the module builders
        self.peel_guarded = False       # the guarded tiles in a loop of their own after the whole ones
        self.query_major = False        # blocks launched query block major over all heads (block_grid)
        self.persistent = 0   # > 0: that many blocks loop over the work items (_Kernel.persistent_body)
        self.splits = 1       # > 1: split-KV over that many key chunks (grid z) and a combine kernel
        self.partials: list[Buffer] = []
        self.lane, self.warp = self.tx % 32, self.tx // 32
        self.lower = ExpressionLowering(self.buffers, u)
        if warpgroup:
            self.warpgroup = self.tx // WARPGROUP_SIZE
            self.qk_wgmma = wgmma_intrinsic(tcc.q.dtype.name, key_tile)
            assert self.C is not None
            self.pv_wgmma = wgmma_intrinsic(tcc.v.dtype.name, self.C)

    def overlapped_loop(self, prologue: Stmt, n_tiles: Expr, load_kv: Callable[[Expr, Expr], Stmt], s_frag: Buffer,
                        p_frag: Buffer, o_frag: Buffer, q_sh: Buffer, k_sh: Buffer, v_sh: Buffer, softmax: Stmt,
                        convert: Stmt) -> tuple[Stmt, Stmt]:
        """The Hopper form with S(kt + 1) = Q·K(kt + 1)ᵀ in flight during P(kt)·V and the softmax
        of tile kt + 1 during P(kt)·V (FlashAttention-3's intra-warpgroup pipelining), over a
        3-stage ring: (the loop, the prologue). `softmax` is the elementwise stage, statistics and
        float32 weights of tile `self.kt` (left in s_frag); `convert` rounds them into p_frag and
        rescales O. Iteration kt:

            cp.async.wait_group 0; fence.proxy.async; barrier   tile kt + 1 landed; tile kt - 1's stage free
            tile kt + 2 -> stage (kt + 2) % 3; commit
            wgmma.fence; S = Q·K(kt + 1)ᵀ; commit                (group A)
            O += P·V(kt); commit                                  (group B: P from registers)
            wait_group 1 (A done); [kt + 1 < n] softmax(kt + 1) in s_frag   (B in flight: O, P untouched)
            wait_group 0 (B done); [kt + 1 < n] P = s_frag rounded; O·α

        The copies and S(kt + 1) are issued even past the block's last tile (keys past the end are
        zero-filled, the scores unused): with the wgmma under a condition that the softmax's
        `kt + 1 < n` does not provably match, ptxas serializes the wgmmas (C7514).
        """
        zero, one = Const(0, dt.int32), Const(1, dt.int32)
        S = self.stages
        D, BN = self.D, self.BN

        def scores(stage: Expr) -> Stmt:
            return seq(self.unrolled("qk_step", D // 16, lambda kd: WarpgroupMatrixMultiply(
                           self.qk_wgmma, FragmentRef(s_frag, zero), self.operand(q_sh, zero, self.warpgroup * 64, kd),
                           self.operand(k_sh, stage, zero, kd), compare("!=", kd, zero))),
                       WarpgroupCommit())
        nxt = self.kt + 1
        has_next = compare("<", nxt, n_tiles)
        pv = seq(self.unrolled("pv_step", BN // 16, lambda kk: WarpgroupMatrixMultiply(
                     self.pv_wgmma, FragmentRef(o_frag, zero), FragmentRef(p_frag, 8 * kk),
                     self.operand(v_sh, self.kt % S, zero, kk, mn_major=True), Const(True, dt.bool_))),
                 WarpgroupCommit())
        first = seq(
            AsyncWait(1),           # Q and tile 0 (tile 1 may be in flight)
            AsyncProxyFence(),
            Barrier(),
            WarpgroupFence(),
            scores(zero),
            WarpgroupWait(0, (s_frag,)),
            substitute_stmt(softmax, {self.kt: zero}),
            substitute_stmt(convert, {self.kt: zero}))
        start = seq(
            prologue,  # Q and tile 0: one group
            load_kv(one, one),
            AsyncCommit(),
            IfThenElse(compare("<", zero, n_tiles), first))
        ahead = self.kt + 2
        loop = For(self.kt, zero, n_tiles, "serial", seq(
            AsyncWait(0),
            AsyncProxyFence(),
            Barrier(),
            load_kv(ahead % S, ahead),
            AsyncCommit(),
            WarpgroupFence(),
            scores(nxt % S),
            pv,
            WarpgroupWait(1, (s_frag,)),
            IfThenElse(has_next, substitute_stmt(softmax, {self.kt: nxt})),
            WarpgroupWait(0, (o_frag,)),
            IfThenElse(has_next, substitute_stmt(convert, {self.kt: nxt})),
        ))
        return loop, start

    def limited_guard(self, score: Expr, fold: bool, s_frag: Buffer, SF: int, c_map: Any,
                      warp_row0: Callable[[Expr], Expr], head_at: dict[Var, Expr],
                      bound: tuple[Expr, str] | None) -> Stmt | None:
        """The guarded tile's elementwise stage with each affine condition of the mask (key_tiles.
        affine_form: c·key + a·row + rest ≤ 0) compared against ONE integer per m16 tile and
        condition, so that its register cost is that integer, not the element's row and key.

        An accumulator element sits at row R0 + rc and key K0 + kc, with R0 = the m16 tile's first
        row + the lane's row, K0 = kt·BN + the lane's column, and (rc, kc) = (8·(e // 2), 8·n +
        e % 2), constants once the element loops are unrolled (the C fragment is the lane's
        position plus the element's: checked against the table). So the condition is

            c·kc + a·rc ≤ limit,   limit = -(c·K0 + a·R0 + rest)    (one int per m16 tile)

        The key-extent test key < Sk is one more such condition, left out when isl proves every
        key of the visited tiles is inside (key_tiles.tiles_inside_keys: Sk a multiple of the
        tile, or the mask's last kept key inside). Conditions that are not affine in the row and
        key are evaluated per element as before. `fold`: log2(e) folded into the kept value (no
        raw-Σ scale). None when the fragment is not lane + element (the per-element form then)."""
        chain, BN, MT = self.chain, self.BN, self.MT
        for lane in range(32):
            for e in range(4):
                (r, col), (r0, c0), (re, ce), (rz, cz) = c_map(lane, e), c_map(lane, 0), c_map(0, e), c_map(0, 0)
                if (r, col) != (r0 + re - rz, c0 + ce - cz):
                    return None
        value = kept(score)[1]
        flat = kept_conditions(score)
        tiles = (chain.keys + (BN - 1)) // BN if bound is None else bound[0]
        if not tiles_inside_keys(chain, self.bx, self.BM, BN, tiles):
            flat.append(compare("<", chain.key, chain.keys))
        query, key = chain.row[-1], chain.key
        forms = [affine_form(c, query, key) for c in flat]
        zero = Const(0, dt.int32)
        minus_inf = Const(-math.inf, dt.float32)

        def combination(parts: Sequence[tuple[int, Any]]) -> Expr:
            """Σ k·x, written with subtractions for negative k and without the zero terms."""
            out: Expr | None = None
            for k, x in parts:
                if k == 0 or const_int(x) == 0:
                    continue
                term = x if abs(k) == 1 else Const(abs(k), dt.int32) * x
                out = (term if k > 0 else zero - term) if out is None else (out + term if k > 0 else out - term)
            return zero if out is None else out

        def per_tile(mt: Var) -> Stmt:
            r_lane, c_lane = c_map(self.lane, 0)
            row0, key0 = warp_row0(mt) + r_lane, self.kt * BN + c_lane
            limits: list[tuple[Var, Expr]] = []
            for form in forms:
                if form is not None:
                    a, c, rest = form
                    limit = Var(self.unique("key_limit"), dt.int32)
                    limits.append((limit, combination([(-a, row0), (-c, key0), (-1, substitute(rest, head_at))])))

            def tile(nt: Var) -> Stmt:
                def one(e: Var) -> Stmt:
                    r, col = c_map(self.lane, e)
                    (re, ce), (rz, cz) = c_map(0, e), c_map(0, 0)
                    kc, rc = nt * 8 + (ce - cz), re - rz
                    at = {**head_at, query: warp_row0(mt) + r, key: self.kt * BN + nt * 8 + col}
                    here = SF * mt + 4 * nt + e
                    ok: Expr | None = None
                    used = iter(limits)
                    for cond, form in zip(flat, forms):
                        if form is None:
                            test = substitute(cond, at)
                        else:
                            a, c, _ = form
                            lhs = combination([(c, kc), (a, rc)])
                            test = compare("<=", lhs, next(used)[0])
                        ok = test if ok is None else ok & test
                    v = substitute(SubexpressionReplacer({self.tcc.scores: s_frag[here]}).visit(value), at)
                    stmts, val = self.lower.value(_fold_log2e(v) if fold else v)
                    kept_value = cast(val, dt.float32)
                    return seq(*stmts, BufferStore(s_frag, (here,), kept_value if ok is None else
                                                   select(ok, kept_value, minus_inf)))
                return self.unrolled("s_e", 4, one)
            body: Stmt = self.unrolled("s_tile", BN // 8, tile)
            for limit, at_tile in reversed(limits):
                body = LetStmt(limit, at_tile, body)
            return body
        return self.unrolled("s_m", MT, per_tile)

    def work_items(self) -> Expr:
        return ((self.chain.rows[-1] + (self.BM - 1)) // self.BM) * size_product(self.chain.rows[:-1])

    def persistent_body(self, q_copy: Stmt, init: Stmt, loop: Stmt, finish: Sequence[Stmt],
                        order: tuple[int, bool, str]) -> Stmt:
        """The persistent form (the Hopper form's `persistent` = P blocks): block p runs the work
        items p, p + P, .. (launch_order.work_item: query block major, the longest first), each
        item the plain block's key loop and epilogue; the next item's Q tile and first K/V tile
        (q_copy, one commit group) are issued before this item's epilogue, after a barrier that
        orders every warpgroup's last wgmmas (which read Q and the ring) before the copies
        overwrite them, so the loads run under the epilogue's normalization and stores.

            [p < W] copy Q, K/V tile 0 of item p; commit
            for it < ceil((W - p) / P):  item = p + it·P  (query_block, head from it)
              init; key loop; wait_group 0; barrier
              [item + P < W] copy Q, K/V tile 0 of item + P; commit
              epilogue
            wait_group 0
        """
        zero = Const(0, dt.int32)
        P = Const(self.persistent, dt.int32)
        W = self.work_items()
        item, it = Var(self.unique("work_item"), dt.int32), Var(self.unique("work"), dt.int32)

        def at(linear: Expr) -> dict[Var, Expr]:
            qb, head = work_item(self.chain, self.BM, order, linear, self.plain_order)
            return {self.bx: qb, self.by: head} if self.chain.rows[:-1] else {self.bx: qb}

        body: Stmt = seq(init, loop, AsyncWait(0), Barrier(),
                         IfThenElse(compare("<", item + P, W), substitute_stmt(q_copy, at(item + P))),
                         *finish)
        here = at(item)
        if self.chain.rows[:-1]:
            body = LetStmt(self.by, here[self.by], body)
        body = LetStmt(item, self.pb + it * P, LetStmt(self.bx, here[self.bx], body))
        items = For(it, zero, (W - self.pb + (P - 1)) // P, "serial", body)
        return seq(IfThenElse(compare("<", self.pb, W), substitute_stmt(q_copy, at(self.pb))), items, AsyncWait(0))

    def module(self) -> Module:
        chain, tcc, BM, BN, D, C = self.chain, self.tcc, self.BM, self.BN, self.D, self.C
        assert C is not None
        zero = Const(0, dt.int32)
        minus_inf = Const(-math.inf, dt.float32)
        heads, queries = chain.rows[:-1], chain.rows[-1]
        n_heads = size_product(heads)
        if (const_int(n_heads) or 0) > MAX_GRID_Y:
            raise ScheduleError(f"online_contraction_mma: {const_int(n_heads)} heads exceed the grid's y extent "
                                f"{MAX_GRID_Y}")
        head_at = dict(zip(chain.row[:-1], head_indices(self.by, heads)))
        MT = self.MT
        q0 = self.bx * BM

        def warp_row0(mt: Expr) -> Expr:
            return q0 + self.warp * self.WR + mt * 16

        # per m16 tile mt of the warp: fragments at mt · (one tile's size), statistics at 2·mt + r
        QF, SF, PF, OF = 8 * (D // 16), 4 * (BN // 8), 8 * (BN // 16), 4 * (C // 8)
        m_run, l_run = self.local("m_run", 2 * MT), self.local("l_run", 2 * MT)
        m_use, alpha = self.local("m_use", 2 * MT), self.local("alpha", 2 * MT)
        wg = self.wg
        # the mma.sync form's operand fragments (declared in both forms, allocated in its own)
        q_frag = self.frag("q_frag", tcc.qk_intrinsic, "a", QF * MT)
        k_frag = self.frag("k_frag", tcc.qk_intrinsic, "b", 8)
        v_frag = self.frag("v_frag", tcc.pv_intrinsic, "b", 8)
        if wg:  # the Hopper form: S and O are wgmma accumulators, P its register A, Q stays in shared
            s_frag = self.frag("s_frag", self.qk_wgmma, "d", SF)
            p_frag = self.frag("p_frag", self.pv_wgmma, "a", PF)
            o_frag = self.frag("o_frag", self.pv_wgmma, "d", OF)
            q_sh = self.blocked("q_shared", tcc.q, 1, BM, D)
            k_sh = self.blocked("k_shared", tcc.k, self.stages, BN, D)
            v_sh = self.blocked("v_shared", tcc.v, self.stages, BN, C)
        else:
            s_frag = self.frag("s_frag", tcc.qk_intrinsic, "c", SF * MT)
            p_frag = self.frag("p_frag", tcc.pv_intrinsic, "a", PF * MT)
            o_frag = self.frag("o_frag", tcc.pv_intrinsic, "c", OF * MT)
            q_sh = self.shared("q_shared", tcc.q, 1, BM, D)
            k_sh = self.shared("k_shared", tcc.k, STAGES, BN, D)
            v_sh = self.shared("v_shared", tcc.v, STAGES, BN, C)
        c_map = lookup(tcc.qk_intrinsic).operand("c").layout

        bound = key_tile_bound(chain, self.bx, BM, BN)
        n_tiles: Expr = (chain.keys + (BN - 1)) // BN if bound is None else substitute(bound[0], head_at)
        first_tile: Expr = zero
        if self.splits > 1:   # split-KV: this block's chunk of the key tiles, within the proven range
            first_tile = self.bz * self.chunk_tiles()
            n_tiles = binary("min", n_tiles, first_tile + self.chunk_tiles())

        def load_kv(stage: Expr, tile: Expr) -> Stmt:
            j0 = tile * BN
            return seq(self.copy_tile(k_sh, stage, tcc.k, head_at, j0, chain.keys, BN, D),
                       self.copy_tile(v_sh, stage, tcc.v, head_at, j0, chain.keys, BN, C))

        # 1. Q -> shared -> A fragments; K, V tile 0 in the same group
        init = seq(
            self.unrolled("row", 2 * MT, lambda r: seq(BufferStore(m_run, (r,), minus_inf),
                                                      BufferStore(l_run, (r,), Const(0.0, dt.float32)))),
            self.unrolled("o_zero", OF * MT, lambda e: BufferStore(o_frag, (e,), Const(0.0, dt.float32))))
        q_copy = seq(self.copy_tile(q_sh, zero, tcc.q, head_at, q0, queries, BM, D),
                     IfThenElse(compare("<", first_tile, n_tiles), load_kv(first_tile % self.stages, first_tile)),
                     AsyncCommit())
        if wg and not self.overlap:   # a deeper ring: tiles 1 .. S - 2 in a group each, before the loop
            q_copy = seq(q_copy, *(seq(IfThenElse(compare("<", first_tile + s, n_tiles),
                                                  load_kv((first_tile + s) % self.stages, first_tile + s)),
                                       AsyncCommit()) for s in range(1, self.stages - 1)))
        # the Hopper form: Q stays in shared memory; the loop's wait, proxy fence and barrier
        # make it (and tile 0) visible to the first wgmma
        prologue = seq(q_copy, init) if wg else seq(
            q_copy,
            AsyncWait(0),
            Barrier(),
            self.unrolled("q_tile", MT, lambda mt: self.unrolled("q_step", D // 16, lambda kd: load_a_fragment(
                FragmentRef(q_frag, QF * mt + 8 * kd), q_sh, zero, self.warp * self.WR + mt * 16, kd * 16, self.lane,
                True))),
            init,
        )

        # 3. S = Q K^T
        stage = self.kt % self.stages

        def qk_step(kd: Var) -> Stmt:
            def pair(kn: Var) -> Stmt:
                def mma(mt: Var) -> Stmt:  # one K fragment load serves the warp's MT m16 tiles
                    return two_n8_tiles(tcc.qk_intrinsic, s_frag, SF * mt + 8 * kn, FragmentRef(q_frag, QF * mt + 8 * kd),
                                        k_frag)
                return seq(
                    load_b_fragments(FragmentRef(k_frag, 0), k_sh, stage, kn * 16, kd * 16, self.lane, True),
                    self.unrolled("qk_tile", MT, mma))
            return self.unrolled("key_pair", BN // 16, pair)
        if wg:
            scores = seq(WarpgroupFence(),
                         self.unrolled("qk_step", D // 16, lambda kd: WarpgroupMatrixMultiply(
                             self.qk_wgmma, FragmentRef(s_frag, zero), self.operand(q_sh, zero, self.warpgroup * 64, kd),
                             self.operand(k_sh, stage, zero, kd), compare("!=", kd, zero))),
                         WarpgroupCommit(),
                         WarpgroupWait(0, (s_frag,)))
        else:
            scores = seq(self.unrolled("s_zero", SF * MT, lambda e: BufferStore(s_frag, (e,), Const(0.0, dt.float32))),
                         self.unrolled("qk_step", D // 16, qk_step))

        # 4. the elementwise stage per accumulator element, in log2 units
        has_reads = _reads_inputs(tcc)
        # s = Σ·c (c > 0) under the masks: the fragments keep the raw Σ (or -inf), the max is taken
        # on it and scaled once per row, and each weight is exp2(Σ·c·log2 e - m₂), one FFMA; the
        # tiles kept whole then need no elementwise work at all
        kept_value = kept(chain.score)[1]
        raw_scale = None if has_reads else _positive_scale(kept_value, tcc.scores)
        score = chain.score
        if raw_scale is not None:
            score = SubexpressionReplacer({kept_value: tcc.scores}).visit(chain.score)

        def element(score: Expr, guarded: bool) -> Stmt:
            def tile(mt: Var, nt: Var) -> Stmt:
                def one(e: Var) -> Stmt:
                    r, col = c_map(self.lane, e)
                    row = warp_row0(mt) + r
                    key = self.kt * BN + nt * 8 + col
                    at = {**head_at, chain.row[-1]: row, chain.key: key}
                    here = SF * mt + 4 * nt + e
                    s = substitute(SubexpressionReplacer({tcc.scores: s_frag[here]}).visit(score), at)
                    stmts, value = self.lower.value(_fold_log2e(s) if raw_scale is None else s)
                    store = seq(*stmts, BufferStore(s_frag, (here,), cast(value, dt.float32)))
                    if not guarded:
                        return store
                    key_ok = compare("<", key, chain.keys)
                    if has_reads:  # a bias or mask read: only inside the rows and keys
                        return IfThenElse(compare("<", row, queries) & key_ok, store,
                                          BufferStore(s_frag, (here,), minus_inf))
                    return seq(*stmts, BufferStore(s_frag, (here,), select(key_ok, cast(value, dt.float32), minus_inf)))
                return self.unrolled("s_e", 4, one)
            if guarded and not has_reads:
                limited = self.limited_guard(score, raw_scale is None, s_frag, SF, c_map, warp_row0, head_at, bound)
                if limited is not None:
                    return limited
            return self.unrolled("s_m", MT, lambda mt: self.unrolled("s_tile", BN // 8, lambda nt: tile(mt, nt)))
        guarded = element(score, True)
        # tiles every row of the block keeps whole (below the diagonal): no condition, no guard
        unmasked = None if has_reads or self.guard_every_tile else unmasked_tile_bound(chain, self.bx, BM, BN)
        self.skipping = skipping_description(chain, bound, unmasked)
        whole: Stmt = seq()   # the elementwise stage of a whole tile (the peeled loop's)
        if unmasked is None:
            elementwise: Stmt = guarded
        else:
            unmasked = substitute(unmasked, head_at)
            if raw_scale is not None:  # the raw Σ is the value: nothing to do on whole tiles
                elementwise = IfThenElse(compare(">=", self.kt, unmasked), guarded)
            else:
                whole = element(kept_value, False)
                elementwise = IfThenElse(compare("<", self.kt, unmasked), whole, guarded)

        # 5. running max over the quad, the rescale α, 6. P into the A fragments, the partial sum
        tile_max = self.local("tile_max", 2 * MT)

        def row_stats(r: Var) -> Stmt:  # r = 2·mt + (0: row g, 1: row g + 8)
            def fold(nt: Var) -> Stmt:
                # fmax (one FMNMX) rather than the NaN-propagating max: a NaN score still makes
                # its p, hence l and the outputs, NaN, as the program's max would
                here = SF * (r // 2) + 4 * nt + 2 * (r % 2)
                return seq(*(BufferStore(tile_max, (r,), binary("fmax", tile_max[r], s_frag[here + i]))
                             for i in (0, 1)))
            scaled = () if raw_scale is None else (
                BufferStore(tile_max, (r,), binary("fmax", m_run[r], tile_max[r] * Const(raw_scale, dt.float32))),)
            return seq(
                BufferStore(tile_max, (r,), m_run[r] if raw_scale is None else minus_inf),
                self.unrolled("max_n", BN // 8, fold),
                BufferStore(tile_max, (r,), binary("fmax", tile_max[r], warp_shuffle("shfl_xor", tile_max[r], 1))),
                BufferStore(tile_max, (r,), binary("fmax", tile_max[r], warp_shuffle("shfl_xor", tile_max[r], 2))),
                *scaled,
                BufferStore(m_use, (r,), select(compare("==", tile_max[r], minus_inf), Const(0.0, dt.float32),
                                                tile_max[r])),
                BufferStore(alpha, (r,), call("exp2_approx", m_run[r] - m_use[r])),
                BufferStore(m_run, (r,), tile_max[r]),
                BufferStore(l_run, (r,), l_run[r] * alpha[r]),
            )
        p_dtype = lookup(tcc.pv_intrinsic).operand("a").dtype

        def weights(mt: Var, nt: Var) -> Stmt:
            def one(e: Var) -> Stmt:
                here, r = SF * mt + 4 * nt + e, 2 * mt + e // 2
                t = s_frag[here] if raw_scale is None else s_frag[here] * Const(raw_scale, dt.float32)
                p = call("exp2_approx", t - m_use[r])
                return seq(BufferStore(s_frag, (here,), p),
                           BufferStore(l_run, (r,), l_run[r] + s_frag[here]),
                           # C tile nt element e is A element 4·nt + e of k16 step nt // 2 (the relayout);
                           # the overlapped form converts after the P·V in flight has read the old P
                           None if self.overlap else
                           BufferStore(p_frag, (PF * mt + 4 * nt + e,), cast(s_frag[here], p_dtype)))
            return self.unrolled("p_e", 4, one)

        def rescale(mt: Var, nt: Var) -> Stmt:
            return self.unrolled("o_e", 4, lambda e: BufferStore(o_frag, (OF * mt + 4 * nt + e,),
                                                                 o_frag[OF * mt + 4 * nt + e] * alpha[2 * mt + e // 2]))

        # 7. O += P V
        def pv_step(kk: Var) -> Stmt:
            def pair(dn: Var) -> Stmt:
                def mma(mt: Var) -> Stmt:  # one V fragment load serves the warp's MT m16 tiles
                    return two_n8_tiles(tcc.pv_intrinsic, o_frag, OF * mt + 8 * dn, FragmentRef(p_frag, PF * mt + 8 * kk),
                                        v_frag)
                return seq(
                    load_b_fragments(FragmentRef(v_frag, 0), v_sh, stage, dn * 16, kk * 16, self.lane, False),
                    self.unrolled("pv_tile", MT, mma))
            return self.unrolled("column_pair", C // 16, pair)

        ahead = self.kt + (self.stages - 1 if wg else 1)   # the tile this iteration starts loading
        if wg and self.overlap:
            loop, prologue = self.overlapped_loop(
                prologue, n_tiles, load_kv, s_frag, p_frag, o_frag, q_sh, k_sh, v_sh,
                seq(elementwise, self.unrolled("row_stat", 2 * MT, row_stats),
                    self.unrolled("p_m", MT, lambda mt: self.unrolled("p_tile", BN // 8, lambda nt: weights(mt, nt)))),
                seq(self.unrolled("p_cast", PF, lambda e: BufferStore(p_frag, (e,), cast(s_frag[e], p_dtype))),
                    self.unrolled("o_m", MT, lambda mt: self.unrolled("o_tile", C // 8, lambda nt: rescale(mt, nt)))))
        elif wg:
            pv: Stmt = seq(
                WarpgroupFence(),   # after the rescale's writes of O, before the wgmmas read it
                self.unrolled("pv_step", BN // 16, lambda kk: WarpgroupMatrixMultiply(
                    self.pv_wgmma, FragmentRef(o_frag, zero), FragmentRef(p_frag, 8 * kk),
                    self.operand(v_sh, stage, zero, kk, mn_major=True), Const(True, dt.bool_))),
                WarpgroupCommit(),
                WarpgroupWait(0, (o_frag,)))   # P and the stage are free before the next iteration
            # tile kt (and Q) has landed (one group per iteration: with a ring of S stages the
            # S - 2 later tiles may still be in flight); the copies are generic-proxy writes, which
            # wgmma (the async proxy) sees after the fence; then every thread's copies, and every
            # warpgroup's wgmmas of tile kt - 1 are complete, so its stage (that of tile
            # kt + S - 1) may be refilled
            head: tuple[Stmt, ...] = (AsyncWait(self.stages - 2), AsyncProxyFence(), Barrier())
        else:
            pv = self.unrolled("pv_step", BN // 16, pv_step)
            # tile kt has landed (the only group in flight) for every thread, and every warp is
            # done with tile kt - 1's stage
            head = (AsyncWait(0), Barrier())
        if not (wg and self.overlap):
            def key_loop(lo: Expr, hi: Expr, elementwise: Stmt) -> Stmt:
                return For(self.kt, lo, binary("max", hi - lo, zero), "serial", seq(
                    *head,
                    IfThenElse(compare("<", ahead, n_tiles), load_kv(ahead % (self.stages if wg else STAGES), ahead)),
                    AsyncCommit(),
                    scores,
                    elementwise,
                    self.unrolled("row_stat", 2 * MT, row_stats),
                    self.unrolled("p_m", MT, lambda mt: self.unrolled("p_tile", BN // 8, lambda nt: weights(mt, nt))),
                    self.unrolled("o_m", MT, lambda mt: self.unrolled("o_tile", C // 8, lambda nt: rescale(mt, nt))),
                    pv,
                ))
            if self.peel_guarded and unmasked is not None:
                # the whole tiles, then the guarded ones: kt runs on, so the ring's stages and
                # the prefetch of the next tile are those of the one loop
                split = binary("max", first_tile, binary("min", unmasked, n_tiles))
                loop = seq(key_loop(first_tile, split, whole), key_loop(split, n_tiles, guarded))
            else:
                loop = key_loop(first_tile, n_tiles, elementwise)

        # 8. epilogue
        l_sum = self.local("l_sum", 2 * MT)
        finish: list[Stmt] = [self.unrolled("quad_sum", 2 * MT, lambda r: seq(
            BufferStore(l_sum, (r,), l_run[r] + warp_shuffle("shfl_xor", l_run[r], 1)),
            BufferStore(l_sum, (r,), l_sum[r] + warp_shuffle("shfl_xor", l_sum[r], 2))))]

        def final(r: Expr) -> dict[Expr, Expr]:
            return {chain.m_value: cast(m_run[r] * LN2, chain.m.dtype), chain.l_value: cast(l_sum[r], chain.l.dtype)}

        out = self.buffers[chain.output]

        _check_pairs(tcc.qk_intrinsic)

        def out_tile(mt: Var, nt: Var) -> Stmt:
            # elements 2h and 2h + 1 of the m16n8 C fragment are one row's two adjacent columns
            # (_check_pairs): one guarded 2-element store per row, a 4-byte store of 16-bit outputs
            def pair(h: Var) -> Stmt:
                v = Var(self.unique("out_e"), dt.int32)
                r, col = c_map(self.lane, 2 * h)
                row = warp_row0(mt) + r
                column = nt * 8 + col + v
                body = SubexpressionReplacer({**final(2 * mt + h),
                                              chain.contraction: cast(o_frag[OF * mt + 4 * nt + 2 * h + v],
                                                                      chain.contraction.dtype)}
                                             ).visit(chain.output_body)
                at = {**head_at, chain.row[-1]: row, chain.column: column}
                st, val = self.lower.value(substitute(body, at))
                idx = tuple(head_at[u] for u in chain.row[:-1]) + (row, column)
                return IfThenElse(compare("<", row, queries), For(
                    v, zero, Const(2, dt.int32), "vectorize" if not st else "unroll",
                    seq(*st, BufferStore(out, idx, cast(val, chain.output.dtype)))))
            return self.unrolled("out_h", 2, pair)
        finish.append(self.unrolled("out_m", MT, lambda mt: self.unrolled("out_tile", C // 8,
                                                                            lambda nt: out_tile(mt, nt))))

        def row_out(r: Var) -> Stmt:  # r = 2·mt + (0: row g, 1: row g + 8)
            row = warp_row0(r // 2) + self.lane // 4 + 8 * (r % 2)
            at = {**head_at, chain.row[-1]: row}
            stmts: list[Stmt] = []
            for t, value in chain.row_outputs:
                st, val = self.lower.value(substitute(SubexpressionReplacer(final(r)).visit(value), at))
                idx = tuple(head_at[v] for v in chain.row[:-1]) + (row,)
                stmts.append(seq(*st, BufferStore(self.buffers[t], idx, cast(val, t.dtype))))
            return IfThenElse(compare("==", self.lane % 4, zero) & compare("<", row, queries), seq(*stmts))
        if chain.row_outputs:
            finish.append(self.unrolled("row_out", 2 * MT, row_out))

        if self.splits > 1:   # the partial (acc, m₂, l) of this chunk instead of the program's epilogue
            finish = finish[:1] + [self.store_partials(o_frag, m_run, l_sum, c_map, warp_row0, head_at)]
        order = (1, False, "") if self.plain_order else launch_order(self.chain, (tcc.k, tcc.v), self.bx, BM, bound)
        self.order = order[2]
        if self.persistent:
            body: Stmt = self.persistent_body(q_copy, init, loop, finish, order)
        else:
            body = seq(prologue, loop, AsyncWait(0), *finish)
        unused = (q_frag, k_frag, v_frag) if wg else ()
        for buf in reversed([q_sh, k_sh, v_sh, q_frag, k_frag, s_frag, p_frag, v_frag, o_frag,
                             m_run, l_run, m_use, alpha, tile_max, l_sum, *self.lower.allocs]):
            if not any(buf is u for u in unused):
                body = Allocate(buf, body)
        body = For(self.tx, zero, Const(self.threads, dt.int32), "threadIdx.x", body)
        if self.persistent:
            body = For(self.pb, zero, binary("min", Const(self.persistent, dt.int32), self.work_items()), "blockIdx.x",
                       body)
        else:
            body = block_grid(body, self.chain, BM, self.bx, self.by, order, self.unique, self.query_major)
        if self.splits > 1:
            body = For(self.bz, zero, Const(self.splits, dt.int32), "blockIdx.z", body)

        prog = chain.program
        used = global_buffers(body)
        body_vars = scalar_vars(exprs_of(body) + [s for b in used for s in b.shape + (b.strides or ())])
        params = tuple(self.buffers[a] for a in prog.args if self.buffers[a] in used) + \
            tuple(v for v in self.sig.scalars if v in body_vars)
        kname = self.unique(f"{chain.output.name}_attention_{'wgmma' if wg else 'mma'}_kernel")
        mname = identifier(self.name or next(a.name for a in reversed(prog.args) if not a.is_placeholder))
        if self.query_major and chain.rows[:-1]:
            self.order = ", ".join(x for x in (self.order, "query blocks major over all heads (query_major)") if x)
        said = f"; {self.order}" if self.order else ""
        if self.splits > 1:
            said += (f"; split-KV: {self.splits} chunks of {self.chunk_tiles()} key tiles (grid z), float32 partial "
                      "O, max and sum per chunk, combined by a second kernel (rescaled by 2^(m_s - max), then the "
                      "program's epilogue)")
        if self.persistent:
            said += (f"; persistent: {self.persistent} blocks loop over the (query block, head) work items, query "
                      "block major" + (", the longest first" if "from the last" in self.order else "") +
                      ", the next item's Q and first K/V tile loaded under this one's epilogue")
        if wg:
            what = (f"{self.qk_wgmma} / {self.pv_wgmma} (P from registers): {BM} query rows ({BM // 64} warpgroups of "
                    f"64), key tiles of {BN}, Q, K K-major and V MN-major in swizzled shared memory read through "
                    f"descriptors, {self.stages}-stage cp.async ring"
                    f"{'; S(kt + 1) and its softmax while P(kt)·V is in flight' if self.overlap else ''}; "
                    "exp2 with log2(e) folded into the scale; "
                    f"{self.skipping}{said}")
        else:
            what = (f"{tcc.qk_intrinsic} / {tcc.pv_intrinsic}: {BM} query rows ({self.warps} warps of {self.WR}), key "
                    f"tiles of {BN}, "
                    f"{STAGES}-stage cp.async ring; exp2 with log2(e) folded into the scale; {self.skipping}{said}")
        attrs: tuple[tuple[str, object], ...] = (
            ("online_contraction", (chain.m.name, chain.l.name, chain.output.name)), ("tensorize", what))
        temps = tuple(self.partials) if self.splits > 1 else ()
        if temps:
            params = params[:len(params) - len([v for v in self.sig.scalars if v in body_vars])] + \
                tuple(t for t in temps if t in used) + tuple(v for v in self.sig.scalars if v in body_vars)
        kernel = PrimFunc(kname, params, body, attrs)
        module_params = tuple(self.buffers[a] for a in prog.args) + tuple(self.sig.scalars)
        kernels, calls = [kernel], [KernelCall(kname, params)]
        if temps:
            combine = self.combine_kernel(head_at_of=head_indices, prog_args=prog.args)
            kernels.append(combine)
            calls.append(KernelCall(combine.name, combine.params))
        return Module(mname, module_params, tuple(kernels), tuple(calls), temps)

    # ---- split-KV (decoding): partial (acc, m₂, l) per key chunk, then a combine kernel -------------

    def chunk_tiles(self) -> Expr:
        """Key tiles per chunk: ceil(all tiles / splits)."""
        all_tiles = (self.chain.keys + (self.BN - 1)) // self.BN
        return (all_tiles + (self.splits - 1)) // self.splits

    def partial_buffers(self) -> tuple[Buffer, Buffer, Buffer]:
        """Float32 [splits, heads, rows, C] partial outputs and [splits, heads, rows] running max
        (log2 units) and sums, the module's temporaries."""
        if not self.partials:
            chain = self.chain
            heads = size_product(chain.rows[:-1])
            S = Const(self.splits, dt.int32)
            assert self.C is not None
            name = chain.output.name
            self.partials = [
                Buffer(self.unique(f"{name}_partial_acc"), dt.float32, (S, heads, chain.rows[-1], Const(self.C, dt.int32)),
                       "global", tensor=f"{name}.partial_acc"),
                Buffer(self.unique(f"{name}_partial_max"), dt.float32, (S, heads, chain.rows[-1]), "global",
                       tensor=f"{name}.partial_max"),
                Buffer(self.unique(f"{name}_partial_sum"), dt.float32, (S, heads, chain.rows[-1]), "global",
                       tensor=f"{name}.partial_sum")]
        acc, mx, sm = self.partials
        return acc, mx, sm

    def store_partials(self, o_frag: Buffer, m_run: Buffer, l_sum: Buffer, c_map: Any, warp_row0: Callable[[Expr], Expr],
                       head_at: dict[Var, Expr]) -> Stmt:
        """This chunk's unnormalized O, running max m₂ and sum l to the partial buffers (rows
        inside the queries; m₂ and l by lane 0 of each quad)."""
        acc, mx, sm = self.partial_buffers()
        queries, OF, MT = self.chain.rows[-1], 4 * (self.C // 8), self.MT   # type: ignore[operator]
        hd = self.by if self.chain.rows[:-1] else Const(0, dt.int32)

        def out_tile(mt: Var, nt: Var) -> Stmt:
            def one(e: Var) -> Stmt:
                r, col = c_map(self.lane, e)
                row = warp_row0(mt) + r
                return IfThenElse(compare("<", row, queries), BufferStore(
                    acc, (self.bz, hd, row, nt * 8 + col), o_frag[OF * mt + 4 * nt + e]))
            return self.unrolled("part_e", 4, one)

        def row_out(r: Var) -> Stmt:
            row = warp_row0(r // 2) + self.lane // 4 + 8 * (r % 2)
            return IfThenElse(compare("==", self.lane % 4, Const(0, dt.int32)) & compare("<", row, queries), seq(
                BufferStore(mx, (self.bz, hd, row), m_run[r]),
                BufferStore(sm, (self.bz, hd, row), l_sum[r])))
        return seq(self.unrolled("part_m", MT, lambda mt: self.unrolled("part_tile", self.C // 8,  # type: ignore[operator]
                                                                          lambda nt: out_tile(mt, nt))),
                   self.unrolled("part_row", 2 * MT, row_out))

    def combine_kernel(self, head_at_of: Callable[[Expr, Sequence[Expr]], tuple[Expr, ...]],
                       prog_args: Sequence[Tensor]) -> PrimFunc:
        """One thread per (head, row, column): m* = max_s m₂_s (0 in its place while -inf),
        w_s = 2^(m₂_s - m*), l* = Σ_s w_s·l_s, acc* = Σ_s w_s·acc_s (the rescaling of the online
        pass, across chunks), then the program's epilogue g(acc*, m*·ln 2, l*) and, at column 0,
        its row outputs."""
        chain = self.chain
        acc, mx, sm = self.partial_buffers()
        u = self.unique
        lower = ExpressionLowering(self.buffers, u)
        zero = Const(0, dt.int32)
        C = Const(self.C, dt.int32)   # type: ignore[arg-type]
        heads, queries = chain.rows[:-1], chain.rows[-1]
        n_heads = size_product(heads)
        total = n_heads * queries * C
        threads = 256
        b, t, s = (Var(u(n), dt.int32) for n in ("combine_block", "combine_thread", "chunk"))
        flat = b * threads + t
        column, row, head = flat % C, (flat // C) % queries, flat // (C * queries)
        head_at = dict(zip(chain.row[:-1], head_at_of(head, heads)))
        m_star, m_use, l_star, o_star, w = (Buffer(u(n), dt.float32, (Const(1, dt.int32),), "local",
                                                                   tensor=f"combine.{n}")
                                            for n in ("m_star", "m_use", "l_star", "o_star", "weight"))
        minus_inf = Const(-math.inf, dt.float32)
        S = Const(self.splits, dt.int32)
        stats: dict[Expr, Expr] = {chain.m_value: cast(m_star[zero] * LN2, chain.m.dtype), chain.l_value: cast(l_star[zero], chain.l.dtype)}
        body_g = SubexpressionReplacer({**stats, chain.contraction: cast(o_star[zero], chain.contraction.dtype)}
                                       ).visit(chain.output_body)
        at = {**head_at, chain.row[-1]: row, chain.column: column}
        st, val = lower.value(substitute(body_g, at))
        idx = tuple(head_at[v] for v in chain.row[:-1]) + (row, column)
        out = self.buffers[chain.output]
        stmts: list[Stmt] = [
            BufferStore(m_star, (zero,), minus_inf),
            For(s, zero, S, "serial", BufferStore(m_star, (zero,), binary("fmax", m_star[zero], mx[s, head, row]))),
            BufferStore(m_use, (zero,), select(compare("==", m_star[zero], minus_inf), Const(0.0, dt.float32),
                                               m_star[zero])),
            BufferStore(l_star, (zero,), Const(0.0, dt.float32)),
            BufferStore(o_star, (zero,), Const(0.0, dt.float32)),
            For(s, zero, S, "serial", seq(
                BufferStore(w, (zero,), call("exp2_approx", mx[s, head, row] - m_use[zero])),
                BufferStore(l_star, (zero,), l_star[zero] + w[zero] * sm[s, head, row]),
                BufferStore(o_star, (zero,), o_star[zero] + w[zero] * acc[s, head, row, column]))),
            *st, BufferStore(out, idx, cast(val, chain.output.dtype))]
        rows_at = {**head_at, chain.row[-1]: row}
        row_stmts: list[Stmt] = []
        for tensor, value in chain.row_outputs:
            st2, val2 = lower.value(substitute(SubexpressionReplacer(stats).visit(value), rows_at))
            row_stmts.append(seq(*st2, BufferStore(self.buffers[tensor], tuple(head_at[v] for v in chain.row[:-1]) + (row,),
                                                   cast(val2, tensor.dtype))))
        if row_stmts:
            stmts.append(IfThenElse(compare("==", column, zero), seq(*row_stmts)))
        body: Stmt = IfThenElse(compare("<", flat, total), seq(*stmts))
        for buf in reversed([m_star, m_use, l_star, o_star, w, *lower.allocs]):
            body = Allocate(buf, body)
        body = For(b, zero, (total + (threads - 1)) // threads, "blockIdx.x",
                   For(t, zero, Const(threads, dt.int32), "threadIdx.x", body))
        used = global_buffers(body)
        body_vars = scalar_vars(exprs_of(body) + [x for bf in used for x in bf.shape + (bf.strides or ())])
        params = tuple(self.buffers[a] for a in prog_args if self.buffers[a] in used) + \
            tuple(p for p in self.partials if p in used) + tuple(v for v in self.sig.scalars if v in body_vars)
        name = u(f"{chain.output.name}_attention_combine_kernel")
        attrs: tuple[tuple[str, object], ...] = (
            ("online_contraction", (chain.m.name, chain.l.name, chain.output.name)),
            ("split_kv", f"{self.splits} chunks: rescale the partials by 2^(m_s - max), then the program's epilogue"))
        return PrimFunc(name, params, body, attrs)


def _wgmma_module(tcc: TensorCoreChain, rows_per_block: int, key_tile: int, name: str | None,
                  blocks_per_sm: int, overlap: bool = False, plain_order: bool = False, persistent: int = 0,
                  kv_splits: int = 1, guard_every_tile: bool = False, stages: int = STAGES,
                  peel_guarded: bool = False, query_major: bool = False) -> Module:
    where = "online_contraction_mma (wgmma)"
    if rows_per_block not in (64, 128, 192, 256):
        raise ScheduleError(f"{where}: rows_per_block={rows_per_block} must be 64, 128, 192 or 256 (one warpgroup "
                            "of m64 tiles per 64 query rows)")
    if key_tile not in (64, 128):
        raise ScheduleError(f"{where}: key_tile={key_tile} must be 64 or 128 (the n of the scores' m64nNk16 wgmma)")
    columns = const_int(tcc.chain.columns)
    if tcc.q.dtype != tcc.v.dtype:
        raise ScheduleError(f"{where}: Q/K are {tcc.q.dtype} and V is {tcc.v.dtype}; the Hopper form rounds P to one "
                            "16-bit dtype for both wgmmas")
    for what, n in (("scores", key_tile), ("output", columns)):
        if n not in WGMMA_N:
            raise ScheduleError(f"{where}: the {what} tile is {n} wide; wgmma has n in {WGMMA_N}")
    if isinstance(blocks_per_sm, bool) or not isinstance(blocks_per_sm, int) or not 0 <= blocks_per_sm <= 8:
        raise ScheduleError(f"{where}: blocks_per_sm={blocks_per_sm!r} must be 0 (no request) .. 8")
    if isinstance(persistent, bool) or not isinstance(persistent, int) or not 0 <= persistent <= 1024:
        raise ScheduleError(f"{where}: persistent={persistent!r} must be 0 (one block per work item) or the number of "
                            "blocks that loop over the work items (132: one per SM of an H100/H200), at most 1024")
    if isinstance(stages, bool) or stages not in (2, 3):
        raise ScheduleError(f"{where}: stages={stages!r} must be 2 or 3 (the depth of the K/V cp.async ring)")
    if stages != STAGES and (overlap or persistent):
        raise ScheduleError(f"{where}: stages={stages} is an option of the plain loop; the overlapped form has its own "
                            f"{OVERLAP_STAGES}-stage ring and the persistent one a 2-stage ring: leave stages out")
    if peel_guarded and overlap:
        raise ScheduleError(f"{where}: peel_guarded splits the plain key loop; the overlapped loop issues the next "
                            "tile's scores across the split: take one")
    if persistent and overlap:
        raise ScheduleError(f"{where}: persistent and overlap together are not built (the overlapped loop's prologue "
                            "issues tile 0's scores); take one")
    kernel = _Kernel(tcc, rows_per_block, key_tile, 16, name, warpgroup=True)
    kernel.plain_order = plain_order
    kernel.guard_every_tile = guard_every_tile
    kernel.peel_guarded = bool(peel_guarded)
    kernel.query_major = bool(query_major)
    kernel.persistent = persistent
    kernel.splits = kv_splits
    kernel.stages = stages
    if overlap:
        kernel.overlap, kernel.stages = True, OVERLAP_STAGES
    assert columns is not None
    # Q, the K and V ring, and the slack that aligns the dynamic shared memory to 1024 bytes
    # (the 128B swizzle's atom) in the emitter
    needed = 2 * (rows_per_block * tcc.depth + kernel.stages * key_tile * (tcc.depth + columns)) + 1024
    limit = target("sm_90").smem_per_block_optin
    if needed > limit:
        raise ScheduleError(f"{where}: {rows_per_block} rows x {key_tile}-key tiles at head dims {tcc.depth} / "
                            f"{columns} need {needed // 1024} KiB of shared memory; sm_90 allows {limit // 1024} KiB "
                            "per block: take 64-key tiles or fewer rows")
    _check_wgmma_relayout(kernel.qk_wgmma, kernel.pv_wgmma)
    module = kernel.module()
    if not blocks_per_sm:
        return module
    func, *rest = module.kernels
    func = replace(func, attrs=func.attrs + (("min_blocks_per_sm", blocks_per_sm),))
    return replace(module, kernels=(func, *rest))


def _positive_scale(value: Expr, scores: Reduce) -> float | None:
    """log2(e)·c when `value` is `scores · c` (either order, c > 0 a constant) or `scores` itself
    (c = 1), so that max(value) = c·max(scores); None otherwise."""
    if value is scores:
        return LOG2E
    if isinstance(value, Binary) and value.op == "*":
        for x, y in ((value.a, value.b), (value.b, value.a)):
            if x is scores and isinstance(y, Const) and y.dtype.is_float and float(y.value) > 0:
                return float(y.value) * LOG2E
    return None


def _inside(node: Expr, container: Expr) -> bool:
    return any(n is node for n in walk(container))


__all__ = ["TensorCoreChain", "block_width", "describe_skipping", "mma_sync_head_dims", "online_contraction_mma",
           "tensor_core_chain"]
