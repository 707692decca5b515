"""CUDA graphs patched for new pointers, without a GPU (tecc/runtime/graph_patch.py; the executor's
side in tecc/runtime/graphs.py, TECC_CUDA_GRAPHS=patch): which launches a pointer change reaches,
the chain check that maps a captured graph's nodes to the launches (a stand-in driver), the
packed parameters a patch writes (read back as the bytes a kernel would receive, tensor maps
included), and the executor's decisions (capture, patch, exact replay, the fallbacks) checked
by running the same calls with plain launches and comparing every launch's parameter bytes. The
GPU tests are in tests/test_runtime_graphs_gpu.py."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest
from test_runtime_fastpath import (TMA_TEMPORARY_SIZES, StubExecutor, TorchLike, _followed_stream_stub,  # noqa: F401
                                   faketorch, full_path, tma_temporary_gemm)
from test_runtime_graphs import FakeDriver, FakeGraph, GraphStub, pair_arrays, two_kernel_program

from tecc.ir.errors import LaunchError
from tecc.runtime import arena, graph_patch, graphs
from tecc.runtime.tensor_map import EncodedTensorMap, PackedParameters


def param_bytes(params):
    """The bytes each parameter passes to the kernel (what cuda.core or cuLaunchKernel copy)."""
    packed = PackedParameters(params)
    return [packed.parameter_bytes(j) for j in range(len(params))]


def fake_map(ptr):
    """A stand-in encoded tensor map: 128 bytes that name the pointer."""
    return EncodedTensorMap(int(ptr).to_bytes(8, "little") * 16)


# ---- the pure decisions ---------------------------------------------------------------------------

def launch_with(array_slots=(), map_slots=()):
    return types.SimpleNamespace(array_slots=tuple(array_slots), map_slots=tuple(map_slots))


def test_a_changed_pointer_reaches_exactly_the_launches_that_take_it():
    launches = [launch_with([(0, 0), (1, 1)]), launch_with([(0, 0), (1, 1), (2, 2)]),
                launch_with([(0, 3)], [(1, 1, "spec", (4,), (1,))])]
    users = graph_patch.pointer_users(launches, 5)
    assert users == ((0, 1), (0, 1, 2), (1,), (2,), ()), "pointer 1 is read by slot in 0, 1 and by map in 2"
    old = (10, 20, 30, 40, 50)
    assert graph_patch.changed_launches(users, old, old) == []
    assert graph_patch.changed_launches(users, old, (10, 20, 31, 40, 50)) == [1]
    assert graph_patch.changed_launches(users, old, (10, 21, 30, 40, 50)) == [0, 1, 2]
    assert graph_patch.changed_launches(users, old, (10, 20, 30, 41, 50)) == [2]
    assert graph_patch.changed_launches(users, old, (10, 20, 30, 40, 51)) == [], "a pointer no launch takes"


def test_a_graph_maps_to_its_launches_only_as_one_chain():
    assert graph_patch.chain_order([3, 1, 2], [(2, 3), (1, 2)]) == [1, 2, 3]
    assert graph_patch.chain_order([7], []) == [7]
    assert "two dependents" in graph_patch.chain_order([1, 2, 3], [(1, 2), (1, 3)])
    assert "two dependencies" in graph_patch.chain_order([1, 2, 3], [(1, 3), (2, 3)])
    assert "2 nodes without a dependency" in graph_patch.chain_order([1, 2, 3], [(1, 2)])
    assert "0 nodes without a dependency" in graph_patch.chain_order([1, 2], [(1, 2), (2, 1)])
    assert "outside the graph" in graph_patch.chain_order([1, 2], [(1, 9)])


def test_a_patch_writes_the_new_pointers_and_maps_into_the_packed_parameters_of_the_changed_nodes():
    """Three launches (pointers, an int32 scalar, a tensor map of pointer 1); pointer 2 moves, then
    pointer 1: the patched nodes' parameters read back byte for byte as freshly packed ones."""
    spec, shape, strides = "spec", (64, 64), (64, 1)
    launches = [launch_with([(0, 0), (1, 1)]), launch_with([(0, 2)]),
                launch_with([(0, 0)], [(2, 1, spec, shape, strides)])]
    templates = [[None, None, np.int32(4096)], [None, np.float32(0.5)], [None, np.int64(-3), None]]

    def params_for(ptrs):
        out = []
        for launch, template in zip(launches, templates):
            p = list(template)
            for pos, index in launch.array_slots:
                p[pos] = ptrs[index]
            for pos, index, *_ in launch.map_slots:
                p[pos] = fake_map(ptrs[index])
            out.append(p)
        return out

    ptrs = [0x7000_0000, 0x7100_0000, 0x7200_0000]
    node_params = [types.SimpleNamespace(kernelParams=None, extra=None) for _ in launches]
    packed = [PackedParameters(p) for p in params_for(ptrs)]
    patch = graph_patch.NodePatch(["n0", "n1", "n2"], node_params, packed,
                                  graph_patch.pointer_users(launches, 3), ptrs)
    assert [p.kernelParams for p in node_params] == [pk.address for pk in packed] and node_params[0].extra == 0
    encoded, handed = [], []

    def tensor_map(s, ptr, sh, st):
        assert (s, sh, st) == (spec, shape, strides)
        encoded.append(ptr)
        return fake_map(ptr)

    def set_params(node, params):
        handed.append(node)
        position = ["n0", "n1", "n2"].index(node)
        n = len(templates[position])
        pointers = (ctypes.c_void_p * n).from_address(params.kernelParams)
        sizes = [len(b) for b in param_bytes(params_for(ptrs)[position])]
        got = [ctypes.string_at(pointers[j], sizes[j]) for j in range(n)]
        assert got == param_bytes(params_for(moved)[position]), f"node {node} reads the new parameters"

    moved = [ptrs[0], ptrs[1], 0x7300_0000]
    assert patch.patch(launches, moved, tensor_map, set_params) == 1
    assert handed == ["n1"] and encoded == [] and patch.ptrs == tuple(moved)
    handed.clear()
    moved = [ptrs[0], 0x7400_0000, 0x7300_0000]
    assert patch.patch(launches, moved, tensor_map, set_params) == 2
    assert handed == ["n0", "n2"] and encoded == [0x7400_0000], "the map of the moved pointer is encoded anew"
    with pytest.raises(LaunchError, match="2 nodes, 3 parameter sets"):
        graph_patch.NodePatch(["a", "b"], node_params, packed, (), ptrs)


