"""The online contraction on tensor cores: both contractions of the chain as mma.sync tiles, or
wgmma in the Hopper form (`wgmma=True`, sm_90a; docs/attention.md "The Hopper form").

The chain is the one `online_chain` recognises (tecc.passes.rewrite.online_contraction: a row max
m, a row sum l of exp(s - m), and O = g(Σ_j exp(s - m)·v, m, l)); online_mma_chain.py says when
it fits the tensor cores. This module builds its FlashAttention-2-shaped kernel (Dao,
"FlashAttention-2", 2023) from the kernel's layers, one module and one concern each (the list is
online_mma_operands.py's docstring): what a GEMM kernel also has -- operand tiles staged by
cp.async in swizzled shared memory, a ring of them, the two contractions, the epilogue, a
persistent grid -- written with the tensor-core layers' pieces where they are the same
(thread_partition.tile_copy, tile_staging.row_swizzle, ring.py's ring_fill and ring_step,
epilogue.paired_columns, tile_kernel.persistent_trips), and what is the attention's own: the
scores' elementwise stage under the masks, with the isl-proven key-tile bounds
(online_mma_scores.py, key_tiles.py), the running statistics, the rescale and P relaid from C to
A fragments (online_mma_softmax.py), split-KV's partials (online_mma_split_kv.py) and the launch
order (launch_order.py).

The kernel. One block per (head, BM query rows); per block:

1. Q tile [BM][D] -> shared; mma.sync: ldmatrix.x4 into A fragments that stay in registers for
   the whole key loop; the Hopper form reads Q from shared memory.
2. K and V tiles [BN][D], [BN][C] of consecutive keys stream through the ring; tile kt + S - 1
   is in flight while tile kt is computed (online_mma_loop.py).
3. S = Q Kᵀ into float32 fragments (online_mma_operands.py).
4. t = log2(e)·f(S) per element, -inf past the keys and outside the masks (online_mma_scores.py).
5. The running max m₂ and sum l per row, α = exp2(m₂_old - m₂_new) (online_mma_softmax.py).
6. P = exp2(t - m₂), rounded to V's dtype, straight into the A fragment of the second mma.
7. O = O·α + P V.
8. Epilogue: l summed over the quad, m = m₂ · ln 2, O[row, col] = g(acc, m, l) and the row outputs
   (online_mma_epilogue.py).

The Hopper form: one warpgroup per 64 query rows (warp 4w + v of warpgroup w owns rows 16v.. of
its 64, the mma.sync form's m16 rows), Q [BM][D], K and V tiles in blocked swizzled shared tiles
[stage][D / W][rows][W] (W = min(D, 64) halves a row: the 128B, 64B or 32B swizzle) read by wgmma
through descriptors (Q and K K-major, V MN-major as the B of P·V). S = Q·Kᵀ is D/16
wgmma.m64n{BN}k16 into the accumulator, whose layout is the m16n8 C pattern per warp and n8
block, so steps 4-6 are the mma.sync form's code; P's fragment is the register A of
wgmma.m64n{C}k16, and O += P·V is BN/16 such wgmmas. Both groups are waited for in their
iteration; the loop head is cp.async.wait_group S - 2, fence.proxy.async (wgmma reads through the
async proxy), barrier, then the next tile's copies.
"""

from __future__ import annotations

from typing import Any, Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, binary, const_int, size_product
from ...ir.intrinsics import WGMMA_N
from ...ir.stmt import Allocate, AsyncWait, Buffer, For, KernelCall, Module, PrimFunc, Stmt, seq
from ...ir.target import target
from ...ir.tensor import Tensor
from ..lower import kernel_params
from ..names import identifier
from .launch_order import block_grid, launch_order
from .mma_tiles import block_width, check_relayout, check_wgmma_relayout
from .online_contraction import MAX_GRID_Y, online_chain
from .online_mma_chain import (
    TensorCoreChain,
    describe_skipping,
    mma_sync_head_dims,
    tensor_core_chain,
)
from .online_mma_loop import KeyLoop
from .online_mma_operands import OVERLAP_STAGES, STAGES, OnlineTiling

WHERE = "online_contraction_mma"


