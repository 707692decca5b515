"""cp.async under the emulator: copies that land at the wait, and the races around them.

- `AsyncCopy` reads its source when it is issued (a GPU may read it any time before the wait;
  a kernel that writes the source in between has a race this does not report) and records,
  per lane, the destination elements and values as *in flight*: the destination's `pending`
  shadow counts copies in flight per element. The predicate-false lanes record zeros (the
  src-size 0 form) and read nothing.
- `AsyncCommit` closes each active lane's open copies into its next group (numbered 1, 2, ...).
- `AsyncWait(n)` lands, in each active lane, every copy of a group at most `committed - n`:
  the values are written, the writer shadow names the issuing thread (so another thread must
  pass a barrier before reading them, as on a GPU) and the pending count drops.
- With checks on, each copy must be one aligned contiguous run in the destination (after its
  layout) and in the source, as the hardware writes it; cp.async writes into a buffer with a
  layout are counted by an active bank-conflict counter.
- With checks on, any access to an element with a copy in flight is a RaceError (state.async_race);
  so is a second copy to it. At the end of the kernel a copy that was never committed, or
  committed but never waited for, is a RaceError too: its data would land at an unknown time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...ir.errors import RaceError, TeccError
from ...ir.stmt import AsyncCopy, Instruction
from .banks import counting, record_access
from .expr_compiler import Scope, compile_expr, compile_indices
from .memory import SharedMemory, check_bounds, flat_index
from .state import LaneState, restrict

Runner = Callable[[LaneState], None]
OPEN = 0  # the group number of a copy not yet committed


@dataclass
class _Copy:
    """The copies one AsyncCopy statement issued in some lanes: `keys` and `values` are
    (lanes, elements); `group[i]` is lane i's group number (OPEN until its commit)."""

    mem: SharedMemory
    lanes: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    group: np.ndarray
    where: str


class AsyncCopies:
    """The copies in flight of one chunk and how many groups each lane committed."""

    def __init__(self, lanes: int) -> None:
        self.committed = np.zeros(lanes, dtype=np.int64)
        self.copies: list[_Copy] = []


def _state(st: LaneState) -> AsyncCopies:
    if st.async_copies is None:
        st.async_copies = AsyncCopies(st.layout.lanes)
    state: AsyncCopies = st.async_copies
    return state


def _active(st: LaneState) -> np.ndarray:
    return np.arange(st.layout.lanes) if st.mask is None else np.flatnonzero(st.mask)


def compile_async_copy(s: AsyncCopy, scope: Scope) -> Runner:
    return _compile_copy(s, scope)


def compile_commit(s: Instruction, scope: Scope) -> Runner:
    """cp.async.commit_group (a row of tecc.ir.instructions)."""
    return _commit


def compile_wait(s: Instruction, scope: Scope) -> Runner:
    """cp.async.wait_group n (a row of tecc.ir.instructions)."""
    pending = s.pending
    return lambda st: _wait(st, pending)


def _element(idx: tuple[Any, ...], src: Any, e: int, along: int = -1) -> tuple[Any, ...]:
    """The index of the element `e` past `idx`. cp.async reads contiguous bytes, so in a row-major
    buffer a copy may run past the end of a row into the next (an implicit GEMM's reduction index
    c·R·S + r·S + s of a KCRS filter): the index carries. A buffer with other strides does not
    carry (the copy must stay in its row; the bounds check says so otherwise)."""
    if not idx:
        return idx
    along %= len(idx)
    if along != len(idx) - 1:   # a transposed view's copy along a dimension of unit stride
        return (*idx[:along], idx[along] + e, *idx[along + 1:])
    shape = tuple(src.shape)
    row_major = tuple(int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape)))
    if e == 0 or tuple(src.strides) != row_major:
        return (*idx[:-1], idx[-1] + e)
    out = list(idx)
    carry: Any = e
    for d in reversed(range(1, len(out))):
        v = out[d] + carry
        out[d], carry = v % shape[d], v // shape[d]
    out[0] = out[0] + carry
    return tuple(out)


