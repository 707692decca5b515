"""Tensor-core contractions with operands declared `strides="any"`, on a real GPU (skipped without
one), with torch views in place: a slice of a wider tensor (the cp.async loop), a transposed
view (w.t(): the transposed-view cp.async loop, the tile stored in the other orientation), an
odd row stride (the element loop), a batch with its own stride, and the Linear layer's
x @ w.t() with B declared strided. Which loop a view takes is checked on the kernel's launch
conditions (its `built:` line) against the view's strides; the emulator tests
(test_strided_tensor_core.py) check it on the shared tile's accesses. Against torch in
float64 under tests/test_tensorize_gpu.py's bound: (K + 1)·2⁻²³·Σ|a·b| plus one rounding of a
16-bit output; outputs start as NaN, inputs are fresh random values. Plans: the planner's (on
sm_90 gemm_wgmma) and mma.sync forced by a manual tensorize step."""

from __future__ import annotations

from typing import Any

import pytest

import tecc as tc
from gpu_checks import check_on_gpu

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}
EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
TENSOR_CORE = ("gemm_tensor_core", "gemm_wgmma")


def _contraction(m: int, n: int, k: int, dtype: str, batch: int = 0, b_any: bool = False,
                 a_any: bool = True) -> list[tc.Tensor]:
    lead = (batch,) if batch else ()
    A = tc.placeholder(lead + (m, k), dtype, "A", strides="any" if a_any else None)
    B = tc.placeholder(lead + (k, n), dtype, "B", strides="any" if b_any else None)
    r = tc.reduce_axis(k, "r")

    def body(*ix: Any) -> Any:
        *bs, i, j = ix
        return tc.cast(tc.sum(tc.cast(A[(*bs, i, r)], "float32") * tc.cast(B[(*bs, r, j)], "float32"), axis=r), dtype)

    return [A, B, tc.compute(lead + (m, n), body, name="C")]


def _mma_plan() -> dict[str, Any]:
    return {"strategy": "manual", "reason": "mma.sync forced", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": "auto", "block": [128, 128], "warps": [2, 2],
                                            "k_tile": 32, "stages": 4}}]}


def _views(m: int, k: int, dtype: str, g: Any, lead: tuple[int, ...] = ()) -> dict[str, Any]:
    """Views of shape lead + (m, k): the strides a torch user passes."""
    t = TORCH[dtype]
    return {
        "slice": torch.randn(lead + (m, k + 64), device="cuda", generator=g).to(t)[..., :k],
        "offset slice": torch.randn(lead + (m, k + 64), device="cuda", generator=g).to(t)[..., 8:8 + k],
        "transposed": torch.randn(lead + (k, m), device="cuda", generator=g).to(t).transpose(-1, -2),
        "odd row stride": torch.randn(lead + (m, k + 3), device="cuda", generator=g).to(t)[..., :k],
    }


def _copy_loop(f: Any, name: str, strides: tuple[int, ...]) -> str:
    """Which of the kernel's main loops a view of operand `name` with `strides` takes, from the
    launch conditions of its built line: "copies" (unit innermost stride, the others multiples
    of 8 halves), "transposed copies" (unit stride on the next dimension, the others multiples
    of 8) or "element loads"."""
    line = next(x for x in f.explain().splitlines() if "built:" in x)
    last = len(strides) - 1

    def unit_at(d: int) -> bool:
        return strides[d] == 1 and all(s % 8 == 0 for i, s in enumerate(strides) if i != d)
    if f"{name}_stride{last} == 1" in line and unit_at(last):
        return "copies"
    if f"{name}_stride{last - 1} == 1" in line and unit_at(last - 1):
        return "transposed copies"
    return "element loads"


