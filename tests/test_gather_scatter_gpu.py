"""Data-dependent indices on the GPU: gathers and scatter-adds against NumPy float64, the
out-of-range error (the module's error record, raised as OutOfBoundsError when the call is
synchronized, never memory corruption), atomics against the deterministic realization, and the
error of an in-place torch call surfacing at `synchronize()`."""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc
from tecc.ir import dtype as dt
from tecc.ir.errors import OutOfBoundsError

pytestmark = pytest.mark.gpu

RNG = np.random.default_rng(3030)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2 ** -7, "float16": 2 ** -10}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(dt.as_dtype(name).numpy)


def embedding(n, d, v, dtype, index):
    W = tc.placeholder((v, d), dtype, name="W")
    idx = tc.placeholder((n,), index, name="idx")
    return [W, idx, tc.compute((n, d), lambda i, j: W[idx[i], j], name="Y")]


def embedding_backward(n, d, v, dtype, index):
    dY = tc.placeholder((n, d), dtype, name="dY")
    idx = tc.placeholder((n,), index, name="idx")
    return [dY, idx, tc.scatter_add((v, d), (n, d), at=lambda i, j: (idx[i], j), value=lambda i, j: dY[i, j],
                                    name="dW")]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got64 = got.astype(np.float64)
    assert not np.isnan(got64).any(), "an output element was never written"
    return float((np.abs(got64 - want) / (1.0 + np.abs(want))).max()) if want.size else 0.0


@pytest.mark.parametrize("index", ["int32", "int64"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_gather_copies_the_indexed_rows(dtype, index):
    n, d, v = 2049, 768, 5003
    f = tc.build(embedding(n, d, v, dtype, index), target="cuda")
    w = RNG.standard_normal((v, d)).astype(np_dtype(dtype))
    ix = RNG.integers(0, v, n).astype(index)
    y = np.full((n, d), np.nan, np_dtype(dtype))
    f(w, ix, y)
    assert np.array_equal(y, w[ix]), f.plan


@pytest.mark.parametrize("bad", [5003, -1, 2 ** 40])
def test_gpu_out_of_range_gather_raises_and_the_next_call_runs(bad):
    n, d, v = 300, 64, 5003
    f = tc.build(embedding(n, d, v, "float32", "int64"), target="cuda")
    w = RNG.standard_normal((v, d)).astype("float32")
    ix = RNG.integers(0, v, n)
    ix[123] = bad
    with pytest.raises(OutOfBoundsError) as info:
        f(w, ix, np.empty((n, d), "float32"))
    text = str(info.value)
    assert f"{bad} indexes dimension 0 of W (size {v})" in text and "Y_kernel" in text, text
    ix[123] = 7  # the record was cleared and the context is healthy: a correct call runs
    y = np.full((n, d), np.nan, "float32")
    f(w, ix, y)
    assert np.array_equal(y, w[ix])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_atomic_scatter_matches_np_add_at(dtype):
    n, d, v = 8192, 768, 1000  # ~8 additions per element on average, a hot row of 500 below
    f = tc.build(embedding_backward(n, d, v, dtype, "int64"), target="cuda")
    assert "scatter_atomic" in f.plan.strategy, f.explain()
    y = RNG.standard_normal((n, d)).astype(np_dtype(dtype))
    ix = RNG.integers(0, v, n)
    ix[:500] = 17
    out = np.full((v, d), np.nan, np_dtype(dtype))
    f(y, ix, out)
    want = np.zeros((v, d))
    np.add.at(want, ix, y.astype(np.float64))
    # float32 accumulation of up to 500 terms, in the hardware's order, then one rounding
    assert relative_error(out, want) <= max(TOLERANCE[dtype], 1e-4), f.plan


def test_gpu_deterministic_scatter_is_bitwise_reproducible():
    n, d, v = 4096, 256, 300
    tensors = embedding_backward(n, d, v, "float32", "int32")
    f = tc.build(tensors, target="cuda", deterministic=True)
    assert "scatter_atomic" not in f.plan.strategy
    y = RNG.standard_normal((n, d)).astype("float32")
    ix = RNG.integers(0, v, n).astype("int32")
    runs = []
    for _ in range(3):
        out = np.full((v, d), np.nan, "float32")
        f(y, ix, out)
        runs.append(out)
    assert all(np.array_equal(runs[0], r) for r in runs[1:]), "deterministic scatter differs between runs"
    want = np.zeros((v, d))
    np.add.at(want, ix, y.astype(np.float64))
    assert relative_error(runs[0], want) <= 1e-4
    # the emulator sums in the same fixed order
    sim = np.full((v, d), np.nan, "float32")
    f.sim(y, ix, sim)
    assert np.array_equal(sim, runs[0])


def test_gpu_out_of_range_scatter_raises_without_writing_outside():
    n, d, v = 1000, 128, 64
    f = tc.build(embedding_backward(n, d, v, "float32", "int32"), target="cuda")
    y = RNG.standard_normal((n, d)).astype("float32")
    ix = RNG.integers(0, v, n).astype("int32")
    ix[999] = v + 5
    with pytest.raises(OutOfBoundsError, match=f"{v + 5} indexes dimension 0 of dW"):
        f(y, ix, np.empty((v, d), "float32"))
    ix[999] = 0
    out = np.full((v, d), np.nan, "float32")
    f(y, ix, out)
    want = np.zeros((v, d))
    np.add.at(want, ix, y.astype(np.float64))
    assert relative_error(out, want) <= 1e-4


def test_gpu_error_of_an_in_place_torch_call_surfaces_at_synchronize():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    n, d, v = 256, 64, 100
    f = tc.build(embedding(n, d, v, "float32", "int64"), target="cuda")
    w = torch.randn(v, d, device="cuda")
    ix = torch.randint(0, v, (n,), device="cuda")
    y = torch.empty(n, d, device="cuda")
    f(w, ix, y)
    f.synchronize()
    assert torch.equal(y, w[ix])
    ix[3] = -2
    f(w, ix, y)  # asynchronous: nothing raised yet
    with pytest.raises(OutOfBoundsError, match="-2 indexes dimension 0 of W"):
        f.synchronize()
    ix[3] = 1
    f(w, ix, y)
    f.synchronize()
    assert torch.equal(y, w[ix])