# ---- the node mapping through a stand-in driver ---------------------------------------------------

class FakeGraphDriver:
    """A captured graph as the driver lists it: `nodes` (handle -> kind, func, grid, block, smem)
    and `edges`; cuGraphExecKernelNodeSetParams recorded."""

    def __init__(self, monkeypatch, nodes, edges):
        from cuda.bindings import driver

        self.driver, self.nodes, self.edges, self.set = driver, nodes, edges, []
        ok = driver.CUresult.CUDA_SUCCESS
        kinds = {"kernel": driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL,
                 "memset": driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET}

        def get_nodes(graph, count=0):
            listed = [driver.CUgraphNode(h) for h in self.nodes] if count else []
            return ok, listed, len(self.nodes)

        def get_edges(graph, count=0):
            sources = [driver.CUgraphNode(a) for a, _ in self.edges] if count else []
            targets = [driver.CUgraphNode(b) for _, b in self.edges] if count else []
            return ok, sources, targets, [None] * len(sources), len(self.edges)

        def node_params(node):
            kind, func, grid, block, smem = self.nodes[int(node)]
            p = driver.CUDA_KERNEL_NODE_PARAMS()
            p.func = driver.CUfunction(func)
            p.gridDimX, p.gridDimY, p.gridDimZ = grid
            p.blockDimX, p.blockDimY, p.blockDimZ = block
            p.sharedMemBytes = smem
            return ok, p

        monkeypatch.setattr(driver, "cuGraphGetNodes", get_nodes)
        monkeypatch.setattr(driver, "cuGraphGetEdges", get_edges)
        monkeypatch.setattr(driver, "cuGraphNodeGetType", lambda node: (ok, kinds[self.nodes[int(node)][0]]))
        monkeypatch.setattr(driver, "cuGraphKernelNodeGetParams", node_params)
        monkeypatch.setattr(driver, "cuGraphExecKernelNodeSetParams",
                            lambda graph_exec, node, p: self.set.append((int(graph_exec), int(node),
                                                                         int(p.kernelParams))) or (ok,))


def test_a_patchable_capture_keeps_its_source_graph_until_closed(monkeypatch):
    drv = FakeDriver(monkeypatch)
    graph = graphs.capture(0xCAF, lambda: None, 2, keep_source=True)
    assert drv.names() == ["cuStreamBeginCapture", "cuStreamEndCapture", "cuGraphInstantiate"]
    assert int(graph.source) == 0xA11, "the nodes a patch names belong to the source graph"
    graph.close()
    assert drv.calls[-2:] == [("cuGraphExecDestroy", 0xE0), ("cuGraphDestroy", 0xA11)]
    dropped = graphs.capture(0xCAF, lambda: None, 2, keep_source=True)
    dropped.drop_source()
    assert drv.calls[-1] == ("cuGraphDestroy", 0xA11) and dropped.source is None
    dropped.close()
    assert drv.names().count("cuGraphDestroy") == 2, "a dropped source graph is destroyed once"


