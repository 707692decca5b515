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
from ...ir.expr import (
    BufferLoad,
    Const,
    Expr,
    Reduce,
    Var,
    binary,
    cast,
    const_int,
    free_vars,
    load_cg,
    reduce_identity,
    substitute,
    walk,
    size_product,
)
from ...ir.stmt import (
    Allocate,
    Barrier,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    KernelCall,
    Module,
    PrimFunc,
    Stmt,
    seq,
)
from ...ir.tensor import ComputeOp, Tensor
from ...ir.visitor import ExprMutator
from .last_block import COMBINE_FORMS, MAX_GRID_Y, LastBlockHandshake
from .reduction_stage import reduction_stage
from ..lower import (
    COMBINE,
    buffer_for,
    exprs_of,
    global_buffers,
    Inliner,
    scalar_vars,
    choose_inlined,
    collect_program,
    signature,
)
from ..names import identifier


def reduction_over_one_axis(args: Sequence[Tensor]) -> tuple[Tensor, Reduce]:
    """The one reduction stage of the program `args` and its Reduce, or ScheduleError: one
    reduced axis and an output of rank >= 1 (a full reduction is split_rows' business)."""
    t, r = reduction_stage(args, "split_reduce")
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
    if threads_x % 32 or threads_x <= 0 or threads_y <= 0 or threads_x * threads_y > 1024:
        raise ScheduleError(f"split_reduce: threads {threads_x}x{threads_y}: x a multiple of 32, at most 1024 in all")
    if splits < 1 or unroll < 1:
        raise ScheduleError(f"split_reduce: splits ({splits}) and unroll ({unroll}) must be at least 1")
    if splits > MAX_GRID_Y:
        raise ScheduleError(f"split_reduce: splits ({splits}) over CUDA's gridDim.y limit of {MAX_GRID_Y}")
    if combine not in COMBINE_FORMS:
        raise ScheduleError(f"split_reduce: combine={combine!r}; one of {', '.join(COMBINE_FORMS)}")
    stage, red = reduction_over_one_axis(args)
    V = outputs_per_thread
    last = const_int(stage.shape[-1])
    if V not in (1, 2, 4, 8) or (V > 1 and (last is None or last % V)):
        raise ScheduleError(f"split_reduce: outputs_per_thread={V} must be 1, 2, 4 or 8 and divide the output's "
                            f"last extent {stage.shape[-1]}")
    prog = choose_inlined(collect_program(args))
    op = stage.op
    assert isinstance(op, ComputeOp)

    sig = signature(prog)
    buffers, scalars, unique = sig.buffers, sig.scalars, sig.unique
    inliner = Inliner(prog.inlined, buffers)
    out = buffers[stage]

    n_out = size_product(stage.shape)

    def unflatten(o: Expr) -> tuple[Expr, ...]:
        idx: list[Expr] = []
        rest = o
        for i, extent in enumerate(reversed(stage.shape)):
            idx.append(rest if i == len(stage.shape) - 1 else rest % extent)
            rest = rest // extent
        return tuple(reversed(idx))

    def finish(acc: Expr, o_idx: tuple[Expr, ...]) -> Expr:
        """The stage's body with its Reduce replaced by the combined accumulator."""

        class _Finish(ExprMutator):
            def visit_Reduce(self, r: Reduce) -> Expr:  # noqa: N805
                return cast(acc, r.dtype)

        return inliner.visit(_Finish().visit(substitute(op.body, dict(zip(op.axes, o_idx)))))

    TX, TY, S = threads_x, threads_y, splits
    N = red.axes[0].extent
    combiner = COMBINE[red.combiner]
    acc_dtype = red.acc_dtype
    zero = Const(0, dt.int32)
    one_pass = S > 1 and combine == "last_block"

    # ---- kernel 1: per-block partials over TY·S interleaved rows, combined over ty in shared
    bo, s, ty, tx, v = (Var(unique(n), dt.int32) for n in ("bo", "s", "ty", "tx", "v"))
    i = Var(unique("i"), dt.int32)
    g = bo * TX + tx                                      # the thread's group of V outputs
    o0 = g * V if V > 1 else g                            # its first output
    o = o0 + v if V > 1 else o0

    def lanes(group: Expr) -> tuple[Expr, ...]:
        """The index of output group·V + v. V divides the last extent, so the group is unflattened
        over the shape with the last extent divided by V, and only the last index moves with v:
        written `(..)·V + v`, the offset of lane 0 is visibly a multiple of V (vectorize)."""
        if V == 1:
            return unflatten(group)
        idx: list[Expr] = []
        rest = group
        shape = tuple(stage.shape[:-1]) + (Const(last // V, dt.int32),)
        for n, extent in enumerate(reversed(shape)):
            idx.append(rest if n == len(shape) - 1 else rest % extent)
            rest = rest // extent
        idx.reverse()
        return tuple(idx[:-1]) + (idx[-1] * V + v,)

    def per_output(body: Stmt, vectorized: bool = False) -> Stmt:
        return For(v, 0, V, "vectorize" if vectorized else "unroll", body) if V > 1 else body

    o_idx = lanes(g)
    r = (i * S + s) * TY + ty
    lane = v if V > 1 else zero
    acc = Buffer(unique(f"{stage.name}_acc"), acc_dtype, (V,), "local", tensor=f"{stage.name}.acc")
    block = Buffer(unique(f"{stage.name}_block"), acc_dtype, (TY, V, TX), "shared", tensor=f"{stage.name}.block")
    source = inliner.visit(substitute(red.source, {**dict(zip(op.axes, o_idx)), red.axes[0]: r}))
    update = per_output(BufferStore(acc, (lane,), binary(combiner, acc[lane], cast(source, acc_dtype))),
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
    row_loop: Stmt = IfThenElse(o0 < n_out, For(i, 0, rounds, "serial", step, annotations=notes))
    w = Var(unique("w"), dt.int32)
    identity = per_output(BufferStore(acc, (lane,), reduce_identity(red.combiner, acc_dtype)))
    blocks_x = (n_out + (TX * V - 1)) // (TX * V)

    def block_stage(then: Stmt) -> Stmt:
        """acc over the TY threads of an output, through shared memory, then `then` in ty == 0.
        The block stage is laid out [ty, v, tx]: consecutive lanes on consecutive words."""
        return seq(
            per_output(BufferStore(block, (ty, lane, tx), acc[lane])),
            Barrier(),
            IfThenElse(ty == 0, seq(
                For(w, 0, TY - 1, "unroll",
                    per_output(BufferStore(acc, (lane,), binary(combiner, acc[lane], block[w + 1, lane, tx])))),
                then,
            )),
        )

    def last_block_combines(partial: Buffer, store_partial: Stmt) -> tuple[Stmt, Buffer]:
        """Kernel 1's body in the one-pass form (module docstring, combine="last_block"; the
        handshake is last_block.py's, shared with split_rows) and its arrivals counter: per
        block of TX·V outputs, how many of its S blocks have stored their partials."""
        handshake = LastBlockHandshake(unique, stage.name, blocks_x)
        leader = (tx == 0) & (ty == 0)
        j = Var(unique("j"), dt.int32)
        sj = j * TY + ty                                  # thread ty combines s = ty, ty + TY, ...
        gather: Stmt = per_output(BufferStore(acc, (lane,), binary(combiner, acc[lane], load_cg(partial[sj, o]))))
        if S % TY:
            gather = IfThenElse(sj < S, gather)
        gather = IfThenElse(o0 < n_out, For(j, 0, -(-S // TY), "unroll", gather))
        body = handshake.body(seq(identity, row_loop, block_stage(store_partial)),
                              seq(identity, gather, block_stage(write_y)),
                              leader=leader, group=bo, splits=S)
        return body, handshake.arrivals

    write_y = IfThenElse(o0 < n_out, per_output(BufferStore(out, o_idx, finish(acc[lane], o_idx)), vectorized=True))
    temps: tuple[Buffer, ...] = ()
    partial = None
    if S == 1:
        body1 = seq(identity, row_loop, block_stage(write_y))
    else:
        partial = Buffer(unique(f"{stage.name}_partial"), acc_dtype, (Const(S, dt.int32), n_out), "global",
                         tensor=f"{stage.name}.partial")
        temps = (partial,)
        store_partial = IfThenElse(o0 < n_out, per_output(BufferStore(partial, (s, o), acc[lane]), vectorized=True))
        if not one_pass:
            body1 = seq(identity, row_loop, block_stage(store_partial))
        else:
            body1, arrivals = last_block_combines(partial, store_partial)
            temps = (partial, arrivals)
    body1 = Allocate(acc, Allocate(block, body1))
    body1 = For(bo, 0, blocks_x, "blockIdx.x", For(s, 0, S, "blockIdx.y",
                For(ty, 0, TY, "threadIdx.y", For(tx, 0, TX, "threadIdx.x", body1))))

    kernels = [body1]
    # ---- kernel 2 (S > 1, combine="kernel"): one thread per output combines the S partials
    if partial is not None and not one_pass:
        b2, t2, j = (Var(unique(n), dt.int32) for n in ("b2", "t2", "j"))
        threads2 = 256
        o2 = b2 * threads2 + t2
        acc2 = Buffer(unique(f"{stage.name}_total"), acc_dtype, (1,), "local", tensor=f"{stage.name}.total")
        body2: Stmt = IfThenElse(o2 < n_out, seq(
            BufferStore(acc2, (zero,), partial[zero, o2]),
            For(j, 0, S - 1, "serial", BufferStore(acc2, (zero,), binary(combiner, acc2[zero], partial[j + 1, o2]))),
            BufferStore(out, unflatten(o2), finish(acc2[zero], unflatten(o2))),
        ))
        body2 = For(b2, 0, (n_out + (threads2 - 1)) // threads2, "blockIdx.x",
                    For(t2, 0, threads2, "threadIdx.x", Allocate(acc2, body2)))
        kernels.append(body2)

    funcs: list[PrimFunc] = []
    calls: list[KernelCall] = []
    for n, body in enumerate(kernels):
        used = global_buffers(body)
        body_vars = scalar_vars(exprs_of(body) + [e for u in used for e in u.shape + (u.strides or ())])
        params = (tuple(buffers[a] for a in prog.args if buffers[a] in used) + tuple(t for t in temps if t in used)
                  + tuple(v for v in scalars if v in body_vars))
        kname = unique(f"{stage.name}_{'split' if n == 0 else 'combine'}_kernel")
        attrs: tuple[tuple[str, object], ...] = (("split_reduce", stage.name),)
        if n == 0 and one_pass:
            attrs += (("combine", "last_block"),)
        funcs.append(PrimFunc(kname, params, body, attrs))
        calls.append(KernelCall(kname, params))
    mname = identifier(name or stage.name)
    module_params = tuple(buffers[a] for a in prog.args) + tuple(scalars)
    return Module(mname, module_params, tuple(funcs), tuple(calls), temps)


def uncoalesced_read(args: Sequence[Tensor]) -> str | None:
    """Why the reads of the one reduction of `args` would not be coalesced by split_reduce, or
    None when every read that walks the reduced axis keeps it out of its last index and has the
    output's last axis, alone, as its last index (consecutive outputs: consecutive addresses)."""
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
        if any(axis in free_vars(i) for i in node.indices[-1:]):
            return f"{node.buffer.name} walks the reduced axis along its last (unit-stride) index: a row reduction"
        if node.indices[-1] is not last:
            return f"{node.buffer.name}'s last index is {node.indices[-1]}, not the output's last axis {last}"
    return None


__all__ = ["reduction_over_one_axis", "split_reduce", "uncoalesced_read"]
