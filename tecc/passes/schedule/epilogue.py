"""The fused tail of a tensorized kernel: the stage's own store, applied to each accumulator
element (the layer the `epilogue` primitive chooses).

Each lane's accumulator elements sit at (row, col) of the block tile by the accumulator
fragment's layout map (the intrinsic-table row's; the family says where a fragment tile starts:
`accumulator_position`). Each is stored as the stage's own store with acc[0] replaced by the
element, guarded by row < M and col < N, the row and column unflattened into their axes: bias,
activations, residuals, scales and the cast to the output dtype fuse as written. The parts of
the store's value that read neither a row nor the accumulator and cost more than a load (an
inference batch norm's 1 / sqrt(var + eps) of the column's channel) are computed once per column
a lane holds, not once per element (`column_invariants`): each lane's elements go by column groups
(`column_groups`), the group's values first, in registers. Three ways out:

- "registers": every thread stores its elements to global memory. Elements 2j, 2j + 1 (adjacent
  columns) are stored together by a vectorize loop where the innermost column extent is even
  (`output_pair`: one 4- or 8-byte store).
- "staged": the values go to a padded shared tile of the block's BM x BN outputs, which the block
  then copies to the output in 16-byte chunks, whole lines per warp (`finish_output`); element by
  element where the output's rows are not a whole number of chunks (rows of 50,257 logits: a warp's
  store is then 32 adjacent elements of a row).
- "tma" (the warp-specialized wgmma kernel): each consumer warpgroup writes its 64 rows into a
  128B-swizzled staging tile C_stage[BN/W][BM/8][8][W] (W = 128 bytes of output elements; the
  row's multiple of 8 its own dimension keeps it outside the swizzle's XOR in codegen), fences
  (fence.proxy.async), meets at a named barrier of its 128 threads (bar.sync 1 + warpgroup), and
  its thread 0 issues BN/W TMA stores of (64, W) boxes through the output's tensor map (the TMA
  unit clips them at M and N) as one bulk group. In a persistent block the next tile's writes
  wait (wait_group.read 0, then the barrier) until the store has read the tile, so it drains
  under the next k loop. The output's map is built as the operands' are (tma.tma_dims: rows
  or columns that are several axes are one flat dimension where the output's dimensions chain).
  `tma_store_refusal` says when the output cannot take a tensor map (the register epilogue is
  kept then, and the summary says why).
- "threads" (the warp-specialized wgmma kernel, for an output TMA cannot store: rows that are not
  a multiple of 16 bytes, as a vocabulary of 50,257 logits): the same swizzled staging tile, then
  the warpgroup's own threads copy its 64 rows out, consecutive threads consecutive elements of
  a row (a warp's store covers 32 adjacent elements however the row is aligned), each store
  guarded by row < M and column < N. A named barrier before the copy (the staged values are
  read by other threads) and, in a persistent block, another before the next tile's writes
  (the copy has read the tile). In the persistent grid (no split-K, no batch axes) the copy of
  a tile runs under the next tile's k loop, as a TMA store drains: the tile's block row and
  column kept in two registers, each k tile's wgmmas issued, then R of each warp's 16 rows
  stored while they run (R spreads the rows over the k loop's first tiles:
  `deferred_copy`), and the block's last tile after its tile loop (`final_copy`). Copied
  between k loops instead, the consumers' stores added 0.53 ms to the 1.03 of GPT-2's head
  GEMM (8192 x 50257 x 768); deferred, the kernel takes 1.00. The values cross to global
  memory in whole runs of a row, where the register epilogue stores 2-byte pieces of 8 rows
  per warp instruction.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.arith import warp_shuffle
from ...ir.expr import BufferLoad, Const, Expr, Select, Var, const_int, free_vars, substitute, walk
from ...ir.expr_visitor import SubexpressionReplacer
from ...ir.intrinsics import WARPGROUP_SIZE
from ...ir.stmt import (
    Allocate,
    AsyncProxyFence,
    Barrier,
    Buffer,
    BufferStore,
    BulkCommit,
    BulkWait,
    For,
    IfThenElse,
    NamedBarrier,
    Stmt,
    TensorMap,
    TensorStore,
    seq,
)
from ...ir.tma_stmt import SWIZZLE_BYTES, TMA_ALIGN, swizzle_layout
from ...ir.visitor import ExprMutator
from ..hoist_invariants import costly
from .implicit_gemm import Contraction, unflatten
from .tile_kernel import TileSchedule, int32, int32_shape
from .tile_staging import TileStaging
from .tma import MapDim, tma_dims


class AccumulatorReplacer(ExprMutator):
    """Every read of the accumulator `acc` in an expression replaced by `value` (the stage's
    store expression applied to one accumulator element)."""

    def __init__(self, acc: Buffer, value: Expr) -> None:
        super().__init__()
        self.acc, self.value = acc, value

    def visit_BufferLoad(self, e: BufferLoad) -> Expr:
        if e.buffer is self.acc:
            return self.value
        return self.generic_visit(e)


# paired_columns of each (layout map, lanes, elements) asked before: a map is an intrinsic table
# row's Layout (hashable, by value), the same few for every tensor-core kernel of a build, whose
# check enumerates every (lane, element): 128 x 64 of them for a 64 x 256 wgmma accumulator
_PAIRED: dict[tuple[Any, int, int], bool] = {}


def paired_columns(c_map: Callable[[Any, Any], tuple[Any, Any]], lanes: int, elements: int) -> bool:
    """Whether an accumulator layout map keeps elements 2j, 2j + 1 of every lane at (row, col),
    (row, col + 1) with col even (mma.sync's C and wgmma's D fragments do: PTX ISA, "Matrix
    fragments"), so one 2-element store writes both (a 4-byte store of 16-bit outputs)."""
    key = (c_map, lanes, elements)
    try:
        known = _PAIRED.get(key)
    except TypeError:   # a map that is no Layout (a plain function): checked every time
        return _paired_columns(c_map, lanes, elements)
    if known is None:
        known = _PAIRED[key] = _paired_columns(c_map, lanes, elements)
    return known


def _paired_columns(c_map: Callable[[Any, Any], tuple[Any, Any]], lanes: int, elements: int) -> bool:
    for lane in range(lanes):
        for j in range(elements // 2):
            (r0, c0), (r1, c1) = c_map(lane, 2 * j), c_map(lane, 2 * j + 1)
            if r0 != r1 or c1 != c0 + 1 or c0 % 2:
                return False
    return True


def output_dims(c: Contraction) -> tuple[MapDim, ...] | str:
    """The output's tensor-map dimensions (tma.tma_dims): its batch axes, "row" and "column"
    (each the flat index of its group, over the dimensions it merges)."""
    return tma_dims(c.store.buffer, c.store.indices, {"row": c.rows, "column": c.cols}, [v for v, _ in c.batch])


def reads_global(value: Expr) -> bool:
    """Whether an epilogue's value reads global memory besides the accumulator (a bias, a residual)."""
    return any(isinstance(x, BufferLoad) and x.buffer.scope == "global" for x in walk(value))


def thread_store_refusal(c: Contraction) -> str | None:
    """Why the output cannot be copied out of the staging tile by the threads (epilogue
    "threads"), or None: a global output of 2- or 4-byte elements (the staging tile's 128B
    swizzle), any strides -- each element is stored through the output's own indices."""
    out = c.store.buffer
    if out.scope != "global":
        return f"the output {out.name} is a {out.scope} buffer"
    if out.dtype.bytes not in (2, 4):
        return f"the output's {out.dtype} elements are not 2 or 4 bytes"
    return None


def tma_store_refusal(c: Contraction) -> str | None:
    """Why the stage's output cannot be written by TMA stores from a staging tile, or None: the
    output a global buffer indexed by batch axes, then the rows, then the columns innermost, each
    a plain loop variable or the flat index of its group's axes over consecutive dimensions whose
    strides chain (tma.tma_dims: y.view(B, T, N) of the GEMM's [B·T, N] rows), contiguous rows
    of a multiple of 16 bytes known at compile time, elements of 2 or 4 bytes."""
    out = c.store.buffer
    if out.scope != "global":
        return f"the output {out.name} is a {out.scope} buffer"
    if out.dtype.bytes not in (2, 4):
        return f"the output's {out.dtype} elements are not 2 or 4 bytes"
    dims = output_dims(c)
    if isinstance(dims, str):
        return f"the output {out.name}: {dims}"
    if tuple(d.axis for d in dims) != (*(v for v, _ in c.batch), "row", "column"):
        return "it is not indexed [batch.., row, column] by plain loop variables (or flat indices of their axes)"
    if out.strides is not None:
        if str(out.strides[-1]) != "1":
            return f"its innermost stride is {out.strides[-1]} (TMA needs contiguous rows)"
        for s in out.strides[:-1]:
            if not isinstance(s, Const) or (int(s.value) * out.dtype.bytes) % TMA_ALIGN:
                return f"its stride {s} is not a compile-time multiple of {TMA_ALIGN} bytes"
    elif len(out.shape) > 1:
        row = out.shape[-1]
        if not isinstance(row, Const) or (int(row.value) * out.dtype.bytes) % TMA_ALIGN:
            return (f"its rows of {row} elements are not a compile-time multiple of {TMA_ALIGN} bytes "
                    "(TMA's stride alignment)")
    return None


class KernelEpilogue(TileStaging):
    """The fused tail (module docstring)."""

    def __init__(self, schedule: TileSchedule) -> None:
        super().__init__(schedule)
        c, t = self.c, self.t
        self.out_tile = self.output_tile() if t.staged_output else None
        self.store_refusal = tma_store_refusal(c) if t.epilogue == "tma" else None
        if self.store_refusal is None and t.epilogue == "tma" and self.transposed_output():
            self.store_refusal = "the accumulators hold Cᵀ (tf32's swapped form)"
        if t.epilogue == "threads":
            refusal = thread_store_refusal(c) or ("the accumulators hold Cᵀ (tf32's swapped form)"
                                                   if self.transposed_output() else None)
            if refusal is not None:
                raise ScheduleError(f"epilogue({c.store.buffer.tensor or c.store.buffer.name}, 'threads'): "
                                    f"{refusal}; keep the registers epilogue")
        # TMA stores out of the staging tile; the threads' stores out of it
        self.store_staged = t.epilogue == "tma" and self.store_refusal is None
        self.store_threads = t.epilogue == "threads"
        if self.store_staged or self.store_threads:
            out = c.store.buffer
            width = SWIZZLE_BYTES["128B"] // out.dtype.bytes   # output elements per 128-byte staging row
            self.stage_width = width
            # [column chunk][row / 8][row % 8][column]: the 8-row period of the swizzle its own
            # dimension, so that codegen keeps the row's multiple of 8 outside the XOR
            self.staging = Buffer(f"{out.name}_stage", out.dtype, int32_shape(t.bn // width, t.bm // 8, 8, width),
                                  "shared", tensor=f"{out.tensor}.stage", layout=swizzle_layout("128B", out.dtype.bytes))
        out = c.store.buffer
        # the block row and column of the tile whose copy is deferred (`deferred_copy`)
        self.previous = (Buffer(f"{out.name}_prev", dt.int32, int32_shape(2), "local",
                                tensor=f"{out.tensor}.prev") if self.defers_copy() else None)
        if self.store_staged:
            dims = output_dims(c)
            assert not isinstance(dims, str)   # tma_store_refusal found none
            self.out_dims: tuple[MapDim, ...] = dims
            box = tuple(64 if d.axis == "row" else width if d.axis == "column" else 1 for d in self.out_dims)
            merge = tuple(d.span for d in self.out_dims) if any(d.span > 1 for d in self.out_dims) else ()
            self.out_map = TensorMap(out, box, "128B", merge)

    # ---- where the family's accumulators are ------------------------------------------------------
    def accumulator_lane(self) -> Expr:
        """The lane index the accumulator fragment's map is evaluated at (per warp or warpgroup)."""
        raise NotImplementedError

    def accumulator_lanes(self) -> int:
        raise NotImplementedError

    def accumulator_tiles(self) -> int | None:
        """Fragment tiles per lane (an unrolled loop over them), or None for one."""
        raise NotImplementedError

    def tile_elements(self) -> int:
        """Accumulator elements per lane of one fragment tile."""
        raise NotImplementedError

    def accumulator_position(self, tile: Expr | None, r: Expr, col: Expr) -> tuple[Expr, Expr]:
        """(row, column) in the block tile of fragment tile `tile`'s element at (r, col) of its map."""
        raise NotImplementedError

    def transposed_output(self) -> bool:
        """Whether the accumulators hold Cᵀ (tf32's swapped wgmma form: its rows are C's columns)."""
        return False

    # ---- the registers epilogue -------------------------------------------------------------------
    def epilogue(self) -> Stmt:
        """Each lane's accumulator elements stored through the stage's own store (module docstring);
        column pairs in one store where `pairs_columns`; staged when asked (`finish_output`)."""
        per_tile = self.tile_elements()
        transposed = self.transposed_output()
        # Cᵀ's adjacent accumulator columns are adjacent rows of C: no pairs in the swapped form
        paired = not transposed and self.pairs_columns(self.accumulator_lanes(), per_tile)

        hoisted = self.column_invariants() if paired else ()
        groups = self.column_groups() if hoisted else None
        if groups is not None:
            count, width, at = groups
            lane = self.accumulator_lane()

            def column_of(g: Expr) -> Expr:
                q, e = at(g, int32(0))
                return self.bx * self.t.bn + self.accumulator_position(q, *self.c_map(lane, e))[1]

            def pair(g: Expr, w: Expr, regs: dict[Expr, Buffer]) -> Stmt:
                q, e = at(g, w)
                row, column = self.accumulator_position(q, *self.c_map(lane, e))
                return self.output_pair(row, column, e if q is None else q * per_tile + e, regs)
            return self.finish_output(self.by_column_groups(hoisted, count, width, column_of, pair, ("out_g", "out_w")))

        def tile(q: Var | None) -> Stmt:
            def element(e: Expr) -> Stmt:
                first = e if q is None else q * per_tile + e
                r, col = self.c_map(self.accumulator_lane(), e)
                row, column = self.accumulator_position(q, r, col)
                if transposed:
                    return self.output(column, row, self.frag_c[first])
                if paired:
                    return self.output_pair(row, column, first)
                return self.output(row, column, self.frag_c[first])
            if paired:
                return self.unrolled("out_e", per_tile // 2, lambda p: element(p * 2))
            return self.unrolled("out_e", per_tile, element)
        tiles = self.accumulator_tiles()
        return self.finish_output(tile(None) if tiles is None else self.unrolled("out_tile", tiles, tile))

    def pairs_columns(self, lanes: int, elements: int) -> bool:
        """Whether the epilogue stores two adjacent columns per statement (`output_pair`): the
        accumulator layout keeps elements 2j, 2j + 1 of every lane at (row, col), (row, col + 1)
        with col even (mma.sync's C and wgmma's D fragments do: PTX ISA, "Matrix fragments"),
        and the innermost column axis has a constant even extent, so an even column and the
        next one unflatten to the same outer axes and are both in range or both out."""
        inner = const_int(self.c.cols[-1][1])
        if inner is None or inner % 2:
            return False
        return paired_columns(self.c_map, lanes, elements)

    def output_values(self, row: Expr, column: Expr) -> dict[Var, Expr]:
        """The loop axes' values at output (row, column) of the block: the batch axes of the block,
        the row and the column unflattened into their axes."""
        c = self.c
        values: dict[Var, Expr] = {v: self.batch_index[v.name] for v, _ in c.batch}
        values.update(unflatten(c.rows, row))
        values.update(unflatten(c.cols, column))
        return values

    def fused_value(self, element: Expr, values: dict[Var, Expr], computed: Mapping[Expr, Expr] | None = None) -> Expr:
        """The stage's store expression with the accumulator replaced by `element`, at `values`;
        the parts in `computed` (`column_invariants`) replaced by their registers."""
        c = self.c
        value = SubexpressionReplacer(computed).visit(c.store.value) if computed else c.store.value
        return substitute(AccumulatorReplacer(c.acc, element).visit(value), values)

    # ---- what the fused tail computes once per column ------------------------------------------------
    def column_invariants(self) -> tuple[Expr, ...]:
        """The largest parts of the store's value that read no row axis, no accumulator and not
        the output, and cost more than loads and arithmetic: a float division or a math intrinsic
        (an inference batch norm's 1 / sqrt(var[c] + eps)), none from a side of a where(). Each
        is computed once per column a lane holds (`by_column_groups`) instead of once per
        element: ptxas does not merge the IEEE square roots and divisions of the unrolled
        elements (a 128 x 128 mma.sync tile's epilogue computed 64 of each per thread for 8
        columns)."""
        c = self.c
        rows = {v for v, _ in c.rows}
        found: list[Expr] = []
        seen: set[int] = set()
        stack = [c.store.value]
        while stack:
            e = stack.pop()
            if id(e) in seen:
                continue
            seen.add(id(e))
            if costly(e) and not free_vars(e) & rows \
                    and not any(isinstance(x, BufferLoad) and x.buffer in (c.acc, c.store.buffer) for x in walk(e)):
                found.append(e)
                continue
            # a side of a where() is evaluated only where its condition picks it (a load it guards
            # may be out of bounds elsewhere): nothing under it is taken out alone
            stack.extend(reversed((e.cond,) if isinstance(e, Select) else e.children))
        return tuple(found)

    def column_groups(self) -> tuple[int, int, Callable[[Expr, Expr], tuple[Expr | None, Expr]]] | None:
        """(G, W, at): a lane's accumulator column pairs as G groups of W pairs that share their
        two columns, pair w of group g being the elements at(g, w) = (fragment tile or None,
        first element) -- the family's; None where it gives none (every element on its own)."""
        return None

    def column_sharing(self) -> int:
        """How many lanes of a warp hold each column group (lanes 4 apart: wgmma's D fragment
        gives a column to the 8 lanes of one lane % 4), 1 where none share: `shared_columns`."""
        return 1

    def shared_columns(self, hoisted: tuple[Expr, ...], count: int, column_of: Callable[[Expr], Expr]
                       ) -> tuple[Callable[[Stmt], Stmt], Callable[[Expr], tuple[list[Buffer], Stmt]]] | None:
        """Where S lanes of a warp (`column_sharing`, lanes 4 apart) hold each of the `count`
        column groups: each lane computes the `hoisted` values of count / S groups (group
        j·S + lane // 4 at slot j, its column `column_of(group)`) once, and each group's values
        reach the lanes that hold it by a warp shuffle from the lane that computed them -- a
        shuffle per value instead of a division or square root per column a lane holds (64 per
        thread for a 128 x 256 wgmma tile). (a function putting the lane's share, computed, and
        its registers around the stores, a function of a group giving its registers and the
        shuffles that fill them); None where no lanes share or the groups do not divide among
        them."""
        share = self.column_sharing()
        if share <= 1 or count % share or count < share:
            return None
        c, out = self.c, self.c.store.buffer
        lane = self.tx % 32
        slots = count // share
        n = self.names.get("col_own", 0)
        self.names["col_own"] = n + 1
        own = [Buffer(f"{out.name}_own{k}" if n == 0 else f"{out.name}_own{k}_{n}", e.dtype, int32_shape(2 * slots),
                      "local", tensor=f"{out.tensor}.column") for k, e in enumerate(hoisted)]

        def slot(j: Var) -> Stmt:
            column = column_of(j * share + lane // 4)
            v, values = self.pair_values("own_v", self.by * self.t.bm, column)
            fill = For(v, int32(0), int32(2), "unroll", seq(*(
                BufferStore(reg, (j * 2 + v,), substitute(e, values)) for reg, e in zip(own, hoisted))))
            return fill if self.tiles_divide() else IfThenElse(column < c.n, fill)
        zero = seq(*(For(z, int32(0), int32(2 * slots), "unroll", BufferStore(reg, (z,), Const(0, reg.dtype)))
                     for reg in own for z in [Var(f"{reg.name}_z")]))
        pre: Stmt = seq(zero, self.unrolled("col_slot", slots, slot))

        def group(g: Expr) -> tuple[list[Buffer], Stmt]:
            regs = self.column_buffers(hoisted)
            src = (g % share) * 4 + lane % 4
            v = Var(f"{regs[0].name}_v")
            take = For(v, int32(0), int32(2), "unroll", seq(*(
                BufferStore(reg, (v,), warp_shuffle("shfl_idx", BufferLoad(mine, ((g // share) * 2 + v,)), src))
                for reg, mine in zip(regs, own))))
            return regs, take

        def around(stores: Stmt) -> Stmt:
            body = seq(pre, stores)
            for reg in own:
                body = Allocate(reg, body)
            return body
        return around, group

    def by_column_groups(self, hoisted: tuple[Expr, ...], count: int, width: int,
                         column_of: Callable[[Expr], Expr], pair: Callable[[Expr, Expr, dict[Expr, Buffer]], Stmt],
                         labels: tuple[str, str]) -> Stmt:
        """A lane's column groups (`column_groups`: `count` groups of `width` pairs, group g's even
        column `column_of(g)`), each group's `hoisted` values first, in registers (computed, or
        shuffled from the lane that computed them: `shared_columns`), then its pairs stored by
        `pair(g, w, registers)`; the loops named `labels` (the registers and the staged epilogue's)."""
        shared = self.shared_columns(hoisted, count, column_of)

        def group(g: Var) -> Stmt:
            regs, fill = shared[1](g) if shared is not None else self.column_registers(hoisted, column_of(g))
            computed = dict(zip(hoisted, regs))
            body = seq(fill, self.unrolled(labels[1], width, lambda w: pair(g, w, computed)))
            for reg in regs:
                body = Allocate(reg, body)
            return body
        stores = self.unrolled(labels[0], count, group)
        return stores if shared is None else shared[0](stores)

    def column_registers(self, hoisted: tuple[Expr, ...], column: Expr) -> tuple[list[Buffer], Stmt]:
        """Registers of two elements for each of `hoisted` and the statement that fills them with
        its values at the even `column` of the output and the next (guarded by column < N where
        the tiles do not divide the output, as the stores are): `by_column_groups`. (Any row will
        do: the hoisted values read none.)"""
        v, values = self.pair_values("col_v", self.by * self.t.bm, column)
        regs = self.column_buffers(hoisted)
        fill: Stmt = For(v, int32(0), int32(2), "unroll",
                         seq(*(BufferStore(reg, (v,), substitute(e, values)) for reg, e in zip(regs, hoisted))))
        return regs, (fill if self.tiles_divide() else IfThenElse(column < self.c.n, fill))

    def column_buffers(self, hoisted: tuple[Expr, ...]) -> list[Buffer]:
        """Two-element registers for each of `hoisted` (a column pair's values), named by the
        kernel's next column group."""
        out = self.c.store.buffer
        n = self.names.get("col_regs", 0)
        self.names["col_regs"] = n + 1
        return [Buffer(f"{out.name}_col{k}" if n == 0 else f"{out.name}_col{k}_{n}", e.dtype, int32_shape(2), "local",
                       tensor=f"{out.tensor}.column") for k, e in enumerate(hoisted)]

    def pair_values(self, label: str, row: Expr, column: Expr) -> tuple[Var, dict[Var, Expr]]:
        """A new lane variable named after `label` (0 or 1: the even `column` or the next) and the
        loop axes' values at output (row, column + lane)."""
        lane = self.fresh_var(label)
        values = self.output_values(row, column)
        inner = self.c.cols[-1][0]
        values[inner] = values[inner] + lane    # (column + v) % e = column % e + v: e and column even
        return lane, values

    def output(self, row_in_block: Expr, column_in_block: Expr, element: Expr) -> Stmt:
        """The stage's own store of output (row, column) -- the block's row_in_block,
        column_in_block --, guarded by row < M and column < N, with the accumulator replaced by
        `element`: the epilogue fuses as written. With a staged output the value goes to the
        block's output tile in shared memory instead (`finish_output` stores it)."""
        c = self.c
        store = c.store
        row, column = self.by * self.t.bm + row_in_block, self.bx * self.t.bn + column_in_block
        values = self.output_values(row, column)
        value = self.fused_value(element, values)
        if self.out_tile is not None:
            target = BufferStore(self.out_tile, (row_in_block, column_in_block), value)
        else:
            target = BufferStore(store.buffer, tuple(substitute(ix, values) for ix in store.indices), value)
        return self.guarded(row, column, target)

    def output_pair(self, row_in_block: Expr, column_in_block: Expr, first: Expr,
                    regs: dict[Expr, Buffer] | None = None) -> Stmt:
        """Outputs (row, column) and (row, column + 1) from accumulator elements `first` and
        `first` + 1, column even (`pairs_columns`): a `vectorize` loop of 2 over the innermost
        column axis, so where the output is contiguous along it codegen stores both with one
        4-byte (half2) or 8-byte (float2) store instead of two scalar ones -- a warp's store then
        covers whole 32-byte sectors of 8 rows (16 bytes per row from each of two stores) rather
        than every other 2-byte element -- and reads a residual operand the same way. The guard
        is the even column's: column + 1 < N whenever column < N (N even)."""
        store = self.c.store
        row, column = self.by * self.t.bm + row_in_block, self.bx * self.t.bn + column_in_block
        lane, values = self.pair_values("out_v", row, column)
        computed = {e: BufferLoad(reg, (lane,)) for e, reg in regs.items()} if regs else None
        value = self.fused_value(self.frag_c[first + lane], values, computed)
        if self.out_tile is not None:
            target = BufferStore(self.out_tile, (row_in_block, column_in_block + lane), value)
        else:
            target = BufferStore(store.buffer, tuple(substitute(ix, values) for ix in store.indices), value)
        return For(lane, int32(0), int32(2), "vectorize", self.guarded(row, column, target))

    def tiles_divide(self) -> bool:
        """Whether the block tile divides M and N (both known at compile time): every block's
        rows and columns are then in range, and no output needs a bounds check."""
        m, n = const_int(self.c.m), const_int(self.c.n)
        return m is not None and n is not None and m % self.t.bm == 0 and n % self.t.bn == 0

    def guarded(self, row: Expr, column: Expr, store: Stmt) -> Stmt:
        """`store` of output (row, column) under row < M and column < N, or as it is where the
        tiles divide M and N (`tiles_divide`): a branch per element less, and the element's
        fused reads (a bias, a residual) no longer wait behind one each."""
        return store if self.tiles_divide() else IfThenElse((row < self.c.m) & (column < self.c.n), store)

    # ---- the staged epilogue: the block's outputs through shared memory ------------------------------
    def copy_chunk(self) -> int:
        """Elements per copy of the staged output: a 16-byte chunk where the column extent is a
        multiple of it (the rows stay 16-byte aligned), else one element."""
        chunk = 16 // self.c.store.buffer.dtype.bytes
        n = const_int(self.c.cols[0][1]) if len(self.c.cols) == 1 else None
        return chunk if n is not None and n % chunk == 0 else 1

    def output_tile(self) -> Buffer:
        """The block's BM x BN outputs in shared memory, rows padded by 16 bytes (consecutive
        rows start 4 banks apart, so a warp's paired stores of 8 rows x 4 lanes hit 32 banks),
        or a ScheduleError when the output cannot be copied out along one column axis."""
        c, t = self.c, self.t
        where = f"epilogue({c.store.buffer.tensor or c.store.buffer.name}, 'staged')"
        out = c.store.buffer
        pad = 16 // out.dtype.bytes
        chunk = self.copy_chunk()
        (j, extent), = c.cols if len(c.cols) == 1 else ((None, None),)
        n = const_int(extent) if extent is not None else None
        if j is None or n is None:
            raise ScheduleError(f"{where}: the output is copied out along one column axis of a constant extent; the "
                                f"columns here are {', '.join(f'{v.name} ({e})' for v, e in c.cols)}: keep the "
                                "registers epilogue")
        if out.strides is not None or not (isinstance(c.store.indices[-1], Var) and c.store.indices[-1] is j):
            raise ScheduleError(f"{where}: the output {out.name} must be contiguous along its column axis {j.name} "
                                "(its innermost index): keep the registers epilogue")
        if (t.bm * t.bn // chunk) % t.threads:
            raise ScheduleError(f"{where}: a {t.bm}x{t.bn} output tile is not a whole number of "
                                f"{chunk * out.dtype.bytes}-byte copies per thread for {t.threads} threads")
        return Buffer(f"{out.name}_out", out.dtype, int32_shape(t.bm, t.bn + pad), "shared",
                      tensor=f"{out.tensor}.out")

    def finish_output(self, stores: Stmt) -> Stmt:
        """The epilogue's statements, then, with a staged output, a barrier and the copy of the
        block's tile to the output: thread tx copies 16-byte chunks (`copy_chunk`: or elements)
        tx, tx + threads, ... in row order (a warp stores whole 128-byte lines of consecutive
        rows), each guarded by its row and its column (N is a multiple of the chunk) and
        addressed through the output's own indices with the row unflattened and the column
        axis at column .. column + chunk - 1 (a `vectorize` loop: one 16-byte store, one
        16-byte shared load)."""
        if self.out_tile is None:
            return stores
        c, t = self.c, self.t
        store, tile = c.store, self.out_tile
        chunk = self.copy_chunk()
        per_row = t.bn // chunk
        j = c.cols[0][0]

        def piece(i: Var) -> Stmt:
            index = self.tx + i * t.threads
            r, col = index // per_row, index % per_row * chunk
            row, column = self.by * t.bm + r, self.bx * t.bn + col
            lane = Var("out_copy_v" if i.name == "out_copy" else f"{i.name}_v")
            values: dict[Var, Expr] = {v: self.batch_index[v.name] for v, _ in c.batch}
            values.update(unflatten(c.rows, row))
            values[j] = column + lane
            indices = tuple(substitute(ix, values) for ix in store.indices)
            body = self.guarded(row, column, BufferStore(store.buffer, indices, BufferLoad(tile, (r, col + lane))))
            return For(lane, int32(0), int32(chunk), "vectorize", body)
        copy = self.unrolled("out_copy", t.bm * t.bn // chunk // t.threads, piece)
        return seq(stores, Barrier(), copy)

    # ---- the TMA-store epilogue (the warp-specialized wgmma kernel) -----------------------------------
    def staging_guard(self, value: Expr) -> bool:
        """Whether a staged element keeps its guard row < M and column < N: only where the value
        reads global memory besides the accumulator (a bias, a residual) and the tiles do not
        divide M and N. The TMA store clips the staged tile's rows and columns past M and N
        itself, so a value that reads nothing else (a plain GEMM, an activation, a cast) is staged
        unguarded at every shape -- a branch per element less --, and where the tiles divide
        every element's reads are in range: without the branches ptxas issues a fused
        epilogue's loads together instead of paying each one's latency in turn."""
        return reads_global(value) and not self.tiles_divide()

    def staged_epilogue(self) -> Stmt:
        """A consumer warpgroup's tile through the swizzled staging tile and TMA stores (module
        docstring, "tma"). Where the accumulator layout pairs adjacent columns (`pairs_columns`)
        elements 2j, 2j + 1 are staged by one 4- or 8-byte shared store (a `vectorize` loop of 2:
        the pair stays adjacent under the 128-byte swizzle, whose XOR moves 16-byte chunks)."""
        c, t = self.c, self.t
        thread = self.tx % WARPGROUP_SIZE
        width = self.stage_width
        row0 = self.warpgroup * 64
        paired = self.pairs_columns(self.accumulator_lanes(), self.tile_elements()) or self.pairs_staged()

        def element(e: Expr, lane: Var | None, regs: dict[Expr, Buffer] | None = None) -> Stmt:
            r, col = self.c_map(thread, e)
            row = self.by * t.bm + row0 + r
            column = self.bx * t.bn + col
            values = self.output_values(row, column)
            if lane is not None:
                inner = c.cols[-1][0]
                values[inner] = values[inner] + lane   # col even, the extent even: same outer axes
            computed = {x: BufferLoad(reg, (lane,)) for x, reg in regs.items()} if regs and lane is not None else None
            value = self.fused_value(self.frag_c[e if lane is None else e + lane], values, computed)
            local = row0 + r
            within = col % width if lane is None else col % width + lane
            store = BufferStore(self.staging, (col // width, local // 8, local % 8, within), value)
            # the guard keeps the epilogue's own reads (a bias at the column...) in bounds; the
            # TMA store clips the staged tile's out-of-range rows and columns itself
            return IfThenElse((row < c.m) & (column < c.n), store) if self.staging_guard(value) else store

        def pair(p: Expr, regs: dict[Expr, Buffer] | None = None) -> Stmt:
            lane = self.fresh_var("stage_v")
            return For(lane, int32(0), int32(2), "vectorize", element(p * 2, lane, regs))
        hoisted = self.column_invariants() if paired else ()
        groups = self.column_groups() if hoisted else None
        if groups is not None:   # the column invariants once per column group (`by_column_groups`)
            count, per_group, at = groups
            writes = self.by_column_groups(
                hoisted, count, per_group, lambda g: self.bx * t.bn + self.c_map(thread, at(g, int32(0))[1])[1],
                lambda g, w, regs: pair(at(g, w)[1] // 2, regs), ("stage_g", "stage_w"))
        elif paired:
            writes = self.unrolled("stage_e", self.tile_elements() // 2, pair)
        else:
            writes = self.unrolled("stage_e", self.tile_elements(), lambda e: element(e, None))

        def copies() -> Stmt:
            out: list[Stmt] = []
            for chunk in range(t.bn // width):
                coords = []
                for d in self.out_dims:   # a merged dimension's coordinate is its flat index
                    if d.axis == "row":
                        coords.append(self.by * t.bm + row0)
                    elif d.axis == "column":
                        coords.append(self.bx * t.bn + chunk * width)
                    else:
                        assert isinstance(d.axis, Var)
                        coords.append(self.batch_index[d.axis.name])
                out.append(TensorStore(self.staging, (int32(chunk), row0 // 8, int32(0), int32(0)), self.out_map,
                                       tuple(coords)))
            return seq(*out, BulkCommit())
        # one named barrier per consumer warpgroup, id 1 + warpgroup (0 is __syncthreads')
        sync = NamedBarrier(self.warpgroup + 1, WARPGROUP_SIZE)
        if self.store_threads and self.defers_copy():
            prev = self.previous_tile()
            return seq(
                sync,     # the previous tile's copy (under this tile's k loop) has read the staging tile
                writes,
                sync,     # the staged values, visible to the warpgroup's other threads
                BufferStore(prev, (int32(0),), self.by),   # copied out under the next k loop
                BufferStore(prev, (int32(1),), self.bx))
        if self.store_threads:
            return seq(
                sync if t.persistent else None,   # the previous tile's copy has read the staging tile
                writes,
                sync,
                self.thread_copies(row0, self.by, self.bx))
        return seq(
            IfThenElse(thread == 0, BulkWait(0)) if t.persistent else None,   # the previous tile's store read it
            sync if t.persistent else None,
            writes,
            AsyncProxyFence(),    # the staged values, visible to the TMA unit (async proxy)
            sync,
            IfThenElse(thread == 0, copies()))


    def pairs_staged(self) -> bool:
        """Whether the threads' epilogue stages column pairs where `pairs_columns` refuses them
        for an odd column extent: one column axis (no unflattening) and a value that reads no
        global memory, so the pair's second element needs no guard of its own (it lands in the
        staging tile, and the copy out guards each element). Unpaired, ptxas serialized the
        wgmmas (C7514) of the non-persistent 128 x 256 kernel."""
        c = self.c
        return (self.store_threads and len(c.cols) == 1 and not reads_global(c.store.value)
                and paired_columns(self.c_map, self.accumulator_lanes(), self.tile_elements()))

    def thread_copies(self, row0: Expr, by: Expr, bx: Expr) -> Stmt:
        """The warpgroup's 64 staged rows (from block row `row0`) of the tile at block row `by`,
        column `bx` stored by its threads (module
        docstring, "threads"): warp w copies rows w, w + 4, ..., each as BN / 32 runs of 32
        adjacent columns (`copy_row`). A serial loop over the rows: the runs' addresses differ
        by constants and their column guards are the same in every row (ptxas keeps them out
        of the loop); a flat element index unrolled over the tile cost ~4 times the
        instructions per element."""
        rr = self.fresh_var("out_row")
        return For(rr, int32(0), int32(COPY_ROWS), "serial", self.copy_row(row0, rr, by, bx))

    def copy_row(self, row0: Expr, rr: Expr, by: Expr, bx: Expr) -> Stmt:
        """Row rr · 4 + warp of the warpgroup's 64 staged rows of the tile at block row `by`,
        column `bx`: BN / 32 runs of 32 adjacent columns (lane l the run's l-th), read from the
        swizzled staging tile and stored through the output's own indices, guarded by row < M
        and column < N where the tiles do not divide them."""
        c, t = self.c, self.t
        thread = self.tx % WARPGROUP_SIZE
        lane, warp = thread % 32, thread // 32
        width = self.stage_width
        r = rr * 4 + warp
        row = by * t.bm + row0 + r

        def piece(j: Var) -> Stmt:
            col = j * 32 + lane
            column = bx * t.bn + col
            values = self.output_values(row, column)
            value = BufferLoad(self.staging, (col // width, (row0 + r) // 8, r % 8, col % width))
            store = BufferStore(c.store.buffer, tuple(substitute(ix, values) for ix in c.store.indices), value)
            return self.guarded(row, column, store)
        return self.unrolled("out_copy", t.bn // 32, piece)

    # ---- the threads' copy deferred into the next tile's k loop (the persistent grid) -----------------
    def defers_copy(self) -> bool:
        """Whether the threads' copy of a tile runs under the next tile's k loop: the persistent
        grid without split-K or batch axes (module docstring, "threads")."""
        return self.store_threads and bool(self.t.persistent) and self.t.splits == 1 and not self.c.batch

    def previous_tile(self) -> Buffer:
        """Registers of the block row and column of the tile whose staged rows are still to be
        copied out (the previous tile of this block)."""
        assert self.previous is not None
        return self.previous

    def deferred_copy(self, kt: Expr) -> Stmt | None:
        """After k tile kt's wgmmas are issued (they run while the threads store): rows
        [kt · R, kt · R + R) of each warp's share of the previous tile, R spreading the 16 rows
        over the k loop's first tiles (all at kt = 0 where the k loop's length is not known)."""
        if not self.defers_copy():
            return None
        known = const_int(self.k_tiles)
        per = -(-COPY_ROWS // known) if known else COPY_ROWS
        prev = self.previous_tile()
        by, bx = BufferLoad(prev, (int32(0),)), BufferLoad(prev, (int32(1),))
        row0 = self.warpgroup * 64
        v = self.fresh_var("out_row")
        rr = kt * per + v
        body = For(v, int32(0), int32(per), "unroll",
                   IfThenElse(rr < COPY_ROWS, self.copy_row(row0, rr, by, bx)) if COPY_ROWS % per else
                   self.copy_row(row0, rr, by, bx))
        return IfThenElse((self.tile_iter > 0) & (kt * per < COPY_ROWS), body)

    def final_copy(self) -> Stmt | None:
        """The block's last tile, copied out after the tile loop (when the block had a tile)."""
        if not self.defers_copy():
            return None
        prev = self.previous_tile()
        copy = self.thread_copies(self.warpgroup * 64, BufferLoad(prev, (int32(0),)), BufferLoad(prev, (int32(1),)))
        return IfThenElse(self.block_id < self.work_units(), copy)


# rows of a warpgroup's 64 that each of its 4 warps copies out (epilogue "threads")
COPY_ROWS = 16


__all__ = ["AccumulatorReplacer", "KernelEpilogue", "paired_columns", "thread_store_refusal", "tma_store_refusal"]