EXPECTED = [({0xF1}, (16, 1, 1), (256, 1, 1), 0), ({0xF2}, (32, 1, 1), (128, 1, 1), 1024),
            ({0xF1}, (16, 1, 1), (256, 1, 1), 0)]


def chain_nodes():
    return {0xB: ("kernel", 0xF2, (32, 1, 1), (128, 1, 1), 1024), 0xA: ("kernel", 0xF1, (16, 1, 1), (256, 1, 1), 0),
            0xC: ("kernel", 0xF1, (16, 1, 1), (256, 1, 1), 0)}


def test_the_nodes_of_a_one_stream_capture_map_to_the_launches_in_order(monkeypatch):
    drv = FakeGraphDriver(monkeypatch, chain_nodes(), [(0xB, 0xC), (0xA, 0xB)])
    nodes, params = graph_patch.kernel_nodes("graph", EXPECTED)
    assert [int(n) for n in nodes] == [0xA, 0xB, 0xC]
    assert [int(p.func) for p in params] == [0xF1, 0xF2, 0xF1] and params[1].sharedMemBytes == 1024
    graph_patch.node_setter(drv.driver.CUgraphExec(0xE0))(nodes[1], types.SimpleNamespace(kernelParams=0x99))
    assert drv.set == [(0xE0, 0xB, 0x99)]


@pytest.mark.parametrize("change, why", [
    ("memset", "node 1 is a CU_GRAPH_NODE_TYPE_MEMSET node"),
    ("function", "node 1 launches another function"),
    ("grid", "node 1 has grid (33, 1, 1)"),
    ("extra node", "4 graph nodes for 3 launches"),
    ("fork", "two dependents"),
])
def test_a_graph_that_is_not_one_kernel_node_per_launch_is_not_patched(monkeypatch, change, why):
    nodes, edges = chain_nodes(), [(0xA, 0xB), (0xB, 0xC)]
    if change == "memset":
        nodes[0xB] = ("memset",) + nodes[0xB][1:]
    if change == "function":
        nodes[0xB] = ("kernel", 0xF3) + nodes[0xB][2:]
    if change == "grid":
        nodes[0xB] = ("kernel", 0xF2, (33, 1, 1), (128, 1, 1), 1024)
    if change == "extra node":
        nodes[0xD] = nodes[0xC]
        edges.append((0xC, 0xD))
    if change == "fork":
        edges = [(0xA, 0xB), (0xA, 0xC)]
    FakeGraphDriver(monkeypatch, nodes, edges)
    found = graph_patch.kernel_nodes("graph", EXPECTED)
    assert isinstance(found, str) and why in found, found


# ---- the executor's decisions ---------------------------------------------------------------------

class PatchGraph(FakeGraph):
    """A captured graph whose nodes hold parameter bytes: set at capture, replaced by a patch."""

    def __init__(self, launches):
        super().__init__(launches)
        self.source, self.patch = "source graph", None
        self.node_bytes = [param_bytes(params) for _, _, _, params in launches]

    def drop_source(self):
        self.source = None


class PatchStub(GraphStub):
    """The graph stub with patching on: a graph's nodes are (graph, position); a node given
    parameters reads them back from the `kernelParams` array it was handed (what the driver
    copies); `ran` lists every launch that ran, plain or in a graph, as (kernel, parameter bytes)."""

    def __init__(self, host, patching=True, **kw):
        super().__init__(host, **kw)
        self.graph_patching = patching
        self.ran, self.unmappable, self.fail_set = [], None, False

    def _submit(self, kernel, config, params, stream=None):
        super()._submit(kernel, config, params, stream)
        if stream is None:
            self.ran.append((kernel, param_bytes(params)))

    def _capture_graph(self, submit, launches):
        return PatchGraph(super()._capture_graph(submit, launches).launches)

    def _graph_nodes(self, graph, cached):
        if self.unmappable:
            return self.unmappable
        count = len(graph.launches)
        return [(graph, i) for i in range(count)], [types.SimpleNamespace(kernelParams=None) for _ in range(count)]

    def _node_setter(self, graph):
        return lambda node, params: self._set_node_params(graph, node, params)

    def _set_node_params(self, graph, node, params):
        if self.fail_set:
            raise LaunchError("cuGraphExecKernelNodeSetParams failed: CUDA_ERROR_INVALID_VALUE (stub)")
        owner, position = node
        assert owner is graph
        sizes = [len(b) for b in graph.node_bytes[position]]
        pointers = (ctypes.c_void_p * len(sizes)).from_address(params.kernelParams)
        graph.node_bytes[position] = [ctypes.string_at(pointers[j], sizes[j]) for j in range(len(sizes))]

    def _launch_graph(self, graph):
        super()._launch_graph(graph)
        self.ran.extend((kernel, list(node)) for (kernel, *_), node in zip(graph.launches, graph.node_bytes))


