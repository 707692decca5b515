"""A row sum over a one-hot row in closed form (fuse_rows, row_algebra.delta_sum): cross-entropy's
backward sums the scatter of -1 at each row's target, Σ_c where(t[r] == c, -1, 0)·w[r]; the row
kernel computes it once per row instead of walking the row. Checked in the emulator against
float64 NumPy, with targets outside the row (ignored rows) and an infinite weight, whose 0·inf
over the other columns makes the walked sum NaN."""

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def ce_backward(R, C, dtype):
    X = tc.placeholder((R, C), dtype, name="X")
    L = tc.placeholder((R,), "float32", name="L")
    T = tc.placeholder((R,), "int64", name="T")
    W = tc.placeholder((R,), "float32", name="W")
    c = tc.reduce_axis(C, name="c")
    g = tc.compute((R, C), lambda r, j: tc.where(T[r] == tc.cast(j, "int64"), -1.0, 0.0) * W[r], name="g")
    s = tc.compute((R,), lambda r: tc.sum(g[r, c], axis=c), name="s")
    Y = tc.compute((R, C), lambda r, j: tc.cast(g[r, j] - tc.exp(tc.cast(X[r, j], "float32") - L[r]) * s[r], dtype),
                   name="Y")
    return [X, L, T, W, Y]


def reference(x, lse, t, w):
    x = np.asarray(x, np.float64)
    cols = np.arange(x.shape[1])
    with np.errstate(invalid="ignore"):
        g = np.where(t[:, None] == cols[None, :], -1.0, 0.0) * np.asarray(w, np.float64)[:, None]
        s = g.sum(axis=1)
        return g - np.exp(x - np.asarray(lse, np.float64)[:, None]) * s[:, None]


PLANS = {"registers": dict(threads=32, cache="registers", vector=4),
         "none": dict(threads=64, cache="none", vector=4, unroll=3)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cache,columns", [("registers", 96), ("none", 1000)])
def test_a_one_hot_row_sum_takes_no_walk_and_matches_float64(cache, columns, dtype):
    R = 7
    rng = np.random.default_rng(3)
    x = rng.standard_normal((R, columns)).astype(NP[dtype])
    lse = (np.log(np.exp(np.asarray(x, np.float64)).sum(axis=1))).astype(np.float32)
    t = rng.integers(0, columns, R).astype(np.int64)
    t[1], t[2], t[3] = -1, columns, columns - 1       # ignored (outside the row) and the last column
    w = rng.uniform(0.1, 1.0, R).astype(np.float32)
    w[4] = np.inf                                     # 0·inf on the other columns: the row's sum is NaN
    k = tc.build(ce_backward(R, columns, dtype), target="sim", plan=Plan((Step("fuse_rows", PLANS[cache]),)))
    text = str(k.module)
    assert "s_acc" not in text, "the one-hot row sum still walks the row"
    y = np.full((R, columns), np.nan, NP[dtype])
    k(x, lse, t, w, y)
    want = reference(x, lse, t, w)
    got = np.asarray(y, np.float64)
    assert np.isnan(got[4]).all() and np.isnan(want[4]).all()
    ok = np.arange(R) != 4
    bound = 1e-5 if dtype == "float32" else 2 ** -8
    err = np.abs(got[ok] - want[ok]) / np.maximum(np.abs(want[ok]), 1e-3)
    assert err.max() <= bound, err.max()
    # a target outside the row hits no column: the sum is 0 and so is the row's gradient
    assert (got[1] == 0).all() and (got[2] == 0).all()


def test_a_sum_that_reads_the_row_still_walks_it():
    """The source also reads the row at the column: no closed form."""
    R, C = 3, 64
    X = tc.placeholder((R, C), "float32", name="X")
    T = tc.placeholder((R,), "int64", name="T")
    c = tc.reduce_axis(C, name="c")
    g = tc.compute((R, C), lambda r, j: tc.where(T[r] == tc.cast(j, "int64"), X[r, j], 0.0), name="g")
    s = tc.compute((R,), lambda r: tc.sum(g[r, c], axis=c), name="s")
    Y = tc.compute((R, C), lambda r, j: X[r, j] * s[r], name="Y")
    k = tc.build([X, T, Y], target="sim", plan=Plan((Step("fuse_rows", PLANS["registers"]),)))
    assert "s_acc" in str(k.module)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((R, C)).astype(np.float32)
    t = np.array([0, 63, 70], np.int64)
    y = np.full((R, C), np.nan, np.float32)
    k(x, t, y)
    s_ref = np.array([x[0, 0], x[1, 63], 0.0])
    np.testing.assert_allclose(y, x * s_ref[:, None], rtol=1e-6)
