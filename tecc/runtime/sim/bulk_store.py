"""TMA tensor stores, bulk groups and named barriers under the emulator.

- `TensorStore` (issued by each active lane, normally one): the box at the lane's coordinates is
  read from the source's shared tile (row-major through its layout) when the store is issued and
  written to the global tensor, clipped at the tensor's edges (elements outside are not
  written, and their shared elements are not read). The read must be legal for the async proxy:
  every element read must have been written (uninitialized otherwise), by this thread or before
  a barrier (a named one among the writers is enough; read-after-write race otherwise), with a
  `fence.proxy.async` after the last ordinary store to the tile (race otherwise), and no
  asynchronous copy may still be writing it. From then on the elements are *being read* by the
  store (the memory's `bulk_reading` shadow) until the issuing thread's
  `cp.async.bulk.wait_group.read` retires its group: any write to them before is a RaceError.
  The read is also logged as the issuing thread's, so another thread that overwrites the tile
  after that wait but before a barrier is a write-after-read race.
- `BulkCommit` closes the lane's open group; `BulkWait(n)` retires all but the lane's `n` newest
  committed groups (their reads of shared memory are done).
- `NamedBarrier(id, n)` (bar.sync): in every block of the chunk that reaches it, exactly `n`
  threads must be active (all lanes of a statement run together, so this is the whole set that
  synchronizes); it then closes a race epoch for those blocks like `__syncthreads()`. The model
  is coarse in one way: the epoch closes for the whole block, so a thread outside the barrier's
  set whose stores race with it would not be reported (the producer warpgroup of the TMA ring
  stores nothing with ordinary stores).
- `TensorMapPrefetch` (prefetch.tensormap) is a hint to the TMA unit's descriptor cache: it
  changes nothing here.
- At the end of the kernel a store group that still reads shared memory (no wait_group.read 0
  after it) is a RaceError: the block's shared memory may be gone before the TMA unit read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ...ir.errors import DivergenceError, RaceError, TeccError, UninitializedReadError
from ...ir.stmt import NAMED_BARRIERS, Instruction, TensorStore
from ...ir.tma_stmt import merged_geometry
from .expr_compiler import Scope, compile_expr, compile_indices
from .memory import NEVER_WRITTEN, SAME_VALUE_WRITERS, SharedMemory, check_bounds, flat_index
from .memory_intrinsics import note_barrier
from .state import LaneState

Runner = Callable[[LaneState], None]


@dataclass
class _Read:
    """One store's read of shared memory, in flight until its group is waited for."""

    mem: SharedMemory
    keys: np.ndarray
    where: str


@dataclass
class BulkStores:
    """Per issuing lane: its open group and its committed groups, oldest first."""

    open: dict[int, list[_Read]] = field(default_factory=dict)
    committed: dict[int, list[list[_Read]]] = field(default_factory=dict)


def _state(st: LaneState) -> BulkStores:
    from .mbarrier import _state as mbarrier_state  # the bulk stores live beside the barriers (shared by roles)

    state = mbarrier_state(st)
    if state.stores is None:
        state.stores = BulkStores()
    stores: BulkStores = state.stores
    return stores


def _lanes(st: LaneState) -> np.ndarray:
    return np.arange(st.layout.lanes) if st.mask is None else np.flatnonzero(st.mask)


def compile_tensor_store(s: TensorStore, scope: Scope) -> Runner:
    return _compile_tensor_store(s, scope)


# The rows of tecc.ir.instructions that run here.
def compile_commit(s: Instruction, scope: Scope) -> Runner:
    """cp.async.bulk.commit_group."""
    return _commit


def compile_wait(s: Instruction, scope: Scope) -> Runner:
    """cp.async.bulk.wait_group.read n."""
    pending = s.pending
    return lambda st: _wait(st, pending)


def compile_prefetch_tensor_map(s: Instruction, scope: Scope) -> Runner:
    """prefetch.tensormap: no effect on any value (module docstring)."""
    return lambda st: None


def compile_named_barrier(s: Instruction, scope: Scope) -> Runner:
    """bar.sync id, threads."""
    return _named_barrier(s, scope)