def moving_outputs(calls):
    """x fixed; a and b at new addresses on every call but the last two, which repeat earlier ones."""
    x = pair_arrays()[0]
    sets = [[x, *pair_arrays(base=0x2000_0000 + 0x40_0000 * k)[1:]] for k in range(calls - 2)]
    return sets + [sets[-1], sets[1]]


def run_both(calls_args, unmappable=None):
    plain, patched = PatchStub(two_kernel_program(), patching=False), PatchStub(two_kernel_program())
    plain.cuda_graphs = False
    patched.unmappable = unmappable
    for args in calls_args:
        plain(*args)
        patched(*args)
    assert patched.ran == plain.ran, "the patched graphs ran exactly the launches plain launching runs"
    return patched


def test_moving_outputs_patch_one_graph_and_run_what_plain_launches_run(full_path):
    f = run_both(moving_outputs(8))
    # call 0: the full path; 1: captured at once; 2..5: patched (a and b move: both nodes);
    # 6 repeats 5's pointers: the graph holds them; 7 comes back to 1's, seen before: a graph of its own
    assert f.graph_stats == graphs.GraphStats(captured=2, launched=7, gave_up=0, patched=4, patched_nodes=8)
    assert f.graph_stats.first_sights == 0 and len(f.submitted) == 2, "only the full path launched plainly"
    (cached,) = f._calls.values()
    assert len(cached.graphs.graphs) == 2


def test_an_input_that_moves_alone_patches_only_the_launches_that_read_it(full_path):
    x_moves = [[pair_arrays(base=0x3000_0000 + 0x40_0000 * k)[0], *pair_arrays()[1:]] for k in range(4)]
    f = run_both(x_moves)
    assert (f.graph_stats.patched, f.graph_stats.patched_nodes) == (2, 4)
    b_moves = [[*pair_arrays()[:2], pair_arrays(base=0x5000_0000 + 0x40_0000 * k)[2]] for k in range(4)]
    f = run_both(b_moves)
    assert (f.graph_stats.patched, f.graph_stats.patched_nodes) == (2, 2), "b is read by the second launch only"


def test_alternating_pointer_sets_get_a_graph_each_and_replay_without_patching(full_path):
    one, two = pair_arrays(), pair_arrays(base=0x9000_0000)
    f = run_both([one, one, two, one, two, one, two, one])
    # 0 full path; 1 capture (one); 2 patch -> two; 3 one seen before: its own graph; then exact replays
    assert f.graph_stats == graphs.GraphStats(captured=2, launched=7, gave_up=0, patched=1, patched_nodes=2)


def test_a_graph_whose_nodes_do_not_map_replays_exact_pointers_only(full_path):
    why = "node 1 is a CU_GRAPH_NODE_TYPE_MEMSET node, not a kernel launch"
    calls = moving_outputs(6)  # pointer sets 0 1 2 3 3 1
    f = run_both(calls + [calls[-1], calls[-1]], unmappable=why)
    stats = f.graph_stats
    assert (stats.unpatchable, stats.unpatchable_why, stats.patched) == (1, why, 0)
    # 0 the full path; 1 captured at once (then found unpatchable); 2, 3 first sights, plain;
    # 3 again: captured on its second sight; 1 again (three times): its graph replays
    assert (stats.captured, stats.launched, stats.first_sights) == (2, 5, 2)
    assert f.graph_launches[0][0].source is None, "an unpatchable graph's source graph is destroyed"


def test_a_patch_that_fails_drops_the_graph_and_the_call_launches_plainly(full_path):
    f = PatchStub(two_kernel_program())
    calls = moving_outputs(5)
    for args in calls[:2]:
        f(*args)
    (cached,) = f._calls.values()
    (graph,) = cached.graphs.graphs.values()
    f.fail_set = True
    before = len(f.submitted)
    f(*calls[2])
    assert graph.closed and not cached.graphs.graphs and not cached.graphs.patchable
    assert f.graph_stats.unpatchable == 1 and "CUDA_ERROR_INVALID_VALUE" in f.graph_stats.unpatchable_why
    assert len(f.submitted) == before + 2, "the call's two kernels launched plainly"
    assert f.submitted[-1][3][:3] == [a.__cuda_array_interface__["data"][0] for a in calls[2]]


