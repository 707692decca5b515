"""Row fusion of the forms a loss head brings (tecc/passes/rewrite/row_group.py, fuse_rows.py):

* a **row value kept with a size-1 axis**: lse of shape (R, 1), read at [r, 0] by the row's
  output (torch's keepdim statistics, lowered so: docs/models.md, "keepdim");
* a **per-row input of shape (R, 1)** (a target kept with its axis): read once per row, not a row
  of the group's C columns (its bytes are not the row's: row_fused's `row_inputs`);
* a **full reduction with a data-dependent read**: the NLL's mean, Σ_r where(t[r] != -1,
  -Y[r, t[r]], 0) / Σ_r (t[r] != -1), one row of R values reduced by one block, its int64
  targets cached in registers (two registers per element in the occupancy request).

Each in the emulator against float64 NumPy, outputs poisoned (NaN) before the run, at row
lengths 1000 and 1031 (no vector width divides 1031), at the plan row_fused proposes and at
fixed fuse_rows points; and the NVRTC compile of the sm_90 plan without spills.
"""

from __future__ import annotations

import numpy as np
import pytest
from nvrtc_checks import skip_without_nvrtc

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.compiler.strategies.row_fused import propose
from tecc.passes.rewrite.row_group import row_group

IGNORE = -1


def log_softmax_keepdim(R: int, C: int):
    """Y = X - lse, lse = m + log(Σ exp(X - m)) kept as (R, 1): the log-softmax as the torch
    lowering gives it (row statistics at the rows, the saved row value with its axis)."""
    X = tc.placeholder((R, C), "float32", name="X")
    c, c2 = tc.reduce_axis(C, name="c"), tc.reduce_axis(C, name="c2")
    m = tc.compute((R,), lambda r: tc.max(X[r, c], axis=c), name="m")
    s = tc.compute((R,), lambda r: tc.sum(tc.exp(X[r, c2] - m[r]), axis=c2), name="s")
    lse = tc.compute((R, 1), lambda r, o: m[r] + tc.log(s[r]), name="lse")
    Y = tc.compute((R, C), lambda r, j: X[r, j] - lse[r, 0], name="Y")
    return [X, lse, Y]


def scaled_rows(R: int, C: int):
    """Y = X * w[r, 0] - Σ_j X[r, j]·w[r, 0]: a per-row input w of shape (R, 1)."""
    X = tc.placeholder((R, C), "float32", name="X")
    w = tc.placeholder((R, 1), "float32", name="w")
    c = tc.reduce_axis(C, name="c")
    s = tc.compute((R,), lambda r: tc.sum(X[r, c] * w[r, 0], axis=c), name="s")
    Y = tc.compute((R, C), lambda r, j: X[r, j] * w[r, 0] - s[r], name="Y")
    return [X, w, Y]


def nll_mean(R: int, C: int):
    """The NLL's mean over the targets kept: a full reduction reading Y at t[r]."""
    Y = tc.placeholder((R, C), "float32", name="Y")
    t = tc.placeholder((R,), "int64", name="t")
    r, r2 = tc.reduce_axis(R, name="r"), tc.reduce_axis(R, name="r2")
    keep = lambda i: t[i] != tc.const(IGNORE, "int64")  # noqa: E731
    count = tc.compute((), lambda: tc.cast(tc.sum(tc.cast(keep(r2), "int64"), axis=r2), "float32"), name="count")
    pick = lambda i: Y[i, tc.where(keep(i), t[i], tc.const(0, "int64"))]  # noqa: E731
    total = tc.compute((), lambda: tc.sum(tc.where(keep(r), 0.0 - pick(r), 0.0), axis=r), name="total")
    loss = tc.compute((), lambda: total[()] / count[()], name="loss")
    return [Y, t, count, loss]


