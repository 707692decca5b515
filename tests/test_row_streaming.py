"""A row group that reads its row only once streams it (row_fused.streams_once): a loss over a
large vocabulary, as the min-cut partitioner splits it, saves the row's max (keepdim) and the
log of its sum of exp in the forward, and its backward sums a one-hot built from indices before
the one pass that reads the logits to write dX. Caching such a row in registers buys no read and
leaves one block per SM; the chunked walk reads it once (cache="online": the max and the sum of
exp in one pass, even where the sum subtracts the keepdim copy of the max) or once in the pass
that needs it (cache="none").

* In the emulator (rows short enough to emulate, the streaming plan given explicitly): the
  forward's statistics and the backward's dX against float64 NumPy, outputs poisoned (NaN)
  before the kernel writes them; the row read through a reshape's index arithmetic
  (`X[r // T * T + r % T, c]`, what a [B, T, V] view of a [B·T, V] GEMM output gives) is
  staged like `X[r, c]`.
* The planner's point at GPT-2's vocabulary (8192 x 50304 bf16): the forward and backward
  stream with 16-byte vectors; a log-softmax that writes its output (two reads streamed) keeps
  its row in registers.
"""

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.compiler.strategies.row_fused import STREAM_THREADS, propose
from tecc.passes.rewrite.fuse_rows import fuse_rows

T_SPLIT = 4   # the reshape's inner extent: rows = B x T_SPLIT


