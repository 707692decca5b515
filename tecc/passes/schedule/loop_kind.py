"""bind, unroll, vectorize: set how a loop's iterations run (see the For kinds in tecc.ir.stmt).

bind(loop, axis), axis one of blockIdx.{x,y,z} / threadIdx.{x,y,z}. Preconditions:
- the loop is serial, starts at 0, and carries no dependence (islpy): its iterations will run in
  different blocks or threads at once;
- a thread axis needs a constant extent (split by a constant first); a grid axis may be symbolic;
- no enclosing loop is bound to the same axis, and a block axis is not bound inside a thread loop;
- the threads bound on one path multiply to at most 1024 (CUDA's limit per block);
- a thread axis is not bound to a loop that holds a shared-memory stage placed for one of its
  iterations (the threads would race filling the one per-block buffer);
- the loop holds all the work of the kernel: every store of the kernel is inside it and only
  block/thread loops and allocations are around it. Code outside a bound loop would run once in
  every block (or thread) -- e.g. binding the `i_init` loop that reorder split off an
  accumulator would leave the update loop running redundantly in every block.

unroll(loop): constant extent. vectorize(loop): constant extent, innermost (no loop inside); the
emitter turns its contiguous accesses into one vector access where aligned and unrolls otherwise.
"""

from __future__ import annotations

from ...ir.errors import ScheduleError
from ...ir.expr import const_int
from ...ir.stmt import BLOCK_KINDS, THREAD_KINDS, Allocate, For, PrimFunc
from .legality import check_parallel
from .loops import find_loop, iter_with_path, leaves, loops_on_path, replace_stmt

MAX_THREADS_PER_BLOCK = 1024  # CUDA limit for every architecture tecc targets (sm_70 .. sm_90)


def _rekind(func: PrimFunc, node: For, kind: str) -> PrimFunc:
    new = For(node.var, node.min, node.extent, kind, node.body, node.annotations)
    return func.with_body(replace_stmt(func.body, node, new))


def bind(func: PrimFunc, loop: str, axis: str) -> PrimFunc:
    what = f"bind({loop}, {axis!r})"
    if axis not in BLOCK_KINDS + THREAD_KINDS:
        raise ScheduleError(f"{what}: unknown axis; one of {BLOCK_KINDS + THREAD_KINDS}")
    node, path = find_loop(func, loop)
    if node.kind != "serial":
        raise ScheduleError(f"{what}: the loop is already {node.kind}")
    if const_int(node.min) != 0:
        raise ScheduleError(f"{what}: the loop starts at {node.min}, a bound loop must start at 0; split it first")
    extent = const_int(node.extent)
    if axis in THREAD_KINDS and extent is None:
        raise ScheduleError(
            f"{what}: a thread axis needs a constant extent, the loop has {node.extent}; "
            f"split {loop} by a constant factor and bind the inner loop"
        )
    outer = loops_on_path(path)
    for lp in outer:
        if lp.kind == axis:
            raise ScheduleError(f"{what}: the enclosing loop {lp.var.name} is already bound to {axis}")
        if axis in BLOCK_KINDS and lp.is_thread:
            raise ScheduleError(f"{what}: a block axis cannot be bound inside the thread loop {lp.var.name}")
    if axis in THREAD_KINDS:
        threads = extent or 1
        for lp in outer:
            if lp.is_thread:
                threads *= const_int(lp.extent) or 1
        if threads > MAX_THREADS_PER_BLOCK:
            raise ScheduleError(f"{what}: {threads} threads per block, more than CUDA's {MAX_THREADS_PER_BLOCK}")
    for s, _ in iter_with_path(node.body):
        if isinstance(s, For) and s.kind == axis:
            raise ScheduleError(f"{what}: the inner loop {s.var.name} is already bound to {axis}")
        if axis in THREAD_KINDS and isinstance(s, Allocate) and s.buffer.scope == "shared":
            # The shared tile was sized for one iteration of this loop; as threads, all iterations
            # would fill the one per-block buffer at once (a race). Staging placed after the bind
            # sizes the tile for all the block's threads and copies cooperatively.
            raise ScheduleError(
                f"{what}: the shared buffer {s.buffer.name} is staged inside this loop for one of its "
                "iterations; bind the loop to threads first, then compute_at the shared cache"
            )
    check_parallel(func, node, what)
    for anc in path:
        if isinstance(anc, For) and not (anc.is_block or anc.is_thread):
            raise ScheduleError(f"{what}: the loop is inside the serial loop {anc.var.name}; a bound loop may only "
                                "be nested in other bound loops (reorder it outward first)")
    inside = {id(x) for x in leaves(node)}
    outside = [x for x in leaves(func.body) if id(x) not in inside]
    if outside:
        raise ScheduleError(f"{what}: the statement `{str(outside[0]).strip()}` is outside the loop and would run in "
                            "every block/thread; bind a loop that holds all the kernel's work")
    return _rekind(func, node, axis)


def unroll(func: PrimFunc, loop: str) -> PrimFunc:
    node, _ = find_loop(func, loop)
    if node.kind not in ("serial", "unroll"):
        raise ScheduleError(f"unroll({loop}): the loop is {node.kind}; only a serial loop can be unrolled")
    if const_int(node.extent) is None:
        raise ScheduleError(f"unroll({loop}): the extent {node.extent} is not constant; split by a constant first")
    return _rekind(func, node, "unroll")


def vectorize(func: PrimFunc, loop: str) -> PrimFunc:
    node, _ = find_loop(func, loop)
    if node.kind not in ("serial", "vectorize"):
        raise ScheduleError(f"vectorize({loop}): the loop is {node.kind}; only a serial loop can be vectorized")
    if const_int(node.extent) is None:
        raise ScheduleError(f"vectorize({loop}): the extent {node.extent} is not constant; split by a constant first")
    if any(isinstance(s, For) for s, _ in iter_with_path(node.body)):
        raise ScheduleError(f"vectorize({loop}): the loop contains other loops; only an innermost loop can be vectorized")
    return _rekind(func, node, "vectorize")
