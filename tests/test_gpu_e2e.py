"""GPU end to end: the three kernels of the design notes at many shapes (odd, prime, 1, 0, large),
on the device, each compared with float64 NumPy on fresh random inputs and poisoned outputs, and
with the emulator where the shape is small enough to emulate quickly."""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.check import OpSpec, run_and_compare

pytestmark = pytest.mark.gpu

SHAPES_2D = [(1, 1), (0, 7), (7, 0), (13, 17), (97, 101), (1024, 1023), (4099, 257), (1 << 12, 1 << 12)]


def _elementwise():
    R, C = tc.var("R"), tc.var("C")
    x = tc.placeholder((R, C), "float32", name="x", strides="any")
    a = tc.placeholder((C,), "float32", name="a")
    b = tc.placeholder((), "float32", name="b")
    y = tc.compute((R, C), lambda i, j: tc.sin(a[j] * x[i, j] + b[()]), name="y")
    return [x, a, b, y]


def _row_sum(dtype):
    R, C = tc.var("R"), tc.var("C")
    x = tc.placeholder((R, C), dtype, name="x")
    c = tc.reduce_axis(C, name="c")
    y = tc.compute((R,), lambda r: tc.sum(x[r, c], axis=c), name="y")
    return [x, y]


def _matmul():
    M, N, K = tc.var("M"), tc.var("N"), tc.var("K")
    A = tc.placeholder((M, K), "float32", name="A")
    B = tc.placeholder((K, N), "float32", name="B")
    k = tc.reduce_axis(K, name="k")
    C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    return [A, B, C]


@pytest.mark.parametrize("shape", SHAPES_2D, ids=str)
def test_elementwise_sin_axpb(shape):
    r, c = shape
    args = _elementwise()
    f = tc.build(args, "cuda", name="ew")
    spec = OpSpec("sin_axpb", args, lambda x, a, b: np.sin(a[None, :] * x + b), sizes={"R": r, "C": c})
    result = run_and_compare(spec, f, seed=r * 31 + c)
    assert result.ok, str(result)


@pytest.mark.parametrize("shape", SHAPES_2D, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_sum(shape, dtype):
    r, c = shape
    args = _row_sum(dtype)
    f = tc.build(args, "cuda", name="rs")
    result = run_and_compare(OpSpec("row_sum", args, lambda x: x.sum(axis=-1), sizes={"R": r, "C": c}), f,
                             seed=r + c)
    assert result.ok, str(result)


@pytest.mark.parametrize("mnk", [(1, 1, 1), (0, 5, 3), (5, 3, 0), (127, 129, 131), (256, 256, 256),
                                 (1000, 1000, 1000), (2048, 64, 512)], ids=str)
def test_matmul(mnk):
    m, n, k = mnk
    args = _matmul()
    f = tc.build(args, "cuda", name="mm")
    result = run_and_compare(OpSpec("matmul", args, lambda a, b: a @ b, sizes={"M": m, "N": n, "K": k}), f,
                             seed=m + n + k)
    assert result.ok, str(result)


def test_gpu_and_emulator_agree_to_rounding():
    args = _matmul()
    f = tc.build(args, "cuda", name="mm")
    rng = np.random.default_rng(7)
    a = rng.uniform(-1, 1, (33, 65)).astype(np.float32)
    b = rng.uniform(-1, 1, (65, 17)).astype(np.float32)
    gpu = np.full((33, 17), np.nan, np.float32)
    sim = np.full((33, 17), np.nan, np.float32)
    f(a, b, gpu)
    f.sim(a, b, sim)
    np.testing.assert_allclose(gpu, sim, rtol=1e-5, atol=1e-6)


def test_torch_tensors_in_place_including_a_transposed_view():
    torch = pytest.importorskip("torch")
    args = _elementwise()
    f = tc.build(args, "cuda", name="ew")
    base = torch.rand(300, 129, device="cuda") * 2 - 1
    x = base.t()  # (129, 300), non-contiguous
    a = torch.rand(300, device="cuda")
    b = torch.tensor(0.5, device="cuda")
    y = torch.full((129, 300), float("nan"), device="cuda")
    f(x, a, b, y)
    torch.cuda.synchronize()
    ref = torch.sin(a.double()[None, :] * x.double() + 0.5)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6)
