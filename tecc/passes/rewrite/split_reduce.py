"""Split reduction: a reduction over a non-contiguous axis (columns, a middle axis) read coalesced,
with the reduced axis split over threads and blocks and combined in a second stage.

A column sum `Y[j] = Σ_i X[i, j]` or a middle-axis sum `Y[a, c] = Σ_b X[a, b, c]` has few
outputs (one per column) and long reductions. One thread per output (the planner's `thread`
mapping) is coalesced but leaves the GPU idle: 1024 outputs are 1024 threads. `split_reduce`
spreads the reduced axis r (extent N) over TY threads of a block and S blocks:

    for bo in blockIdx.x(ceil(O / TX)):          # TX consecutive outputs per block
      for s in blockIdx.y(S):                    # S slices of the reduced axis
        for ty in threadIdx.y(TY): for tx in threadIdx.x(TX):
          o = bo*TX + tx                         # the output, flattened row-major
          acc = identity
          for i in serial(ceil(N / (S*TY))):     # rows r = (i*S + s)*TY + ty
            if o < O and r < N: acc = acc ⊕ f(X[.., r, .. o ..])
          red[ty, tx] = acc; barrier()           # the block stage: shared memory over ty
          if ty == 0: acc = ⊕_w red[w, tx]
            S == 1: Y[o] = finish(acc)           # (the body around the Reduce: a mean's 1/N, a cast)
            S > 1:  partial[s, o] = acc          # then the S partials of o are combined (below)

Consecutive lanes take consecutive outputs, whose reads are consecutive addresses when the
output's last axis is the input's unit-stride axis (checked by the strategy), so a warp load is
one contiguous run of 32 elements. The warp-shuffle allreduce of cross_thread.py does not fit
here: the lanes of a warp hold *different* outputs; the threads that share an output are the
TY rows of the block, combined through shared memory. The partials (S · O accumulators, in the
accumulation dtype, float32 for 16-bit sources) are the only extra traffic; the strategy keeps
S small enough that they are a few percent of the input.

With S > 1 the partials are combined in one of two forms (`combine=`):

* "kernel": a second kernel, one thread per output, folds partial[0..S-1, o]. Simple, but it
  costs ~2.5 µs of a ~13 µs column sum of 16384 × 1024 bf16 (H200, 2026-11-21: the first kernel
  alone ran at 87-91% of copy bandwidth, with the combine kernel at 71-73%). The one-pass form
  below costs every block a tail instead (two barriers, a fence and an atomic round trip):
  0.3-0.5 µs less there (73-75%), but up to 1.8 µs more on grids of several short waves;
  strategies/column_reduction.py chooses.
* "last_block" (one kernel, "the last block combines", as CUDA's threadFenceReduction sample):
  after storing its partials each block announces itself on a per-column-block counter, and
  the block that arrives last combines the S partials of its outputs:

      if ty == 0: partial[s, o] = acc
      barrier()
      if tx == 0 and ty == 0:                    # the leader, for the whole block
        thread_fence()                           # release: the block's partials before its count
        arrived[0] = atomic_add(arrivals[bo], 1) # shared int32
        if arrived[0] == S - 1: thread_fence()   # acquire: every other block's partials
      barrier()
      if arrived[0] == S - 1:                    # block-uniform: every block of bo came before
        acc = identity; for j: acc = acc ⊕ load_cg(partial[j*TY + ty, o])   # s over ty
        red[ty, tx] = acc; barrier(); if ty == 0: Y[o] = finish(⊕_w red[w, tx])
        if tx == 0 and ty == 0: arrivals[bo] = 0  # zero again for the next launch

  Why it is right: this is the barrier-fence-atomic-fence-barrier handshake of
  cooperative_groups' grid sync. The barrier orders every partial store of the block before
  the leader's fence, and a fence is cumulative (PTX memory model: it orders what its thread
  has observed, the block's stores through the barrier included), so fence-then-atomic
  releases all the block's partials before its count; the leader that reads S - 1 has seen
  every other block's atomic, its fence then the barrier order the block's reads after them,
  and the partials are read at L2 (`load_cg`, `ld.global.cg`: never the non-coherent
  `ld.global.nc`, which may serve a stale line). One leader fences instead of every writer:
  measured the same or up to 0.4 µs faster on 16384 × 1024 (H200, 2026-11-21). `arrivals` is a
  zero_init temporary (the host zeroes it once when it allocates it, tecc/runtime/cuda.py and
  the emulator's executor alike) that the last block resets, so every launch finds it zero;
  launches on one stream do not overlap. The emulator runs the protocol with atomics in lane
  order and checks its fences and barriers (tecc/runtime/sim/memory_intrinsics.py).

What is accepted (ScheduleError says why not): after elementwise producers are inlined, one
compute stage, an output, whose body holds one Reduce over one axis starting at 0.
"""

