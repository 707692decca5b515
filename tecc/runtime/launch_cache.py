"""The CUDA executor's launch cache (docs/runtime.md, "Repeated calls"): what a call with device
arrays only is remembered as, under its arguments' layout key, and what a later call with the same
key must re-check before it relaunches the cached launches for its own data pointers.

A key is each argument's `arrays.device_key`, in order (for a torch-like tensor read by attribute:
its type, shape, strides, dtype and device; the pointer is not part of it). A call is remembered
only when every key says what the full path read (`arrays.key_agrees`), so a later call with the
same keys passes the same binding and shape checks; the two checks that depend on the pointers
themselves (alignment, overlap) are redone for every new set of pointers (`CachedCall.accepts`).
A cached call also holds its CUDA graphs, by exact pointers (graphs.py).

Bookkeeping only: the executor (cuda.py) decides when to look up, remember and replay, and
launches; nothing here touches the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..ir.expr import Var
from . import arrays
from .arrays import Argument
from .graphs import CallGraphs
from .host import HostProgram, KernelInfo, bind_arguments
from .marshal import PlannedLaunch, PointerChecks, byte_span, tensor_map_geometry, written_overlap
from .tensor_map import TensorMapSpec

# Distinct argument layouts remembered per executor; the oldest is forgotten past this.
CALL_CACHE_SIZE = 64
# Argument lists at least this long check a new pointer set in NumPy (marshal.PointerChecks),
# shorter ones in Python (fewer microseconds for a handful of arguments).
NUMPY_CHECKS = 32
# Pointer sets a cached call remembers having accepted (alignment and overlap are functions of
# the pointers alone, so a set accepted once is accepted again without redoing the checks).
ACCEPTED_POINTERS = 16

# A call's key (each argument's key, in order) and the arguments' data pointers.
Keys = tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class LaunchRecord:
    """One launch of the last call, for profiling: kernel, grid, block, dynamic shared bytes."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem: int = 0


