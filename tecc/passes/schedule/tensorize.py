"""tensorize: a contraction stage rebuilt as a tiled tensor-core kernel (mma.sync, ldmatrix, cp.async).

What it matches (by index structure, never by name). The stage must still be the kernel lowering
made for it (tensorize is its first primitive):

    for b..: for i: for j:                      # spatial loops; the last two are rows and columns
      acc[0] = 0
      for k: acc[0] = acc[0] + term             # one reduction axis
      C[b.., i, j] = epilogue(acc[0])

where `term` is `float32(A[..] * B[..])` (the plain half form `tc.sum(A[i, k] * B[k, j])`) or
`float32(A[..]) * float32(B[..])`; A and B are float16 or bfloat16 (the same dtype, the one of
the intrinsic) global buffers, contiguous, each index a single loop variable: A by the batch
axes, then (i, k) or (k, i); B by the batch axes, then (k, j) or (j, k); C by exactly
(b.., i, j). Anything else is a ScheduleError naming the condition.

Accumulation semantics: the mma multiplies the half operands exactly and accumulates in float32
(the lowered loop's accumulator dtype), rounding once per k16 step. The plain half form lowers to
`float32(A * B)`, a product rounded to half before it is widened; the tensor core does not round
the product, so the tensorized kernel is at least as accurate (products exact, fp32 sums); the
epilogue then rounds once to the output dtype.

What it emits, step by step (each step is one function below):

1. tiling      blocks over (batch → blockIdx.z, row tiles → blockIdx.y, column tiles →
               blockIdx.x), grids by ceil-division (symbolic sizes work); one threadIdx.x loop of
               32·WM_COUNT·WN_COUNT threads, warp = tx // 32 at (warp // WN_COUNT, warp % WN_COUNT);
               each warp owns (BM/WM_COUNT) × (BN/WN_COUNT) = TM × TN mma tiles of 16 × 8, their
               accumulators one fragment buffer of TM·TN·4 floats per lane.
2. staging     each operand's tile is kept in shared memory in its global orientation (its
               contiguous axis contiguous), in a ring of S stages: A as [S][BM][BK] (k-contiguous)
               or [S][BK][BM] (i-contiguous), B as [S][BK][BN] or [S][BN][BK]. A row of W halves
               gets the XOR swizzle that puts the 8 rows one ldmatrix matrix reads in 8 different
               16-byte bank groups (`row_swizzle`). A tile is filled with 16-byte cp.async copies
               when the operand's contiguous extent is a constant multiple of 8 (every chunk then
               lies inside or outside the matrix, and rows start 16-byte aligned); the predicate
               zero-fills chunks past the M/N/K edges. A contiguous extent that is a multiple of 4
               or 2 only gets 8- or 4-byte copies (cp.async.ca). Otherwise (odd K, a symbolic
               contiguous extent) the tile's elements are loaded guarded (select(in range, x, 0))
               into registers when the refill is issued and stored to shared after the compute.
3. pipeline    S - 1 stages are loaded before the k loop, one commit group each; iteration kt
               waits until at most S - 2 groups are in flight (stage kt has landed), barriers
               (every thread's copies are visible, and every warp is done with stage kt - 1),
               then refills stage (kt + S - 1) % S = (kt - 1) % S, commits (a group even when
               empty, so "S - 2 most recent" always means the stages after kt), and computes
               stage kt. One barrier per k tile; the emulator proves the ring race-free.
4. fragments   per k16 step: ldmatrix.x4 for a 16 × 16 A tile (`.trans` when A is i-contiguous,
               stored [k][i]), ldmatrix.x4 for two 16 × 8 B tiles (`.trans` when B is
               j-contiguous, stored [k][j]; plain when B is k-contiguous, stored [j][k]).
5. mma         TM × TN mma.sync per k16 step into the accumulators.
6. epilogue    each lane's accumulator elements at (row, col) from the C fragment's layout map,
               guarded by row < M and col < N, stored as the stage's own store with acc[0]
               replaced by the element: bias, activations, residuals, scales and the cast to the
               output dtype fuse as written.

Next refactor (not done here): steps 2-3 are a `pipeline(loop, stages)` primitive on loop IR
(staged loads of a k-tile loop → a ring of cp.async groups) and a `swizzle(cache)` primitive;
this file would then keep the matching, the fragment loads, the mma and the epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Binary, BufferLoad, Cast, Const, Expr, Var, const_int, select, size_product, substitute
from ...ir.intrinsics import lookup
from ...ir.layout import Swizzle
from ...ir.stmt import (
    Allocate,
    AsyncCommit,
    AsyncCopy,
    AsyncWait,
    Barrier,
    Buffer,
    BufferStore,
    For,
    FragmentRef,
    IfThenElse,
    MatrixLoad,
    MatrixMultiply,
    PrimFunc,
    Seq,
    Stmt,
    seq,
)
from ...ir.visitor import ExprMutator

INTRINSICS = {"float16": "mma.m16n8k16.f32.f16", "bfloat16": "mma.m16n8k16.f32.bf16"}
CHUNK = 8  # halves per 16-byte cp.async copy and per ldmatrix row


def copy_elements(contiguous_extent: Expr) -> int:
    """Halves per cp.async copy of an operand whose rows have `contiguous_extent` elements: 8
    (16 bytes), 4 or 2 when the extent is a constant multiple of it (every copy then lies wholly
    inside or outside the matrix, and every row starts aligned to the copy), 0 when none is
    provable (odd or symbolic: element loads)."""
    last = const_int(contiguous_extent)
    if last is None:
        return 0
    return next((n for n in (8, 4, 2) if last % n == 0), 0)


@dataclass(frozen=True)
class Operand:
    """One multiplicand: its buffer, its batch indices, and which of its two trailing indices is
    the reduction axis. `k_last`: contiguous along k (A[i, k], B[j, k])."""

    role: str            # "A" (rows) or "B" (columns)
    buffer: Buffer
    k_last: bool


@dataclass(frozen=True)
class Contraction:
    """The matched stage: C[b.., i, j] = epilogue(Σ_k A · B)."""

    batch: tuple[tuple[Var, Expr], ...]   # (loop variable, extent), outermost first
    i: Var
    m: Expr
    j: Var
    n: Expr
    k: Var
    kext: Expr
    a: Operand
    b: Operand
    acc: Buffer                            # the lowered accumulator (float32[1], local)
    store: BufferStore                     # C[b.., i, j] = epilogue(acc[0])


# ---- matching -----------------------------------------------------------------------------------

def match_contraction(func: PrimFunc, stage: str) -> Contraction:
    """The contraction computed by `func` for `stage`, or a ScheduleError naming what differs."""
    where = f"tensorize({stage})"
    loops: list[For] = []
    node: Stmt = func.body
    while isinstance(node, For):
        if node.kind != "serial":
            raise ScheduleError(f"{where}: loop {node.var.name} is already {node.kind}; tensorize must be the "
                                "first primitive applied to the stage's kernel")
        loops.append(node)
        node = node.body
    if not isinstance(node, Allocate) or len(loops) < 2:
        raise ScheduleError(f"{where}: expected the lowered loop nest (spatial loops, then the accumulator) of a "
                            "stage with at least two spatial axes and one reduction")
    acc = node.buffer
    body = node.body
    if not isinstance(body, Seq) or len(body.stmts) != 3:
        raise ScheduleError(f"{where}: expected init, one reduction loop and the store under the accumulator "
                            f"{acc.name} (a stage with one Reduce)")
    init, kloop, store = body.stmts
    if acc.dtype != dt.float32:
        raise ScheduleError(f"{where}: the accumulator {acc.name} is {acc.dtype}; tensor cores accumulate in float32 "
                            "(use float16/bfloat16 operands and a float16/bfloat16/float32 result)")
    if not (isinstance(init, BufferStore) and init.buffer is acc and isinstance(init.value, Const)
            and float(init.value.value) == 0.0):
        raise ScheduleError(f"{where}: the reduction must be a sum starting at 0 (tc.sum)")
    if not isinstance(kloop, For) or not isinstance(kloop.body, BufferStore) or kloop.body.buffer is not acc:
        raise ScheduleError(f"{where}: expected one reduction axis whose loop updates {acc.name} and nothing else")
    if not isinstance(store, BufferStore) or store.buffer.scope != "global":
        raise ScheduleError(f"{where}: expected the store of the stage to a global buffer after the reduction")
    if const_int(kloop.min) != 0 or any(const_int(lp.min) != 0 for lp in loops):
        raise ScheduleError(f"{where}: every axis must start at 0")
    update = kloop.body.value
    if not (isinstance(update, Binary) and update.op == "+" and isinstance(update.a, BufferLoad)
            and update.a.buffer is acc):
        raise ScheduleError(f"{where}: the reduction must be a sum (acc = acc + term), got {update}")
    x, y = _multiplicands(where, update.b)
    spatial = [lp.var for lp in loops]
    i, j, k = spatial[-2], spatial[-1], kloop.var
    batch = spatial[:-2]
    if not _same_vars(store.indices, spatial):
        raise ScheduleError(f"{where}: the output {store.buffer.name} must be indexed by exactly its loop axes "
                            f"({', '.join(v.name for v in spatial)}), got [{', '.join(map(str, store.indices))}]; "
                            "the kernel must be as lowered (tensorize is the first primitive applied to it)")
    ops: dict[str, Operand] = {}
    for load in (x, y):
        names = [ix.name if isinstance(ix, Var) else None for ix in load.indices]
        if None in names:
            raise ScheduleError(f"{where}: operand {load.buffer.name} is indexed by "
                                f"[{', '.join(map(str, load.indices))}]; tensorize needs every index a single axis")
        role = ("A" if i.name in names and j.name not in names
                else "B" if j.name in names and i.name not in names else "?")
        outer = i if role == "A" else j
        want_batch = [v.name for v in batch]
        tail = names[len(batch):]
        if (role == "?" or names[:len(batch)] != want_batch
                or sorted(str(x) for x in tail) != sorted([outer.name, k.name])):
            raise ScheduleError(
                f"{where}: operand {load.buffer.name}[{', '.join(map(str, load.indices))}] must be indexed by the "
                f"batch axes ({', '.join(want_batch) or 'none'}) then by (row, {k.name}) or (col, {k.name}) with "
                f"row {i.name} and col {j.name}")
        if role in ops:
            raise ScheduleError(f"{where}: both operands are indexed by the {'row' if role == 'A' else 'column'} axis")
        if load.buffer.strides is not None:
            raise ScheduleError(f"{where}: operand {load.buffer.name} has run-time strides; tensorize needs a "
                                "contiguous row-major operand (copy it first)")
        ops[role] = Operand(role, load.buffer, tail[-1] == k.name)
    if x.buffer.dtype != y.buffer.dtype:
        raise ScheduleError(f"{where}: mixed operand dtypes {x.buffer.name}: {x.buffer.dtype}, {y.buffer.dtype} "
                            f"{y.buffer.name}; cast one so both are float16 or both bfloat16")
    return Contraction(tuple((lp.var, lp.extent) for lp in loops[:-2]), i, loops[-2].extent, j, loops[-1].extent,
                       k, kloop.extent, ops["A"], ops["B"], acc, store)


def _same_vars(indices: Sequence[Expr], vars_: Sequence[Var]) -> bool:
    return len(indices) == len(vars_) and all(isinstance(a, Var) and a.name == b.name for a, b in zip(indices, vars_))


def _multiplicands(where: str, term: Expr) -> tuple[BufferLoad, BufferLoad]:
    """The two half loads of `float32(A * B)` or `float32(A) * float32(B)`."""
    if isinstance(term, Cast) and term.dtype == dt.float32:
        term = term.a
    if not (isinstance(term, Binary) and term.op == "*"):
        raise ScheduleError(f"{where}: the summed term must be a product of two operands, got {term}")
    out = []
    for side in (term.a, term.b):
        if isinstance(side, Cast) and side.dtype == dt.float32:
            side = side.a
        if not isinstance(side, BufferLoad) or side.buffer.scope != "global":
            raise ScheduleError(f"{where}: multiplicand {side} is not a read of an input (fold scales into the "
                                "epilogue, casts to float32 are allowed)")
        if side.buffer.dtype not in (dt.float16, dt.bfloat16):
            raise ScheduleError(f"{where}: operand {side.buffer.name} is {side.buffer.dtype}; tensor-core "
                                "mma.m16n8k16 needs float16 or bfloat16 operands")
        out.append(side)
    return out[0], out[1]


# ---- fragment loads (shared by every tensor-core kernel) ---------------------------------------

def load_a_fragment(dst: FragmentRef, tile: Buffer, stage: Expr, m0: Expr, k0: Expr, lane: Expr,
                    k_last: bool) -> Stmt:
    """ldmatrix.x4 of the 16 x 16 A tile at rows m0.., k k0.. of ring stage `stage` of `tile` into
    the A fragment `dst`. The four 8 x 8 matrices in register order are (m 0:8, k 0:8),
    (m 8:16, k 0:8), (m 0:8, k 8:16), (m 8:16, k 8:16); lane = 8j + r supplies row r of matrix j.
    `k_last`: the tile is stored [m][k] (plain); otherwise [k][m] (`.trans`)."""
    r, j = lane % 8, lane // 8
    if k_last:
        return MatrixLoad("ldmatrix.x4", dst, tile, (stage, m0 + r + 8 * (j % 2), k0 + 8 * (j // 2)))
    return MatrixLoad("ldmatrix.x4.trans", dst, tile, (stage, k0 + r + 8 * (j // 2), m0 + 8 * (j % 2)))


def load_b_fragments(dst: FragmentRef, tile: Buffer, stage: Expr, n0: Expr, k0: Expr, lane: Expr,
                     k_last: bool) -> Stmt:
    """ldmatrix.x4 of two 16 x 8 B tiles (columns n0..n0+16, k k0..k0+16) of ring stage `stage`
    of `tile` into 8 elements of B fragments at `dst` (the first n8 tile, then the second). The
    matrices are (k 0:8, n 0:8), (k 8:16, n 0:8), (k 0:8, n 8:16), (k 8:16, n 8:16). `k_last`:
    the tile is stored [n][k] and plain ldmatrix gives the "col" B fragment; otherwise [k][n]
    (`.trans`)."""
    r, j = lane % 8, lane // 8
    if k_last:
        return MatrixLoad("ldmatrix.x4", dst, tile, (stage, n0 + r + 8 * (j // 2), k0 + 8 * (j % 2)))
    return MatrixLoad("ldmatrix.x4.trans", dst, tile, (stage, k0 + r + 8 * (j % 2), n0 + 8 * (j // 2)))


# ---- the kernel ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tiling:
    bm: int
    bn: int
    warps_m: int
    warps_n: int
    bk: int
    stages: int

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def tm(self) -> int:
        return self.bm // self.warps_m // 16

    @property
    def tn(self) -> int:
        return self.bn // self.warps_n // 8


def check_tiling(stage: str, t: Tiling) -> None:
    where = f"tensorize({stage})"
    if t.stages < 2 or t.stages > 8:
        raise ScheduleError(f"{where}: stages must be 2..8 (cp.async.wait_group takes 0..7), got {t.stages}")
    if t.bk % 16 or t.bk < 16:
        raise ScheduleError(f"{where}: k_tile must be a multiple of 16 (the mma's k), got {t.bk}")
    if t.warps_m < 1 or t.warps_n < 1 or t.threads > 1024:
        raise ScheduleError(f"{where}: warps {t.warps_m}x{t.warps_n} must be positive and at most 32 in all")
    if t.bm % (16 * t.warps_m) or t.bn % (16 * t.warps_n):
        raise ScheduleError(f"{where}: block {t.bm}x{t.bn} over warps {t.warps_m}x{t.warps_n} must give warp tiles "
                            "that are multiples of 16 x 16 (ldmatrix.x4 loads two 16x8 B tiles)")
    for rows, width in ((t.bm, t.bk), (t.bk, t.bm), (t.bk, t.bn), (t.bn, t.bk)):
        if (rows * width) % (CHUNK * t.threads) or width % CHUNK or _power_of_two(width) is None:
            raise ScheduleError(f"{where}: a {rows}x{width} tile is not a whole number of 16-byte copies per thread "
                                f"for {t.threads} threads (block dimensions and k_tile powers of two >= 16)")


def _power_of_two(n: int) -> int | None:
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else None


def row_swizzle(width: int) -> Swizzle:
    """The XOR swizzle of a tile with rows of `width` halves: the 16-byte chunk index (base 3)
    XORed with row % 8 (3 bits, shift log2(width) - 3, so the XOR source is the row number), so
    the 8 consecutive rows an ldmatrix matrix reads at one chunk hit 8 different 16-byte bank
    groups. Rows of 32 halves (64 B) pair up in a 128-byte line: there the chunk (2 bits) is
    XORed with (row // 2) % 4, as in tests/test_matrix_gemm.py."""
    w = _power_of_two(width)
    assert w is not None and w >= 4
    bits = min(3, w - 3)
    return Swizzle(bits, 3, max(3, w - 3))


def tensorize(func: PrimFunc, stage: str, intrinsic: str, tiling: Tiling) -> PrimFunc:
    """`func` (the lowered kernel of `stage`) as a tensor-core kernel (module docstring)."""
    c = match_contraction(func, stage)
    check_tiling(stage, tiling)
    dtype = c.a.buffer.dtype.name
    want = INTRINSICS.get(dtype)
    if intrinsic == "auto":
        intrinsic = want or ""
    if intrinsic != want:
        raise ScheduleError(f"tensorize({stage}): intrinsic {intrinsic!r} does not take {dtype} operands; "
                            f"use {want!r} (or 'auto')")
    return _Emitter(func, c, intrinsic, tiling).kernel()


def _int(value: int) -> Expr:
    return Const(value, dt.int32)


def _shape(*dims: int) -> tuple[Expr, ...]:
    return tuple(_int(d) for d in dims)


def _ceil_div(a: Expr, b: int) -> Expr:
    return (a + (b - 1)) // b


def _unrolled(name: str, extent: int, body: Callable[[Var], Stmt]) -> Stmt:
    v = Var(name)
    return For(v, _int(0), _int(extent), "unroll", body(v))


class _ReplaceAccumulator(ExprMutator):
    def __init__(self, acc: Buffer, value: Expr) -> None:
        super().__init__()
        self.acc, self.value = acc, value

    def visit_BufferLoad(self, e: BufferLoad) -> Expr:
        if e.buffer is self.acc:
            return self.value
        return self.generic_visit(e)


class _Emitter:
    def __init__(self, func: PrimFunc, c: Contraction, intrinsic: str, t: Tiling) -> None:
        self.func, self.c, self.row, self.t = func, c, intrinsic, t
        # names that meet a parameter's are made distinct by unique_names before codegen
        self.bz, self.by, self.bx = Var("block_batch"), Var("block_row"), Var("block_col")
        self.tx, self.kt = Var("thread"), Var("k_tile")
        self.lane, warp = self.tx % 32, self.tx // 32
        self.warp_m, self.warp_n = warp // t.warps_n, warp % t.warps_n
        self.k_tiles = _ceil_div(c.kext, t.bk)
        frag = lookup(intrinsic)
        self.frag_a = Buffer("a_frag", frag.operand("a").dtype, _shape(8 * t.tm), "fragment",
                             fragment=(intrinsic, "a"))
        self.frag_b = Buffer("b_frag", frag.operand("b").dtype, _shape(4 * t.tn), "fragment",
                             fragment=(intrinsic, "b"))
        self.frag_c = Buffer("acc", dt.float32, _shape(4 * t.tm * t.tn), "fragment",
                             fragment=(intrinsic, "c"))
        self.c_map = frag.operand("c").layout
        # batch indices of this block (several batch axes share blockIdx.z, unflattened)
        self.batch_index: dict[str, Expr] = {}
        rest: Expr = self.bz
        for n, (bv, ext) in enumerate(reversed(c.batch)):
            last = n == len(c.batch) - 1
            self.batch_index[bv.name] = rest if last else rest % ext
            rest = rest // ext
        self.shared = {op.role: self.shared_buffer(op) for op in (c.a, c.b)}
        # registers of the element loads of an operand without 16-byte copies
        self.staged = {op.role: Buffer(f"{op.buffer.name}_staged", op.buffer.dtype,
                                       _shape(self.tile_shape(op)[0] * self.tile_shape(op)[1] // t.threads), "local")
                       for op in (c.a, c.b) if not self.asynchronous(op)}
        self.names: dict[str, int] = {}

    def unrolled(self, name: str, extent: int, body: Callable[[Var], Stmt]) -> Stmt:
        """An unrolled loop whose variable is named uniquely in the kernel (primitives address
        loops by name): the second `copy_a` loop is `copy_a1`."""
        n = self.names.get(name, 0)
        self.names[name] = n + 1
        return _unrolled(name if n == 0 else f"{name}{n}", extent, body)

    # step 1: tiling ------------------------------------------------------------------------------
    def kernel(self) -> PrimFunc:
        c, t = self.c, self.t
        allocs = self.pipeline()
        for buf in (self.shared["A"], self.shared["B"], *self.staged.values(), self.frag_a, self.frag_b, self.frag_c):
            allocs = Allocate(buf, allocs)
        body: Stmt = For(self.tx, _int(0), _int(t.threads), "threadIdx.x", allocs)
        body = For(self.bx, _int(0), _ceil_div(c.n, t.bn), "blockIdx.x", body)
        body = For(self.by, _int(0), _ceil_div(c.m, t.bm), "blockIdx.y", body)
        if c.batch:
            body = For(self.bz, _int(0), size_product([ext for _, ext in c.batch]), "blockIdx.z", body)
        what = f"{self.row} block {t.bm}x{t.bn} warps {t.warps_m}x{t.warps_n} k_tile {t.bk} stages {t.stages}"
        return PrimFunc(self.func.name, self.func.params, body, self.func.attrs + (("tensorize", what),))

    # step 2: staging + layout ---------------------------------------------------------------------
    def tile_shape(self, op: Operand) -> tuple[int, int]:
        """(rows, width) of the operand's tile in its global orientation."""
        outer = self.t.bm if op.role == "A" else self.t.bn
        return (outer, self.t.bk) if op.k_last else (self.t.bk, outer)

    def shared_buffer(self, op: Operand) -> Buffer:
        rows, width = self.tile_shape(op)
        return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, _shape(self.t.stages, rows, width), "shared",
                      tensor=f"{op.buffer.tensor}.shared", layout=row_swizzle(width))

    def asynchronous(self, op: Operand) -> bool:
        return copy_elements(op.buffer.shape[-1]) > 0

    def load_tile(self, op: Operand, stage: Expr, k0: Expr) -> tuple[Stmt, Stmt | None]:
        """The operand's tile for k tile k0 into ring stage `stage`, zero past the edges: (issue,
        finish). cp.async copies are all issue; element loads are issued into registers and
        finished (stored to shared) after the compute, so their latency overlaps it too."""
        c, t = self.c, self.t
        rows, width = self.tile_shape(op)
        outer0 = self.by * t.bm if op.role == "A" else self.bx * t.bn
        outer_ext = c.m if op.role == "A" else c.n
        row0, row_ext, col0, col_ext = ((outer0, outer_ext, k0, c.kext) if op.k_last
                                        else (k0, c.kext, outer0, outer_ext))
        batch = tuple(self.batch_index[v.name] for v, _ in c.batch)
        dst = self.shared[op.role]
        size = copy_elements(op.buffer.shape[-1])
        if size:
            per_row = width // size
            nbytes = size * op.buffer.dtype.bytes

            def copy(u: Var) -> Stmt:
                chunk = self.tx + t.threads * u
                r, col = chunk // per_row, (chunk % per_row) * size
                inside = (row0 + r < row_ext) & (col0 + col < col_ext)
                return AsyncCopy(dst, (stage, r, col), op.buffer, batch + (row0 + r, col0 + col), nbytes, inside,
                                 "cg" if nbytes == 16 else "ca")
            return self.unrolled(f"copy_{op.role.lower()}", rows * width // size // t.threads, copy), None
        staged = self.staged[op.role]

        def fetch(u: Var) -> Stmt:
            e = self.tx + t.threads * u
            r, col = e // width, e % width
            inside = (row0 + r < row_ext) & (col0 + col < col_ext)
            value = select(inside, op.buffer[batch + (row0 + r, col0 + col)], Const(0.0, op.buffer.dtype))
            return BufferStore(staged, (u,), value)

        def store(u: Var) -> Stmt:
            e = self.tx + t.threads * u
            return BufferStore(dst, (stage, e // width, e % width), staged[u])
        count = rows * width // t.threads
        return (self.unrolled(f"fetch_{op.role.lower()}", count, fetch),
                self.unrolled(f"store_{op.role.lower()}", count, store))

    def load_stage(self, stage: Expr, k_tile: Expr) -> tuple[Stmt, Stmt | None]:
        k0 = k_tile * self.t.bk
        (issue_a, finish_a), (issue_b, finish_b) = (self.load_tile(self.c.a, stage, k0),
                                                    self.load_tile(self.c.b, stage, k0))
        finish = seq(finish_a, finish_b) if finish_a is not None or finish_b is not None else None
        return seq(issue_a, issue_b), finish

    # step 3: the pipeline ring ---------------------------------------------------------------------
    def pipeline(self) -> Stmt:
        t = self.t
        zero = self.unrolled("zero", 4 * t.tm * t.tn, lambda z: BufferStore(self.frag_c, (z,), Const(0.0, dt.float32)))
        known = const_int(self.k_tiles)
        prologue: list[Stmt] = []
        for s in range(t.stages - 1):
            issue, finish = self.load_stage(Const(s, dt.int32), Const(s, dt.int32))
            load = seq(issue, finish)
            if known is None:
                prologue.append(IfThenElse(Const(s, dt.int32) < self.k_tiles, load))
            elif s < known:
                prologue.append(load)
            prologue.append(AsyncCommit())  # one group per stage, even when K has fewer tiles
        ahead = self.kt + (t.stages - 1)
        issue, finish = self.load_stage(ahead % t.stages, ahead)
        loop = For(self.kt, _int(0), self.k_tiles, "serial", seq(
            AsyncWait(t.stages - 2),   # stage kt has landed (at most S - 2 later groups in flight)
            Barrier(),                 # ... for every thread, and every warp is done with stage kt - 1
            IfThenElse(ahead < self.k_tiles, issue),
            AsyncCommit(),             # possibly empty, so the group count per iteration is fixed
            self.compute(self.kt % t.stages),
            # element loads land in stage kt - 1 (free since the barrier) after the compute
            IfThenElse(ahead < self.k_tiles, finish) if finish is not None else None,
        ))
        return seq(zero, *prologue, loop, AsyncWait(0), self.epilogue())

    # steps 4 and 5: fragment loads and mma ------------------------------------------------------------
    def compute(self, stage: Expr) -> Stmt:
        t, c = self.t, self.c
        wm, wn = t.bm // t.warps_m, t.bn // t.warps_n

        def k_step(kk: Var) -> Stmt:
            k0 = kk * 16

            def load_a(mi: Var) -> Stmt:
                return load_a_fragment(FragmentRef(self.frag_a, 8 * mi), self.shared["A"], stage,
                                       self.warp_m * wm + mi * 16, k0, self.lane, c.a.k_last)

            def load_b(nj: Var) -> Stmt:
                return load_b_fragments(FragmentRef(self.frag_b, 8 * nj), self.shared["B"], stage,
                                        self.warp_n * wn + nj * 16, k0, self.lane, c.b.k_last)

            def mma(mi: Var) -> Stmt:
                def one(ni: Var) -> Stmt:
                    acc = FragmentRef(self.frag_c, (mi * t.tn + ni) * 4)
                    return MatrixMultiply(self.row, acc, FragmentRef(self.frag_a, 8 * mi),
                                          FragmentRef(self.frag_b, 4 * ni), acc)
                return self.unrolled("mma_n", t.tn, one)

            return seq(self.unrolled("frag_m", t.tm, load_a), self.unrolled("frag_n", t.tn // 2, load_b),
                       self.unrolled("mma_m", t.tm, mma))
        return self.unrolled("k_step", t.bk // 16, k_step)

    # step 6: the epilogue ---------------------------------------------------------------------------
    def epilogue(self) -> Stmt:
        t, c = self.t, self.c
        wm, wn = t.bm // t.warps_m, t.bn // t.warps_n
        store = c.store

        def tile(q: Var) -> Stmt:
            mi, ni = q // t.tn, q % t.tn

            def element(e: Var) -> Stmt:
                r, col = self.c_map(self.lane, e)
                row = self.by * t.bm + self.warp_m * wm + mi * 16 + r
                column = self.bx * t.bn + self.warp_n * wn + ni * 8 + col
                values: dict[Var, Expr] = {v: self.batch_index[v.name] for v, _ in c.batch}
                values[c.i], values[c.j] = row, column
                value = _ReplaceAccumulator(c.acc, self.frag_c[q * 4 + e]).visit(store.value)
                value = substitute(value, values)
                indices = tuple(substitute(ix, values) for ix in store.indices)
                return IfThenElse((row < c.m) & (column < c.n), BufferStore(store.buffer, indices, value))
            return self.unrolled("out_e", 4, element)
        return self.unrolled("out_tile", t.tm * t.tn, tile)


__all__ = ["CHUNK", "INTRINSICS", "Contraction", "Operand", "Tiling", "check_tiling", "copy_elements", "load_a_fragment",
           "load_b_fragments", "match_contraction", "row_swizzle", "tensorize"]
