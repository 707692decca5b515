"""tc.grad: backward tensor expressions by reverse mode, checked in the CPU emulator (float64)
against central finite differences of the forward kernel and against hand-derived NumPy
gradients, on fresh random inputs."""

from __future__ import annotations

import math
import secrets
from typing import Callable, Sequence

import numpy as np
import pytest
from autodiff_programs import Program, attention, layer_norm, matmul_bias_gelu, mlp_block, random_inputs, softmax

import tecc as tc

FD_STEP = 1e-6


def _fresh_rng() -> tuple[np.random.Generator, int]:
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def _run(kernel: tc.Kernel, arrays: Sequence[np.ndarray], out_shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    outs = [np.full(s, np.nan) for s in out_shapes]
    kernel(*arrays, *outs)
    return outs


def _finite_differences(forward: Callable[[list[np.ndarray]], np.ndarray], arrays: list[np.ndarray],
                        cotangent: np.ndarray, which: int) -> np.ndarray:
    """d(Σ cotangent · forward)/d arrays[which], by central differences."""
    out = np.zeros_like(arrays[which])
    for idx in np.ndindex(out.shape):
        plus = [a.copy() for a in arrays]
        minus = [a.copy() for a in arrays]
        plus[which][idx] += FD_STEP
        minus[which][idx] -= FD_STEP
        out[idx] = ((forward(plus) * cotangent).sum() - (forward(minus) * cotangent).sum()) / (2 * FD_STEP)
    return out


def check_gradients(inputs: list[tc.Tensor], output: tc.Tensor, wrt: list[tc.Tensor], arrays: list[np.ndarray],
                    hand: Callable[..., list[np.ndarray]] | None = None, seed: int = 0,
                    rng: np.random.Generator | None = None, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    """Build forward and backward in the emulator; compare the gradients of Σ dC·C with finite
    differences of the forward kernel and (when given) `hand(*arrays, dC)`."""
    rng = rng or np.random.default_rng(seed)
    g = tc.grad(output, wrt)
    assert [t.name for t in g.inputs] == [t.name for t in inputs]
    assert [tuple(map(str, d.shape)) for d in g.grads] == [tuple(map(str, x.shape)) for x in wrt]
    # the forward as the gradient asks for it: the output, and what the backward reads of it (an
    # online-softmax chain saves its output and log-sum-exp: g.saved)
    assert list(g.forward[:len(inputs) + 1]) == [*inputs, output]
    forward = tc.build(list(g.forward), target="sim")
    backward = tc.build(g.args, target="sim")
    shapes = [_concrete(t, inputs, arrays) for t in g.forward[len(inputs):]]
    y, *extra = _run(forward, arrays, shapes)
    saved = [y, *extra] if g.saved else []
    cotangent = rng.standard_normal(y.shape)
    grads = _run(backward, [*arrays, *saved, cotangent], [arrays[inputs.index(x)].shape for x in wrt])

    def run_forward(xs: list[np.ndarray]) -> np.ndarray:
        return _run(forward, xs, shapes)[0]

    expected_hand = hand(*arrays, cotangent) if hand is not None else None
    for n, (x, got) in enumerate(zip(wrt, grads)):
        fd = _finite_differences(run_forward, arrays, cotangent, inputs.index(x))
        where = f"d{x.name} of {output.name} (seed {seed})"
        np.testing.assert_allclose(got, fd, rtol=1e-5, atol=1e-6, err_msg=f"{where} against finite differences")
        if expected_hand is not None:
            np.testing.assert_allclose(got, expected_hand[n], rtol=rtol, atol=atol,
                                       err_msg=f"{where} against the hand-derived gradient")


def _concrete(t: tc.Tensor, inputs: list[tc.Tensor], arrays: list[np.ndarray]) -> tuple[int, ...]:
    """The shape of `t` for the sizes the arrays bind."""
    env: dict[object, int] = {}
    for x, a in zip(inputs, arrays):
        for dim, n in zip(x.shape, a.shape):
            env[dim] = n
    out = []
    for dim in t.shape:
        out.append(env[dim] if dim in env else int(dim))
    return tuple(out)


def check_program(p: Program, hand: Callable[..., list[np.ndarray]] | None = None) -> None:
    rng, seed = _fresh_rng()
    arrays = random_inputs(p, rng)
    y = _run(tc.build([*p.inputs, p.output], target="sim"), arrays, [_concrete(p.output, p.inputs, arrays)])[0]
    np.testing.assert_allclose(y, p.numpy(*arrays), rtol=1e-10, atol=1e-12, err_msg=f"{p.name} forward")
    check_gradients(p.inputs, p.output, p.inputs, arrays, hand, seed=seed, rng=rng)


# ---- whole programs -------------------------------------------------------------------------------

def test_matmul_bias_tanh_gelu_gradients_match_finite_differences_and_hand_derivation() -> None:
    def hand(a: np.ndarray, b: np.ndarray, c: np.ndarray, dy: np.ndarray) -> list[np.ndarray]:
        h = a @ b + c
        u = math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)
        t = np.tanh(u)
        dh = dy * (0.5 * (1 + t) + 0.5 * h * (1 - t * t) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * h * h))
        return [dh @ b.T, a.T @ dh, dh.sum(0)]

    check_program(matmul_bias_gelu(), hand)


