"""The tuner's step 4 (docs/tuning.md): where candidates run, and how they are timed.

`CudaBench` records CUDA events on the executor's stream immediately around every launch (the
profiling hook of tecc.compiler.profiling), so a call's time is the sum of its kernels' times,
without host overhead or copies. The calls rotate over device-resident copies of the arguments
whose total size is at least `L2_FACTOR` times the L2 cache of `tecc.ir.target.from_device()`,
so no call finds its operands in L2 from an earlier one: the time is that of a kernel reading
cold inputs, as in an application.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .pool import first_line

# The argument sets of one timing session together span at least this many L2 caches: with an
# LRU-like replacement a set's lines are evicted before the rotation comes back to it.
L2_FACTOR = 2.0
MAX_SETS = 512
MAX_SET_BYTES = 2 << 30  # never hold more than 2 GiB of rotating copies on the device


class Bench:
    """Where candidates run: `run` once for the check (host arrays, written in place), `time`
    for the measurement (microseconds per call). Subclassed by CudaBench; tests stub it."""

    device: str = ""
    note: str = ""

    def run(self, kernel: Any, arrays: list[np.ndarray]) -> None:
        kernel(*arrays)

    def time(self, kernel: Any, arrays: list[np.ndarray], warmup: int, repeats: int) -> list[float]:
        raise NotImplementedError


class CudaBench(Bench):
    """Times on the current CUDA device: CUDA events around every launch (the profiling hook),
    rotating over device-resident copies of the arguments that together span `L2_FACTOR` times
    the L2 size. The copies are made once per distinct argument list and reused by every
    candidate (they all share the build signature)."""

    def __init__(self) -> None:
        from ...ir.target import from_device
        from ...runtime.cuda import current_device

        self._device = current_device()
        self.target = from_device(self._device)
        self.device = str(self._device.name)
        self._sets: list[list[Any]] = []
        self._key: tuple[int, ...] = ()
        self._keep: list[Any] = []

    def rotation(self, set_bytes: int) -> int:
        """How many argument sets to rotate over: enough to span L2_FACTOR × L2, at least 2."""
        need = math.ceil(L2_FACTOR * self.target.l2_bytes / max(set_bytes, 1)) + 1
        return max(2, min(need, MAX_SETS, max(2, MAX_SET_BYTES // max(set_bytes, 1))))

    def _device_sets(self, arrays: list[np.ndarray]) -> list[list[Any]]:
        key = tuple(id(a) for a in arrays)
        if key == self._key:
            return self._sets
        from cuda.core.utils import StridedMemoryView  # type: ignore[import-untyped]

        from ...runtime import arrays as rt_arrays

        stream = self._device.default_stream
        count = self.rotation(sum(a.nbytes for a in arrays))
        self._keep, self._sets = [], []
        try:
            for _ in range(count):
                views = []
                for a in arrays:
                    buf = rt_arrays.to_device(np.ascontiguousarray(a), self._device, stream)
                    self._keep.append(buf)
                    views.append(StridedMemoryView.from_buffer(buf, tuple(a.shape), dtype=a.dtype))
                self._sets.append(views)
            stream.sync()
            self.note = f"{count} device-resident argument sets of {sum(a.nbytes for a in arrays) / 1e6:.2f} MB"
        except Exception as exc:  # noqa: BLE001 - keep measuring, warm-L2 host arrays are still events-timed
            self._keep, self._sets = [], [arrays]
            self.note = f"host arrays (device copies failed: {first_line(exc)})"
        self._key = key
        return self._sets

    def time(self, kernel: Any, arrays: list[np.ndarray], warmup: int, repeats: int) -> list[float]:
        from ..profiling import profile

        sets = self._device_sets(arrays)
        times: list[float] = []
        with profile() as prof:
            for i in range(warmup + repeats):
                before = len(prof.launches)
                kernel(*sets[i % len(sets)])
                if i >= warmup:
                    times.append(sum(r.time_ms or 0.0 for r in prof.launches[before:]) * 1e3)
        return times