from __future__ import annotations

from typing import Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import (BufferLoad, Const, Expr, Reduce, TensorRead, Var, binary, cast, const_int, free_vars, load_cg,
                       reduce_identity, size_product, substitute, walk)
from ...ir.stmt import Allocate, Barrier, Buffer, BufferStore, For, IfThenElse, KernelCall, Module, PrimFunc, Stmt, seq
from ...ir.tensor import ComputeOp, Tensor, reduce_axis
from .last_block import COMBINE_FORMS, MAX_GRID_Y, LastBlockHandshake
from .reduction_stage import LoweredReduction, reduction_stage
from ..lower import COMBINE, Inliner, buffer_for, choose_inlined, collect_program, kernel_params, unflatten
from ..names import identifier

ZERO = Const(0, dt.int32)


def merged_axes(r: Reduce) -> Reduce:
    """`r` over one axis where it reduces over several, each from 0 with a constant extent and read
    only as a whole index (`X[n, h, w, c]`; not a window's `X[n, p + r - 1, ..]`): their
    mixed-radix index, the first axis outermost (a global average pool's (h, w) of an NHWC input
    read as one axis of H·W rows, `X[n, hw // W, hw % W, c]`, which the lowering's linear form
    reads at hw·C + c). The same points in the same order, so the same reduction; else `r`."""
    if len(r.axes) < 2:
        return r
    extents = [const_int(a.extent) for a in r.axes]
    if any(e is None or e < 1 for e in extents) or any(const_int(a.lo) != 0 for a in r.axes):
        return r
    axes = set(r.axes)
    for read in walk(r.source):  # each reduced axis a whole index of its own: no window (a stencil)
        if isinstance(read, TensorRead) and any(free_vars(i) & axes and i not in axes for i in read.indices):
            return r
    total = 1
    for e in extents:
        total *= e  # type: ignore[operator]
    axis = reduce_axis(total, name="_".join(a.name for a in r.axes))
    subs: dict[Var, Expr] = {}
    stride = total
    for i, (a, e) in enumerate(zip(r.axes, extents)):
        assert e is not None
        stride //= e
        digit = axis // stride if stride > 1 else axis
        subs[a] = digit if i == 0 else digit % e
    return Reduce(r.combiner, substitute(r.source, subs), (axis,))


def reduction_over_one_axis(args: Sequence[Tensor]) -> tuple[Tensor, Reduce]:
    """The one reduction stage of the program `args` and its Reduce, or ScheduleError: one
    reduced axis (several of constant extents merged into one: `merged_axes`) and an output of
    rank >= 1 (a full reduction is split_rows' business)."""
    t, r = reduction_stage(args, "split_reduce")
    r = merged_axes(r)
    if len(r.axes) != 1:
        raise ScheduleError(f"split_reduce: {t.name} reduces over {len(r.axes)} axes; one axis from 0 is needed")
    if not t.shape:
        raise ScheduleError(f"split_reduce: {t.name} is 0-d (a full reduction)")
    return t, r


def split_reduce(args: Sequence[Tensor], threads_x: int = 32, threads_y: int = 8, splits: int = 1,
                 unroll: int = 4, name: str | None = None, outputs_per_thread: int = 1,
                 combine: str = "kernel") -> Module:
    """The module computing the one-reduction program `args` with the reduced axis split over
    `threads_y` threads and `splits` blocks (see the module docstring): one kernel when
    splits == 1; else a temporary of splits × outputs partials, combined by a second kernel
    (`combine="kernel"`) or, in the same kernel, by the last block of each column block to
    finish (`combine="last_block"`, with a zero_init counter temporary). The default is the
    two-kernel form, so plans recorded before the one-kernel form existed replay unchanged.

    outputs_per_thread: V > 1 gives each thread V adjacent outputs `o = (bo·TX + tx)·V + v`, so
    its read of a row is V consecutive elements, emitted as one vector load (`vectorize`: 16
    bytes for V = 8 bf16 / 4 float32); a warp then reads 32·V consecutive elements per
    instruction instead of 32 (64 bytes for bf16). V must divide the output's last extent (a
    constant), so the V outputs of a thread never cross into the next output row."""
    _check_point(threads_x, threads_y, splits, unroll, combine)
    stage, red = reduction_over_one_axis(args)
    V = outputs_per_thread
    last = const_int(stage.shape[-1])
    if V not in (1, 2, 4, 8) or (V > 1 and (last is None or last % V)):
        raise ScheduleError(f"split_reduce: outputs_per_thread={V} must be 1, 2, 4 or 8 and divide the output's "
                            f"last extent {stage.shape[-1]}")
    low = LoweredReduction.of(args, stage, red)
    one_pass = splits > 1 and combine == "last_block"
    slices = _SliceKernel(low, threads_x, threads_y, splits, unroll, V, one_pass)
    kernels = [slices.kernel()]
    if slices.partial is not None and not one_pass:
        kernels.append(_combine_kernel(low, slices.partial, splits))
    return _module(low, kernels, slices.temps, one_pass, name)


