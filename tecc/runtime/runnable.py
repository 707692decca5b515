"""A runnable kernel: a host program and its device code, called like a function.

Both things a user calls are one: `tecc.compiler.kernel.Kernel` (what `build` returns; it adds
the loop IR, the plan, `explain`, timing and `save`) and `tecc.runtime.artifact.LoadedKernel`
(what `load` returns from a saved artifact; it adds the manifest and the files it came from).
What they share lives here:

- the state a launch needs: `host` (the HostProgram: signature, temporaries, kernels and their
  launch dimensions, call sequence), `cubin` (the device code), `ptx` (kept for inspection) and
  `arch` (what the cubin was compiled for);
- the CUDA executor (`tecc.runtime.cuda.CudaExecutor`), made on first use and then kept, so its
  loaded kernels, its temporaries and its launch cache (docs/runtime.md, "Repeated calls")
  serve every later call;
- the call path: once the executor exists, `f(*arrays)` is one frame on top of it;
- `sim(*arrays)`, the same call in the CPU emulator (the outputs left out or given, as `f`).

Nothing here imports the compiler: a deployment runs a saved artifact with the runtime alone.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..ir.errors import DeviceError
from . import cuda
from .host import HostProgram
from .launch_cache import LaunchEntry
from .outputs import OutputAllocator, returned


class RunnableKernel:
    """A host program with its device code. `f(*arrays)` runs it on the current CUDA device:
    arrays in `host.buffer_params` order, NumPy arrays copied in and the results copied back,
    device arrays used in place. `f(*inputs)` (the outputs left out) allocates the outputs like
    the inputs and returns them, one bare, several as a tuple (tecc.runtime.outputs); `f.sim(...)`
    is called the same way and runs the loop IR in the CPU emulator. `executor` is the CudaExecutor, made on first call (DeviceError
    when no GPU can run it); `synchronize()` waits for the launches of earlier calls.

    `stream` and `debug_sync` are passed on to the executor (docs/runtime.md, "Streams,
    synchronization, errors")."""

    def __init__(self, host: HostProgram, cubin: bytes = b"", ptx: str | None = None, arch: str = "", *,
                 stream: Any = None, debug_sync: bool = False) -> None:
        self.host = host
        self.cubin = cubin
        self.ptx = ptx
        self.arch = arch
        self._stream = stream
        self._debug_sync = debug_sync
        self._executor: cuda.CudaExecutor | None = None
        self._arity = len(host.buffer_params)
        self._allocator: OutputAllocator | None = None

    @property
    def name(self) -> str:
        return self.host.name

    # ---- running ----------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        # Thin on purpose: a repeated call with device arrays is a launch-cache hit in the
        # executor (docs/runtime.md, "Repeated calls"), so this frame is most of what is left.
        executor = self._executor
        if executor is not None:
            if len(args) == self._arity:
                executor(*args)
                return None
            made = executor.call_allocating(args)  # the outputs left out: a launch-cache hit
            if made is not None:
                return returned(made)
        if len(args) != self._arity and self.allocator.accepts(len(args)):
            allocator = self.allocator
            full, outputs = allocator.complete(args, numpy_only=self._runs_in_emulator())
            self._runner()(*full)
            executor = self._executor
            if executor is not None and not self._runs_in_emulator():
                executor.learn_allocating(args, full, outputs, allocator.positions)
            return returned(outputs)
        self._runner()(*args)
        return None

    def call_entry(self, *args: Any) -> LaunchEntry | None:
        """`f(*args)` with every argument given, on the GPU; returns the launch-cache entry the
        call ran as (None when it is none), which `relaunch` launches again for new pointers."""
        if self._runs_in_emulator():
            self._runner()(*args)
            return None
        executor = self.executor
        cached = executor.keyed_call(args)
        return None if cached is None else LaunchEntry(cached, executor.cache_generation)

    def relaunch(self, entry: LaunchEntry, ptrs: list[int], args: tuple[Any, ...]) -> bool:
        """The call `call_entry` returned `entry` for, again, on `args` (data pointers `ptrs`),
        whose devices, dtypes, shapes and strides the caller vouches are the ones of then
        (CudaExecutor.relaunch). False, nothing launched, when it cannot: call again then."""
        executor = self._executor
        return executor is not None and executor.relaunch(entry, ptrs, args)

    def prepared(self, entry: LaunchEntry) -> Callable[[list[int]], bool] | None:
        """`relaunch` of `entry` for a caller that allocates the written arrays afresh for each
        call, as one callable of the data pointers (CudaExecutor.prepared), or None."""
        executor = self._executor
        return None if executor is None else executor.prepared(entry)

    @property
    def allocator(self) -> OutputAllocator:
        """What makes the outputs of a call that leaves them out (tecc.runtime.outputs)."""
        allocator = self._allocator
        if allocator is None:
            allocator = self._allocator = OutputAllocator(self.host)
        return allocator

    def sim(self, *args: Any) -> Any:
        """Run the kernel's loop IR in the CPU SIMT emulator: NumPy arrays, in `host.buffer_params`
        order, written in place. With the outputs left out, they are allocated as NumPy arrays
        and returned (one bare, several as a tuple), as `f(*inputs)` does on the GPU."""
        if len(args) != self._arity and self.allocator.accepts(len(args)):
            full, outputs = self.allocator.complete(args, numpy_only=True)
            self._simulate(full)
            return returned(outputs)
        self._simulate(args)
        return None

    def _simulate(self, args: Sequence[Any]) -> None:
        """Run the loop IR in the emulator on the full argument list (the subclass knows where its
        loop IR is: Kernel holds it, LoadedKernel reads the artifact's `path.ir`)."""
        raise NotImplementedError(f"{type(self).__name__} has no loop IR to emulate")

    def _runs_in_emulator(self) -> bool:
        """Whether calls run in the CPU emulator, which takes NumPy arrays only (Kernel: "sim")."""
        return False

    def _runner(self) -> Callable[..., None]:
        """What runs a call while no executor is held: the executor, made now. (A Kernel built
        for target "sim" runs in the CPU emulator instead.)"""
        return self.executor

    @property
    def executor(self) -> cuda.CudaExecutor:
        """The CUDA executor, made (and the cubin loaded) on first use."""
        executor = self._executor
        if executor is None:
            executor = self._executor = self._make_executor()
        return executor

    def _make_executor(self) -> cuda.CudaExecutor:
        reason = cuda.cuda_unavailable_reason()  # through the module, so a stand-in (tests) is seen
        if reason is not None:
            raise DeviceError(self._no_device_message(reason))
        self._check_device()
        return cuda.CudaExecutor(self.host, self.cubin, stream=self._stream, debug_sync=self._debug_sync)

    def _no_device_message(self, reason: str) -> str:
        """The DeviceError's text when no CUDA device is usable (`reason` says why not)."""
        return f"{self.name}: no CUDA device is available to run it ({reason})"

    def _check_device(self) -> None:
        """Refuse the current device before the cubin is loaded, where the subclass knows a
        reason to (LoadedKernel: an arch the device cannot run). Nothing by default."""

    def synchronize(self) -> None:
        """Wait for every launch of earlier calls (LaunchError if one of them faulted)."""
        self.executor.synchronize()