def online_contraction_mma(args: Sequence[Tensor], rows_per_block: int = 64, key_tile: int = 64,
                           warp_rows: int = 16, name: str | None = None, wgmma: bool = False,
                           blocks_per_sm: int = 0, overlap: bool = False, plain_order: bool = False,
                           persistent: int = 0, kv_splits: int = 1, guard_every_tile: bool = False,
                           stages: int = STAGES, peel_guarded: bool = False, query_major: bool = False) -> Module:
    """The module of ONE tensor-core kernel computing the chain `args` (module docstring):
    `rows_per_block` query rows per block, `warp_rows` (16 or 32: one or two m16 tiles, which
    share every K and V fragment a warp loads) per warp, key tiles of `key_tile`.
    `wgmma`: the Hopper form (sm_90a; the module docstring's last section): one warpgroup per 64
    query rows, both contractions as wgmma, `warp_rows` ignored; `blocks_per_sm` > 0 asks for that
    many resident blocks (`__launch_bounds__`: ptxas caps the registers); `overlap`: S(kt + 1) and
    the softmax of tile kt + 1 while P(kt)·V is in flight, over a 3-stage ring
    (KeyLoop.overlapped_loop). `plain_order`: launch the blocks in the plain grid's order (query
    blocks, then heads) instead of launch_order's (for timing one against the other).
    `persistent` > 0 (the Hopper form, not overlapped): a grid of that many blocks (one per SM:
    132 on an H100/H200) looping over the (query block, head) work items, the longest first, the
    next item's loads under this one's epilogue (KeyLoop.persistent_body). `kv_splits` > 1
    (split-KV, for few query rows over many keys): a third grid axis over that many chunks of the
    key tiles, each block writing float32 partial O, max and sum of its chunk, and a second kernel
    combining them (SplitKV.combine_kernel); not with `overlap` or `persistent`.
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
    tcc = tensor_core_chain(online_chain(args))
    if isinstance(kv_splits, bool) or not isinstance(kv_splits, int) or not 1 <= kv_splits <= 65535:
        raise ScheduleError(f"{WHERE}: kv_splits={kv_splits!r} must be 1 (no split) .. 65535 key chunks")
    if kv_splits > 1 and (overlap or persistent):
        raise ScheduleError(f"{WHERE}: kv_splits with overlap or persistent is not built; take one")
    if query_major and (persistent or plain_order):
        raise ScheduleError(f"{WHERE}: query_major is a launch order of the plain grid; the persistent form's work "
                            "items are already query block major, and plain_order is another order: take one")
    common: dict[str, Any] = dict(splits=kv_splits, plain_order=bool(plain_order), query_major=bool(query_major),
                  guard_every_tile=bool(guard_every_tile), peel_guarded=bool(peel_guarded))
    if wgmma:
        check_wgmma_options(tcc, rows_per_block, key_tile, blocks_per_sm, overlap, persistent, stages, peel_guarded)
        tiling = OnlineTiling(rows_per_block, key_tile, wgmma=True, stages=OVERLAP_STAGES if overlap else stages,
                              overlap=bool(overlap), persistent=persistent, blocks_per_sm=blocks_per_sm, **common)
        check_shared_memory(tcc, tiling)
    else:
        if blocks_per_sm or overlap or persistent or stages != STAGES:
            raise ScheduleError(f"{WHERE}: blocks_per_sm, overlap, persistent and stages are options of the wgmma form "
                                "(wgmma=True)")
        check_mma_sync_options(tcc, rows_per_block, key_tile, warp_rows)
        tiling = OnlineTiling(rows_per_block, key_tile, warp_rows, **common)
    return _Kernel(tcc, tiling, name).module()


def check_mma_sync_options(tcc: TensorCoreChain, rows_per_block: int, key_tile: int, warp_rows: int) -> None:
    """The mma.sync form's tiling, or ScheduleError naming what it cannot take."""
    not_sync = mma_sync_head_dims(tcc)
    if not_sync is not None:
        raise ScheduleError(not_sync)
    if warp_rows not in (16, 32):
        raise ScheduleError(f"{WHERE}: warp_rows={warp_rows} must be 16 or 32 (one or two m16 tiles per warp)")
    if rows_per_block % warp_rows or not warp_rows <= rows_per_block <= 512 or rows_per_block // warp_rows > 16:
        raise ScheduleError(f"{WHERE}: rows_per_block={rows_per_block} must be a multiple of warp_rows={warp_rows} "
                            "(one warp per warp_rows rows), at most 16 warps")
    if key_tile not in (16, 32, 64, 128):
        raise ScheduleError(f"{WHERE}: key_tile={key_tile} must be 16, 32, 64 or 128")
    check_relayout(tcc.qk_intrinsic, tcc.pv_intrinsic)


