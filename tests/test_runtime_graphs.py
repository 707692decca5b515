"""CUDA graphs of cached calls, without a GPU (tecc/runtime/graphs.py): the bookkeeping (keys seen
once, graphs by exact pointers, least recently used evicted and closed, a failed capture gives
up), when the executor uses graphs and when it launches plainly, the capture and launch calls
to the driver (a stand-in driver), and the launch cache's overlap check as a sweep (against the
check over every pair). The executor is test_runtime_fastpath's stub; the GPU tests are in
tests/test_runtime_graphs_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from test_runtime_fastpath import FakeDeviceArray, StubExecutor, TorchLike, faketorch, full_path  # noqa: F401

from tecc.ir import dtype as dt
from tecc.ir.errors import LaunchError
from tecc.ir.expr import Const, Var
from tecc.ir.stmt import Buffer
from tecc.runtime import graphs
from tecc.runtime import launch_cache
from tecc.runtime.cuda import CudaExecutor
from tecc.runtime.host import Call, HostProgram, KernelInfo
from tecc.runtime.marshal import written_overlap

ONE = Const(1, dt.int32)


def two_kernel_program() -> HostProgram:
    """a[i] = f(x[i]) (kernel `first`), b[i] = g(x[i], a[i]) (kernel `second`): two launches."""
    n = Var("n", dt.int32, "size")
    x, a, b = (Buffer(name, dt.float32, (n,)) for name in ("x", "a", "b"))
    first = KernelInfo("first", (x, a, n), ((n + 255) // 256, ONE, ONE), (256, 1, 1))
    second = KernelInfo("second", (x, a, b, n), ((n + 127) // 128, ONE, ONE), (128, 1, 1))
    return HostProgram("pair", (x, a, b, n), (), (first, second),
                       (Call("first", ("x", "a", "n")), Call("second", ("x", "a", "b", "n"))), ("a", "b"))


def one_kernel_program() -> HostProgram:
    n = Var("n", dt.int32, "size")
    x, y = Buffer("x", dt.float32, (n,)), Buffer("y", dt.float32, (n,))
    kernel = KernelInfo("scale", (x, y, n), ((n + 255) // 256, ONE, ONE), (256, 1, 1))
    return HostProgram("scale", (x, y, n), (), (kernel,), (Call("scale", ("x", "y", "n")),), ("y",))


def pair_arrays(base=0x7000_0000, n=4096):
    return [FakeDeviceArray((n,), base + k * 0x10_0000) for k in range(3)]


class FakeGraph:
    """A captured graph: the launches captured into it; `closed` once destroyed."""

    def __init__(self, launches):
        self.launches = launches
        self.closed = False

    def close(self):
        self.closed = True


class GraphStub(StubExecutor):
    """The stub executor with graphs on: a capture records the launches `submit` queues (they do
    not run: they leave `submitted`, which lists what ran plainly), a graph launch is recorded in
    `graph_launches` with its stream; `capturing` plays a user's capture of the call's stream."""

    def __init__(self, host, **kw):
        super().__init__(host, **kw)
        self.cuda_graphs = True
        self.capturing = False
        self.fail_capture = False
        self.graph_launches = []

    def _stream_capturing(self):
        return self.capturing

    def _capture_graph(self, submit, launches):
        before = len(self.submitted)
        submit(type("CaptureStream", (), {"handle": 0xCAF})())
        captured = self.submitted[before:]
        del self.submitted[before:]
        if self.fail_capture:
            raise LaunchError("cuStreamEndCapture failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (stub)")
        assert len(captured) == launches
        return FakeGraph(captured)

    def _launch_graph(self, graph):
        self.graph_launches.append((graph, self._stream_ptr))


def ran(f):
    """Every launch that ran, plain or in a graph, as (kernel, parameters)."""
    return [(k, p) for k, _, _, p in f.submitted] + [(k, p) for g, _ in f.graph_launches for k, _, _, p in g.launches]


# ---- the bookkeeping -----------------------------------------------------------------------------

def test_a_key_is_captured_on_its_second_sight_and_graphs_are_evicted_least_recently_used():
    state = graphs.CallGraphs(size=2, seen_size=2)
    assert not state.second_sight("a") and state.second_sight("a"), "the second sight of a key captures"
    assert not state.second_sight("a"), "a key handed over for capture is forgotten by the seen list"
    assert state.keep("a", "graph a") == [] and state.keep("b", "graph b") == []
    assert state.find("a") == "graph a"  # now the most recently used
    assert state.keep("c", "graph c") == ["graph b"], "the least recently used graph is evicted"
    assert state.find("b") is None and state.find("c") == "graph c"
    for key in ("x", "y", "z"):
        state.second_sight(key)
    assert not state.second_sight("x"), "past seen_size keys the oldest is forgotten"
    assert sorted(state.give_up()) == ["graph a", "graph c"] and state.failed and state.find("a") is None


def test_the_environment_turns_graphs_off(monkeypatch):
    monkeypatch.delenv("TECC_CUDA_GRAPHS", raising=False)
    assert graphs.enabled_by_environment() and graphs.patching_by_environment(), "patching graphs is the default"
    monkeypatch.setenv("TECC_CUDA_GRAPHS", "0")
    assert not graphs.enabled_by_environment()
    monkeypatch.setenv("TECC_CUDA_GRAPHS", "1")
    assert graphs.enabled_by_environment() and not graphs.patching_by_environment()


# ---- the executor: when it replays a graph --------------------------------------------------------

def test_a_repeated_call_replays_one_graph_from_its_third_call(full_path):
    f = GraphStub(two_kernel_program())
    args = pair_arrays()
    for _ in range(5):
        f(*args)
    assert full_path["binds"] == 1
    assert len(f.submitted) == 4, "the full path and the first hit launch plainly (two launches each)"
    assert f.graph_stats == graphs.GraphStats(captured=1, launched=3, gave_up=0)
    assert f.graph_stats.first_sights == 1, "the first hit's pointers were new"
    graph = f.graph_launches[0][0]
    assert all(g is graph for g, _ in f.graph_launches) and all(s == 0x5EED for _, s in f.graph_launches)
    ptrs = [a.__cuda_array_interface__["data"][0] for a in args]
    assert [k for k, *_ in graph.launches] == ["<kernel first>", "<kernel second>"]
    assert graph.launches[0][3][:2] == [ptrs[0], ptrs[1]] and graph.launches[1][3][:3] == ptrs
    assert graph.launches == f.submitted[2:], "the graph holds exactly the launches of a plain hit"
    assert [r.kernel for r in f.last_launches] == ["first", "second"]


def test_new_pointers_miss_the_graph_and_get_their_own_on_their_second_sight(full_path):
    f = GraphStub(two_kernel_program())
    old, new = pair_arrays(), pair_arrays(base=0x9000_0000)
    for _ in range(3):
        f(*old)
    f(*new)
    assert len(f.graph_launches) == 1, "new pointers launch plainly"
    new_ptrs = [a.__cuda_array_interface__["data"][0] for a in new]
    assert f.submitted[-1][3][:3] == new_ptrs
    f(*new)
    assert f.graph_stats.captured == 2 and f.graph_launches[-1][0].launches[1][3][:3] == new_ptrs
    f(*old)
    assert f.graph_launches[-1][0] is f.graph_launches[0][0], "each pointer set keeps its own graph"
    assert full_path["binds"] == 1


def test_past_graphs_per_call_the_least_recently_used_graph_is_destroyed(full_path):
    f = GraphStub(two_kernel_program())
    sets = [pair_arrays(base=0x1000_0000 * (k + 1)) for k in range(graphs.GRAPHS_PER_CALL + 1)]
    for args in sets:
        for _ in range(3):
            f(*args)
    made = [g for g, _ in f.graph_launches[::2]]
    assert len(made) == graphs.GRAPHS_PER_CALL + 1 == f.graph_stats.captured
    assert made[0].closed and not any(g.closed for g in made[1:])
    (cached,) = f._calls.values()
    assert len(cached.graphs.graphs) == graphs.GRAPHS_PER_CALL


def test_a_failed_capture_launches_plainly_and_is_not_tried_again(full_path):
    f = GraphStub(two_kernel_program())
    f.fail_capture = True
    args = pair_arrays()
    for _ in range(5):
        f(*args)
    assert f.graph_launches == [] and len(f.submitted) == 10, "every call launched its two kernels plainly"
    assert f.graph_stats == graphs.GraphStats(captured=0, launched=0, gave_up=1)
    (cached,) = f._calls.values()
    assert cached.graphs.failed


@pytest.mark.parametrize("why", ["switched off", "one launch", "debug_sync", "wrapped launch", "stream captured"])
def test_calls_launch_plainly_where_graphs_do_not_apply(full_path, monkeypatch, why):
    program = one_kernel_program() if why == "one launch" else two_kernel_program()
    f = GraphStub(program, debug_sync=why == "debug_sync")
    if why == "switched off":
        f.cuda_graphs = False
    if why == "debug_sync":
        monkeypatch.setattr(CudaExecutor, "_synchronize", lambda self, message: None)
    if why == "wrapped launch":  # what tc.profile() does
        plain = CudaExecutor._launch
        monkeypatch.setattr(CudaExecutor, "_launch", lambda self, *a: plain(self, *a))
    f.capturing = why == "stream captured"
    args = pair_arrays()[: len(program.buffer_params)]
    for _ in range(4):
        f(*args)
    assert f.graph_launches == [] and f.graph_stats.captured == 0
    assert len(f.submitted) == 4 * len(program.kernels)


def test_a_graph_that_fails_to_launch_is_a_launch_error_naming_the_program(full_path):
    f = GraphStub(two_kernel_program())

    def fail(graph):
        raise RuntimeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

    args = pair_arrays()
    f(*args)
    f(*args)
    f._launch_graph = fail
    with pytest.raises(LaunchError, match=r"pair: the CUDA graph of its 2 launches \(first, second\) failed to launch: "
                                          r"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        f(*args)


def test_a_followed_calls_stream_temporaries_are_part_of_the_key(full_path, faketorch):
    faketorch.uint8 = "uint8"
    made = []

    class Allocating(TorchLike):
        def new_zeros(self, shape, dtype):
            array = np.zeros(shape, np.uint8)
            made.append(array)
            return TorchLike(array, dtype=dtype)

    Allocating.__module__ = "faketorch"
    n = Var("n", dt.int32, "size")
    x, out = Buffer("x", dt.float32, (n,)), Buffer("out", dt.float32, (n,))
    part = Buffer("part", dt.float32, (n,), zero_init=True)
    k1 = KernelInfo("stage1", (x, part, n), ((n + 255) // 256, ONE, ONE), (256, 1, 1))
    k2 = KernelInfo("stage2", (part, out, n), ((n + 255) // 256, ONE, ONE), (256, 1, 1))
    program = HostProgram("staged", (x, out, n), (part,), (k1, k2),
                          (Call("stage1", ("x", "part", "n")), Call("stage2", ("part", "out", "n"))), ("out",))

    class FollowingGraphStub(GraphStub):
        follows_producer = True

        def _use_stream(self, handle):
            self.stream = type("FakeStream", (), {"handle": handle, "sync": lambda self: None})()
            self._stream_ptr = handle

    f = FollowingGraphStub(program)
    args = [Allocating(np.zeros(1024, np.float32)) for _ in range(2)]
    faketorch.current[0] = 0x1234
    for _ in range(3):
        f(*args)
    assert len(made) == 1 and f.graph_stats.captured == 1 and f.graph_launches[-1][1] == 0x1234
    temp = made[0].ctypes.data
    graph = f.graph_launches[-1][0]
    assert graph.launches[0][3][1] == temp and graph.launches[1][3][0] == temp, "the graph uses the kept temporary"
    faketorch.current[0] = 0x5678  # another stream: its own temporary, so another key
    f(*args)
    assert len(made) == 2 and len(f.graph_launches) == 1 and f.submitted[-1][3][0] == made[1].ctypes.data
    f(*args)
    assert f.graph_stats.captured == 2 and f.graph_launches[-1][1] == 0x5678
    assert f.graph_launches[-1][0].launches[0][3][1] == made[1].ctypes.data


# ---- the capture: the executor's side and the driver calls (a stand-in driver) --------------------

class FakeDriver:
    """The driver calls graphs.py makes, recorded; `fail` names one to fail."""

    def __init__(self, monkeypatch, fail=None):
        from cuda.bindings import driver

        self.driver, self.calls, self.fail = driver, [], fail
        ok, bad = driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        result = lambda name: bad if name == self.fail else ok  # noqa: E731

        def record(name, value):
            def call(*args):
                self.calls.append((name, *[int(a) if hasattr(a, "getPtr") else a for a in args]))
                return (result(name),) + value

            return call

        for name, value in [("cuStreamBeginCapture", ()), ("cuStreamEndCapture", (driver.CUgraph(0xA11),)),
                            ("cuGraphInstantiate", (driver.CUgraphExec(0xE0),)), ("cuGraphDestroy", ()),
                            ("cuGraphLaunch", ()), ("cuGraphExecDestroy", ()),
                            ("cuStreamIsCapturing", (driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE,))]:
            monkeypatch.setattr(driver, name, record(name, value))

    def names(self):
        return [c[0] for c in self.calls]


def test_capture_instantiates_destroys_the_source_graph_and_replays_until_closed(monkeypatch):
    drv = FakeDriver(monkeypatch)
    queued = []
    graph = graphs.capture(0xCAF, lambda: queued.append("launches"), 2, keep="module")
    assert queued == ["launches"]
    assert drv.names() == ["cuStreamBeginCapture", "cuStreamEndCapture", "cuGraphInstantiate", "cuGraphDestroy"]
    begin = drv.calls[0]
    assert begin[1] == 0xCAF and begin[2] == drv.driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    graph.launch(0x1234)
    assert drv.calls[-1] == ("cuGraphLaunch", 0xE0, 0x1234)
    graph.close()
    graph.close()
    del graph
    assert drv.names().count("cuGraphExecDestroy") == 1, "an executable graph is destroyed once"
    dropped = graphs.capture(0xCAF, lambda: None, 2)
    del dropped
    assert drv.names().count("cuGraphExecDestroy") == 2, "a graph no one holds is destroyed when collected"
    assert not graphs.stream_capturing(0x1234)


def test_a_capture_that_fails_ends_the_capture_and_raises(monkeypatch):
    drv = FakeDriver(monkeypatch)

    def submit():
        raise LaunchError("a launch failed while capturing")

    with pytest.raises(LaunchError, match="a launch failed while capturing"):
        graphs.capture(0xCAF, submit, 2)
    assert drv.names() == ["cuStreamBeginCapture", "cuStreamEndCapture", "cuGraphDestroy"]
    drv = FakeDriver(monkeypatch, fail="cuGraphInstantiate")
    with pytest.raises(LaunchError, match="cuGraphInstantiate failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"):
        graphs.capture(0xCAF, lambda: None, 2)
    assert drv.names()[-1] == "cuGraphDestroy", "the source graph is destroyed when instantiation fails"
    drv = FakeDriver(monkeypatch, fail="cuStreamIsCapturing")
    assert graphs.stream_capturing(1), "when the driver cannot say, the stream counts as captured"


def test_the_executor_captures_on_its_own_stream_and_launches_the_graph_on_the_calls(full_path, monkeypatch):
    class Recording(StubExecutor):
        def _submit(self, kernel, config, params, stream=None):
            handle = self._stream_ptr if stream is None else stream.handle
            self.submitted.append((kernel, config.grid, config.block, list(params), handle))

        def _stream_capturing(self):
            return False

    f = Recording(two_kernel_program())
    f.cuda_graphs = True
    f.object_code = "module"
    made = []
    f.device.create_stream = lambda: made.append(0xCAF) or type("Stream", (), {"handle": 0xCAF})()
    captured = []

    def capture(stream_handle, submit, launches, keep=None, keep_source=False):
        assert not keep_source, "without patching the source graph is not kept"
        before = len(f.submitted)
        submit()
        queued = f.submitted[before:]
        del f.submitted[before:]  # captured, not run
        captured.append((stream_handle, launches, keep, [s[-1] for s in queued]))
        return FakeGraph(queued)

    monkeypatch.setattr(graphs, "capture", capture)
    launched = []
    f._launch_graph = lambda graph: launched.append(f._stream_ptr)
    args = pair_arrays()
    for _ in range(4):
        f(*args)
    assert captured == [(0xCAF, 2, "module", [0xCAF, 0xCAF])], "the launches are captured on the capture stream"
    assert launched == [0x5EED, 0x5EED] and made == [0xCAF], "the graph launches on the call's stream"
    assert [s[-1] for s in f.submitted] == [0x5EED] * 4, "the plain launches went to the call's stream"


# ---- the launch cache's overlap check --------------------------------------------------------------

def _random_arrays(rng, count, unit, places, longest, share_written):
    """`count` arrays' pointers (multiples of `unit` below unit * places), byte spans (a fifth
    reaching below the pointer, as negative strides do) and written flags."""
    ptrs = [int(p) * unit for p in rng.integers(0, places, count)]
    spans = []
    for _ in range(count):
        lo = -int(rng.integers(0, 3)) * 64 if rng.random() < 0.2 else 0
        spans.append((lo, int(rng.integers(1, longest))))
    return ptrs, spans, [bool(w) for w in rng.random(count) < share_written]


def test_the_overlap_sweep_agrees_with_the_check_over_every_pair():
    rng = np.random.default_rng()
    for case in range(3000):
        count = int(rng.integers(1, 7))
        ptrs, spans, written = _random_arrays(rng, count, 16, 40, 200, 0.5)
        pairs = [(i, j) for i in range(count) for j in range(i + 1, count) if written[i] or written[j]]
        expected = any(ptrs[i] + spans[i][0] < ptrs[j] + spans[j][1] and ptrs[j] + spans[j][0] < ptrs[i] + spans[i][1]
                       for i, j in pairs)
        assert written_overlap(ptrs, spans, written) == expected, f"case {case}: {ptrs}, {spans}, {written}"


def test_the_numpy_pointer_checks_agree_with_the_python_ones():
    """marshal.PointerChecks (what a cached call of 32 arguments or more runs per new pointer
    set) gives the verdict of the alignment loop and the overlap sweep, ties in the sort and
    negative strides included."""
    from tecc.runtime.marshal import PointerChecks

    rng = np.random.default_rng()
    for case in range(3000):
        count = int(rng.integers(1, 40))
        ptrs, spans, written = _random_arrays(rng, count, 8, 60, 120, 0.3)
        needs = [int(n) for n in rng.choice([1, 2, 4, 8, 16], count)]
        expected = all(p % n == 0 for p, n in zip(ptrs, needs)) and not written_overlap(ptrs, spans, written)
        assert PointerChecks(spans, written, needs).passes(ptrs) == expected, f"case {case}: {ptrs}, {spans}, {written}, {needs}"


def test_a_cached_call_checks_a_pointer_set_once(full_path, monkeypatch):
    f = StubExecutor(two_kernel_program())
    args = pair_arrays()
    f(*args)
    sweeps = []
    real = launch_cache.written_overlap
    monkeypatch.setattr(launch_cache, "written_overlap", lambda *a: sweeps.append(1) or real(*a))
    for _ in range(3):
        f(*args)
    assert len(sweeps) == 1 and len(f.submitted) == 8, "an accepted pointer set is not checked again"
    x, a, _ = args
    overlapping = FakeDeviceArray((4096,), a.__cuda_array_interface__["data"][0] + 64)
    with pytest.raises(Exception, match=r"argument 1 \(a\) and argument 2 \(b\) of pair overlap in memory"):
        f(x, a, overlapping)


def test_a_relaunch_runs_the_entry_a_call_returned_on_other_pointers(full_path):
    """`CudaExecutor.keyed_call` returns the cached call it was remembered as; `relaunch` launches it
    on other pointers without reading a key (no full-path view, no binding), refuses a stale
    entry (the executor's cache generation moved on) and pointers that overlap a written array,
    launching nothing then."""
    from tecc.runtime.launch_cache import LaunchEntry

    f = StubExecutor(two_kernel_program())
    f.cuda_graphs = False
    cached = f.keyed_call(tuple(pair_arrays()))
    assert cached is not None and len(f.submitted) == 2
    entry = LaunchEntry(cached, f.cache_generation)
    views, binds = full_path["views"], full_path["binds"]
    other = pair_arrays(base=0x9000_0000)
    ptrs = [a.__cuda_array_interface__["data"][0] for a in other]
    assert f.relaunch(entry, ptrs, tuple(other))
    assert len(f.submitted) == 4 and (full_path["views"], full_path["binds"]) == (views, binds)
    relaunched = [p for _, _, _, params in f.submitted[2:] for p in params]
    assert set(ptrs) <= set(relaunched) and not {a.__cuda_array_interface__["data"][0] for a in pair_arrays()} & set(relaunched)
    overlapping = [ptrs[0], ptrs[1], ptrs[1] + 64]
    assert not f.relaunch(entry, overlapping, tuple(other)) and len(f.submitted) == 4
    f.cache_generation += 1
    assert not f.relaunch(entry, ptrs, tuple(other)) and len(f.submitted) == 4


def test_a_runnable_kernel_hands_out_entries_that_relaunch(full_path):
    """RunnableKernel.call_entry makes the call and returns its entry with the executor's
    generation; relaunch passes it back to the executor (what tecc/torch/runtime.py does)."""
    from tecc.runtime.runnable import RunnableKernel

    f = StubExecutor(two_kernel_program())
    f.cuda_graphs = False
    k = RunnableKernel(f.host)
    k._executor = f
    entry = k.call_entry(*pair_arrays())
    again = k.call_entry(*pair_arrays(base=0xA000_0000))  # a hit: the same entry
    assert entry is not None and again is not None and again.cached is entry.cached
    assert entry.generation == f.cache_generation
    other = pair_arrays(base=0x9000_0000)
    assert k.relaunch(entry, [a.__cuda_array_interface__["data"][0] for a in other], tuple(other))
    assert len(f.submitted) == 6
