"""Contractions whose operands are views of tensors computed in the same program (a model's linear
layers: x.view(B*T, C) @ w.t(), its weight gradient x.view(B*T, C).t() @ dy, the attention output
through permute + view, the QKV gradient through a concatenation) are planned on tensor cores,
and what they build computes the product.

The views reach the contraction as index expressions: X[i // T, i % T, k] (a merge of two
dimensions of a computed tensor: here autocast's bfloat16 copy of a float32 input), X[(i // T)*T + i % T, k] (a view of such a view),
O[i // T, k // D, i % T, k % D] (a transposed merge), X[k // T, k % T, c] (a merged reduction
axis), where(k < C, A[..], B[..]) (a concatenation). In the emulator against NumPy float64
(exact products, float32 sums, one bfloat16 rounding of the output); outputs start as NaN.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from test_tensorize import np_dtype

import tecc as tc
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.planner import plan_program
from tecc.passes.lower import lower
from tecc.passes.simplify import from_linear, linear_form

TENSOR_CORES = ("gemm_tensor_core", "gemm_wgmma")
F32, BF16 = "float32", "bfloat16"


def _mm(m: int, n: int, k: int, a: Callable[..., Any], b: Callable[..., Any], name: str = "C") -> tc.Tensor:
    r = tc.reduce_axis(k, "r")
    return tc.compute((m, n), lambda i, j: tc.cast(tc.sum(tc.cast(a(i, r), F32) * tc.cast(b(r, j), F32), axis=r), BF16),
                      name=name)


def merged_rows(B: int, T: int, C: int, N: int) -> tuple[list[tc.Tensor], Callable[..., np.ndarray]]:
    """Y = (2·x).view(B*T, C) @ w.t(): the operand a computed tensor read as X[i // T, i % T, k]."""
    x, w = tc.placeholder((B, T, C), F32, "x"), tc.placeholder((N, C), BF16, "w")
    X = tc.compute((B, T, C), lambda b, t, c: tc.cast(x[b, t, c], BF16), name="X")
    Y = _mm(B * T, N, C, lambda i, r: X[i // T, i % T, r], lambda r, j: w[j, r])
    return [x, w, Y], lambda x, w: x.reshape(B * T, C) @ w.T


def view_of_view(B: int, T: int, C: int, N: int) -> tuple[list[tc.Tensor], Callable[..., np.ndarray]]:
    """The same through a view that split the rows and one that merged them again."""
    x, w = tc.placeholder((B * T, C), F32, "x"), tc.placeholder((N, C), BF16, "w")
    X = tc.compute((B * T, C), lambda i, c: tc.cast(x[i, c], BF16), name="X")
    Y = _mm(B * T, N, C, lambda i, r: X[i // T * T + i % T, r], lambda r, j: w[j, r])
    return [x, w, Y], lambda x, w: x @ w.T


def weight_gradient(B: int, T: int, C: int, N: int) -> tuple[list[tc.Tensor], Callable[..., np.ndarray]]:
    """dW = X.view(B*T, C).t() @ dy: the reduction axis read as X[k // T, k % T, c]."""
    x, dy = tc.placeholder((B, T, C), F32, "x"), tc.placeholder((B * T, N), BF16, "dy")
    X = tc.compute((B, T, C), lambda b, t, c: tc.cast(x[b, t, c], BF16), name="X")
    G = _mm(C, N, B * T, lambda c, r: X[r // T, r % T, c], lambda r, j: dy[r, j])
    return [x, dy, G], lambda x, dy: x.reshape(B * T, C).T @ dy


def transposed_merge(B: int, T: int, H: int, D: int, N: int) -> tuple[list[tc.Tensor], Callable[..., np.ndarray]]:
    """y = o.transpose(1, 2).reshape(B*T, H*D) @ w.t(): O[i // T, k // D, i % T, k % D]."""
    o, w = tc.placeholder((B, H, T, D), F32, "o"), tc.placeholder((N, H * D), BF16, "w")
    O = tc.compute((B, H, T, D), lambda b, h, t, d: tc.cast(o[b, h, t, d], BF16), name="O")
    Y = _mm(B * T, N, H * D, lambda i, r: O[i // T, r // D, i % T, r % D], lambda r, j: w[j, r])
    return [o, w, Y], lambda o, w: o.transpose(0, 2, 1, 3).reshape(B * T, H * D) @ w.T


def concatenated(M: int, C: int, N: int) -> tuple[list[tc.Tensor], Callable[..., np.ndarray]]:
    """dx = cat([a, b], 1) @ w: the operand a where() between two tensors."""
    a, b = tc.placeholder((M, C), BF16, "a"), tc.placeholder((M, C), BF16, "b")
    w = tc.placeholder((2 * C, N), BF16, "w")
    cat = tc.compute((M, 2 * C), lambda i, k: tc.where(k < C, a[i, k], b[i, k - C]), name="cat")
    Y = _mm(M, N, 2 * C, lambda i, r: cat[i, r], lambda r, j: w[r, j])
    return [a, b, w, Y], lambda a, b, w: np.concatenate([a, b], axis=1) @ w


CASES: dict[str, Callable[..., tuple[list[tc.Tensor], Callable[..., np.ndarray]]]] = {
    "merged rows": lambda big: merged_rows(8, 1024, 768, 3072) if big else merged_rows(2, 32, 48, 40),
    "view of a view": lambda big: view_of_view(8, 1024, 768, 3072) if big else view_of_view(2, 32, 48, 40),
    "weight gradient": lambda big: weight_gradient(8, 1024, 768, 3072) if big else weight_gradient(2, 32, 48, 40),
    "transposed merge": lambda big: transposed_merge(8, 1024, 12, 64, 768) if big else transposed_merge(2, 16, 2, 16, 40),
    "concatenation": lambda big: concatenated(8192, 768, 768) if big else concatenated(48, 32, 40),
}


def test_linear_form_folds_a_split_and_merge() -> None:
    i, k = tc.var("i"), tc.var("k")
    for e, want in ((i // 1024 * 1024 + i % 1024, "i"), ((i // 12 * 12 + i % 12) * 64 + k, "i * 64 + k"),
                    (i // 12 * 24 + i % 12 * 2, "i * 2")):
        terms, const = linear_form(e)
        assert str(from_linear(terms, const, e)) == want, e
    # not a split and merge: the coefficients disagree
    e = i // 12 * 12 + i % 12 * 2
    assert "//" in str(from_linear(*linear_form(e), e))


@pytest.mark.parametrize("case", sorted(set(CASES) - {"concatenation"}))
def test_the_view_contraction_is_analyzed_as_a_contraction(case: str) -> None:
    tensors, _ = CASES[case](False)
    module = lower(tensors)
    (kernel,) = [k for k in module.kernels if k.name.startswith("C")]
    assert analyze_kernel(kernel).kind == "contraction"


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt2_sized_view_contractions_plan_on_tensor_cores(case: str, arch: str) -> None:
    tensors, _ = CASES[case](True)
    result = plan_program(tensors, arch)
    chosen = {kp.kernel: kp.chosen.strategy.name for kp in result.kernels}
    assert chosen["C_kernel"] in TENSOR_CORES, chosen
    assert not [r for r in result.plan.reason.split(";") if "fell back" in r], result.plan.reason


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_tensor_core_plan_of_a_view_contraction_computes_it(case: str) -> None:
    tensors, reference = CASES[case](False)
    plan = plan_program(tensors, "sm_80", only=["gemm_tensor_core"]).plan
    assert plan.strategy != "naive" and "gemm_tensor_core" in plan.strategy, plan.reason
    f = tc.build(tensors, target="sim", arch="sm_80", plan=plan)
    g = np.random.default_rng(7)
    shapes = [[int(str(s)) for s in t.shape] for t in tensors]
    # bfloat16 values (the computed operands' casts to bfloat16 are exact), in each input's dtype
    inputs = [(g.uniform(0.5, 1.5, shape) * g.choice([-1, 1], shape)).astype(np_dtype(BF16)).astype(np_dtype(t.dtype.name))
              for t, shape in zip(tensors[:-1], shapes)]
    out = np.full(shapes[-1], np.nan, dtype=np_dtype(BF16))
    f(*inputs, out)
    wide = [x.astype(np.float64) for x in inputs]
    exact = reference(*wide)
    # float32 sums of exact products, one bfloat16 rounding
    size = reference(*[np.abs(x) for x in wide])
    k = max(int(str(d)) for t in tensors[:-1] for d in t.shape)
    bound = (k + 1) * 2.0**-24 * size + 2.0**-8 * (np.abs(exact) + (k + 1) * 2.0**-24 * size)
    got = out.astype(np.float64)
    err = np.where(np.isnan(got), np.inf, np.abs(got - exact) - bound)
    assert (err <= 0).all(), f"{case}: {(err > 0).sum()} of {err.size} elements off (worst {err.max():.3g})"


def test_every_gpt2_linear_layer_and_its_gradients_plan_on_tensor_cores_for_sm_90() -> None:
    """GPT-2 small (one block, batch 8 x 1024, bf16 autocast, SDPA) traced as the backend gets it
    and planned for sm_90 on the CPU (benchmarks/model_kernels.py): every kernel that computes an
    mm / addmm node (the QKV, projection, MLP and lm-head layers, their input and weight
    gradients) is a tensor-core GEMM."""
    import re
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import model_kernels

    graphs = model_kernels.gpt2(1)
    rows, fallbacks = model_kernels.plan_model(graphs, "sm_90", log=lambda _: None)
    linear = [r for r in rows if any(re.fullmatch(r"(add)?mm(_\d+)?", n) for n in r.nodes)]
    nodes = {n for r in linear for n in r.nodes if re.fullmatch(r"(add)?mm(_\d+)?", n)}
    # forward: qkv, proj, fc, out and the lm head (5 nodes); backward: the input and the weight
    # gradient of each of them (10)
    assert len(nodes) == 5 + 2 * 5, sorted(nodes)
    slow = [(r.kernels, r.label) for r in linear if r.strategy not in TENSOR_CORES]
    assert not slow, slow
    assert all("scatter" in f for f in fallbacks), fallbacks
    # the bias and layer-norm weight gradients (sums over batch and tokens) split over blocks
    import torch

    column_sums = {n.name for g in graphs.values() for n in g.graph.nodes
                   if n.target is torch.ops.aten.sum.dim_IntList and list(n.args[1]) == [0, 1]}
    assert len(column_sums) >= 6, column_sums
    planned = {n: r.strategy for r in rows for n in r.nodes if n in column_sums and r.nodes[-1] == n}
    assert planned and set(planned.values()) == {"column_reduction"}, planned


def test_the_conv_nets_convolutions_plan_on_tensor_cores_for_sm_90() -> None:
    """benchmarks/models.py's conv net (bf16 channels_last, batch 32, inference) planned for sm_90:
    the relu between two convolutions is stored once (tecc.passes.lower.computed_operands), so
    every convolution is an implicit GEMM on tensor cores, not a generic reduction reading the
    relu's input at each tap (18 ms predicted each)."""
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import model_kernels

    rows, fallbacks = model_kernels.plan_model(model_kernels.convnet(3), "sm_90", log=lambda _: None)
    # the two middle convolutions are the epilogue-fused kernels of the relus they feed
    # (tecc.passes.lower.epilogue_consumer); the stem's relu is read by the max pool, the last
    # one by the average pool, so those two convolutions keep kernels of their own; the stem's 3
    # input channels are read through copies padded to 4 (convolution.py `_padded_channels`)
    convs = [r for r in rows if any(k.startswith(("convolution", "relu")) for k in r.kernels)]
    padded = {"convolution_channels_kernel", "convolution_filters_kernel"}
    assert sorted(k for r in convs for k in r.kernels) == ["convolution_3_kernel", "convolution_channels_kernel",
                                                           "convolution_filters_kernel", "convolution_kernel",
                                                           "relu_1_kernel", "relu_2_kernel"], [r.kernels for r in rows]
    assert all(r.strategy in TENSOR_CORES for r in convs if not padded & set(r.kernels)), \
        [(r.kernels, r.label) for r in convs]
    assert not fallbacks
    assert sum(r.seconds for r in rows) < 2e-3, model_kernels.table(rows, 0)


def per_head_copy(B: int, T: int, H: int, D: int) -> tuple[list[tc.Tensor], Callable[..., np.ndarray]]:
    """dP = dO_h @ V_hᵀ for every head, as the backward of attention written by hand computes it:
    dO arrives as a GEMM's output [B·T, H·D], its per-head copy (`clone` of a permute, G) is read
    through a view merging batch and head, [B·H, T, D]. Inlined, the contraction would read
    g[(z // H)·T + i, (z % H)·D + r], which no tensor-core strategy takes
    (tecc.passes.lower.regathered_operands keeps the view a stage of its own)."""
    g, v = tc.placeholder((B * T, H * D), BF16, "g"), tc.placeholder((B * H, T, D), BF16, "v")
    G = tc.compute((B, H, T, D), lambda b, h, t, d: g[b * T + t, h * D + d], name="G")
    Gv = tc.compute((B * H, T, D), lambda z, t, d: G[z // H, z % H, t, d], name="Gv")
    r = tc.reduce_axis(D, "r")
    C = tc.compute((B * H, T, T), lambda z, i, j: tc.cast(tc.sum(tc.cast(Gv[z, i, r], F32) * tc.cast(v[z, j, r], F32),
                                                                   axis=r), BF16), name="C")

    def reference(g: np.ndarray, v: np.ndarray) -> np.ndarray:
        heads = g.reshape(B, T, H, D).transpose(0, 2, 1, 3).reshape(B * H, T, D)
        return heads @ v.transpose(0, 2, 1)

    return [g, v, C], reference


def test_a_per_head_copy_stays_a_stage_so_the_batched_gemm_is_a_contraction() -> None:
    tensors, _ = per_head_copy(2, 16, 2, 16)
    module = lower(tensors)
    names = sorted(k.name for k in module.kernels)
    assert "Gv_kernel" in names, names
    (kernel,) = [k for k in module.kernels if k.name.startswith("C")]
    assert analyze_kernel(kernel).kind == "contraction"
    # at GPT-2's size (8 x 1024 tokens, 12 heads of 64) it plans on tensor cores
    result = plan_program(per_head_copy(8, 1024, 12, 64)[0], "sm_90")
    chosen = {kp.kernel: kp.chosen.strategy.name for kp in result.kernels}
    assert chosen["C_kernel"] in TENSOR_CORES, chosen


def test_the_batched_gemm_over_a_per_head_copy_computes_it() -> None:
    tensors, reference = per_head_copy(2, 32, 2, 16)
    plan = plan_program(tensors, "sm_80", only=["gemm_tensor_core", "elementwise"]).plan
    assert "gemm_tensor_core" in plan.strategy, plan.reason
    f = tc.build(tensors, target="sim", arch="sm_80", plan=plan)
    rng = np.random.default_rng(11)
    g = rng.uniform(-1, 1, (64, 32)).astype(np_dtype(BF16))
    v = rng.uniform(-1, 1, (4, 32, 16)).astype(np_dtype(BF16))
    out = np.full((4, 32, 32), np.nan, dtype=np_dtype(BF16))
    f(g, v, out)
    exact = reference(g.astype(np.float64), v.astype(np.float64))
    size = reference(np.abs(g.astype(np.float64)), np.abs(v.astype(np.float64)))
    bound = 17 * 2.0**-24 * size + 2.0**-8 * (np.abs(exact) + 17 * 2.0**-24 * size)
    assert np.isfinite(out.astype(np.float64)).all()
    assert (np.abs(out.astype(np.float64) - exact) <= bound).all()
