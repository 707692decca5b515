"""Row-invariant factors of a row kernel's per-column expressions (passes/rewrite/row_algebra.py):
products with two or more factors free of the column group them into one subexpression, a sum's
invariant factor moves out of the sum; nothing else changes."""

import sys
from pathlib import Path

import numpy as np

import tecc as tc
from tecc.ir import dtype as dt
from tecc.ir.expr import Binary, Var, free_vars
from tecc.ir.stmt import Buffer
from tecc.passes.rewrite.row_algebra import group_invariants, split_invariant

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import row_backward as rb  # noqa: E402

K = Var("k", dt.int32)
ROW = Buffer("row_vals", dt.float32, (1,), "local")
X = Buffer("x_row", dt.float32, (8,), "local")


def _x():
    return X[K]


def _r():
    return tc.rsqrt(ROW[tc.const(0, "int32")] + 1e-5)


def test_two_invariant_factors_become_one_subexpression():
    e = _x() * _x() * -0.5 * _r() * _r()
    out = group_invariants(e, {K})
    assert isinstance(out, Binary) and out.op == "*"
    assert out.a is _x() * _x()                      # the column factors, in their order
    assert K not in free_vars(out.b)                  # one invariant subtree: computed once per row
    assert str(out.b) == str(((tc.const(-0.5, "float32")) * _r()) * _r())


def test_a_single_invariant_factor_or_an_invariant_subtree_is_left_as_it_is():
    for e in (_x() * _r() * _x(), (ROW[tc.const(0, "int32")] * 0.25) * _x(), _x() / _r() / _r()):
        assert group_invariants(e, {K}) is e, e


def test_a_sums_invariant_factor_moves_out_of_the_sum():
    column, factor = split_invariant(_x() * 3.0 * _r(), {K})
    assert column is _x() and factor is not None and str(factor) == str(tc.const(3.0, "float32") * _r())
    assert split_invariant(_x() + _r(), {K}) == (_x() + _r(), None)
    assert split_invariant(_x() * _x(), {K}) == (_x() * _x(), None)


def test_layer_norm_backward_sums_without_the_row_constants_and_matches_float64():
    """dvar's source dY·g·(x − μ)·(−0.5)·r·r·r sums dY·g·(x − μ) and scales the total."""
    g = rb.layer_norm_backward(9, 300, save=True)
    k = tc.build(g.args, target="sim")
    src = str(k.module.kernels[0].body)
    line = next(ln for ln in src.splitlines() if "dvar_acc[0] = dvar_acc[0] +" in ln)
    assert "rsqrt" not in line, line
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 300)).astype(np.float32)
    gg, bb, dy = (rng.standard_normal(s).astype(np.float32) for s in (300, 300, (9, 300)))
    fwd = tc.build(list(g.forward), target="sim")
    y, mu, var = np.empty_like(x), np.empty(9, np.float32), np.empty(9, np.float32)
    fwd(x, gg, bb, y, mu, var)
    outs = [np.full((9, 300), np.nan, np.float32), np.full(300, np.nan, np.float32), np.full(300, np.nan, np.float32)]
    k(x, gg, bb, mu, var, dy, *outs)
    for got, want in zip(outs, rb.np_layer_norm_backward(x, gg, bb, dy)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())



def test_a_division_free_of_the_column_is_found_once_and_not_under_a_select():
    from tecc.passes.rewrite.row_algebra import invariant_divisions

    q = ROW[tc.const(0, "int32")] / _r()
    e = _x() * q + q * 2.0
    assert invariant_divisions(e, {K}) == [q]
    assert invariant_divisions(_x() / _r(), {K}) == []                 # varies with the column
    guarded = tc.where(_x() > 0.0, q, 0.0)
    assert invariant_divisions(guarded, {K}) == []                     # a Select's branch: left there


def test_cross_entropy_divides_once_per_row():
    k = tc.build(rb.cross_entropy_forward_backward(4, 3000), target="sim")
    body = str(k.module.kernels[0].body)
    assert body.count(" / ") == 1, [ln for ln in body.splitlines() if " / " in ln]
