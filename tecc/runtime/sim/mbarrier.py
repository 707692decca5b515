"""mbarriers and bulk copies under the emulator.

Every mbarrier (one element of an int64 shared buffer, per block) has an expected arrival
count, the arrivals still missing in the current phase, a transaction count (bytes) and the
number of phases completed. The statements run in lockstep like all others:

- `BarrierInit` (per active lane; several lanes initializing one barrier must agree) sets the
  count and clears the rest. Any other use of a barrier nothing initialized is a TeccError.
- `BarrierArrive` counts one arrival per active lane; `BarrierExpectTx` first adds its bytes to
  the transaction count. A phase completes when no arrival is missing and no byte is pending:
  the phase number goes up and the arrivals are re-armed. Arrivals beyond a phase's count go to
  the next phase.
- `BulkCopy` reads its source when issued and is *in flight* (the destination's `pending`
  shadow, as for cp.async: any access to it is a RaceError) until a `BarrierWait` on its
  barrier; then its bytes land (written by no thread of this epoch: the mbarrier wait is what
  makes them visible) and complete as many transactions.
- `BarrierWait(bar, parity)` first lands the bulk copies of that barrier, then needs, in every
  active lane, the phase of that parity completed (current phase's parity differs). If not:
  when the whole block is waiting, nothing can ever arrive, and it is a DeadlockError naming
  the barrier and the phase; likewise when no statement of the kernel arrives on that barrier
  buffer at all (a warp-specialized ring whose release was forgotten). When only part of the
  block waits and other threads could still arrive later in program order (warp specialization
  whose other part comes later in the program text) the lockstep emulator cannot run it and
  says so.
- `TensorCopy` (TMA) is a bulk copy of a box: the issuing lane's coordinates select the box,
  elements outside the tensor are zeros, the box lands in row-major order through the
  destination's layout (the swizzle the tensor map writes), and it completes the box's full
  byte count on its barrier, like a `BulkCopy`.
- At the end of the kernel a bulk copy still in flight is a RaceError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...ir.errors import DeadlockError, OutOfBoundsError, RaceError, TeccError
from ...ir.stmt import BarrierArrive, BarrierExpectTx, BarrierRef, BulkCopy, Instruction, Stmt, TensorCopy, iter_stmts
from ...ir.tma_stmt import merged_geometry
from .expr_compiler import Scope, compile_expr, compile_indices
from .memory import NOT_THIS_EPOCH, SharedMemory, check_bounds, flat_index
from .state import LaneState

Runner = Callable[[LaneState], None]


@dataclass
class _Barrier:
    count: int
    missing: int
    tx: int = 0
    phase: int = 0


@dataclass
class _BulkCopy:
    mem: SharedMemory
    keys: np.ndarray
    values: np.ndarray
    bar_id: int
    bar_key: int
    bytes: int
    where: str


@dataclass
class MbarrierState:
    """Barriers by (id of their SharedMemory, key in its data) and the bulk copies in flight."""

    barriers: dict[tuple[int, int], _Barrier] = field(default_factory=dict)
    copies: list[_BulkCopy] = field(default_factory=list)
    events: int = 0   # arrivals, copies issued and landed so far (roles.py: has anything changed?)
    stores: Any = None  # TMA stores' bulk groups (bulk_store.py), shared by roles like the barriers


def _state(st: LaneState) -> MbarrierState:
    if st.mbarriers is None:
        st.mbarriers = MbarrierState()
    state: MbarrierState = st.mbarriers
    return state


def _lanes(st: LaneState) -> np.ndarray:
    return np.arange(st.layout.lanes) if st.mask is None else np.flatnonzero(st.mask)


class _Ref:
    """A compiled BarrierRef: each active lane's barrier key."""

    def __init__(self, ref: BarrierRef, scope: Scope) -> None:
        self.ref = ref
        self.slot = scope.buffer_slot(ref.buffer)
        self.index = compile_expr(ref.index, scope)

    def keys(self, st: LaneState, lanes: np.ndarray) -> tuple[SharedMemory, np.ndarray]:
        mem: SharedMemory = st.mems[self.slot]
        idx = (self.index(st),)
        if st.checks:
            check_bounds(st, "mbarrier access", "shared", mem.name, mem.shape, idx, (0,))
        keys = np.broadcast_to(mem.keys_of(flat_index(idx, mem.strides)), (st.layout.lanes,))[lanes]
        return mem, keys

    def get(self, st: LaneState, mem: SharedMemory, key: int, what: str) -> _Barrier:
        bar = _state(st).barriers.get((id(mem), key))
        if bar is None:
            raise TeccError(f"{what} in kernel {st.kernel}: mbarrier {mem.name}[{key % mem.size}] "
                            "was never initialized (mbarrier.init, then __syncthreads(), before any use)")
        return bar


