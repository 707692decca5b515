"""How the threads of a chunk of thread blocks map onto NumPy vector lanes.

A chunk is `blocks` consecutive thread blocks of the grid (linear block id, x fastest, as CUDA
numbers them) with `threads` threads each. Lane `l` is thread `l % threads` of the chunk's block
`l // threads`; a thread's linear id in its block is `x + y*bx + z*bx*by`, and its warp lane is
that id modulo 32 (CUDA's definition, which warp shuffles rely on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WARP_SIZE = 32


@dataclass
class LaneLayout:
    """The lanes of one chunk: per-lane thread and block coordinates, and the helpers that
    turn a lane back into the `block (x, y, z) thread (x, y, z)` an error message names."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    first_block: int  # linear id of the chunk's first block
    blocks: int  # blocks in this chunk
    thread_idx: tuple[np.ndarray, np.ndarray, np.ndarray] = field(init=False)
    block_idx: tuple[np.ndarray, np.ndarray, np.ndarray] = field(init=False)
    lane_thread: np.ndarray = field(init=False)  # linear thread id in the block, per lane
    lane_block: np.ndarray = field(init=False)  # block index within the chunk, per lane
    _warp_sources: dict[tuple[str, int], tuple[np.ndarray, np.ndarray | None]] = field(init=False)

    def __post_init__(self) -> None:
        bx, by, _ = self.block
        gx, gy, _ = self.grid
        t = np.arange(self.threads, dtype=np.int32)
        self.lane_thread = np.tile(t, self.blocks)
        self.lane_block = np.repeat(np.arange(self.blocks, dtype=np.int32), self.threads)
        tx, ty, tz = t % bx, (t // bx) % by, t // (bx * by)
        self.thread_idx = (np.tile(tx, self.blocks), np.tile(ty, self.blocks), np.tile(tz, self.blocks))
        b = self.first_block + self.lane_block
        self.block_idx = ((b % gx).astype(np.int32), ((b // gx) % gy).astype(np.int32),
                          (b // (gx * gy)).astype(np.int32))
        self._warp_sources = {}

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def lanes(self) -> int:
        return self.threads * self.blocks

    # ---- naming a lane in error messages ----------------------------------------------------
    def block_of(self, lane: int) -> tuple[int, int, int]:
        return tuple(int(a[lane]) for a in self.block_idx)  # type: ignore[return-value]

    def thread_of(self, lane: int) -> tuple[int, int, int]:
        return tuple(int(a[lane]) for a in self.thread_idx)  # type: ignore[return-value]

    def thread_coords(self, linear: int) -> tuple[int, int, int]:
        bx, by, _ = self.block
        return (linear % bx, (linear // bx) % by, linear // (bx * by))

    def where(self, lane: int) -> str:
        return f"block {self.block_of(lane)} thread {self.thread_of(lane)}"

    # ---- warp shuffles ----------------------------------------------------------------------
    def warp_source(self, kind: str, arg: int) -> tuple[np.ndarray, np.ndarray | None]:
        """For a shuffle with a uniform argument: the lane each lane reads from, and which lanes
        read a real partner (None: all do). A partner outside the warp (shfl_down past lane 31) or
        past the block's last thread (a partial warp) gives the lane its own value, as CUDA does
        for shfl_down and as the emulator chooses for the undefined partial-warp case."""
        key = (kind, arg)
        hit = self._warp_sources.get(key)
        if hit is not None:
            return hit
        t = self.lane_thread
        lane_in_warp = t % WARP_SIZE
        if kind == "shfl_xor":
            src_lane = lane_in_warp ^ (arg % WARP_SIZE)
        elif kind == "shfl_down":
            src_lane = lane_in_warp + arg
        elif kind == "shfl_idx":
            src_lane = np.full_like(lane_in_warp, arg % WARP_SIZE)
        else:  # pragma: no cover - the compiler checks the name
            raise ValueError(kind)
        src_thread = t - lane_in_warp + src_lane
        real = (src_lane >= 0) & (src_lane < WARP_SIZE) & (src_thread < self.threads)
        src_thread = np.where(real, src_thread, t)
        source = self.lane_block * self.threads + src_thread
        result = (source, None if bool(real.all()) else real)
        self._warp_sources[key] = result
        return result

    def warp_source_lanes(self, kind: str, arg: np.ndarray) -> np.ndarray:
        """Like `warp_source` for a lane-varying argument (not cached)."""
        t = self.lane_thread
        lane_in_warp = t % WARP_SIZE
        if kind == "shfl_xor":
            src_lane = lane_in_warp ^ (arg % WARP_SIZE)
        elif kind == "shfl_down":
            src_lane = lane_in_warp + arg
        else:
            src_lane = arg % WARP_SIZE
        src_thread = t - lane_in_warp + src_lane
        real = (src_lane >= 0) & (src_lane < WARP_SIZE) & (src_thread < self.threads)
        return self.lane_block * self.threads + np.where(real, src_thread, t)
