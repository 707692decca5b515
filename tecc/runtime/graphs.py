"""CUDA graphs of cached calls (docs/runtime.md, "CUDA graphs of repeated calls").

A launch-cache hit (launch_cache.py) still submits every kernel of the call from Python, one
driver launch each: a whole-graph program of the model backend launches ~60 kernels per layer,
and the host then submits slower than the GPU runs them. So a hit whose exact pointers were seen
before replays the call as one CUDA graph instead:

- the **key** is the stream and every pointer the launches take: the arguments' and those of the
  temporaries taken from the followed stream's allocator (what changes between hits; the scalars,
  grids and executor-owned temporaries are fixed per cached call, and a new temporary clears
  the cache). A graph writes exactly where the call's arrays are, so a different pointer simply
  misses: correct by construction;
- the first time a key is seen the call launches as before (`CallGraphs.second_sight` notes it);
  the second time, its launches are captured (driver stream capture on a private stream of the
  executor, `capture`: the legacy default stream, torch's default, cannot be captured) and the
  graph is launched; every later hit with that key is one `cuGraphLaunch`. A training loop with
  torch's caching allocator gets the same addresses every step, so it replays graphs from its
  third step on;
- each cached call keeps at most `GRAPHS_PER_CALL` graphs, the least recently used destroyed;
- a call whose capture fails launches plainly from then on (`CallGraphs.failed`): nothing is
  raised, a launch error is raised by the plain launch as before.

Where graphs are not used (the executor decides, cuda.py): `TECC_CUDA_GRAPHS=0` or
`executor.cuda_graphs = False`, `debug_sync=True`, a wrapped `_launch` (tc.profile()), a call of
fewer than `MIN_LAUNCHES` launches (a one-kernel graph saves nothing), and a call whose stream is
being captured by someone else (a user's `torch.cuda.graph`: the plain launches go into their graph).

By default (`TECC_CUDA_GRAPHS=patch`; `1` replays exact pointers only) a call's graph is also
patched for new pointers instead of launching plainly (graph_patch.py: the kernel nodes whose pointers changed get new parameters);
`CallGraphs.plan` decides between replay, capture, patch and a plain launch.

The bookkeeping (`CallGraphs`, `GraphStats`) is pure Python; `capture`, `stream_capturing` and
`CapturedGraph` call the driver through cuda.bindings, imported when first needed.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from ..ir.errors import LaunchError

# A cached call (launch_cache.CachedCall) is typed Any here: launch_cache imports this module.
GRAPHS_PER_CALL = 4   # graphs kept per cached call (pointer sets in use at once: usually one)
SEEN_PER_CALL = 8     # keys seen once, remembered per cached call until a second sight
MIN_LAUNCHES = 2      # a call of one launch gains nothing from a graph (cuGraphLaunch is one call too)


def mode_from_environment() -> str:
    """TECC_CUDA_GRAPHS (docs/knobs.md): "0" no graphs; "patch" (the default) graphs, and a
    call's graph patched for new pointers (graph_patch.py); "1" graphs replayed on exact pointers
    only. Read when an executor is made (the runtime runs without the compiler, whose options.py
    lists the knobs, so it reads this one itself)."""
    return os.environ.get("TECC_CUDA_GRAPHS", "patch").strip().lower()


def enabled_by_environment() -> bool:
    """Whether TECC_CUDA_GRAPHS lets executors replay repeated calls as CUDA graphs (not "0")."""
    return mode_from_environment() != "0"


def patching_by_environment() -> bool:
    """Whether TECC_CUDA_GRAPHS=patch asks executors to patch a call's graph for new pointers."""
    return mode_from_environment() == "patch"


@dataclass
class GraphStats:
    """An executor's graph counts: graphs `captured`, graph launches (`launched`, the launch
    right after each capture included), cached calls that `gave_up` after a failed capture, and
    `first_sights`: hits launched plainly because their pointers were new (a steady loop whose
    count keeps growing gets new addresses every call and never replays). With patching
    (TECC_CUDA_GRAPHS=patch, graph_patch.py): graph launches of a graph `patched` for new
    pointers first, the kernel nodes given new parameters (`patched_nodes`), and cached calls
    whose graph was `unpatchable` (its nodes are not one kernel node per launch, in order, or a
    patch failed: `unpatchable_why` says why, the last time), which replay exact pointers only."""

    captured: int = 0
    launched: int = 0
    gave_up: int = 0
    patched: int = 0
    patched_nodes: int = 0
    unpatchable: int = 0
    first_sights: int = field(default=0, compare=False)  # a diagnostic: not part of equality
    unpatchable_why: str = field(default="", compare=False)


