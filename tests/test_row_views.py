"""Rows read through a view (tecc/passes/rewrite/row_group.py `holds_rows`, fuse_rows.py
`row_reads`): transformers' loss head reads its logits [B, T, V] as B·T rows of V through a view,
`X[r // T, r % T, c]`. Such an input holds the rows: row_fused prices its bytes (before, it had
no row input: 8 bytes per row, a 50257-wide row's loads unvectorized and the kernel asking for 4
blocks per SM of 512 threads, 32 registers, so ptxas spilled the unrolled walk's 99 loads), and
fuse_rows caches it in registers where the passes read it at one index of the row.

Each in the emulator against float64 NumPy, outputs poisoned (NaN) before the run, at row lengths
a vector divides and one none does, at row_fused's own point and at fixed fuse_rows points; and
the NVRTC compile of the loss head's log-sum-exp at GPT-2's vocabulary for sm_90 without spills."""

from __future__ import annotations

import numpy as np
import pytest
from nvrtc_checks import skip_without_nvrtc

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.compiler.strategies.row_fused import propose
from tecc.passes.rewrite.row_group import row_group


def log_sum_exp_of_a_view(B: int, T: int, C: int, dtype: str = "float32"):
    """lse[r] = m[r] + log(Σ_c exp(X[r // T, r % T, c] - m[r])), m the row's max: the rows of X
    [B, T, C] read through its view as [B·T, C]."""
    X = tc.placeholder((B, T, C), dtype, name="X")
    rows = tc.compute((B * T, C), lambda r, c: tc.cast(X[r // T, r % T, c], "float32"), name="rows")
    c, c2 = tc.reduce_axis(C, name="c"), tc.reduce_axis(C, name="c2")
    m = tc.compute((B * T,), lambda r: tc.max(rows[r, c], axis=c), name="m")
    s = tc.compute((B * T,), lambda r: tc.sum(tc.exp(rows[r, c2] - m[r]), axis=c2), name="s")
    lse = tc.compute((B * T,), lambda r: m[r] + tc.log(s[r]), name="lse")
    return [X, lse]


def softmax_of_a_view(B: int, T: int, C: int):
    """Y[r, j] = exp(X[r // T, r % T, j] - m[r]) / Σ: an elementwise output beside the view."""
    X = tc.placeholder((B, T, C), "float32", name="X")
    rows = tc.compute((B * T, C), lambda r, c: X[r // T, r % T, c], name="rows")
    c, c2 = tc.reduce_axis(C, name="c"), tc.reduce_axis(C, name="c2")
    m = tc.compute((B * T,), lambda r: tc.max(rows[r, c], axis=c), name="m")
    s = tc.compute((B * T,), lambda r: tc.sum(tc.exp(rows[r, c2] - m[r]), axis=c2), name="s")
    Y = tc.compute((B * T, C), lambda r, j: tc.exp(rows[r, j] - m[r]) / s[r], name="Y")
    return [X, Y]


def _run(args, plan, inputs):
    k = tc.build(args, target="sim", plan=plan)
    outs = [np.full(tuple(int(s) for s in a.shape), np.nan, np.float32) for a in args if not a.is_placeholder]
    k(*inputs, *outs)
    return k, outs


def _plans(args):
    chosen = propose(args, "sm_90")
    assert chosen is not None
    yield chosen.plan
    for step in ({"threads": 64, "cache": "registers"}, {"threads": 32, "cache": "registers", "vector": 4},
                 {"threads": 128, "cache": "none"}, {"threads": 64, "cache": "online"}):
        yield Plan((Step("fuse_rows", step),))


@pytest.mark.parametrize("C", [1000, 1031])
def test_a_view_of_the_rows_is_a_row_input_cached_in_registers(C):
    B, T = 2, 3
    args = log_sum_exp_of_a_view(B, T, C)
    assert [t.name for t in row_group(args).row_inputs] == ["X"]
    chosen = propose(args, "sm_90")
    assert chosen is not None and chosen.arrays == 1
    x = (np.random.default_rng(C).standard_normal((B, T, C)) * 3).astype(np.float32)
    x64 = x.reshape(B * T, C).astype(np.float64)
    m = x64.max(1)
    want = m + np.log(np.exp(x64 - m[:, None]).sum(1))
    for plan in _plans(args):
        if plan.steps[0].args.get("vector", 1) > 1 and C % 4:
            continue   # (a vector of 4 needs rows that it divides)
        k, (lse,) = _run(args, plan, [x])
        assert len(k.module.kernels) == 1, plan
        if plan.steps[0].args["cache"] == "registers":
            assert "X_row" in str(k.module), "the view's row is not cached"
        np.testing.assert_allclose(lse, want, rtol=2e-6, err_msg=str(plan))


def test_a_view_of_the_rows_beside_an_elementwise_output():
    B, T, C = 3, 2, 520
    args = softmax_of_a_view(B, T, C)
    x = np.random.default_rng(4).standard_normal((B, T, C)).astype(np.float32)
    x64 = x.reshape(B * T, C).astype(np.float64)
    e = np.exp(x64 - x64.max(1, keepdims=True))
    for plan in _plans(args):
        _, (y,) = _run(args, plan, [x])
        np.testing.assert_allclose(y, e / e.sum(1, keepdims=True), rtol=2e-6, atol=1e-12, err_msg=str(plan))


def test_the_loss_heads_log_sum_exp_compiles_for_sm_90_without_spills():
    """GPT-2's vocabulary, rows of 50257 bfloat16 logits read through [8, 1024, 50257]: the row
    in registers, and no request for more resident blocks than its registers allow."""
    skip_without_nvrtc("sm_90")
    k = tc.build(log_sum_exp_of_a_view(8, 1024, 50257, "bfloat16"), target="cuda", arch="sm_90")
    assert k.plan.strategy == "row_fused", k.plan.reason
    for name, res in k.resources.items():
        assert res.spill_stores == 0 and res.spill_loads == 0, (name, res)


@pytest.mark.gpu
def test_the_loss_heads_log_sum_exp_on_the_gpu_matches_numpy():
    B, T, C = 2, 1024, 50257
    f = tc.build(log_sum_exp_of_a_view(B, T, C, "bfloat16"), target="cuda")
    import ml_dtypes

    x = (np.random.default_rng(1).standard_normal((B, T, C)) * 2).astype(ml_dtypes.bfloat16)
    lse = np.full(B * T, np.nan, np.float32)
    f(x, lse)
    x64 = x.astype(np.float64).reshape(B * T, C)
    m = x64.max(1)
    np.testing.assert_allclose(lse, m + np.log(np.exp(x64 - m[:, None]).sum(1)), rtol=1e-5)
