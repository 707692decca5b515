"""Costly loop-invariant expressions computed once before their loop (tecc/passes/hoist_invariants.py):
resnet50's max pool reads the stem's batch norm inlined, and computed the channel's
1 / sqrt(var[c] + eps) for each of the 9 window elements, under the window's padding test.

Each kernel runs in the emulator against float64 NumPy on fresh random inputs, its output
poisoned (NaN); the loop IR says what was taken out and what was left (a load of a buffer the
kernel writes, an index the loops' ranges do not bound, a value that changes in the loop)."""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc
from tecc.ir.stmt import For, LetStmt, iter_stmts

EPS = 1e-5


def pool_of_batch_norm(n: int, h: int, w: int, c: int):
    """max over the 3 x 3 window (stride 2, padding 1, -inf outside) of
    relu((x - mean[c]) * (1 / sqrt(var[c] + eps)) * g[c] + b[c]), NHWC."""
    x = tc.placeholder((n, h, w, c), "float32", name="x")
    mean, var = tc.placeholder((c,), "float32", name="mean"), tc.placeholder((c,), "float32", name="var")
    g, b = tc.placeholder((c,), "float32", name="g"), tc.placeholder((c,), "float32", name="b")
    bn = tc.compute((n, h, w, c), lambda i, y, z, k: tc.maximum(
        (x[i, y, z, k] - mean[k]) * (1.0 / tc.sqrt(var[k] + EPS)) * g[k] + b[k], 0.0), name="bn")
    oh, ow = (h - 1) // 2 + 1, (w - 1) // 2 + 1
    kh, kw = tc.reduce_axis(3, name="kh"), tc.reduce_axis(3, name="kw")

    def window(i, y, z, k):
        yy, zz = y * 2 + kh - 1, z * 2 + kw - 1
        inside = (yy >= 0) & (yy < h) & (zz >= 0) & (zz < w)
        return tc.max(tc.where(inside, bn[i, yy, zz, k], tc.const(float("-inf"), "float32")), axis=[kh, kw])
    return [x, mean, var, g, b, tc.compute((n, oh, ow, c), window, name="pool")]


def reference(x, mean, var, g, b):
    n, h, w, c = x.shape
    y = np.maximum((x.astype(np.float64) - mean) / np.sqrt(var.astype(np.float64) + EPS) * g + b, 0.0)
    padded = np.full((n, h + 2, w + 2, c), -np.inf)
    padded[:, 1:-1, 1:-1] = y
    oh, ow = (h - 1) // 2 + 1, (w - 1) // 2 + 1
    out = np.full((n, oh, ow, c), -np.inf)
    for dy in range(3):
        for dx in range(3):
            out = np.maximum(out, padded[:, dy:dy + 2 * oh:2, dx:dx + 2 * ow:2])
    return out


def run_and_check(f, shape, seed):
    """The pool on fresh random inputs, its output poisoned, against float64 NumPy."""
    g = np.random.default_rng(seed)
    x = g.standard_normal(shape).astype(np.float32)
    n, h, w, c = shape
    mean, var = g.standard_normal(c).astype(np.float32), g.uniform(0.25, 4.0, c).astype(np.float32)
    gamma, beta = g.uniform(0.5, 2.0, c).astype(np.float32), g.standard_normal(c).astype(np.float32)
    out = np.full((n, (h - 1) // 2 + 1, (w - 1) // 2 + 1, c), np.nan, np.float32)
    f(x, mean, var, gamma, beta, out)
    np.testing.assert_allclose(out, reference(x, mean, var, gamma, beta), rtol=2e-6, atol=1e-6)


def _lets(f):
    return [s for k in f.module.kernels for s in iter_stmts(k.body) if isinstance(s, LetStmt)
            and "_invariant" in s.var.name]


def test_a_pools_batch_norm_takes_its_channels_square_root_once_per_output():
    shape = (2, 9, 11, 8)
    f = tc.build(pool_of_batch_norm(*shape), target="sim")
    lets = _lets(f)
    assert lets and all("sqrt" in str(s.value) for s in lets), str(f.module)
    # the let is outside the window's loops, and no square root is left inside them
    for s in lets:
        loops = [t for t in iter_stmts(s.body) if isinstance(t, For) and t.var.name in ("kh", "kw")]
        assert loops and not any("sqrt" in line for line in str(loops[0].body).splitlines())
    run_and_check(f, shape, seed=3)


def test_what_changes_in_the_loop_or_cannot_be_read_before_it_stays():
    """exp of the element (changes with the reduction), a load at a data-dependent index (no
    bound), and a per-row value whose index the loops bound: only the last is taken out."""
    R, C = 6, 40
    x = tc.placeholder((R, C), "float32", name="x")
    s = tc.placeholder((R,), "float32", name="s")
    at = tc.placeholder((R,), "int32", name="at")
    k = tc.reduce_axis(C, name="k")
    out = tc.compute((R,), lambda r: tc.sum(tc.exp(x[r, k]) * tc.sqrt(s[r]) + 1.0 / s[at[r]], axis=k), name="out")
    f = tc.build([x, s, at, out], target="sim")
    lets = _lets(f)
    assert [str(l.value) for l in lets] and all("sqrt" in str(l.value) and "at[" not in str(l.value)
                                                 and "exp" not in str(l.value) for l in lets), str(f.module)
    g = np.random.default_rng(0)
    xv = g.standard_normal((R, C)).astype(np.float32)
    sv = g.uniform(0.5, 2.0, R).astype(np.float32)
    av = g.integers(0, R, R).astype(np.int32)
    got = np.full(R, np.nan, np.float32)
    f(xv, sv, av, got)
    want = (np.exp(xv.astype(np.float64)) * np.sqrt(sv.astype(np.float64))[:, None]).sum(1) + C / sv[av]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_kernel_without_costly_invariants_is_left_as_it_is():
    from tecc.passes.hoist_invariants import hoist_invariants
    from tecc.passes.lower import lower

    x = tc.placeholder((4, 16), "float32", name="x")
    k = tc.reduce_axis(16, name="k")
    y = tc.compute((4,), lambda r: tc.sum(x[r, k] * 2.0, axis=k), name="y")
    module = lower([x, y])
    assert hoist_invariants(module) is module


@pytest.mark.gpu
def test_a_pools_batch_norm_on_the_gpu_matches_numpy():
    shape = (4, 56, 58, 64)
    f = tc.build(pool_of_batch_norm(*shape), target="cuda")
    assert _lets(f)
    run_and_check(f, shape, seed=5)