TOTALS = GraphStats()  # the same counts summed over every executor of the process (benchmarks print it)


class CallGraphs:
    """One cached call's graphs, by key (the stream and every pointer), least recently used
    first; the keys seen once; whether a capture of this call failed (then no more graphs); and
    whether its graphs can be patched for new pointers (`patchable`: until a mapping of its nodes
    or a patch failed). Bookkeeping only: the graphs are whatever the executor captured
    (anything with `close()`)."""

    __slots__ = ("graphs", "seen", "failed", "patchable", "size", "seen_size")

    def __init__(self, size: int = GRAPHS_PER_CALL, seen_size: int = SEEN_PER_CALL) -> None:
        self.graphs: OrderedDict[Hashable, Any] = OrderedDict()
        self.seen: OrderedDict[Hashable, None] = OrderedDict()
        self.failed = False
        self.patchable = True
        self.size = size
        self.seen_size = seen_size

    def plan(self, key: Hashable, patching: bool) -> str:
        """What a hit with `key` does: "replay" its graph (now the most recently used),
        "capture" one, "patch" the least recently used graph for it, or launch "plain".
        Without patching a key is captured on its second sight. With patching (and graphs of
        this call patchable) the first graph is captured at once (it serves every later pointer
        set); a key seen before, while there is room, gets a graph of its own (pointer sets
        that alternate then replay without patching); any other key patches a graph."""
        if self.failed:
            return "plain"
        if self.find(key) is not None:
            return "replay"
        if not (patching and self.patchable):
            return "capture" if self.second_sight(key) else "plain"
        if not self.graphs:
            return "capture"
        if self.second_sight(key) and len(self.graphs) < self.size:
            return "capture"
        return "patch"

    def oldest(self, usable: Callable[[Any], bool]) -> tuple[Hashable, Any] | None:
        """The least recently used graph for which `usable(graph)`, and its key; None if none is."""
        return next(((key, graph) for key, graph in self.graphs.items() if usable(graph)), None)

    def rekey(self, old: Hashable, new: Hashable) -> None:
        """The graph kept for `old` now holds the pointers of `new` (it was patched): kept under
        `new`, the most recently used; `old` is remembered as seen (a key coming back gets a
        graph of its own, `plan`)."""
        self.graphs[new] = self.graphs.pop(old)
        self._remember(old)

    def drop(self, key: Hashable) -> Any:
        """Forget the graph kept for `key` and return it (to close)."""
        return self.graphs.pop(key)

    def find(self, key: Hashable) -> Any:
        """The graph captured for `key` (now the most recently used), or None."""
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
        return graph

    def second_sight(self, key: Hashable) -> bool:
        """Whether `key` was seen before (then it is forgotten here: a graph is captured for it);
        else it is remembered, the oldest of more than `seen_size` keys forgotten."""
        if key in self.seen:
            del self.seen[key]
            return True
        self._remember(key)
        return False

    def _remember(self, key: Hashable) -> None:
        self.seen[key] = None
        self.seen.move_to_end(key)
        if len(self.seen) > self.seen_size:
            self.seen.popitem(last=False)

    def keep(self, key: Hashable, graph: Any) -> list[Any]:
        """Keep `graph` for `key`; returns the graphs evicted to stay within `size` (to close)."""
        self.graphs[key] = graph
        self.graphs.move_to_end(key)
        evicted = []
        while len(self.graphs) > self.size:
            evicted.append(self.graphs.popitem(last=False)[1])
        return evicted

    def give_up(self) -> list[Any]:
        """No more graphs for this call (a capture failed): returns the graphs kept (to close)."""
        self.failed = True
        dropped = list(self.graphs.values())
        self.graphs.clear()
        self.seen.clear()
        return dropped


# ---- the driver ----------------------------------------------------------------------------------

def _check(err: Any, what: str) -> None:
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        name = getattr(err, "name", str(err))
        raise LaunchError(f"{what} failed: {name}")