def _arrive(bar: _Barrier, arrivals: int, tx: int) -> int:
    """Count `arrivals` (after adding `tx` bytes); arrivals past a completed phase go to the next.
    Returns the arrivals that found no phase to count in (all arrived, bytes still pending)."""
    bar.tx += tx
    while arrivals and bar.missing:
        take = min(arrivals, bar.missing)
        bar.missing -= take
        arrivals -= take
        _maybe_complete(bar)
    return arrivals


def _maybe_complete(bar: _Barrier) -> None:
    if bar.missing == 0 and bar.tx == 0:
        bar.phase += 1
        bar.missing = bar.count


def compile_copy(s: BulkCopy | TensorCopy, scope: Scope) -> Runner:
    """A bulk copy or a TMA tile copy, landing at the wait on its barrier."""
    if isinstance(s, BulkCopy):
        return _compile_bulk_copy(s, scope)
    return _compile_tensor_copy(s, scope)


# The mbarrier rows of tecc.ir.instructions.
def compile_init(s: Instruction, scope: Scope) -> Runner:
    """mbarrier.init: per active lane; lanes initializing one barrier must agree on the count."""
    ref = _Ref(s.bar, scope)
    fcount = compile_expr(s.count, scope)

    def init(st: LaneState) -> None:
        lanes = _lanes(st)
        mem, keys = ref.keys(st, lanes)
        counts = np.broadcast_to(np.asarray(fcount(st)), (st.layout.lanes,))[lanes]
        for key in np.unique(keys):
            values = np.unique(counts[keys == key])
            if values.size > 1:
                raise TeccError(f"mbarrier.init in kernel {st.kernel}: threads initialize barrier {s.bar} with "
                                f"different counts {values.tolist()}")
            _state(st).barriers[(id(mem), int(key))] = _Barrier(int(values[0]), int(values[0]))

    return init


def compile_arrive(s: Instruction, scope: Scope) -> Runner:
    """mbarrier.arrive and mbarrier.arrive.expect_tx: one arrival per active lane, after adding
    the bytes the phase now also waits for."""
    ref = _Ref(s.bar, scope)
    fbytes = compile_expr(s.bytes, scope) if s.name == "mbarrier.arrive.expect_tx" else None
    what = "mbarrier.arrive" + (".expect_tx" if fbytes is not None else "") + f" on {s.bar}"

    def arrive(st: LaneState) -> None:
        lanes = _lanes(st)
        mem, keys = ref.keys(st, lanes)
        nbytes = np.zeros(lanes.size, dtype=np.int64) if fbytes is None else \
            np.broadcast_to(np.asarray(fbytes(st)), (st.layout.lanes,))[lanes]
        uniq, counts = np.unique(keys, return_counts=True)
        _state(st).events += 1
        for key, arrivals in zip(uniq, counts):
            bar = ref.get(st, mem, int(key), what)
            if _arrive(bar, int(arrivals), int(nbytes[keys == key].sum())):
                raise TeccError(f"{what} in kernel {st.kernel}: more arrivals than mbarrier.init's count "
                                f"({bar.count}) while the phase still waits for {bar.tx} transaction bytes")

    return arrive