def _rows_of_a_reshape(rows: int, vocab: int):
    """Logits [rows, vocab] bf16 read through [B, T, V] and back: X[r // T * T + r % T, c]."""
    x = tc.placeholder((rows, vocab), "bfloat16", name="X")
    x3 = tc.compute((rows // T_SPLIT, T_SPLIT, vocab), lambda b, t, c: x[b * T_SPLIT + t, c], name="X3")
    x2 = tc.compute((rows, vocab), lambda r, c: x3[r // T_SPLIT, r % T_SPLIT, c], name="X2")
    return x, x2


def loss_forward(rows: int, vocab: int):
    """The forward's statistics: m = max, m'[r, 0] = m[r] (saved), lse = log Σ exp(x - m'[r, 0])."""
    x, x2 = _rows_of_a_reshape(rows, vocab)
    j1, j2 = tc.reduce_axis(vocab, name="j1"), tc.reduce_axis(vocab, name="j2")
    m = tc.compute((rows,), lambda r: tc.max(tc.cast(x2[r, j1], "float32"), axis=j1), name="m")
    mk = tc.compute((rows, 1), lambda r, o: m[r], name="m_keepdim")
    s = tc.compute((rows,), lambda r: tc.sum(tc.exp(tc.cast(x2[r, j2], "float32") - mk[r, 0]), axis=j2), name="s")
    lse = tc.compute((rows, 1), lambda r, o: tc.log(s[r]), name="lse")
    return [x, mk, lse]


def loss_backward(rows: int, vocab: int):
    """dX = bf16(onehot·w - exp(x - m - lse)·Σ_c onehot·w), onehot[r, c] = -(t[r] == c)."""
    x, x2 = _rows_of_a_reshape(rows, vocab)
    t = tc.placeholder((rows, 1), "int32", name="t")
    w = tc.placeholder((rows, 1), "float32", name="w")
    m = tc.placeholder((rows, 1), "float32", name="m")
    lse = tc.placeholder((rows, 1), "float32", name="lse")
    j = tc.reduce_axis(vocab, name="j")

    def onehot(r, c):
        return tc.where(t[r, 0] == c, -1.0, 0.0) * w[r, 0]

    g = tc.compute((rows,), lambda r: tc.sum(onehot(r, j), axis=j), name="g")
    dx = tc.compute((rows, vocab), lambda r, c: tc.cast(
        onehot(r, c) - tc.exp(tc.cast(x2[r, c], "float32") - m[r, 0] - lse[r, 0]) * g[r], "bfloat16"), name="dX")
    return [x, t, w, m, lse, dx]


def _plan(**step):
    return Plan((Step("fuse_rows", step),))


def _attrs(args, **step):
    (kernel,) = fuse_rows(args, **step).kernels
    return dict(kernel.attrs)


def _rel(got, want):
    got = np.asarray(got, np.float64)
    return float(np.max(np.abs(got - want) / (np.abs(want) + 1e-30)))


def test_the_forward_streams_its_statistics_in_one_online_pass_in_the_emulator():
    rows, vocab = 8, 8 * 64 * 4 * 2 + 8 * 64 * 3   # two full chunks of 64 threads x 4 x 8, then a tail
    args = loss_forward(rows, vocab)
    step = {"threads": 64, "cache": "online", "vector": 8, "unroll": 4}
    attrs = _attrs(args, **step)
    assert attrs["online_pairs"] == 1 and attrs["row_reads"] == 1, attrs
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((rows, vocab)) * 3).astype(ml_dtypes.bfloat16)
    k = tc.build(args, target="sim", plan=_plan(**step))
    m_out, lse_out = np.full((rows, 1), np.nan, np.float32), np.full((rows, 1), np.nan, np.float32)
    k(x, m_out, lse_out)
    xd = x.astype(np.float64)
    m = xd.max(axis=1)
    lse = np.log(np.exp(xd - m[:, None]).sum(axis=1))
    assert np.array_equal(m_out[:, 0], m.astype(np.float32)), (m_out[:, 0], m)
    assert _rel(lse_out[:, 0], lse) <= 1e-5, (lse_out[:, 0], lse)


def test_the_backward_reads_its_row_once_and_writes_dx_in_the_emulator():
    rows, vocab = 8, 8 * 64 * 4 + 8 * 64 + 40   # a full chunk, a full tail vector, a guarded one
    args = loss_backward(rows, vocab)
    step = {"threads": 64, "cache": "none", "vector": 8, "unroll": 4}
    assert _attrs(args, **step)["row_reads"] == 1
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((rows, vocab)) * 3).astype(ml_dtypes.bfloat16)
    xd = x.astype(np.float64)
    m = xd.max(axis=1, keepdims=True)
    lse = np.log(np.exp(xd - m).sum(axis=1, keepdims=True))
    t = rng.integers(0, vocab, (rows, 1)).astype(np.int32)
    w = rng.uniform(0.5, 1.5, (rows, 1)).astype(np.float32)
    w[3] = 0.0   # an ignored target: its row's gradient is 0
    k = tc.build(args, target="sim", plan=_plan(**step))
    dx = np.full((rows, vocab), np.nan, ml_dtypes.bfloat16)
    k(x, t, w, m.astype(np.float32), lse.astype(np.float32), dx)
    onehot = -(np.arange(vocab)[None, :] == t).astype(np.float64) * w
    want = onehot - np.exp(xd - m.astype(np.float32) - lse.astype(np.float32)) * onehot.sum(axis=1, keepdims=True)
    got = dx.astype(np.float64)
    assert not np.isnan(got).any()
    err = np.abs(got - want)
    assert np.all(err <= 2 ** -8 * np.abs(want) + 1e-30), (float(err.max()), np.unravel_index(err.argmax(), err.shape))


def test_the_loss_rows_of_gpt2s_vocabulary_stream_for_sm_90():
    rows, vocab = 8192, 50304
    fwd = propose(loss_forward(rows, vocab), "sm_90")
    assert fwd is not None
    assert (fwd.cache, fwd.threads, fwd.vector, fwd.passes) == ("online", STREAM_THREADS, 8, 1), fwd.plan
    bwd = propose(loss_backward(rows, vocab), "sm_90")
    assert bwd is not None
    assert (bwd.cache, bwd.threads, bwd.vector, bwd.passes) == ("none", STREAM_THREADS, 8, 1), bwd.plan
    assert "read once" in fwd.reason and "read once" in bwd.reason


def test_a_row_read_twice_by_a_streamed_walk_stays_in_registers():
    """A log-softmax writing its output over 50,304 columns: the statistics' pass and the
    output's pass would each read the row, so it stays cached."""
    rows, vocab = 8192, 50304
    x = tc.placeholder((rows, vocab), "bfloat16", name="X")
    j1, j2 = tc.reduce_axis(vocab, name="j1"), tc.reduce_axis(vocab, name="j2")
    m = tc.compute((rows,), lambda r: tc.max(tc.cast(x[r, j1], "float32"), axis=j1), name="m")
    s = tc.compute((rows,), lambda r: tc.sum(tc.exp(tc.cast(x[r, j2], "float32") - m[r]), axis=j2), name="s")
    y = tc.compute((rows, vocab), lambda r, c: tc.cast(x[r, c], "float32") - m[r] - tc.log(s[r]), name="Y")
    choice = propose([x, y], "sm_90")
    assert choice is not None and choice.cache == "registers", choice and choice.plan


def test_a_short_row_stays_in_registers():
    choice = propose(loss_forward(64, 1024), "sm_90")
    assert choice is not None and choice.cache == "registers", choice and choice.plan


def test_the_streamed_kernels_compile_for_sm_90_without_spills_at_two_blocks_per_sm():
    """NVRTC + ptxas (no GPU): at GPT-2's vocabulary both kernels keep 16-byte loads, no local
    memory, and at most 64 registers (two blocks of 512 threads per SM)."""
    from nvrtc_checks import skip_without_nvrtc

    skip_without_nvrtc("sm_90")
    for args in (loss_forward(8192, 50304), loss_backward(8192, 50304)):
        f = tc.build(args, target="cuda", arch="sm_90")
        assert f.plan.steps[0].args["cache"] in ("online", "none"), f.plan
        assert "ld.global.nc.v4" in f.ptx, f.plan
        for name, res in f.resources.items():
            assert res.spill_stores == 0 and res.spill_loads == 0 and res.registers <= 64, (name, res)


@pytest.mark.gpu
def test_the_streamed_loss_rows_on_the_gpu_match_float64():
    """The planner's kernels at GPT-2's vocabulary (1024 rows) on the GPU against float64."""
    rows, vocab = 1024, 50304
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((rows, vocab)) * 3).astype(ml_dtypes.bfloat16)
    xd = x.astype(np.float64)
    fwd = tc.build(loss_forward(rows, vocab), target="cuda")
    assert fwd.plan.steps[0].args["cache"] == "online", fwd.plan
    m_out, lse_out = np.full((rows, 1), np.nan, np.float32), np.full((rows, 1), np.nan, np.float32)
    fwd(x, m_out, lse_out)
    m = xd.max(axis=1, keepdims=True)
    lse = np.log(np.exp(xd - m).sum(axis=1, keepdims=True))
    assert np.array_equal(m_out, m.astype(np.float32))
    assert _rel(lse_out, lse) <= 1e-5
    bwd = tc.build(loss_backward(rows, vocab), target="cuda")
    assert bwd.plan.steps[0].args["cache"] == "none", bwd.plan
    t = rng.integers(0, vocab, (rows, 1)).astype(np.int32)
    w = np.full((rows, 1), 1.0 / rows, np.float32)
    dx = np.full((rows, vocab), np.nan, ml_dtypes.bfloat16)
    bwd(x, t, w, m_out, lse_out, dx)
    onehot = -(np.arange(vocab)[None, :] == t).astype(np.float64) * w
    want = onehot - np.exp(xd - m_out - lse_out) * onehot.sum(axis=1, keepdims=True)
    err = np.abs(dx.astype(np.float64) - want)
    assert np.all(err <= 2 ** -8 * np.abs(want) + 1e-30), float(err.max())