def test_matmul_bias_erf_gelu_gradients_match_finite_differences() -> None:
    def hand(a: np.ndarray, b: np.ndarray, c: np.ndarray, dy: np.ndarray) -> list[np.ndarray]:
        h = a @ b + c
        cdf = 0.5 * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
        dh = dy * (cdf + h * np.exp(-h * h / 2) / math.sqrt(2 * math.pi))
        return [dh @ b.T, a.T @ dh, dh.sum(0)]

    check_program(matmul_bias_gelu(erf=True), hand)


def test_softmax_gradient_is_y_times_dy_minus_its_row_dot() -> None:
    def hand(x: np.ndarray, dy: np.ndarray) -> list[np.ndarray]:
        z = np.exp(x - x.max(-1, keepdims=True))
        y = z / z.sum(-1, keepdims=True)
        return [y * (dy - (dy * y).sum(-1, keepdims=True))]

    check_program(softmax(), hand)


def test_layer_norm_gradients_through_shared_mean_and_variance_stages() -> None:
    def hand(x: np.ndarray, g: np.ndarray, b: np.ndarray, dy: np.ndarray) -> list[np.ndarray]:
        mu = x.mean(-1, keepdims=True)
        inv = 1 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        xhat = (x - mu) * inv
        dxhat = dy * g
        dx = inv * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
        return [dx, (dy * xhat).sum(0), dy.sum(0)]

    check_program(layer_norm(), hand)


def test_attention_gradients_match_finite_differences_and_hand_derivation() -> None:
    def hand(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray) -> list[np.ndarray]:
        scale = 1 / math.sqrt(q.shape[1])
        s = q @ k.T * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        dp = do @ v.T
        ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
        return [ds @ k, ds.T @ q, p.T @ do]

    check_program(attention(), hand)


def test_attention_forward_backward_reads_the_forward_output_and_log_sum_exp() -> None:
    """The online form's forward_backward: one program [Q, K, V, dO, O, dQ, dK, dV] whose
    gradients read the forward's O and log-sum-exp stages (no saved placeholder), and which
    computes the same output and gradients as the forward and the backward built apart."""
    rng, seed = _fresh_rng()
    p = attention()
    g = tc.grad(p.output, p.inputs)
    assert g.saved and "FlashAttention-2" in g.form, g.form
    joint = list(g.forward_backward)
    assert joint[:5] == [*p.inputs, g.cotangent, p.output]
    assert not {id(t) for t in g.saved} & {id(r.tensor) for d in joint[5:] for r in _reads_below(d)}
    arrays = random_inputs(p, rng)
    do = rng.standard_normal(arrays[0].shape)
    shapes = [arrays[0].shape] + [a.shape for a in arrays]
    got = _run(tc.build(joint, target="sim"), [*arrays, do], shapes)
    y, lse = _run(tc.build(list(g.forward), target="sim"), arrays, [arrays[0].shape, arrays[0].shape[:1]])
    want = [y, *_run(tc.build(g.args, target="sim"), [*arrays, y, lse, do], [a.shape for a in arrays])]
    for name, a, b in zip(["O", "dQ", "dK", "dV"], got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"{name} of the joint program (seed {seed})")


def _reads_below(t: tc.Tensor) -> list:
    """Every read in the programs of t, through computes."""
    from tecc.ir.expr import TensorRead, walk

    out, seen, stack = [], set(), [t]
    while stack:
        u = stack.pop()
        if id(u) in seen or u.is_placeholder:
            continue
        seen.add(id(u))
        reads = [n for n in walk(u.op.body) if isinstance(n, TensorRead)]
        out.extend(reads)
        stack.extend(r.tensor for r in reads)
    return out


def test_mlp_block_gradients_through_two_contractions_and_a_residual() -> None:
    check_program(mlp_block())


# ---- single rules ---------------------------------------------------------------------------------

