"""CUDA graphs of repeated calls on a GPU (tecc/runtime/graphs.py; docs/runtime.md, "CUDA graphs of
repeated calls"): a multi-launch program (a row softmax into a temporary that a GEMM reads, by TMA
on sm_90) called repeatedly with the same arrays replays one graph from its third call; new
pointers miss and compute right; a user's torch.cuda.graph around the call still captures it;
TECC_CUDA_GRAPHS=0 and an executor with its own stream. Every result against NumPy in float64
on fresh random inputs, outputs poisoned before each call. With TECC_CUDA_GRAPHS=patch: one graph
patched for arrays that move (every array, the output alone, a TMA-read array whose old memory is
poisoned). The CPU tests of the same logic are tests/test_runtime_graphs.py and
tests/test_runtime_graph_patch.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.runtime.cuda import CudaExecutor
from tecc.runtime.graphs import GraphStats

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA")]

M, K, N = 1024, 1024, 512


def softmax_matmul(m: int = M, k: int = K, n: int = N) -> "tc.Kernel":
    """C = bf16(softmax(X)) @ W, X and W bfloat16, float32 out: a row kernel, the normalized rows
    into a temporary P, a GEMM reading P (by TMA on sm_90)."""
    X = tc.placeholder((m, k), "bfloat16", name="X")
    W = tc.placeholder((k, n), "bfloat16", name="W")
    c, c2, r = tc.reduce_axis(k, name="c"), tc.reduce_axis(k, name="c2"), tc.reduce_axis(k, name="r")
    mx = tc.compute((m,), lambda i: tc.max(tc.cast(X[i, c], "float32"), axis=c), name="mx")
    e = tc.compute((m, k), lambda i, j: tc.exp(tc.cast(X[i, j], "float32") - mx[i]), name="e")
    s = tc.compute((m,), lambda i: tc.sum(e[i, c2], axis=c2), name="s")
    P = tc.compute((m, k), lambda i, j: tc.cast(e[i, j] / s[i], "bfloat16"), name="P")
    C = tc.compute((m, n), lambda i, j: tc.sum(tc.cast(P[i, r], "float32") * tc.cast(W[r, j], "float32"), axis=r),
                   name="C")
    return tc.build([X, W, C], name="softmax_matmul")


@pytest.fixture(autouse=True)
def exact_pointer_graphs(monkeypatch):
    """These tests count the exact-pointer graphs (TECC_CUDA_GRAPHS=1; the default, patch, is
    asked for by name below). An executor reads the mode when it is made, at its first call."""
    monkeypatch.setenv("TECC_CUDA_GRAPHS", "1")


@pytest.fixture(scope="module")
def program():
    f = softmax_matmul()
    assert len(f.host.kernels) >= 2 and f.host.temps, f"the test needs several launches and a temporary: {f.explain()}"
    if f.arch.startswith("sm_90"):
        assert any(k.tensor_maps for k in f.host.kernels), "on sm_90 the GEMM should read P through a TMA map"
    return f


def fresh_inputs():
    g = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 31)))
    x = (torch.randn(M, K, device="cuda", generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)
    return x, w


def check(c: "torch.Tensor", x: "torch.Tensor", w: "torch.Tensor", what: str) -> None:
    """C against float64 NumPy: softmax in float64, P rounded to bfloat16 as the program stores
    it, the product in float64; each element within 2 bfloat16 ulps of P (2^-7) times the sum of
    |P||W| of its row and column (a rounding of P the other way), plus float32 accumulation."""
    torch.cuda.synchronize()
    x64 = x.float().cpu().numpy().astype(np.float64)
    w64 = w.float().cpu().numpy().astype(np.float64)
    e = np.exp(x64 - x64.max(axis=1, keepdims=True))
    p = (e / e.sum(axis=1, keepdims=True)).astype(ml_dtypes.bfloat16).astype(np.float64)
    want = p @ w64
    bound = 2.0 ** -7 * (np.abs(p) @ np.abs(w64)) + 1e-6
    got = c.cpu().numpy().astype(np.float64)
    excess = np.abs(got - want) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert np.isfinite(got).all() and excess[worst] <= 0, (
        f"softmax_matmul {what}: C{worst} = {got[worst]}, want {want[worst]} (bound {bound[worst]:.3g})")


def test_a_repeated_call_replays_a_graph_from_its_third_call(program):
    x, w = fresh_inputs()
    c = torch.empty(M, N, device="cuda")
    for call in range(5):
        new_x, new_w = fresh_inputs()
        x.copy_(new_x)  # new values, same pointers: the graph reads what the arrays hold now
        w.copy_(new_w)
        c.fill_(float("nan"))
        program(x, w, c)
        check(c, x, w, f"call {call}")
        stats = program.executor.graph_stats
        assert stats.launched == max(0, call - 1), f"call {call}: {stats}"
    assert program.executor.graph_stats == GraphStats(captured=1, launched=3, gave_up=0)
    assert [r.kernel for r in program.executor.last_launches] == [call.kernel for call in program.host.calls]


def test_new_pointers_miss_the_graph_and_compute_right():
    f = softmax_matmul()  # a fresh executor: no graph of another test's (freed, reusable) arrays
    x0, w0 = fresh_inputs()
    c0 = torch.empty(M, N, device="cuda")
    for _ in range(3):
        f(x0, w0, c0)  # a graph for these pointers
    assert f.executor.graph_stats == GraphStats(captured=1, launched=1, gave_up=0)
    kept = []
    for call in range(3):
        x, w = fresh_inputs()
        c = torch.full((M, N), float("nan"), device="cuda")
        kept.append((x, w, c))  # all alive: every call's arrays are somewhere else
        f(x, w, c)
        check(c, x, w, f"new arrays, call {call}")
        assert f.executor.graph_stats.launched == 1, "new pointers must not replay another call's graph"
    x, w, c = kept[0]
    c.fill_(float("nan"))
    f(x, w, c)  # the first new set's second sight: captured now
    check(c, x, w, "the first new arrays again")
    assert f.executor.graph_stats == GraphStats(captured=2, launched=2, gave_up=0)
    new_x, new_w = fresh_inputs()
    x0.copy_(new_x)
    w0.copy_(new_w)
    c0.fill_(float("nan"))
    f(x0, w0, c0)  # the first graph again, on new values
    check(c0, x0, w0, "the first arrays again")
    assert f.executor.graph_stats == GraphStats(captured=2, launched=3, gave_up=0)


def test_a_users_cuda_graph_around_the_call_still_captures_it(program):
    x, w = fresh_inputs()
    c = torch.empty(M, N, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up: the executor's own graph of these pointers on the side stream
            program(x, w, c)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    stats = GraphStats(**vars(program.executor.graph_stats))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        program(x, w, c)
    assert program.executor.graph_stats == stats, "under the user's capture the launches go into the user's graph"
    for replay in range(3):
        new_x, new_w = fresh_inputs()
        x.copy_(new_x)
        w.copy_(new_w)
        c.fill_(float("nan"))
        graph.replay()
        check(c, x, w, f"user's graph, replay {replay}")


def test_tecc_cuda_graphs_0_launches_plainly(monkeypatch):
    monkeypatch.setenv("TECC_CUDA_GRAPHS", "0")
    f = softmax_matmul()  # a new kernel: its executor is made (and reads the variable) on the first call
    x, w = fresh_inputs()
    c = torch.empty(M, N, device="cuda")
    for call in range(4):
        c.fill_(float("nan"))
        f(x, w, c)
        check(c, x, w, f"TECC_CUDA_GRAPHS=0, call {call}")
    assert not f.executor.cuda_graphs and f.executor.graph_stats == GraphStats()


def test_an_executor_with_its_own_stream_replays_graphs_on_it(program):
    stream = torch.cuda.Stream()
    executor = CudaExecutor(program.host, program.cubin, stream=stream)
    x, w = fresh_inputs()
    c = torch.empty(M, N, device="cuda")
    for call in range(4):
        c.fill_(float("nan"))  # on torch's stream, which each call's launches wait on (docs/runtime.md)
        executor(x, w, c)
        stream.synchronize()
        check(c, x, w, f"own stream, call {call}")
    assert executor.graph_stats == GraphStats(captured=1, launched=2, gave_up=0)
    assert executor._temps, "an executor with its own stream keeps its temporaries (in the graph's parameters)"


# ---- patched graphs (TECC_CUDA_GRAPHS=patch, tecc/runtime/graph_patch.py) -----------------------

def patching_executor(program) -> CudaExecutor:
    executor = CudaExecutor(program.host, program.cubin, cuda_graphs="patch")
    assert executor.cuda_graphs and executor.graph_patching
    return executor


def test_a_patched_graph_computes_right_when_every_array_moves(program):
    """Fresh X, W and C on every call (all kept alive: every call's pointers are new): the call's
    one graph is patched for each and computes what plain launches compute, the output poisoned
    before each call."""
    executor = patching_executor(program)
    kept = []
    for call in range(6):
        x, w = fresh_inputs()
        c = torch.full((M, N), float("nan"), device="cuda")
        kept.append((x, w, c))
        executor(x, w, c)
        check(c, x, w, f"patched graph, call {call}")
    stats = executor.graph_stats
    assert stats.unpatchable == 0, f"the graph could not be patched: {stats.unpatchable_why}"
    # call 0 takes the full path; call 1 captures the graph; calls 2-5 patch and replay it
    assert (stats.captured, stats.patched, stats.launched, stats.first_sights) == (1, 4, 5, 0), stats
    (cached,) = executor._calls.values()
    arity = len(program.host.buffer_params)
    takes_argument = sum(any(index < arity for _, index in launch.array_slots) or
                         any(index < arity for _, index, *_ in launch.map_slots) for launch in cached.launches)
    assert stats.patched_nodes == 4 * takes_argument, "X, W and C move: each launch taking one is patched"
    x, w, c = kept[2]
    new_x, new_w = fresh_inputs()
    x.copy_(new_x)
    w.copy_(new_w)
    c.fill_(float("nan"))
    executor(x, w, c)  # pointers seen before, no longer the graph's: a graph of their own
    check(c, x, w, "the third arrays again, on new values")
    assert (executor.graph_stats.captured, executor.graph_stats.launched) == (2, 6)


def test_a_moving_output_patches_only_the_launches_that_take_it(program):
    """X and W stay, C is new on every call (a training loop's outputs from torch's allocator):
    only the launches that take C get new parameters; each call computes right."""
    executor = patching_executor(program)
    x, w = fresh_inputs()
    kept = []
    for call in range(5):
        new_x, new_w = fresh_inputs()
        x.copy_(new_x)
        w.copy_(new_w)
        c = torch.full((M, N), float("nan"), device="cuda")
        kept.append(c)
        executor(x, w, c)
        check(c, x, w, f"moving output, call {call}")
    (cached,) = executor._calls.values()
    c_index = [p.name for p in program.host.buffer_params].index("C")
    takes_c = sum(any(index == c_index for _, index in launch.array_slots) or
                  any(index == c_index for _, index, *_ in launch.map_slots) for launch in cached.launches)
    stats = executor.graph_stats
    assert 0 < takes_c < len(cached.launches), "the softmax launches do not take C"
    assert (stats.patched, stats.patched_nodes, stats.unpatchable) == (3, 3 * takes_c, 0), stats


def test_a_patched_tma_map_reads_the_new_array(program):
    """On sm_90 the GEMM reads an argument or temporary by TMA: a moving W (a new map) must be
    read at its new address, not the captured one (the old W is overwritten with garbage)."""
    executor = patching_executor(program)
    x, w = fresh_inputs()
    c = torch.empty(M, N, device="cuda")
    executor(x, w, c)
    executor(x, w, c)  # captured for these pointers
    (cached,) = executor._calls.values()
    maps = [index for launch in cached.launches for _, index, *_ in launch.map_slots]
    kept = []  # every call's arrays alive: no address comes back (it would get a graph of its own)
    for call in range(3):
        x2, w2 = fresh_inputs()
        c2 = torch.full((M, N), float("nan"), device="cuda")
        w.fill_(float("nan"))  # the arrays the graph held: a node still reading them gives NaN
        x.fill_(float("nan"))
        executor(x2, w2, c2)
        check(c2, x2, w2, f"moved arrays, call {call} (maps of arguments {sorted(set(maps))})")
        kept.append((x, w, c))
        x, w, c = x2, w2, c2
    assert executor.graph_stats.patched == 3 and executor.graph_stats.unpatchable == 0, executor.graph_stats
