"""The memory intrinsics (MEMORY_INTRINSICS in tecc.ir.expr) under the emulator, and the check
that a block publishes its global stores before an atomic announces them.

**Order.** A statement runs for all lanes of a chunk before the next statement starts; the
lanes are the chunk's blocks in linear order (x fastest), and chunks run one after another.
`atomic_add` applies the additions of its active lanes one lane at a time, in lane order: each
lane gets the element's value before its own addition, with the additions of the lanes before
it (same element) and of every earlier statement and chunk already in. That is one legal GPU
order of relaxed atomics.

Why a split reduction's last block then sees every partial (tecc.passes.rewrite.split_reduce,
combine="last_block"): a block stores its partials, reaches a barrier, and only then does its
leader fence and add 1 to the column group's counter. Take the block that gets S-1. Every
other block of its group got a smaller value, so its atomic came earlier: in an earlier chunk
(which finished entirely, partials included), or in this chunk's same atomic statement at a
lower lane (and its partial stores are statements before that one, so they finished in every
lane of the chunk). Either way its partials are in memory when the last block reads them.

**The check** (checks=True, kernels that hold an atomic_add; only an integer atomic is checked:
a float atomic_add accumulates and announces nothing, so a store before it needs no fence)
follows the PTX memory model's release pattern: a store is published before an atomic by a fence after it, either of its own
thread or, through a barrier, of any thread of its block (fences are cumulative). Per lane:
CLEAN, STORED (a global store that nothing orders yet), SYNCED (stored, then a barrier of its
block: ordered before what the block does next, not yet released) or FENCED (stored, then its
own fence: released, but another thread's atomic needs a barrier after that fence).

    store:      the lane            -> STORED
    barrier:    its blocks' lanes   STORED -> SYNCED, FENCED -> CLEAN
    fence:      the lane            STORED -> FENCED; its block's SYNCED lanes -> CLEAN
    atomic_add by lane L: RaceError if a lane of L's block is STORED or SYNCED, or a lane
                other than L is FENCED

So both handshakes pass: every writer fences, a barrier, then the atomic (CUDA's
threadFenceReduction sample); or a barrier, then one thread fences and does the atomic
(cooperative_groups' grid sync, what split_reduce emits). Under lockstep a missing fence or
barrier never changes a result here, so the check is what finds it; on a GPU another block
could see the atomic's count before the data it announces. The barrier that hands the atomic's
result to the block through shared memory is checked by the shared-memory race detector (a
read-after-write without a barrier).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...ir.errors import OutOfBoundsError, RaceError
from ...ir.expr import ATOMIC_INTRINSICS, Call, walk
from ...ir.stmt import BufferStore, Evaluate, For, IfThenElse, LetStmt, Stmt, iter_stmts
from .memory import GlobalMemory, check_bounds, flat_index
from .state import LaneState

CLEAN, STORED, SYNCED, FENCED = 0, 1, 2, 3


def uses_atomics(body: Stmt) -> bool:
    """Whether a kernel body holds an atomic_add (then its global stores are tracked)."""
    for s in iter_stmts(body):
        exprs: list[Any] = []
        if isinstance(s, BufferStore):
            exprs = [*s.indices, s.value]
        elif isinstance(s, Evaluate):
            exprs = [s.value]
        elif isinstance(s, IfThenElse):
            exprs = [s.cond]
        elif isinstance(s, LetStmt):
            exprs = [s.value]
        elif isinstance(s, For):
            exprs = [s.min, s.extent]
        if any(isinstance(n, Call) and n.name in ATOMIC_INTRINSICS for e in exprs for n in walk(e)):
            return True
    return False


def atomic_add(st: LaneState, mem: GlobalMemory, idx: tuple[Any, ...], value: Any, dims: Any) -> np.ndarray:
    if st.checks:
        check_bounds(st, "atomic add", "global", mem.name, mem.shape, idx, dims)
        if mem.flat.dtype.kind not in "f":   # a float accumulation announces nothing (MEMORY_INTRINSICS)
            _check_published(st)
    lanes = st.layout.lanes
    where = np.broadcast_to(np.asarray(flat_index(idx, mem.strides, mem.wide) + mem.origin), (lanes,))
    kind = mem.flat.dtype
    wide = np.int64 if kind.kind in "iu" else np.float64
    add = np.broadcast_to(np.asarray(value).astype(kind, copy=False), (lanes,))
    active = np.arange(lanes) if st.mask is None else np.flatnonzero(st.mask)
    order = active[np.argsort(where[active], kind="stable")]  # by element, lane order within
    f = np.clip(where[order], 0, mem.last)
    v = add[order]
    # the value each lane gets back: the element plus the additions of the lanes before it on the
    # same element (exact for integers, which wrap below; computed in float64 for floats, where
    # the value returned is then within the rounding of the additions before it)
    earlier = np.cumsum(v.astype(wide)) - v.astype(wide)  # the additions of the lanes before, over all elements
    if f.size:
        first = np.flatnonzero(np.r_[True, f[1:] != f[:-1]])  # where each element's run starts
        runs = np.diff(np.r_[first, f.size])
        earlier = earlier - np.repeat(earlier[first], runs)  # ... on the same element only
    old = np.zeros(lanes, dtype=wide)
    old[order] = mem.flat[f].astype(wide) + earlier
    # one addition at a time, in lane order, each rounded to the element's dtype (ufunc.at is
    # unbuffered): float atomics round every addition as the GPU does, in one of its legal orders;
    # integers wrap, as on the GPU
    np.add.at(mem.flat, f, v)
    with np.errstate(over="ignore", invalid="ignore"):
        return old.astype(kind)


def atomic_add_pair(st: LaneState, mem: GlobalMemory, idx: tuple[Any, ...], first: Any, second: Any,
                    dims: Any) -> int:
    """atomic_add_pair (MEMORY_INTRINSICS): `first` added to the element at idx and `second` to
    the next one of the innermost dimension, as two float32 atomic_adds in lane order; the pair
    must lie inside that dimension and start 8 bytes aligned (an even element offset: buffers
    start aligned), as red.global.add.v2.f32 needs."""
    nxt = (*idx[:-1], np.asarray(idx[-1]) + 1)
    if st.checks:
        # the second element's column is one past what the static bounds proof (dims) covered
        last = len(mem.shape) - 1
        check_bounds(st, "atomic add (pair's second element)", "global", mem.name, mem.shape, nxt,
                     (*(d for d in dims if d != last), last))
        where = np.broadcast_to(np.asarray(flat_index(idx, mem.strides, mem.wide) + mem.origin), (st.layout.lanes,))
        active = where if st.mask is None else where[st.mask]
        if np.any(active % 2):
            raise OutOfBoundsError(f"atomic_add_pair into {mem.name}: a pair starts at an odd element "
                                   f"({int(active[np.flatnonzero(active % 2)[0]])}), not 8 bytes aligned; "
                                   "pair even columns with the next")
    atomic_add(st, mem, idx, first, dims)
    atomic_add(st, mem, nxt, second, dims)
    return 0


def run_fence(st: LaneState) -> int:
    state = st.fences
    if state is None:
        return 0
    lay = st.layout
    fencing = np.ones(lay.lanes, dtype=bool) if st.mask is None else st.mask
    blocks = np.zeros(lay.blocks, dtype=bool)
    blocks[lay.lane_block[fencing]] = True
    released = (state == SYNCED) & blocks[lay.lane_block]  # cumulative: what the barrier ordered
    own = (state == STORED) & fencing
    state[released] = CLEAN
    state[own] = FENCED
    return 0


def note_global_store(st: LaneState) -> None:
    """A global store by the active lanes (called only in kernels that hold an atomic)."""
    if not st.checks:
        return
    if st.fences is None:
        st.fences = np.zeros(st.layout.lanes, dtype=np.int8)
    if st.mask is None:
        st.fences[:] = STORED
    else:
        st.fences[st.mask] = STORED


def note_barrier(st: LaneState) -> None:
    """A barrier reached by the active lanes' blocks (whole blocks: _run_barrier checked it)."""
    state = st.fences
    if state is None:
        return
    here = np.ones(state.size, dtype=bool) if st.mask is None else st.mask
    fenced, stored = (state == FENCED) & here, (state == STORED) & here
    state[fenced] = CLEAN
    state[stored] = SYNCED