def test_patch_mode_comes_from_the_environment(monkeypatch):
    for value, enabled, patching in [(None, True, True), ("0", False, False), ("1", True, False),
                                     ("patch", True, True), ("PATCH", True, True)]:
        if value is None:
            monkeypatch.delenv("TECC_CUDA_GRAPHS", raising=False)
        else:
            monkeypatch.setenv("TECC_CUDA_GRAPHS", value)
        assert (graphs.enabled_by_environment(), graphs.patching_by_environment()) == (enabled, patching), value


def test_call_graphs_plan_capture_patch_and_replay():
    state = graphs.CallGraphs(size=2)
    assert state.plan("a", patching=True) == "capture"
    state.keep("a", "graph")
    assert state.plan("a", patching=True) == "replay"
    assert state.plan("b", patching=True) == "patch"
    assert state.oldest(lambda graph: False) is None and state.oldest(lambda graph: True) == ("a", "graph")
    state.rekey("a", "b")
    assert state.find("b") == "graph" and state.find("a") is None
    assert state.plan("a", patching=True) == "capture", "a key seen before gets its own graph while there is room"
    state.patchable = False
    assert state.plan("c", patching=True) == "plain" and state.plan("c", patching=True) == "capture"
    assert StubExecutor.graph_patching is False, "patching is off unless asked for"


def test_a_gemm_reading_a_moving_temporary_by_tma_gets_its_map_patched(full_path, faketorch, monkeypatch):
    """A program whose GEMM reads an intermediate (a temporary from the followed torch stream) by
    TMA, as a model graph's GEMMs do: when the input and the temporaries move, the patched nodes'
    parameters, the re-encoded tensor map included, are byte for byte what a plain launch of the
    same call passes (`_with_maps` for its pointers)."""
    import ml_dtypes

    M, K, N = TMA_TEMPORARY_SIZES
    host = tma_temporary_gemm()

    class CheckedPatchStub(PatchStub):
        def _replay_graph(self, cached, ptrs):
            self.call = (cached, list(ptrs))
            return super()._replay_graph(cached, ptrs)

        def _launch_graph(self, graph):
            cached, ptrs = self.call
            want = [param_bytes(self._with_maps(launch, ptrs)) for launch in cached.launches]
            assert graph.node_bytes == want, "the graph's nodes pass what plain launches of this call pass"
            self.graph_runs += 1

    f = _followed_stream_stub(host, faketorch, monkeypatch, cls=CheckedPatchStub)
    f.graph_runs, encoded = 0, []

    def tensor_map(self, spec, ptr, shape, strides):
        encoded.append((spec.param, ptr))
        return fake_map(ptr)

    monkeypatch.setattr(StubExecutor, "_tensor_map", tensor_map)
    bf16 = ml_dtypes.bfloat16
    w, c = TorchLike(np.ones((N, K), bf16)), TorchLike(np.zeros((M, N), bf16))
    kept = []  # earlier temporaries (and their stream arena) stay alive, so new ones get new addresses
    for _ in range(5):
        kept.append(dict(f._stream_temps))
        f._stream_temps.clear()
        arena._ARENAS.clear()  # the next call takes a new arena, not the one its earlier calls hold
        f(TorchLike(np.ones((M, K), bf16)), w, c)
    assert full_path["binds"] == 1 and f.graph_runs == 4
    stats = f.graph_stats
    assert (stats.captured, stats.patched, stats.unpatchable) == (1, 3, 0), stats
    assert stats.patched_nodes == 3 * len(host.kernels), "X and the temporaries move: every launch takes one"
    (entry,) = [e for key, e in f._stream_temps.items() if key[:2] == ("signature", 0x5EED)]
    t_ptr = entry[3][[name for name, _, _ in entry[0]].index("T")]
    assert ("T", t_ptr) in encoded, "the map of the last call's temporary was encoded for the patch"


def test_graphs_captured_before_patching_was_switched_on_are_replaced_by_patchable_ones(full_path):
    f = PatchStub(two_kernel_program(), patching=False)
    calls = moving_outputs(6)
    for args in [calls[0]] * 3:
        f(*args)
    assert f.graph_stats.captured == 1
    f.graph_patching = True
    for args in calls[1:4]:
        f(*args)
    stats = f.graph_stats
    # call 1: the only graph has nothing to patch with: a patchable one is captured; 2, 3 patch it
    assert (stats.captured, stats.patched, stats.unpatchable) == (2, 2, 0), stats