def _check(f: Any, a: Any, b: Any, dtype: str, what: str) -> None:
    k = a.shape[-1]
    a64, b64 = a.double(), b.double()
    exact = a64 @ b64
    bound = (k + 1) * 2.0**-23 * (a64.abs() @ b64.abs())
    bound = bound + EPS[dtype] * (exact.abs() + bound)
    c = torch.full(exact.shape, float("nan"), device="cuda", dtype=TORCH[dtype])
    f(a, b, c)
    torch.cuda.synchronize()
    check_on_gpu(c, exact, bound, f"{what} (A strides {a.stride()}): {f.plan.reason}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("plan", ["auto", "mma"])
def test_every_view_matches_torch(dtype: str, plan: str) -> None:
    """M, N, K no multiple of the tiles; one kernel per plan serves every view."""
    m, n, k = 1000, 520, 776
    f = tc.build(_contraction(m, n, k, dtype), plan=_mma_plan() if plan == "mma" else "auto")
    if plan == "auto":
        assert f.plan.strategy in TENSOR_CORE, f.plan.reason
    g = torch.Generator(device="cuda").manual_seed(13)
    expect = {"slice": "copies", "offset slice": "copies", "transposed": "transposed copies",
              "odd row stride": "element loads"}
    for what, a in _views(m, k, dtype, g).items():
        assert _copy_loop(f, "A", a.stride()) == expect[what], (what, a.stride(), f.explain())
        b = torch.randn((k, n), device="cuda", generator=g).to(TORCH[dtype])
        _check(f, a, b, dtype, f"{plan} {dtype} A {what}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("plan", ["auto", "mma"])
def test_a_linear_layer_weight_passed_transposed(dtype: str, plan: str) -> None:
    """x @ w.t() with B declared (K, N), strides="any", passed as w.t() for a contiguous (N, K)
    weight (torch's Linear): B's transposed-view copy loop (not the element loop); w's (K, N)
    slice takes the matched copy loop of the same kernel."""
    m, n, k = 1000, 520, 776
    f = tc.build(_contraction(m, n, k, dtype, a_any=False, b_any=True), plan=_mma_plan() if plan == "mma" else "auto")
    if plan == "auto":
        assert f.plan.strategy in TENSOR_CORE, f.plan.reason
    g = torch.Generator(device="cuda").manual_seed(19)
    t = TORCH[dtype]
    a = torch.randn((m, k), device="cuda", generator=g).to(t)
    for what, b, loop in (("w.t()", torch.randn((n, k), device="cuda", generator=g).to(t).t(), "transposed copies"),
                          ("(K, N) slice", torch.randn((k, n + 8), device="cuda", generator=g).to(t)[:, :n], "copies")):
        assert _copy_loop(f, "B", b.stride()) == loop, (what, b.stride(), f.explain())
        _check(f, a, b, dtype, f"{plan} {dtype} B {what} (B strides {b.stride()})")


def test_both_operands_strided_and_batched() -> None:
    batch, m, n, k = 3, 256, 192, 320
    f = tc.build(_contraction(m, n, k, "float16", batch=batch, b_any=True))
    assert f.plan.strategy in TENSOR_CORE, f.plan.reason
    g = torch.Generator(device="cuda").manual_seed(17)
    for what, a in _views(m, k, "float16", g, (batch,)).items():
        b = torch.randn((2 * batch, k, n + 8), device="cuda", generator=g).half()[::2, :, :n]
        _check(f, a, b, "float16", f"batched, B every other sliced, A {what}")
    b_t = torch.randn((batch, n, k), device="cuda", generator=g).half().transpose(-1, -2)
    a = torch.randn((batch, m, k + 8), device="cuda", generator=g).half()[..., :k]
    assert _copy_loop(f, "B", b_t.stride()) == "transposed copies", f.explain()
    _check(f, a, b_t, "float16", "batched, A sliced, B transposed")
    a_t = torch.randn((batch, k, m), device="cuda", generator=g).half().transpose(-1, -2)
    assert _copy_loop(f, "A", a_t.stride()) == "transposed copies", f.explain()
    _check(f, a_t, b_t, "float16", "batched, A and B transposed")
