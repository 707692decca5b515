"""Shared-memory bank conflicts, counted while a `count_bank_conflicts()` block is active.

Shared memory has 32 banks of 4-byte words; a bank serves one word per cycle. One warp access
is split into phases of at most 128 bytes (all 32 lanes for accesses up to 4 bytes per lane,
16 lanes for 8 bytes, 8 lanes for 16 bytes: one ldmatrix 8 x 8 matrix is one phase). A phase
takes as many wavefronts as the largest number of *distinct* words any one bank must deliver
(lanes reading the same word share it); every wavefront beyond the first is a conflict.

Counted: ldmatrix reads, cp.async copies, and plain loads and stores of every shared buffer
(through its layout, tecc.ir.layout, where it has one), so a test can show what a swizzle or a
padded row buys. A plain access is counted per element: a `vectorize` loop's elements count as
one access each, not as the one wide access the emitter makes of them.
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
        record_access(st, mem.name, np.asarray(physical) * mem.dtype.bytes, mem.dtype.bytes)
