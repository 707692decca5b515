"""The fused tail of a tensor-core GEMM computes what depends on the column alone once per column
a lane holds (tecc/passes/schedule/epilogue.py, `column_invariants`): an inference batch norm
after a convolution, `relu((acc - mean[j]) · (1 / sqrt(var[j] + eps)) · γ[j] + β[j] + R[i, j])`,
takes its 1 / sqrt(var[j] + eps) into registers for each column group of the lane, not for
each accumulator element (ptxas merged none of them: a 128 x 128 mma.sync tile computed 64
square roots and 64 IEEE divisions per thread for 8 columns); where 8 lanes of a warp hold the
same columns (wgmma), each computes an eighth of them and shuffles them to the others.

Every kernel runs in the emulator against NumPy in float64 on fresh random inputs with the output
poisoned (NaN), through mma.sync, wgmma's register epilogue and wgmma's TMA-stored epilogue, at
shapes the tiles divide and shapes they do not (the columns past N then are not read)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_tensorize import np_dtype

import tecc as tc

EPS = 1e-5


def batch_norm_gemm(m: int, n: int, k: int, dtype: str, residual: bool = True) -> list[tc.Tensor]:
    """C[i, j] = relu((Σ_k A[i, k]·W[k, j] - mean[j]) · (1 / sqrt(var[j] + eps)) · γ[j] + β[j] (+ R[i, j]))."""
    A = tc.placeholder((m, k), dtype, name="A")
    W = tc.placeholder((k, n), dtype, name="W")
    mean, var = tc.placeholder((n,), "float32", name="mean"), tc.placeholder((n,), "float32", name="var")
    gamma, beta = tc.placeholder((n,), "float32", name="gamma"), tc.placeholder((n,), "float32", name="beta")
    R = tc.placeholder((m, n), dtype, name="R")
    r = tc.reduce_axis(k, name="k")

    def body(i: Any, j: Any) -> Any:
        acc = tc.sum(tc.cast(A[i, r], "float32") * tc.cast(W[r, j], "float32"), axis=r)
        y = (acc - mean[j]) * (1.0 / tc.sqrt(var[j] + EPS)) * gamma[j] + beta[j]
        if residual:
            y = y + tc.cast(R[i, j], "float32")
        return tc.cast(tc.maximum(y, 0.0), dtype)
    return [A, W, mean, var, gamma, beta, R, tc.compute((m, n), body, name="C")]


def tensorize(intrinsic: str, block: tuple[int, int], warps: tuple[int, int], k_tile: int, stages: int,
              **extra: Any) -> dict[str, Any]:
    args = {"stage": "C", "intrinsic": intrinsic, "block": list(block), "warps": list(warps), "k_tile": k_tile,
            "stages": stages} | extra
    return {"strategy": "manual", "reason": "test", "steps": [{"primitive": "tensorize", "args": args}]}


def run_and_check(f: Any, m: int, n: int, k: int, dtype: str, residual: bool, seed: int) -> None:
    g = np.random.default_rng(seed)
    a = g.standard_normal((m, k)).astype(np_dtype(dtype))
    w = g.standard_normal((k, n)).astype(np_dtype(dtype))
    mean = g.standard_normal(n).astype(np.float32)
    var = g.uniform(0.25, 4.0, n).astype(np.float32)
    gamma, beta = g.uniform(0.5, 2.0, n).astype(np.float32), g.standard_normal(n).astype(np.float32)
    res = g.standard_normal((m, n)).astype(np_dtype(dtype))
    c = np.full((m, n), np.nan, np_dtype(dtype))
    f(a, w, mean, var, gamma, beta, res, c)
    a64, w64 = a.astype(np.float64), w.astype(np.float64)
    scale = gamma / np.sqrt(var.astype(np.float64) + EPS)
    before = (a64 @ w64 - mean) * scale + beta + (res.astype(np.float64) if residual else 0.0)
    want = np.maximum(before, 0.0)
    # float32 sums within (K + 1)·2⁻²⁴·Σ|a·b| scaled, a few float32 roundings of the tail, one
    # rounding to the output type
    size = (np.abs(a64) @ np.abs(w64) + np.abs(mean)) * scale + np.abs(beta) + np.abs(res.astype(np.float64))
    unit = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype]
    bound = (k + 8) * 2.0**-24 * size + unit * np.abs(want)
    got = c.astype(np.float64)
    err = np.where(np.isnan(got), np.inf, np.abs(got - want) - bound)
    if (err > 0).any():
        worst = np.unravel_index(int(np.argmax(err)), err.shape)
        raise AssertionError(f"{dtype} {m}x{n}x{k}: {(err > 0).sum()} of {err.size} off; worst at "
                             f"{tuple(map(int, worst))}: got {got[worst]!r}, want {want[worst]!r} "
                             f"(bound {bound[worst]:.3g})")


def square_roots_outside_the_stores(f: Any) -> bool:
    """Whether every sqrt of the kernel IR is in a column register's fill (C_col, or C_own where
    the lanes that share a column take it by a shuffle), none in a store of C."""
    lines = [line.strip() for line in str(f.module).splitlines() if "sqrt(" in line]
    return bool(lines) and all(line.startswith(("C_col", "C_own")) for line in lines)


PLANS = {
    "mma.sync": ("sm_80", tensorize("auto", (64, 64), (2, 2), 32, 2)),
    "mma.sync staged output": ("sm_80", tensorize("auto", (64, 64), (2, 2), 32, 2, staged_output=True)),
    "wgmma": ("sm_90", tensorize("wgmma", (64, 128), (4, 1), 64, 3)),
    "wgmma TMA store": ("sm_90", tensorize("wgmma", (128, 128), (8, 1), 64, 3, producer="tma", epilogue="tma",
                                           persistent=3)),
}


@pytest.mark.parametrize("kernel", sorted(PLANS))
@pytest.mark.parametrize("shape", [(128, 128, 64), (72, 136, 56)])
def test_a_batch_norm_tail_takes_its_column_values_once_per_column(kernel: str, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    arch, plan = PLANS[kernel]
    dtype = "bfloat16" if kernel.startswith("wgmma") else "float16"
    f = tc.build(batch_norm_gemm(m, n, k, dtype), target="sim", arch=arch, plan=plan)
    assert square_roots_outside_the_stores(f), str(f.module)
    # wgmma's D fragment gives each column to the 8 lanes of one lane % 4: each computes an
    # eighth of the groups, and the values reach the others by warp shuffles
    assert ("shfl_idx(C_own0" in str(f.module)) == kernel.startswith("wgmma")
    run_and_check(f, m, n, k, dtype, residual=True, seed=m + n + len(kernel))


@pytest.mark.parametrize("arch,steps", [
    ("sm_80", {"block": (64, 64), "warps": (2, 2), "k_tile": 32, "stages": 2, "splits": 3}),
    ("sm_90", {"intrinsic": "wgmma", "block": (64, 128), "warps": (4, 1), "k_tile": 64, "stages": 2, "splits": 2}),
    ("sm_90", {"intrinsic": "wgmma", "block": (128, 128), "warps": (8, 1), "k_tile": 64, "stages": 3,
               "producer": "tma", "persistent": 2}),
])
def test_the_column_values_with_split_k_and_a_persistent_grid(arch: str, steps: dict[str, Any]) -> None:
    """split-K (the last part sums the partials, then the tail) and a persistent grid (a block's
    tiles in turn, each its own columns): the column values are those of the tile stored."""
    from tensor_core_steps import schedule_tensor_core

    from tecc.compiler.schedule import Schedule

    m, n, k = 136, 264, 200
    dtype = "bfloat16" if arch == "sm_90" else "float16"
    sch = schedule_tensor_core(Schedule(batch_norm_gemm(m, n, k, dtype)), **steps)
    f = tc.build(sch, target="sim", arch=arch)
    assert square_roots_outside_the_stores(f), str(f.module)
    run_and_check(f, m, n, k, dtype, residual=True, seed=23)


def test_without_a_residual_the_tail_is_the_same_batch_norm() -> None:
    m, n, k = 96, 72, 40
    f = tc.build(batch_norm_gemm(m, n, k, "float16", residual=False), target="sim", arch="sm_80",
                 plan=tensorize("auto", (64, 64), (2, 2), 32, 2))
    assert square_roots_outside_the_stores(f)
    run_and_check(f, m, n, k, "float16", residual=False, seed=5)


def _gemm_with_tail(tail: Any) -> list[tc.Tensor]:
    A = tc.placeholder((64, 32), "float16", name="A")
    W = tc.placeholder((32, 64), "float16", name="W")
    v = tc.placeholder((64,), "float32", name="v")
    r = tc.reduce_axis(32, name="k")
    C = tc.compute((64, 64), lambda i, j: tail(tc.sum(tc.cast(A[i, r], "float32") * tc.cast(W[r, j], "float32"),
                                                        axis=r), v, i, j), name="C")
    return [A, W, v, C]


@pytest.mark.parametrize("name,tail,hoisted", [
    ("a column bias: a load, nothing to compute", lambda acc, v, i, j: acc + v[j], False),
    ("a row's square root", lambda acc, v, i, j: acc * tc.sqrt(v[i] + 1.0), False),
    ("the accumulator's own exp", lambda acc, v, i, j: tc.exp(acc * 0.01) + v[j], False),
    ("a column's exp", lambda acc, v, i, j: acc * tc.exp(v[j]), True),
    # where() evaluates only the side it picks: a load it guards may be out of bounds elsewhere
    ("a column's exp on a side of where()", lambda acc, v, i, j: tc.where(j < 40, acc * tc.exp(v[j]), acc), False),
])
def test_only_costly_parts_of_the_column_alone_are_taken_out(name: str, tail: Any, hoisted: bool) -> None:
    f = tc.build(_gemm_with_tail(tail), target="sim", arch="sm_80", plan=tensorize("auto", (64, 64), (2, 2), 32, 2))
    assert ("C_col0" in str(f.module)) == hoisted, name
    g = np.random.default_rng(1)
    a, w = g.standard_normal((64, 32)).astype(np.float16), g.standard_normal((32, 64)).astype(np.float16)
    v = g.uniform(0.0, 1.0, 64).astype(np.float32)
    c = np.full((64, 64), np.nan, np.float32)
    f(a, w, v, c)
    acc = a.astype(np.float64) @ w.astype(np.float64)
    want = {"a column bias: a load, nothing to compute": acc + v,
            "a row's square root": acc * np.sqrt(v[:, None] + 1.0),
            "the accumulator's own exp": np.exp(acc * 0.01) + v,
            "a column's exp": acc * np.exp(v.astype(np.float64)),
            "a column's exp on a side of where()": np.where(np.arange(64) < 40, acc * np.exp(v.astype(np.float64)),
                                                            acc)}[name]
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", sorted(PLANS))
def test_a_batch_norm_tail_on_the_gpu_matches_numpy(kernel: str) -> None:
    m, n, k = 200, 264, 96
    _, plan = PLANS[kernel]
    dtype = "bfloat16" if kernel.startswith("wgmma") else "float16"
    f = tc.build(batch_norm_gemm(m, n, k, dtype), target="cuda", plan=plan)
    run_and_check(f, m, n, k, dtype, residual=True, seed=17)


@pytest.mark.gpu
def test_the_planners_batch_norm_convolution_tail_on_the_gpu_matches_numpy() -> None:
    """resnet50's 1 x 1 convolution 64 -> 256 at 56 x 56 as its GEMM (M = 8 x 56 x 56), planned."""
    m, n, k = 8 * 56 * 56, 256, 64
    f = tc.build(batch_norm_gemm(m, n, k, "bfloat16"), target="cuda")
    assert f.plan.strategy.startswith("gemm_"), f.plan.strategy
    run_and_check(f, m, n, k, "bfloat16", residual=True, seed=19)
