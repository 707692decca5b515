"""The errors tecc raises.

Every error says what went wrong, where (op, tensor, index, pass) and what to do about it.
They live in `tecc.ir` because every layer raises them and `ir` is the layer all may import;
`tecc` re-exports them.
"""

from __future__ import annotations


class TeccError(Exception):
    """Base class of every error tecc raises on purpose."""


class ShapeError(TeccError, ValueError):
    """A shape, index arity, bound or stride does not fit what the tensor or kernel expects."""


class InvalidNameError(TeccError, ValueError):
    """A tensor, axis, size or op name tecc cannot use: it becomes C identifiers, file names of
    dumps and artifacts, and schedule addresses (`kernel/stage`), so it must be an ASCII identifier."""


class DTypeError(TeccError, TypeError):
    """An operator or argument is used with a dtype it does not support."""


class ScheduleError(TeccError):
    """A schedule primitive or pass was asked for something illegal; the message says which precondition failed."""


class GradientError(TeccError):
    """A program tecc cannot differentiate (tc.grad; the message names the tensor and the read)."""


class ResourceError(TeccError):
    """A kernel needs more of a hardware resource (shared memory, registers, threads) than the target has."""


class CompileError(TeccError):
    """NVRTC rejected generated CUDA C. `log` holds the compiler's log, `source` the CUDA C."""

    def __init__(self, message: str, log: str = "", source: str = "") -> None:
        super().__init__(message)
        self.log = log
        self.source = source


class LaunchError(TeccError):
    """A kernel launch failed or the device reported an error after it."""


class OutOfBoundsError(TeccError, IndexError):
    """A kernel accessed memory outside a buffer (reported by the SIMT emulator)."""


class RaceError(TeccError):
    """Two threads of a block touched the same shared address with no barrier between (SIMT emulator)."""


class UninitializedReadError(TeccError):
    """A kernel read shared or local memory that nothing wrote (SIMT emulator)."""


class DivergenceError(TeccError):
    """A block-wide or warp-wide operation (`__syncthreads()`, a warp shuffle) was reached by only
    some of the threads that must take part in it (SIMT emulator; undefined behaviour on a GPU:
    a hang or garbage, which compute-sanitizer's synccheck reports)."""


class DeadlockError(TeccError):
    """Threads wait for something that can never happen: an mbarrier phase that no pending
    arrival or asynchronous copy can complete any more (SIMT emulator; a hang on a GPU)."""


class DeviceError(TeccError):
    """No usable CUDA device or driver where one is needed."""