def _check_published(st: LaneState) -> None:
    state = st.fences
    if state is None:
        return
    lay = st.layout
    issuing = np.arange(lay.lanes) if st.mask is None else np.flatnonzero(st.mask)
    rows = state.reshape(lay.blocks, lay.threads)[lay.lane_block[issuing]]  # each issuer's block
    own = np.zeros_like(rows, dtype=bool)
    own[np.arange(issuing.size), lay.lane_thread[issuing]] = True
    unordered = ("stored to global memory, and neither its own __threadfence() nor a __syncthreads() "
                 "then a __threadfence() orders that store before the atomic")
    unfenced = "stored to global memory before a __syncthreads(), but no __threadfence() follows it before the atomic"
    unsynced = "fenced its global stores, but no __syncthreads() orders that fence before the atomic"
    for bad, what in ((rows == STORED, unordered), (rows == SYNCED, unfenced), ((rows == FENCED) & ~own, unsynced)):
        hit = bad.any(axis=1)
        if hit.any():
            n = int(np.argmax(hit))
            lane = int(issuing[n])
            other = int(np.argmax(bad[n]))
            err = RaceError(
                f"unpublished global stores before atomic_add in kernel {st.kernel}, block {lay.block_of(lane)}: "
                f"thread {lay.thread_coords(other)} {what} of thread {lay.thread_of(lane)}; another block could "
                "see the atomic's count before the data it announces")
            err.block = lay.block_of(lane)  # type: ignore[attr-defined]
            err.thread = lay.thread_of(lane)  # type: ignore[attr-defined]
            err.other_thread = lay.thread_coords(other)  # type: ignore[attr-defined]
            raise err


__all__ = ["atomic_add", "atomic_add_pair", "note_barrier", "note_global_store", "run_fence", "uses_atomics"]