def _compile_tensor_store(s: TensorStore, scope: Scope) -> Runner:
    src_slot, dst_slot = scope.buffer_slot(s.src), scope.buffer_slot(s.map.buffer)
    fsrc, fcoords = compile_indices(s.src_indices, scope), compile_indices(s.coords, scope)
    n = s.bytes // s.src.dtype.bytes
    # element k of the box comes from coords + box_coordinates(k) (the box's layout, row-major)
    steps = [np.broadcast_to(c, (n,)) for c in s.map.box_coordinates(np.arange(n))]
    where = f"TMA store {s.src.name} -> {s.map.buffer.name}"

    def run(st: LaneState) -> None:
        lanes = _lanes(st)
        src, dst = st.mems[src_slot], st.mems[dst_slot]
        sidx = fsrc(st)
        if st.checks:
            check_bounds(st, "TMA store load", "shared", src.name, src.shape, sidx, tuple(range(len(sidx))))
        start = np.broadcast_to(np.asarray(flat_index(sidx, src.strides)), (st.layout.lanes,))[lanes]
        coords = [np.broadcast_to(np.asarray(c), (st.layout.lanes,))[lanes] for c in fcoords(st)]
        if st.checks and ((start + n > src.size) | (start < 0)).any():
            raise TeccError(f"{where} in kernel {st.kernel}: the {s.bytes}-byte box leaves {src.name}")
        state = _state(st)
        # the map's dimensions: runs of the array's merged (TensorMap.merge; the launch checked
        # that their strides chain)
        shape, strides = merged_geometry(s.map.spans, dst.shape, dst.strides)
        for i, lane in enumerate(lanes):
            at = [int(c[i]) + steps[d] for d, c in enumerate(coords)]
            inside = np.ones(n, dtype=bool)
            offset = np.zeros(n, dtype=np.int64)
            for d, a in enumerate(at):
                inside &= (a >= 0) & (a < shape[d])
                offset += np.where(inside, a, 0) * strides[d]
            logical = start[i] + np.arange(n)[inside]
            physical = logical if src.layout is None else src.layout.apply(logical)
            keys = src.base[lane] + physical
            if st.checks:
                _check_read(st, src, keys, int(lane), where)
            dst.flat[offset[inside] + dst.origin] = src.data[keys]
            if src.bulk_reading is None:
                src.bulk_reading = np.zeros(src.data.size, dtype=np.int32)
            src.bulk_reading[keys] += 1
            state.open.setdefault(int(lane), []).append(_Read(src, keys, where))

    return run


def _check_read(st: LaneState, src: SharedMemory, keys: np.ndarray, lane: int, where: str) -> None:
    at = f"{where} in kernel {st.kernel} at {st.layout.where(lane)}"
    if src.pending is not None and (src.pending[keys] > 0).any():
        raise RaceError(f"{at}: reads shared memory an asynchronous copy is still writing")
    w = src.writer[keys]
    if (w == NEVER_WRITTEN).any():
        raise UninitializedReadError(f"{at}: reads staging elements nothing wrote")
    tid = int(st.layout.lane_thread[lane])
    if (((w >= 0) & (w != tid)) | (w == SAME_VALUE_WRITERS)).any():
        raise RaceError(f"{at}: reads shared memory other threads stored since the last barrier; a barrier among "
                        "the writers (bar.sync) between their stores and the store's issue")
    if src.unfenced:
        raise RaceError(f"{at}: reads shared memory written by ordinary stores with no fence.proxy.async after "
                        "them; the TMA store reads through the async proxy and needs that fence (then a barrier)")
    src.read_log.append((keys, np.full(keys.size, tid, dtype=np.int32)))
    src.logged += keys.size


def _commit(st: LaneState) -> None:
    state = _state(st)
    for lane in _lanes(st):
        group = state.open.pop(int(lane), [])
        state.committed.setdefault(int(lane), []).append(group)


def _wait(st: LaneState, pending: int) -> None:
    state = _state(st)
    for lane in _lanes(st):
        groups = state.committed.get(int(lane), [])
        while len(groups) > pending:
            for r in groups.pop(0):
                assert r.mem.bulk_reading is not None
                np.add.at(r.mem.bulk_reading, r.keys, -1)


def _named_barrier(s: Instruction, scope: Scope) -> Runner:
    fid = compile_expr(s.id, scope)

    def run(st: LaneState) -> None:
        lay = st.layout
        mask = np.ones(lay.lanes, dtype=bool) if st.mask is None else st.mask
        ids = np.broadcast_to(np.asarray(fid(st)), (lay.lanes,))
        for bid in np.unique(ids[mask]):
            if not 1 <= int(bid) < NAMED_BARRIERS:
                raise TeccError(f"bar.sync in kernel {st.kernel}: barrier id {int(bid)} is not in 1..{NAMED_BARRIERS - 1}")
            per_block = (mask & (ids == bid)).reshape(lay.blocks, lay.threads).sum(axis=1)
            bad = (per_block != 0) & (per_block != s.threads)
            if bad.any():
                b = int(np.argmax(bad))
                raise DivergenceError(
                    f"bar.sync {int(bid)}, {s.threads} in kernel {st.kernel}: block {lay.block_of(b * lay.threads)} "
                    f"reaches it with {int(per_block[b])} threads; exactly {s.threads} must arrive (the others "
                    "would never come: a deadlock)")
        for mem in st.live_shared:
            mem.barrier(st)
        note_barrier(st)

    return run


def finish_bulk_stores(st: LaneState) -> None:
    """RaceError if a TMA store group of this chunk still reads shared memory at the end."""
    state = st.mbarriers
    stores = None if state is None else state.stores
    if stores is None:
        return
    for groups in (list(stores.open.values()), *stores.committed.values()):
        for group in groups:
            for r in group:
                if r.mem.bulk_reading is not None and (r.mem.bulk_reading[r.keys] > 0).any():
                    raise RaceError(f"{r.where} in kernel {st.kernel}: the store still reads shared memory when the "
                                    "kernel ends; cp.async.bulk.wait_group.read 0 after its commit")