def check_wgmma_options(tcc: TensorCoreChain, rows_per_block: int, key_tile: int, blocks_per_sm: int,
                        overlap: bool, persistent: int, stages: int, peel_guarded: bool) -> None:
    """The Hopper form's tiling and options, or ScheduleError naming what it cannot take."""
    where = f"{WHERE} (wgmma)"
    if rows_per_block not in (64, 128, 192, 256):
        raise ScheduleError(f"{where}: rows_per_block={rows_per_block} must be 64, 128, 192 or 256 (one warpgroup "
                            "of m64 tiles per 64 query rows)")
    if key_tile not in (64, 128):
        raise ScheduleError(f"{where}: key_tile={key_tile} must be 64 or 128 (the n of the scores' m64nNk16 wgmma)")
    if tcc.q.dtype != tcc.v.dtype:
        raise ScheduleError(f"{where}: Q/K are {tcc.q.dtype} and V is {tcc.v.dtype}; the Hopper form rounds P to one "
                            "16-bit dtype for both wgmmas")
    for what, n in (("scores", key_tile), ("output", const_int(tcc.chain.columns))):
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


def check_shared_memory(tcc: TensorCoreChain, t: OnlineTiling) -> None:
    """Q, the K and V ring, and the slack that aligns the dynamic shared memory to 1024 bytes (the
    128B swizzle's atom) in the emitter must fit sm_90's opt-in shared memory per block."""
    columns = const_int(tcc.chain.columns)
    assert columns is not None
    needed = 2 * (t.rows * tcc.depth + t.stages * t.key_tile * (tcc.depth + columns)) + 1024
    limit = target("sm_90").smem_per_block_optin
    if needed > limit:
        raise ScheduleError(f"{WHERE} (wgmma): {t.rows} rows x {t.key_tile}-key tiles at head dims {tcc.depth} / "
                            f"{columns} need {needed // 1024} KiB of shared memory; sm_90 allows {limit // 1024} KiB "
                            "per block: take 64-key tiles or fewer rows")


