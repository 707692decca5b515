"""tecc kernels as PyTorch ops on the GPU: outputs allocated by torch, launches on torch's current
stream, CUDA-graph capture and replay, a registered op under opcheck and torch.compile, and
gradcheck in float64 of the backward kernels tc.grad derives."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
from autodiff_programs import Program, attention, layer_norm, matmul_bias_gelu, softmax

import tecc as tc

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA")]


def _name(what: str) -> str:
    return f"tecc_gpu_test::{what}_{secrets.token_hex(4)}"


def _generator() -> "torch.Generator":
    return torch.Generator(device="cuda").manual_seed(secrets.randbits(32))


def _inputs(p: Program, dtype=torch.float64, requires_grad: bool = True) -> list:
    g = _generator()
    return [torch.randn(p.shapes[t.name], dtype=dtype, device="cuda", generator=g, requires_grad=requires_grad)
            for t in p.inputs]


def _axpy(n=None, dtype="float32"):
    N = n if n is not None else tc.var("N")
    X = tc.placeholder((N,), dtype, name="X")
    Y = tc.placeholder((N,), dtype, name="Y")
    Z = tc.compute((N,), lambda i: X[i] * 2.5 + Y[i], name="Z")
    return X, Y, Z


# ---- outputs allocated for the caller -------------------------------------------------------------

def test_torch_cuda_inputs_give_a_torch_output_on_their_device() -> None:
    p = matmul_bias_gelu(dtype="float32")
    f = tc.build([*p.inputs, p.output])
    xs = _inputs(p, torch.float32, requires_grad=False)
    y = f(*xs)
    assert isinstance(y, torch.Tensor) and y.device == xs[0].device and y.dtype == torch.float32
    assert tuple(y.shape) == (p.shapes["A"][0], p.shapes["B"][1])
    expected = p.numpy(*[x.double().cpu().numpy() for x in xs])
    np.testing.assert_allclose(y.cpu().numpy(), expected, rtol=1e-4, atol=1e-5)


def test_numpy_inputs_give_numpy_outputs_on_the_gpu_too() -> None:
    X, Y, Z = _axpy()
    f = tc.build([X, Y, Z])
    rng = np.random.default_rng()
    x, y = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    z = f(x, y)
    assert isinstance(z, np.ndarray)
    np.testing.assert_allclose(z, 2.5 * x + y, rtol=1e-6, atol=1e-6)


# ---- streams ----------------------------------------------------------------------------------------

def test_calls_launch_on_torchs_current_stream_without_an_event_wait(monkeypatch) -> None:
    X, Y, Z = _axpy()
    f = tc.build([X, Y, Z])
    n = 1 << 20
    x, y = torch.zeros(n, device="cuda"), torch.ones(n, device="cuda")
    f(x, y)  # warm: the executor exists and the launch is cached
    torch.cuda.synchronize()
    waits = []
    monkeypatch.setattr(f.executor, "_record_and_wait", lambda producer: waits.append(producer))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # GPU time on the side stream before x is written
        x.fill_(2.0)
        z = f(x, y)
        assert int(f.executor.stream.handle) == side.cuda_stream, "the launch went to another stream"
    torch.cuda.synchronize()
    assert waits == [], "a call on torch's stream has nothing to wait for"
    assert torch.equal(z, torch.full((n,), 6.0, device="cuda")), "the kernel ran before the fill it follows"


# ---- CUDA graphs -----------------------------------------------------------------------------------

def _capture_and_replay(f, inputs, reference, atol: float = 1e-5, exact: bool = True) -> None:
    """Warm f up on a side stream, capture one call in a CUDA graph, then replay it on fresh data
    copied into the captured inputs: the graph's output matches the reference and a direct call."""
    static = [x.clone() for x in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: load the kernel, fill the launch cache
            f(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(*static)
    for _ in range(3):
        fresh = [torch.randn_like(x) for x in inputs]
        for s, x in zip(static, fresh):
            s.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, reference(*fresh), rtol=1e-4, atol=atol)
        direct = f(*fresh)
        torch.testing.assert_close(out, direct, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-5)


def test_a_call_captured_in_a_cuda_graph_replays_with_the_same_results() -> None:
    X, Y, Z = _axpy()
    f = tc.build([X, Y, Z])
    x, y = torch.randn(10_000, device="cuda"), torch.randn(10_000, device="cuda")
    _capture_and_replay(f, [x, y], lambda a, b: 2.5 * a + b)


def test_a_program_with_temporaries_is_capturable_too() -> None:
    # few long rows: split over blocks, partial sums and an arrival counter in temporaries
    # (split_rows, docs/memory-bound.md)
    R, C = 4, 1 << 20
    X = tc.placeholder((R, C), "float32", name="X")
    c = tc.reduce_axis(C, name="c")
    S = tc.compute((R,), lambda i: tc.sum(X[i, c], axis=c), name="S")
    f = tc.build([X, S])
    assert f.host.temps, f"this test needs a plan with temporaries, the planner chose {f.plan}"
    x = torch.randn(R, C, device="cuda")
    _capture_and_replay(f, [x], lambda a: a.double().sum(1).float(), atol=1e-2, exact=False)  # 2^20 float32 terms
    assert f.executor._temps == {}, "calls on torch's stream take their temporaries from torch's allocator"


def test_a_registered_op_is_capturable() -> None:
    p = matmul_bias_gelu(dtype="float32")
    op = tc.torch.op([*p.inputs, p.output], _name("graph"))
    xs = _inputs(p, torch.float32, requires_grad=False)
    ref = lambda a, b, c: torch.from_numpy(p.numpy(a.double().cpu().numpy(), b.double().cpu().numpy(),  # noqa: E731
                                                  c.double().cpu().numpy())).float().cuda()
    _capture_and_replay(op, xs, ref)


# ---- the registered op ------------------------------------------------------------------------------

def test_opcheck_passes_for_a_registered_op_with_gradients() -> None:
    p = matmul_bias_gelu()
    op = tc.torch.op([*p.inputs, p.output], _name("opcheck"), grads=tc.grad(p.output, p.inputs))
    torch.library.opcheck(op.custom_op, tuple(_inputs(p)))
    torch.library.opcheck(op.custom_op, tuple(_inputs(p, requires_grad=False)))


def test_torch_compile_fullgraph_traces_the_op_and_its_backward() -> None:
    p = matmul_bias_gelu(dtype="float32")
    op = tc.torch.op([*p.inputs, p.output], _name("compiled"), grads=tc.grad(p.output, p.inputs))

    def block(a, b, bias):
        return (op(a, b, bias) * 2.0).relu().sum()

    compiled = torch.compile(block, fullgraph=True)
    for rows in (5, 9):  # a second size: the fake implementation handles symbolic sizes
        xs = [torch.randn(s, device="cuda", requires_grad=True) for s in ((rows, 4), (4, 6), (6,))]
        loss = compiled(*xs)
        loss.backward()
        got = [x.grad.clone() for x in xs]
        for x in xs:
            x.grad = None
        block(*xs).backward()
        torch.testing.assert_close(loss, block(*xs), rtol=1e-5, atol=1e-5)
        for g, x in zip(got, xs):
            torch.testing.assert_close(g, x.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [matmul_bias_gelu, softmax, layer_norm, attention], ids=lambda m: m.__name__)
def test_gradcheck_float64_on_the_gpu(make) -> None:
    p = make()
    op = tc.torch.op([*p.inputs, p.output], _name(p.name), grads=tc.grad(p.output, p.inputs))
    xs = _inputs(p)
    expected = p.numpy(*[x.detach().cpu().numpy() for x in xs])
    np.testing.assert_allclose(op(*xs).detach().cpu().numpy(), expected, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(op, tuple(xs), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradients_match_torch_autograd_of_the_same_expression_in_float32() -> None:
    p = layer_norm(dtype="float32", rows=64, cols=256)
    op = tc.torch.op([*p.inputs, p.output], _name("ln32"), grads=tc.grad(p.output, p.inputs))
    xs = _inputs(p, torch.float32)
    dy = torch.randn(64, 256, device="cuda", generator=_generator())
    got = torch.autograd.grad(op(*xs), xs, dy)
    ref = torch.autograd.grad(torch.nn.functional.layer_norm(xs[0], (256,), xs[1], xs[2], eps=1e-5), xs, dy)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_autograd_function_gradcheck_on_the_gpu() -> None:
    p = softmax()
    apply = tc.torch.function([*p.inputs, p.output], tc.grad(p.output, p.inputs))
    assert torch.autograd.gradcheck(apply, tuple(_inputs(p)), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_a_registered_op_relaunches_a_layout_it_ran_before() -> None:
    """A second call with the inputs' sizes, strides, dtypes and devices of an earlier one runs
    that call's launch on the new pointers (no argument keys read); other strides or another
    size are a call of their own; every result is the expression's. The memory the output will
    take is poisoned first (a NaN block freed right before the call: torch's caching allocator
    hands it out again)."""
    N = tc.var("N")
    X = tc.placeholder((N,), "float32", name="X", strides="any")   # read with its strides
    Y = tc.placeholder((N,), "float32", name="Y")
    Z = tc.compute((N,), lambda i: X[i] * 2.5 + Y[i], name="Z")
    op = tc.torch.op([X, Y, Z], _name("relaunch"))
    g = _generator()

    def check(x, y):
        poison = torch.full(x.shape, float("nan"), device="cuda")
        del poison
        z = op(x, y)
        torch.testing.assert_close(z, x * 2.5 + y, rtol=1e-6, atol=1e-6)
        return z

    x, y = (torch.randn(1000, device="cuda", generator=g) for _ in range(2))
    check(x, y)
    executor = op.kernel.executor
    relaunched = executor.calls_relaunched
    for _ in range(3):   # new data at new addresses
        x, y = (torch.randn(1000, device="cuda", generator=g) for _ in range(2))
        check(x, y)
    assert executor.calls_relaunched == relaunched + 3
    # a strided input: another layout, its own call, then relaunched too
    wide = torch.randn(2000, device="cuda", generator=g)
    check(wide[::2], y)
    check(wide[::2], y)
    assert executor.calls_relaunched == relaunched + 4
    # another length (N is symbolic): its own launch and outputs
    x5, y5 = (torch.randn(5, device="cuda", generator=g) for _ in range(2))
    assert check(x5, y5).shape == (5,)
    assert executor.calls_relaunched == relaunched + 4
    # back to the first layout after others (its layout read again), then the C++ check of the
    # last layout taken twice; the strided layout again fails that check and is read
    for _ in range(3):
        x, y = (torch.randn(1000, device="cuda", generator=g) for _ in range(2))
        check(x, y)
    assert executor.calls_relaunched == relaunched + 7
    check(wide[::2], y)
    assert executor.calls_relaunched == relaunched + 8