def stream_capturing(stream_handle: int) -> bool:
    """Whether the stream is being captured into a graph (cuStreamIsCapturing). True also when
    the driver cannot say: the legacy default stream answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    while a blocking stream of the context is capturing (then launch plainly, as before)."""
    from cuda.bindings import driver

    err, status = driver.cuStreamIsCapturing(driver.CUstream(stream_handle))
    if err != driver.CUresult.CUDA_SUCCESS:
        return True
    return bool(status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


def _destroy_exec(handle: Any, source: list[Any], keep: Any) -> None:
    """Destroy an instantiated graph (a graph still running is freed when it completes:
    cuGraphExecDestroy), and its source graph when it was kept (`source`: empty, or the graph
    whose nodes a patch names). `keep` (the loaded module) lives until then. Errors are ignored:
    the context may already be gone."""
    try:
        from cuda.bindings import driver

        driver.cuGraphExecDestroy(handle)
        for graph in source:
            driver.cuGraphDestroy(graph)
    except Exception:  # noqa: BLE001 - best effort while tearing down
        pass
    del keep


class CapturedGraph:
    """An instantiated graph (CUgraphExec) of one call's launches. `launch(stream)` replays it;
    `close()` (or garbage collection) destroys it. It keeps `keep` (the executor's loaded module,
    whose kernels its nodes launch) alive as long as it exists. `source` is its source graph
    when kept for patching (the nodes `cuGraphExecKernelNodeSetParams` names; else None), and
    `patch` what patching it needs (graph_patch.NodePatch), once its nodes were mapped."""

    __slots__ = ("handle", "launches", "source", "patch", "_sources", "_finalizer", "__weakref__")

    def __init__(self, handle: Any, launches: int, keep: Any = None, source: Any = None) -> None:
        self.handle = handle
        self.launches = launches
        self.source = source
        self.patch: Any = None
        self._sources = [] if source is None else [source]  # the finalizer's list: emptied by drop_source
        self._finalizer = weakref.finalize(self, _destroy_exec, handle, self._sources, keep)
        self._finalizer.atexit = False  # at interpreter exit the driver may be gone before us

    def launch(self, stream_handle: int) -> None:
        from cuda.bindings import driver

        (err,) = driver.cuGraphLaunch(self.handle, driver.CUstream(stream_handle))
        _check(err, "cuGraphLaunch")

    def drop_source(self) -> None:
        """Destroy the source graph now (the graph will not be patched)."""
        if self._sources:
            from cuda.bindings import driver

            driver.cuGraphDestroy(self._sources.pop())
        self.source = None

    def close(self) -> None:
        self._finalizer()


def capture(stream_handle: int, submit: Callable[[], None], launches: int, keep: Any = None,
            keep_source: bool = False) -> CapturedGraph:
    """Capture what `submit()` queues on the stream into a graph and instantiate it; the source
    graph is destroyed, or kept with it (`keep_source`: for patching its nodes).

    The capture is thread-local (CU_STREAM_CAPTURE_MODE_THREAD_LOCAL): other threads' work is
    not affected. `submit` must queue its work on `stream_handle` and do nothing else with the
    device (no allocation, no synchronization). Raises (LaunchError, or what `submit` raised)
    when the capture fails; the stream is left not capturing either way."""
    from cuda.bindings import driver

    stream = driver.CUstream(stream_handle)
    (err,) = driver.cuStreamBeginCapture(stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    _check(err, "cuStreamBeginCapture")
    try:
        submit()
    except BaseException:
        err, graph = driver.cuStreamEndCapture(stream)  # end it, so the stream can be used again
        if err == driver.CUresult.CUDA_SUCCESS and int(graph):
            driver.cuGraphDestroy(graph)
        raise
    err, graph = driver.cuStreamEndCapture(stream)
    _check(err, "cuStreamEndCapture")
    try:
        err, handle = driver.cuGraphInstantiate(graph, 0)
    except BaseException:
        driver.cuGraphDestroy(graph)
        raise
    if err != driver.CUresult.CUDA_SUCCESS or not keep_source:
        driver.cuGraphDestroy(graph)  # the executable graph does not need its source graph
    _check(err, "cuGraphInstantiate")
    return CapturedGraph(handle, launches, keep, source=graph if keep_source else None)


# ---- the executor's graph path -------------------------------------------------------------------

def _has_patch(graph: Any) -> bool:
    """Whether a kept graph can be patched (its nodes were mapped: graph_patch.NodePatch)."""
    return getattr(graph, "patch", None) is not None


class GraphReplay:
    """The CUDA executor's graph path (cuda.py's CudaExecutor inherits it): replay a cached
    call as its graph, capture it, patch it for new pointers (`graph_patching`), launch it. It
    uses the executor's stream, device, loaded module (`object_code`), `_submit` (one launch),
    `_with_maps` (a cached launch's parameters for the call's pointers) and `_tensor_map` (an
    encoded map, cached)."""

    host: Any
    device: Any
    stream: Any
    _stream_ptr: int
    object_code: Any
    last_launches: list[Any]
    graph_stats: GraphStats
    graph_patching: bool
    _capture_stream: Any
    _capture_lock: Any
    _graph_lock: Any
    _submit: Callable[..., None]
    _with_maps: Callable[[Any, list[int]], list[Any]]
    _tensor_map: Callable[..., Any]

    def _replay_graph(self, cached: Any, ptrs: list[int]) -> bool:
        """Launch the cached call as its CUDA graph for these pointers (and this stream): the
        graph of these exact pointers, one captured now (`CallGraphs.plan`), or, with patching,
        a graph of the call patched for them (graph_patch.py). False (nothing launched) when the
        call launches plainly: pointers seen for the first time (without patching), a stream
        someone else is capturing, a call whose capture or patch failed."""
        if not self.graph_patching:
            return self._replay_planned(cached, ptrs)
        with self._graph_lock:  # a graph patched and launched by one thread at a time
            return self._replay_planned(cached, ptrs)

    def _replay_planned(self, cached: Any, ptrs: list[int]) -> bool:
        state = cached.graphs
        key = (self._stream_ptr, *ptrs)
        action = state.plan(key, self.graph_patching)
        victim = state.oldest(_has_patch) if action == "patch" else None
        if action == "patch" and victim is None:
            action = "capture"  # the graphs were captured before patching was switched on
        if action == "plain":
            if not state.failed:
                self.graph_stats.first_sights += 1
                TOTALS.first_sights += 1
            return False
        if self._stream_capturing():
            return False  # a user's capture (torch.cuda.graph): the plain launches go into it
        if action == "replay":
            graph = state.graphs[key]
        elif victim is not None:
            graph = self._patch(cached, victim, key, ptrs)
        else:
            graph = self._capture(cached, ptrs)
            if graph is not None:
                for evicted in state.keep(key, graph):
                    evicted.close()
        if graph is None:
            return False
        try:
            self._launch_graph(graph)
        except Exception as exc:  # noqa: BLE001 - the driver's error, named with the call
            self.last_launches = []
            names = [r.kernel for r in cached.records]
            listed = ", ".join(names[:6]) + (f", ... {names[-1]}" if len(names) > 6 else "")
            raise LaunchError(f"{self.host.name}: the CUDA graph of its {len(names)} launches ({listed}) failed to "
                              f"launch: {exc}") from exc
        self.graph_stats.launched += 1
        TOTALS.launched += 1
        self.last_launches = list(cached.records)
        return True

    def _capture(self, cached: Any, ptrs: list[int]) -> Any:
        """The call's launches for `ptrs` captured as a graph; None when the capture failed (the
        call then launches plainly from now on; nothing is raised here: a launch that really
        fails raises from the plain launch). The parameters (tensor maps encoded) are made
        before the capture, so that only the launches happen while capturing. With patching,
        the graph's nodes are then mapped to the launches (`_prepare_patch`)."""
        params = [self._with_maps(launch, ptrs) for launch in cached.launches]

        def submit_all(stream: Any) -> None:
            for launch, launch_params in zip(cached.launches, params):
                self._submit(launch.kernel, launch.config, launch_params, stream)

        try:
            graph = self._capture_graph(submit_all, len(params))
        except Exception:  # noqa: BLE001 - any failure: launch plainly instead, and stop trying
            for dropped in cached.graphs.give_up():
                dropped.close()
            self.graph_stats.gave_up += 1
            TOTALS.gave_up += 1
            return None
        self.graph_stats.captured += 1
        TOTALS.captured += 1
        if self.graph_patching:
            if not cached.graphs.patchable:
                graph.drop_source()
            else:
                why = self._prepare_patch(graph, cached, params, ptrs)
                if why:
                    self._unpatchable(cached, why)
        return graph

    def _prepare_patch(self, graph: Any, cached: Any, params: list[list[Any]], ptrs: list[int]) -> str:
        """Make `graph` patchable (its `patch`, graph_patch.NodePatch): each launch's parameters
        packed as captured, the graph's nodes in launch order. Returns why not ("" when done);
        then its source graph is destroyed and it replays its exact pointers only."""
        from .graph_patch import NodePatch, pointer_users
        from .tensor_map import PackedParameters

        try:
            packed = [PackedParameters(p) for p in params]
            found = self._graph_nodes(graph, cached)
            if not isinstance(found, str):
                graph.patch = NodePatch(found[0], found[1], packed, pointer_users(cached.launches, len(ptrs)), ptrs)
                return ""
            why = found
        except Exception as exc:  # noqa: BLE001 - a parameter that cannot be packed, a driver error
            why = str(exc)
        graph.drop_source()
        return why

    def _patch(self, cached: Any, victim: tuple[Hashable, Any], key: Hashable, ptrs: list[int]) -> Any:
        """The call's graph `victim` (its key and graph: the least recently used patchable one)
        patched for `ptrs` and kept under `key`; None when a patch failed (the graph is dropped
        and the call patches no more)."""
        state = cached.graphs
        old_key, graph = victim
        try:
            changed = graph.patch.patch(cached.launches, ptrs, self._tensor_map, self._node_setter(graph))
        except Exception as exc:  # noqa: BLE001 - half patched: drop it, launch plainly
            state.drop(old_key).close()
            self._unpatchable(cached, f"a patch failed: {exc}")
            return None
        state.rekey(old_key, key)
        self.graph_stats.patched += 1
        self.graph_stats.patched_nodes += changed
        TOTALS.patched += 1
        TOTALS.patched_nodes += changed
        return graph

    def _unpatchable(self, cached: Any, why: str) -> None:
        cached.graphs.patchable = False
        self.graph_stats.unpatchable += 1
        self.graph_stats.unpatchable_why = why
        TOTALS.unpatchable += 1
        TOTALS.unpatchable_why = why

    def _capture_graph(self, submit: Callable[[Any], None], launches: int) -> Any:
        """Capture `submit(stream)`'s launches into an instantiated graph, on the executor's
        private capture stream (made once, non-blocking: cuda.core's default). Not the caller's
        stream: that may be the legacy default stream, which cannot be captured, and a graph
        launches on any stream. The executor's own stream is left as it is, so another thread's
        call meanwhile launches where it should. With patching, the source graph is kept."""
        with self._capture_lock:
            if self._capture_stream is None:
                self._capture_stream = self.device.create_stream()
            stream = self._capture_stream
            try:
                return capture(int(stream.handle), lambda: submit(stream), launches, keep=self.object_code,
                               keep_source=self.graph_patching)
            except Exception:
                self._capture_stream = None  # a fresh one next time, whatever state this one is in
                raise

    def _graph_nodes(self, graph: Any, cached: Any) -> tuple[list[Any], list[Any]] | str:
        """The captured graph's kernel nodes in launch order and their parameter structures,
        checked against the call's launches (graph_patch.kernel_nodes), or why not."""
        from .graph_patch import kernel_handles, kernel_nodes

        expected = [(kernel_handles(launch.kernel.handle), launch.grid, launch.block, launch.info.dynamic_smem)
                    for launch in cached.launches]
        return kernel_nodes(graph.source, expected)

    def _node_setter(self, graph: Any) -> Callable[[Any, Any], None]:
        """`set(node, node_params)` for the nodes of `graph` (graph_patch.node_setter)."""
        from .graph_patch import node_setter

        return node_setter(graph.handle)

    def _launch_graph(self, graph: Any) -> None:
        graph.launch(self._stream_ptr)

    def _stream_capturing(self) -> bool:
        """Whether the call's stream is being captured by someone else (cuStreamIsCapturing)."""
        return stream_capturing(self._stream_ptr)


__all__ = ["CallGraphs", "CapturedGraph", "GRAPHS_PER_CALL", "GraphReplay", "GraphStats", "MIN_LAUNCHES", "SEEN_PER_CALL",
           "TOTALS", "capture", "enabled_by_environment", "mode_from_environment", "patching_by_environment",
           "stream_capturing"]