def _run(args, plan, inputs):
    k = tc.build(args, target="sim", plan=plan)
    outs = [np.full(tuple(int(s) for s in a.shape), np.nan, np.float32) for a in args if not a.is_placeholder]
    k(*inputs, *outs)
    return k, outs


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _plans(args):
    """row_fused's own point and fixed fuse_rows points (registers, re-read, online)."""
    chosen = propose(args, "sm_90")
    assert chosen is not None
    yield chosen.plan
    for step in ({"threads": 64, "cache": "registers"}, {"threads": 128, "cache": "none"},
                 {"threads": 64, "cache": "online"}):
        yield Plan((Step("fuse_rows", step),))


@pytest.mark.parametrize("C", [1000, 1031])
def test_a_row_value_kept_with_a_size_1_axis_is_one_row_kernel(C):
    R = 5
    args = log_softmax_keepdim(R, C)
    group = row_group(args)
    assert [t.name for t in group.row_values] == ["lse"] and [t.name for t in group.elementwise] == ["Y"]
    x = (np.random.default_rng(C).standard_normal((R, C)) * 3).astype(np.float32)
    x64 = x.astype(np.float64)
    m = x64.max(1, keepdims=True)
    lse = m + np.log(np.exp(x64 - m).sum(1, keepdims=True))
    for plan in _plans(args):
        k, (got_lse, got_y) = _run(args, plan, [x])
        assert len(k.module.kernels) == 1, plan
        assert got_lse.shape == (R, 1)
        assert _rel(got_lse, lse) <= 1e-6, plan
        assert _rel(got_y, x64 - lse) <= 1e-6, plan


@pytest.mark.parametrize("C", [1000, 1031])
def test_a_per_row_input_of_shape_r_1_is_read_per_row_not_as_a_row(C):
    R = 4
    args = scaled_rows(R, C)
    assert [t.name for t in row_group(args).row_inputs] == ["X"]
    chosen = propose(args, "sm_90")
    assert chosen is not None and chosen.vector > 1 or C % 2, chosen
    rng = np.random.default_rng(C + 7)
    x, w = rng.standard_normal((R, C)).astype(np.float32), rng.standard_normal((R, 1)).astype(np.float32)
    want = x.astype(np.float64) * w - (x.astype(np.float64) * w).sum(1, keepdims=True)
    for plan in _plans(args):
        _, (y,) = _run(args, plan, [x, w])
        assert _rel(y, want) <= 1e-6, plan


@pytest.mark.parametrize("C", [1000, 1031])
def test_the_nll_mean_with_its_gather_is_one_block_reduction(C):
    R = 777
    args = nll_mean(R, C)
    chosen = propose(args, "sm_90")
    assert chosen is not None, "a full reduction over the rows is a row group of one row"
    rng = np.random.default_rng(C)
    y = rng.standard_normal((R, C)).astype(np.float32)
    t = rng.integers(0, C, R).astype(np.int64)
    t[::5] = IGNORE
    kept = np.nonzero(t != IGNORE)[0]
    want_total = -(y.astype(np.float64)[kept, t[kept]]).sum()
    for plan in (chosen.plan, Plan((Step("fuse_rows", {"threads": 128, "cache": "registers"}),))):
        k, (count, loss) = _run(args, plan, [y, t])
        assert len(k.module.kernels) == 1, plan
        assert count.shape == () and float(count) == len(kept)
        assert abs(float(loss) - want_total / len(kept)) <= 1e-5 * abs(want_total / len(kept)), plan


def test_the_nll_mean_compiles_for_sm_90_without_spills():
    """Its int64 targets cached in registers count two registers each in the occupancy request
    (counted as one, the 512-thread block asked for 3 per SM, 42 registers, and ptxas spilled)."""
    skip_without_nvrtc("sm_90")
    for R in (8192, 4099):
        k = tc.build(nll_mean(R, 50304), target="cuda", arch="sm_90")
        assert k.plan.strategy == "row_fused", k.plan.reason
        for name, res in k.resources.items():
            assert res.spill_stores == 0 and res.spill_loads == 0, (name, res)
