"""The Hopper form (sm_90a) of the backward's key-block-major kernel: online_backward_mma's kernel
with every contraction a warpgroup MMA (FlashAttention-3's backward without its warp
specialization). One warpgroup per 64 keys of the block (BN = 64 or 128), warp w of the block
still owning keys 16w .. 16w + 15: the wgmma accumulator is the m16n8 C pattern per warp and n8
block (mma_tiles.check_wgmma_relayout), so the elementwise stage (P, the weights, the guards)
is the mma.sync kernel's, unchanged. Per query block of BM rows:

    wait; fence.proxy.async; barrier      the row tiles (Q, dO) landed and are visible to wgmma
    the next query block's tiles -> the other stage
    wgmma.fence; Sᵀ = K·Qᵀ; dPᵀ = V·dOᵀ   m64n{BM}k16, A = the warpgroup's 64 key rows, B = the row
                                          tile, both K-major; a group each; wait for Sᵀ's
    P                                     in place, while dPᵀ's group runs; then wait for it
    dV's and dK's weights -> register A fragments (the accumulator's elements 8k .. 8k + 7 are
                                          the register A of k16 step k), dQ's -> a blocked tile
    wgmma.fence; dV += Pᵀ·dO, dK += dSᵀ·Q  m64n{d}k16, A from registers, B = the row tile MN-major;
                                          committed, not waited for when dQ follows
    fence.proxy.async; barrier            dS's tile written by the threads, visible to wgmma
    wgmma.fence; dQ_part = dS·K           m64n{d / G}k16 per 64 queries over all BN keys, warpgroup
                                          g of G = BN / 64 owning columns g·d / G ..: A = dS's tile
                                          MN-major ([queries / 64][keys][64]), B = the K tile
                                          MN-major from g's first column; commit; wait (for
                                          both groups); float32 atomics

The warpgroups split dQ's columns, not its keys: one atomic per element and tile (as
FlashAttention-2), where a split by keys (each warpgroup its own 64) would add every element
once per warpgroup. Each reads the other's rows of dS's tile: the barrier before the dQ group
publishes them, and the one at the top of the next step (the ring's) keeps them until both
warpgroups' dQ groups are waited for. The tiles are the forward's
blocked swizzled ones ([stages][width / W][rows][W], TileStaging.blocked), read through
descriptors (TileStaging.operand).
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, TensorRead, Var, atomic_add_pair, compare, substitute
from ...ir.intrinsics import WARPGROUP_SIZE, WGMMA_N
from ...ir.stmt import (
    AsyncProxyFence,
    Barrier,
    Buffer,
    Evaluate,
    FragmentRef,
    IfThenElse,
    SharedMatrix,
    Stmt,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupMatrixMultiply,
    WarpgroupWait,
    seq,
)
from ..schedule.tensorize_wgmma import wgmma_intrinsic
from .mma_tiles import block_width, check_wgmma_relayout, descriptor
from .online_backward import BackwardChain, Contraction, GradOutput
from .online_backward_dq import QueryMajor
from .online_backward_kernels import WHERE, BackwardKernels, Tiles, tile_key
from .online_backward_key_major import KeyMajor


class KeyMajorWgmma(KeyMajor):
    """The key-block-major kernel on wgmma (module docstring)."""

    def __init__(self, chain: BackwardChain, key_tile: int, rows: int, atomics: bool, name: str | None,
                 overlap: bool = False) -> None:
        if key_tile not in (64, 128):
            raise ScheduleError(f"{WHERE} (wgmma): key_tile={key_tile} must be 64 or 128 (a warpgroup per 64 keys)")
        if rows not in (32, 64, 128) or (atomics and chain.of_kind("row") and rows % 64):
            raise ScheduleError(f"{WHERE} (wgmma): rows={rows} must be 64 or 128 (the scores' n; dQ's m64 tiles), or 32 "
                                "when dQ is the query-major kernel's")
        super().__init__(chain, key_tile, rows, 32, atomics, name)
        self.warpgroup = self.tx // WARPGROUP_SIZE
        self.qk = wgmma_intrinsic(self.dtype.name, rows)
        self.overlap = overlap

    def describe(self) -> str:
        text = "wgmma " + super().describe().replace(f"({self.warps} warps of 16)",
                                                     f"({self.BN // 64} warpgroups of 64)")
        return text + ("; each step's dV/dK wgmmas in flight into the next step's scores" if self.overlap else "")

    def _drain(self, n_steps: Expr) -> Stmt:
        """The last step's key-side group, left in flight (`overlap`), waited for; the
        accumulators zeroed where no step ran (`_init` leaves them to the first step)."""
        if not self.overlap:
            return seq()
        accs = tuple(self.accs[id(o.tensor)] for o in self.chain.of_kind("key"))
        return seq(WarpgroupWait(0, accs), IfThenElse(compare("==", n_steps, Const(0, dt.int32)), super()._init()))

    def _tile_buffer(self, label: str, read: TensorRead, stages: int, rows: int, width: int) -> Buffer:
        return self.blocked(label, read, stages, rows, width)

    def _weights_buffer(self) -> Buffer:
        """dS's tile as wgmma's MN-major A of dS·K: [BM / W][BN keys][W queries], W = 64."""
        w = block_width(self.BM)
        shape = tuple(Const(n, dt.int32) for n in (1, self.BM // w, self.BN, w))
        return Buffer(self.unique("weights_tile"), self.dtype, shape, "shared", tensor="dS.shared",
                      layout=descriptor(w, "K").layout)

    def _weights_index(self, rr: Expr, cc: Expr, nt: Expr) -> tuple[Expr, ...]:
        w = block_width(self.BM)
        query = nt * 8 + cc
        return Const(0, dt.int32), query // w, self.warp * 16 + rr, query % w

    def _fragments(self) -> None:
        chain, BM = self.chain, self.BM
        self.c_frags = {id(c.node): self.frag("tile_frag", self.qk, "d", BM // 2) for c in chain.contractions}
        self.pv = {id(o.tensor): wgmma_intrinsic(self.dtype.name, o.columns) for o in chain.outputs if o.operand is not None}
        for o in chain.outputs:
            if o.operand is not None and o.columns not in WGMMA_N:
                raise ScheduleError(f"{WHERE} (wgmma): {o.tensor.name} has {o.columns} columns, not a wgmma n")
        self.w_frags = {id(o.tensor): self.frag("weight_frag", self.pv[id(o.tensor)], "a", BM // 2)
                        for o in chain.of_kind("key")}
        self.accs = {id(o.tensor): self.frag("acc_frag", self.pv[id(o.tensor)], "d", o.columns // 2)
                     for o in chain.of_kind("key")}
        # dQ's columns split among the warpgroups (each sums all BN keys for its share) where each
        # share is whole chunks inside the K tile's column blocks, else each warpgroup sums its own
        # 64 keys over all columns; in chunks of at most 64 columns (one column block of the K
        # tile: half the accumulator of d = 128 at once, which keeps the kernel within 255 registers)
        self.dq_groups = {id(o.tensor): self._column_split(o) for o in self.row_side}
        self.dq_width = {id(o.tensor): o.columns // self.dq_groups[id(o.tensor)] for o in self.row_side}
        self.dq_chunk = {k: 64 if w % 64 == 0 else w for k, w in self.dq_width.items()}
        self.dq_row = {k: wgmma_intrinsic(self.dtype.name, n) for k, n in self.dq_chunk.items()}
        self.dq_frags = {id(o.tensor): self.frag("row_frag", self.dq_row[id(o.tensor)], "d", self.dq_chunk[id(o.tensor)] // 2)
                         for o in self.row_side}
        for o in chain.of_kind("key"):
            check_wgmma_relayout(self.qk, self.pv[id(o.tensor)], WHERE)

    def _column_split(self, o: GradOutput) -> int:
        """Into how many warpgroups' shares dQ's columns split: BN / 64 when each share is a wgmma
        n of whole chunks inside one column block of the K tile (d = 64: 32 each; d = 128: 64), else 1."""
        groups = self.BN // 64
        width, block = o.columns // groups, block_width(o.columns)
        if groups == 1 or o.columns % groups:
            return 1
        fits = width % 64 == 0 and block == 64 if width >= 64 else width in WGMMA_N and block % width == 0
        return groups if fits else 1

    def _allocations(self) -> list[Buffer]:
        out = [b for b, _ in self.key_tiles.values()] + [b for b, _ in self.row_tiles.values()]
        out += [b for b, _ in self.stat_tiles.values()]
        out += [self.weights_tile] if self.weights_tile is not None else []
        out += [*self.c_frags.values(), *self.w_frags.values(), *self.accs.values(), *self.dq_frags.values()]
        return out + list(self.lower.allocs)

    def _publish(self) -> list[Stmt]:
        """cp.async writes through the generic proxy: the fence makes them visible to wgmma."""
        return [AsyncProxyFence()]

    def _contractions(self, stage: Expr) -> Stmt:
        """Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ: the warpgroup's 64 key rows (K-major A) by the row tile (K-major
        B), scale-d false on the first k16 step. The scores are their own group, waited for
        while the others run (`_elementwise` computes P meanwhile, then waits for the rest)."""
        score = self.c_frags[id(self.score_node())]
        others = [c for c in self.chain.contractions if self.c_frags[id(c.node)] is not score]
        if not others:
            return row_key_contractions(self, stage, keys_first=True)
        steps = {id(c.node): self._scores_step(c, stage) for c in self.chain.contractions}
        # with `overlap` the last step's key-side group is ahead of these two in the queue: the
        # wait for the scores completes it too (its accumulators are next touched by this step's
        # key-side wgmmas, ordered after the wait as every asm statement is)
        return seq(WarpgroupFence(), steps[id(self.score_node())], WarpgroupCommit(),
                   *(steps[id(c.node)] for c in others), WarpgroupCommit(), WarpgroupWait(1, (score,)))

    def _scores_step(self, c: Contraction, stage: Expr) -> Stmt:
        key_tile = self.key_tiles[tile_key(c.key_operand)][0]
        row_tile = self.row_tiles[tile_key(c.row_operand)][0]
        return self.wgmma_k_major("depth_step", self.qk, self.c_frags[id(c.node)], key_tile, self.warpgroup * 64,
                                  row_tile, stage, c.depth // 16)

    def _elementwise(self, stage: Expr, parts: str = "all") -> Stmt:
        """P while the contractions after the scores run, their wait, then the weights."""
        score = self.c_frags[id(self.score_node())]
        others = tuple(f for f in self.c_frags.values() if f is not score)
        if not others or parts != "all":
            return super()._elementwise(stage, parts)
        return seq(super()._elementwise(stage, "probs"), WarpgroupWait(0, others), super()._elementwise(stage, "weights"))

    def _key_side(self, stage: Expr) -> Stmt:
        """acc[64 keys x C] += wᵀ·X: A = the weights from registers (k16 step kk of the queries),
        B = X's row tile MN-major (k = the queries). With row-side outputs the group is left in
        flight: dQ's group queues behind it and dQ's wait covers both (`_row_side`), so the
        tensor cores run through the barrier between them."""
        outs = self.chain.of_kind("key")
        if not outs:
            return seq()
        return register_a_outputs(self, stage, outs, self.row_tiles, "query_step", self.BM,
                                  wait=not (self.row_side or self.overlap),
                                  accumulate=compare("!=", self.it, Const(0, dt.int32)) if self.overlap else None)

    def _init(self) -> Stmt:
        """With `overlap` the accumulators are not zeroed: the first step's wgmmas do not read them
        (scale-d false on its first k16 step), and `_drain` zeroes them where no step ran."""
        return seq() if self.overlap else super()._init()

    def _row_side(self) -> Stmt:
        """dQ_part[64 queries x d] = dS·K over all BN keys of the block, the columns split among
        the warpgroups (warpgroup g owns d / (BN / 64) of them; `_column_split`), or over each
        warpgroup's own 64 keys where they do not split: A = dS's tile MN-major, B = the K tile
        MN-major from the share's first column; float32 atomics from the accumulator, one per
        element and tile when split (FlashAttention-2's count), else one per warpgroup."""
        if not self.row_side:
            return seq()
        assert self.weights_tile is not None
        out: list[Stmt] = [AsyncProxyFence(), Barrier()]
        in_flight = tuple(self.accs[id(o.tensor)] for o in self.chain.of_kind("key"))   # _key_side's group
        for o in self.row_side:
            assert o.operand is not None
            tile = self.key_tiles[tile_key(o.operand)][0]
            dq, row, chunk = self.dq_frags[id(o.tensor)], self.dq_row[id(o.tensor)], self.dq_chunk[id(o.tensor)]
            acc = self.accumulators[id(o.tensor)]
            tile_w = block_width(self.tile_width(tile))
            width = self.dq_width[id(o.tensor)]
            for mq in range(self.BM // 64):
                for c in range(0, width, chunk):
                    split = self.dq_groups[id(o.tensor)] > 1
                    c0: Expr | int = self.warpgroup * width + c if split else c
                    # split: every key of the block; else the warpgroup's own 64
                    k0 = None if split else self.warpgroup * 4
                    steps = self.BN // 16 if split else 4
                    out += [WarpgroupFence(), self.unrolled("key_step", steps, lambda kk, tile=tile, dq=dq, row=row,
                                                            mq=mq, c0=c0, k0=k0, tw=tile_w:
                                                            self._dq_step(kk, k0, tile, dq, row, mq, c0, tw)),
                            WarpgroupCommit(), WarpgroupWait(0, (dq, *in_flight)),
                            self.unrolled("dq_n", chunk // 8, lambda nt, mq=mq, c0=c0, dq=dq, acc=acc:
                                          self._dq_add(nt, mq, c0, dq, acc))]
                    in_flight = ()
        return seq(*out)

    def _dq_step(self, kk: Var, k0: Expr | None, tile: Buffer, dq: Buffer, row: str, mq: int, c0: Expr | int,
                 tile_w: int) -> Stmt:
        """k16 step k0 + kk of the block's keys: A = dS's tile MN-major at queries 64·mq.., B = the
        K tile MN-major at columns c0.. (inside one column block of it: an MN-major start moves n
        before the swizzle, as the hardware adds the start address)."""
        zero = Const(0, dt.int32)
        assert self.weights_tile is not None
        w = block_width(self.BM)
        k = kk if k0 is None else k0 + kk
        a = SharedMatrix(self.weights_tile, mq * (self.BN * w) + k * (16 * w), descriptor(w, "MN", self.BN))
        b = self.operand(tile, zero, zero, k, mn_major=True)
        start = b.start + (c0 // tile_w) * (self.BN * tile_w)
        if not isinstance(c0, int):
            start = start + c0 % tile_w
        b = SharedMatrix(b.buffer, start, b.descriptor)
        return WarpgroupMatrixMultiply(row, FragmentRef(dq, zero), a, b, compare("!=", kk, zero))

    def _dq_add(self, nt: Var, mq: int, c0: Expr | int, dq: Buffer, acc: Buffer) -> Stmt:
        """The accumulator's n8 tile nt added to dQ's float32 accumulator (rows past the end not):
        elements 2p and 2p + 1 of a thread are two adjacent columns of one row (the C pattern,
        checked), so each pair is one 8-byte reduction (atomic_add_pair: red.global.add.v2.f32,
        which sm_90 has), half the instructions and L2 requests of one atomic per element."""
        chain = self.chain
        for lane in range(32):
            for e in (0, 2):
                (r0, k0), (r1, k1) = self.c_map(lane, e), self.c_map(lane, e + 1)
                if r1 != r0 or k1 != k0 + 1 or k0 % 2:
                    raise ScheduleError(f"{WHERE} (wgmma): the accumulator's elements {e}, {e + 1} of lane {lane} "
                                        "are not an even column and the next of one row")

        def pair(p: Var) -> Stmt:
            rr, cc = self.c_map(self.lane, 2 * p)
            query = self.q0 + mq * 64 + (self.warp % 4) * 16 + rr
            at = tuple(substitute(x, {chain.query: query}) for x in chain.row_at)
            return IfThenElse(compare("<", query, chain.rows[-1]), Evaluate(
                atomic_add_pair(acc[at + (c0 + nt * 8 + cc,)], dq[4 * nt + 2 * p], dq[4 * nt + 2 * p + 1])))
        return self.unrolled("dq_pair", 2, pair)


class QueryMajorWgmma(QueryMajor):
    """The query-major dQ kernel (online_backward_dq) on wgmma: one warpgroup per 64 query rows
    (warp w of the block owning rows 16w.., the accumulator's row pattern), S = Q·Kᵀ and
    dP = dO·Vᵀ as m64n{BN}k16 (A = the warpgroup's 64 rows of the row tile, B = the key tile, both
    K-major), dQ += dS·K as m64n{d}k16 with dS the register A and the key tile MN-major."""

    def __init__(self, chain: BackwardChain, rows: int, key_tile: int, name: str | None,
                 like: BackwardKernels | None = None) -> None:
        if rows not in (64, 128) or key_tile not in (64, 128):
            raise ScheduleError(f"{WHERE} (wgmma): the query-major kernel takes 64 or 128 rows (a warpgroup per 64) "
                                f"and key blocks of 64 or 128, got {rows} x {key_tile}")
        super().__init__(chain, rows, key_tile, name, like)
        self.warpgroup = self.tx // WARPGROUP_SIZE
        self.qk = wgmma_intrinsic(self.dtype.name, key_tile)

    def form(self) -> str:
        return f"wgmma ({self.BM // 64} warpgroups of 64 rows)"

    def _tile_buffer(self, label: str, read: TensorRead, stages: int, rows: int, width: int) -> Buffer:
        return self.blocked(label, read, stages, rows, width)

    def _publish(self) -> list[Stmt]:
        return [AsyncProxyFence()]

    def _fragments(self) -> None:
        BN = self.BN
        self.c_frags = {id(c.node): self.frag("tile_frag", self.qk, "d", BN // 2) for c in self.chain.contractions}
        self.pv = {id(o.tensor): wgmma_intrinsic(self.dtype.name, o.columns) for o in self.outputs}
        self.w_frags = {id(o.tensor): self.frag("weight_frag", self.pv[id(o.tensor)], "a", BN // 2) for o in self.outputs}
        self.accs = {id(o.tensor): self.frag("acc_frag", self.pv[id(o.tensor)], "d", o.columns // 2)
                     for o in self.outputs}
        for o in self.outputs:
            if o.columns not in WGMMA_N:
                raise ScheduleError(f"{WHERE} (wgmma): {o.tensor.name} has {o.columns} columns, not a wgmma n")
            check_wgmma_relayout(self.qk, self.pv[id(o.tensor)], WHERE)

    def _allocations(self) -> list[Buffer]:
        out = [b for b, _ in self.row_tiles.values()] + [b for b, _ in self.key_tiles.values()]
        out += [b for b, _ in self.stat_tiles.values()]
        out += [*self.c_frags.values(), *self.w_frags.values(), *self.accs.values()]
        return out + list(self.lower.allocs)

    def _contractions(self, stage: Expr) -> Stmt:
        """S = Q·Kᵀ, dP = dO·Vᵀ: the warpgroup's 64 rows of the row tile (K-major A) by the key
        tile (K-major B); then waited for."""
        return row_key_contractions(self, stage, keys_first=False)

    def _row_side(self, stage: Expr) -> Stmt:
        """acc[64 queries x C] += w·Y: A = the weights from registers (k16 step kk of the keys),
        B = Y's key tile MN-major (k = the keys)."""
        return register_a_outputs(self, stage, self.outputs, self.key_tiles, "key_step", self.BN)


def row_key_contractions(kernel: KeyMajorWgmma | QueryMajorWgmma, stage: Expr, keys_first: bool) -> Stmt:
    """Each row-key contraction of the chain into its accumulator as one wgmma group, waited for:
    A = the staged tile (stage 0, K-major) of its key operand (`keys_first`: the key-block-major
    kernel's Sᵀ) or its row operand at the warpgroup's 64 rows, B = the other operand's tile of
    ring stage `stage` (K-major); scale-d false on the first k16 step."""
    steps = []
    for c in kernel.chain.contractions:
        key_tile = kernel.key_tiles[tile_key(c.key_operand)][0]
        row_tile = kernel.row_tiles[tile_key(c.row_operand)][0]
        a, b = (key_tile, row_tile) if keys_first else (row_tile, key_tile)
        steps.append(kernel.wgmma_k_major("depth_step", kernel.qk, kernel.c_frags[id(c.node)], a, kernel.warpgroup * 64,
                                          b, stage, c.depth // 16))
    return kernel.wgmma_group(steps, tuple(kernel.c_frags.values()))


def register_a_outputs(kernel: KeyMajorWgmma | QueryMajorWgmma, stage: Expr, outs: list[GradOutput], tiles: Tiles,
                       label: str, k: int, wait: bool = True, accumulate: Expr | None = None) -> Stmt:
    """acc += w·X for each output of `outs` as one wgmma group, waited for unless not `wait` (then
    committed and left in flight: a later wait must cover it before the accumulators or the
    register A are touched): A = its weights from registers, B = its operand's tile in `tiles` of
    ring stage `stage` MN-major, over `k` (the queries or the keys) in k16 steps."""
    steps = []
    for o in outs:
        assert o.operand is not None
        key = id(o.tensor)
        steps.append(kernel.wgmma_register_a(label, kernel.pv[key], kernel.accs[key], kernel.w_frags[key],
                                             tiles[tile_key(o.operand)][0], stage, k // 16, accumulate))
    if not wait:
        return seq(WarpgroupFence(), *steps, WarpgroupCommit())
    return kernel.wgmma_group(steps, tuple(kernel.accs.values()))


__all__ = ["KeyMajorWgmma", "QueryMajorWgmma"]