def test_max_reduction_gradient_goes_to_the_maximum() -> None:
    rng, seed = _fresh_rng()
    X = tc.placeholder((5, 6), "float64", name="X")
    c = tc.reduce_axis(6, name="c")
    Y = tc.compute((5,), lambda i: tc.max(X[i, c] * X[i, c], axis=c), name="Y")
    x = rng.standard_normal((5, 6))

    def hand(x: np.ndarray, dy: np.ndarray) -> list[np.ndarray]:
        sq = x * x
        mask = sq == sq.max(-1, keepdims=True)
        return [np.where(mask, 2 * x * dy[:, None], 0.0)]

    check_gradients([X], Y, [X], [x], hand, seed=seed, rng=rng)


def test_min_reduction_ties_share_the_gradient_equally() -> None:
    X = tc.placeholder((2, 4), "float64", name="X")
    c = tc.reduce_axis(4, name="c")
    Y = tc.compute((2,), lambda i: tc.min(X[i, c], axis=c), name="Y")
    g = tc.grad(Y, [X])
    back = tc.build(g.args, target="sim")
    x = np.array([[0.5, -1.25, 3.0, -1.25], [2.0, 1.5, 1.75, 4.0]])
    dx = np.full_like(x, np.nan)
    back(x, np.array([3.0, -2.0]), dx)
    np.testing.assert_array_equal(dx, [[0, 1.5, 0, 1.5], [0, -2.0, 0, 0]])


def test_where_passes_the_gradient_through_the_taken_branch() -> None:
    rng, seed = _fresh_rng()
    X = tc.placeholder((4, 5), "float64", name="X")
    W = tc.placeholder((4, 5), "float64", name="W")
    Y = tc.compute((4, 5), lambda i, j: tc.where(X[i, j] > 0, X[i, j] * W[i, j], 0.1 * tc.exp(X[i, j])), name="Y")

    def hand(x: np.ndarray, w: np.ndarray, dy: np.ndarray) -> list[np.ndarray]:
        return [dy * np.where(x > 0, w, 0.1 * np.exp(x)), dy * np.where(x > 0, x, 0.0)]

    check_gradients([X, W], Y, [X, W], [rng.standard_normal((4, 5)), rng.standard_normal((4, 5))], hand,
                    seed=seed, rng=rng)


def test_broadcasts_sum_the_gradient_over_the_broadcast_axes() -> None:
    rng, seed = _fresh_rng()
    N = tc.var("N")
    X = tc.placeholder((N, 3), "float64", name="X")
    row = tc.placeholder((3,), "float64", name="row")
    col = tc.placeholder((N,), "float64", name="col")
    Y = tc.compute((N, 3), lambda i, j: X[i, j] * row[j] - col[i] / row[j], name="Y")

    def hand(x: np.ndarray, r: np.ndarray, c: np.ndarray, dy: np.ndarray) -> list[np.ndarray]:
        return [dy * r, (dy * (x + c[:, None] / r**2)).sum(0), -(dy / r).sum(1)]

    arrays = [rng.standard_normal((6, 3)), rng.uniform(0.5, 2.0, 3), rng.standard_normal(6)]
    check_gradients([X, row, col], Y, [X, row, col], arrays, hand, seed=seed, rng=rng)


def test_transposed_and_shifted_reads_gather_from_the_right_elements() -> None:
    rng, seed = _fresh_rng()
    X = tc.placeholder((5, 4), "float64", name="X")
    # Y[i, j] = X[j, i] * X[j + 1, i] for j < 4: a transpose and a shift of the same input
    Y = tc.compute((4, 4), lambda i, j: X[j, i] * X[j + 1, i], name="Y")

    def hand(x: np.ndarray, dy: np.ndarray) -> list[np.ndarray]:
        dx = np.zeros_like(x)
        dx[:4] += (dy * x[1:].T).T
        dx[1:] += (dy * x[:4].T).T
        return [dx]

    check_gradients([X], Y, [X], [rng.standard_normal((5, 4))], hand, seed=seed, rng=rng)


