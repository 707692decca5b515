"""Dropout inside attention: O = Σ_j dropout(P[r, j])·V[j, c] with P = exp(S - m)/l and the mask
drawn from tc.rand, written as ordinary tensor expressions, is recognised by the online
contraction (tecc.ir.online_dropout) and runs as ONE kernel that regenerates the mask from
(seed, offset, the element's linear index) -- the SIMT kernel, mma.sync and wgmma -- matching a
float64 NumPy reference whose mask comes from the independent Philox of tests/test_random.py."""

import math

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.ir.errors import ScheduleError
from tecc.ir.philox import uniform_from_index
from tecc.passes.rewrite.online_contraction import online_chain
from tecc.passes.rewrite.online_contraction_mma import online_contraction_mma

from test_attention_tensor_core import EPSILON, make_inputs, poisoned, wide
from test_online_contraction import check
from test_random import reference_rand

SEED, OFFSET = 0x1234_5678_9ABC, 5


def dropout_attention(B, H, Sq, Sk, D, dtype, p, causal=False, form="normalized", seed_tensor=True, groups=1):
    """Attention with dropout on the probabilities, as users write it. `form`: 'normalized'
    (P = e / l, then where(R < p, 0, P / (1 - p))), 'weights' (the dropout on e, the division by
    l after the contraction) or 'keep_mask' (P times a keep mask where(R < p, 0, 1 / (1 - p)));
    `groups` query heads share a K/V head (K[b, h // groups, j, d])."""
    Q = tc.placeholder((B, H, Sq, D), dtype, name="Q")
    K = tc.placeholder((B, H // groups, Sk, D), dtype, name="K")
    V = tc.placeholder((B, H // groups, Sk, D), dtype, name="V")
    ins = [Q, K, V]
    seed = SEED
    if seed_tensor:
        seed = tc.placeholder((), "int64", name="seed")
        ins.append(seed)
    d = tc.reduce_axis(D, name="d")
    scale = 1.0 / math.sqrt(D)

    def score(b, h, i, j):
        s = tc.sum(tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h // groups, j, d], "float32"), axis=d) * scale
        return tc.where(j <= i, s, -math.inf) if causal else s

    S = tc.compute((B, H, Sq, Sk), score, name="S")
    j1, j2, j3 = (tc.reduce_axis(Sk, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((B, H, Sq), lambda b, h, i: tc.max(S[b, h, i, j1], axis=j1), name="m")
    e = tc.compute((B, H, Sq, Sk), lambda b, h, i, j: tc.exp(S[b, h, i, j] - m[b, h, i]), name="e")
    l = tc.compute((B, H, Sq), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
    R = tc.rand((B, H, Sq, Sk), seed, OFFSET, name="R")
    if form == "normalized":
        P = tc.compute((B, H, Sq, Sk), lambda b, h, i, j: e[b, h, i, j] / l[b, h, i], name="P")
        Pd = tc.compute((B, H, Sq, Sk), lambda b, h, i, j: tc.where(R[b, h, i, j] < p, 0, P[b, h, i, j] / (1 - p)),
                        name="Pd")
        O = tc.compute((B, H, Sq, D), lambda b, h, i, c: tc.cast(
            tc.sum(Pd[b, h, i, j3] * tc.cast(V[b, h // groups, j3, c], "float32"), axis=j3), dtype), name="O")
    elif form == "keep_mask":
        P = tc.compute((B, H, Sq, Sk), lambda b, h, i, j: e[b, h, i, j] / l[b, h, i], name="P")
        mask = tc.compute((B, H, Sq, Sk), lambda b, h, i, j: tc.where(R[b, h, i, j] < p, 0.0, 1 / (1 - p)),
                          name="mask")
        O = tc.compute((B, H, Sq, D), lambda b, h, i, c: tc.cast(
            tc.sum(P[b, h, i, j3] * mask[b, h, i, j3] * tc.cast(V[b, h // groups, j3, c], "float32"), axis=j3), dtype),
            name="O")
    else:
        ed = tc.compute((B, H, Sq, Sk), lambda b, h, i, j: tc.where(R[b, h, i, j] < p, 0, e[b, h, i, j] / (1 - p)),
                        name="ed")
        O = tc.compute((B, H, Sq, D), lambda b, h, i, c: tc.cast(
            tc.sum(ed[b, h, i, j3] * tc.cast(V[b, h // groups, j3, c], "float32"), axis=j3) / l[b, h, i], dtype),
            name="O")
    return ins, [O]


def draws(shape, fast=False):
    """tc.rand's draws of (SEED, OFFSET): the independent pure-Python Philox, or (`fast`, for the
    GPU tests' sizes) the NumPy one the emulator runs, which tests/test_random.py holds to it."""
    if not fast:
        return reference_rand(shape, SEED, OFFSET).astype(np.float32)
    return uniform_from_index(SEED, OFFSET, np.arange(math.prod(shape), dtype=np.int64)).reshape(shape)


def test_fast_draws_are_the_reference_draws():
    assert np.array_equal(draws((2, 3, 17, 19), fast=True), draws((2, 3, 17, 19)))


def reference(given, p, causal, shape, fast=False):
    """float64 dropout attention of the (rounded) inputs; the mask from the independent Philox."""
    q, k, v = given[:3]
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        i, j = np.indices(s.shape[-2:])
        s = np.where(j <= i, s, -np.inf)
    prob = np.exp(s - s.max(axis=-1, keepdims=True))
    prob /= prob.sum(axis=-1, keepdims=True)
    keep = ~(draws(shape, fast) < np.float32(p))
    return (np.where(keep, prob / (1 - p), 0.0) @ v), keep


def bound(dtype, keys, v, p):
    """As the dropout-free bound (tests/test_attention_tensor_core.bound), with the kept weights
    scaled by 1/(1 - p)."""
    eps = EPSILON[dtype]
    return (2 * keys * float(np.finfo(np.float32).eps) + eps + eps / 2 * float(np.abs(v).max())) / (1 - p)


def run(ins, outs, plan, arch, rng, v=None):
    k = tc.build(ins + outs, target="sim", plan=plan, arch=arch)
    x = make_inputs([t for t in ins if t.name != "seed"], rng)
    if v is not None:
        x[2] = v
    args = x + ([np.array(SEED, np.int64)] if any(t.name == "seed" for t in ins) else [])
    got = [poisoned(t) for t in outs]
    k(*args, *got)
    return k, wide(got[0]), [wide(a) for a in x]


PLANS = {
    "simt": (Plan((Step("online_contraction", {"threads": 32, "rows_per_block": 4}),), "test", ""), "sm_80"),
    "mma": (Plan((Step("online_contraction_mma", {"rows_per_block": 64, "key_tile": 32}),), "test", ""), "sm_80"),
    "mma_split_kv": (Plan((Step("online_contraction_mma", {"rows_per_block": 64, "key_tile": 32, "kv_splits": 2}),),
                          "test", ""), "sm_80"),
    "wgmma": (Plan((Step("online_contraction_mma", {"rows_per_block": 64, "key_tile": 64, "wgmma": True}),),
                   "test", ""), "sm_90"),
    "wgmma_persistent": (Plan((Step("online_contraction_mma", {"rows_per_block": 64, "key_tile": 64, "wgmma": True,
                                                                "persistent": 3}),), "test", ""), "sm_90"),
    "wgmma_overlap": (Plan((Step("online_contraction_mma", {"rows_per_block": 64, "key_tile": 64, "wgmma": True,
                                                             "overlap": True}),), "test", ""), "sm_90"),
}


@pytest.mark.parametrize("kernel", sorted(PLANS))
@pytest.mark.parametrize("dtype,p,causal,S", [("float16", 0.1, False, 45), ("bfloat16", 0.5, True, 37),
                                              ("float16", 0.5, True, 70), ("bfloat16", 0.1, False, 33),
                                              ("float16", 0.1, True, 64)])
def test_dropout_attention_matches_float64(kernel, dtype, p, causal, S):
    ins, outs = dropout_attention(1, 2, S, S, 32, dtype, p, causal)
    plan, arch = PLANS[kernel]
    k, got, given = run(ins, outs, plan, arch, np.random.default_rng())
    if kernel == "mma_split_kv":   # the key chunks' partials and their combine kernel
        assert len(k.module.kernels) == 2, k.module
    else:
        assert len(k.module.kernels) == 1 and not k.module.temps, k.module
    want, _ = reference(given, p, causal, (1, 2, S, S))
    check(f"{kernel} dropout attention {dtype} p={p} causal={causal} S={S}", got, want, bound(dtype, S, given[2], p),
          k.plan)


@pytest.mark.parametrize("form", ["weights", "keep_mask"])
def test_other_written_forms(form):
    """The dropout on exp(s - m) with l divided after, and P times a keep mask: the same chain."""
    ins, outs = dropout_attention(1, 2, 41, 41, 32, "float16", 0.1, causal=True, form=form)
    plan, arch = PLANS["mma"]
    k, got, given = run(ins, outs, plan, arch, np.random.default_rng())
    want, _ = reference(given, 0.1, True, (1, 2, 41, 41))
    check(f"dropout attention written as {form}", got, want, bound("float16", 41, given[2], 0.1), k.plan)


@pytest.mark.parametrize("kernel,S", [("mma", 32), ("mma", 33), ("wgmma", 32), ("wgmma_overlap", 35), ("simt", 33),
                                      ("mma_split_kv", 36), ("wgmma_persistent", 70)])
def test_mask_is_tc_rand_bit_for_bit(kernel, S):
    """V = the identity on the first 32 keys (the rest zero): O[r, c] is the dropped probability
    of key c, zero exactly where the kernel dropped it; the zeros are where tc.rand's own draws
    (built and run as a tensor) and the independent Philox say, element for element. An odd
    length puts odd rows' pairs of keys across two counter groups (the per-element branch)."""
    p, D = 0.5, 32
    ins, outs = dropout_attention(1, 2, S, S, D, "float16", p)
    v = np.zeros((1, 2, S, D), np.float16)
    v[:, :, :D, :] = np.eye(D, dtype=np.float16)
    plan, arch = PLANS[kernel]
    _, got, _ = run(ins, outs, plan, arch, np.random.default_rng(), v=v)
    seed = tc.placeholder((), "int64", name="seed")
    R = tc.rand((1, 2, S, S), seed, OFFSET, name="R")
    draws = np.full((1, 2, S, S), np.nan, np.float32)
    tc.build([seed, R], target="sim")(np.array(SEED, np.int64), draws)
    tc_keep = ~(draws < np.float32(p))
    assert np.array_equal(tc_keep, ~(reference_rand((1, 2, S, S), SEED, OFFSET).astype(np.float32) < p))
    assert np.all(np.isfinite(got))
    want = tc_keep[..., :D]
    assert np.array_equal(got != 0, want), f"{kernel}: {np.sum((got != 0) != want)} elements differ"


def test_symbolic_length_and_a_constant_seed():
    N = tc.var("N")
    ins, outs = dropout_attention(1, 2, N, N, 32, "float16", 0.1, causal=True, seed_tensor=False)
    plan, arch = PLANS["mma"]
    k = tc.build(ins + outs, target="sim", plan=plan, arch=arch)
    assert len(k.module.kernels) == 1
    for n in (29, 64, 66):   # odd (per element on odd rows), a multiple of 4 (four per call), even (pairs)
        rng = np.random.default_rng()
        x = [rng.standard_normal((1, 2, n, 32)).astype(np.float16) for _ in range(3)]
        got = np.full((1, 2, n, 32), np.nan, np.float16)
        k(*x, got)
        want, _ = reference([a.astype(np.float64) for a in x], 0.1, True, (1, 2, n, n))
        check(f"symbolic N={n}", got.astype(np.float64), want, bound("float16", n, x[2], 0.1), k.plan)


def test_chain_records_the_dropout():
    ins, outs = dropout_attention(1, 2, 40, 40, 32, "float16", 0.25)
    chain = online_chain(ins + outs)
    assert chain.dropout is not None and chain.dropout.scale == pytest.approx(1 / 0.75)
    plain = dropout_attention(1, 2, 40, 40, 32, "float16", 0.25)
    assert online_chain(plain[0] + plain[1]).dropout is not None
    mod = online_contraction_mma(ins + outs, 64, 32)
    assert len(mod.kernels) == 1 and "rand(" in str(mod.kernels[0])


def test_mask_not_from_rand_is_refused_saying_why():
    """A where on the probabilities whose condition reads a tensor (not tc.rand) is no dropout
    the kernels can regenerate; the recognizer says so."""
    B, H, S, D = 1, 2, 16, 32
    Q, K, V = (tc.placeholder((B, H, S, D), "float16", name=n) for n in "QKV")
    keep = tc.placeholder((B, H, S, S), "bool", name="keep")
    d = tc.reduce_axis(D, name="d")
    Sc = tc.compute((B, H, S, S), lambda b, h, i, j: tc.sum(
        tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h, j, d], "float32"), axis=d), name="S")
    j1, j2, j3 = (tc.reduce_axis(S, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((B, H, S), lambda b, h, i: tc.max(Sc[b, h, i, j1], axis=j1), name="m")
    e = tc.compute((B, H, S, S), lambda b, h, i, j: tc.exp(Sc[b, h, i, j] - m[b, h, i]), name="e")
    l = tc.compute((B, H, S), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
    Pd = tc.compute((B, H, S, S), lambda b, h, i, j: tc.where(keep[b, h, i, j], e[b, h, i, j] / l[b, h, i], 0),
                    name="Pd")
    O = tc.compute((B, H, S, D), lambda b, h, i, c: tc.sum(Pd[b, h, i, j3] * tc.cast(V[b, h, j3, c], "float32"),
                                                         axis=j3), name="O")
    with pytest.raises(ScheduleError, match="draws no tc.rand"):
        online_chain([Q, K, V, keep, O])


# ---- the backward -------------------------------------------------------------------------------

def backward_reference(given, do, o_saved, p, causal, eps, fast=False):
    """float64 dQ, dK, dV of dropout attention and a bound per element (as
    tests/test_attention_backward.gradients: P, dS rounded to 16 bits before their mma, each
    output rounded once), the mask from the independent Philox:
    dV = Σ_r drop(P)·dO, dP = keep·(dO·Vᵀ)/(1 - p), Δ = Σ_c dO·O, dS = P·(dP - Δ)."""
    q, k, v = given[:3]
    B, H, S, D = q.shape
    groups = H // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)

    def per_kv(a):   # dK, dV: summed over the query heads of a K/V head
        return a.reshape(B, H // groups, groups, *a.shape[2:]).sum(2)
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(D)
    if causal:
        i, j = np.indices((S, S))
        s = np.where(j <= i, s, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    keep = ~(draws((B, H, S, S), fast) < np.float32(p))
    scale, sm = 1.0 / (1 - p), 1.0 / math.sqrt(D)
    dropped = np.where(keep, prob * scale, 0.0)
    o_saved = o_saved.astype(np.float64)
    dp = np.where(keep, do @ np.swapaxes(v, -1, -2) * scale, 0.0)
    delta = (do * o_saved).sum(-1, keepdims=True)
    ds = prob * (dp - delta)
    mag = prob * (scale * (np.abs(do) @ np.swapaxes(np.abs(v), -1, -2)) + (np.abs(do) * np.abs(o_saved)).sum(
        -1, keepdims=True))
    dq, dk, dv = ds @ k * sm, per_kv(np.swapaxes(ds, -1, -2) @ q) * sm, per_kv(np.swapaxes(dropped, -1, -2) @ do)
    sub = 2.0 ** -24 if eps == EPSILON["float16"] else 0.0
    nz = (prob > 0).astype(np.float64)
    return [(dq, eps * (sm * mag @ np.abs(k) + np.abs(dq)) + sub * (1 + sm * nz @ np.abs(k))),
            (dk, eps * (sm * per_kv(np.swapaxes(mag, -1, -2) @ np.abs(q)) + np.abs(dk))
             + sub * (1 + sm * per_kv(np.swapaxes(nz, -1, -2) @ np.abs(q)))),
            (dv, eps * (per_kv(np.swapaxes(dropped, -1, -2) @ np.abs(do)) + np.abs(dv))
             + sub * (1 + scale * per_kv(np.swapaxes(nz, -1, -2) @ np.abs(do))))]


def check_bound(what, got, want, bound):
    got = got.astype(np.float64)
    err = np.where(np.isnan(got), np.inf, np.abs(got - want) - bound)
    if (err > 0).any():
        i = np.unravel_index(np.argmax(err), err.shape)
        raise AssertionError(f"{what}: {(err > 0).sum()} of {err.size} elements off; worst at {i}: got {got[i]}, "
                             f"want {want[i]} (bound {bound[i]:.3g})")


BACKWARD_PLANS = {
    "mma_atomic": ({"key_tile": 32, "rows": 32, "dq_columns": 16}, "sm_80"),
    "mma_dq_kernel": ({"key_tile": 32, "rows": 32, "dq": "kernel", "dq_rows": 32, "dq_key_tile": 32}, "sm_80"),
    "wgmma_atomic": ({"key_tile": 128, "rows": 64, "dq_columns": 32, "wgmma": True}, "sm_90"),
    "wgmma_dq_kernel": ({"key_tile": 128, "rows": 32, "dq": "kernel", "dq_rows": 128, "dq_key_tile": 64,
                         "wgmma": True}, "sm_90"),
}


def run_backward(S, dtype, p, causal, form, groups=1):
    """tc.grad of dropout attention, built by the online backward rewrite (the plan `form`), run
    on fresh inputs with O and the log-sum-exp saved by tecc's forward kernel and every gradient
    NaN-poisoned; checked against backward_reference."""
    ins, outs = dropout_attention(1, 2 * groups, S, S, 32, dtype, p, causal, groups=groups)
    wrt = [t for t in ins if t.dtype.is_float]
    g = tc.grad(outs[0], wrt)
    assert g.saved and "FlashAttention-2" in g.form, g.form
    args, arch = BACKWARD_PLANS[form]
    rng = np.random.default_rng()
    x = make_inputs(wrt, rng)
    by_name = {**dict(zip((t.name for t in wrt), x)), "seed": np.array(SEED, np.int64)}
    given = [by_name[t.name] for t in g.inputs]
    fk = tc.build(list(g.forward), target="sim", arch=arch)
    o, lse = poisoned(g.forward[-2]), poisoned(g.forward[-1])
    fk(*given, o, lse)
    do = rng.standard_normal(o.shape).astype(np.float32).astype(x[0].dtype)
    k = tc.build(g.args, target="sim", arch=arch, plan=Plan((Step("online_backward_mma", args),), "test", ""))
    assert len(k.module.kernels) <= 3, [f.name for f in k.module.kernels]
    for t in k.module.temps:   # no (rows x keys) buffer: Δ and dQ's float32 accumulator
        assert math.prod(int(s) for s in t.shape) <= 2 * groups * S * 32, (t.name, t.shape)
    grads = [poisoned(t) for t in g.grads]
    k(*given, o, lse, do, *grads)
    want = backward_reference([wide(a) for a in x], do.astype(np.float64), o, p, causal, EPSILON[dtype])
    for t, got, (w, b) in zip(g.grads, grads, want):
        check_bound(f"{t.name} of dropout attention S={S} {dtype} p={p} causal={causal} {form}", got, w, b)
    return k


@pytest.mark.parametrize("form", sorted(BACKWARD_PLANS))
@pytest.mark.parametrize("dtype,p,causal,S", [("float16", 0.1, True, 45), ("bfloat16", 0.5, False, 37),
                                              ("float16", 0.5, True, 64), ("bfloat16", 0.1, False, 48)])
def test_dropout_attention_backward_matches_float64(form, dtype, p, causal, S):
    """Odd lengths draw per element; lengths that are multiples of 4 share one draw per four
    elements through shuffles (online_backward_dropout)."""
    run_backward(S, dtype, p, causal, form)


@pytest.mark.parametrize("p,causal", [(0.5, True), (0.1, False)])
def test_dropout_backward_kernel_count_planned(p, causal):
    """plan="auto" takes the online backward (at most three kernels) for dropout attention too."""
    ins, outs = dropout_attention(1, 2, 64, 64, 32, "float16", p, causal)
    g = tc.grad(outs[0], [t for t in ins if t.dtype.is_float])
    k = tc.build(g.args, target="sim", arch="sm_80")
    assert k.plan.steps[0].primitive == "online_backward_mma", k.plan
    assert len(k.module.kernels) <= 3


# ---- NVRTC: the benchmark's programs compile without spills -----------------------------------------

def benchmark_program(d, causal):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.attention_dropout import dropout_attention as program
    return program(2048 // d, d, "float16", causal, 0.1)


@pytest.mark.parametrize("d,causal,arch", [(64, False, "sm_80"), (128, True, "sm_80"), (64, True, "sm_90"),
                                           (128, False, "sm_90")])
def test_benchmark_programs_compile_without_spills(d, causal, arch):
    """benchmarks/attention_dropout.py's forward (one online kernel) and backward (at most three
    kernels) as planned for the GPU, B and S symbolic: ptxas without spills, the mask's Philox in
    the kernels (no rand tensor among the temporaries)."""
    from nvrtc_checks import skip_without_nvrtc
    skip_without_nvrtc(arch)
    from benchmarks.attention_dropout import PLANNED_SIZES
    ins, O = benchmark_program(d, causal)
    fwd = tc.build(ins + [O], target="cuda", arch=arch, sizes=PLANNED_SIZES)
    assert fwd.plan.strategy == "online_contraction_mma" and len(fwd.module.kernels) == 1, fwd.plan
    g = tc.grad(O, ins[:3])
    bwd = tc.build(g.args, target="cuda", arch=arch, sizes=PLANNED_SIZES)
    assert bwd.plan.strategy == "online_backward_mma" and len(bwd.module.kernels) <= 3, bwd.plan
    for k in (fwd, bwd):
        assert "tecc_philox4x32_10" in k.source
        for name, res in k.resources.items():
            assert res.spill_stores == 0 and res.spill_loads == 0 and res.registers <= 255, (name, res)


# ---- on a GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B,H,S,D,dtype,causal,p", [(2, 4, 333, 64, "float16", True, 0.1),
                                                    (1, 8, 1024, 128, "bfloat16", False, 0.1),
                                                    (2, 2, 512, 64, "float16", False, 0.5)])
def test_dropout_attention_on_the_gpu(B, H, S, D, dtype, causal, p):
    """The planned forward (one kernel) and backward (at most three) on the GPU against float64
    NumPy with the mask of tc.rand's definition; the forward's zeros with V = the identity are the
    dropped keys exactly (the GPU's Philox is the emulator's, bit for bit)."""
    import torch

    from gpu_checks import check_on_gpu
    ins, outs = dropout_attention(B, H, S, S, D, dtype, p, causal)
    fwd = tc.build(ins + outs, target="cuda")
    assert fwd.plan.strategy == "online_contraction_mma" and len(fwd.module.kernels) == 1, fwd.plan
    g = tc.grad(outs[0], ins[:3])
    gf, bwd = tc.build(list(g.forward), target="cuda"), tc.build(g.args, target="cuda")
    assert bwd.plan.steps[0].primitive == "online_backward_mma" and len(bwd.module.kernels) <= 3, bwd.plan
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(np.random.SeedSequence().entropy % 2**63)
    q, k, v = (torch.randn((B, H, S, D), device="cuda", generator=gen).to(tdt) for _ in range(3))
    seed = torch.tensor(SEED, dtype=torch.int64, device="cuda")
    o = torch.full((B, H, S, D), float("nan"), device="cuda", dtype=tdt)
    fwd(q, k, v, seed, o)
    x = [t.double().cpu().numpy() for t in (q, k, v)]
    want, _ = reference(x, p, causal, (B, H, S, S), fast=True)
    check_on_gpu(o, torch.from_numpy(want).cuda(), torch.from_numpy(bound(dtype, S, x[2], p) * (1 + np.abs(want))).cuda(),
                 f"forward B{B} H{H} S{S} d{D} {dtype} causal={causal} p={p}")
    o2, lse = torch.full_like(o, float("nan")), torch.full((B, H, S), float("nan"), device="cuda")
    by_name = {"Q": q, "K": k, "V": v, "seed": seed}
    gf(*[by_name[t.name] for t in g.inputs], o2, lse)
    do = torch.randn((B, H, S, D), device="cuda", generator=gen).to(tdt)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    bwd(*[by_name[t.name] for t in g.inputs], o2, lse, do, *grads)
    refs = backward_reference(x, do.double().cpu().numpy(), o2.float().cpu().numpy(), p, causal, EPSILON[dtype],
                              fast=True)
    for name, got, (w, b) in zip("QKV", grads, refs):
        check_on_gpu(got, torch.from_numpy(w).cuda(), torch.from_numpy(b).cuda(),
                     f"d{name} B{B} H{H} S{S} d{D} {dtype} causal={causal} p={p}")
    if S >= D:   # the mask exactly: V = the identity on the first D keys, the rest zero
        eye = torch.zeros((B, H, S, D), device="cuda", dtype=tdt)
        eye[:, :, :D, :] = torch.eye(D, device="cuda", dtype=tdt)
        fwd(q, k, eye, seed, o)
        keep = ~(draws((B, H, S, S), fast=True) < np.float32(p))[..., :D]
        reachable = np.ones_like(keep) if not causal else (np.arange(D)[None, :] <= np.arange(S)[:, None])
        got = o.float().cpu().numpy() != 0
        assert np.array_equal(got, keep & reachable), f"{np.sum(got != (keep & reachable))} mask elements differ"


@pytest.mark.parametrize("arch,args", [("sm_80", {"rows_per_block": 64, "key_tile": 64}),
                                       ("sm_90", {"rows_per_block": 64, "key_tile": 64, "wgmma": True})])
def test_philox_calls_per_two_and_four_keys(arch, args, monkeypatch):
    """Elements 2h, 2h + 1 of the C fragment (keys c, c + 1 of a row, c even) share one Philox
    call: the second index is written n0 | 1, and NVVM computes the two inlined calls once; with
    the length a multiple of 4, a lane pair shares a group through a shuffle. The PTX mul.hi
    count against the per-element form: a half with pairs, a quarter with groups of four."""
    import re

    from nvrtc_checks import skip_without_nvrtc
    from tecc.codegen import compile_cuda, emit_source
    from tecc.passes.rewrite.online_mma_dropout import DroppedWeights
    skip_without_nvrtc(arch)
    ins, outs = dropout_attention(2, 4, 1024, 1024, 64, "float16", 0.1)

    def mul_hi() -> int:
        mod = online_contraction_mma(ins + outs, **args)
        return len(re.findall(r"mul\.hi\.u32", compile_cuda(emit_source(mod.kernels), arch=arch, name="drop").ptx))
    four = mul_hi()
    monkeypatch.setattr(DroppedWeights, "quad_extent", lambda self: None)
    paired = mul_hi()
    monkeypatch.setattr(DroppedWeights, "pair_form", lambda self: None)
    alone = mul_hi()
    # 153, 305, 577 at 64 x 64 on sm_80 (20 mul.hi per call)
    assert 20 <= four and 1.8 * four <= paired and 1.8 * paired <= alone, (four, paired, alone)


def _weights_program(weight_of):
    """Attention whose contraction weight is weight_of(e, l, R, b, h, i, j) (for the refusals)."""
    B, H, S, D = 1, 2, 16, 32
    Q, K, V = (tc.placeholder((B, H, S, D), "float16", name=n) for n in "QKV")
    d = tc.reduce_axis(D, name="d")
    Sc = tc.compute((B, H, S, S), lambda b, h, i, j: tc.sum(
        tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h, j, d], "float32"), axis=d), name="S")
    j1, j2, j3 = (tc.reduce_axis(S, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((B, H, S), lambda b, h, i: tc.max(Sc[b, h, i, j1], axis=j1), name="m")
    e = tc.compute((B, H, S, S), lambda b, h, i, j: tc.exp(Sc[b, h, i, j] - m[b, h, i]), name="e")
    l = tc.compute((B, H, S), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
    R = tc.rand((B, H, S, S), 7, 0, name="R")
    W = tc.compute((B, H, S, S), lambda b, h, i, j: weight_of(e, l, R, b, h, i, j), name="W")
    O = tc.compute((B, H, S, D), lambda b, h, i, c: tc.sum(W[b, h, i, j3] * tc.cast(V[b, h, j3, c], "float32"),
                                                         axis=j3), name="O")
    return [Q, K, V, O]


@pytest.mark.parametrize("weight_of,why", [
    (lambda e, l, R, b, h, i, j: tc.where(R[b, h, i, j] < 0.01 * l[b, h, i], 0, e[b, h, i, j] / l[b, h, i]),
     "reads a row statistic"),
    (lambda e, l, R, b, h, i, j: e[b, h, i, j] / l[b, h, i] * 2.0, "does not contract"),
    (lambda e, l, R, b, h, i, j: tc.where(R[b, h, i, j] < 0.1, 0, e[b, h, i, j] / l[b, h, i] / l[b, h, i]),
     "does not contract"),
])
def test_refusals_name_the_failing_condition(weight_of, why):
    """A mask drawn with a row statistic, a constant factor without a mask, P divided by l twice."""
    with pytest.raises(ScheduleError, match=why):
        online_chain(_weights_program(weight_of))


@pytest.mark.parametrize("form", ["mma_atomic", "wgmma_dq_kernel"])
@pytest.mark.parametrize("S", [40, 41])
def test_grouped_heads(form, S):
    """Two query heads per K/V head (K[b, h // 2, j, d]), the rand tensor of the query heads:
    the forward and the backward (dK, dV summed over the group)."""
    ins, outs = dropout_attention(1, 4, S, S, 32, "bfloat16", 0.1, True, groups=2)
    plan, arch = PLANS["mma"]
    k, got, given = run(ins, outs, plan, arch, np.random.default_rng())
    want, _ = reference(given, 0.1, True, (1, 4, S, S))
    check(f"grouped dropout attention S={S}", got, want, bound("bfloat16", S, given[2], 0.1), k.plan)
    run_backward(S, "bfloat16", 0.1, True, form, groups=2)
