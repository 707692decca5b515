"""Data-dependent indices in the emulator: gathers (`W[idx[i], j]`) and scatter-adds
(`tc.scatter_add`), against NumPy in float64, with their out-of-range errors, both realizations of
a scatter (atomics, and the deterministic per-output sum), autodiff through them, and what the
planner, the cost model and the code generator make of them."""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.cost.traffic import gathered_cost
from tecc.compiler.strategies import registry as strategies
from tecc.ir import dtype as dt
from tecc.ir.errors import DTypeError, OutOfBoundsError, ShapeError
from tecc.passes.lower import lower

RNG = np.random.default_rng(30)
FLOATS = ["float32", "bfloat16", "float16"]
INDICES = ["int32", "int64"]
# relative error of one rounding to the output dtype, plus float32 accumulation over a few terms
TOLERANCE = {"float32": 1e-5, "bfloat16": 2 ** -7, "float16": 2 ** -10}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(dt.as_dtype(name).numpy)


def random(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np_dtype(dtype))


def poisoned(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.full(shape, np.nan, dtype=np_dtype(dtype))


def embedding(n, d, v, dtype="float32", index="int32"):
    W = tc.placeholder((v, d), dtype, name="W")
    idx = tc.placeholder((n,), index, name="idx")
    Y = tc.compute((n, d), lambda i, j: W[idx[i], j], name="Y")
    return W, idx, Y


def embedding_backward(n, d, v, dtype="float32", index="int32", init=False):
    dY = tc.placeholder((n, d), dtype, name="dY")
    idx = tc.placeholder((n,), index, name="idx")
    base = tc.placeholder((v, d), dtype, name="base") if init else None
    dW = tc.scatter_add((v, d), (n, d), at=lambda i, j: (idx[i], j), value=lambda i, j: dY[i, j], init=base,
                        name="dW")
    return [dY, idx] + ([base] if init else []) + [dW]


def check_close(got: np.ndarray, want: np.ndarray, dtype: str, what: str, plan: object) -> None:
    got64 = got.astype(np.float64)
    assert not np.isnan(got64).any(), f"{what}: NaN left in the output (an element was never written)\n{plan}"
    err = np.abs(got64 - want) / (1.0 + np.abs(want))
    if err.size:
        worst = np.unravel_index(int(np.argmax(err)), err.shape)
        assert err[worst] <= TOLERANCE[dtype], (f"{what}: worst element {worst}: got {got64[worst]}, want "
                                                 f"{want[worst]}\n{plan}")


# ---- gathers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("index", INDICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_embedding_gather_copies_the_indexed_rows(dtype, index):
    n, d, v = 37, 24, 11  # odd sizes; indices repeat (37 rows from 11)
    f = tc.build(list(embedding(n, d, v, dtype, index)), target="sim")
    w, ix = random((v, d), dtype), RNG.integers(0, v, n).astype(index)
    y = poisoned((n, d), dtype)
    f.sim(w, ix, y)
    assert np.array_equal(y, w[ix]), f"gather differs from w[ix]\n{f.plan}"


def test_gather_mixes_affine_and_data_dependent_indices():
    b, n, k, d = 3, 5, 7, 4
    X = tc.placeholder((b, k, d), "float32", name="X")
    idx = tc.placeholder((b, n), "int64", name="idx")
    scale = tc.placeholder((b, n), "float32", name="scale")
    Y = tc.compute((b, n, d), lambda p, i, j: X[p, idx[p, i], j] * scale[p, i] + X[p, idx[p, i], d - 1 - j], name="Y")
    f = tc.build([X, idx, scale, Y], target="sim")
    x, ix, s = random((b, k, d), "float32"), RNG.integers(0, k, (b, n)), random((b, n), "float32")
    y = poisoned((b, n, d), "float32")
    f.sim(x, ix, s, y)
    rows = x[np.arange(b)[:, None], ix]  # (b, n, d)
    want = rows.astype(np.float64) * s[..., None] + rows[..., ::-1]
    check_close(y, want, "float32", "batched gather", f.plan)


def test_cross_entropy_target_pick_and_a_reduction_over_gathered_rows():
    n, c = 9, 13
    logits = tc.placeholder((n, c), "float32", name="logits")
    target = tc.placeholder((n,), "int64", name="target")
    picked = tc.compute((n,), lambda i: logits[i, target[i]], name="picked")
    f = tc.build([logits, target, picked], target="sim")
    x, t = random((n, c), "float32"), RNG.integers(0, c, n)
    y = poisoned((n,), "float32")
    f.sim(x, t, y)
    assert np.array_equal(y, x[np.arange(n), t])
    # a row reduction reading gathered rows still plans (a row strategy) and matches
    W, idx = tc.placeholder((c, 32), "float32", name="W"), tc.placeholder((n,), "int32", name="idx")
    k = tc.reduce_axis(32, name="k")
    s = tc.compute((n,), lambda i: tc.sum(tc.exp(W[idx[i], k]), axis=k), name="s")
    g = tc.build([W, idx, s], target="sim")
    w, ix = random((c, 32), "float32"), RNG.integers(0, c, n).astype("int32")
    out = poisoned((n,), "float32")
    g.sim(w, ix, out)
    check_close(out, np.exp(w[ix].astype(np.float64)).sum(axis=1), "float32", "sum over gathered rows", g.plan)


def test_gather_with_symbolic_sizes_serves_several_shapes():
    N, V = tc.var("N"), tc.var("V")
    f = tc.build(list(embedding(N, 16, V)), target="sim")
    for n, v in ((5, 3), (33, 70), (1, 1)):
        w, ix = random((v, 16), "float32"), RNG.integers(0, v, n).astype("int32")
        y = poisoned((n, 16), "float32")
        f.sim(w, ix, y)
        assert np.array_equal(y, w[ix]), f"n={n} v={v}"


@pytest.mark.parametrize("n,d,v", [(0, 8, 5), (6, 0, 5), (0, 8, 0)])
def test_gather_with_empty_dimensions(n, d, v):
    f = tc.build(list(embedding(n, d, v)), target="sim")
    y = np.empty((n, d), "float32")
    f.sim(random((v, d), "float32"), RNG.integers(0, max(v, 1), n).astype("int32"), y)
    assert y.shape == (n, d)


@pytest.mark.parametrize("bad", [11, 12345, -1])
def test_out_of_range_gather_index_names_the_tensor_the_index_and_the_value(bad, monkeypatch):
    monkeypatch.setenv("TECC_SIM_CHECKS", "0")  # a program error, reported whatever the checks knob says
    f = tc.build(list(embedding(7, 5, 11)), target="sim")
    ix = RNG.integers(0, 11, 7).astype("int32")
    ix[4] = bad
    with pytest.raises(OutOfBoundsError) as info:
        f.sim(random((11, 5), "float32"), ix, np.empty((7, 5), "float32"))
    text = str(info.value)
    assert "W" in text and f"= {bad}" in text and "[0, 11)" in text and "dimension 0" in text, text
    assert info.value.tensor == "W" and info.value.value == bad and info.value.dimension == 0


def test_non_integer_data_dependent_indices_are_dtype_errors():
    W = tc.placeholder((4, 3), "float32", name="W")
    f_idx = tc.placeholder((2,), "float32", name="f_idx")
    b_idx = tc.placeholder((2,), "bool", name="b_idx")
    with pytest.raises(DTypeError, match="data-dependent index must be the value of an integer tensor"):
        tc.compute((2, 3), lambda i, j: W[f_idx[i], j])
    with pytest.raises(DTypeError, match="integer tensor"):
        tc.compute((2, 3), lambda i, j: W[b_idx[i], j])
    with pytest.raises(DTypeError, match="integer tensor's value"):
        tc.scatter_add((4, 3), (2, 3), at=lambda i, j: (f_idx[i], j), value=lambda i, j: W[i, j])


def test_a_gathered_tile_cached_in_shared_memory_holds_the_whole_axis():
    n, d, v = 50, 32, 16
    W, idx, Y = embedding(n, d, v)
    sch = tc.Schedule([W, idx, Y])
    i, j = sch.get_loops("Y")
    io, ii = sch.split(i, 8)
    sch.reorder(io, j, ii)
    sch.bind(io, "blockIdx.x")
    sch.bind(j, "threadIdx.x")
    Ws = sch.cache_read("Y", "W", "shared")
    sch.compute_at(Ws, io)
    assert "W_shared: float32[16, 32] @shared" in str(sch.mod)
    f = tc.build(sch, target="sim")
    w, ix = random((v, d), "float32"), RNG.integers(0, v, n).astype("int32")
    y = poisoned((n, d), "float32")
    f.sim(w, ix, y)
    assert np.array_equal(y, w[ix])
    ix[7] = v
    with pytest.raises(OutOfBoundsError, match="into W"):
        f.sim(w, ix, y)


# ---- scatter-add -------------------------------------------------------------------------------

def _build_scatter(tensors, deterministic, items=2):
    """The deterministic build, or the atomic realization (forced: at these small sizes the
    planner may rank the one-kernel reduction first, which the deterministic build covers)."""
    if deterministic:
        return tc.build(tensors, target="sim", deterministic=True)
    sch = tc.Schedule(tensors)
    (kernel,) = sch.mod.kernels
    strategies.get("scatter_atomic").apply(sch, analyze_kernel(kernel), {"threads": 64, "items": items})
    return tc.build(sch, target="sim")


def _run_scatter(tensors, inputs, out_shape, dtype, deterministic, items=2):
    f = _build_scatter(tensors, deterministic, items)
    out = poisoned(out_shape, dtype)
    f.sim(*inputs, out)
    return f, out


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("index", INDICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_embedding_backward_matches_np_add_at(dtype, index, deterministic):
    n, d, v = 45, 12, 7  # 45 rows into 7: every row repeats; some rows may get none
    y, ix = random((n, d), dtype), RNG.integers(0, v, n).astype(index)
    ix[:9] = 3  # a hot row
    f, out = _run_scatter(embedding_backward(n, d, v, dtype, index), (y, ix), (v, d), dtype, deterministic)
    want = np.zeros((v, d))
    np.add.at(want, ix, y.astype(np.float64))
    check_close(out, want, dtype, "embedding backward", f.plan)
    assert ("atomic_add" in str(f.module)) != deterministic, f.module


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_index_put_accumulate_adds_to_init(deterministic):
    n, d, v = 20, 6, 9
    y, ix, base = random((n, d), "float32"), RNG.integers(0, v, n).astype("int32"), random((v, d), "float32")
    f, out = _run_scatter(embedding_backward(n, d, v, init=True), (y, ix, base), (v, d), "float32", deterministic)
    want = base.astype(np.float64)
    np.add.at(want, ix, y.astype(np.float64))
    check_close(out, want, "float32", "index_put(accumulate=True)", f.plan)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_scatter_add_along_dim_0_with_a_narrower_index(deterministic):
    # torch.scatter_add(self, 0, index, src): self[index[i, j], j] += src[i, j], index narrower than self
    v, d, n, dn = 6, 8, 10, 5
    self_ = tc.placeholder((v, d), "float32", name="self_")
    index = tc.placeholder((n, dn), "int64", name="index")
    src = tc.placeholder((n, dn), "float32", name="src")
    out = tc.scatter_add((v, d), (n, dn), at=lambda i, j: (index[i, j], j), value=lambda i, j: src[i, j],
                         init=self_, name="out")
    s, ix, x = random((v, d), "float32"), RNG.integers(0, v, (n, dn)), random((n, dn), "float32")
    f, got = _run_scatter([self_, index, src, out], (s, ix, x), (v, d), "float32", deterministic)
    want = s.astype(np.float64)
    np.add.at(want, (ix, np.broadcast_to(np.arange(dn), (n, dn))), x.astype(np.float64))
    check_close(got, want, "float32", "scatter_add along dim 0", f.plan)


def test_scatter_with_symbolic_sizes_and_empty_domains():
    N, V = tc.var("N"), tc.var("V")
    f = tc.build(embedding_backward(N, 4, V), target="sim")
    for n, v in ((0, 3), (17, 5), (3, 40)):
        y, ix = random((n, 4), "float32"), RNG.integers(0, v, n).astype("int32")
        out = poisoned((v, 4), "float32")
        f.sim(y, ix, out)
        want = np.zeros((v, 4))
        np.add.at(want, ix, y.astype(np.float64))
        check_close(out, want, "float32", f"n={n} v={v}", f.plan)


def test_atomics_in_the_emulator_add_lane_by_lane_in_float32():
    # every row into one: each element receives 64 float32 additions, in lane order, which is the
    # domain's order with one domain point per thread
    n, d = 64, 3
    y, ix = random((n, d), "float32"), np.zeros(n, "int32")
    f, out = _run_scatter(embedding_backward(n, d, 2), (y, ix), (2, d), "float32", False, items=1)
    assert "atomic_add" in str(f.module)
    want = np.zeros(d, np.float32)
    for row in y:  # the sequential float32 sum, one rounding per addition
        want = (want + row).astype(np.float32)
    assert np.array_equal(out[0], want) and np.array_equal(out[1], np.zeros(d, np.float32))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_out_of_range_scatter_position_names_the_output(deterministic):
    f = _build_scatter(embedding_backward(8, 4, 5, index="int64"), deterministic)
    ix = RNG.integers(0, 5, 8).astype("int64")
    ix[6] = -3
    with pytest.raises(OutOfBoundsError) as info:
        f.sim(random((8, 4), "float32"), ix, np.empty((5, 4), "float32"))
    assert info.value.tensor == "dW" and info.value.value == -3, str(info.value)


def test_scatter_bad_arguments_are_clear_errors():
    y = tc.placeholder((4, 3), "float32", name="y")
    idx = tc.placeholder((4,), "int32", name="idx")
    with pytest.raises(ShapeError, match="one per dimension"):
        tc.scatter_add((5, 3), (4, 3), at=lambda i, j: idx[i], value=lambda i, j: y[i, j])
    with pytest.raises(ShapeError, match=r"leaves dimension 1 of s \(size 3\)"):
        tc.scatter_add((5, 3), (4, 3), at=lambda i, j: (idx[i], j + 1), value=lambda i, j: y[i, j], name="s")
    with pytest.raises(ShapeError, match="init"):
        tc.scatter_add((5, 3), (4, 3), at=lambda i, j: (idx[i], j), value=lambda i, j: y[i, j], init=y)
    with pytest.raises(DTypeError, match="cannot accumulate bool"):
        tc.scatter_add((5, 3), (4, 3), at=lambda i, j: (idx[i], j), value=lambda i, j: y[i, j] > 0)


def test_the_atomic_rewrite_also_takes_a_masked_sum_written_by_hand():
    # the same algebra without scatter_add: no index checks, so out-of-range positions add nothing
    n, d, v = 30, 5, 6
    dY, idx = tc.placeholder((n, d), "float32", name="dY"), tc.placeholder((n,), "int32", name="idx")
    k = tc.reduce_axis(n, name="k")
    dW = tc.compute((v, d), lambda r, j: tc.sum(tc.where(idx[k] == r, dY[k, j], 0.0), axis=k), name="dW")
    f = _build_scatter([dY, idx, dW], False)
    assert "atomic_add" in str(f.module), f.module
    y, ix = random((n, d), "float32"), RNG.integers(-2, v + 2, n).astype("int32")
    out = poisoned((v, d), "float32")
    f.sim(y, ix, out)
    want = np.zeros((v, d))
    keep = (ix >= 0) & (ix < v)
    np.add.at(want, ix[keep], y[keep].astype(np.float64))
    check_close(out, want, "float32", "masked sum by hand", f.plan)


# ---- autodiff ----------------------------------------------------------------------------------

def test_grad_of_an_embedding_is_a_scatter_matching_numpy():
    n, d, v = 23, 8, 6
    W = tc.placeholder((v, d), "float32", name="W")
    idx = tc.placeholder((n,), "int64", name="idx")
    P = tc.placeholder((d, 3), "float32", name="P")
    k = tc.reduce_axis(d, name="k")
    # an embedding followed by a projection: Y = W[idx] @ P
    Y = tc.compute((n, 3), lambda i, c: tc.sum(W[idx[i], k] * P[k, c], axis=k), name="Y")
    g = tc.grad(Y, [W, P])
    assert "+=" in str(g[W]), str(g[W])
    f = tc.build(g.args, target="sim")
    w, ix, p, dy = random((v, d), "float32"), RNG.integers(0, v, n), random((d, 3), "float32"), random((n, 3), "float32")
    values = {"W": w, "idx": ix, "P": p}
    dw, dp = poisoned((v, d), "float32"), poisoned((d, 3), "float32")
    f.sim(*[values[t.name] for t in g.inputs], dy, dw, dp)
    want_w = np.zeros((v, d))
    np.add.at(want_w, ix, dy.astype(np.float64) @ p.T.astype(np.float64))
    check_close(dw, want_w, "float32", "dW of an embedding", f.plan)
    check_close(dp, w[ix].astype(np.float64).T @ dy, "float32", "dP", f.plan)


def test_grad_of_a_scatter_is_a_gather_and_indices_get_none():
    n, d, v = 9, 4, 5
    dY, idx, base, dW = embedding_backward(n, d, v, init=True)
    g = tc.grad(dW, [dY, base])
    f = tc.build(g.args, target="sim")
    y, ix, b, gs = random((n, d), "float32"), RNG.integers(0, v, n).astype("int32"), random((v, d), "float32"), \
        random((v, d), "float32")
    values = {"dY": y, "idx": ix, "base": b}
    gy, gb = poisoned((n, d), "float32"), poisoned((v, d), "float32")
    f.sim(*[values[t.name] for t in g.inputs], gs, gy, gb)
    assert np.array_equal(gy, gs[ix]) and np.array_equal(gb, gs)
    with pytest.raises(DTypeError, match="only float tensors"):
        tc.grad(dW, [idx])


# ---- planner, cost model, code generator --------------------------------------------------------

def test_planner_adds_a_gpt2_embedding_backward_with_atomics_unless_deterministic():
    tensors = embedding_backward(8192, 768, 50257, "bfloat16", "int64")
    result = tc.plan_program(tensors, "sm_90")
    (kp,) = result.kernels
    assert kp.chosen.strategy.name == "scatter_atomic", tc.explain(result)
    other = next(c for c in kp.ranked if c.strategy.name != "scatter_atomic")
    assert other.cost.total > 100 * kp.chosen.cost.total, tc.explain(result)
    strict = tc.plan_program(tensors, tc.target("sm_90").replace(deterministic=True))
    assert strict.kernels[0].chosen.strategy.name != "scatter_atomic"
    assert any(name == "scatter_atomic" and "deterministic" in why for name, why in strict.kernels[0].declined)


def tied_embedding_gradient(n, d, v, dtype="float32", index="int32"):
    """GPT-2's tied token-embedding gradient: the lm head's weight gradient dLᵀ·h (in `dtype`,
    then float32, as under autocast) plus the embedding's scatter of dY, one output."""
    dL = tc.placeholder((n, v), dtype, name="dL")
    h = tc.placeholder((n, d), dtype, name="h")
    dY = tc.placeholder((n, d), "float32", name="dY")
    idx = tc.placeholder((n,), index, name="idx")
    k = tc.reduce_axis(n, name="k")
    mm = tc.compute((v, d), lambda i, j: tc.cast(tc.sum(tc.cast(dL[k, i], "float32") * tc.cast(h[k, j], "float32"),
                                                        axis=k), dtype), name="mm")
    emb = tc.scatter_add((v, d), (n, d), at=lambda i, j: (idx[i], j), value=lambda i, j: dY[i, j], name="emb")
    dW = tc.compute((v, d), lambda i, j: tc.cast(mm[i, j], "float32") + emb[i, j], name="dW")
    return [dL, h, dY, idx, dW]


def test_a_scatter_is_not_inlined_into_its_reader_and_only_one_reduction_is():
    """dW = mm + scatter, both read once at dW's own index: the contraction becomes dW's kernel
    (an epilogue), the scatter stays a stage of its own (inlined, it is the gather-wise search of
    every position for every output, which no strategy but the thread-per-output reduction
    takes), and the emulator gives NumPy's sum."""
    n, d, v = 40, 12, 9
    tensors = tied_embedding_gradient(n, d, v)
    assert [k.name for k in lower(tensors).kernels] == ["emb_kernel", "dW_kernel"]
    f = tc.build(tensors, target="sim")
    dl, h, dy = random((n, v), "float32"), random((n, d), "float32"), random((n, d), "float32")
    ix = RNG.integers(0, v, n).astype("int32")
    out = poisoned((v, d), "float32")
    f.sim(dl, h, dy, ix, out)
    want = dl.astype(np.float64).T @ h.astype(np.float64)
    np.add.at(want, ix, dy.astype(np.float64))
    check_close(out, want, "float32", "tied embedding gradient", f.plan)


def test_two_reductions_read_by_one_output_leave_one_inlined():
    """D = A·B + A·C: each contraction alone would be D's epilogue; inlining both makes a kernel
    of two reductions that no GEMM takes, so only one is inlined (the first in the program's
    order), the other is stored."""
    A = tc.placeholder((24, 16), "float32", name="A")
    B = tc.placeholder((16, 20), "float32", name="B")
    C = tc.placeholder((16, 20), "float32", name="C")
    k, m = tc.reduce_axis(16, name="k"), tc.reduce_axis(16, name="m")
    AB = tc.compute((24, 20), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="AB")
    AC = tc.compute((24, 20), lambda i, j: tc.sum(A[i, m] * C[m, j], axis=m), name="AC")
    D = tc.compute((24, 20), lambda i, j: AB[i, j] + AC[i, j], name="D")
    names = [k.name for k in lower([A, B, C, D]).kernels]
    assert len(names) == 2 and names[0] in ("AB_kernel", "AC_kernel") and names[1] == "D_kernel", names
    f = tc.build([A, B, C, D], target="sim")
    a, b, c = random((24, 16), "float32"), random((16, 20), "float32"), random((16, 20), "float32")
    out = poisoned((24, 20), "float32")
    f.sim(a, b, c, out)
    check_close(out, a.astype(np.float64) @ (b.astype(np.float64) + c), "float32", "A·B + A·C", f.plan)


def test_gpt2_tied_embedding_gradient_is_a_gemm_and_an_atomic_scatter():
    """At GPT-2's sizes (8192 positions, width 768, vocabulary 50257, bf16) on sm_90: the
    contraction on tensor cores with the add as its epilogue, the scatter by atomics; a few ms
    predicted in all (inlined together they were one thread-per-output reduction: 2 s)."""
    result = tc.plan_program(tied_embedding_gradient(8192, 768, 50257, "bfloat16", "int64"), "sm_90")
    chosen = {kp.kernel: kp.chosen for kp in result.kernels}
    assert chosen["emb_kernel"].strategy.name == "scatter_atomic", tc.explain(result)
    assert chosen["dW_kernel"].strategy.name in ("gemm_wgmma", "gemm_tensor_core"), tc.explain(result)
    assert sum(c.cost.total for c in chosen.values()) < 5e-3, tc.explain(result)


def test_gathered_rows_are_coalesced_along_an_affine_fastest_axis():
    W, idx, Y = embedding(1024, 768, 50257)
    (kernel,) = lower([W, idx, Y]).kernels
    info = analyze_kernel(kernel)
    (w,) = [a for a in info.reads if a.tensor == "W"]
    assert w.offset is None and w.gathered is not None and w.gather_vars == {"i"}
    along_row = {"i": [0] * 32, "j": list(range(32))}
    across_rows = {"i": list(range(32)), "j": [0] * 32}
    assert gathered_cost(w, along_row, 1) == (4, 1)     # one row: 128 contiguous bytes
    assert gathered_cost(w, across_rows, 1) == (32, 32)  # a row each: a sector per lane
    f = tc.build([W, idx, Y], target="cuda", arch="sm_90")
    assert "vector=4" in str(f.plan) or "vector=2" in str(f.plan), f.plan
    assert "float4" in f.source or "float2" in f.source, f.source


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_of_gathers_and_atomic_scatters_compiles_with_64_bit_gather_offsets(dtype):
    f = tc.build(list(embedding(300, 64, 1000, dtype, "int32")), target="cuda", arch="sm_90")
    assert "tecc_index_ok(idx[" in f.source and "* 64LL" in f.source and "tecc_index_error[5]" in f.source
    assert all(r.spill_stores == 0 for r in f.resources.values())
    g = tc.build(embedding_backward(300, 64, 1000, dtype, "int64"), target="cuda", arch="sm_90")
    assert "atomicAdd(&dW" in g.source and "scatter_atomic" in g.plan.strategy, g.source
    assert (dtype == "bfloat16") == ("dW_finish" in g.source)
    assert [c.to_json() for c in g.host.index_checks] == [["dW_kernel", "dW", 0]]


def test_programs_without_data_dependent_indices_have_no_error_record():
    A = tc.placeholder((64, 32), "float32", name="A")
    B = tc.compute((64, 32), lambda i, j: A[i, j] * 2.0, name="B")
    f = tc.build([A, B], target="cuda", arch="sm_90")
    assert "tecc_index" not in f.source and f.host.index_checks == ()
    assert "index_checks" not in f.host.to_json()


def test_saved_artifacts_keep_the_index_checks(tmp_path):
    f = tc.build(list(embedding(9, 4, 5, "float32", "int64")), target="cuda", arch="sm_90")
    f.save(str(tmp_path / "emb"))
    g = tc.load(str(tmp_path / "emb"))
    assert g.host.index_checks == f.host.index_checks != ()
    w, ix = random((5, 4), "float32"), RNG.integers(0, 5, 9)
    y = poisoned((9, 4), "float32")
    g.sim(w, ix, y)
    assert np.array_equal(y, w[ix])
    ix[0] = 5
    with pytest.raises(OutOfBoundsError, match="into W"):
        g.sim(w, ix, y)


def _gathered_programs():
    n, d, v = 40, 96, 70
    W, idx = tc.placeholder((v, d), "float32", name="W"), tc.placeholder((n,), "int32", name="idx")
    k1, k2, k3, k4 = (tc.reduce_axis(d, name=f"k{u}") for u in range(4))
    r = tc.reduce_axis(n, name="r")
    m = tc.compute((n,), lambda i: tc.max(W[idx[i], k1], axis=k1), name="m")
    s = tc.compute((n,), lambda i: tc.sum(tc.exp(W[idx[i], k2] - m[i]), axis=k2), name="s")
    softmax = tc.compute((n, d), lambda i, j: tc.exp(W[idx[i], j] - m[i]) / s[i], name="softmax")
    P = tc.placeholder((d, 16), "float32", name="P")
    matmul = tc.compute((n, 16), lambda i, c: tc.sum(W[idx[i], k3] * P[k3, c], axis=k3), name="matmul")
    colsum = tc.compute((d,), lambda j: tc.sum(W[idx[r], j], axis=r), name="colsum")
    rowsum = tc.compute((n,), lambda i: tc.sum(W[idx[i], k4] * W[idx[i], k4], axis=k4), name="rowsum")

    def softmax_ref(w, ix):
        e = np.exp(w[ix] - w[ix].max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    return [
        ("softmax of gathered rows", [W, idx, softmax], softmax_ref),
        ("gathered rows times a matrix", [W, idx, P, matmul], None),
        ("column sum of gathered rows", [W, idx, colsum], lambda w, ix: w[ix].sum(0)),
        ("row sums of squares of gathered rows", [W, idx, rowsum], lambda w, ix: (w[ix] ** 2).sum(1)),
    ]


@pytest.mark.parametrize("case", range(4))
def test_every_strategy_that_takes_a_gather_builds_it_correctly(case, monkeypatch):
    monkeypatch.setenv("TECC_STRICT_PLANS", "1")  # a strategy that fails on a gather raises here
    name, tensors, ref = _gathered_programs()[case]
    f = tc.build(tensors, target="sim")
    tc.build(tensors, target="cuda", arch="sm_90")  # and its CUDA compiles
    w, ix = random((70, 96), "float32"), RNG.integers(0, 70, 40).astype("int32")
    inputs = [w, ix]
    if ref is None:
        p = random((96, 16), "float32")
        inputs.append(p)
        want = w[ix].astype(np.float64) @ p
    else:
        want = ref(w.astype(np.float64), ix)
    out = poisoned(want.shape, "float32")
    f.sim(*inputs, out)
    check_close(out, want, "float32", name, f.plan)


def test_the_runtime_raises_a_filled_error_record_once_and_clears_it(monkeypatch):
    """The host side of the GPU's index checks, with the driver's copy and memset stood in for
    (the device side runs in tests/test_gather_scatter_gpu.py)."""
    import ctypes

    from cuda.bindings import driver

    from tecc.runtime import index_errors

    f = tc.build(list(embedding(9, 4, 5003, "float32", "int64")), target="cuda", arch="sm_90")
    device = np.array([1, -7, 5003, 4, 96], np.int64)  # site 0 failed: value -7 of extent 5003
    ok = (driver.CUresult.CUDA_SUCCESS,)

    def copy(dst, src, nbytes):
        assert src == 4096 and nbytes == device.nbytes
        ctypes.memmove(dst, device.ctypes.data, nbytes)
        return ok

    def clear(ptr, value, nbytes):
        device[:] = value
        return ok

    monkeypatch.setattr(driver, "cuMemcpyDtoH", copy)
    monkeypatch.setattr(driver, "cuMemsetD8", clear)
    with pytest.raises(OutOfBoundsError) as info:
        index_errors.check(4096, f.host)
    assert ("-7 indexes dimension 0 of W (size 5003) in kernel Y_kernel, found by block 4, thread 96"
            in str(info.value)), str(info.value)
    assert not device.any()
    index_errors.check(4096, f.host)  # cleared: the next synchronized call raises nothing
