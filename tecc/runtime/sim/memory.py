"""Global, shared and local memory of the emulator, with the checks a GPU does not give.

Every memory takes a per-dimension index (each a uniform scalar or a per-lane array) and the
`LaneState`; only active lanes are checked, and masked-off lanes never fault (their flat index
is clipped into range and their result discarded).

- Global: a flat view of the caller's array; element (i0..in) at sum(ik * stride_k).
- Shared: one copy per block of the chunk, one flat array of `blocks * size`; lane l addresses
  its block's copy at `lane_block[l] * size`. With checks on, three shadows per element track
  races the way compute-sanitizer's racecheck does, within one *epoch* (the span between two
  barriers): the thread that wrote it (-1 none, -3 several with the same value), the thread that
  read it (-1 none, -2 several), and whether anything ever wrote it (uninitialized reads).
  A buffer with a layout (tecc.ir.layout) stores logical element o at physical o' = layout(o);
  its accesses are counted by an active bank-conflict counter (banks.py).
- Local: one copy per lane, kept as a list of per-lane columns (one (lanes,) array per element).
  Register tiles are indexed by constants after unrolling, so a load is a list lookup and a
  store rebinds one column. Columns are never mutated in place, so a loaded value stays valid
  after later stores.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...ir.dtype import DType
from ...ir.errors import RaceError
from ...ir.layout import Swizzle
from .banks import note_shared_access
from .numerics import poison
from .state import LaneState, async_race, bulk_store_race, out_of_bounds, race, uninitialized, wgmma_operand_race

Index = Sequence[Any]

# Writer shadow of a shared element, or the linear id (>= 0) of the one thread that wrote it in
# the current epoch.
NEVER_WRITTEN = -4  # nothing wrote it since allocation: a read is an uninitialized read
NOT_THIS_EPOCH = -1  # written before the last barrier
SAME_VALUE_WRITERS = -3  # several threads wrote one value: benign, as racecheck treats it
NO_READER = np.iinfo(np.int32).max  # reader-min shadow of an element nobody read this epoch

def span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from the first to one past the last element of a strided layout."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def row_major(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def flat_index(idx: Index, strides: Sequence[int], wide: bool = False) -> Any:
    f: Any = 0
    for v, s in zip(idx, strides):
        if wide and isinstance(v, np.ndarray):
            v = v.astype(np.int64)
        f = f + (v if s == 1 else v * s)
    return f


def check_bounds(st: LaneState, access: str, scope: str, name: str, shape: Sequence[int],
                 idx: Index, dims: Sequence[int]) -> None:
    """Raise OutOfBoundsError if an active lane's index leaves the buffer in one of `dims`."""
    for d in dims:
        v, n = idx[d], shape[d]
        if isinstance(v, np.ndarray):
            # Fast path: when every lane (active or not) is in range there is nothing to find.
            if n > 0 and v.min() >= 0 and v.max() < n:
                continue
            bad = (v < 0) | (v >= n)
            if st.mask is not None:
                bad &= st.mask
            if bad.any():
                raise out_of_bounds(st, access, scope, name, shape, idx, d, int(np.argmax(bad)))
        elif not 0 <= v < n:
            raise out_of_bounds(st, access, scope, name, shape, idx, d, st.first_active_lane())


def _uniform(v: Any, d: DType) -> Any:
    """A NumPy scalar read from memory, as the emulator holds uniform values."""
    if d.is_float:
        return v
    return bool(v) if d.is_bool else int(v)


