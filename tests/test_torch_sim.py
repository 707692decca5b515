"""tc.torch with CPU tensors: the registered op and its gradients run in the emulator, so
gradcheck in float64 checks tc.grad's backward kernels against torch's numerical Jacobian
without a GPU (skips without torch)."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
from autodiff_programs import Program, attention, layer_norm, matmul_bias_gelu, softmax

import tecc as tc

torch = pytest.importorskip("torch")


def _name(what: str) -> str:
    return f"tecc_test::{what}_{secrets.token_hex(4)}"


def _inputs(p: Program, device: str = "cpu") -> list:
    g = torch.Generator(device=device).manual_seed(secrets.randbits(32))
    return [torch.randn(p.shapes[t.name], dtype=torch.float64, device=device, generator=g, requires_grad=True)
            for t in p.inputs]


@pytest.mark.parametrize("make", [matmul_bias_gelu, softmax, layer_norm, attention], ids=lambda m: m.__name__)
def test_gradcheck_in_the_emulator(make) -> None:
    p = make()
    op = tc.torch.op([*p.inputs, p.output], _name(p.name), grads=tc.grad(p.output, p.inputs), target="sim")
    xs = _inputs(p)
    y = op(*xs)
    expected = p.numpy(*[x.detach().numpy() for x in xs])
    np.testing.assert_allclose(y.detach().numpy(), expected, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(op, tuple(xs), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_with_saved_statistics_in_the_emulator() -> None:
    """tc.grad(..., save=[mu, var]): the backward reads the statistics as inputs; the op's backward
    runs the forward built from g.forward on the saved inputs and passes its last len(g.saved)
    outputs (mu, var) to the backward kernel, as for attention's output and log-sum-exp."""
    p = layer_norm()
    stages, stack = {}, [p.output]
    while stack:
        t = stack.pop()
        if t.name not in stages and not t.is_placeholder:
            stages[t.name] = t
            stack.extend(t.op.input_tensors)
    g = tc.grad(p.output, p.inputs, save=[stages["mu"], stages["var"]])
    assert [t.name for t in g.saved] == ["mu", "var"] and [t.name for t in g.forward[-2:]] == ["mu", "var"]
    op = tc.torch.op([*p.inputs, p.output], _name("saved_stats"), grads=g, target="sim")
    xs = _inputs(p)
    np.testing.assert_allclose(op(*xs).detach().numpy(), p.numpy(*[x.detach().numpy() for x in xs]),
                               rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(op, tuple(xs), eps=1e-6, atol=1e-6, rtol=1e-5)
    apply = tc.torch.function([*p.inputs, p.output], g, target="sim")
    assert torch.autograd.gradcheck(apply, tuple(xs), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_autograd_function_without_registration_in_the_emulator() -> None:
    p = softmax()
    apply = tc.torch.function([*p.inputs, p.output], tc.grad(p.output, p.inputs), target="sim")
    (x,) = _inputs(p)
    assert torch.autograd.gradcheck(apply, (x,), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_opcheck_passes_in_the_emulator() -> None:
    p = matmul_bias_gelu()
    op = tc.torch.op([*p.inputs, p.output], _name("opcheck"), grads=tc.grad(p.output, p.inputs), target="sim")
    xs = _inputs(p)
    torch.library.opcheck(op.custom_op, tuple(xs))
    torch.library.opcheck(op.custom_op, tuple(x.detach() for x in xs))


def test_the_fake_implementation_derives_shapes_and_dtypes_from_the_expression() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = matmul_bias_gelu(dtype="float32")
    op = tc.torch.op([*p.inputs, p.output], _name("fake"), target="sim")
    with FakeTensorMode():
        a, b, bias = torch.empty(13, 4), torch.empty(4, 6), torch.empty(6)
        y = op(a, b, bias)
        assert tuple(y.shape) == (13, 6) and y.dtype == torch.float32
        with pytest.raises(tc.DTypeError, match=r"argument 2 \(bias\) must be float32, got torch.float64"):
            op(a, b, torch.empty(6, dtype=torch.float64))


def test_an_output_size_no_input_determines_is_refused_at_registration() -> None:
    N = tc.var("N")
    X = tc.placeholder((4,), "float32", name="X")
    Y = tc.compute((N,), lambda i: tc.cast(i, "float32"), name="Y")
    with pytest.raises(tc.ShapeError, match=r"output Y's dimension 0 \(N\) needs N"):
        tc.torch.op([X, Y], _name("unsized"), target="sim")


def test_the_documented_training_example_trains_like_torch() -> None:
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent.parent / "docs" / "examples" / "pytorch_mlp.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "the tecc block trains like the torch block" in result.stdout


def test_an_op_name_must_be_namespace_colons_name() -> None:
    p = softmax()
    with pytest.raises(tc.TeccError, match="must read 'namespace::name'"):
        tc.torch.op([*p.inputs, p.output], "softmax_without_namespace", target="sim")


def _scaled(name: str, how: str) -> tuple[tc.Tensor, tc.Tensor]:
    n = tc.var("n")
    X = tc.placeholder((n,), "float32", name="X")
    Y = tc.compute((n,), lambda i: X[i] * 2.0 if how == "twice" else X[i] + 1.0, name=name)
    return X, Y


def test_another_program_under_a_taken_op_name_is_refused_naming_both() -> None:
    name = _name("taken")
    first = tc.torch.op(list(_scaled("Y", "twice")), name, target="sim")
    x = torch.randn(7, generator=torch.Generator().manual_seed(secrets.randbits(32)))
    with pytest.raises(tc.TeccError, match=rf"op {name} is already registered with another program \(it runs "
                                           r"kernel Y\(X: float32\[n\]\) -> Y: float32\[n\]; this one is "
                                           r"kernel Z\(X: float32\[n\]\) -> Z: float32\[n\]\)"):
        tc.torch.op(list(_scaled("Z", "plus_one")), name, target="sim")
    with pytest.raises(tc.TeccError, match=r"the same signature, another computation"):
        tc.torch.op(list(_scaled("Y", "plus_one")), name, target="sim")
    np.testing.assert_allclose(first(x).numpy(), 2.0 * x.numpy(), rtol=1e-6)  # still the first program
    assert tc.torch.op(list(_scaled("Y", "twice")), name, target="sim") is first  # the same program again


def test_an_op_with_gradients_under_a_name_taken_without_them_is_refused() -> None:
    p = softmax()
    name = _name("grads")
    plain = tc.torch.op([*p.inputs, p.output], name, target="sim")
    with pytest.raises(tc.TeccError, match=r"both run kernel .*, it with no gradients, this one with the gradients"):
        tc.torch.op([*p.inputs, p.output], name, grads=tc.grad(p.output, p.inputs), target="sim")
    with_grads = tc.torch.op([*p.inputs, p.output], name + "_g", grads=tc.grad(p.output, p.inputs), target="sim")
    with pytest.raises(tc.TeccError, match=rf"{name}_g_backward is already registered: it is the backward op of"):
        tc.torch.op([*p.inputs, p.output], name + "_g_backward", target="sim")
    assert plain is not with_grads


def test_the_training_examples_annotations_name_public_tecc_types() -> None:
    import importlib.util
    import pathlib
    import typing

    script = pathlib.Path(__file__).parent.parent / "docs" / "examples" / "pytorch_mlp.py"
    spec = importlib.util.spec_from_file_location("pytorch_mlp_example", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for function in (module.gelu, module.mlp_block):
        typing.get_type_hints(function)  # resolves every annotation (tc.Expr, tc.Tensor)
    x = tc.placeholder((3,), "float32", name="x")
    y = tc.compute((3,), lambda i: module.gelu(x[i]), name="y")
    v = np.random.default_rng().standard_normal(3).astype(np.float32)
    want = 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))
    np.testing.assert_allclose(tc.build([x, y], target="sim")(v), want, rtol=1e-5, atol=1e-6)  # float32 near gelu's cancellation (1 + tanh -> 0)


def test_torch_compile_fullgraph_traces_an_op_in_the_emulator() -> None:
    """The op's call is what dynamo traces as one node (no graph break): a call path that goes
    around the op overload (its `_op`) would break the graph."""
    X = tc.placeholder((8,), "float32", name="X")
    Y = tc.compute((8,), lambda i: X[i] * 2.0, name="Y")
    op = tc.torch.op([X, Y], f"tecc_sim_test::double_{secrets.token_hex(4)}", target="sim")
    compiled = torch.compile(lambda x: op(x) + 1.0, fullgraph=True, backend="eager")
    x = torch.randn(8)
    torch.testing.assert_close(compiled(x), x * 2.0 + 1.0)
