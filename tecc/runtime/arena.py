"""One memory arena per torch stream for the kernel temporaries of every executor that follows it.

A call that follows a torch stream (cuda.py: every device argument a torch tensor, no explicit
stream) takes its temporaries from torch's caching allocator (arrays.stream_temporaries). Kept
per executor, each program held its largest working set between calls: a model's forward
program kept its temporaries through the backward and the backward's (the gradient of the
logits, 0.77 GiB at GPT-2's size) through the next forward, and every program of every graph
added its own. Launches on one stream run in order, so no two programs' kernels ever run at
once on it: one arena per (device, stream), as large as the largest program's working set,
serves them all. Within a program, temporaries are placed by `layout`: each storage of
marshal.shared_storage (temporaries whose launches do not overlap share one) at its own offset.

The registry holds arenas weakly: the executors that used one hold it (in their kept
temporaries), so it is freed (to torch, on its stream) when the last of them goes. A program
whose working set is larger than the stream's arena makes a larger one, which every executor
takes from its next call on (the old one is freed once none holds it: stream-ordered, as torch
frees). After the first calls the arena stays put, and so do the temporaries' pointers, which
the launch cache and the CUDA graphs of repeated calls are keyed by (graphs.py).

A zero_init temporary (a counter its kernels leave zero for the next call) is not placed in
the arena, which another program overwrites: its executor keeps it apart (arrays.py).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

# Each storage starts at a multiple of this many bytes (TMA wants 16; 256 is what cudaMalloc
# and torch's allocator give, so a temporary's accesses align as they did in its own allocation).
ALIGNMENT = 256


@dataclass(frozen=True)
class Layout:
    """Where each temporary of a call lives in the arena: its byte offset, or None for a
    zero_init one (kept apart); `nbytes` the arena bytes the call needs."""

    offsets: tuple[int | None, ...]
    nbytes: int


def layout(temps: Sequence[tuple[str, int, bool]], storage: Mapping[str, str] | None = None,
           ranges: Mapping[str, tuple[int, int]] | None = None) -> Layout:
    """The offsets of `temps` ((name, bytes, zero_init) each) in an arena.

    With `ranges` (marshal.live_ranges: each temporary's first and last launch), temporaries
    whose launches do not overlap may take the same bytes: each is placed at the lowest offset
    where it overlaps no placed temporary live at the same time (greedy, in three orders, the
    smallest kept: `_packed`; so the arena is
    about the most bytes live at one launch, not a sum of storages each as large as the largest
    temporary it ever held). A temporary no launch passes overlaps nothing. Without `ranges`:
    one region per storage (`storage[name]`, marshal.shared_storage; each temporary its own
    without it), as large as its largest temporary. Every offset is a multiple of ALIGNMENT."""
    if ranges is not None:
        return _packed(temps, ranges)
    size: dict[str, int] = {}
    for name, nbytes, zero in temps:
        if not zero:
            key = storage.get(name, name) if storage is not None else name
            size[key] = max(size.get(key, 0), int(nbytes))
    start: dict[str, int] = {}
    end = 0
    for key, nbytes in size.items():
        start[key] = end
        end += _aligned(nbytes)
    offsets = tuple(None if zero else start[storage.get(name, name) if storage is not None else name]
                    for name, _, zero in temps)
    return Layout(offsets, end)


def _aligned(nbytes: int) -> int:
    return -(-max(int(nbytes), 1) // ALIGNMENT) * ALIGNMENT


def _packed(temps: Sequence[tuple[str, int, bool]], ranges: Mapping[str, tuple[int, int]]) -> Layout:
    """`layout` by live ranges: the smallest of three greedy placements (largest first; first
    used first; longest lived first), each temporary at the lowest offset clear of the placed
    ones whose ranges overlap its own. Ties keep the temporaries' order, so a layout is
    reproducible."""
    spans = [(_aligned(nbytes), *ranges.get(name, (-1, -2))) for name, nbytes, _ in temps]  # (-1, -2): no launch
    kept = [i for i, (_, _, zero) in enumerate(temps) if not zero]
    orders = (sorted(kept, key=lambda i: (-spans[i][0], spans[i][1], i)),
              sorted(kept, key=lambda i: (spans[i][1], -spans[i][0], i)),
              sorted(kept, key=lambda i: (spans[i][1] - spans[i][2], -spans[i][0], i)))
    best: Layout | None = None
    for order in orders:
        placed = _place(order, spans, len(temps))
        if best is None or placed.nbytes < best.nbytes:
            best = placed
    assert best is not None
    return best


def _place(order: Sequence[int], spans: Sequence[tuple[int, int, int]], count: int) -> Layout:
    """Place temporaries `order` (their (bytes, first, last) in `spans`) one by one at the
    lowest offset where they overlap no placed temporary live at the same launch."""
    placed: list[tuple[int, int, int, int]] = []  # (first, last, start, end)
    offsets: list[int | None] = [None] * count
    end = 0
    for i in order:
        size, first, last = spans[i]
        busy = sorted((s, e) for f, l, s, e in placed if f <= last and first <= l)
        offset = 0
        for s, e in busy:
            if offset + size <= s:
                break
            offset = max(offset, e)
        placed.append((first, last, offset, offset + size))
        offsets[i] = offset
        end = max(end, offset + size)
    return Layout(tuple(offsets), end)


class Arena:
    """`nbytes` of device memory at `ptr`, alive as long as `owner` (a torch byte tensor)."""

    __slots__ = ("ptr", "owner", "nbytes", "__weakref__")

    def __init__(self, ptr: int, owner: Any, nbytes: int) -> None:
        self.ptr = ptr
        self.owner = owner
        self.nbytes = nbytes


# (device, stream handle) -> the stream's arena, held by the executors that use it
_ARENAS: dict[tuple[Any, int], "weakref.ref[Arena]"] = {}
_LOCK = threading.Lock()


def stream_arena(device: Any, stream_ptr: int, nbytes: int, allocate: Callable[[int], tuple[int, Any]]) -> Arena:
    """The arena of `stream_ptr` on `device`, at least `nbytes` large: the one in use when it
    is large enough, else a new one from `allocate(bytes)` -> (pointer, owner), as large as the
    old one at least (so programs of different sizes settle on one arena)."""
    key = (device, stream_ptr)
    ref = _ARENAS.get(key)
    arena = ref() if ref is not None else None
    if arena is not None and arena.nbytes >= nbytes:
        return arena
    with _LOCK:
        ref = _ARENAS.get(key)
        arena = ref() if ref is not None else None
        if arena is not None and arena.nbytes >= nbytes:
            return arena
        size = max(int(nbytes), arena.nbytes if arena is not None else 0, 1)
        ptr, owner = allocate(size)
        arena = Arena(ptr, owner, size)
        for dead in [k for k, r in _ARENAS.items() if r() is None]:
            del _ARENAS[dead]
        _ARENAS[key] = weakref.ref(arena)
        return arena


def arena_bytes() -> int:
    """The bytes of every arena alive (a benchmark's accounting)."""
    return sum(a.nbytes for a in (r() for r in list(_ARENAS.values())) if a is not None)


__all__ = ["ALIGNMENT", "Arena", "Layout", "arena_bytes", "layout", "stream_arena"]
