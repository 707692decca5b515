"""Run a compiled module on a CUDA GPU through cuda.core.

`CudaExecutor(host, cubin)` loads the cubin's kernels onto the device; each call then

1. describes the arguments (`tecc.runtime.arrays`) and binds them against the host program's
   signature (`bind_arguments`: count, dtype, rank, every dimension and stride), so a wrong
   argument is a ShapeError / DTypeError that names it before anything runs;
2. uploads host (NumPy) arguments into fresh device buffers and allocates the temporaries;
3. launches the kernels of `host.calls` in order on one stream, each with its parameters
   marshaled by the kernel ABI (below) and its grid evaluated for the bound sizes; a kernel
   whose grid has a zero dimension is skipped (it would have no threads);
4. if any argument came from the host: downloads the outputs, synchronizes the stream (an
   asynchronous kernel fault surfaces here as LaunchError) and copies the results into the
   caller's arrays. Calls with device arrays only return without synchronizing.

A call with device arrays only is remembered under its arguments' layout key (the launch cache,
docs/runtime.md "Repeated calls"): a later call with the same key skips steps 1-2 and relaunches
the cached launches for the new data pointers, after re-checking their alignment and overlap and
ordering the stream after the producers' (torch's current stream, for tensors read by attribute).
A hit whose exact pointers were seen before replays the call as one CUDA graph (graphs.py).
What is remembered and re-checked is launch_cache.py's; which stream a call runs on, streams.py's.

Kernel ABI (docs/runtime.md, "Kernel ABI"): a kernel's parameters are `KernelInfo.params` in
order. A Buffer parameter is passed as a device pointer (8 bytes): the data pointer of the
argument or temporary named by the call, or a valid dummy allocation for a zero-size array
whose pointer is null. A Var parameter is passed by value in its dtype (int32 -> 4 bytes,
int64 -> 8 bytes); its value is the one argument binding found for the variable of that name.

Nothing here imports the compiler; cuda.core and cuda.bindings are imported when first needed,
so this module imports (and `cuda_available()` answers False) on a machine without a driver.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from ..ir.errors import DeviceError, LaunchError, ResourceError
from ..ir.expr import Var
from . import arrays, graphs, index_errors
from .arrays import Argument
from .host import HostProgram, KernelInfo, resolve_launch, temp_bytes
from .launch_cache import (CALL_CACHE_SIZE, AllocatingCall, CachedCall, CachedLaunch, LaunchEntry,  # noqa: F401
                           LaunchRecord, cached_call, read_keys, with_pointers)
from .marshal import (DEFAULT_ALIGNMENT, ParamSlot, PlannedLaunch, alias_pairs, byte_span, check_aliasing,  # noqa: F401
                      check_device_arrays, live_ranges, plan_launches, prepare_arguments, scalar_argument,
                      shared_storage, tensor_map_geometry)
from .streams import (CU_STREAM_LEGACY, FOLLOWED_STREAMS, LEGACY_DEFAULT_STREAMS, as_stream,  # noqa: F401
                      followed_producer, same_stream)
from .tensor_map import EncodedTensorMap, TensorMapSpec, encode_arguments, encode_tensor_map, prepare_packed

# Encoded tensor maps an executor keeps (a map per array pointer and shape; cleared when full).
TENSOR_MAP_CACHE = 4096
PACKED_LAUNCHES = 256  # packed parameter blocks of tensor-map launches kept per executor

# Dynamic shared memory a kernel may use per block without opting in: 48 KiB on every
# architecture since Volta (CUDA C++ Programming Guide, "Shared Memory"); a kernel that needs
# more must raise CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, up to the device's
# max_shared_memory_per_block_optin (227 KiB on sm_90).
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024


# ---- the device -------------------------------------------------------------------------------

def cuda_unavailable_reason() -> str | None:
    """Why no CUDA device can be used here (None when one can). Never raises."""
    try:
        from cuda.bindings import driver
    except Exception as exc:  # noqa: BLE001 - any import failure means "no CUDA here"
        return f"cuda-bindings cannot be imported ({type(exc).__name__}: {exc})"
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - e.g. the driver library libcuda.so is not installed
        return f"the CUDA driver cannot be loaded ({type(exc).__name__}: {exc})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuInit failed with {_error_text(err)}"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuDeviceGetCount failed with {_error_text(err)}"
    if count == 0:
        return "the CUDA driver reports no device"
    try:
        import cuda.core  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"cuda-core cannot be imported ({type(exc).__name__}: {exc})"
    return None


def cuda_available() -> bool:
    """True when a CUDA driver and at least one device can be used. Never raises."""
    return cuda_unavailable_reason() is None


def current_device(device: Any = None) -> Any:
    """The cuda.core `Device` to run on (the current one, or ordinal / Device `device`), made
    current on this thread. DeviceError if there is no usable CUDA device."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise DeviceError(f"no CUDA device is available: {reason}")
    from cuda.core import Device

    try:
        dev = device if isinstance(device, Device) else Device(device)
        dev.set_current()
    except Exception as exc:  # noqa: BLE001 - cuda.core raises CUDAError / ValueError
        raise DeviceError(f"cannot use CUDA device {device if device is not None else '(current)'}: {exc}") from exc
    return dev