@pytest.mark.parametrize("name, op, np_derivative, low", [
    ("exp", tc.exp, np.exp, -1.0),
    ("log", tc.log, lambda x: 1 / x, 0.5),
    ("sqrt", tc.sqrt, lambda x: 0.5 / np.sqrt(x), 0.5),
    ("rsqrt", tc.rsqrt, lambda x: -0.5 * x**-1.5, 0.5),
    ("sin", tc.sin, np.cos, -1.0),
    ("cos", tc.cos, lambda x: -np.sin(x), -1.0),
    ("tanh", tc.tanh, lambda x: 1 - np.tanh(x) ** 2, -1.0),
    ("sigmoid", tc.sigmoid, lambda x: np.exp(-x) / (1 + np.exp(-x)) ** 2, -1.0),
    ("erf", tc.erf, lambda x: 2 / math.sqrt(math.pi) * np.exp(-x * x), -1.0),
    ("abs", tc.abs, np.sign, -1.0),
    ("exp2", tc.exp2, lambda x: np.log(2) * 2**x, -1.0),
    ("log2", tc.log2, lambda x: 1 / (x * np.log(2)), 0.5),
    ("cube", lambda x: x**3.0, lambda x: 3 * x * x, -1.0),
    ("pow_x_x", lambda x: tc.pow(x, x), lambda x: x**x * (np.log(x) + 1), 0.5),
    ("reciprocal", lambda x: 1.0 / x, lambda x: -1 / x**2, 0.5),
])
def test_elementwise_math_rules(name: str, op: Callable[[tc.Expr], tc.Expr], np_derivative: Callable[..., np.ndarray],
                                low: float) -> None:
    rng, seed = _fresh_rng()
    X = tc.placeholder((7,), "float64", name="X")
    Y = tc.compute((7,), lambda i: op(X[i]), name="Y")
    x = rng.uniform(low, 2.0, 7)
    check_gradients([X], Y, [X], [x], lambda x, dy: [dy * np_derivative(x)], seed=seed, rng=rng)


def test_elementwise_maximum_and_minimum_give_ties_to_the_first_operand() -> None:
    A = tc.placeholder((4,), "float64", name="A")
    B = tc.placeholder((4,), "float64", name="B")
    Y = tc.compute((4,), lambda i: tc.maximum(A[i], B[i]) + 10.0 * tc.minimum(A[i], B[i]), name="Y")
    g = tc.grad(Y, [A, B])
    back = tc.build(g.args, target="sim")
    a, b = np.array([1.0, 2.0, -3.0, 0.5]), np.array([1.0, 3.0, -4.0, 0.25])
    da, db = np.full(4, np.nan), np.full(4, np.nan)
    back(a, b, np.ones(4), da, db)
    # ties (element 0): both max and min send their gradient to A
    np.testing.assert_array_equal(da, [11.0, 10.0, 1.0, 1.0])
    np.testing.assert_array_equal(db, [0.0, 1.0, 10.0, 10.0])


def test_casts_carry_the_gradient_back_in_the_input_dtype() -> None:
    rng, seed = _fresh_rng()
    X = tc.placeholder((6,), "float32", name="X")
    Y = tc.compute((6,), lambda i: tc.cast(X[i], "float64") * tc.cast(X[i], "float64"), name="Y")
    g = tc.grad(Y, [X])
    assert g.grads[0].dtype == tc.float32
    back = tc.build(g.args, target="sim")
    x = rng.standard_normal(6).astype(np.float32)
    dy = rng.standard_normal(6)
    dx = np.full(6, np.nan, np.float32)
    back(x, dy, dx)
    np.testing.assert_allclose(dx, (2 * x.astype(np.float64) * dy).astype(np.float32), rtol=1e-6,
                               err_msg=f"seed {seed}")


def test_integer_inputs_get_no_gradient_and_cannot_be_asked_for() -> None:
    rng, seed = _fresh_rng()
    X = tc.placeholder((5,), "float64", name="X")
    idx = tc.placeholder((5,), "int32", name="idx")
    Y = tc.compute((5,), lambda i: X[i] * tc.cast(idx[i], "float64") + tc.cast(idx[i] * 2, "float64"), name="Y")
    x, ix = rng.standard_normal(5), rng.integers(1, 9, 5).astype(np.int32)
    g = tc.grad(Y, [X])
    back = tc.build(g.args, target="sim")
    dy = rng.standard_normal(5)
    dx = np.full(5, np.nan)
    back(x, ix, dy, dx)
    np.testing.assert_allclose(dx, dy * ix, rtol=1e-12, err_msg=f"seed {seed}")
    with pytest.raises(tc.DTypeError, match="idx is int32"):
        tc.grad(Y, [idx])