@dataclass(frozen=True)
class CachedLaunch:
    """One launch of a cached call: the kernel, its resolved grid and block, the prepared
    LaunchConfig, and its parameters with the temporaries' pointers and the scalars filled in;
    `array_slots` says which parameter positions take which argument's data pointer."""

    info: KernelInfo
    kernel: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    config: Any
    params: tuple[Any, ...]
    array_slots: tuple[tuple[int, int], ...]
    # tensor-map parameters: (position, argument index, spec, shape, strides); encoded for each
    # hit's pointer (tensor_map.py), from the executor's cache of encoded maps
    map_slots: tuple[tuple[int, int, TensorMapSpec, tuple[int, ...], tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class CachedCall:
    """What a call with one key of argument layouts launches, once checked by the full path.

    `needs` is each argument's required pointer alignment and `spans` its byte span from its
    pointer, `written` whether the kernels write it: the two checks that depend on the pointers
    themselves (alignment; no overlap with a written array), redone for every new set of pointers.
    `producer_streams` are the current-stream readers of the producers whose arrays were read by
    attribute (torch): on every hit the executor's stream waits on each one's current stream --
    or, when `follow` (an executor made without a stream, every device argument torch's), the
    launches go on the first one's current stream, with nothing to wait for.
    `temps` are the (name, bytes, zero_init) of temporaries taken from the allocator of argument
    `temps_like` (a followed torch stream: torch's caching allocator; kept per stream outside
    CUDA-graph capture, per call under it: arrays.stream_temporaries); their pointers fill the
    parameter slots numbered from the arity on. `records` is what
    `last_launches` says after a hit. `graphs` are the call's CUDA graphs by exact pointers
    (graphs.py), `accepted` the pointer sets `accepts` has passed (up to ACCEPTED_POINTERS)."""

    launches: tuple[CachedLaunch, ...]
    needs: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    written: tuple[bool, ...]
    producer_streams: tuple[Callable[[int], int], ...] = ()
    records: tuple[LaunchRecord, ...] = ()
    follow: bool = False
    temps: tuple[tuple[str, int, bool], ...] = ()
    temps_like: int = -1
    graphs: CallGraphs = field(default_factory=CallGraphs, compare=False, repr=False)
    accepted: dict[tuple[int, ...], None] = field(default_factory=dict, compare=False, repr=False)
    # long argument lists: the pointer checks in NumPy, made from needs, spans and written
    checks: PointerChecks | None = field(init=False, default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.needs) >= NUMPY_CHECKS:
            object.__setattr__(self, "checks", PointerChecks(self.spans, self.written, self.needs))

    def accepts(self, ptrs: Sequence[int]) -> bool:
        """Whether this call's launches may run on the data pointers `ptrs`: each aligned as
        its argument needs, and no array the kernels write overlapping another. When not, the
        full path raises the error that names them. Remembered per pointer set: a training
        loop passes the same pointers every step."""
        key = tuple(ptrs)
        if key in self.accepted:
            return True
        if self.checks is not None:
            if not self.checks.passes(ptrs):  # (a pointer past int64 does not occur: CUDA's are below 2^49)
                return False
        else:
            for ptr, need in zip(ptrs, self.needs):
                if ptr % need:
                    return False
            if written_overlap(ptrs, self.spans, self.written):
                return False
        if len(self.accepted) >= ACCEPTED_POINTERS:
            self.accepted.clear()
        self.accepted[key] = None
        return True


@dataclass(frozen=True)
class LaunchEntry:
    """What `RunnableKernel.call_entry` hands its caller: the cached call a call ran as
    (`CudaExecutor.keyed_call`), and the executor's cache generation then (an entry of an older
    generation holds temporaries' pointers that are gone, so `CudaExecutor.relaunch` refuses it)."""

    cached: CachedCall
    generation: int


@dataclass(frozen=True)
class AllocatingCall:
    """A call that leaves its outputs out (`f(*inputs)`), remembered under its inputs' keys:
    the cached call of the whole argument list, what each output is (shape, producer dtype),
    and which positions of the argument list are outputs."""

    cached: CachedCall
    recipe: tuple[tuple[Any, Any], ...]
    positions: tuple[bool, ...]

    def arguments(self, inputs: Sequence[Any], ptrs: Sequence[int],
                  outputs: Sequence[Any]) -> tuple[tuple[Any, ...], list[int]]:
        """The whole argument list, the inputs (data pointers `ptrs`) and the freshly made
        `outputs` in their positions, and its data pointers."""
        full: list[Any] = []
        all_ptrs: list[int] = []
        given, made = 0, 0
        for is_output in self.positions:
            if is_output:
                out = outputs[made]
                full.append(out)
                all_ptrs.append(out.data_ptr())
                made += 1
            else:
                full.append(inputs[given])
                all_ptrs.append(ptrs[given])
                given += 1
        return tuple(full), all_ptrs


def read_keys(args: Sequence[Any], stream_ptr: int,
              pointer_device: Callable[[int], int]) -> tuple[Keys, list[int]] | None:
    """Each argument's key and data pointer (`arrays.device_key`), or None when one must take
    the full path (a host array, a zero-size array, a producer the key readers do not know)."""
    read = arrays.device_key
    keys = []
    ptrs = []
    for arg in args:
        found = read(arg, stream_ptr, pointer_device)
        if found is None:
            return None
        keys.append(found[0])
        ptrs.append(found[1])
    return tuple(keys), ptrs


def with_pointers(launch: CachedLaunch, ptrs: list[int]) -> list[Any]:
    """A cached launch's parameters with this call's argument pointers in their slots: a fresh
    list per call, so that two threads replaying one entry never see each other's pointers."""
    params = list(launch.params)
    for pos, index in launch.array_slots:
        params[pos] = ptrs[index]
    return params


def cached_call(host: HostProgram, kernels: Mapping[str, Any], keys: Keys, ptrs: Sequence[int],
                prepared: Sequence[Argument], launched: Sequence[tuple[Any, ...]], per_call_temps: Any, *,
                alignment: int, follows_producer: bool) -> CachedCall | None:
    """What the launch cache keeps of a call the full path has just checked and launched
    (`launched`: (planned launch, grid, block, parameters) each; `per_call_temps`: None, or the
    followed argument's position and each temporary's (name, bytes, zero_init)), or None when
    it must not be cached: a key that does not say what the full path read. A tensor map of a
    temporary is re-encoded for each hit's pointer of a followed-stream temporary (as the
    arguments' maps are); an executor-owned temporary keeps its buffer (a new one clears the
    cache), so its map stays as the full path encoded it."""
    has_tensor_maps = any(k.tensor_maps for k in host.kernels)
    if not all(arrays.key_agrees(key, ptr, arg) for key, ptr, arg in zip(keys, ptrs, prepared)):
        return None
    producer_streams: list[Callable[[int], int]] = []
    for key in keys:
        current_stream = arrays.producer_stream(key)
        if current_stream is not None and current_stream not in producer_streams:
            producer_streams.append(current_stream)
    env = bind_arguments(host, [arg.info for arg in prepared]) if has_tensor_maps else {}
    temp_slot = {}  # followed-stream temporaries: name -> its pointer's index after the arguments'
    if per_call_temps is not None:
        arity = len(host.buffer_params)
        temp_slot = {name: arity + t for t, (name, _, _) in enumerate(per_call_temps[1])}
    launches = tuple(_cached_launch(host, kernels, planned, grid, block, params, env, temp_slot)
                     for planned, grid, block, params in launched)
    return CachedCall(
        launches,
        needs=tuple(max(alignment, arg.info.dtype.bytes) for arg in prepared),
        spans=tuple(byte_span(arg.info) for arg in prepared),
        written=tuple(param.name in host.outputs for param in host.buffer_params),
        producer_streams=tuple(producer_streams),
        records=tuple(LaunchRecord(launch.info.name, launch.grid, launch.block, launch.info.dynamic_smem)
                      for launch in launches),
        follow=follows_producer and bool(producer_streams) and all(isinstance(k[0], type) for k in keys),
        temps=() if per_call_temps is None else tuple(per_call_temps[1]),
        temps_like=-1 if per_call_temps is None else per_call_temps[0],
    )


def _cached_launch(host: HostProgram, kernels: Mapping[str, Any], planned: PlannedLaunch,
                   grid: tuple[int, int, int], block: tuple[int, int, int], params: Sequence[Any],
                   env: dict[Var, int], temp_slot: Mapping[str, int]) -> CachedLaunch:
    """One launch of the full path as the cache keeps it: the slots that change with each hit's
    pointers (arguments, followed-stream temporaries, tensor maps) left open."""
    from cuda.core import LaunchConfig

    slots = tuple((pos, slot.index) for pos, slot in enumerate(planned.slots) if slot.kind == "array")
    slots += tuple((pos, temp_slot[slot.name]) for pos, slot in enumerate(planned.slots)
                   if slot.kind == "temp" and slot.name in temp_slot)
    maps = tuple((pos, slot.index if slot.index >= 0 else temp_slot[slot.name], slot.map,
                  *tensor_map_geometry(host, slot.name, env))
                 for pos, slot in enumerate(planned.slots)
                 if slot.kind == "tensor_map" and (slot.index >= 0 or slot.name in temp_slot))
    template = list(params)
    for pos, *_ in slots + maps:
        template[pos] = None
    config = LaunchConfig(grid=grid, block=block, shmem_size=planned.kernel.dynamic_smem)
    return CachedLaunch(planned.kernel, kernels[planned.kernel.name], grid, block, config, tuple(template), slots,
                        maps)  # type: ignore[arg-type]  # a tensor_map slot always holds its map


__all__ = ["AllocatingCall", "CALL_CACHE_SIZE", "CachedCall", "CachedLaunch", "LaunchRecord", "cached_call",
           "read_keys", "with_pointers"]