def compile_wait(s: Instruction, scope: Scope) -> Runner:
    """mbarrier.try_wait.parity: lands the bulk copies of the barrier, then needs the phase."""
    ref = _Ref(s.bar, scope)
    fparity = compile_expr(s.parity, scope)
    bar_text = str(s.bar)
    never_arrived = id(s.bar.buffer) not in scope.arrived_barriers

    def blocked(st: LaneState) -> tuple[int, str, bool] | None:
        """None when every active lane may pass; else (a waiting lane, what is missing, whether
        its whole block waits)."""
        lanes = _lanes(st)
        mem, keys = ref.keys(st, lanes)
        parity = np.broadcast_to(np.asarray(fparity(st)), (st.layout.lanes,))[lanes]
        state = _state(st)
        for key in np.unique(keys):
            _land(st, state, mem, int(key))
        for key in np.unique(keys):
            bar = ref.get(st, mem, int(key), f"mbarrier wait on {bar_text}")
            waiting = (keys == key) & (parity == bar.phase % 2)
            if not waiting.any():
                continue
            lane = int(lanes[np.argmax(waiting)])
            missing = (f"phase {bar.phase} (parity {bar.phase % 2}) to complete, but {bar.missing} of {bar.count} "
                       f"arrivals and {bar.tx} transaction bytes are missing")
            block = st.layout.lane_block == st.layout.lane_block[lane]
            active = np.zeros(st.layout.lanes, dtype=bool)
            active[lanes] = True
            return lane, missing, bool(active[block].all())
        return None

    def wait(st: LaneState) -> None:
        while True:
            found = blocked(st)
            if found is None:
                return
            lane, missing, whole_block = found
            roles = st.roles
            if roles is not None and not never_arrived and roles[0].stop_at_wait(roles[1]):
                continue  # another role ran: check again
            if whole_block or never_arrived or roles is not None:
                who = ("every thread of the block waits" if whole_block else
                       f"{st.layout.where(lane)} waits (no statement of the kernel arrives on {s.bar.buffer.name})"
                       if never_arrived else
                       f"{st.layout.where(lane)} waits and no other role of the warp-specialized branch can make "
                       "progress")
                raise DeadlockError(
                    f"mbarrier wait on {bar_text} in kernel {st.kernel}, block {st.layout.block_of(lane)}: {who} "
                    f"for {missing} and nothing in flight can supply them; the kernel would hang. Check the arrival "
                    "count of mbarrier.init, the bytes of expect_tx, the arrivals that release the barrier, and the "
                    "parity waited for")
            raise TeccError(
                f"mbarrier wait on {bar_text} in kernel {st.kernel} at {st.layout.where(lane)}: waits for {missing} "
                "while only part of the block waits; the emulator runs the threads in lockstep in program order, so "
                "the arrivals must come before the wait in the program text (or in the other branch of a "
                "warp-specialized if whose both branches wait on mbarriers: those run as roles, roles.py)")

    return wait


def barrier_events(st: LaneState) -> int:
    """How many arrivals and copies the chunk's barriers have seen (roles.py)."""
    return _state(st).events


def arrived_barriers(body: Stmt) -> set[int]:
    """Ids of the barrier buffers that some statement of `body` arrives on or completes bytes on."""
    return {id(s.bar.buffer) for s in iter_stmts(body)
            if isinstance(s, (BarrierArrive, BarrierExpectTx, BulkCopy, TensorCopy))}


