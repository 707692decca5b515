"""transpose_tile: permutations of axes whose output's fastest axis reads a slow input axis
(`Y[i, j] = X[j, i]`, `x.permute(...)`), staged through a padded shared-memory tile.

Every kernel runs in the emulator (bounds and shared-memory race checks on) on fresh random
inputs with every output byte poisoned (the expected bytes flipped), and is compared with NumPy's
transpose bit for bit (a permutation moves bytes; a fused cast is compared with the float64
reference within the output dtype's rounding). The emulator's bank-conflict counter checks that
the padded tile is conflict-free for 1-, 2- and 4-byte elements, and that it does count the
conflicts of an unpadded tile. The planner takes the strategy for a 4096² transpose and a 3-D
permutation, and the cost model predicts DRAM traffic of the tensor's bytes twice."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from nvrtc_checks import needs_nvrtc
from test_tensorize import np_dtype

import tecc as tc
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.cost.model import predict
from tecc.compiler.planner import plan_program
from tecc.compiler.schedule import Schedule
from tecc.compiler.strategies import get
from tecc.compiler.strategies.transpose_tile import best_pad, phase_wavefronts
from tecc.ir.target import target as make_target
from tecc.passes.lower import lower
from tecc.runtime.sim.banks import count_bank_conflicts

H100 = make_target("sm_90")


def permute(shape: tuple[Any, ...], perm: tuple[int, ...], dtype: str) -> list[tc.Tensor]:
    """Y = X.transpose(perm): Y[o_0, .., o_n] = X[..] with output axis o_k on input axis perm[k]."""
    X = tc.placeholder(shape, dtype, name="X")

    def body(*ix: Any) -> Any:
        idx: list[Any] = [None] * len(shape)
        for out_axis, in_axis in enumerate(perm):
            idx[in_axis] = ix[out_axis]
        return X[tuple(idx)]

    return [X, tc.compute(tuple(shape[p] for p in perm), body, name="Y")]


def random_values(g: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "bool":
        return g.random(shape) < 0.5
    if dtype in ("int32", "int64"):
        return g.integers(-(2**30), 2**30, shape).astype(dtype)
    return (g.standard_normal(shape) * 8).astype(np_dtype(dtype))


def poisoned_like(expected: np.ndarray) -> np.ndarray:
    """An output array whose every byte differs from the expected one."""
    out = np.empty_like(expected)
    out.view(np.uint8)[...] = ~np.ascontiguousarray(expected).view(np.uint8)
    return out


def tile_schedule(tensors: list[tc.Tensor], point: dict[str, int] | None = None,
                  sizes: dict[str, int] | None = None) -> tuple[Schedule, dict[str, Any]]:
    """transpose_tile applied at `point` (default: the planner's best point of the strategy)."""
    info = analyze_kernel(lower(tensors).kernels[0], sizes)
    strategy = get("transpose_tile")
    assert strategy.guard(info, H100) is None, strategy.guard(info, H100)
    if point is None:
        point = min(strategy.space(info, H100), key=lambda p: predict(strategy.workload(info, p, H100), H100).total)
    sch = Schedule(tensors)
    strategy.apply(sch, info, point)
    return sch, point


def run_transpose(f: Any, shape: tuple[int, ...], perm: tuple[int, ...], dtype: str, seed: int) -> Any:
    g = np.random.default_rng(seed)
    x = random_values(g, shape, dtype)
    want = np.ascontiguousarray(x.transpose(perm))
    y = poisoned_like(want)
    with count_bank_conflicts() as banks:
        f(x, y)
    worst = np.argwhere(y.view(np.uint8) != want.view(np.uint8))
    assert worst.size == 0, (f"{dtype} {shape} perm {perm} plan {f.plan.to_json()[:300]}: "
                             f"{len(worst)} bytes differ, first at byte index {tuple(worst[0])}")
    return banks


CASES = [
    ((100, 70), (1, 0), "float32"),
    ((70, 130), (1, 0), "float16"),          # 130 % 64: the vector store falls back to scalar
    ((128, 64), (1, 0), "bfloat16"),         # two outputs per 4-byte store
    ((33, 130), (1, 0), "float8_e4m3"),
    ((41, 37), (1, 0), "bool"),
    ((3, 50, 37), (0, 2, 1), "bfloat16"),    # a batch of transposes, tiles larger than the matrix
    ((5, 40, 70), (2, 0, 1), "float32"),
    ((5, 40, 70), (1, 2, 0), "int32"),
    ((2, 3, 40, 36), (0, 3, 1, 2), "float16"),  # NCHW -> NHWC
    ((2, 3, 40, 36), (3, 2, 1, 0), "bool"),     # every axis reversed
]


@pytest.mark.parametrize("shape,perm,dtype", CASES)
def test_a_permutation_matches_numpy_without_bank_conflicts(shape: tuple[int, ...], perm: tuple[int, ...],
                                                            dtype: str) -> None:
    sch, point = tile_schedule(permute(shape, perm, dtype))
    banks = run_transpose(tc.build(sch, target="sim"), shape, perm, dtype, seed=sum(shape))
    assert banks.requests["X_shared"] > 0, dict(banks.requests)
    assert banks.conflicts("X_shared") == 0, (point, dict(banks.requests), dict(banks.wavefronts))


@pytest.mark.parametrize("tu,tv,ty", [(32, 32, 8), (64, 32, 4), (32, 64, 2), (128, 32, 16)])
def test_other_tilings_of_an_odd_shape_match_numpy(tu: int, tv: int, ty: int) -> None:
    shape = (150, 97)
    tensors = permute(shape, (1, 0), "float32")
    point = {"tu": tu, "tv": tv, "ty": ty, "vector": 1, "pad": best_pad(min(tu, shape[1]), tv, 1, 4)}  # X rows: u
    sch, _ = tile_schedule(tensors, point)
    banks = run_transpose(tc.build(sch, target="sim"), shape, (1, 0), "float32", seed=tu + tv + ty)
    assert banks.conflicts("X_shared") == 0, (point, dict(banks.wavefronts))


def test_the_bank_conflict_counter_sees_an_unpadded_tile() -> None:
    """The same tile without its pad: each warp's column read hits one bank 32 times."""
    shape = (64, 64)
    sch, _ = tile_schedule(permute(shape, (1, 0), "float32"), {"tu": 32, "tv": 32, "ty": 8, "vector": 1, "pad": 0})
    banks = run_transpose(tc.build(sch, target="sim"), shape, (1, 0), "float32", seed=1)
    reads_per_tile = 32 * 32 // 32          # warp-wide column reads per 32 x 32 tile
    assert banks.conflicts("X_shared") == 4 * reads_per_tile * 31, dict(banks.wavefronts)
    assert phase_wavefronts(32, 32, 1, 0, 4)[1] == 32 and phase_wavefronts(32, 32, 1, 1, 4)[1] == 1


def test_a_symbolic_extent_matches_numpy_at_several_sizes() -> None:
    M = tc.var("M")
    tensors = permute((M, 70), (1, 0), "float32")
    sch, _ = tile_schedule(tensors, sizes={"M": 512})
    f = tc.build(sch, target="sim")
    for m in (1, 33, 100):
        run_transpose(f, (m, 70), (1, 0), "float32", seed=m)


def test_a_fused_cast_and_a_second_operand_are_computed_at_the_store() -> None:
    """Y[i, j] = float16(2 · X[j, i] + Z[i, j]): X through the tile, Z read at the output's index."""
    n0, n1 = 70, 96
    X = tc.placeholder((n0, n1), "float32", name="X")
    Z = tc.placeholder((n1, n0), "float32", name="Z")
    Y = tc.compute((n1, n0), lambda i, j: tc.cast(X[j, i] * 2.0 + Z[i, j], "float16"), name="Y")
    sch, point = tile_schedule([X, Z, Y])
    g = np.random.default_rng(4)
    x, z = g.standard_normal((n0, n1)).astype(np.float32), g.standard_normal((n1, n0)).astype(np.float32)
    y = np.full((n1, n0), np.nan, np.float16)
    tc.build(sch, target="sim")(x, z, y)
    want = 2.0 * x.T.astype(np.float64) + z
    err = np.abs(y.astype(np.float64) - want) - 2.0**-11 * np.abs(want) * 1.01
    assert not np.isnan(y).any() and (err <= 1e-30).all(), (point, np.unravel_index(np.argmax(err), err.shape))


# ---- the planner and the cost model -----------------------------------------------------------------

@pytest.mark.parametrize("shape,perm,dtype", [((4096, 4096), (1, 0), "float32"), ((4096, 4096), (1, 0), "float16"),
                                              ((32, 512, 1024), (0, 2, 1), "float32"),
                                              ((8, 64, 56, 56), (0, 2, 3, 1), "bfloat16")])
def test_the_planner_takes_the_tile_and_predicts_the_tensor_bytes_twice(shape: tuple[int, ...], perm: tuple[int, ...],
                                                                       dtype: str) -> None:
    res = plan_program(permute(shape, perm, dtype), "sm_90")
    kp = res.kernels[0]
    assert kp.chosen.strategy.name == "transpose_tile", kp.chosen.strategy.name
    tensor_bytes = float(np.prod(shape)) * np.dtype(np_dtype(dtype)).itemsize
    assert kp.chosen.workload.dram_bytes == pytest.approx(2 * tensor_bytes, rel=0.01)
    assert kp.chosen.cost.bound == "dram", kp.chosen.cost.bound
    elementwise = min((c for c in kp.ranked if c.strategy.name == "elementwise"), key=lambda c: c.cost.total)
    assert elementwise.cost.total > kp.chosen.cost.total
    if tensor_bytes > H100.l2_bytes:
        # elementwise's warp loads touch a line per lane; the lines are evicted before their
        # other elements are read (the 420 MB of DRAM traffic for 134 MB moved)
        assert elementwise.workload.dram_bytes > 2.5 * kp.chosen.workload.dram_bytes
        assert elementwise.cost.total > 2.5 * kp.chosen.cost.total


def test_the_guard_declines_what_is_already_coalesced() -> None:
    """A copy, a permutation that keeps the fastest axis, a broadcast and a reduction are not
    transposes: each read is along the output's fastest axis (or there is no tile to stage)."""
    strategy = get("transpose_tile")

    def reason(tensors: list[tc.Tensor]) -> str | None:
        return strategy.guard(analyze_kernel(lower(tensors).kernels[0]), H100)

    assert reason(permute((64, 64), (0, 1), "float32")) is not None
    assert reason(permute((4, 64, 64), (1, 0, 2), "float32")) is not None
    X = tc.placeholder((64,), "float32", name="X")
    assert reason([X, tc.compute((64, 64), lambda i, j: X[i], name="Y")]) is not None
    X2 = tc.placeholder((64, 64), "float32", name="X")
    k = tc.reduce_axis(64, name="k")
    assert "reduction" in str(reason([X2, tc.compute((64,), lambda i: tc.sum(X2[k, i], axis=k), name="Y")]))
    twice = [X2, tc.compute((64, 64), lambda i, j: X2[j, i] + X2[i, j], name="Y")]
    assert "more than one index" in str(reason(twice))


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "float16", "float8_e4m3"])
def test_the_planned_4096_transpose_compiles_without_spills(dtype: str) -> None:
    f = tc.build(permute((4096, 4096), (1, 0), dtype), target="cuda", arch="sm_90")
    assert f.plan.strategy == "transpose_tile", f.plan.strategy
    (resources,) = f.resources.values()
    assert resources.spill_stores == 0 and resources.shared_bytes > 0, resources
    assert "__syncthreads();" in f.source


@pytest.mark.gpu
@pytest.mark.parametrize("shape,perm,dtype", [((4096, 4096), (1, 0), "float32"), ((4099, 1023), (1, 0), "float16"),
                                              ((16, 1000, 1001), (0, 2, 1), "bfloat16"),
                                              ((8, 64, 56, 56), (0, 2, 3, 1), "float32")])
def test_a_transpose_on_the_gpu_matches_numpy(shape: tuple[int, ...], perm: tuple[int, ...], dtype: str) -> None:
    f = tc.build(permute(shape, perm, dtype), target="cuda")
    assert f.plan.strategy == "transpose_tile", f.plan.strategy
    run_transpose(f, shape, perm, dtype, seed=7)