class _Kernel(KeyLoop):
    """The kernel assembled from its layers (module docstring)."""

    def module(self) -> Module:
        """The module: the kernel, and split-KV's combine kernel and partials."""
        chain, wg = self.chain, self.wg
        n_heads = size_product(chain.rows[:-1])
        if (const_int(n_heads) or 0) > MAX_GRID_Y:
            raise ScheduleError(f"{WHERE}: {const_int(n_heads)} heads exceed the grid's y extent {MAX_GRID_Y}")
        if wg:
            check_wgmma_relayout(self.qk_wgmma, self.pv_wgmma)
        body = self.block_body()
        for buf in reversed(self.allocations()):
            body = Allocate(buf, body)
        body = self.grid(For(self.tx, Const(0, dt.int32), Const(self.threads, dt.int32), "threadIdx.x", body))
        temps = tuple(self.partials) if self.t.splits > 1 else ()
        params = kernel_params(body, [self.buffers[a] for a in chain.program.args], temps, self.sig.scalars)
        kname = self.unique(f"{chain.output.name}_attention_{'wgmma' if wg else 'mma'}_kernel")
        attrs: tuple[tuple[str, object], ...] = (
            ("online_contraction", (chain.m.name, chain.l.name, chain.output.name)), ("tensorize", self.summary()))
        if self.t.blocks_per_sm:
            attrs += (("min_blocks_per_sm", self.t.blocks_per_sm),)
        kernels = [PrimFunc(kname, params, body, attrs)]
        if temps:
            kernels.append(self.combine_kernel())
        prog = chain.program
        mname = identifier(self.name or next(a.name for a in reversed(prog.args) if not a.is_placeholder))
        module_params = tuple(self.buffers[a] for a in prog.args) + tuple(self.sig.scalars)
        return Module(mname, module_params, tuple(kernels), tuple(KernelCall(k.name, k.params) for k in kernels), temps)

    def block_body(self) -> Stmt:
        """One block's work (module docstring, steps 1-8), in the loop form the tiling asks for."""
        self.operand_buffers()
        self.masked_tiles()
        self.key_range()
        init = self.statistics_init()
        q_copy = self.ring_prologue()
        # the Hopper form: Q stays in shared memory; the loop's wait, proxy fence and barrier make
        # it (and tile 0) visible to the first wgmma
        prologue = seq(q_copy, init) if self.wg else seq(q_copy, self.q_fragments(), init)
        if self.overlap:
            # the name the plain loop's scores take: kept, so the overlapped loop's are as they were
            self.unique("qk_step")
            loop, prologue = self.overlapped_loop(prologue, self.elementwise_stage())
        else:
            scores = self.scores(self.kt % self.stages)
            loop = self.plain_loop(scores, self.elementwise_stage())
        if self.t.splits > 1:   # the partial (acc, m₂, l) of this chunk instead of the program's epilogue
            finish = [self.row_sums(), self.store_partials()]
        else:
            finish = self.epilogue()
        self.launch = (1, False, "") if self.t.plain_order else launch_order(
            self.chain, (self.tcc.k, self.tcc.v), self.bx, self.BM, self.bound)
        if self.t.persistent:
            return self.persistent_body(q_copy, init, loop, finish, self.launch)
        return seq(prologue, loop, AsyncWait(0), *finish)

    def allocations(self) -> list[Buffer]:
        """The kernel's buffers, the outermost first."""
        if self.wg:
            fragments = [self.s_frag, self.p_frag, self.o_frag]
        else:
            fragments = [self.q_frag, self.k_frag, self.s_frag, self.p_frag, self.v_frag, self.o_frag]
        return [self.q_sh, self.k_sh, self.v_sh, *fragments, self.m_run, self.l_run, self.m_use, self.alpha,
                self.tile_max, self.l_sum, *self.lower.allocs]

    def grid(self, body: Stmt) -> Stmt:
        """The block loops: the persistent grid's P blocks, or launch_order's grid of (query block,
        head); split-KV's chunks on blockIdx.z."""
        zero = Const(0, dt.int32)
        if self.t.persistent:
            blocks = binary("min", Const(self.t.persistent, dt.int32), self.work_items())
            body = For(self.pb, zero, blocks, "blockIdx.x", body)
        else:
            body = block_grid(body, self.chain, self.BM, self.bx, self.by, self.launch, self.unique, self.t.query_major)
        if self.t.splits > 1:
            body = For(self.bz, zero, Const(self.t.splits, dt.int32), "blockIdx.z", body)
        return body

    def summary(self) -> str:
        """What the kernel is, for the plan (the attr "tensorize")."""
        t, tcc, BM, BN = self.t, self.tcc, self.BM, self.BN
        order = self.launch[2]
        if t.query_major and self.chain.rows[:-1]:
            order = ", ".join(x for x in (order, "query blocks major over all heads (query_major)") if x)
        said = f"; {order}" if order else ""
        if self.chain.dropout is not None:
            said += f"; {self.dropout_summary()}"
        if t.splits > 1:
            said += (f"; split-KV: {t.splits} chunks of {self.chunk_tiles()} key tiles (grid z), float32 partial "
                     "O, max and sum per chunk, combined by a second kernel (rescaled by 2^(m_s - max), then the "
                     "program's epilogue)")
        if t.persistent:
            said += (f"; persistent: {t.persistent} blocks loop over the (query block, head) work items, query "
                     "block major" + (", the longest first" if "from the last" in order else "") +
                     ", the next item's Q and first K/V tile loaded under this one's epilogue")
        if self.wg:
            return (f"{self.qk_wgmma} / {self.pv_wgmma} (P from registers): {BM} query rows ({BM // 64} warpgroups of "
                    f"64), key tiles of {BN}, Q, K K-major and V MN-major in swizzled shared memory read through "
                    f"descriptors, {self.stages}-stage cp.async ring"
                    f"{'; S(kt + 1) and its softmax while P(kt)·V is in flight' if self.overlap else ''}; "
                    "exp2 with log2(e) folded into the scale; "
                    f"{self.skipping}{said}")
        return (f"{tcc.qk_intrinsic} / {tcc.pv_intrinsic}: {BM} query rows ({self.warps} warps of {self.WR}), key "
                f"tiles of {BN}, {STAGES}-stage cp.async ring; exp2 with log2(e) folded into the scale; "
                f"{self.skipping}{said}")


__all__ = ["TensorCoreChain", "block_width", "describe_skipping", "mma_sync_head_dims", "online_contraction_mma",
           "tensor_core_chain"]
