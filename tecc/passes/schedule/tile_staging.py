"""The operand tiles of a tensorized kernel in shared memory: their buffers and layouts, how each
element is found in global memory, and how a tile is filled (the layer `stage_operand` decides).

Each operand's tile is kept in its memory orientation (along the group of axes it is contiguous
in), one buffer per ring stage: A as [S][BM][BK] (k-contiguous) or [S][BK][BM] (row-contiguous),
B as [S][BK][BN] or [S][BN][BK] (S = 1 before `pipeline`). Element (outer, k) of an operand is at
the operand's own indices with every axis replaced by its unflattened expression
(implicit_gemm.Operand.at), predicated by the M/N/K edges and its where() condition.

- Layouts. A staged operand's tile gets the XOR swizzle its reads are conflict-free under: for
  ldmatrix of 16-bit rows of W halves the 16-byte chunk index XORed with row % 8 (`row_swizzle`),
  for tf32's 32-bit fragment loads `tf32_swizzle`; the wgmma family (tensorize_wgmma.py) has the
  128-byte swizzle its descriptors read whether staged or not. An operand not staged (or staged
  with layout "none") has a plain tile.
- Copies. A staged operand is filled with cp.async copies of 16 bytes where
  implicit_gemm.contiguous_copy proves 8 consecutive halves contiguous, aligned and uniformly in
  or out of range (a plain matrix whose contiguous extent is a constant multiple of 8, NHWC
  activations with C % 8 == 0), the predicate zero-filling chunks outside; runs of 4 or 2 only
  get 8- or 4-byte copies (cp.async.ca). The copies are spread over the block's threads by
  thread_partition.tile_copy. Otherwise -- an operand not staged, odd K, a symbolic contiguous
  extent, C = 3, NCHW activations -- the tile's elements are loaded guarded (select(in range,
  x, 0)) into registers when the refill is issued and stored to shared memory after the compute
  (`load_tile`'s (issue, finish)).
- Run-time strides (`dispatch`). An operand with run-time strides has copies only under a
  launch condition (implicit_gemm.stride_condition); the kernel holds one main loop per
  combination of the operands' copy forms and one of element loads, and branches at launch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, const_int, select
from ...ir.layout import Swizzle
from ...ir.stmt import AsyncCopy, Buffer, BufferStore, For, IfThenElse, Stmt, seq
from .implicit_gemm import Operand, unflatten
from .thread_partition import tile_copy
from .tile_kernel import BlockTile, TileKernel, TileSchedule, int32, int32_shape

CHUNK = 8  # halves per 16-byte cp.async copy and per ldmatrix row
COPY_BYTES = 16
# element loads per round of dispatch's element-load loop (`load_tile`): a serial loop of rounds
# of this many unrolled loads, so ptxas keeps few loaded elements and addresses live at once
# (all of a 128x32 tile's 32 per thread at once took the kernel to 255 registers on sm_80, from
# 222 with the copy loop alone; rounds of 4, 8 or 16 kept 222; on sm_90, 8 kept 168, 16 170)
DIRECT_LOADS = 8
# (row, column) of a tile element -> its global indices and the predicate that it is in range
AddressOf = Callable[[Expr, Expr], tuple[tuple[Expr, ...], Expr]]


def power_of_two(n: int) -> int | None:
    """log2(n) when n is a positive power of two, else None."""
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else None


def row_swizzle(width: int) -> Swizzle:
    """The XOR swizzle of a tile with rows of `width` halves: the 16-byte chunk index (base 3)
    XORed with row % 8 (3 bits, shift log2(width) - 3, so the XOR source is the row number), so
    the 8 consecutive rows an ldmatrix matrix reads at one chunk hit 8 different 16-byte bank
    groups. Rows of 32 halves (64 B) pair up in a 128-byte line: there the chunk (2 bits) is
    XORed with (row // 2) % 4, as in tests/test_matrix_gemm.py."""
    w = power_of_two(width)
    assert w is not None and w >= 4
    bits = min(3, w - 3)
    return Swizzle(bits, 3, max(3, w - 3))


def tf32_swizzle(width: int, k_last: bool) -> Swizzle:
    """The XOR swizzle of a float32 tile with rows of `width` floats for the tf32 fragment loads
    (32-bit shared loads, one element per lane; tensorize.py, steps 4-5).

    k-contiguous ([outer][k], k_last): the 32 lanes of an A or B fragment load read 8 rows (g =
    lane // 4) at 4 consecutive floats (t = lane % 4) of one 16-byte chunk; the chunk index (base
    2: 4 floats) XORed with row % 8 puts the 8 rows in 8 different chunks of the 32 banks. Rows
    of 16 floats (64 B) pair up in a 128-byte line, so there the 2 chunk bits are XORed with
    (row // 2) % 4 (bank = 16·(row % 2) + 4·chunk + t: 32 banks), as row_swizzle does for halves.

    outer-contiguous ([k][outer]): the lanes read 4 rows (k = t) at 8 consecutive floats (g) of
    one 8-aligned 32-byte group; the group index (base 3) XORed with row % 4 (2 bits) puts the 4
    rows in 4 different 8-bank groups. Rows must be at least 32 floats (the XOR source lies
    above the group bits). Both keep 16-byte chunks whole for the cp.async copies."""
    w = power_of_two(width)
    assert w is not None
    if k_last:
        assert w >= 3
        return Swizzle(min(3, w - 2), 2, max(3, w - 2))
    assert w >= 5
    return Swizzle(2, 3, w - 3)


class TileStaging(TileKernel):
    """The operand tiles (module docstring)."""

    def __init__(self, schedule: TileSchedule) -> None:
        super().__init__(schedule)
        c, t = self.c, self.t
        self.shared = {op.role: self.shared_buffer(op) for op in (c.a, c.b)}
        # the orientation each shared tile is laid out for (the operand as matched); a main loop
        # for transposed views stores the other orientation in the same buffer (`shared_index`)
        self.laid_out = {op.role: op for op in (c.a, c.b)}
        # operands loaded element by element in the main loop being built (`dispatch`): those
        # whose copies need a launch condition, in the main loop for when it fails
        self.element_roles: set[str] = set()
        # registers of the element loads of an operand without copies (TMA boxes need none)
        self.fetched = {op.role: Buffer(f"{op.buffer.name}_staged", op.buffer.dtype,
                                        int32_shape(self.tile_shape(op)[0] * self.tile_shape(op)[1] // t.threads),
                                        "local")
                        for op in (c.a, c.b) if not self.copied(op) and t.producer != "tma"}

    # ---- the tiles ----------------------------------------------------------------------------------
    def tile_shape(self, op: Operand) -> tuple[int, int]:
        """(rows, width) of the operand's tile in its global orientation."""
        outer = self.t.bm if op.role == "A" else self.t.bn
        return (outer, self.t.bk) if op.k_last else (self.t.bk, outer)

    def swizzled(self, op: Operand) -> bool:
        """Whether the operand's tile has the swizzle of its reads (staged with layout "swizzle")."""
        return self.t.layout(op.role) == "swizzle"

    def copied(self, op: Operand) -> bool:
        """Whether the operand is staged with copies in some main loop (`asynchronous`)."""
        return op.copy > 0 and self.t.layout(op.role) is not None

    def shared_buffer(self, op: Operand) -> Buffer:
        rows, width = self.tile_shape(op)
        if op.buffer.dtype == dt.float32:
            # [S][rows / P][P][width], P rows per swizzle period: the stride of the second axis is
            # a whole period, so codegen keeps a row block's offset outside the XOR (like the
            # stage's) and the fragment loads' swizzled addresses are invariant in the k loop
            layout = tf32_swizzle(width, op.k_last)
            per = layout.period // width
            shape = int32_shape(self.t.stages, rows // per, per, width)
        else:
            layout, shape = row_swizzle(width), int32_shape(self.t.stages, rows, width)
        return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, shape, "shared",
                      tensor=f"{op.buffer.tensor}.shared", layout=layout if self.swizzled(op) else None)

    def period_rows(self, op: Operand) -> int | None:
        """P of a [S][rows / P][P][width] tile (tf32), None for [S][rows][width]."""
        buf = self.shared[op.role]
        return const_int(buf.shape[2]) if len(buf.shape) == 4 else None

    def shared_index(self, op: Operand, stage: Expr, r: Expr, col: Expr) -> tuple[Expr, ...]:
        """The shared-buffer indices of element (r, col) of the operand's tile (its global
        orientation) in ring stage `stage`.

        A tile stored in the other orientation than its buffer is laid out for (a transposed
        view's main loop, `dispatch`): a R' x W' tile in the buffer of a W' x R' one, seen through
        the buffer's [W'][R'] rows as a flat offset. Its 8-element (16-byte) chunks go column-chunk
        major, the 8 rows r..r+7 of one column chunk c (what an ldmatrix phase reads) one 128-byte
        line -- line c·(R' / 8) + r // 8 --, row r in slot (r % 8) ^ (c % (8 / p))·p of it, p the
        rows a phase of 8 copies covers (the copies go row-major, 16 bytes each, as for a tile in
        the buffer's own orientation: `load_tile`; p = 8 / min(8, chunks per row)): the 8 copies
        of a phase (p rows by 8 / p consecutive chunks) land in 8 different slots, and so do an
        ldmatrix phase's 8 rows. The buffer's row_swizzle XORs the slot with bits of the line
        number; the offset is given pre-swizzled (the swizzle is an involution that keeps the
        line), so the slot above is the physical one. A chunk stays 16 contiguous bytes."""
        per = self.period_rows(op)
        if per is not None:
            return stage, r // per, r % per, col
        if op.k_last != self.laid_out[op.role].k_last:
            rows, own_width = self.tile_shape(op)
            width = self.tile_shape(self.laid_out[op.role])[1]
            line_elements = 8 * CHUNK
            p = 8 // min(8, own_width // CHUNK)
            chunk = col // CHUNK
            slot = (r % 8) ^ ((chunk % (8 // p)) * p)
            flat = (chunk * (rows // 8) + r // 8) * line_elements + slot * CHUNK + col % CHUNK
            layout = self.shared[op.role].layout
            if layout is not None:
                flat = layout.apply(flat)
            return stage, flat // width, flat % width
        return stage, r, col

    # ---- filling a tile -----------------------------------------------------------------------------
    def asynchronous(self, op: Operand) -> bool:
        """Whether the main loop being built copies the operand with cp.async (`dispatch`)."""
        return self.copied(op) and op.role not in self.element_roles

    def element(self, op: Operand, outer: Expr, k: Expr) -> tuple[tuple[Expr, ...], Expr | None]:
        """The operand's global indices of GEMM element (outer, k) -- the row (A) or column (B) and
        the reduction index, unflattened into the loop axes (implicit_gemm.Operand.at) -- and its
        where() predicate (None: none)."""
        c = self.c
        values: dict[Var, Expr] = {v: self.batch_index[v.name] for v, _ in c.batch}
        values.update(unflatten(c.rows if op.role == "A" else c.cols, outer))
        values.update(unflatten(c.ks, k))
        return op.at(values)

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
        dst = self.shared[op.role]

        def address(r: Expr, col: Expr) -> tuple[tuple[Expr, ...], Expr]:
            # tile element (r, col) in the tile's orientation: in range of the GEMM and of the
            # operand's where() condition (padding)
            inside = (row0 + r < row_ext) & (col0 + col < col_ext)
            outer, k = (row0 + r, col0 + col) if op.k_last else (col0 + col, row0 + r)
            indices, pad = self.element(op, outer, k)
            return indices, inside if pad is None else inside & pad
        if self.asynchronous(op):
            size = op.copy
            nbytes = size * op.buffer.dtype.bytes

            def copy(r: Expr, col: Expr) -> Stmt:
                indices, inside = address(r, col)
                # an operand with run-time strides is copied only in dispatch's main loop that
                # runs when its strides were tested (a unit stride along the copy among them)
                return AsyncCopy(dst, self.shared_index(op, stage, r, col), op.buffer, indices, nbytes, inside,
                                 "cg" if nbytes == COPY_BYTES else "ca", op.assumes is not None, op.along)
            return tile_copy(self.unrolled, f"copy_{op.role.lower()}", self.tx, t.threads, rows, width, size,
                             copy), None
        count = rows * width // t.threads
        if op.role in self.element_roles:
            return seq(), self.direct_loads(op, stage, address, count, width)
        fetched = self.fetched[op.role]

        def fetch(u: Var) -> Stmt:
            e = self.tx + t.threads * u
            indices, inside = address(e // width, e % width)
            value = select(inside, op.buffer[indices], Const(0.0, op.buffer.dtype))
            return BufferStore(fetched, (u,), value)

        def store(u: Var) -> Stmt:
            e = self.tx + t.threads * u
            return BufferStore(dst, self.shared_index(op, stage, e // width, e % width), fetched[u])
        return (self.unrolled(f"fetch_{op.role.lower()}", count, fetch),
                self.unrolled(f"store_{op.role.lower()}", count, store))

    def direct_loads(self, op: Operand, stage: Expr, address: AddressOf, count: int, width: int) -> Stmt:
        """dispatch's loop for strides the launch test refused: each element is loaded and
        stored to its ring stage at once, where the element loads' registers would be stored
        (after the compute: the stage is free then, and on Hopper the next k tile's proxy fence
        publishes the stores to wgmma before any wgmma reads the buffer), in rounds of
        DIRECT_LOADS, so no register holds one across the compute and ptxas's allocation for the
        kernel stays the copy loop's; the loads' latency is exposed per round instead."""
        t = self.t
        dst = self.shared[op.role]
        group = min(count, DIRECT_LOADS)
        while count % group:
            group //= 2

        def rounds(g: Var) -> Stmt:
            def direct(u: Var) -> Stmt:
                e = self.tx + t.threads * (g * group + u)
                indices, inside = address(e // width, e % width)
                value = select(inside, op.buffer[indices], Const(0.0, op.buffer.dtype))
                return BufferStore(dst, self.shared_index(op, stage, e // width, e % width), value)
            return self.unrolled(f"load_{op.role.lower()}", group, direct)
        n = self.names.get("load_round", 0)
        self.names["load_round"] = n + 1
        g = Var("load_round" if n == 0 else f"load_round{n}")
        return For(g, int32(0), int32(count // group), "serial", rounds(g))

    def load_stage(self, stage: Expr, k_tile: Expr) -> tuple[Stmt, Stmt | None]:
        """Both operands' tiles of k tile `k_tile` into ring stage `stage`: (issue, finish)."""
        k0 = self.k_index(k_tile) * self.t.bk
        (issue_a, finish_a), (issue_b, finish_b) = (self.load_tile(self.c.a, stage, k0),
                                                    self.load_tile(self.c.b, stage, k0))
        finish = seq(finish_a, finish_b) if finish_a is not None or finish_b is not None else None
        return seq(issue_a, issue_b), finish

    def staging_summary(self) -> str:
        """The operands not staged yet, for the summary ('' when both are)."""
        names = [op.buffer.name for op in (self.c.a, self.c.b) if self.t.layout(op.role) is None]
        if not names:
            return ""
        return f"; {' and '.join(names)} not staged (element loads into a plain tile)"

    # ---- operands with run-time strides: a main loop per copy form ---------------------------------
    def transposes(self) -> bool:
        """Whether the family builds main loops for transposed views (`copy_forms`)."""
        raise NotImplementedError

    def copy_forms(self) -> list[tuple[str, list[tuple[Operand, Expr]]]]:
        """Per staged operand with run-time strides that has copies under some launch condition,
        its copy forms: (the operand in the orientation the loop stores it, the condition), the
        matched orientation first (a slice of a wider row-major array: unit innermost stride),
        then the transposed one (`Operand.transposed`: unit stride on another dimension, e.g.
        w.t())."""
        out: list[tuple[str, list[tuple[Operand, Expr]]]] = []
        for op in (self.c.a, self.c.b):
            if self.t.layout(op.role) is None:
                continue
            forms: list[tuple[Operand, Expr]] = []
            if op.copy and op.assumes is not None:
                forms.append((op, op.assumes))
            alt = op.transposed
            if alt is not None and alt.assumes is not None and self.transposes():
                forms.append((alt, alt.assumes))
            if forms:
                out.append((op.role, forms))
        return out

    def dispatch_summary(self) -> str:
        """The launch-time choice between the main loops, for the summary ('' when there is none)."""
        forms = self.copy_forms()
        if not forms:
            return ""
        parts = []
        for role, choices in forms:
            name = self.laid_out[role].buffer.name
            said = []
            for op, cond in choices:
                kind = "cp.async copies" if op is self.laid_out[role] else "transposed-view cp.async copies"
                said.append(f"{kind} when {cond}")
            parts.append(f"{name}: {', '.join(said)}")
        both = ", every combination a main loop" if len(forms) == 2 else ""
        return (f"; run-time strides of {'; '.join(parts)}{both}, else element loads "
                "(a uniform branch at launch)")

    def dispatch(self) -> Stmt:
        """The kernel's main loop (`pipeline`, through the epilogue). An operand with run-time
        strides has copies only under a launch condition (implicit_gemm.stride_condition): unit
        innermost stride, the others multiples of the copy -- a slice of a wider row-major
        array --, or (`Operand.transposed`) unit stride on another dimension -- a transposed
        view, whose copies run along the rows and whose tile is stored in the other orientation
        in the same shared buffer (`shared_index`) and read with the other ldmatrix (.trans or
        not). The kernel holds one main loop per combination of the operands' copy forms (1, 2,
        or 4 with two strided operands), then one that loads those operands element by element
        (always correct, any strides), and branches on the conditions, first true wins. They
        read kernel parameters only, so every thread takes the same side: no divergence, one test
        per launch. ptxas allocates registers for the largest of the loops; the element loop's
        loads go straight to shared memory (`direct_loads`), so that is the copy loops' count."""
        forms = self.copy_forms()
        if not forms:
            return self.pipeline()
        combos: list[list[tuple[Operand, Expr]]] = [[]]
        for _, choices in forms:
            combos = [done + [choice] for done in combos for choice in choices]
        loops: list[tuple[Expr, Stmt]] = []
        matched = self.c
        for n, combo in enumerate(combos):
            c = matched
            cond: Expr | None = None
            for op, test in combo:
                c = replace(c, a=op) if op.role == "A" else replace(c, b=op)
                cond = test if cond is None else cond & test
            assert cond is not None
            if n:
                self.kt = Var(self.kt.name, self.kt.dtype)   # each loop binds a variable of its own
            self.c = c
            try:
                loops.append((cond, self.pipeline()))
            finally:
                self.c = matched
        self.element_roles = {op.role for op in (matched.a, matched.b) if op.assumes is not None}
        self.kt = Var(self.kt.name, self.kt.dtype)
        try:
            body = self.pipeline()
        finally:
            self.element_roles = set()
        for cond, loop in reversed(loops):
            body = IfThenElse(cond, loop, body)
        return body

    def pipeline(self) -> Stmt:
        raise NotImplementedError


def check_staged_tiles(where: str, schedule: BlockTile, element_bytes: int) -> None:
    """Refuse a block tile that is not a whole number of 16-byte copies per thread in each
    orientation (the copies and element loads spread the tile evenly over the threads)."""
    t = schedule
    chunk = COPY_BYTES // element_bytes
    for rows, width in ((t.bm, t.bk), (t.bk, t.bm), (t.bk, t.bn), (t.bn, t.bk)):
        if (rows * width) % (chunk * t.threads) or width % chunk or power_of_two(width) is None:
            raise ScheduleError(f"{where}: a {rows}x{width} tile is not a whole number of 16-byte copies per thread "
                                f"for {t.threads} threads (block dimensions and k_tile powers of two >= 16)")


__all__ = ["CHUNK", "COPY_BYTES", "DIRECT_LOADS", "TileStaging", "check_staged_tiles", "power_of_two",
           "row_swizzle", "tf32_swizzle"]