def test_an_input_the_output_does_not_read_gets_a_zero_gradient() -> None:
    X = tc.placeholder((3,), "float64", name="X")
    unused = tc.placeholder((2,), "float64", name="unused")
    Y = tc.compute((3,), lambda i: X[i] * 2.0, name="Y")
    g = tc.grad(Y, [X, unused])
    back = tc.build([X, unused, g.cotangent, *g.grads], target="sim")
    dx, du = np.full(3, np.nan), np.full(2, np.nan)
    back(np.ones(3), np.ones(2), np.array([1.0, 2.0, 3.0]), dx, du)
    np.testing.assert_array_equal(dx, [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(du, [0.0, 0.0])


def test_the_backward_program_lists_inputs_cotangent_and_gradients() -> None:
    p = matmul_bias_gelu()
    g = tc.grad(p.output, [p.inputs[0], p.inputs[2]])
    assert g.cotangent.name == "dY" and g.cotangent.dtype == p.output.dtype
    assert [t.name for t in g.args] == ["A", "B", "bias", "dY", "dA", "dbias"]
    assert g[p.inputs[2]] is g.grads[1]


# ---- refusals -------------------------------------------------------------------------------------

def test_a_convolution_like_read_is_refused_naming_the_read() -> None:
    X = tc.placeholder((10,), "float64", name="X")
    w = tc.placeholder((3,), "float64", name="w")
    k = tc.reduce_axis(3, name="k")
    Y = tc.compute((8,), lambda i: tc.sum(X[i + k] * w[k], axis=k), name="Y")
    with pytest.raises(tc.GradientError, match=r"Y's read X\[i \+ k\].*index 0"):
        tc.grad(Y, [X])
    tc.grad(Y, [w])  # w's reads are plain axes: its gradient is fine


def test_prod_reductions_are_refused_with_a_rewrite_to_use() -> None:
    X = tc.placeholder((4, 3), "float64", name="X")
    k = tc.reduce_axis(3, name="k")
    Y = tc.compute((4,), lambda i: tc.prod(X[i, k], axis=k), name="Y")
    with pytest.raises(tc.GradientError, match="prod reduction.*exp\\(sum\\(log"):
        tc.grad(Y, [X])


def test_gradients_are_taken_with_respect_to_placeholders_only() -> None:
    p = softmax()
    with pytest.raises(tc.GradientError, match="not a placeholder"):
        tc.grad(p.output, [p.output])


def test_generated_names_never_collide_with_the_programs_own() -> None:
    X = tc.placeholder((3,), "float64", name="X")
    dY = tc.compute((3,), lambda i: X[i] * 3.0, name="dY")  # a forward stage named like an adjoint
    Y = tc.compute((3,), lambda i: dY[i] * X[i], name="Y")
    g = tc.grad(Y, [X])
    names = [t.name for t in g.args]
    assert len(set(names)) == len(names) and g.cotangent.name != "dY"
    back = tc.build(g.args, target="sim")
    x, dy = np.array([1.0, -2.0, 0.5]), np.array([0.25, 1.0, -3.0])
    (dx,) = _run(back, [x, dy], [(3,)])
    np.testing.assert_allclose(dx, dy * 6 * x, rtol=1e-12)


def test_a_reduction_nested_in_another_is_refused_naming_the_stage() -> None:
    X = tc.placeholder((4, 3, 2), "float64", name="X")
    a, b = tc.reduce_axis(3, name="a"), tc.reduce_axis(2, name="b")
    Y = tc.compute((4,), lambda i: tc.sum(tc.exp(tc.max(X[i, a, b], axis=b)), axis=a), name="Y")
    with pytest.raises(tc.GradientError, match="Y nests the reduction .* inside another"):
        tc.grad(Y, [X])


def test_a_non_float_output_cannot_be_differentiated() -> None:
    X = tc.placeholder((4,), "float64", name="X")
    Y = tc.compute((4,), lambda i: tc.cast(X[i] > 0, "int32"), name="Y")
    with pytest.raises(tc.DTypeError, match="output Y is int32"):
        tc.grad(Y, [X])


def test_iterating_the_gradients_yields_them_in_wrt_order() -> None:
    M, K, N = 3, 4, 5
    A = tc.placeholder((M, K), "float64", name="A")
    B = tc.placeholder((K, N), "float64", name="B")
    k = tc.reduce_axis(K, name="k")
    C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    g = tc.grad(C, [B, A])  # not the order the program reads them in
    assert len(g) == 2 and list(g) == [g[B], g[A]]
    dB, dA = g
    assert dB.shape == B.shape and dA.shape == A.shape
    f = tc.build(g.args, target="sim")  # [A, B, dC, dB, dA]
    rng, seed = _fresh_rng()
    a, b, dc = rng.standard_normal((M, K)), rng.standard_normal((K, N)), rng.standard_normal((M, N))
    got_db, got_da = f(a, b, dc)
    np.testing.assert_allclose(got_db, a.T @ dc, rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")
    np.testing.assert_allclose(got_da, dc @ b.T, rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")
