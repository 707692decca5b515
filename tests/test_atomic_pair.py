"""atomic_add_pair (MEMORY_INTRINSICS): two float32 additions into an element and the next one
as one `red.global.add.v2.f32` (sm_90), what the Hopper attention backward adds dQ with."""

from __future__ import annotations

import numpy as np
import pytest

from tecc.codegen.cuda import emit_source
from tecc.codegen.nvrtc import compile_cuda
from tecc.ir import dtype as dt
from tecc.ir.errors import DTypeError, OutOfBoundsError, TeccError
from tecc.ir.expr import Call, Const, Var, atomic_add_pair
from tecc.ir.stmt import Buffer, Evaluate, For, PrimFunc
from tecc.runtime.sim import simulate_kernel


def pair_kernel(rows: int, cols: int, offset: int = 0) -> PrimFunc:
    """Block b, thread t: adds (x[b, t, 0], x[b, t, 1]) into acc[t // (cols / 2), 2·(t % (cols / 2)) + offset]
    and the next column, every block onto the same elements (acc has cols + 2·offset columns)."""
    acc = Buffer("acc", dt.float32, (rows, cols + 2 * offset))
    x = Buffer("x", dt.float32, (4, rows * cols // 2, 2))
    bx, tx = Var("bx", dt.int32), Var("tx", dt.int32)
    half = cols // 2
    add = Evaluate(atomic_add_pair(acc[tx // half, 2 * (tx % half) + offset], x[bx, tx, 0], x[bx, tx, 1]))
    body = For(bx, 0, 4, "blockIdx.x", For(tx, 0, rows * half, "threadIdx.x", add))
    return PrimFunc("pairs", (acc, x), body)


def test_pairs_add_both_elements_in_lane_order_as_float32_atomics():
    rows, cols = 3, 16
    rng = np.random.default_rng()
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal((4, rows * cols // 2, 2)).astype(np.float32)
    want = a.copy()
    for b in range(4):   # lane order: block 0's threads, then block 1's, ...; each add rounded to float32
        for t in range(rows * cols // 2):
            r, c = divmod(t, cols // 2)
            want[r, 2 * c] += x[b, t, 0]
            want[r, 2 * c + 1] += x[b, t, 1]
    simulate_kernel(pair_kernel(rows, cols), {"acc": a, "x": x}, (4, 1, 1), (rows * cols // 2, 1, 1))
    np.testing.assert_array_equal(a, want)


def test_a_pair_at_an_odd_element_is_refused():
    rows, cols = 2, 8
    x = np.ones((4, rows * cols // 2, 2), np.float32)
    with pytest.raises(OutOfBoundsError, match="odd element"):
        simulate_kernel(pair_kernel(rows, cols, offset=1), {"acc": np.zeros((rows, cols + 2), np.float32), "x": x},
                        (4, 1, 1), (rows * cols // 2, 1, 1))


def test_a_pair_past_the_innermost_dimension_is_out_of_bounds():
    acc = Buffer("acc", dt.float32, (1, 7))   # element (0, 6) is inside, its pair's (0, 7) is not
    tx = Var("tx", dt.int32)
    body = For(tx, 0, 1, "threadIdx.x", Evaluate(
        atomic_add_pair(acc[0, 6 + tx], Const(1.0, dt.float32), Const(2.0, dt.float32))))
    with pytest.raises(OutOfBoundsError, match="second element"):
        simulate_kernel(PrimFunc("past", (acc,), body), {"acc": np.zeros((1, 7), np.float32)}, (1, 1, 1), (1, 1, 1))


def test_only_float32_pairs_into_a_global_element():
    f32 = Buffer("f", dt.float32, (4,))
    one = Const(1.0, dt.float32)
    with pytest.raises(DTypeError, match="two float32 values"):
        atomic_add_pair(Buffer("d", dt.float64, (4,))[0], one, one)
    with pytest.raises(DTypeError, match="two float32 values"):
        atomic_add_pair(f32[0], one, Const(1, dt.int32))
    with pytest.raises(TeccError, match="global buffer element"):
        atomic_add_pair(Buffer("s", dt.float32, (4,), "shared")[0], one, one)
    assert atomic_add_pair(f32[0], one, one).dtype == dt.int32
    with pytest.raises(TeccError, match="3 argument"):
        Call("atomic_add_pair", (f32[0], one), dt.int32)


def test_codegen_prints_one_vector_reduction_and_ptxas_takes_it_for_sm_90():
    src = emit_source([pair_kernel(2, 8)])
    assert "red.global.add.v2.f32" in src and src.count("tecc_red_add_pair(") == 2, src   # the helper and its call
    assert "const float* __restrict__ acc" not in src, "the buffer added into is written"
    try:
        out = compile_cuda(src, arch="sm_90", name="pairs")
    except TeccError as exc:   # no NVRTC here
        pytest.skip(f"NVRTC unavailable: {exc}")
    assert "red.global.add.v2.f32" in out.ptx