def _compile_copy(s: AsyncCopy, scope: Scope) -> Runner:
    dst_slot, src_slot = scope.buffer_slot(s.dst), scope.buffer_slot(s.src)
    fdst, fsrc = compile_indices(s.dst_indices, scope), compile_indices(s.src_indices, scope)
    fpred = compile_expr(s.predicate, scope) if s.predicate is not None else None
    n = s.elements
    where = f"cp.async {s.src.name} -> {s.dst.name}"

    def run(st: LaneState) -> None:
        dst, src = st.mems[dst_slot], st.mems[src_slot]
        if s.unit_stride_at_launch and src.strides[s.along] != 1:
            which = "innermost stride" if s.along % len(src.strides) == len(src.strides) - 1 else \
                f"stride along dimension {s.along % len(src.strides)}"
            raise TeccError(f"{where} in kernel {st.kernel}: the copy assumes a unit {which}, tested at "
                            f"launch, but {s.src.name}'s is {src.strides[s.along]}: the kernel reached the copy "
                            "without the test (a tensorize dispatch bug)")
        lanes = _active(st)
        didx, sidx = fdst(st), fsrc(st)
        pred = fpred(st) if fpred is not None else True
        values = np.zeros((st.layout.lanes, n), dtype=dst.dtype.numpy)
        saved = st.mask
        if isinstance(pred, np.ndarray):
            read_mask = restrict(saved, pred)
            reads = read_mask is None or bool(read_mask.any())
        else:
            read_mask, reads = saved, bool(pred)
        if reads:
            st.mask = read_mask
            try:
                for e in range(n):
                    idx = _element(sidx, src, e, s.along)
                    values[:, e] = np.broadcast_to(src.load(st, idx, tuple(range(len(idx)))), (st.layout.lanes,))
            finally:
                st.mask = saved
            if isinstance(pred, np.ndarray):
                values[~pred] = 0  # the src-size 0 form: zero-fill, nothing read
        keys = np.empty((lanes.size, n), dtype=np.int64)
        for e in range(n):
            idx = (*didx[:-1], didx[-1] + e)
            if st.checks:
                check_bounds(st, "cp.async store", "shared", dst.name, dst.shape, idx, tuple(range(len(idx))))
            keys[:, e] = np.broadcast_to(dst.keys_of(flat_index(idx, dst.strides)), (st.layout.lanes,))[lanes]
        physical = keys - dst.base[lanes][:, None]  # element offsets inside the block's copy
        if st.checks:
            _check_contiguous(st, dst, lanes, physical, didx, _source_offsets(src, sidx), n, where)
            dst.check_async_write(st, didx, lanes, keys)
        if counting() and dst.layout is not None:
            start = np.zeros(st.layout.lanes, dtype=np.int64)
            start[lanes] = physical[:, 0]
            record_access(st, dst.name, start * dst.dtype.bytes, n * dst.dtype.bytes)
        if dst.pending is None:
            dst.pending = np.zeros(dst.data.size, dtype=np.int32)
        np.add.at(dst.pending, keys.reshape(-1), 1)
        _state(st).copies.append(_Copy(dst, lanes, keys, values[lanes], np.full(lanes.size, OPEN), where))

    return run


def _source_offsets(src: Any, sidx: Any) -> Any:
    """The source's flat element offset per lane (for the alignment check)."""
    return flat_index(sidx, src.strides)


def _check_contiguous(st: LaneState, dst: SharedMemory, lanes: np.ndarray, physical: np.ndarray, didx: Any,
                      src_flat: Any, n: int, where: str) -> None:
    """A cp.async writes `n` contiguous elements at one address aligned to its size, and reads
    them from a source address aligned the same way: codegen passes the physical address of the
    first element, so the layout must keep the copy's elements together."""
    src = np.broadcast_to(np.asarray(src_flat), (st.layout.lanes,))[lanes]
    bad = (physical != physical[:, :1] + np.arange(n)).any(axis=1) | (physical[:, 0] % n != 0) | (src % n != 0)
    if bad.any():
        lane = int(lanes[np.argmax(bad)])
        layout = f" under {dst.layout}" if dst.layout is not None else ""
        raise TeccError(
            f"{where} in kernel {st.kernel} at {st.layout.where(lane)}: the {n} elements it copies are not one "
            f"{n * dst.dtype.bytes}-byte-aligned contiguous run in {dst.name}{layout} or in the source; align the "
            "copy to its size (and to the swizzle's chunk)")


def _commit(st: LaneState) -> None:
    state = _state(st)
    active = np.zeros(st.layout.lanes, dtype=bool)
    active[_active(st)] = True
    state.committed[active] += 1
    for c in state.copies:
        closing = (c.group == OPEN) & active[c.lanes]
        c.group[closing] = state.committed[c.lanes[closing]]


def _wait(st: LaneState, pending: int) -> None:
    state = st.async_copies
    if state is None:
        return
    active = np.zeros(st.layout.lanes, dtype=bool)
    active[_active(st)] = True
    limit = state.committed - pending  # per lane: groups up to this number must have landed
    kept: list[_Copy] = []
    for c in state.copies:
        land = (c.group != OPEN) & active[c.lanes] & (c.group <= limit[c.lanes])
        if land.any():
            keys, values = c.keys[land], c.values[land]
            c.mem.data[keys.reshape(-1)] = values.reshape(-1)
            assert c.mem.pending is not None
            np.add.at(c.mem.pending, keys.reshape(-1), -1)
            if st.checks:
                tid = np.repeat(st.layout.lane_thread[c.lanes[land]], keys.shape[1])
                c.mem.writer[keys.reshape(-1)] = tid
            stay = ~land
            c = _Copy(c.mem, c.lanes[stay], c.keys[stay], c.values[stay], c.group[stay], c.where)
        if c.lanes.size:
            kept.append(c)
    state.copies = kept


def finish_async_copies(st: LaneState) -> None:
    """RaceError if a copy of this chunk was never committed or never waited for."""
    state = st.async_copies
    if state is None or not state.copies:
        return
    c = state.copies[0]
    lane = int(c.lanes[0])
    status = "never committed (no cp.async.commit_group after it)" if c.group[0] == OPEN else \
        "committed but never waited for (no cp.async.wait_group covering its group)"
    raise RaceError(
        f"{c.where} in kernel {st.kernel}: the copy issued by {st.layout.where(lane)} is {status} when the kernel "
        "ends; its data would land at an unknown time. Commit it and cp.async.wait_group before using or "
        "leaving the buffer")