class GlobalMemory:
    """A global buffer: a flat, writable view of the caller's storage. `origin`: the flat
    position of element 0 (its lowest-addressed element comes first in `flat`, so an array with
    negative strides has element 0 past the start); element offsets from the strides are
    relative to element 0, as the kernel's pointer arithmetic is."""

    scope = "global"

    def __init__(self, name: str, dtype: DType, flat: np.ndarray, shape: tuple[int, ...],
                 strides: tuple[int, ...], origin: int = 0) -> None:
        self.name, self.dtype, self.flat, self.origin = name, dtype, flat, origin
        self.shape, self.strides = shape, strides
        self.wide = flat.size >= 2**31
        self.last = max(flat.size - 1, 0)

    def load(self, st: LaneState, idx: Index, dims: Sequence[int]) -> Any:
        if st.checks:
            check_bounds(st, "load", "global", self.name, self.shape, idx, dims)
        f = flat_index(idx, self.strides, self.wide) + self.origin
        if isinstance(f, np.ndarray):
            return self.flat.take(f, mode="clip")
        return _uniform(self.flat[min(max(f, 0), self.last)], self.dtype)

    def store(self, st: LaneState, idx: Index, value: Any, dims: Sequence[int]) -> None:
        if st.checks:
            check_bounds(st, "store", "global", self.name, self.shape, idx, dims)
        f = flat_index(idx, self.strides, self.wide) + self.origin
        m = st.mask
        if m is not None:
            f = f[m] if isinstance(f, np.ndarray) else f
            value = value[m] if isinstance(value, np.ndarray) else value
        if not isinstance(f, np.ndarray) and isinstance(value, np.ndarray):
            value = value[-1]  # every active lane writes one address: the last one wins
        np.put(self.flat, f, value, mode="clip")


