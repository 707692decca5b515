"""Graph-level rewrites inside larger programs (tecc/compiler/region_search.py, regions.py): the
part a rewrite takes is cut out, planned by it, and composed with the rest into one module."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tecc as tc


def attention_layer(name: str, B: int = 1, H: int = 2, N: int = 24, D: int = 16, causal: bool = True,
                    inputs: tuple | None = None):
    """Scores, a causal mask, softmax statistics, the output, its log-sum-exp, then a projection."""
    if inputs is None:
        Q, K, V = (tc.placeholder((B, H, N, D), "float32", name=f"{name}{x}") for x in "QKV")
    else:
        Q, K, V = inputs
    W = tc.placeholder((D, D), "float32", name=f"{name}W")
    d, j1, j2, j3, k = (tc.reduce_axis(n_, x) for n_, x in ((D, "d"), (N, "j1"), (N, "j2"), (N, "j3"), (D, "k")))
    S = tc.compute((B, H, N, N), lambda b, h, i, j: tc.sum(Q[b, h, i, d] * K[b, h, j, d], axis=d) / math.sqrt(D),
                   name=f"{name}S")
    Sm = tc.compute(S.shape, lambda b, h, i, j: tc.where(j <= i, S[b, h, i, j], -math.inf) if causal else S[b, h, i, j],
                    name=f"{name}Sm")
    m = tc.compute((B, H, N), lambda b, h, i: tc.max(Sm[b, h, i, j1], axis=j1), name=f"{name}m")
    e = tc.compute(S.shape, lambda b, h, i, j: tc.exp(Sm[b, h, i, j] - m[b, h, i]), name=f"{name}e")
    l = tc.compute((B, H, N), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name=f"{name}l")
    O = tc.compute((B, H, N, D), lambda b, h, i, c: tc.sum(e[b, h, i, j3] * V[b, h, j3, c], axis=j3) / l[b, h, i],
                   name=f"{name}O")
    lse = tc.compute((B, H, N), lambda b, h, i: m[b, h, i] + tc.log(l[b, h, i]), name=f"{name}lse")
    P = tc.compute((B, H, N, D), lambda b, h, i, c: tc.sum(O[b, h, i, k] * W[k, c], axis=k), name=f"{name}P")
    return (Q, K, V, W), P, lse


def reference(q, k, v, w, causal=True):
    q, k, v, w = (x.astype(np.float64) for x in (q, k, v, w))
    s = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:])) > 0, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    return (e @ v) / l @ w, (m + np.log(l))[..., 0]


def run(f, *inputs):
    outs = [np.full(b.shape and tuple(int(s) for s in b.shape), np.nan, np.float32)
            for b in f.host.buffer_params[len(inputs):]]
    f.sim(*inputs, *outs)
    return outs


def rand(*shape):
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def test_attention_inside_a_larger_program_is_one_online_kernel_composed_with_the_rest():
    (Q, K, V, W), P, lse = attention_layer("a")
    f = tc.build([Q, K, V, W, P, lse], target="sim")
    assert f.plan.strategy == "regions", f.plan.reason
    names = [k.name for k in f.module.kernels]
    assert any("online" in n for n in names) and len(names) == 2, names
    q, k, v = rand(1, 2, 24, 16), rand(1, 2, 24, 16), rand(1, 2, 24, 16)
    w = rand(16, 16)
    p, ls = run(f, q, k, v, w)
    ref_p, ref_lse = reference(q, k, v, w)
    np.testing.assert_allclose(p, ref_p, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ls, ref_lse, rtol=1e-5, atol=1e-5)


def test_a_composed_plan_replays_to_the_same_kernels():
    (Q, K, V, W), P, lse = attention_layer("r")
    f = tc.build([Q, K, V, W, P, lse], target="sim")
    g = tc.build([Q, K, V, W, P, lse], target="sim", plan=f.plan.to_json())
    assert [k.name for k in g.module.kernels] == [k.name for k in f.module.kernels]
    assert str(g.module) == str(f.module)
    q, k, v, w = rand(1, 2, 24, 16), rand(1, 2, 24, 16), rand(1, 2, 24, 16), rand(16, 16)
    for got, want in zip(run(g, q, k, v, w), reference(q, k, v, w)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_two_attention_layers_in_a_chain_are_two_regions_with_a_part_between():
    (Q, K, V, W1), P1, lse1 = attention_layer("x", causal=False)
    (_, _, _, W2), P2, lse2 = attention_layer("y", causal=False, inputs=(P1, K, V))
    f = tc.build([Q, K, V, W1, W2, P2, lse1, lse2], target="sim")
    assert f.plan.strategy == "regions", f.plan.reason
    assert sum("online" in k.name for k in f.module.kernels) == 2, [k.name for k in f.module.kernels]
    q, k, v, w1, w2 = rand(1, 2, 24, 16), rand(1, 2, 24, 16), rand(1, 2, 24, 16), rand(16, 16), rand(16, 16)
    p2, l1, l2 = run(f, q, k, v, w1, w2)
    ref_p1, ref_l1 = reference(q, k, v, w1, causal=False)
    ref_p2, ref_l2 = reference(ref_p1.astype(np.float32), k, v, w2, causal=False)
    np.testing.assert_allclose(l1, ref_l1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l2, ref_l2, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(p2, ref_p2, rtol=1e-4, atol=1e-4)


def test_a_stage_that_depends_on_no_region_runs_in_the_part_of_its_reader():
    """A value computed from the program's inputs alone (W2 squared, as a backward recomputes a
    value from a saved one) is computed in the part of the stage that reads it, after the
    attention region, not in the first part: its output is then alive for one part, not the
    whole program."""
    (Q, K, V, W), P, lse = attention_layer("z", causal=False)
    W2 = tc.placeholder((16, 16), "float32", name="W2")
    r, c = tc.reduce_axis(16, "r"), tc.reduce_axis(16, "c")
    Wsq = tc.compute((16, 16), lambda a, b: tc.sum(W2[a, r] * W2[r, b], axis=r), name="Wsq")
    Z = tc.compute((1, 2, 24, 16), lambda b, h, i, j: tc.sum(P[b, h, i, c] * Wsq[c, j], axis=c), name="Z")
    f = tc.build([Q, K, V, W, W2, Z, lse], target="sim")
    assert f.plan.strategy == "regions", f.plan.reason
    names = [k.name for k in f.module.kernels]
    online = next(n for n, name in enumerate(names) if "online" in name)
    square = next(n for n, name in enumerate(names) if "Wsq" in name)
    assert square > online, f"W2 squared runs before the region: {names}"
    q, k, v, w, w2 = rand(1, 2, 24, 16), rand(1, 2, 24, 16), rand(1, 2, 24, 16), rand(16, 16), rand(16, 16)
    z, ls = run(f, q, k, v, w, w2)
    ref_p, ref_lse = reference(q, k, v, w, causal=False)
    want = ref_p @ (w2.astype(np.float64) @ w2)
    np.testing.assert_allclose(z, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(ls, ref_lse, rtol=1e-5, atol=1e-5)


def test_a_program_with_no_graph_level_part_is_planned_kernel_by_kernel():
    A = tc.placeholder((8, 12), "float32", name="A")
    B = tc.placeholder((12, 5), "float32", name="B")
    k = tc.reduce_axis(12, "k")
    C = tc.compute((8, 5), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    D = tc.compute((8, 5), lambda i, j: C[i, j] * C[i, j] + A[i, j], name="D")
    f = tc.build([A, B, C, D], target="sim")
    assert f.plan.strategy != "regions", f.plan.reason
    a, b = rand(8, 12), rand(12, 5)
    c, d = run(f, a, b)
    ref = a.astype(np.float64) @ b
    # float32 sums of 12 products: bounded relative to the sums' scale (a sum that cancels to near
    # zero keeps the summands' absolute error, not a relative one)
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    want = ref ** 2 + a[:, :5]
    np.testing.assert_allclose(d, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("columns", [1000, 1031])
def test_a_row_reduction_that_nothing_joins_is_a_region_of_its_own(columns):
    """D sums the rows of the GEMM C (over 1000 or 1031 columns): no other stage shares its
    rows, so the seed alone is offered to the graph strategies, and row fusion's one block per
    row (a block-wide reduction) wins over the per-kernel reduction's thread per row."""
    A = tc.placeholder((6, 12), "float32", name="A")
    B = tc.placeholder((12, columns), "float32", name="B")
    k = tc.reduce_axis(12, "k")
    C = tc.compute((6, columns), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    r = tc.reduce_axis(columns, "r")
    D = tc.compute((6,), lambda i: tc.sum(C[i, r] * C[i, r], axis=r), name="D")
    f = tc.build([A, B, D], target="sim")
    assert f.plan.strategy == "regions", f.plan.reason
    assert [s.args["plan"]["strategy"] for s in f.plan.steps if s.primitive == "region"][-1] == "row_fused", \
        f.plan.reason
    a, b = rand(6, 12), rand(12, columns)
    (d,) = run(f, a, b)
    np.testing.assert_allclose(d, ((a.astype(np.float64) @ b) ** 2).sum(1), rtol=1e-5)


@pytest.mark.parametrize("dims", [(1, 2, 24, 16)])
def test_the_composed_module_keeps_the_program_signature(dims):
    (Q, K, V, W), P, lse = attention_layer("s")
    f = tc.build([Q, K, V, W, P, lse], target="sim")
    assert [b.name for b in f.host.buffer_params] == ["sQ", "sK", "sV", "sW", "sP", "slse"]
    assert "sO" in [t.name for t in f.host.temps]   # the attention output: between the two parts


def norm_backward_with_residual(R: int, C: int, half: bool, K: int = 16):
    """A layer norm backward's shape of program (GPT-2's): the gradient G arrives from a GEMM,
    two row statistics s1 = sum_c G*g and s2 = sum_c G*g*X feed dx; dx (cast to bfloat16 when
    `half`, as autocast does) feeds the next GEMM H, and the residual gradient out = dx + H - t
    adds dx to what came through that GEMM. out's region with s1 / s2 would run before and after
    H at once (a cycle), which used to drop the whole region: each statistic became a per-kernel
    reduction of its own."""
    low = "bfloat16" if half else "float32"
    A = tc.placeholder((R, K), low, name="A")
    B = tc.placeholder((K, C), low, name="B")
    X = tc.placeholder((R, C), "float32", name="X")
    g = tc.placeholder((C,), "float32", name="g")
    W = tc.placeholder((C, C), low, name="W")
    k, c1, c2, c3, c4 = (tc.reduce_axis(n, x) for n, x in ((K, "k"), (C, "c1"), (C, "c2"), (C, "c3"), (C, "c4")))

    def matmul(shape, a, b, axis, name):
        return tc.compute(shape, lambda i, j: tc.cast(tc.sum(tc.cast(a(i, axis), "float32")
                                                             * tc.cast(b(axis, j), "float32"), axis=axis), low),
                          name=name)

    G = matmul((R, C), lambda i, r: A[i, r], lambda r, j: B[r, j], k, "G")
    s1 = tc.compute((R,), lambda i: tc.sum(G[i, c1] * g[c1], axis=c1), name="s1")
    s2 = tc.compute((R,), lambda i: tc.sum(G[i, c2] * g[c2] * X[i, c2], axis=c2), name="s2")
    dx = tc.compute((R, C), lambda i, j: G[i, j] * g[j] * C - s1[i] - X[i, j] * s2[i], name="dx")
    dx_low = tc.compute((R, C), lambda i, j: tc.cast(dx[i, j], low), name="dx_low") if half else dx
    H = matmul((R, C), lambda i, r: dx_low[i, r], lambda r, j: W[r, j], c3, "H")
    t = tc.compute((R,), lambda i: tc.sum(H[i, c4] * X[i, c4], axis=c4), name="t")
    out = tc.compute((R, C), lambda i, j: dx[i, j] + H[i, j] - t[i], name="out")
    return [A, B, X, g, W, out]


def norm_backward_reference(a, b, x, g, w, half: bool):
    import ml_dtypes

    def low(v):
        return v.astype(ml_dtypes.bfloat16).astype(np.float64) if half else v

    a, b, x, g, w = (v.astype(np.float64) for v in (a, b, x, g, w))
    G = low(a @ b)
    s1 = (G * g).sum(1, keepdims=True)
    s2 = (G * g * x).sum(1, keepdims=True)
    dx = G * g * x.shape[1] - s1 - x * s2
    H = low(low(dx) @ w)
    return dx + H - (H * x).sum(1, keepdims=True)


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("rows, columns", [(37, 45), (5, 130), (0, 45)])
def test_row_statistics_read_across_a_gemm_are_one_row_kernel(half, rows, columns):
    """The two statistics and dx share one row kernel (the cycle through H leaves out the residual
    sum, which gets a row kernel of its own after H), and the program computes what NumPy does."""
    import ml_dtypes

    args = norm_backward_with_residual(rows, columns, half)
    f = tc.build(args, target="sim")
    assert f.plan.strategy == "regions", f.plan.reason
    names = [k.name for k in f.module.kernels]
    # one row kernel for s1 and s2 (and dx_low, which the GEMM reads), one for t and out; before,
    # s1 and s2 were per-kernel reductions, a kernel each
    assert not {"s1_kernel", "s2_kernel"} & set(names), (names, f.plan.reason)
    assert sum(n.endswith("_rows_kernel") for n in names) == 2, (names, f.plan.reason)
    rng = np.random.default_rng()
    low = ml_dtypes.bfloat16 if half else np.float32
    a, b = rng.standard_normal((rows, 16)).astype(low), rng.standard_normal((16, columns)).astype(low)
    x, g = rng.standard_normal((rows, columns)).astype(np.float32), rng.standard_normal(columns).astype(np.float32)
    w = (rng.standard_normal((columns, columns)) / np.sqrt(columns)).astype(low)
    (out,) = run(f, a, b, x, g, w)
    want = norm_backward_reference(a, b, x, g, w, half)
    if rows == 0:
        assert out.shape == (0, columns)
        return
    # float32: sums of ~100 terms; bfloat16: dx rounded before the GEMM (a dx at a rounding
    # boundary may round the other way in float32 than in float64), H rounded after it
    bound = (2.0 ** -7 if half else 1e-5) * np.abs(want).max()
    worst = np.unravel_index(np.argmax(np.abs(out - want)), want.shape)
    assert np.abs(out - want).max() <= bound, (f.plan.reason, worst, out[worst], want[worst])


@pytest.mark.gpu
@pytest.mark.parametrize("rows, columns", [(8192, 768), (1000, 770)])
def test_gpu_row_statistics_read_across_a_gemm_match_numpy(rows, columns):
    """GPT-2's layer norm backward shape on the GPU (bf16 GEMMs, float32 rows): the composed
    module with one row kernel for both sums and dx against NumPy, outputs poisoned."""
    import ml_dtypes

    args = norm_backward_with_residual(rows, columns, True, K=64)
    f = tc.build(args, target="cuda")
    names = [k.name for k in f.module.kernels]
    assert not {"s1_kernel", "s2_kernel"} & set(names), (names, f.plan.reason)
    rng = np.random.default_rng(rows)
    a = rng.standard_normal((rows, 64)).astype(ml_dtypes.bfloat16)
    b = (rng.standard_normal((64, columns)) / 8).astype(ml_dtypes.bfloat16)
    x, g = rng.standard_normal((rows, columns)).astype(np.float32), rng.standard_normal(columns).astype(np.float32)
    w = (rng.standard_normal((columns, columns)) / np.sqrt(columns)).astype(ml_dtypes.bfloat16)
    out = np.full((rows, columns), np.nan, np.float32)
    f(a, b, x, g, w, out)
    want = norm_backward_reference(a, b, x, g, w, True)
    worst = np.unravel_index(np.argmax(np.abs(out - want)), want.shape)
    assert np.abs(out - want).max() <= 2.0 ** -7 * np.abs(want).max(), (f.plan.reason, worst, out[worst], want[worst])
