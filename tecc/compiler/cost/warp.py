"""What one warp-wide access costs: global sectors and L1 wavefronts, shared-memory wavefronts.

A strategy says which value each loop variable takes in each of the 32 lanes of a warp (`lanes`:
variable → 32 values; variables not named are the same in every lane). With an access's affine
offset (tecc.compiler.cost.analysis.Affine, in elements) that gives the 32 addresses.

Global memory (CUDA C++ Best Practices Guide, "Coalesced Access to Global Memory"): a warp's
request is served in 32-byte sectors of 128-byte lines; `sectors` counts distinct sectors,
`lines` distinct lines (an L1 wavefront moves one line per clock).

Shared memory (Programming Guide, "Shared Memory" of compute capability 5.x+): 32 banks of 4
bytes; lanes reading the same word are served by one broadcast; distinct words in one bank are
serialized. A 64-bit access is processed per half warp, a 128-bit access per quarter warp, each
phase costing the worst bank's number of distinct words.
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

from .analysis import Affine

WARP = 32


def lane_offsets(offset: Affine, lanes: Mapping[str, Sequence[int]]) -> list[int]:
    """The element offset each lane accesses (relative: the constant part is dropped)."""
    out = []
    for lane in range(WARP):
        total = 0
        for v, c in offset.coeff:
            vals = lanes.get(v)
            if vals is not None:
                total += c * vals[lane]
        out.append(total)
    return out


def global_cost(offsets: Sequence[int], itemsize: int, vector: int = 1) -> tuple[int, int]:
    """(sectors, lines) one warp instruction touches; each lane moves `vector` consecutive items."""
    return _global_cost(tuple(offsets), itemsize, vector)


@functools.lru_cache(maxsize=65536)
def _global_cost(offsets: tuple[int, ...], itemsize: int, vector: int) -> tuple[int, int]:
    sectors: set[int] = set()
    lines: set[int] = set()
    for o in offsets:
        start = o * itemsize
        end = start + vector * itemsize - 1
        for s in range(start // 32, end // 32 + 1):
            sectors.add(s)
            lines.add(s // 4)
    return len(sectors), len(lines)


def shared_wavefronts(word_offsets: Sequence[int], vector_words: int = 1) -> tuple[int, int]:
    """(wavefronts, worst conflict degree) of one warp access to shared memory; `word_offsets`
    are 4-byte word addresses per lane, each lane moving `vector_words` consecutive words."""
    return _shared_wavefronts(tuple(word_offsets), vector_words)


@functools.lru_cache(maxsize=65536)
def _shared_wavefronts(word_offsets: tuple[int, ...], vector_words: int) -> tuple[int, int]:
    phase = WARP // max(1, min(vector_words, 4) if vector_words in (1, 2, 4) else 1)
    total = 0
    worst = 1
    for p in range(0, WARP, phase):
        banks: dict[int, set[int]] = {}
        for o in word_offsets[p:p + phase]:
            for w in range(vector_words):
                banks.setdefault((o + w) % 32, set()).add(o + w)
        degree = max((len(ws) for ws in banks.values()), default=1)
        total += degree
        worst = max(worst, degree)
    return total, worst


def thread_lanes(block_x: int, block_y: int = 1, x_var: str | None = None, y_var: str | None = None
                 ) -> dict[str, list[int]]:
    """Lane values of the variables bound to threadIdx.x (extent block_x) and threadIdx.y, for
    the first warp of a block (linear thread id = y * block_x + x)."""
    out: dict[str, list[int]] = {}
    xs = [lane % block_x for lane in range(WARP)]
    ys = [(lane // block_x) % max(block_y, 1) for lane in range(WARP)]
    if x_var:
        out[x_var] = xs
    if y_var:
        out[y_var] = ys
    return out


__all__ = ["global_cost", "lane_offsets", "shared_wavefronts", "thread_lanes", "WARP"]