class SharedMemory:
    """A shared buffer: one copy per block of the chunk, with race and initialization shadows.

    Reads are the hot path (a tiled kernel reads each staged element many times per epoch), so
    a read only gathers the writer shadow and appends its (element, thread) pairs to a log; the
    log is folded into the reader shadows (smallest and largest reading thread per element:
    "read by a thread other than t" is `min != t or max != t`) only when a store needs them.
    In a correctly synchronized kernel the barrier drops the log before any store sees it."""

    scope = "shared"
    LOG_LIMIT = 1 << 22  # pending read entries before the log is folded anyway (bounds memory)

    def __init__(self, st: LaneState, name: str, dtype: DType, shape: tuple[int, ...],
                 strides: tuple[int, ...], layout: Swizzle | None = None) -> None:
        self.name, self.dtype, self.shape, self.strides = name, dtype, shape, strides
        self.layout = layout  # logical -> physical element offset (tecc.ir.layout); None: identity
        # per element: cp.async copies in flight to it (async_copy.py); None until one is issued
        self.pending: np.ndarray | None = None
        # ordinary stores since the last fence.proxy.async (wgmma reads need one; warpgroup.py)
        self.unfenced = False
        # per element: wgmmas in flight that read it; None until one does (warpgroup.py)
        self.wgmma_reading: np.ndarray | None = None
        # per element: TMA stores still reading it (bulk_store.py); None until one does
        self.bulk_reading: np.ndarray | None = None
        self.size = span(shape, strides)
        n = st.layout.blocks * self.size
        self.data = np.full(n, poison(dtype), dtype=dtype.numpy)
        self.base = st.layout.lane_block * self.size
        if st.checks:
            self.writer = np.full(n, NEVER_WRITTEN, dtype=np.int32)
            self.reader_min = np.full(n, NO_READER, dtype=np.int32)
            self.reader_max = np.full(n, -1, dtype=np.int32)
            self.read_log: list[tuple[np.ndarray, np.ndarray]] = []
            self.logged = 0
            self.readers_dirty = False

    def _keys(self, idx: Index) -> np.ndarray:
        return self.keys_of(flat_index(idx, self.strides))

    def keys_of(self, logical: Any) -> np.ndarray:
        """Per-lane positions in `data` of logical flat element offsets (through the layout)."""
        physical = logical if self.layout is None else self.layout.apply(logical)
        keys: np.ndarray = self.base + physical
        return keys

    def load(self, st: LaneState, idx: Index, dims: Sequence[int]) -> Any:
        if st.checks:
            check_bounds(st, "load", "shared", self.name, self.shape, idx, dims)
        key = self._keys(idx)
        note_shared_access(st, self, key - self.base)
        if st.checks:
            self._track_read(st, idx, key)
        return self.data.take(key, mode="clip")

    def load_keys(self, st: LaneState, key: np.ndarray, idx: Index) -> np.ndarray:
        """Read the elements at `key` (from `keys_of`; bounds already checked) with the race and
        initialization checks of a load; `idx` is what an error message shows."""
        if st.checks:
            self._track_read(st, idx, key)
        values: np.ndarray = self.data.take(key, mode="clip")
        return values

    def _track_read(self, st: LaneState, idx: Index, key: np.ndarray) -> None:
        lanes = st.active_lanes()
        k = key if lanes is None else key[lanes]
        tid = st.layout.lane_thread if lanes is None else st.layout.lane_thread[lanes]
        if self.pending is not None and self.pending[k].any():
            i = int(np.argmax(self.pending[k] > 0))
            raise async_race(st, self.name, idx, _lane(lanes, i))
        w = self.writer[k]
        if (w == NEVER_WRITTEN).any():
            raise uninitialized(st, "shared", self.name, idx, _lane(lanes, int(np.argmax(w == NEVER_WRITTEN))))
        bad = (w >= 0) & (w != tid)
        if bad.any():
            i = int(np.argmax(bad))
            raise race(st, "read-after-write", self.name, idx, _lane(lanes, i), int(w[i]))
        self.read_log.append((k, tid))
        self.logged += k.size
        if self.logged > self.LOG_LIMIT:
            self._fold_reads()

    def _fold_reads(self) -> None:
        keys = np.concatenate([k for k, _ in self.read_log])
        tids = np.concatenate([t for _, t in self.read_log])
        np.minimum.at(self.reader_min, keys, tids)
        np.maximum.at(self.reader_max, keys, tids)
        self.read_log.clear()
        self.logged = 0
        self.readers_dirty = True

    def store(self, st: LaneState, idx: Index, value: Any, dims: Sequence[int]) -> None:
        if st.checks:
            check_bounds(st, "store", "shared", self.name, self.shape, idx, dims)
        key = self._keys(idx)
        self.unfenced = True
        note_shared_access(st, self, key - self.base)
        lanes = st.active_lanes()
        k = key if lanes is None else key[lanes]
        if isinstance(value, np.ndarray) and lanes is not None:
            value = value[lanes]
        if st.checks and self.pending is not None and self.pending[k].any():
            raise async_race(st, self.name, idx, _lane(lanes, int(np.argmax(self.pending[k] > 0))))
        if st.checks and self.wgmma_reading is not None and self.wgmma_reading[k].any():
            raise wgmma_operand_race(st, self.name, idx, _lane(lanes, int(np.argmax(self.wgmma_reading[k] > 0))))
        if st.checks and self.bulk_reading is not None and self.bulk_reading[k].any():
            raise bulk_store_race(st, self.name, idx, _lane(lanes, int(np.argmax(self.bulk_reading[k] > 0))))
        if not st.checks:
            np.put(self.data, k, value, mode="clip")
            return
        tid = st.layout.lane_thread if lanes is None else st.layout.lane_thread[lanes]
        self._check_write(st, idx, lanes, k, tid, value)
        self.data[k] = value
        self.writer[k] = tid
        dup = self.writer[k] != tid  # another lane of this statement wrote the same element
        if dup.any():
            differs = dup & (self.data[k] != value)
            if differs.any():
                i = int(np.argmax(differs))
                raise race(st, "write-after-write", self.name, idx, _lane(lanes, i), int(self.writer[k][i]))
            self.writer[k[dup]] = SAME_VALUE_WRITERS

    def check_async_write(self, st: LaneState, idx: Index, lanes: np.ndarray, keys: np.ndarray) -> None:
        """The races of cp.async copies by `lanes` into `keys` ((lanes, elements) positions in
        `data`): a copy still in flight to one of them, or another thread's write or read of it
        in this epoch (async_copy.py; called with checks on)."""
        if self.pending is not None:
            busy = (self.pending[keys] > 0).any(axis=1)
            if busy.any():
                raise async_race(st, self.name, idx, int(lanes[np.argmax(busy)]))
        if self.wgmma_reading is not None:
            busy = (self.wgmma_reading[keys] > 0).any(axis=1)
            if busy.any():
                raise wgmma_operand_race(st, self.name, idx, int(lanes[np.argmax(busy)]))
        if self.read_log:
            self._fold_reads()
        tid = st.layout.lane_thread[lanes]
        for e in range(keys.shape[1]):
            k = keys[:, e]
            w = self.writer[k]
            bad = (w >= 0) & (w != tid)
            if bad.any():
                i = int(np.argmax(bad))
                raise race(st, "write-after-write", self.name, idx, int(lanes[i]), int(w[i]))
            if self.readers_dirty:
                lo, hi = self.reader_min[k], self.reader_max[k]
                bad = (hi >= 0) & ((lo != tid) | (hi != tid))
                if bad.any():
                    i = int(np.argmax(bad))
                    other = int(lo[i]) if lo[i] != tid[i] else int(hi[i])
                    raise race(st, "write-after-read", self.name, idx, int(lanes[i]), other)

    def _check_write(self, st: LaneState, idx: Index, lanes: np.ndarray | None, k: np.ndarray,
                     tid: np.ndarray, value: Any) -> None:
        w = self.writer[k]
        bad = ((w >= 0) | (w == SAME_VALUE_WRITERS)) & (w != tid) & (self.data[k] != value)
        if bad.any():
            i = int(np.argmax(bad))
            raise race(st, "write-after-write", self.name, idx, _lane(lanes, i), int(w[i]))
        if self.read_log:
            self._fold_reads()
        if self.readers_dirty:
            lo, hi = self.reader_min[k], self.reader_max[k]
            bad = (hi >= 0) & ((lo != tid) | (hi != tid))
            if bad.any():
                i = int(np.argmax(bad))
                other = int(lo[i]) if lo[i] != tid[i] else int(hi[i])
                raise race(st, "write-after-read", self.name, idx, _lane(lanes, i), other)

    def barrier(self, st: LaneState) -> None:
        """Start a new epoch for the blocks that reached the barrier."""
        if not st.checks:
            return
        if st.mask is None:
            rows = slice(None)
            self.read_log.clear()
            self.logged = 0
        else:
            # Only some blocks of the chunk are here (a block-uniform branch); the others keep
            # their epoch, so their logged reads must survive: fold them first.
            if self.read_log:
                self._fold_reads()
            rows = np.unique(st.layout.lane_block[st.mask])  # type: ignore[assignment]
        writer = self.writer.reshape(-1, self.size)
        w = writer[rows]
        writer[rows] = np.where(w == NEVER_WRITTEN, NEVER_WRITTEN, NOT_THIS_EPOCH)
        if self.readers_dirty:
            self.reader_min.reshape(-1, self.size)[rows] = NO_READER
            self.reader_max.reshape(-1, self.size)[rows] = -1
            self.readers_dirty = st.mask is not None


