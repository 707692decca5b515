"""The state one chunk of thread blocks runs in, and the errors the emulator raises.

`LaneState` is what every compiled closure receives: variable values by slot, memories by slot,
the active-lane mask, and the lane layout. A mask of None means every lane is active; the
emulator keeps it None whenever it can, because the unmasked paths are the fast ones.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...ir.errors import (
    OutOfBoundsError,
    RaceError,
    TeccError,
    UninitializedReadError,
)
from .lanes import LaneLayout


class LaneState:
    """Everything a compiled kernel body reads and writes while it runs one chunk."""

    __slots__ = ("layout", "mask", "vals", "mems", "checks", "kernel", "live_shared", "fences", "async_copies",
                 "warpgroup", "mbarriers", "roles")

    def __init__(self, layout: LaneLayout, n_vars: int, n_mems: int, checks: bool, kernel: str) -> None:
        self.layout = layout
        self.mask: np.ndarray | None = None
        self.vals: list[Any] = [None] * n_vars
        self.mems: list[Any] = [None] * n_mems
        self.checks = checks
        self.kernel = kernel
        self.live_shared: list[Any] = []  # shared memories in scope, for barrier epochs
        # per lane: are its global stores published before an atomic? (memory_intrinsics.py)
        self.fences: np.ndarray | None = None
        # cp.async copies in flight and each lane's committed groups (async_copy.py)
        self.async_copies: Any = None
        # wgmmas in flight and each lane's committed wgmma groups (warpgroup.py)
        self.warpgroup: Any = None
        # mbarrier states and bulk copies in flight (mbarrier.py)
        self.mbarriers: Any = None
        # (Roles, index) while this state runs one role of a warp-specialized branch (roles.py)
        self.roles: Any = None

    def first_active_lane(self) -> int:
        return 0 if self.mask is None else int(np.argmax(self.mask))

    def active_lanes(self) -> np.ndarray | None:
        """Indices of the active lanes, or None when all are active."""
        return None if self.mask is None else np.flatnonzero(self.mask)


def restrict(mask: np.ndarray | None, cond: np.ndarray) -> np.ndarray | None:
    """The lanes of `mask` where `cond` holds; None (all lanes) when that is every lane."""
    m = cond if mask is None else (mask & cond)
    return None if m.all() else m


def index_at(idx: Sequence[Any], lane: int) -> tuple[int, ...]:
    """The multi-dimensional index a lane used (for error messages)."""
    return tuple(int(v[lane]) if isinstance(v, np.ndarray) else int(v) for v in idx)


def _fmt_index(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(str(i) for i in index)}]"


def out_of_bounds(st: LaneState, access: str, scope: str, name: str, shape: Sequence[int],
                  idx: Sequence[Any], dim: int, lane: int) -> OutOfBoundsError:
    index = index_at(idx, lane)
    lay = st.layout
    err = OutOfBoundsError(
        f"out-of-bounds {access} of {scope} buffer {_fmt_index(name, index)} in kernel {st.kernel}: "
        f"index {index[dim]} of dimension {dim} is outside [0, {shape[dim]}) (shape "
        f"[{', '.join(str(s) for s in shape)}]), at {lay.where(lane)}; check the guard on this access"
    )
    _annotate(err, name, index, lay.block_of(lane), lay.thread_of(lane))
    return err


def uninitialized(st: LaneState, scope: str, name: str, idx: Sequence[Any], lane: int) -> UninitializedReadError:
    index = index_at(idx, lane)
    lay = st.layout
    err = UninitializedReadError(
        f"read of uninitialized {scope} memory {_fmt_index(name, index)} in kernel {st.kernel} at "
        f"{lay.where(lane)}: nothing wrote this element since the buffer was allocated"
    )
    _annotate(err, name, index, lay.block_of(lane), lay.thread_of(lane))
    return err


def race(st: LaneState, kind: str, name: str, idx: Sequence[Any], lane: int, other_thread: int) -> RaceError:
    """A shared-memory race: `kind` is read-after-write, write-after-write or write-after-read;
    `other_thread` is the linear id of the other thread in the block, or -2 for several threads."""
    index = index_at(idx, lane)
    lay = st.layout
    me = lay.thread_of(lane)
    other = "several other threads" if other_thread < 0 else f"thread {lay.thread_coords(other_thread)}"
    action = {
        "read-after-write": f"thread {me} reads what {other} wrote",
        "write-after-write": f"thread {me} and {other} write different values",
        "write-after-read": f"thread {me} overwrites what {other} read",
    }[kind]
    err = RaceError(
        f"shared-memory race ({kind}) on {_fmt_index(name, index)} in kernel {st.kernel}, block "
        f"{lay.block_of(lane)}: {action} with no __syncthreads() between; add a barrier"
    )
    _annotate(err, name, index, lay.block_of(lane), me)
    err.other_thread = None if other_thread < 0 else lay.thread_coords(other_thread)  # type: ignore[attr-defined]
    return err


def async_race(st: LaneState, name: str, idx: Sequence[Any], lane: int) -> RaceError:
    """A read or write of a shared element that a cp.async copy may still be writing."""
    index = index_at(idx, lane)
    lay = st.layout
    err = RaceError(
        f"cp.async race on {_fmt_index(name, index)} in kernel {st.kernel}, block {lay.block_of(lane)}: thread "
        f"{lay.thread_of(lane)} accesses it while an asynchronous copy into it is still in flight; commit a cp.async "
        "copy's group and cp.async.wait_group it (then __syncthreads() if other threads read it), or wait on the "
        "mbarrier a cp.async.bulk copy completes, before the access"
    )
    _annotate(err, name, index, lay.block_of(lane), lay.thread_of(lane))
    return err


def bulk_store_race(st: LaneState, name: str, idx: Sequence[Any], lane: int) -> RaceError:
    """A write of a shared element that a TMA store may still be reading."""
    index = index_at(idx, lane)
    lay = st.layout
    err = RaceError(
        f"TMA store race on {_fmt_index(name, index)} in kernel {st.kernel}, block {lay.block_of(lane)}: thread "
        f"{lay.thread_of(lane)} overwrites it while a TMA store (cp.async.bulk.tensor) may still be reading it; the "
        "issuing thread's cp.async.bulk.wait_group.read, then a barrier, before the write"
    )
    _annotate(err, name, index, lay.block_of(lane), lay.thread_of(lane))
    return err


def wgmma_operand_race(st: LaneState, name: str, idx: Sequence[Any], lane: int) -> RaceError:
    """A write of a shared element that a wgmma still in flight may be reading as A or B."""
    index = index_at(idx, lane)
    lay = st.layout
    err = RaceError(
        f"wgmma operand race on {_fmt_index(name, index)} in kernel {st.kernel}, block {lay.block_of(lane)}: thread "
        f"{lay.thread_of(lane)} writes it while a wgmma that reads it is still in flight; wgmma.wait_group that "
        "wgmma (and __syncthreads()) before refilling its operands")
    _annotate(err, name, index, lay.block_of(lane), lay.thread_of(lane))
    return err


def _annotate(err: TeccError, buffer: str, index: tuple[int, ...], block: tuple[int, int, int],
              thread: tuple[int, int, int]) -> None:
    # Tests and tools read these rather than parsing the message.
    err.buffer = buffer  # type: ignore[attr-defined]
    err.index = index  # type: ignore[attr-defined]
    err.block = block  # type: ignore[attr-defined]
    err.thread = thread  # type: ignore[attr-defined]
