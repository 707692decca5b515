"""Shared-memory bank conflicts, counted while a `count_bank_conflicts()` block is active.

Shared memory has 32 banks of 4-byte words; a bank serves one word per cycle. One warp access
is split into phases of at most 128 bytes (all 32 lanes for accesses up to 4 bytes per lane,
16 lanes for 8 bytes, 8 lanes for 16 bytes: one ldmatrix 8 x 8 matrix is one phase). A phase
takes as many wavefronts as the largest number of *distinct* words any one bank must deliver
(lanes reading the same word share it); every wavefront beyond the first is a conflict.

Counted: ldmatrix reads, cp.async copies, and plain loads and stores of every shared buffer
(through its layout, tecc.ir.layout, where it has one), so a test can show what a swizzle or a
padded row buys. A plain access is counted per element, except inside a `vectorize` loop of
W iterations (`vector_group`): there the k-th access of every iteration is taken together, and
when in every active lane iteration i's address is iteration 0's plus i elements, iteration 0's
is a multiple of the W elements' bytes and those are 4, 8 or 16 bytes of elements of at most
4 bytes, they count as the one wide access the CUDA emitter makes of them (codegen/vectorize.py:
a 16-byte copy into a tile is an STS.128, served in quarter-warp phases). The emitter proves
that alignment from the offsets; the emulator sees it in the addresses of the run.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from .lanes import WARP_SIZE
from .state import LaneState

BANKS = 32
BANK_BYTES = 4
PHASE_BYTES = BANKS * BANK_BYTES


class BankConflicts:
    """Per shared buffer: `requests` (warp phases), `wavefronts` and `conflicts` (extra wavefronts),
    and `widths`: the bytes per lane of the accesses seen (16 for a 16-byte cp.async, 2 for a
    half stored alone: which form filled a tile)."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = defaultdict(int)
        self.wavefronts: dict[str, int] = defaultdict(int)
        self.widths: dict[str, set[int]] = defaultdict(set)

    def conflicts(self, buffer: str) -> int:
        return self.wavefronts[buffer] - self.requests[buffer]

    def record(self, st: LaneState, buffer: str, byte_address: np.ndarray, width: int,
               lanes_used: int = WARP_SIZE) -> None:
        """Count one warp-wide access: lane L of each warp touches `width` bytes at
        byte_address[L] (offsets inside the block's copy of the buffer); only the first
        `lanes_used` lanes of each warp take part (ldmatrix.x1 / .x2 use 8 / 16)."""
        self.widths[buffer].add(width)
        threads = st.layout.threads
        if threads % WARP_SIZE:
            return  # a partial warp: the emulator reports warp-collective use of it elsewhere
        addr = np.broadcast_to(np.asarray(byte_address, dtype=np.int64), (st.layout.lanes,)).reshape(-1, WARP_SIZE)
        active = np.ones(addr.shape, dtype=bool) if st.mask is None else st.mask.reshape(-1, WARP_SIZE)
        addr, active = addr[:, :lanes_used], active[:, :lanes_used]
        per_phase = max(1, min(lanes_used, PHASE_BYTES // max(width, BANK_BYTES)))
        words_per_lane = max(1, width // BANK_BYTES)
        words = (addr // BANK_BYTES)[..., None] + np.arange(words_per_lane)  # (warps, lanes, words)
        words = np.where(active[..., None], words, -1).reshape(addr.shape[0], -1, per_phase * words_per_lane)
        keep = (words >= 0).any(axis=-1)  # phases with at least one active lane
        words = words[keep]
        if words.size == 0:
            return
        words = np.sort(words, axis=-1)
        first = np.ones(words.shape, dtype=bool)
        first[:, 1:] = words[:, 1:] != words[:, :-1]
        distinct = first & (words >= 0)
        banks = np.where(distinct, words % BANKS, BANKS)  # BANKS: a slot to drop
        per_bank = np.zeros((words.shape[0], BANKS + 1), dtype=np.int64)
        np.add.at(per_bank, (np.arange(words.shape[0])[:, None], banks), 1)
        self.requests[buffer] += int(words.shape[0])
        self.wavefronts[buffer] += int(per_bank[:, :BANKS].max(axis=1).sum())


_ACTIVE: list[BankConflicts] = []
_GROUPS: list["_VectorGroup"] = []
VECTOR_BYTES = (4, 8, 16)  # the wide accesses the emitter makes of a vectorize loop


class _Lanes:
    """What `BankConflicts.record` reads of a LaneState, kept as it was at one access."""

    __slots__ = ("layout", "mask")

    def __init__(self, st: LaneState) -> None:
        self.layout = st.layout
        self.mask = None if st.mask is None else st.mask.copy()


class _VectorGroup:
    """The plain shared accesses of one run of a `vectorize` loop, by iteration."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.iterations: list[list[tuple[_Lanes, str, np.ndarray, int]]] = []

    def next_iteration(self) -> None:
        self.iterations.append([])

    def add(self, st: LaneState, buffer: str, byte_address: Any, width: int) -> None:
        self.iterations[-1].append((_Lanes(st), buffer, np.broadcast_to(np.asarray(byte_address, dtype=np.int64),
                                                                      (st.layout.lanes,)), width))

    def flush(self) -> None:
        """Record the group: each access site as one wide access where it is one, else per element."""
        complete = len(self.iterations) == self.width and len({len(it) for it in self.iterations}) == 1
        for site in range(len(self.iterations[0]) if complete else 0):
            accesses = [it[site] for it in self.iterations]
            wide = self._wide(accesses)
            if wide is not None:
                record_access(accesses[0][0], accesses[0][1], accesses[0][2], wide)  # type: ignore[arg-type]
            else:
                for lanes, buffer, address, width in accesses:
                    record_access(lanes, buffer, address, width)  # type: ignore[arg-type]
        if not complete:
            for it in self.iterations:
                for lanes, buffer, address, width in it:
                    record_access(lanes, buffer, address, width)  # type: ignore[arg-type]

    def _wide(self, accesses: list[tuple[_Lanes, str, np.ndarray, int]]) -> int | None:
        lanes0, buffer, base, element = accesses[0]
        wide = element * len(accesses)
        if element > 4 or wide not in VECTOR_BYTES:
            return None
        active = np.ones(base.shape, dtype=bool) if lanes0.mask is None else lanes0.mask
        for k, (lanes, name, address, size) in enumerate(accesses):
            same_lanes = (lanes.mask is None and lanes0.mask is None) or (
                lanes.mask is not None and lanes0.mask is not None and np.array_equal(lanes.mask, lanes0.mask))
            if name != buffer or size != element or not same_lanes:
                return None
            if not np.array_equal(address[active], base[active] + k * element):
                return None
        return wide if not (base[active] % wide).any() else None


@contextmanager
def vector_group(width: int) -> Iterator[_VectorGroup | None]:
    """Around the run of a `vectorize` loop of `width` iterations (None when nothing counts):
    call `next_iteration()` before each iteration's body; the accesses are recorded at the end."""
    if not _ACTIVE:
        yield None
        return
    group = _VectorGroup(width)
    _GROUPS.append(group)
    try:
        yield group
    finally:
        _GROUPS.remove(group)
    group.flush()


@contextmanager
def count_bank_conflicts() -> Iterator[BankConflicts]:
    """`with count_bank_conflicts() as banks: simulate_kernel(...)`, then `banks.conflicts("As")`."""
    counter = BankConflicts()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)


def counting() -> bool:
    return bool(_ACTIVE)


def record_access(st: LaneState, buffer: str, byte_address: Any, width: int, lanes_used: int = WARP_SIZE) -> None:
    for counter in _ACTIVE:
        counter.record(st, buffer, byte_address, width, lanes_used)


def note_shared_access(st: LaneState, mem: Any, physical: Any) -> None:
    """A plain load or store of a shared buffer (`physical`: element offsets through its layout)."""
    if _ACTIVE:
        if _GROUPS and _GROUPS[-1].iterations:
            _GROUPS[-1].add(st, mem.name, np.asarray(physical) * mem.dtype.bytes, mem.dtype.bytes)
        else:
            record_access(st, mem.name, np.asarray(physical) * mem.dtype.bytes, mem.dtype.bytes)