def _land(st: LaneState, state: MbarrierState, bar_mem: SharedMemory, key: int) -> None:
    """Land the bulk copies in flight that complete on barrier `key` of `bar_mem`."""
    kept: list[_BulkCopy] = []
    for c in state.copies:
        if c.bar_id != id(bar_mem) or c.bar_key != key:
            kept.append(c)
            continue
        c.mem.data[c.keys] = c.values
        assert c.mem.pending is not None
        np.add.at(c.mem.pending, c.keys, -1)
        if st.checks:
            c.mem.writer[c.keys] = NOT_THIS_EPOCH
        bar = state.barriers[(id(bar_mem), key)]
        state.events += 1
        bar.tx -= c.bytes
        _maybe_complete(bar)
    state.copies = kept


def _compile_bulk_copy(s: BulkCopy, scope: Scope) -> Runner:
    ref = _Ref(s.bar, scope)
    dst_slot, src_slot = scope.buffer_slot(s.dst), scope.buffer_slot(s.src)
    fdst, fsrc = compile_indices(s.dst_indices, scope), compile_indices(s.src_indices, scope)
    n = s.elements
    where = f"cp.async.bulk {s.src.name} -> {s.dst.name}"

    def run(st: LaneState) -> None:
        lanes = _lanes(st)
        dst, src = st.mems[dst_slot], st.mems[src_slot]
        bar_mem, bar_keys = ref.keys(st, lanes)
        didx, sidx = fdst(st), fsrc(st)
        if st.checks:
            check_bounds(st, "cp.async.bulk store", "shared", dst.name, dst.shape, didx, tuple(range(len(didx))))
        start_src = np.broadcast_to(np.asarray(flat_index(sidx, src.strides) + src.origin), (st.layout.lanes,))[lanes]
        start_dst = np.broadcast_to(dst.keys_of(flat_index(didx, dst.strides)), (st.layout.lanes,))[lanes]
        elem = dst.dtype.bytes
        if st.checks:
            physical = start_dst - dst.base[lanes]
            if ((physical * elem) % 16).any() or ((start_src * elem) % 16).any():
                raise TeccError(f"{where} in kernel {st.kernel}: both addresses must be 16-byte aligned")
            if (physical + n > dst.size).any() or (start_src < 0).any() or (start_src + n > src.flat.size).any():
                raise OutOfBoundsError(f"{where} in kernel {st.kernel}: the {s.bytes} bytes copied leave the source "
                                       "or the destination")
        state = _state(st)
        for i, lane in enumerate(lanes):
            keys = start_dst[i] + np.arange(n)
            if st.checks:
                if dst.wgmma_reading is not None and (dst.wgmma_reading[keys] > 0).any():
                    raise RaceError(f"{where} in kernel {st.kernel} at {st.layout.where(int(lane))}: overwrites the "
                                    "operand of a wgmma still in flight; wgmma.wait_group it first")
                if dst.pending is not None and (dst.pending[keys] > 0).any():
                    raise RaceError(f"{where} in kernel {st.kernel} at {st.layout.where(int(lane))}: writes shared "
                                    "memory another asynchronous copy is still writing")
                w = dst.writer[keys]
                if (w >= 0).any():
                    raise RaceError(f"{where} in kernel {st.kernel} at {st.layout.where(int(lane))}: overwrites what "
                                    "threads stored since the last barrier")
            values = src.flat[start_src[i] + np.arange(n)].copy()
            if dst.pending is None:
                dst.pending = np.zeros(dst.data.size, dtype=np.int32)
            dst.pending[keys] += 1
            state.copies.append(_BulkCopy(dst, keys, values, id(bar_mem), int(bar_keys[i]), s.bytes, where))
            state.events += 1

    return run