def device_arch(device: Any) -> str:
    """The `sm_XY` name of a cuda.core Device's compute capability (what `arch=` takes)."""
    return f"sm_{device.arch}"


def _error_text(err: Any) -> str:
    """`CUDA_ERROR_X: explanation` for a CUresult."""
    try:
        from cuda.bindings import driver

        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        return f"{name.decode()}: {text.decode()}"
    except Exception:  # noqa: BLE001
        return str(err)


# ---- launching --------------------------------------------------------------------------------

def describe_launch(module: str, kernel: str, grid: Sequence[int], block: Sequence[int], dynamic_smem: int) -> str:
    return (f"{module}: kernel {kernel} (grid {tuple(grid)}, block {tuple(block)}, "
            f"dynamic shared memory {dynamic_smem} bytes)")


class CudaExecutor(graphs.GraphReplay):
    """Runs a HostProgram's kernels from `cubin` on a CUDA device.

    `executor(*arrays)` runs the module on arrays in `host.buffer_params` order: NumPy arrays
    are copied in and the outputs copied back into them (the call synchronizes); device arrays
    (DLPack / CUDA array interface) are used in place (the call does not synchronize; use
    `synchronize()` or the producer library's own synchronization). Returns None.

    stream: a cuda.core Stream, an object with `__cuda_stream__`, a torch.cuda.Stream (its
    `cuda_stream` handle) or a raw CUstream handle as int. Default (None): the caller's stream --
    a call whose device arrays are all torch tensors launches on torch's current stream (nothing
    to wait for, and capturable in a CUDA graph; its temporaries then come from torch's caching
    allocator, kept per stream, per call under capture), any other call on the device's default stream.
    debug_sync: synchronize after every launch, so an asynchronous fault is reported as a
    LaunchError that names the kernel and its launch configuration.
    alignment: the base alignment in bytes required of device arrays' data pointers (default
    16, what vectorized kernels assume; lower it only for code known to make no vector access).
    cuda_graphs: replay a repeated call with the same pointers as one CUDA graph (graphs.py):
    True / False; "patch": and patch a call's graph for new pointers (graph_patch.py); None
    (default): TECC_CUDA_GRAPHS's mode. `graph_stats` counts captures, patches and graph launches.

    `kernels` maps kernel names to the loaded cuda.core Kernels; `last_launches` lists the
    launches of the last call (LaunchRecord) for profiling."""

    follows_producer = False  # launch on torch's current stream (set by __init__ for stream=None)
    cuda_graphs = False  # replay repeated calls as CUDA graphs (set by __init__: on unless TECC_CUDA_GRAPHS=0)
    graph_patching = False  # patch a call's graph for new pointers (set by __init__: TECC_CUDA_GRAPHS=patch, the default)

    def __init__(self, host: HostProgram, cubin: bytes, *, stream: Any = None, device: Any = None,
                 debug_sync: bool = False, alignment: int = DEFAULT_ALIGNMENT, cuda_graphs: bool | str | None = None) -> None:
        self.host = host
        self._planned = plan_launches(host)
        self.device = current_device(device)
        self.arch = device_arch(self.device)
        self._stream_owner = stream  # keeps a foreign stream object alive while we use its handle
        self.stream = as_stream(stream, self.device)
        self.follows_producer = stream is None
        self.debug_sync = debug_sync
        self.alignment = alignment
        mode = graphs.mode_from_environment() if cuda_graphs is None else cuda_graphs
        self.cuda_graphs = mode not in ("0", False)
        self.graph_patching = mode == "patch"
        self.last_launches: list[LaunchRecord] = []
        self._temps: dict[str, Any] = {}
        # temporaries of calls on followed torch streams outside capture (arrays.stream_temporaries:
        # the stream's arena each call signature last used, the zero_init ones kept apart)
        self._stream_temps: dict[tuple[Any, ...], Any] = {}
        self._dummy: Any = None
        self._init_launch_cache()

        from cuda.core import ObjectCode

        self.object_code = ObjectCode.from_cubin(bytes(cubin), name=host.name)
        self.kernels: dict[str, Any] = {}
        self._max_threads: dict[str, int] = {}
        for info in host.kernels:
            kernel = self._load_kernel(info.function)
            self.kernels[info.name] = kernel
            self._max_threads[info.name] = int(_kernel_attribute(kernel, "max_threads_per_block"))
            if info.dynamic_smem > 0:
                self._allow_dynamic_smem(info, kernel)
        self._error_record = index_errors.find_record(self.object_code, host) if host.index_checks else 0

    def _init_launch_cache(self) -> None:
        """The launch cache (docs/runtime.md, "Repeated calls"): argument keys -> CachedCall."""
        self._calls: dict[tuple[Any, ...], CachedCall] = {}
        self.cache_generation = 0  # bumped whenever the cached entries stop being valid
        # temporaries from torch's allocator share storages by liveness (marshal.shared_storage)
        self._storage = shared_storage(self.host, self._planned)
        self._ranges = live_ranges(self._planned)  # and are placed in the stream's arena by them (arena.py)
        # how calls ran: `cached` from the launch cache, `checked` through the full path (a
        # benchmark's check that repeated calls hit: benchmarks/models_hf.py --profile)
        self.calls_cached = 0
        self.calls_checked = 0
        self.calls_relaunched = 0  # of the cached: relaunched on pointers alone (`relaunch`)
        # calls that leave their outputs out, under the inputs' keys
        self._allocating: dict[tuple[Any, ...], AllocatingCall] = {}
        self._arity = len(self.host.buffer_params)
        self._stream_ptr = int(self.stream.handle)
        self._home_stream = (self.stream, self._stream_ptr)  # `stream` and its handle, as made
        self._followed: dict[int, Any] = {}  # producer stream handle -> cuda.core Stream
        self._device_ordinal = int(self.device.device_id)
        self._order_event: Any = None  # made on the first hit that must wait on another stream
        self._order_lock = threading.Lock()  # a record and its wait, not interleaved between threads
        # encoded tensor maps by (spec, pointer, shape, strides) (tensor_map.py)
        self._tensor_maps: dict[tuple[Any, ...], EncodedTensorMap] = {}
        self._packed_launches: dict[tuple[Any, ...], tuple[Any, Callable[[], None]]] = {}
        self.graph_stats = graphs.GraphStats()
        self._capture_stream: Any = None  # made on the first capture (graphs.py: never the caller's stream)
        self._capture_lock = threading.Lock()  # one capture at a time on that stream
        self._graph_lock = threading.Lock()  # with patching: a graph patched and launched by one thread at a time

    def __repr__(self) -> str:
        return f"<CudaExecutor {self.host.name} on {self.arch} kernels={list(self.kernels)}>"

    # ---- loading ----------------------------------------------------------------------------
    def _load_kernel(self, name: str) -> Any:
        try:
            return self.object_code.get_kernel(name)
        except Exception as exc:  # noqa: BLE001 - cuda.core raises CUDAError
            text = str(exc)
            if "NO_BINARY_FOR_GPU" in text or "INVALID_IMAGE" in text:
                raise DeviceError(
                    f"{self.host.name}: the cubin has no code this device ({self.arch}, {self.device.name}) can run: "
                    f"{text}; rebuild it with arch='{self.arch}'"
                ) from exc
            raise DeviceError(f"{self.host.name}: cannot load kernel {name} from the cubin: {text}") from exc

    def _allow_dynamic_smem(self, info: KernelInfo, kernel: Any) -> None:
        """Opt the kernel in to `info.dynamic_smem` bytes of dynamic shared memory when that is
        more than it may use by default (48 KiB minus its static shared memory)."""
        static = int(_kernel_attribute(kernel, "shared_size_bytes"))
        optin = int(self.device.properties.max_shared_memory_per_block_optin)
        if static + info.dynamic_smem > optin:
            raise ResourceError(
                f"{self.host.name}: kernel {info.name} needs {info.dynamic_smem} bytes of dynamic and {static} bytes "
                f"of static shared memory per block, over the {optin} bytes a block may have on {self.device.name} "
                f"({self.arch}); choose a plan with smaller shared-memory tiles"
            )
        if static + info.dynamic_smem <= DEFAULT_DYNAMIC_SMEM_LIMIT:
            return
        from cuda.bindings import driver

        handle = kernel.handle
        if not isinstance(handle, driver.CUkernel):
            handle = driver.CUkernel(int(handle))
        (err,) = driver.cuKernelSetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            int(info.dynamic_smem), handle, driver.CUdevice(self.device.device_id),
        )
        if err != driver.CUresult.CUDA_SUCCESS:
            raise ResourceError(
                f"{self.host.name}: cannot allow kernel {info.name} {info.dynamic_smem} bytes of dynamic shared "
                f"memory: {_error_text(err)}"
            )

    # ---- running ----------------------------------------------------------------------------
    def __call__(self, *args: Any) -> None:
        self.keyed_call(args)

    def keyed_call(self, args: tuple[Any, ...]) -> CachedCall | None:
        """Run a call with every argument given; return the launch-cache entry it ran as or was
        remembered as (with `cache_generation`, what `relaunch` takes), or None when it is none
        (host arrays, a key the full path does not vouch for)."""
        if self.follows_producer:
            self.stream, self._stream_ptr = self._home_stream  # until a call's arguments say otherwise
        found = self._argument_keys(args)
        if found is not None:
            cached = self._calls.get(found[0])
            if cached is not None and self._replay(cached, found[1], args):
                self.calls_cached += 1
                return cached
        self.calls_checked += 1
        launched = self._call_checked(args)
        if found is not None and launched is not None:
            return self._remember(found, *launched)
        return None

    def relaunch(self, entry: LaunchEntry, ptrs: list[int], args: tuple[Any, ...]) -> bool:
        """Launch a call `keyed_call` returned `entry` for, on new data pointers `ptrs` (`args`' own,
        in order), without reading the arguments' keys: the caller vouches that each argument
        has the device, dtype, shape and strides it had then (tecc/torch/runtime.py knows it
        of a whole graph from its inputs). The pointers' own checks (alignment, overlap) are
        redone as on any hit. False, with nothing launched, when the entry is stale (the
        executor's temporaries were reallocated since) or the pointers fail those checks: the
        caller then makes the call the ordinary way."""
        if entry.generation != self.cache_generation:
            return False
        if self.follows_producer:
            self.stream, self._stream_ptr = self._home_stream
        if not self._replay(entry.cached, ptrs, args):
            return False
        self.calls_cached += 1
        self.calls_relaunched += 1
        return True

    def prepared(self, entry: LaunchEntry) -> "PreparedLaunch | None":
        """`relaunch` of `entry` made ready for a caller that allocates every array the kernels
        write afresh for each call (so none can overlap another argument) and whose arguments
        are torch tensors on one current stream: a single launch without temporaries or tensor
        maps, run with about the Python of a raw launch (PreparedLaunch). None where the entry
        is not such a call (relaunch it then)."""
        cached = entry.cached
        if (len(cached.launches) != 1 or cached.temps or not cached.follow or len(cached.producer_streams) != 1
                or cached.launches[0].map_slots
                or any(isinstance(p, EncodedTensorMap) for p in cached.launches[0].params)):
            return None
        return PreparedLaunch(self, entry)

    def call_allocating(self, inputs: tuple[Any, ...]) -> list[Any] | None:
        """The outputs of a call that leaves them out (`f(*inputs)`), when it is a launch-cache
        hit: the inputs' keys find what an earlier such call learned (`learn_allocating`), the
        outputs are made as then (`new_empty` on the first input: same device, shapes and
        dtypes, fresh contiguous memory, so their keys would be the same) and the cached launch
        runs on their pointers -- the outputs' own keys are never read. None (nothing made,
        nothing launched) when the call must take the full path."""
        if self.follows_producer:
            self.stream, self._stream_ptr = self._home_stream
        read = self._read_keys(inputs)
        if read is None:
            return None
        keys, ptrs = read
        hit = self._allocating.get(keys)
        if hit is None:
            return None
        outputs = [inputs[0].new_empty(shape, dtype=dtype) for shape, dtype in hit.recipe]
        full, all_ptrs = hit.arguments(inputs, ptrs, outputs)
        if not self._replay(hit.cached, all_ptrs, full):
            return None
        self.calls_cached += 1
        return outputs

    def learn_allocating(self, inputs: Sequence[Any], full: Sequence[Any], outputs: Sequence[Any],
                         positions: tuple[bool, ...]) -> None:
        """After a full-path call `f(*inputs)` whose outputs the allocator made with the first
        input's `new_empty` (a torch-like producer read by attribute), remember its cached
        launch under the inputs' keys for `call_allocating`."""
        if not inputs or not outputs or len(self._allocating) >= CALL_CACHE_SIZE:
            return
        first = inputs[0]
        if any(type(o) is not type(first) for o in outputs) or not callable(getattr(first, "new_empty", None)):
            return
        found = self._argument_keys(tuple(full))
        if found is None or not all(isinstance(key[0], type) for key in found[0]):
            return  # only keys read by attribute: their pointers are data_ptr()
        cached = self._calls.get(found[0])
        if cached is None:
            return
        input_keys = tuple(key for key, is_output in zip(found[0], positions) if not is_output)
        recipe = tuple((tuple(o.shape), o.dtype) for o in outputs)
        self._allocating[input_keys] = AllocatingCall(cached, recipe, positions)

    def _use_stream(self, handle: int) -> None:
        """Launch the rest of this call on the producer's current stream `handle` (a followed
        torch stream; the legacy default stream's NULL handle is named CU_STREAM_LEGACY, what
        DLPack expects of a consumer stream)."""
        if handle in LEGACY_DEFAULT_STREAMS:
            handle = CU_STREAM_LEGACY
        if handle == self._stream_ptr:
            return
        stream = self._followed.get(handle)
        if stream is None:
            home, home_ptr = self._home_stream
            if same_stream(handle, home_ptr):
                stream = home
            else:
                from cuda.core import Stream

                stream = Stream.from_handle(handle)
            if len(self._followed) >= FOLLOWED_STREAMS:
                self._followed.clear()
                # and their kept temporaries: freed to torch on the stream that used them, which
                # reuses them only for work ordered after them there
                self._stream_temps.clear()
            self._followed[handle] = stream
        self.stream, self._stream_ptr = stream, handle

    def _followed_producer(self, args: tuple[Any, ...]) -> int | None:
        """The position of the argument whose current stream this call follows: the first torch
        CUDA tensor, when the executor follows its producers and every device argument is one;
        None otherwise (the call runs on the executor's own stream)."""
        return followed_producer(args) if self.follows_producer else None

    def _argument_keys(self, args: tuple[Any, ...]) -> tuple[tuple[tuple[Any, ...], ...], list[int]] | None:
        """The call's key (each argument's key from `arrays.device_key`, in order) and the
        arguments' data pointers, or None when any argument must take the full path (a host
        array, a zero-size array, a producer the key readers do not know)."""
        if len(args) != self._arity:
            return None
        return self._read_keys(args)

    def _read_keys(self, args: Sequence[Any]) -> tuple[tuple[tuple[Any, ...], ...], list[int]] | None:
        """Each argument's key and data pointer (launch_cache.read_keys), or None when one
        must take the full path."""
        return read_keys(args, self._stream_ptr, self._pointer_device)

    def _replay(self, cached: CachedCall, ptrs: list[int], args: tuple[Any, ...] = ()) -> bool:
        """Launch a cached call for new data pointers. False (nothing launched) when a pointer
        is misaligned or two arrays overlap: the full path then raises the error that names them."""
        if not cached.accepts(ptrs):
            return False
        self.device.set_current()
        producers = cached.producer_streams
        if cached.follow:
            self._use_stream(producers[0](self._device_ordinal))
            producers = producers[1:]
        for current_stream in producers:
            self._wait_for_stream(current_stream(self._device_ordinal))
        owners: list[Any] = []  # the temporaries' owners, alive until their launches are queued
        if cached.temps:
            temp_ptrs, owners = arrays.stream_temporaries(args[cached.temps_like], cached.temps, self._stream_temps,
                                                          self._stream_ptr, self._storage, self._ranges)
            ptrs = [*ptrs, *temp_ptrs]
        # Straight to the driver unless something must see each launch: debug_sync, or a
        # wrapper around `_launch` (tc.profile() installs one).
        if self.debug_sync or type(self)._launch is not _PLAIN_LAUNCH:
            self.last_launches = []
            for launch in cached.launches:
                self._launch(launch.info, launch.grid, launch.block, self._with_maps(launch, ptrs))
            return True
        if self.cuda_graphs and len(cached.launches) >= graphs.MIN_LAUNCHES and self._replay_graph(cached, ptrs):
            return True
        submit = self._submit
        for done, launch in enumerate(cached.launches):
            try:
                submit(launch.kernel, launch.config, self._with_maps(launch, ptrs))
            except Exception as exc:  # noqa: BLE001 - cuda.core raises CUDAError (driver) or ValueError
                self.last_launches = list(cached.records[:done])
                what = describe_launch(self.host.name, launch.info.name, launch.grid, launch.block,
                                       launch.info.dynamic_smem)
                raise LaunchError(f"{what} failed to launch: {exc}") from exc
        self.last_launches = list(cached.records)
        return True

    def _with_maps(self, launch: CachedLaunch, ptrs: list[int]) -> list[Any]:
        """`_with_pointers`, and the launch's tensor maps for this call's pointers."""
        params = with_pointers(launch, ptrs)
        for pos, index, spec, shape, strides in launch.map_slots:
            params[pos] = self._tensor_map(spec, ptrs[index], shape, strides)
        return params

    def _wait_for_stream(self, producer: int) -> None:
        """Order this executor's stream after the work already queued on stream `producer`, as
        `__dlpack__(stream=...)` does for the arrays it exports: nothing when they are one stream,
        else an event recorded on `producer` that this stream waits on (cuEventRecord,
        cuStreamWaitEvent: a wait binds to the event's latest record, so one event serves every
        call as long as no other thread records it in between: hence the lock)."""
        if not same_stream(producer, self._stream_ptr):
            self._record_and_wait(producer)

    def _record_and_wait(self, producer: int) -> None:
        from cuda.bindings import driver

        with self._order_lock:
            if self._order_event is None:
                self._order_event = self.device.create_event()  # cuda.core's default: no timing, owned
            event = self._order_event.handle
            (err,) = driver.cuEventRecord(event, driver.CUstream(producer))
            if err == driver.CUresult.CUDA_SUCCESS:
                (err,) = driver.cuStreamWaitEvent(driver.CUstream(self._stream_ptr), event, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise LaunchError(
                f"{self.host.name}: cannot order stream {self._stream_ptr:#x} after the arrays' producer stream "
                f"{producer:#x}: {_error_text(err)}"
            )

    def _call_checked(self, args: tuple[Any, ...]) -> tuple[list[Argument], list[tuple[Any, ...]], Any] | None:
        """The full path: describe, bind and check every argument, stage host arrays, launch.
        Returns the device arguments, the launches made (kernel, grid, block, parameters) and
        the temporaries taken from the followed tensor's allocator (None, or the followed
        argument's position and each temporary's name, bytes and zero_init) for the launch cache, or None when the call had
        host arrays."""
        self.device.set_current()
        like = self._followed_producer(args)
        if like is not None:
            reader = arrays.current_stream_reader(args[like])
            assert reader is not None
            self._use_stream(reader(self._device_ordinal))
        prepared, env = prepare_arguments(self.host, args, self._stream_ptr)
        check_device_arrays(self.host, prepared, self.device.device_id, self.alignment)
        check_aliasing(self.host, prepared)
        staged = self._stage(prepared)
        pointers = [self._pointer(arg, buf) for arg, buf in zip(prepared, staged)]
        if like is not None and self.host.temps:
            temps, owners, per_call = self._allocate_temps_like(env, args[like])
            per_call_temps: Any = (like, per_call)
        else:
            temps, owners, per_call_temps = self._allocate_temps(env), [], None
        values = {v.name: value for v, value in env.items()}

        self.last_launches = []
        launched: list[tuple[Any, ...]] = []
        for planned in self._planned:
            grid, block = resolve_launch(planned.kernel, env, self.host.name)
            if min(grid) <= 0:
                continue
            params = [self._param(slot, pointers, temps, values, env) for slot in planned.slots]
            self._launch(planned.kernel, grid, block, params)
            launched.append((planned, grid, block, params))

        if any(arg.is_host for arg in prepared):
            self._finish_host_call(prepared, staged)
            return None
        del owners  # the launches are queued on the stream that allocated them: stream-ordered reuse is safe
        return prepared, launched, per_call_temps

    def _remember(self, found: tuple[tuple[tuple[Any, ...], ...], list[int]], prepared: list[Argument],
                  launched: list[tuple[Any, ...]], per_call_temps: Any = None) -> CachedCall | None:
        """Cache a call the full path has just checked and launched, under its arguments' keys --
        only when every key says what the full path read (`arrays.key_agrees`), so that a later
        call with the same keys passes the same checks. Returns the entry, or None."""
        keys, ptrs = found
        cached = cached_call(self.host, self.kernels, keys, ptrs, prepared, launched, per_call_temps,
                             alignment=self.alignment,
                             follows_producer=self.follows_producer)
        if cached is None:
            return None
        if len(self._calls) >= CALL_CACHE_SIZE:
            del self._calls[next(iter(self._calls))]
        self._calls[keys] = cached
        return cached

    def _pointer_device(self, ptr: int) -> int:
        """The ordinal of the device that owns device pointer `ptr` (cuPointerGetAttribute)."""
        from cuda.bindings import driver

        err, ordinal = driver.cuPointerGetAttribute(
            driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise DeviceError(f"cannot tell which device owns pointer {ptr:#x}: {_error_text(err)}")
        return int(ordinal)

    def synchronize(self) -> None:
        """Wait for this executor's stream; an asynchronous kernel fault raises LaunchError, a
        data-dependent index out of range in an earlier call OutOfBoundsError."""
        self._synchronize(f"{self.host.name}: the device reported an error while synchronizing")
        self._check_index_errors()

    def _check_index_errors(self) -> None:
        """After the stream is synchronized: OutOfBoundsError if a kernel of an earlier call found
        a data-dependent index out of range (index_errors.py)."""
        if self._error_record:
            index_errors.check(self._error_record, self.host)

    def _stage(self, prepared: list[Argument]) -> list[Any]:
        """Device buffers holding the host arguments (None for device arguments), uploaded."""
        staged: list[Any] = []
        for arg in prepared:
            if arg.staged is None:
                staged.append(None)
                continue
            buf = arrays.allocate(self.device, arg.staged.nbytes, self.stream)
            arrays.upload(arg.staged, buf, self.stream)
            staged.append(buf)
        return staged

    def _pointer(self, arg: Argument, staged: Any) -> int:
        if staged is not None:
            return int(staged.handle)
        if arg.ptr == 0:
            # A zero-size DLPack array may carry a null data pointer; the kernel never
            # dereferences it, but keep every pointer parameter a valid allocation.
            return self._dummy_pointer()
        return arg.ptr

    def _dummy_pointer(self) -> int:
        if self._dummy is None:
            self._dummy = arrays.allocate(self.device, 256, self.stream)
        return int(self._dummy.handle)

    def _allocate_temps(self, env: dict[Var, int]) -> dict[str, int]:
        """Device pointers of the temporaries, reusing the last call's buffers when big enough
        (all launches are ordered on one stream, so reuse across calls is safe). A zero_init
        temporary is zeroed once, on the stream, when it is allocated: its kernels leave it
        zero again (a self-resetting counter), so a reused one needs no new fill."""
        pointers: dict[str, int] = {}
        for temp in self.host.temps:
            nbytes = temp_bytes(temp, env)
            buf = self._temps.get(temp.name)
            if buf is None or buf.size < nbytes:
                buf = arrays.allocate(self.device, nbytes, self.stream)
                if temp.zero_init:
                    buf.fill(0, stream=self.stream)  # cuMemsetD8Async, ordered before the launches
                self._temps[temp.name] = buf
                self._calls.clear()  # cached launches hold the old buffer's pointer
                self.cache_generation += 1  # and so do the entries `keyed_call` handed out
                self._allocating.clear()
            pointers[temp.name] = int(buf.handle)
        return pointers

    def _allocate_temps_like(self, env: dict[Var, int], like: Any) -> tuple[dict[str, int], list[Any], tuple[tuple[str, int, bool], ...]]:
        """The temporaries of a call on the followed stream of the torch tensor `like`, from its
        allocator (arrays.stream_temporaries: kept per stream, per call under CUDA-graph capture,
        so replays find them where the capture put them): their pointers, their owners (keep them
        until the launches are queued) and each one's (name, bytes, zero_init)."""
        sizes = tuple((temp.name, temp_bytes(temp, env), bool(temp.zero_init)) for temp in self.host.temps)
        ptrs, owners = arrays.stream_temporaries(like, sizes, self._stream_temps, self._stream_ptr, self._storage,
                                                 self._ranges)
        return {name: ptr for (name, _, _), ptr in zip(sizes, ptrs)}, owners, sizes

    def _param(self, slot: ParamSlot, pointers: list[int], temps: dict[str, int], values: dict[str, int],
               env: dict[Var, int] | None = None) -> Any:
        if slot.kind == "array":
            return pointers[slot.index]
        if slot.kind == "temp":
            return temps[slot.name]
        if slot.kind == "tensor_map":
            assert slot.map is not None and env is not None
            ptr = pointers[slot.index] if slot.index >= 0 else temps[slot.name]
            shape, strides = tensor_map_geometry(self.host, slot.name, env)
            return self._tensor_map(slot.map, ptr, shape, strides)
        return scalar_argument(slot.dtype, values[slot.name])

    def _tensor_map(self, spec: TensorMapSpec, ptr: int, shape: tuple[int, ...],
                    strides: tuple[int, ...]) -> EncodedTensorMap:
        """The encoded map of `spec` for this array, encoded once per (pointer, shape, strides)."""
        key = (spec, ptr, shape, strides)
        found = self._tensor_maps.get(key)
        if found is None:
            where = f"{self.host.name}: tensor map of {spec.param}"
            found = encode_tensor_map(encode_arguments(spec, ptr, shape, strides, where), where)
            if len(self._tensor_maps) >= TENSOR_MAP_CACHE:
                self._tensor_maps.clear()
            self._tensor_maps[key] = found
        return found

    def _launch(self, info: KernelInfo, grid: tuple[int, int, int], block: tuple[int, int, int],
                params: list[Any]) -> None:
        from cuda.core import LaunchConfig

        what = describe_launch(self.host.name, info.name, grid, block, info.dynamic_smem)
        threads = block[0] * block[1] * block[2]
        limit = self._max_threads[info.name]
        if threads > limit:
            raise LaunchError(
                f"{what} cannot launch: {threads} threads per block, but this kernel allows at most {limit} on "
                f"{self.device.name} (the device's limit, or fewer because of the registers each thread uses); "
                "choose a plan with smaller blocks"
            )
        try:
            config = LaunchConfig(grid=grid, block=block, shmem_size=info.dynamic_smem)
            self._submit(self.kernels[info.name], config, params)
        except Exception as exc:  # noqa: BLE001 - cuda.core raises CUDAError (driver) or ValueError
            raise LaunchError(f"{what} failed to launch: {exc}") from exc
        self.last_launches.append(LaunchRecord(info.name, grid, block, info.dynamic_smem))
        if self.debug_sync:
            self._synchronize(f"{what} failed while running")

    def _submit(self, kernel: Any, config: Any, params: Sequence[Any], stream: Any = None) -> None:
        """Hand one launch to the driver: cuda.core's `launch` (cuLaunchKernelEx) on the call's
        stream, or on `stream` (a cuda.core Stream: the capture stream of a CUDA graph, graphs.py)."""
        global _cuda_core_launch
        if _cuda_core_launch is None:
            from cuda.core import launch

            _cuda_core_launch = launch
        if stream is None:
            stream, stream_ptr = self.stream, self._stream_ptr
        else:
            stream_ptr = int(stream.handle)
        if any(isinstance(p, EncodedTensorMap) for p in params):
            # cuda.core's launch takes no raw by-value structure: the driver's cuLaunchKernel does.
            # The packed parameter block is kept per (launch configuration, stream, parameters):
            # a repeated call with the same pointers (its maps are the same encoded objects)
            # relaunches the bytes packed before (the driver copies them at each launch).
            key = (id(config), stream_ptr, tuple(params))
            packed = self._packed_launches.get(key)
            if packed is None or packed[0] is not config:
                prepared = prepare_packed(int(stream.handle), kernel.handle, _dims(config.grid),
                                          _dims(config.block), int(config.shmem_size or 0), params)
                if len(self._packed_launches) >= PACKED_LAUNCHES:
                    self._packed_launches.clear()
                packed = self._packed_launches[key] = (config, prepared)
            packed[1]()
            return
        _cuda_core_launch(stream, config, kernel, *params)

    def _finish_host_call(self, prepared: list[Argument], staged: list[Any]) -> None:
        outputs = set(self.host.outputs)
        for arg, buf, param in zip(prepared, staged, self.host.buffer_params):
            if buf is not None and param.name in outputs:
                assert arg.staged is not None
                arrays.download(buf, arg.staged, self.stream)
        launched = ", ".join(r.kernel for r in self.last_launches) or "no kernel"
        self._synchronize(
            f"{self.host.name}: the device reported an error after launching {launched} "
            "(pass debug_sync=True to synchronize after each launch and name the failing kernel)"
        )
        self._check_index_errors()
        for arg, param in zip(prepared, self.host.buffer_params):
            if arg.writeback is not None and arg.staged is not None and param.name in outputs:
                arg.writeback[...] = arg.staged

    def _synchronize(self, message: str) -> None:
        try:
            self.stream.sync()
        except Exception as exc:  # noqa: BLE001 - cuda.core raises CUDAError
            raise LaunchError(f"{message}: {exc}") from exc


# The unwrapped `_launch`: a cache hit launches directly only while no one has wrapped it.
_PLAIN_LAUNCH = CudaExecutor._launch


class PreparedLaunch:
    """One cached launch (CudaExecutor.prepared) run again on new data pointers: the pointers'
    alignment checked, the launch put on the producer's current stream (as a hit does), the
    parameters filled in and handed to the driver. The written arrays' overlap with the others
    is not checked: the caller allocates them afresh for each call. False, nothing launched,
    when it cannot run so (the entry stale, a pointer misaligned, launches watched: debug_sync
    or tc.profile): the caller then makes the call the ordinary way."""

    __slots__ = ("executor", "generation", "launch", "needs", "producer", "records")

    def __init__(self, executor: CudaExecutor, entry: LaunchEntry) -> None:
        self.executor = executor
        self.generation = entry.generation
        self.launch = entry.cached.launches[0]
        self.needs = entry.cached.needs
        self.producer = entry.cached.producer_streams[0]
        self.records = list(entry.cached.records)   # one list for every call: last_launches is only read

    def __call__(self, ptrs: list[int]) -> bool:
        global _cuda_core_launch
        executor = self.executor
        if (self.generation != executor.cache_generation or executor.debug_sync
                or type(executor)._launch is not _PLAIN_LAUNCH or _cuda_core_launch is None):
            return False
        for ptr, need in zip(ptrs, self.needs):
            if ptr % need:
                return False
        launch = self.launch
        params = list(launch.params)
        for pos, index in launch.array_slots:
            params[pos] = ptrs[index]
        executor.device.set_current()
        handle = self.producer(executor._device_ordinal)
        if handle != executor._stream_ptr:
            executor._use_stream(handle)
        try:
            _cuda_core_launch(executor.stream, launch.config, launch.kernel, *params)
        except Exception as exc:  # noqa: BLE001 - cuda.core raises CUDAError (driver) or ValueError
            what = describe_launch(executor.host.name, launch.info.name, launch.grid, launch.block,
                                   launch.info.dynamic_smem)
            raise LaunchError(f"{what} failed to launch: {exc}") from exc
        executor.last_launches = self.records
        executor.calls_cached += 1
        executor.calls_relaunched += 1
        return True

# cuda.core's `launch`, imported on the first launch (an import statement per launch costs ~0.3 us).
_cuda_core_launch: Any = None


def _dims(value: Any) -> tuple[int, int, int]:
    """A LaunchConfig's grid or block as three ints."""
    dims = tuple(int(v) for v in (value if isinstance(value, (tuple, list)) else (value,)))
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


def _kernel_attribute(kernel: Any, name: str) -> Any:
    """A cuda.core kernel attribute for the current device (a property in cuda.core 1.x;
    a method taking the device in some releases)."""
    value = getattr(kernel.attributes, name)
    return value() if callable(value) else value
