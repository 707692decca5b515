"""The last block combines: the one-kernel form of a grid reduction whose blocks write partials
(split_reduce and split_rows, `combine="last_block"`), as CUDA's threadFenceReduction sample.

The blocks of a group (the S blocks of a column block in split_reduce, of a row in split_rows)
each store their partials, then announce themselves on the group's arrival counter; the block
that arrives last, S - 1 others having stored theirs before it, combines the partials and
writes the group's outputs, in the same kernel. `LastBlockHandshake.body` emits:

    <publish: the block stores its partials>
    barrier()                                      # (publish_barrier) the block's stores before the fence
    if leader:
      thread_fence()                               # release: the block's partials, then its count
      arrived[0] = atomic_add(arrivals[group], 1)  # shared int32
      if arrived[0] == S - 1: thread_fence()       # acquire: every other block's partials
    barrier()                                      # hands the count to the block: block-uniform after it
    if arrived[0] == S - 1:
      <combine: read the partials with load_cg, combine, write the outputs>
      if leader: arrivals[group] = 0               # zero again for the next launch

Why it is right (the barrier-fence-atomic-fence-barrier handshake of cooperative_groups' grid
sync; split_reduce's module docstring gives the whole argument): fence-then-atomic releases
every store that precedes the fence in the leader's view, its own by program order and the
block's through the barrier (a fence is cumulative); the leader that reads S - 1 has seen every
other block's atomic, and its fence then the barrier order the block's reads after them. The
partials must be read at L2 (`load_cg`, `ld.global.cg`), never through the non-coherent path
(`ld.global.nc` may serve a stale line). When the leader is the only thread that stored
(split_rows: thread 0 stores the block's one partial) the first barrier orders nothing and is
left out (`publish_barrier=False`); the emulator's publish check accepts a lane that stores,
fences and counts itself (tecc/runtime/sim/memory_intrinsics.py).

`arrivals` is a zero_init global temporary, one int32 per group: the host zeroes it once when
it allocates it (tecc/runtime/cuda.py and the emulator's executor alike) and the last block of
each group resets its counter, so every launch finds it zero; launches on one stream do not
overlap. A temporary that grows is reallocated and zeroed again; one that shrinks keeps its
zero prefix.
"""

from __future__ import annotations

from typing import Callable

from ...ir import dtype as dt
from ...ir.expr import Const, Expr, atomic_add, thread_fence
from ...ir.stmt import (
    Allocate,
    Barrier,
    Buffer,
    BufferStore,
    Evaluate,
    IfThenElse,
    Stmt,
    seq,
)

# How a grid reduction's S > 1 partials are combined: a second kernel, or the last block (above).
COMBINE_FORMS = ("kernel", "last_block")
# CUDA's gridDim.y limit: the S blocks of a group lie along y in both rewrites that combine this way.
MAX_GRID_Y = 65535


class LastBlockHandshake:
    """The counters of one kernel's groups and the handshake around them (module docstring).

    `unique` names the buffers: `<name>_arrivals` (global, zero_init, `groups` int32 counters)
    and `<name>_arrived` (shared, the leader's atomic result handed to its block)."""

    def __init__(self, unique: Callable[[str], str], name: str, groups: Expr) -> None:
        self.arrivals = Buffer(unique(f"{name}_arrivals"), dt.int32, (groups,), "global",
                               tensor=f"{name}.arrivals", zero_init=True)
        self.arrived = Buffer(unique(f"{name}_arrived"), dt.int32, (1,), "shared", tensor=f"{name}.arrived")

    def body(self, publish: Stmt, combine: Stmt, *, leader: Expr, group: Expr, splits: int,
             publish_barrier: bool = True) -> Stmt:
        """`publish` (the block stores its partials), the handshake, then `combine` in the last
        of the `splits` blocks of `group` to arrive, which also resets the group's counter.
        `leader` selects the one thread of the block that fences and counts; `combine` may hold
        barriers (the condition is block-uniform)."""
        zero = Const(0, dt.int32)
        arrived, arrivals = self.arrived, self.arrivals
        last = arrived[zero] == splits - 1
        return Allocate(arrived, seq(
            publish,
            Barrier() if publish_barrier else None,  # every partial of the block is stored before the leader's fence
            IfThenElse(leader, seq(
                Evaluate(thread_fence()),  # release: the block's partials, then its count
                BufferStore(arrived, (zero,), atomic_add(arrivals[group], 1)),
                IfThenElse(last, Evaluate(thread_fence())),  # acquire: the other blocks' partials
            )),
            Barrier(),  # hands the count to the block: arrived[0] is block-uniform after it
            IfThenElse(last, seq(
                combine,
                IfThenElse(leader, BufferStore(arrivals, (group,), zero)),  # zero again for the next launch
            )),
        ))


__all__ = ["COMBINE_FORMS", "MAX_GRID_Y", "LastBlockHandshake"]