def _check_async_destination(st: LaneState, dst: SharedMemory, keys: np.ndarray, lane: int, where: str) -> None:
    if dst.wgmma_reading is not None and (dst.wgmma_reading[keys] > 0).any():
        raise RaceError(f"{where} in kernel {st.kernel} at {st.layout.where(lane)}: overwrites the operand of a "
                        "wgmma still in flight; wgmma.wait_group it first")
    if dst.pending is not None and (dst.pending[keys] > 0).any():
        raise RaceError(f"{where} in kernel {st.kernel} at {st.layout.where(lane)}: writes shared memory another "
                        "asynchronous copy is still writing")
    if (dst.writer[keys] >= 0).any():
        raise RaceError(f"{where} in kernel {st.kernel} at {st.layout.where(lane)}: overwrites what threads stored "
                        "since the last barrier")
    if dst.bulk_reading is not None and (dst.bulk_reading[keys] > 0).any():
        raise RaceError(f"{where} in kernel {st.kernel} at {st.layout.where(lane)}: overwrites shared memory a TMA "
                        "store still reads; cp.async.bulk.wait_group.read first")


def _compile_tensor_copy(s: TensorCopy, scope: Scope) -> Runner:
    ref = _Ref(s.bar, scope)
    dst_slot, src_slot = scope.buffer_slot(s.dst), scope.buffer_slot(s.map.buffer)
    fdst, fcoords = compile_indices(s.dst_indices, scope), compile_indices(s.coords, scope)
    n = s.bytes // s.dst.dtype.bytes
    # element k of the box comes from coords + box_coordinates(k) (the box's layout, row-major)
    steps = [np.broadcast_to(c, (n,)) for c in s.map.box_coordinates(np.arange(n))]
    where = f"TMA copy {s.map.buffer.name} -> {s.dst.name}"

    def run(st: LaneState) -> None:
        lanes = _lanes(st)
        dst, src = st.mems[dst_slot], st.mems[src_slot]
        bar_mem, bar_keys = ref.keys(st, lanes)
        didx = fdst(st)
        if st.checks:
            check_bounds(st, "TMA copy store", "shared", dst.name, dst.shape, didx, tuple(range(len(didx))))
        start = np.broadcast_to(np.asarray(flat_index(didx, dst.strides)), (st.layout.lanes,))[lanes]
        coords = [np.broadcast_to(np.asarray(c), (st.layout.lanes,))[lanes] for c in fcoords(st)]
        if st.checks and ((start + n > dst.size) | (start < 0)).any():
            raise OutOfBoundsError(f"{where} in kernel {st.kernel}: the {s.bytes}-byte box leaves {dst.name}")
        state = _state(st)
        # the map's dimensions: runs of the array's merged (TensorMap.merge; the launch checked
        # that their strides chain)
        shape, strides = merged_geometry(s.map.spans, src.shape, src.strides)
        for i, lane in enumerate(lanes):
            logical = start[i] + np.arange(n)
            physical = logical if dst.layout is None else dst.layout.apply(logical)
            keys = dst.base[lane] + physical
            if st.checks:
                _check_async_destination(st, dst, keys, int(lane), where)
            at = [int(c[i]) + steps[d] for d, c in enumerate(coords)]
            inside = np.ones(n, dtype=bool)
            offset = np.zeros(n, dtype=np.int64)
            for d, a in enumerate(at):
                inside &= (a >= 0) & (a < shape[d])
                offset += np.where(inside, a, 0) * strides[d]
            values = np.zeros(n, dtype=dst.data.dtype)
            values[inside] = src.flat[offset[inside] + src.origin]
            if dst.pending is None:
                dst.pending = np.zeros(dst.data.size, dtype=np.int32)
            dst.pending[keys] += 1
            state.copies.append(_BulkCopy(dst, keys, values, id(bar_mem), int(bar_keys[i]), s.bytes, where))
            state.events += 1

    return run


def finish_mbarriers(st: LaneState) -> None:
    """RaceError if a bulk copy of this chunk never landed (no wait on its barrier)."""
    state = st.mbarriers
    if state is None or not state.copies:
        return
    c = state.copies[0]
    raise RaceError(f"{c.where} in kernel {st.kernel}: the copy is still in flight when the kernel ends (no mbarrier "
                    "wait on the barrier it completes); its data would land at an unknown time")