def _lane(lanes: np.ndarray | None, i: int) -> int:
    return i if lanes is None else int(lanes[i])


class LocalMemory:
    """A local buffer: one copy per lane, as a list of per-lane columns (see the module docstring)."""

    scope = "local"

    def __init__(self, st: LaneState, name: str, dtype: DType, shape: tuple[int, ...],
                 strides: tuple[int, ...]) -> None:
        self.name, self.dtype, self.shape, self.strides = name, dtype, shape, strides
        self.size = span(shape, strides)
        self.lanes = st.layout.lanes
        fill = np.full(self.lanes, poison(dtype), dtype=dtype.numpy)
        self.cols: list[np.ndarray] = [fill] * self.size
        # Per element: None (never written), True (written in every lane) or a lane mask.
        self.written: list[Any] = [None] * self.size
        # Per element: lanes (a count per lane) whose wgmma writing it is still in flight
        # (warpgroup.py); any access by such a lane before its wgmma.wait_group is a race.
        self.busy: dict[int, np.ndarray] = {}

    def load(self, st: LaneState, idx: Index, dims: Sequence[int]) -> Any:
        if st.checks:
            check_bounds(st, "load", "local", self.name, self.shape, idx, dims)
        f = flat_index(idx, self.strides)
        if self.busy:
            self._check_idle(st, idx, f)
        if isinstance(f, np.ndarray):
            return self._load_dynamic(st, idx, f)
        if st.checks and self.written[f] is not True:
            self._check_written(st, idx, self.written[f])
        return self.cols[f]

    def _check_idle(self, st: LaneState, idx: Index, f: Any) -> None:
        """RaceError if an active lane accesses an element its in-flight wgmma will write."""
        for e in (np.unique(f) if isinstance(f, np.ndarray) else (f,)):
            lanes = self.busy.get(int(e))
            if lanes is None:
                continue
            hit = lanes > 0
            if isinstance(f, np.ndarray):
                hit &= f == e
            if st.mask is not None:
                hit &= st.mask
            if hit.any():
                lane = int(np.argmax(hit))
                raise RaceError(
                    f"wgmma race on {self.name}[{', '.join(str(int(i[lane]) if isinstance(i, np.ndarray) else int(i)) for i in idx)}] "
                    f"in kernel {st.kernel} at {st.layout.where(lane)}: the accumulator of a wgmma still in flight is "
                    "accessed; commit it (wgmma.commit_group) and wgmma.wait_group it before touching its registers")

    def _check_written(self, st: LaneState, idx: Index, w: Any) -> None:
        unwritten = np.ones(self.lanes, dtype=bool) if w is None else ~w
        if st.mask is not None:
            unwritten &= st.mask
        if unwritten.any():
            raise uninitialized(st, "local", self.name, idx, int(np.argmax(unwritten)))

    def _load_dynamic(self, st: LaneState, idx: Index, f: np.ndarray) -> np.ndarray:
        # A lane-varying index into a per-thread array (local memory proper on a GPU): gather
        # from the stacked columns. Rare in generated code, so simplicity wins over speed.
        f = np.clip(f, 0, self.size - 1)
        lane = np.arange(self.lanes)
        if st.checks:
            for c in np.unique(f if st.mask is None else f[st.mask]):
                sel = f == c if st.mask is None else (f == c) & st.mask
                w = self.written[int(c)]
                if w is not True and (w is None or (sel & ~w).any()):
                    bad = sel if w is None else sel & ~w
                    raise uninitialized(st, "local", self.name, idx, int(np.argmax(bad)))
        gathered: np.ndarray = np.stack(self.cols)[f, lane]
        return gathered

    def store(self, st: LaneState, idx: Index, value: Any, dims: Sequence[int]) -> None:
        if st.checks:
            check_bounds(st, "store", "local", self.name, self.shape, idx, dims)
        f = flat_index(idx, self.strides)
        if self.busy:
            self._check_idle(st, idx, f)
        if isinstance(f, np.ndarray):
            self._store_dynamic(st, f, value)
            return
        m = st.mask
        if m is None:
            if not isinstance(value, np.ndarray) or value.dtype != self.cols[f].dtype:
                value = np.full(self.lanes, value, dtype=self.dtype.numpy)
            self.cols[f] = value
            self.written[f] = True
            return
        self.cols[f] = np.where(m, value, self.cols[f]).astype(self.dtype.numpy, copy=False)
        w = self.written[f]
        if w is not True:
            self.written[f] = m.copy() if w is None else (w | m)

    def _store_dynamic(self, st: LaneState, f: np.ndarray, value: Any) -> None:
        active = np.ones(self.lanes, dtype=bool) if st.mask is None else st.mask
        for c in np.unique(f[active]):
            c = int(c)
            if not 0 <= c < self.size:
                continue  # only reachable with checks off; a GPU would corrupt a neighbour
            sel = active & (f == c)
            self.cols[c] = np.where(sel, value, self.cols[c]).astype(self.dtype.numpy, copy=False)
            w = self.written[c]
            if w is not True:
                self.written[c] = sel if w is None else (w | sel)

