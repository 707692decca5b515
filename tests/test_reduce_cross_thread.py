"""Cross-thread reductions (tecc.passes.schedule.cross_thread): warp shuffles then a shared-memory
block stage; row sum / max at any block size, in the emulator (with its race checks)."""

import sys
from pathlib import Path

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.ir import dtype as dt
from tecc.ir.errors import ScheduleError
from tecc.ir.stmt import Buffer
from tecc.passes.schedule.cross_thread import allreduce

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import norms  # noqa: E402


@pytest.mark.parametrize("combiner", ["sum", "max"])
@pytest.mark.parametrize("threads", [32, 64, 96, 512])
@pytest.mark.parametrize("shape", [(5, 1), (3, 100), (2, 1025), (0, 8)])
def test_row_reduction_any_block_size(combiner, threads, shape):
    R, C = shape
    args = norms.row_reduce(R, C, "float32", combiner)
    x = np.random.default_rng(C).standard_normal(shape).astype(np.float32)
    y = np.zeros(R, np.float32)
    k = tc.build(args, target="sim", plan=Plan((Step("fuse_rows", {"threads": threads, "cache": "none"}),)))
    k(x, y)
    want = x.astype(np.float64).sum(-1) if combiner == "sum" else x.max(-1)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=f"{combiner} {shape} threads={threads}")


def test_reduction_over_an_empty_row_gives_the_identity():
    args = norms.row_reduce(3, 0, "float32", "max")
    y = np.zeros(3, np.float32)
    tc.build(args, target="sim", plan=Plan((Step("fuse_rows", {"threads": 32, "cache": "none"}),)))(
        np.zeros((3, 0), np.float32), y)
    assert np.all(y == -np.inf)


def test_allreduce_refuses_what_it_cannot_do():
    acc = Buffer("acc", dt.float32, (1,), "local")
    lane = tc.var("tx")
    with pytest.raises(ScheduleError, match="multiple of 32"):
        allreduce(acc, "+", lane, 48, "red")
    with pytest.raises(ScheduleError, match="combiner"):
        allreduce(acc, "-", lane, 64, "red")
    assert "shfl_xor" in str(allreduce(acc, "max", lane, 32, "red"))


@pytest.mark.parametrize("combiner", ["sum", "max"])
@pytest.mark.parametrize("threads", [64, 96, 512, 1024])
def test_the_shuffle_block_stage_of_row_walking_kernels_matches_numpy(combiner, threads):
    """fuse_rows' row_blocks kernels combine the warps' values with a second butterfly (each
    lane reads red[lane % W]); 3 warps (96 threads) are no power of two and keep the serial
    combine. Every thread must hold the same total: the row sum is stored by thread 0 and the
    rows are walked by 3 blocks, so a wrong lane shows up in some row."""
    R, C = 7, 1000
    args = norms.row_reduce(R, C, "float32", combiner)
    step = {"threads": threads, "cache": "registers", "row_blocks": 3}
    k = tc.build(args, target="sim", plan=Plan((Step("fuse_rows", step),)))
    x = np.random.default_rng(threads).standard_normal((R, C)).astype(np.float32)
    y = np.full(R, np.nan, np.float32)
    k(x, y)
    want = x.astype(np.float64).sum(-1) if combiner == "sum" else x.max(-1)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=f"{combiner} threads={threads}")
    body = str(k.module.kernels[0].body)
    assert ("_block_w" in body) == (threads == 96), body[:2000]


def test_allreduce_shuffle_stage_reads_one_word_per_lane():
    acc = Buffer("acc", dt.float32, (1,), "local")
    lane = tc.var("tx")
    serial, shuffled = (str(allreduce(acc, "+", lane, 512, "red", shuffle_stage=s)) for s in (False, True))
    assert "red_w" in serial and "red_w" not in shuffled
    assert shuffled.count("shfl_xor") == 5 + 4  # the warp's butterfly, then 16 warps' values
