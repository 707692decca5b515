"""Online contraction (tecc.passes.rewrite.online_contraction): a contraction over the axis of a
(max, Σ exp) row statistic -- attention, masked or biased, grouped heads, softmax then a
contraction -- is ONE kernel with a running max, and matches float64 NumPy in the emulator."""

import math

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.ir.errors import ScheduleError
from tecc.ir.stmt import Allocate, iter_stmts
from planning import propose_simt as propose_online
from tecc.passes.rewrite.online_contraction import online_chain, online_contraction

PLAN = Plan((Step("online_contraction", {"threads": 32, "rows_per_block": 4}),), "test", "")


def attention(B, H, S, D, dtype="float32", causal=False, bias=False, groups=1, lse=False, Sk=None):
    """Attention as users write it: scores, row max, exp, row sum, contraction with V, cast."""
    Sk = Sk or S
    Q = tc.placeholder((B, H, S, D), dtype, name="Q")
    K = tc.placeholder((B, H // groups, Sk, D), dtype, name="K")
    V = tc.placeholder((B, H // groups, Sk, D), dtype, name="V")
    ins = [Q, K, V]
    d = tc.reduce_axis(D, name="d")
    scale = 1.0 / math.sqrt(D)
    scores = tc.compute((B, H, S, Sk), lambda b, h, i, j: tc.sum(
        tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h // groups, j, d], "float32"), axis=d) * scale, name="S")
    s = scores
    if bias:
        bias_t = tc.placeholder((B, H, S, Sk), "float32", name="bias")
        ins.append(bias_t)
        s = tc.compute((B, H, S, Sk), lambda b, h, i, j: scores[b, h, i, j] + bias_t[b, h, i, j], name="Sb")
    if causal:
        unmasked = s
        s = tc.compute((B, H, S, Sk), lambda b, h, i, j: tc.where(j <= i, unmasked[b, h, i, j], -math.inf),
                       name="Sm")
    j1, j2, j3 = (tc.reduce_axis(Sk, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((B, H, S), lambda b, h, i: tc.max(s[b, h, i, j1], axis=j1), name="m")
    e = tc.compute((B, H, S, Sk), lambda b, h, i, j: tc.exp(s[b, h, i, j] - m[b, h, i]), name="e")
    l = tc.compute((B, H, S), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
    O = tc.compute((B, H, S, D), lambda b, h, i, c: tc.cast(
        tc.sum(e[b, h, i, j3] * tc.cast(V[b, h // groups, j3, c], "float32"), axis=j3) / l[b, h, i], dtype), name="O")
    outs = [O]
    if lse:
        outs.append(tc.compute((B, H, S), lambda b, h, i: m[b, h, i] + tc.log(l[b, h, i]), name="lse"))
    return ins, outs


def reference(q, k, v, causal=False, bias=None, groups=1):
    """float64 attention and log-sum-exp."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if causal:
        i, j = np.indices(s.shape[-2:])
        s = np.where(j <= i, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", p, v) / l, (m + np.log(l))[..., 0]


def bound(dtype, keys):
    """|tecc - float64| / (1 + |want|) allowed: float32 accumulation (a few ulps per key: the
    scores' dot products, the exps, the rescalings) plus the output's own rounding (half an ulp of
    its dtype, at most eps·|want|)."""
    acc = 2 * keys * np.finfo(np.float32).eps
    return acc + np.finfo(dtype).eps


def run(args, inputs, plan=PLAN):
    k = tc.build(args, target="sim", plan=plan)
    outs = [np.full(tuple(int(x) for x in t.shape), np.nan, t.dtype.name) for t in args if not t.is_placeholder]
    k(*inputs, *outs)  # poisoned: every element must be written
    return k, outs


def check(name, got, want, tol, plan):
    """|got - want| <= tol·(1 + |want|) everywhere: the bound is relative to the value's own scale
    (the output's rounding is relative; the accumulation error scales with |V| ~ 1)."""
    assert np.all(np.isfinite(got)), f"{name}: unwritten or non-finite output at {np.argwhere(~np.isfinite(got))[:3]}"
    err = np.abs(got.astype(np.float64) - want) / (1 + np.abs(want))
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= tol, (f"{name}: worst |diff| / (1 + |want|) {err.max():.3g} > {tol:.3g} at {worst} "
                              f"(got {got[worst]}, want {want[worst]}), plan {plan}")


def inputs_for(ins, rng):
    return [rng.standard_normal(tuple(int(x) for x in t.shape)).astype(t.dtype.name) for t in ins]


VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "bias": {"bias": True},
    "grouped": {"groups": 2},
    "causal_bias_grouped": {"causal": True, "bias": True, "groups": 2},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("S", [37, 64])
def test_attention_matches_float64_numpy(variant, S):
    kw = VARIANTS[variant]
    ins, outs = attention(1, 2, S, 16, **kw)
    rng = np.random.default_rng()
    x = inputs_for(ins, rng)
    k, (o,) = run(ins + outs, x)
    assert len(k.module.kernels) == 1
    want, _ = reference(x[0], x[1], x[2], kw.get("causal", False), x[3] if kw.get("bias") else None,
                        kw.get("groups", 1))
    check(f"attention {variant} S={S}", o, want, bound(np.float32, S), PLAN)


def test_float16_inputs_accumulate_in_float32():
    ins, outs = attention(2, 2, 37, 16, dtype="float16", causal=True)
    rng = np.random.default_rng()
    x = inputs_for(ins, rng)
    _, (o,) = run(ins + outs, x)
    assert o.dtype == np.float16
    want, _ = reference(*x, causal=True)
    check("float16 attention", o, want, bound(np.float16, 37), PLAN)


def test_log_sum_exp_as_a_second_output():
    ins, outs = attention(1, 2, 37, 16, causal=True, lse=True)
    rng = np.random.default_rng()
    x = inputs_for(ins, rng)
    _, (o, lse) = run(ins + outs, x)
    want, want_lse = reference(*x, causal=True)
    check("attention output", o, want, bound(np.float32, 37), PLAN)
    check("log-sum-exp", lse, want_lse, bound(np.float32, 37), PLAN)


def softmax_then_contraction(R, N, C):
    X = tc.placeholder((R, N), "float32", name="X")
    V = tc.placeholder((N, C), "float32", name="V")
    j1, j2, j3 = (tc.reduce_axis(N, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((R,), lambda r: tc.max(X[r, j1], axis=j1), name="m")
    e = tc.compute((R, N), lambda r, j: tc.exp(X[r, j] - m[r]), name="e")
    l = tc.compute((R,), lambda r: tc.sum(e[r, j2], axis=j2), name="l")
    Y = tc.compute((R, C), lambda r, c: tc.sum(e[r, j3] * V[j3, c], axis=j3) / l[r], name="Y")
    return [X, V], [Y]


def test_softmax_then_contraction_without_a_first_contraction():
    ins, outs = softmax_then_contraction(7, 45, 40)  # 40 columns: two column slots per lane, a guarded tail
    rng = np.random.default_rng()
    x, v = (rng.standard_normal(tuple(int(s) for s in t.shape)).astype(np.float32) * 3 for t in ins)
    _, (y,) = run(ins + outs, [x, v])
    x64 = x.astype(np.float64)
    p = np.exp(x64 - x64.max(axis=1, keepdims=True))
    want = (p @ v.astype(np.float64)) / p.sum(axis=1, keepdims=True)
    check("softmax·V", y, want, bound(np.float32, 45), PLAN)


def test_one_kernel_and_no_score_matrix():
    S = 64
    ins, outs = attention(1, 2, S, 16, causal=True)
    mod = online_contraction(ins + outs)
    assert len(mod.kernels) == 1 and not mod.temps
    (kernel,) = mod.kernels
    for st in iter_stmts(kernel.body):
        if isinstance(st, Allocate):
            size = math.prod(int(s) for s in st.buffer.shape)  # type: ignore[arg-type]
            assert size < S * S, f"{st.buffer.name} holds {size} elements: an S x S temporary"


def test_refuses_a_sum_of_exp_without_the_max():
    X = tc.placeholder((4, 8), "float32", name="X")
    V = tc.placeholder((8, 3), "float32", name="V")
    j2, j3 = tc.reduce_axis(8, name="j2"), tc.reduce_axis(8, name="j3")
    l = tc.compute((4,), lambda r: tc.sum(tc.exp(X[r, j2]), axis=j2), name="l")
    Y = tc.compute((4, 3), lambda r, c: tc.sum(tc.exp(X[r, j3]) * V[j3, c], axis=j3) / l[r], name="Y")
    with pytest.raises(ScheduleError, match="no stage is a max"):
        online_chain([X, V, Y])


def test_refuses_a_sum_of_exp_not_shifted_by_the_max():
    X = tc.placeholder((4, 8), "float32", name="X")
    V = tc.placeholder((8, 3), "float32", name="V")
    j1, j2, j3 = (tc.reduce_axis(8, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((4,), lambda r: tc.max(X[r, j1], axis=j1), name="m")
    l = tc.compute((4,), lambda r: tc.sum(tc.exp(X[r, j2] - 1.0), axis=j2), name="l")
    Y = tc.compute((4, 3), lambda r, c: tc.sum(tc.exp(X[r, j3] - m[r]) * V[j3, c], axis=j3) / l[r], name="Y")
    with pytest.raises(ScheduleError, match="sums exp"):
        online_chain([X, V, Y])


def test_refuses_a_contraction_over_another_axis():
    X = tc.placeholder((4, 8), "float32", name="X")
    V = tc.placeholder((4, 8), "float32", name="V")
    j1, j2 = tc.reduce_axis(8, name="j1"), tc.reduce_axis(8, name="j2")
    q = tc.reduce_axis(4, name="q")
    m = tc.compute((4,), lambda r: tc.max(X[r, j1], axis=j1), name="m")
    l = tc.compute((4,), lambda r: tc.sum(tc.exp(X[r, j2] - m[r]), axis=j2), name="l")
    # contracts over the rows q, not over the statistics' axis j (and reads m at another row)
    Y = tc.compute((4, 8), lambda r, c: tc.sum(tc.exp(X[q, c] - m[q]) * V[q, c], axis=q) / l[r], name="Y")
    with pytest.raises(ScheduleError, match="read at its own row"):
        online_chain([X, V, Y])
    # an axis of the statistics' extent, but the summand is not exp(s - m) at the contracted key
    W = tc.placeholder((8, 8), "float32", name="W")
    k = tc.reduce_axis(8, name="k")
    Z = tc.compute((4, 8), lambda r, c: tc.sum(tc.exp(X[r, c] - m[r]) * W[k, c], axis=k) / l[r], name="Z")
    with pytest.raises(ScheduleError, match="does not contract exp"):
        online_contraction([X, W, Z])
    assert propose_online([X, W, Z]) is None


def test_refuses_to_write_the_scores():
    X = tc.placeholder((4, 8), "float32", name="X")
    V = tc.placeholder((8, 3), "float32", name="V")
    j1, j2, j3 = (tc.reduce_axis(8, name=n) for n in ("j1", "j2", "j3"))
    s = tc.compute((4, 8), lambda r, j: X[r, j] * 2.0, name="s")
    m = tc.compute((4,), lambda r: tc.max(s[r, j1], axis=j1), name="m")
    l = tc.compute((4,), lambda r: tc.sum(tc.exp(s[r, j2] - m[r]), axis=j2), name="l")
    Y = tc.compute((4, 3), lambda r, c: tc.sum(tc.exp(s[r, j3] - m[r]) * V[j3, c], axis=j3) / l[r], name="Y")
    with pytest.raises(ScheduleError, match="output and is read"):
        online_chain([X, V, s, Y])


def test_row_statistics_are_outputs_too():
    ins, outs = softmax_then_contraction(5, 33, 8)
    Y = outs[0]
    l = next(t for t in Y.op.input_tensors if t.name == "l")
    rng = np.random.default_rng()
    x, v = (rng.standard_normal(tuple(int(s) for s in t.shape)).astype(np.float32) for t in ins)
    _, (y, l_out) = run(ins + [Y, l], [x, v])
    x64 = x.astype(np.float64)
    p = np.exp(x64 - x64.max(axis=1, keepdims=True))
    check("softmax·V", y, (p @ v.astype(np.float64)) / p.sum(axis=1, keepdims=True), bound(np.float32, 33), PLAN)
    check("sum of exp", l_out, p.sum(axis=1), bound(np.float32, 33), PLAN)


def test_build_proposes_it_and_it_replaces_four_kernels_and_the_score_matrix():
    S = 37
    ins, outs = attention(1, 2, S, 16, causal=True, lse=True)
    unfused = tc.build(ins + outs, target="sim", plan=Plan((), "test", "the stage-per-kernel lowering"))
    assert len(unfused.module.kernels) >= 4
    assert any(math.prod(int(s) for s in t.shape) >= S * S for t in unfused.module.temps)
    rng = np.random.default_rng()
    x = inputs_for(ins, rng)
    k, (o, lse) = run(ins + outs, x, plan="auto")
    assert k.plan.strategy == "online_contraction", k.plan
    assert len(k.module.kernels) == 1 and not k.module.temps and not k.fallbacks
    want, want_lse = reference(*x, causal=True)
    check("auto-planned attention", o, want, bound(np.float32, S), k.plan)
    check("auto-planned log-sum-exp", lse, want_lse, bound(np.float32, S), k.plan)


@pytest.mark.parametrize("D", [96, 256])
def test_wide_heads_in_the_emulator(D):
    ins, outs = attention(1, 1, 21, D, dtype="float16", causal=True)
    rng = np.random.default_rng()
    x = inputs_for(ins, rng)
    _, (o,) = run(ins + outs, x)
    want, _ = reference(*x, causal=True)
    check(f"float16 attention d={D}", o, want, bound(np.float16, 21), PLAN)


def test_symbolic_sequence_length():
    n = tc.var("n")
    ins, outs = softmax_then_contraction(n, n, 8)
    rng = np.random.default_rng()
    for size in (5, 40):
        x = rng.standard_normal((size, size)).astype(np.float32)
        v = rng.standard_normal((size, 8)).astype(np.float32)
        k = tc.build(ins + outs, target="sim", plan=PLAN)
        y = np.full((size, 8), np.nan, np.float32)
        k(x, v, y)
        x64 = x.astype(np.float64)
        p = np.exp(x64 - x64.max(axis=1, keepdims=True))
        check(f"softmax·V n={size}", y, (p @ v.astype(np.float64)) / p.sum(axis=1, keepdims=True),
              bound(np.float32, size), PLAN)


@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_head_dims_compile_with_nvrtc_without_spills(D, dtype):
    from tecc.codegen import compile_cuda, emit_source

    ins, outs = attention(2, 4, 200, D, dtype=dtype, causal=True, groups=2, lse=True)
    mod = online_contraction(ins + outs)
    compiled = compile_cuda(emit_source(mod.kernels), arch="sm_90", name="attention")
    (res,) = compiled.resources.values()
    assert res.spill_stores == 0 and res.spill_loads == 0, res


def test_boolean_mask_tensor_and_more_keys_than_queries():
    B, H, N, Nk, D = 1, 2, 19, 45, 16
    Q = tc.placeholder((B, H, N, D), "float32", name="Q")
    K = tc.placeholder((B, H, Nk, D), "float32", name="K")
    V = tc.placeholder((B, H, Nk, D), "float32", name="V")
    keep = tc.placeholder((B, 1, N, Nk), "bool", name="keep")
    d = tc.reduce_axis(D, name="d")
    j1, j2, j3 = (tc.reduce_axis(Nk, name=n) for n in ("j1", "j2", "j3"))
    s = tc.compute((B, H, N, Nk), lambda b, h, i, j: tc.where(
        keep[b, 0, i, j], tc.sum(Q[b, h, i, d] * K[b, h, j, d], axis=d) * 0.5, -math.inf), name="s")
    m = tc.compute((B, H, N), lambda b, h, i: tc.max(s[b, h, i, j1], axis=j1), name="m")
    l = tc.compute((B, H, N), lambda b, h, i: tc.sum(tc.exp(s[b, h, i, j2] - m[b, h, i]), axis=j2), name="l")
    O = tc.compute((B, H, N, D), lambda b, h, i, c: tc.sum(
        V[b, h, j3, c] * tc.exp(s[b, h, i, j3] - m[b, h, i]), axis=j3) / l[b, h, i], name="O")
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal(tuple(int(x) for x in t.shape)).astype(np.float32) for t in (Q, K, V))
    mask = rng.random((B, 1, N, Nk)) < 0.6
    mask[..., 0] = True  # every row keeps a key (a row with none is 0/0 = NaN, as in NumPy)
    k_, (o,) = run([Q, K, V, keep, O], [q, k, v, mask], plan="auto")
    assert k_.plan.strategy == "online_contraction"
    scores = np.where(mask, np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) * 0.5, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    want = np.einsum("bhij,bhjd->bhid", p, v.astype(np.float64)) / p.sum(axis=-1, keepdims=True)
    check("masked attention", o, want, bound(np.float32, Nk), k_.plan)


def test_golden_cuda_of_causal_half_attention_with_log_sum_exp():
    """The generated CUDA, kept in tests/golden/ (update on purpose with TECC_UPDATE_GOLDEN=1)."""
    import os
    from pathlib import Path

    ins, outs = attention(1, 2, 37, 64, dtype="float16", causal=True, lse=True)
    text = tc.build(ins + outs, target="sim", plan=PLAN).source
    path = Path(__file__).parent / "golden" / "online_attention_causal_f16.cu"
    if os.environ.get("TECC_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with TECC_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"generated CUDA of the online attention kernel changed; diff it against {path}"


def test_the_plan_replays_from_json_and_no_rows_is_no_work():
    ins, outs = softmax_then_contraction(9, 33, 8)
    k = tc.build(ins + outs, target="sim")
    again = tc.build(ins + outs, target="sim", plan=Plan.from_json(k.plan.to_json()))
    assert again.source == k.source and again.plan.steps == k.plan.steps
    empty_ins, empty_outs = softmax_then_contraction(0, 33, 8)
    _, (y,) = run(empty_ins + empty_outs, [np.zeros((0, 33), np.float32), np.zeros((33, 8), np.float32)])
    assert y.shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_attention_on_the_gpu_matches_float64_numpy(variant):
    kw = VARIANTS[variant]
    ins, outs = attention(2, 4, 200, 64, dtype="float16", lse=True, **kw)
    rng = np.random.default_rng()
    x = inputs_for(ins, rng)
    k = tc.build(ins + outs, plan=PLAN)  # the SIMT kernel (tests/test_attention_tensor_core.py: tensor cores)
    assert k.plan.steps[0].primitive == "online_contraction" and len(k.module.kernels) == 1
    o = np.full(tuple(int(s) for s in outs[0].shape), np.nan, np.float16)
    lse = np.full(tuple(int(s) for s in outs[1].shape), np.nan, np.float32)
    k(*x, o, lse)
    want, want_lse = reference(x[0], x[1], x[2], kw.get("causal", False), x[3] if kw.get("bias") else None,
                               kw.get("groups", 1))
    check(f"gpu attention {variant}", o, want, bound(np.float16, 200), k.plan)
    check(f"gpu log-sum-exp {variant}", lse, want_lse, bound(np.float32, 200), k.plan)


def test_whole_key_tiles_masked_before_the_first_kept_key():
    """Rows i >= 32 of an anti-causal mask (keep j >= i) see a first tile of 32 keys that is all
    -inf: the running max stays -inf through it (rescale 1, weights 0) and no NaN appears."""
    N, D = 64, 16
    Q, K, V = (tc.placeholder((1, 1, N, D), "float32", name=n) for n in ("Q", "K", "V"))
    d = tc.reduce_axis(D, name="d")
    j1, j2, j3 = (tc.reduce_axis(N, name=n) for n in ("j1", "j2", "j3"))
    s = tc.compute((1, 1, N, N), lambda b, h, i, j: tc.where(
        j >= i, tc.sum(Q[b, h, i, d] * K[b, h, j, d], axis=d), -math.inf), name="s")
    m = tc.compute((1, 1, N), lambda b, h, i: tc.max(s[b, h, i, j1], axis=j1), name="m")
    l = tc.compute((1, 1, N), lambda b, h, i: tc.sum(tc.exp(s[b, h, i, j2] - m[b, h, i]), axis=j2), name="l")
    O = tc.compute((1, 1, N, D), lambda b, h, i, c: tc.sum(
        tc.exp(s[b, h, i, j3] - m[b, h, i]) * V[b, h, j3, c], axis=j3) / l[b, h, i], name="O")
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 1, N, D)).astype(np.float32) for _ in range(3))
    _, (o,) = run([Q, K, V, O], [q, k, v])
    i, j = np.indices((N, N))
    scores = np.where(j >= i, np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)), -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    want = np.einsum("bhij,bhjd->bhid", p, v.astype(np.float64)) / p.sum(axis=-1, keepdims=True)
    check("anti-causal attention", o, want, bound(np.float32, N), PLAN)


def test_symbolic_batch_and_length_plan_the_online_form_without_sizes():
    """B and S symbolic and not given: the online form is priced at the extents the per-kernel
    plans are (DEFAULT_SIZE), not at NOMINAL_LENGTH, so it is weighed fairly and taken -- before,
    B·H and S² at 8192 priced it ~400x the per-kernel plans', which then stored the (B, H, S, S)
    scores (2^31 elements at B 4, H 32, S 4096)."""
    ins, outs = attention(tc.var("B"), 4, tc.var("S"), 32, "float16")
    f = tc.build(ins + outs, target="sim", arch="sm_90")
    assert f.plan.strategy.startswith("online_contraction"), f.explain()
    assert len(f.module.kernels) == 1, [kern.name for kern in f.module.kernels]
    rng = np.random.default_rng()
    x = [rng.standard_normal((2, 4, 40, 32)).astype(np.float16) for _ in range(3)]
    got = np.full((2, 4, 40, 32), np.nan, np.float16)
    f(*x, got)
    want, _ = reference(*x)
    check("symbolic attention at B 2, S 40", got, want, bound(np.float16, 40), f.plan)
