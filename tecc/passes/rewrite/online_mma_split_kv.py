"""Split-KV of the tensor-core attention (online_contraction_mma's `kv_splits` = S, for decoding:
few query rows over many keys). A third grid axis over S chunks of the key tiles: each block runs
the key loop over its chunk only and stores its unnormalized O, its running max m₂ (log2 units)
and its sum l to float32 partials (`store_partials`, the module's temporaries), and a second
kernel (`combine_kernel`) combines the chunks: the online softmax's rescaling across chunks,
then the program's epilogue.
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.expr import Const, Expr, Var, binary, call, cast, compare, select, size_product, substitute
from ...ir.online_chain import row_index
from ...ir.stmt import Allocate, Buffer, BufferStore, For, IfThenElse, PrimFunc, Stmt, seq
from ...ir.visitor import SubexpressionReplacer
from ..lower import kernel_params
from ..schedule.tile_kernel import ceil_div
from .online_contraction import ExpressionLowering, head_indices
from .online_mma_chain import TensorCoreChain
from .online_mma_epilogue import OnlineEpilogue
from .online_mma_operands import OnlineTiling
from .online_mma_scores import MINUS_INF
from .online_mma_softmax import LN2

COMBINE_THREADS = 256


class SplitKV(OnlineEpilogue):
    """The key chunks, their partials and the combine kernel (module docstring)."""

    def __init__(self, tcc: TensorCoreChain, tiling: OnlineTiling, name: str | None) -> None:
        super().__init__(tcc, tiling, name)
        self.partials: list[Buffer] = []   # made by the first partial_buffers()

    def chunk_tiles(self) -> Expr:
        """Key tiles per chunk: ceil(all tiles / splits)."""
        return ceil_div(ceil_div(self.chain.keys, self.BN), self.t.splits)

    def partial_buffers(self) -> tuple[Buffer, Buffer, Buffer]:
        """Float32 [splits, heads, rows, C] partial outputs and [splits, heads, rows] running max
        (log2 units) and sums, the module's temporaries."""
        if not self.partials:
            chain = self.chain
            heads = size_product(chain.rows[:-1])
            S = Const(self.t.splits, dt.int32)
            name = chain.output.name
            self.partials = [
                Buffer(self.unique(f"{name}_partial_acc"), dt.float32,
                       (S, heads, chain.rows[-1], Const(self.C, dt.int32)), "global", tensor=f"{name}.partial_acc"),
                Buffer(self.unique(f"{name}_partial_max"), dt.float32, (S, heads, chain.rows[-1]), "global",
                       tensor=f"{name}.partial_max"),
                Buffer(self.unique(f"{name}_partial_sum"), dt.float32, (S, heads, chain.rows[-1]), "global",
                       tensor=f"{name}.partial_sum")]
        acc, mx, sm = self.partials
        return acc, mx, sm

    def store_partials(self) -> Stmt:
        """This chunk's unnormalized O, running max m₂ and sum l to the partial buffers (rows
        inside the queries; m₂ and l by lane 0 of each quad)."""
        acc, mx, sm = self.partial_buffers()
        queries, OF, MT = self.chain.rows[-1], self.OF, self.MT
        hd = self.by if self.chain.rows[:-1] else Const(0, dt.int32)

        def out_tile(mt: Var, nt: Var) -> Stmt:
            def one(e: Var) -> Stmt:
                r, col = self.c_map(self.lane, e)
                row = self.warp_row0(mt) + r
                return IfThenElse(compare("<", row, queries), BufferStore(
                    acc, (self.bz, hd, row, nt * 8 + col), self.o_frag[OF * mt + 4 * nt + e]))
            return self.unrolled("part_e", 4, one)

        def row_out(r: Var) -> Stmt:
            row = self.warp_row0(r // 2) + self.lane // 4 + 8 * (r % 2)
            return IfThenElse(compare("==", self.lane % 4, Const(0, dt.int32)) & compare("<", row, queries), seq(
                BufferStore(mx, (self.bz, hd, row), self.m_run[r]),
                BufferStore(sm, (self.bz, hd, row), self.l_sum[r])))
        return seq(self.unrolled("part_m", MT, lambda mt: self.unrolled("part_tile", self.C // 8,
                                                                          lambda nt: out_tile(mt, nt))),
                   self.unrolled("part_row", 2 * MT, row_out))

    def combine_kernel(self) -> PrimFunc:
        """One thread per (head, row, column): m* = max_s m₂_s (0 in its place while -inf),
        w_s = 2^(m₂_s - m*), l* = Σ_s w_s·l_s, acc* = Σ_s w_s·acc_s (the rescaling of the online
        pass, across chunks), then the program's epilogue g(acc*, m*·ln 2, l*) and, at column 0,
        its row outputs."""
        chain = self.chain
        acc, mx, sm = self.partial_buffers()
        u = self.unique
        lower = ExpressionLowering(self.buffers, u)
        zero = Const(0, dt.int32)
        C = Const(self.C, dt.int32)
        heads, queries = chain.rows[:-1], chain.rows[-1]
        total = size_product(heads) * queries * C
        b, t, s = (Var(u(n), dt.int32) for n in ("combine_block", "combine_thread", "chunk"))
        flat = b * COMBINE_THREADS + t
        column, row, head = flat % C, (flat // C) % queries, flat // (C * queries)
        head_at = dict(zip(chain.row[:-1], head_indices(head, heads)))
        m_star, m_use, l_star, o_star, w = (Buffer(u(n), dt.float32, (Const(1, dt.int32),), "local",
                                                   tensor=f"combine.{n}")
                                            for n in ("m_star", "m_use", "l_star", "o_star", "weight"))
        S = Const(self.t.splits, dt.int32)
        stats: dict[Expr, Expr] = {chain.m_value: cast(m_star[zero] * LN2, chain.m.dtype),
                                   chain.l_value: cast(l_star[zero], chain.l.dtype)}
        body_g = SubexpressionReplacer({**stats, chain.contraction: cast(o_star[zero], chain.contraction.dtype)}
                                       ).visit(chain.output_body)
        st, val = lower.value(substitute(body_g, {**head_at, chain.row[-1]: row, chain.column: column}))
        idx = tuple(head_at[v] for v in chain.row[:-1]) + (row, column)
        stmts: list[Stmt] = [
            BufferStore(m_star, (zero,), MINUS_INF),
            For(s, zero, S, "serial", BufferStore(m_star, (zero,), binary("fmax", m_star[zero], mx[s, head, row]))),
            BufferStore(m_use, (zero,), select(compare("==", m_star[zero], MINUS_INF), Const(0.0, dt.float32),
                                               m_star[zero])),
            BufferStore(l_star, (zero,), Const(0.0, dt.float32)),
            BufferStore(o_star, (zero,), Const(0.0, dt.float32)),
            For(s, zero, S, "serial", seq(
                BufferStore(w, (zero,), call("exp2_approx", mx[s, head, row] - m_use[zero])),
                BufferStore(l_star, (zero,), l_star[zero] + w[zero] * sm[s, head, row]),
                BufferStore(o_star, (zero,), o_star[zero] + w[zero] * acc[s, head, row, column]))),
            *st, BufferStore(self.buffers[chain.output], idx, cast(val, chain.output.dtype))]
        row_stmts: list[Stmt] = []
        row_at = tuple(head_at[v] for v in chain.row[:-1]) + (row,)
        for tensor, value in chain.row_outputs:
            st2, val2 = lower.value(substitute(SubexpressionReplacer(stats).visit(value),
                                               {**head_at, chain.row[-1]: row}))
            row_stmts.append(seq(*st2, BufferStore(self.buffers[tensor], row_index(tensor, row_at),
                                                 cast(val2, tensor.dtype))))
        if row_stmts:
            stmts.append(IfThenElse(compare("==", column, zero), seq(*row_stmts)))
        body: Stmt = IfThenElse(compare("<", flat, total), seq(*stmts))
        for buf in reversed([m_star, m_use, l_star, o_star, w, *lower.allocs]):
            body = Allocate(buf, body)
        body = For(b, zero, ceil_div(total, COMBINE_THREADS), "blockIdx.x",
                   For(t, zero, Const(COMBINE_THREADS, dt.int32), "threadIdx.x", body))
        params = kernel_params(body, [self.buffers[a] for a in chain.program.args], self.partials, self.sig.scalars)
        name = u(f"{chain.output.name}_attention_combine_kernel")
        attrs: tuple[tuple[str, object], ...] = (
            ("online_contraction", (chain.m.name, chain.l.name, chain.output.name)),
            ("split_kv", f"{self.t.splits} chunks: rescale the partials by 2^(m_s - max), then the program's epilogue"))
        return PrimFunc(name, params, body, attrs)


__all__ = ["COMBINE_THREADS", "SplitKV"]