def _check_point(threads_x: int, threads_y: int, splits: int, unroll: int, combine: str) -> None:
    """ScheduleError unless split_reduce's parameters are in range."""
    if threads_x % 32 or threads_x <= 0 or threads_y <= 0 or threads_x * threads_y > 1024:
        raise ScheduleError(f"split_reduce: threads {threads_x}x{threads_y}: x a multiple of 32, at most 1024 in all")
    if splits < 1 or unroll < 1:
        raise ScheduleError(f"split_reduce: splits ({splits}) and unroll ({unroll}) must be at least 1")
    if splits > MAX_GRID_Y:
        raise ScheduleError(f"split_reduce: splits ({splits}) over CUDA's gridDim.y limit of {MAX_GRID_Y}")
    if combine not in COMBINE_FORMS:
        raise ScheduleError(f"split_reduce: combine={combine!r}; one of {', '.join(COMBINE_FORMS)}")


class _SliceKernel:
    """Kernel 1 (module docstring): per block, TX·V consecutive outputs and one of S slices of
    the reduced axis, read by TY rows of threads and combined over ty in shared memory; then
    the outputs written (S == 1) or the block's partials stored, which the last block of the
    column block combines in the one-pass form. `partial` and `temps` are the partials'
    temporary (None when S == 1) and every temporary the kernel uses."""

    def __init__(self, low: LoweredReduction, TX: int, TY: int, S: int, unroll: int, V: int,
                 one_pass: bool) -> None:
        self.low, self.TX, self.TY, self.S, self.V, self.one_pass = low, TX, TY, S, V, one_pass
        unique, stage, red = low.sig.unique, low.stage, low.red
        self.unique = unique
        self.combiner = COMBINE[red.combiner]
        self.acc_dtype = acc_dtype = red.acc_dtype
        self.n_out = size_product(stage.shape)
        self.partial: Buffer | None = None
        self.temps: tuple[Buffer, ...] = ()

        self.bo, self.s, self.ty, self.tx, self.v = (Var(unique(n), dt.int32) for n in ("bo", "s", "ty", "tx", "v"))
        self.i = Var(unique("i"), dt.int32)
        g = self.bo * TX + self.tx                            # the thread's group of V outputs
        self.o0 = g * V if V > 1 else g                       # its first output
        self.o = self.o0 + self.v if V > 1 else self.o0
        self.o_idx = self.lanes(g)
        self.lane = self.v if V > 1 else ZERO
        self.acc = Buffer(unique(f"{stage.name}_acc"), acc_dtype, (V,), "local", tensor=f"{stage.name}.acc")
        self.block = Buffer(unique(f"{stage.name}_block"), acc_dtype, (TY, V, TX), "shared",
                            tensor=f"{stage.name}.block")
        self.row_loop = self.rows_of_slice(unroll)
        self.w = Var(unique("w"), dt.int32)
        self.identity = self.per_output(BufferStore(self.acc, (self.lane,), reduce_identity(red.combiner, acc_dtype)))
        self.blocks_x = (self.n_out + (TX * V - 1)) // (TX * V)

    def kernel(self) -> Stmt:
        """The kernel's loop nest: the slice's rows, the block stage, and the outputs written,
        the partials stored, or (one-pass) the partials stored and combined by the last block."""
        low, acc, lane, o0, n_out = self.low, self.acc, self.lane, self.o0, self.n_out
        write_y = IfThenElse(o0 < n_out, self.per_output(
            BufferStore(low.out, self.o_idx, low.finish(acc[lane], self.o_idx)), vectorized=True))
        if self.S == 1:
            body = seq(self.identity, self.row_loop, self.block_stage(write_y))
        else:
            stage = low.stage
            self.partial = partial = Buffer(self.unique(f"{stage.name}_partial"), self.acc_dtype,
                                            (Const(self.S, dt.int32), n_out), "global", tensor=f"{stage.name}.partial")
            self.temps = (partial,)
            store_partial = IfThenElse(o0 < n_out, self.per_output(BufferStore(partial, (self.s, self.o), acc[lane]),
                                                                   vectorized=True))
            if not self.one_pass:
                body = seq(self.identity, self.row_loop, self.block_stage(store_partial))
            else:
                body = self.last_block_combines(partial, store_partial, write_y)
        body = Allocate(acc, Allocate(self.block, body))
        return For(self.bo, 0, self.blocks_x, "blockIdx.x", For(self.s, 0, self.S, "blockIdx.y",
                   For(self.ty, 0, self.TY, "threadIdx.y", For(self.tx, 0, self.TX, "threadIdx.x", body))))

    def lanes(self, group: Expr) -> tuple[Expr, ...]:
        """The index of output group·V + v. V divides the last extent, so the group is unflattened
        over the shape with the last extent divided by V, and only the last index moves with v:
        written `(..)·V + v`, the offset of lane 0 is visibly a multiple of V (vectorize)."""
        shape, V = self.low.stage.shape, self.V
        if V == 1:
            return unflatten(group, shape)
        idx = unflatten(group, tuple(shape[:-1]) + (Const(const_int(shape[-1]) // V, dt.int32),))  # type: ignore[operator]
        return idx[:-1] + (idx[-1] * V + self.v,)

    def per_output(self, body: Stmt, vectorized: bool = False) -> Stmt:
        """`body` for each of the thread's V outputs (lane v)."""
        return For(self.v, 0, self.V, "vectorize" if vectorized else "unroll", body) if self.V > 1 else body

    def rows_of_slice(self, unroll: int) -> Stmt:
        """acc ⊕= f(X[.., r, ..]) over the rows r = (i·S + s)·TY + ty of the block's slice."""
        low, S, TY, lane, acc = self.low, self.S, self.TY, self.lane, self.acc
        red = low.red
        N = red.axes[0].extent
        r = (self.i * S + self.s) * TY + self.ty
        source = low.inliner.visit(substitute(red.source, {**dict(zip(low.op.axes, self.o_idx)), red.axes[0]: r}))
        update = self.per_output(BufferStore(acc, (lane,), binary(self.combiner, acc[lane], cast(source, self.acc_dtype))),
                                 vectorized=True)
        rounds: Expr = (N + (S * TY - 1)) // (S * TY)
        k_rounds = const_int(rounds)
        # the row guard is dropped when S·TY divides a constant N (every row of every round exists),
        # and the output guard is hoisted out of the loop: the unrolled loads are then unconditional
        # and independent, which is what keeps `unroll` of them in flight
        n_const = const_int(N)
        exact = n_const is not None and n_const % (S * TY) == 0
        step = update if exact else IfThenElse(r < N, update)
        notes = (("pragma_unroll", unroll),) if unroll > 1 and (k_rounds is None or k_rounds > 1) else ()
        # V divides the last extent, hence the output count: the first output in range means all V are
        return IfThenElse(self.o0 < self.n_out, For(self.i, 0, rounds, "serial", step, annotations=notes))

    def block_stage(self, then: Stmt) -> Stmt:
        """acc over the TY threads of an output, through shared memory, then `then` in ty == 0.
        The block stage is laid out [ty, v, tx]: consecutive lanes on consecutive words."""
        acc, block, lane, tx, ty = self.acc, self.block, self.lane, self.tx, self.ty
        return seq(
            self.per_output(BufferStore(block, (ty, lane, tx), acc[lane])),
            Barrier(),
            IfThenElse(ty == 0, seq(
                For(self.w, 0, self.TY - 1, "unroll",
                    self.per_output(BufferStore(acc, (lane,), binary(self.combiner, acc[lane],
                                                                     block[self.w + 1, lane, tx])))),
                then,
            )),
        )

    def last_block_combines(self, partial: Buffer, store_partial: Stmt, write_y: Stmt) -> Stmt:
        """Kernel 1's body in the one-pass form (module docstring, combine="last_block"; the
        handshake is last_block.py's, shared with split_rows); adds its arrivals counter to
        `temps`: per block of TX·V outputs, how many of its S blocks have stored their partials."""
        acc, lane, S, TY = self.acc, self.lane, self.S, self.TY
        handshake = LastBlockHandshake(self.unique, self.low.stage.name, self.blocks_x)
        self.temps = (partial, handshake.arrivals)
        leader = (self.tx == 0) & (self.ty == 0)
        j = Var(self.unique("j"), dt.int32)
        sj = j * TY + self.ty                             # thread ty combines s = ty, ty + TY, ...
        gather: Stmt = self.per_output(BufferStore(acc, (lane,), binary(self.combiner, acc[lane],
                                                                        load_cg(partial[sj, self.o]))))
        if S % TY:
            gather = IfThenElse(sj < S, gather)
        gather = IfThenElse(self.o0 < self.n_out, For(j, 0, -(-S // TY), "unroll", gather))
        return handshake.body(seq(self.identity, self.row_loop, self.block_stage(store_partial)),
                              seq(self.identity, gather, self.block_stage(write_y)),
                              leader=leader, group=self.bo, splits=S)


def _combine_kernel(low: LoweredReduction, partial: Buffer, S: int) -> Stmt:
    """Kernel 2 (S > 1, combine="kernel"): one thread per output folds its S partials."""
    unique, stage, red = low.sig.unique, low.stage, low.red
    n_out = size_product(stage.shape)
    b2, t2, j = (Var(unique(n), dt.int32) for n in ("b2", "t2", "j"))
    threads2 = 256
    o2 = b2 * threads2 + t2
    acc2 = Buffer(unique(f"{stage.name}_total"), red.acc_dtype, (1,), "local", tensor=f"{stage.name}.total")
    combined = binary(COMBINE[red.combiner], acc2[ZERO], partial[j + 1, o2])
    o_idx = unflatten(o2, stage.shape)
    body: Stmt = IfThenElse(o2 < n_out, seq(
        BufferStore(acc2, (ZERO,), partial[ZERO, o2]),
        For(j, 0, S - 1, "serial", BufferStore(acc2, (ZERO,), combined)),
        BufferStore(low.out, o_idx, low.finish(acc2[ZERO], o_idx)),
    ))
    return For(b2, 0, (n_out + (threads2 - 1)) // threads2, "blockIdx.x",
               For(t2, 0, threads2, "threadIdx.x", Allocate(acc2, body)))


def _module(low: LoweredReduction, kernels: list[Stmt], temps: tuple[Buffer, ...], one_pass: bool,
            name: str | None) -> Module:
    """The module launching `kernels` (the split kernel, then the combine kernel if any)."""
    unique, buffers, stage = low.sig.unique, low.sig.buffers, low.stage
    arrays = [buffers[a] for a in low.program.args]
    funcs: list[PrimFunc] = []
    for n, body in enumerate(kernels):
        attrs: tuple[tuple[str, object], ...] = (("split_reduce", stage.name),)
        if n == 0 and one_pass:
            attrs += (("combine", "last_block"),)
        params = kernel_params(body, arrays, temps, low.sig.scalars)
        funcs.append(PrimFunc(unique(f"{stage.name}_{'split' if n == 0 else 'combine'}_kernel"), params, body, attrs))
    module_params = tuple(arrays) + tuple(low.sig.scalars)
    calls = tuple(KernelCall(f.name, f.params) for f in funcs)
    return Module(identifier(name or stage.name), module_params, tuple(funcs), calls, temps)


def uncoalesced_read(args: Sequence[Tensor]) -> str | None:
    """Why the reads of the one reduction of `args` would not be coalesced by split_reduce, or
    None when every read that walks the reduced axis keeps it out of its last index and has the
    output's last axis, alone, as its last index (consecutive outputs: consecutive addresses), or
    reads along no output axis at all (the same address for a warp's outputs)."""
    stage, red = reduction_over_one_axis(args)
    prog = choose_inlined(collect_program(args))
    op = stage.op
    assert isinstance(op, ComputeOp)
    buffers = {t: buffer_for(t, t.name) for t in prog.args}
    source = Inliner(prog.inlined, buffers).visit(red.source)
    axis, last = red.axes[0], op.axes[-1]
    for node in walk(source):
        if not isinstance(node, BufferLoad) or axis not in free_vars(node):
            continue
        if node.buffer.strides is not None:
            return f"{node.buffer.name} is strided"
        if not free_vars(node) & set(op.axes):
            continue   # one value per reduced index for all outputs (a row's mean): one address per warp
        if any(axis in free_vars(i) for i in node.indices[-1:]):
            return f"{node.buffer.name} walks the reduced axis along its last (unit-stride) index: a row reduction"
        if node.indices[-1] is not last:
            return f"{node.buffer.name}'s last index is {node.indices[-1]}, not the output's last axis {last}"
    return None


__all__ = ["reduction_over_one_axis", "split_reduce", "uncoalesced_read"]
