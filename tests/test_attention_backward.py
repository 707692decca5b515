"""The backward of attention (docs/training.md, "The backward of attention"): tc.grad of the
attention program users write is the FlashAttention-2 form (the forward saves O and its
log-sum-exp), found by structure, and build() turns it into at most three tensor-core kernels
with no (rows x keys) buffer (tecc.passes.rewrite.online_backward_mma). Checked in the emulator
against float64 NumPy on fresh random float16/bfloat16 inputs with NaN-poisoned outputs, with an
error bound per element derived from the dtypes (below); NVRTC compile checks; GPU tests against
torch's SDPA backward."""

import math

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.ir.errors import ScheduleError
from tecc.ir.stmt import Allocate, For, MatrixMultiply, WarpgroupMatrixMultiply, iter_stmts
from tecc.passes.rewrite.online_backward import backward_chain

from nvrtc_checks import skip_without_nvrtc
from planning import choose
from test_attention_tensor_core import keep_mask, make_inputs, masked_attention, poisoned

EPSILON = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}   # the ulp at 1 (twice the rounding error)


def plan(key_tile=32, rows=32, dq_columns=16):
    return Plan((Step("online_backward_mma", {"key_tile": key_tile, "rows": rows, "dq_columns": dq_columns}),),
                "test", "")


def forward_reference(x, groups, mask, bias):
    """float64 scores' probabilities P, O and the log-sum-exp of the (rounded) inputs."""
    q, k, v = (a.astype(np.float64) for a in x[:3])
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    rest = list(x[3:])
    if bias:
        s = s + rest.pop(0).astype(np.float64)
    keep = keep_mask(mask, s.shape[-2], s.shape[-1], rest.pop(0) if mask == "tensor" else None)
    s = np.where(keep, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    e = np.exp(s - mx)
    total = e.sum(axis=-1, keepdims=True)
    return e / total, (e / total) @ v, (mx + np.log(total))[..., 0]


def gradients(x, do, o_saved, groups, mask, bias, eps):
    """float64 dQ, dK, dV (and dBias) and the bound on each element: P and dS are rounded to the
    operands' dtype before the mma that uses them (half an ulp), Δ is taken from the saved O
    (rounded to its dtype), each output is rounded once: with magnitudes taken over |terms|,
    |error| <= eps·(scale·|dS|-magnitude·|X| + |result|), eps the dtype's ulp (a factor 2 over
    the rounding error covers the float32 sums)."""
    q, k, v = (a.astype(np.float64) for a in x[:3])
    do = do.astype(np.float64)
    kk, vv = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    p, o, _ = forward_reference(x, groups, mask, bias)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dp = do @ np.swapaxes(vv, -1, -2)
    delta = (do * o).sum(-1, keepdims=True)
    ds = p * (dp - delta)
    mag = p * (np.abs(do) @ np.swapaxes(np.abs(vv), -1, -2) + (np.abs(do) * np.abs(o_saved.astype(np.float64))).sum(
        -1, keepdims=True))
    pt, dst, magt = (np.swapaxes(a, -1, -2) for a in (p, ds, mag))

    def per_kv(a):
        B, H = a.shape[:2]
        return a.reshape(B, H // groups, groups, *a.shape[2:]).sum(2)

    dq, dk, dv = ds @ kk * scale, per_kv(dst @ q) * scale, per_kv(pt @ do)
    # float16's subnormals (below 2^-14) are 2^-24 apart: P, dS and the outputs rounded there are
    # off by that much in absolute terms, not relative ones
    sub = 2.0 ** -24 if eps == EPSILON["float16"] else 0.0
    kept = (p > 0).astype(np.float64)
    out = [(dq, eps * (scale * mag @ np.abs(kk) + np.abs(dq)) + sub * (1 + scale * kept @ np.abs(kk))),
           (dk, eps * (scale * per_kv(magt @ np.abs(q)) + np.abs(dk)) + sub * (1 + scale * per_kv(kept.swapaxes(-1, -2)
                                                                                                 @ np.abs(q)))),
           (dv, eps * (per_kv(pt @ np.abs(do)) + np.abs(dv)) + sub * (1 + per_kv(kept.swapaxes(-1, -2) @ np.abs(do))))]
    if bias:
        out.append((ds, eps * p * (np.abs(do) * np.abs(o_saved.astype(np.float64))).sum(-1, keepdims=True) + 1e-6))
    return out


def check(what, got, want, bound):
    got = got.astype(np.float64)
    err = np.where(np.isnan(got), np.inf, np.abs(got - want) - bound)
    if (err > 0).any():
        i = np.unravel_index(np.argmax(err), err.shape)
        raise AssertionError(f"{what}: {(err > 0).sum()} of {err.size} elements off; worst at {i}: got {got[i]}, "
                             f"want {want[i]} (bound {bound[i]:.3g})")


def no_score_buffer(k, B, H, Sq, Sk, D):
    """The built module holds no (rows x keys) buffer: its temporaries are the row statistics
    and dQ's float32 accumulator (O(S·d)), its shared tiles independent of the lengths."""
    for t in k.module.temps:
        n = math.prod(int(s) for s in t.shape)
        assert n <= B * H * Sq * D, (t.name, t.shape)
    for f in k.module.kernels:
        for s in iter_stmts(f.body):
            if isinstance(s, Allocate) and s.buffer.scope == "shared":
                assert all(int(x) <= 256 for x in s.buffer.shape), (f.name, s.buffer.name, s.buffer.shape)


def run_backward(B, H, Sq, Sk, D, dtype, groups=1, mask=None, bias=False, the_plan=None, arch="sm_80",
                 forward="reference"):
    """Build tc.grad's backward of the attention program, run it on fresh inputs (the saved O and
    log-sum-exp from the float64 forward, or from tecc's forward kernel) and check every
    gradient; returns the built kernel."""
    ins, outs = masked_attention(B, H, Sq, Sk, D, dtype, groups=groups, mask=mask, bias=bias)
    wrt = [t for t in ins if t.dtype.is_float]
    g = tc.grad(outs[0], wrt)
    assert g.saved and "FlashAttention-2" in g.form, g.form
    rng = np.random.default_rng()
    x = make_inputs(ins, rng)
    given = [dict(zip((t.name for t in ins), x))[t.name] for t in g.inputs]   # the order tc.grad found them
    if forward == "tecc":
        fk = tc.build(list(g.forward), target="sim", arch=arch)
        o, lse = poisoned(g.forward[-2]), poisoned(g.forward[-1])
        fk(*given, o, lse)
    else:
        _, o64, lse64 = forward_reference(x, groups, mask, bias)
        o, lse = o64.astype(x[0].dtype), lse64.astype(np.float32)
    do = rng.standard_normal(o.shape).astype(np.float32).astype(x[0].dtype)
    k = tc.build(g.args, target="sim", arch=arch, plan=the_plan or "auto")
    assert k.plan.steps[0].primitive == "online_backward_mma", k.plan
    assert len(k.module.kernels) <= 3, [f.name for f in k.module.kernels]
    main = [f for f in k.module.kernels if f.name.endswith("_backward_mma_kernel")]
    assert len(main) == 1 and any(isinstance(s, (MatrixMultiply, WarpgroupMatrixMultiply))
                                  for s in iter_stmts(main[0].body))
    no_score_buffer(k, B, H, Sq, Sk, D)
    grads = [poisoned(t) for t in g.grads]
    k(*given, o, lse, do, *grads)
    eps = EPSILON[dtype]
    for t, got, (want, bound) in zip(g.grads, grads, gradients(x, do, o, groups, mask, bias, eps)):
        check(f"{t.name} of attention B{B} H{H} Sq{Sq} Sk{Sk} d{D} {dtype} G{groups} {mask}{' bias' if bias else ''} "
              f"({k.plan.steps[0].args})", got, want, bound)
    return k


CASES = {
    "plain": dict(Sq=64, Sk=64, D=32, dtype="float16"),
    "causal_odd": dict(Sq=45, Sk=45, D=32, dtype="float16", mask="causal"),
    "causal_bf16": dict(Sq=80, Sk=80, D=32, dtype="bfloat16", mask="causal"),
    "grouped_2": dict(Sq=50, Sk=50, D=16, dtype="float16", groups=2, mask="causal"),
    "grouped_4_bf16": dict(Sq=40, Sk=40, D=16, dtype="bfloat16", groups=4),
    "decode_like": dict(Sq=8, Sk=100, D=32, dtype="float16"),
    "bottom_right": dict(Sq=24, Sk=90, D=32, dtype="float16", mask="bottom_right"),
    "more_queries": dict(Sq=70, Sk=33, D=16, dtype="bfloat16", mask="causal"),
    # keys past every query under the mask: key blocks with no query block (dK, dV zero there)
    "more_keys": dict(Sq=40, Sk=150, D=16, dtype="float16", mask="causal"),
    "mask_tensor": dict(Sq=40, Sk=40, D=16, dtype="float16", mask="tensor"),
    "bias_causal": dict(Sq=40, Sk=40, D=16, dtype="float16", mask="causal", bias=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_backward_matches_float64_numpy(case):
    kw = dict(CASES[case])
    H = 2 * kw.get("groups", 1)
    run_backward(1, H, the_plan=plan(), **kw)


@pytest.mark.parametrize("case", ["causal_odd", "grouped_4_bf16", "decode_like", "bottom_right", "bias_causal"])
def test_dq_by_the_query_major_kernel(case):
    """dQ by the query-major kernel (online_backward_dq) instead of atomics: no float32
    accumulator, no conversion, the same bounds."""
    kw = dict(CASES[case])
    the_plan = Plan((Step("online_backward_mma", {"key_tile": 32, "rows": 32, "dq": "kernel", "dq_rows": 32,
                                                  "dq_key_tile": 32}),), "test", "")
    k = run_backward(1, 2 * kw.get("groups", 1), the_plan=the_plan, **kw)
    names = [f.name for f in k.module.kernels]
    assert any(n.endswith("_backward_rows_kernel") for n in names), names
    assert not any(n.endswith("_convert_kernel") for n in names), names
    assert [t.name for t in k.module.temps] == ["O_delta"], k.module.temps


WGMMA_PLANS = {
    "atomic_2wg": {"key_tile": 128, "rows": 64, "dq_columns": 32, "wgmma": True},
    "atomic_1wg": {"key_tile": 64, "rows": 64, "dq_columns": 32, "wgmma": True},
    "kernel": {"key_tile": 128, "rows": 32, "dq": "kernel", "dq_rows": 128, "dq_key_tile": 64, "wgmma": True},
    # one warpgroup per block in both kernels: the first form tried on sm_90 at d <= 64
    "narrow": {"key_tile": 64, "rows": 64, "dq": "kernel", "dq_rows": 64, "dq_key_tile": 64, "wgmma": True},
    # the same with each step's dV/dK wgmmas in flight into the next step
    "overlap": {"key_tile": 64, "rows": 64, "dq": "kernel", "dq_rows": 64, "dq_key_tile": 64, "wgmma": True,
                "overlap": True},
}


@pytest.mark.parametrize("case,form", [("causal_odd", "atomic_2wg"), ("grouped_4_bf16", "atomic_1wg"),
                                       ("bias_causal", "kernel"), ("decode_like", "kernel"),
                                       ("bottom_right", "atomic_2wg"), ("mask_tensor", "kernel"),
                                       ("causal_odd", "narrow"), ("grouped_4_bf16", "narrow"),
                                       ("causal_odd", "overlap"), ("grouped_4_bf16", "overlap"),
                                       ("more_queries", "overlap"), ("decode_like", "overlap"),
                                       ("more_keys", "narrow"), ("more_keys", "overlap")])
def test_hopper_form_matches_float64_numpy(case, form):
    """The wgmma kernels (online_backward_wgmma): a warpgroup per 64 keys (and per 64 query rows
    in the query-major dQ kernel), the same elementwise stage, in the emulator."""
    kw = dict(CASES[case])
    the_plan = Plan((Step("online_backward_mma", WGMMA_PLANS[form]),), "test", "")
    k = run_backward(1, 2 * kw.get("groups", 1), the_plan=the_plan, arch="sm_90", **kw)
    main = next(f for f in k.module.kernels if f.name.endswith("_backward_mma_kernel"))
    assert any(isinstance(s, WarpgroupMatrixMultiply) for s in iter_stmts(main.body))
    assert dict(main.attrs)["tensorize"].startswith("wgmma"), dict(main.attrs)["tensorize"]


@pytest.mark.parametrize("stages,arch", [(3, "sm_90"), (4, "sm_90"), (3, "sm_80")])
def test_ring_of_query_blocks_three_and_four_deep(stages, arch):
    """The key-block-major kernel's ring of `stages` query blocks (stages - 1 in flight beyond the
    one computed; the step's `stages`), on wgmma and on mma.sync with dQ by atomics: causal,
    lengths that leave a partial last block and key blocks with fewer query blocks than the ring
    is deep; the emulator checks every cp.async against its wait and barrier."""
    base = WGMMA_PLANS["narrow"] if arch == "sm_90" else {"key_tile": 64, "rows": 32, "dq_columns": 32}
    form = dict(base, stages=stages)
    k = run_backward(1, 2, 150, 150, 64, "bfloat16", mask="causal", arch=arch,
                     the_plan=Plan((Step("online_backward_mma", form),), "test", ""))
    assert k.plan.steps[0].args["stages"] == stages
    main = next(f for f in k.module.kernels if f.name.endswith("_backward_mma_kernel"))
    assert f"{stages}-stage cp.async ring" in dict(main.attrs)["tensorize"]


def test_ring_depth_outside_two_to_four_is_refused():
    ins, outs = masked_attention(1, 2, 64, 64, 64, "bfloat16", mask="causal")
    g = tc.grad(outs[0], [t for t in ins if t.dtype.is_float])
    bad = Plan((Step("online_backward_mma", dict(WGMMA_PLANS["narrow"], stages=5)),), "test", "")
    with pytest.raises(ScheduleError, match="stages=5 must be 2, 3 or 4"):
        tc.build(g.args, target="sim", arch="sm_90", plan=bad)


@pytest.mark.parametrize("D,dtype,expected", [(64, "bfloat16", (8, 8)), (128, "float16", (8, 16)),
                                              (16, "bfloat16", (8, 2)), (32, "float16", (8, 4))])
def test_pre_pass_reads_sixteen_bytes_per_lane(D, dtype, expected):
    """The pre-pass's (elements per load, lanes per row): 16 bytes of a 16-bit row per load where
    the head dim divides by 8 (every head dim the tensor-core form takes: 16, 32, 64, 128), as
    many lanes as a row has such loads, up to the warp;
    the kernel's loads of dO and O are then 16-byte vector loads, and Δ still matches float64."""
    from tecc.passes.rewrite.online_backward_kernels import prepass_vector

    ins, outs = masked_attention(1, 2, 33, 33, D, dtype)
    g = tc.grad(outs[0], [t for t in ins if t.dtype.is_float])
    assert prepass_vector(backward_chain(g.args)) == expected
    narrow = Plan((Step("online_backward_mma", WGMMA_PLANS["narrow"]),), "test", "")
    k = run_backward(1, 2, 33, 33, D, dtype, arch="sm_90", the_plan=narrow)
    prepass = next(f for f in k.module.kernels if f.name.endswith("_backward_prepass_kernel"))
    source = k.source[k.source.index(prepass.name):]
    source = source[:source.index("\n}\n")]
    assert "reinterpret_cast<const uint4*>" in source   # 8 elements of 2 bytes per load


def test_dq_conversion_moves_four_elements_per_thread():
    """The atomics form's conversion of dQ from its float32 accumulator: one 16-byte load and one
    vector store per thread of four consecutive elements (a partial last row block included)."""
    atomic = Plan((Step("online_backward_mma", WGMMA_PLANS["atomic_1wg"]),), "test", "")
    k = run_backward(1, 2, 37, 37, 64, "bfloat16", mask="causal", arch="sm_90", the_plan=atomic)
    convert = next(f for f in k.module.kernels if f.name.endswith("_backward_convert_kernel"))
    source = k.source[k.source.index(convert.name):]
    source = source[:source.index("\n}\n")]
    assert "const float4" in source and "reinterpret_cast<uint2*>" in source, source


def test_hopper_form_with_head_dim_128():
    the_plan = Plan((Step("online_backward_mma", WGMMA_PLANS["kernel"]),), "test", "")
    run_backward(1, 2, 70, 70, 128, "float16", mask="causal", the_plan=the_plan, arch="sm_90")


@pytest.mark.parametrize("D,dtype", [(64, "bfloat16"), (128, "float16")])
def test_hopper_form_splits_dq_columns_between_the_warpgroups(D, dtype):
    """With two warpgroups (128 keys) each sums dS·K over all the block's keys for half of dQ's
    columns (d = 64: n32 from column 32 of the K tile's 128B-swizzled row; d = 128: one column
    block each), so each element of dQ takes one atomic per tile, added in pairs of columns
    (atomic_add_pair): GPT-2's head dim, causal, long enough (260) that key block 0 meets query
    blocks below the diagonal, which run the unguarded copy of the elementwise stage."""
    the_plan = Plan((Step("online_backward_mma", WGMMA_PLANS["atomic_2wg"]),), "test", "")
    k = run_backward(1, 2, 260, 260, D, dtype, mask="causal", the_plan=the_plan, arch="sm_90")
    main = next(f for f in k.module.kernels if f.name.endswith("_backward_mma_kernel"))
    rows = {s.intrinsic for s in iter_stmts(main.body) if isinstance(s, WarpgroupMatrixMultiply)}
    assert any(r.startswith(f"wgmma.m64n{D // 2}k16") for r in rows), rows
    assert "without the per-element guard" in dict(main.attrs)["tensorize"], dict(main.attrs)["tensorize"]
    assert "atomic_add_pair" in str(main.body) and "atomic_add(" not in str(main.body)


@pytest.mark.parametrize("D,dtype,tiling", [(64, "float16", (64, 64, 32)), (128, "bfloat16", (64, 16, 32)),
                                            (128, "float16", (128, 32, 32))])
def test_head_dims_64_and_128(D, dtype, tiling):
    run_backward(1, 2, 77, 77, D, dtype, mask="causal", the_plan=plan(*tiling))


def test_with_the_saved_values_of_tecc_forward_kernel():
    """End to end: the forward kernel tc.grad asks for (O and its log-sum-exp, one tensor-core
    kernel) feeds the backward."""
    run_backward(1, 4, 60, 60, 32, "float16", groups=2, mask="causal", the_plan=plan(), forward="tecc")


def test_planned_for_sm_80_with_its_reason():
    skip_without_nvrtc("sm_80")
    k = run_backward(1, 2, 100, 100, 64, "float16", mask="causal")
    reason = k.plan.reason
    assert "blocks of" in reason and "no spills" in reason and "no (rows x keys) buffer" in reason, reason
    assert "query blocks visited" in reason, reason


def test_symbolic_batch_and_length():
    """One backward for every B and S (tc.var): the bounds and the skipped blocks are
    expressions of the sizes; run at two lengths that are not tile multiples."""
    d, h, G = 32, 4, 2
    B, S = tc.var("B"), tc.var("S")
    Q = tc.placeholder((B, h, S, d), "float16", name="Q")
    K = tc.placeholder((B, h // G, S, d), "float16", name="K")
    V = tc.placeholder((B, h // G, S, d), "float16", name="V")
    r = tc.reduce_axis(d, name="d")
    j1, j2, j3 = (tc.reduce_axis(S, name=n) for n in ("j1", "j2", "j3"))

    def score(b, hh, i, j):
        x = tc.sum(tc.cast(Q[b, hh, i, r], "float32") * tc.cast(K[b, hh // G, j, r], "float32"), axis=r)
        return tc.where(j <= i, x * (1 / math.sqrt(d)), -math.inf)

    Sc = tc.compute((B, h, S, S), score, name="S")
    m = tc.compute((B, h, S), lambda b, hh, i: tc.max(Sc[b, hh, i, j1], axis=j1), name="m")
    e = tc.compute((B, h, S, S), lambda b, hh, i, j: tc.exp(Sc[b, hh, i, j] - m[b, hh, i]), name="e")
    l = tc.compute((B, h, S), lambda b, hh, i: tc.sum(e[b, hh, i, j2], axis=j2), name="l")
    O = tc.compute((B, h, S, d), lambda b, hh, i, c: tc.cast(tc.sum(
        e[b, hh, i, j3] * tc.cast(V[b, hh // G, j3, c], "float32"), axis=j3) / l[b, hh, i], "float16"), name="O")
    g = tc.grad(O, [Q, K, V])
    k = tc.build(g.args, target="sim", plan=plan(32, 32, 16))
    rng = np.random.default_rng()
    for s in (70, 33):
        x = [rng.standard_normal((2, h if n == 0 else h // G, s, d)).astype(np.float16) for n in range(3)]
        _, o64, lse64 = forward_reference(x, G, "causal", False)
        o, lse = o64.astype(np.float16), lse64.astype(np.float32)
        do = rng.standard_normal(o.shape).astype(np.float16)
        grads = [np.full(a.shape, np.nan, np.float16) for a in x]
        k(*x, o, lse, do, *grads)
        for name, got, (want, bound) in zip("QKV", grads, gradients(x, do, o, G, "causal", False,
                                                                    EPSILON["float16"])):
            check(f"d{name} of symbolic attention at S = {s}", got, want, bound)


def test_fully_masked_query_blocks_are_skipped():
    """Causal: key block kb visits the query blocks from kb·BN // BM on (isl-proven), so the
    main kernel's loop count falls with the key block; the description says why."""
    ins, outs = masked_attention(1, 2, 128, 128, 16, "float16", mask="causal")
    g = tc.grad(outs[0], ins)
    k = tc.build(g.args, target="sim", plan=plan(32, 32, 16))
    main = next(f for f in k.module.kernels if f.name.endswith("_backward_mma_kernel"))
    said = dict(main.attrs)["tensorize"]
    assert "query blocks per key block from" in said and "isl" in said, said
    chain = backward_chain(g.args)
    from tecc.compiler.strategies.online_backward import visited_fraction
    assert visited_fraction(chain, 32, 32) == pytest.approx((4 + 3 + 2 + 1) / 16)


def grid_bindings(kernel) -> list[tuple[str, str]]:
    """The kernel's block loops, outermost first: (binding, loop variable)."""
    return [(s.kind, s.var.name) for s in iter_stmts(kernel.body) if isinstance(s, For) and s.kind.startswith("blockIdx")]


@pytest.mark.parametrize("mask", ["causal", None])
def test_causal_key_blocks_launch_longest_first(mask):
    """Causal: the first key blocks visit the most query blocks, so the heads run along x and
    the key blocks along y (every head's first key block launched first, the short ones last);
    without a mask every key block's work is the same and the key blocks stay along x."""
    ins, outs = masked_attention(2, 3, 128, 128, 16, "float16", mask=mask)
    g = tc.grad(outs[0], ins)
    k = tc.build(g.args, target="sim", plan=plan(32, 32, 16))
    main = next(f for f in k.module.kernels if f.name.endswith("_backward_mma_kernel"))
    kinds = dict((name.split("_")[0], kind) for kind, name in grid_bindings(main))
    want = {"head": "blockIdx.x", "key": "blockIdx.y"} if mask else {"head": "blockIdx.y", "key": "blockIdx.x"}
    assert kinds == want, grid_bindings(main)


def test_refuses_float32_operands_and_the_build_falls_back():
    """float32 operands: the FlashAttention-2 form still holds (tc.grad), but the tensor-core
    kernels refuse it, saying why, and build() takes the generic kernels."""
    from test_online_contraction import attention
    ins32, outs32 = attention(1, 2, 24, 16, dtype="float32", causal=True)
    g32 = tc.grad(outs32[0], ins32)
    assert g32.saved, g32.form
    with pytest.raises(ScheduleError, match="float16/bfloat16 input read"):
        from tecc.passes.rewrite.online_backward_mma import online_backward_mma
        online_backward_mma(g32.args)
    assert choose(g32.args, "online_backward_mma", "sm_80") is None
    k = tc.build(g32.args, target="sim", arch="sm_80")
    assert k.plan.strategy != "online_backward_mma"


def test_not_a_backward_program_is_refused_by_structure():
    A = tc.placeholder((8, 8), "float16", name="A")
    r = tc.reduce_axis(8, name="r")
    C = tc.compute((8, 8), lambda i, j: tc.exp(tc.sum(tc.cast(A[i, r], "float32") * tc.cast(A[j, r], "float32"),
                                                       axis=r)), name="C")
    with pytest.raises(ScheduleError, match="no stage is exp"):
        backward_chain([A, C])


def test_grad_refuses_the_online_form_for_an_unnormalized_output_and_says_why():
    X = tc.placeholder((4, 6), "float32", name="X")
    V = tc.placeholder((6, 3), "float32", name="V")
    j1, j2, j3 = (tc.reduce_axis(6, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((4,), lambda i: tc.max(X[i, j1], axis=j1), name="m")
    e = tc.compute((4, 6), lambda i, j: tc.exp(X[i, j] - m[i]), name="e")
    l = tc.compute((4,), lambda i: tc.sum(e[i, j2], axis=j2), name="l")
    O = tc.compute((4, 3), lambda i, c: tc.sum(e[i, j3] * V[j3, c], axis=j3) * l[i], name="O")
    g = tc.grad(O, [X, V])
    assert not g.saved and "not the online form" in g.form and "not Σ_j exp(s - m)·v / l" in g.form, g.form
    assert [t.name for t in g.args] == ["X", "V", "dO", "dX", "dV"]
    generic = tc.grad(masked_attention(1, 2, 8, 8, 16, "float16")[1][0], [], online=False)
    assert generic.form == "reverse mode" and not generic.saved


def test_grouped_heads_gradient_in_float64_by_the_generic_kernels():
    """The FlashAttention-2 form with grouped heads (K[b, h // G, j, d]: dK, dV summed over the
    G query heads) in float64, built by the generic planner, against NumPy."""
    B, H, S, D, G = 1, 4, 9, 4, 2
    Q = tc.placeholder((B, H, S, D), "float64", name="Q")
    K = tc.placeholder((B, H // G, S, D), "float64", name="K")
    V = tc.placeholder((B, H // G, S, D), "float64", name="V")
    d = tc.reduce_axis(D, name="d")
    j1, j2, j3 = (tc.reduce_axis(S, name=n) for n in ("j1", "j2", "j3"))
    Sc = tc.compute((B, H, S, S), lambda b, h, i, j: tc.where(
        j <= i, tc.sum(Q[b, h, i, d] * K[b, h // G, j, d], axis=d) * 0.5, -math.inf), name="S")
    m = tc.compute((B, H, S), lambda b, h, i: tc.max(Sc[b, h, i, j1], axis=j1), name="m")
    e = tc.compute((B, H, S, S), lambda b, h, i, j: tc.exp(Sc[b, h, i, j] - m[b, h, i]), name="e")
    l = tc.compute((B, H, S), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
    O = tc.compute((B, H, S, D), lambda b, h, i, c: tc.sum(e[b, h, i, j3] * V[b, h // G, j3, c], axis=j3) / l[b, h, i],
                   name="O")
    g = tc.grad(O, [Q, K, V])
    rng = np.random.default_rng()
    x = [rng.standard_normal(tuple(int(s) for s in t.shape)) for t in (Q, K, V)]
    fk = tc.build(list(g.forward), target="sim")
    o, lse = np.full((B, H, S, D), np.nan), np.full((B, H, S), np.nan)
    fk(*x, o, lse)
    do = rng.standard_normal(o.shape)
    grads = [np.full(t.shape, np.nan) for t in x]
    tc.build(g.args, target="sim")(*x, o, lse, do, *grads)
    kk, vv = np.repeat(x[1], G, 1), np.repeat(x[2], G, 1)
    s = np.where(np.tril(np.ones((S, S), bool)), x[0] @ np.swapaxes(kk, -1, -2) * 0.5, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ds = p * (do @ np.swapaxes(vv, -1, -2) - (do * (p @ vv)).sum(-1, keepdims=True))
    want = [ds @ kk * 0.5, (np.swapaxes(ds, -1, -2) @ x[0] * 0.5).reshape(B, H // G, G, S, D).sum(2),
            (np.swapaxes(p, -1, -2) @ do).reshape(B, H // G, G, S, D).sum(2)]
    for name, got, w in zip("QKV", grads, want):
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12, err_msg=f"d{name}")


# ---- NVRTC: the benchmark shapes compile without spills -------------------------------------------

@pytest.mark.parametrize("D,causal,groups,arch", [(64, True, 1, "sm_80"), (128, False, 1, "sm_80"),
                                                  (64, False, 4, "sm_90"), (128, True, 1, "sm_90")])
def test_benchmark_shapes_compile_without_spills(D, causal, groups, arch):
    """The planned kernels (on sm_90 the Hopper form with the query-major dQ, at d = 64 and 128:
    online_backward.MEASURED_ON_SM90) compile without spills or serialized wgmmas."""
    skip_without_nvrtc(arch)
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.attention import attention_program
    S = 4096
    args = attention_program(16384 // S, 2048 // D, S, S, D, "float16", groups, 0 if causal else None)
    g = tc.grad(args[-1], args[:3])
    k = tc.build(g.args, target="cuda", arch=arch)
    assert k.plan.strategy == "online_backward_mma" and len(k.module.kernels) == 3, k.plan
    assert sorted(k.resources) == sorted(f.name for f in k.module.kernels), k.resources
    for name, res in k.resources.items():
        assert res.spill_stores == 0 and res.spill_loads == 0, (name, res)
        assert res.registers <= 255, (name, res)
    from tecc.compiler.pipeline import wgmma_serialized
    assert wgmma_serialized(k.compile_log) is None
    assert bool(k.plan.steps[0].args.get("wgmma")) == (arch == "sm_90"), k.plan
    if arch == "sm_90":
        assert k.plan.steps[0].args.get("dq") == "kernel", k.plan


@pytest.mark.parametrize("form", sorted(WGMMA_PLANS))
@pytest.mark.parametrize("D,causal", [(64, True), (128, False)])
def test_hopper_forms_compile_for_sm_90a(form, D, causal):
    """Each Hopper form at S = 4k (B = 4, H = 2048 / d): ptxas without spills or serialized
    wgmmas, except the atomic dQ form at d = 128, whose m64 dQ tile beside the accumulators is
    past 255 registers (the planner passes it over)."""
    skip_without_nvrtc("sm_90")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.attention import attention_program
    from tecc.compiler.pipeline import wgmma_serialized
    args = attention_program(4, 2048 // D, 4096, 4096, D, "float16", 1, 0 if causal else None)
    g = tc.grad(args[-1], args[:3])
    k = tc.build(g.args, target="cuda", arch="sm_90", plan=Plan((Step("online_backward_mma", WGMMA_PLANS[form]),),
                                                                "test", ""))
    assert wgmma_serialized(k.compile_log) is None
    if D == 128 and form.startswith("atomic"):
        return
    for name, res in k.resources.items():
        assert res.spill_stores == 0 and res.spill_loads == 0, (name, res)


# ---- on a GPU ----------------------------------------------------------------------------------------

GPU_CASES = [(64, "float16", False, 1, 1024), (64, "float16", True, 1, 1024), (128, "bfloat16", False, 1, 1024),
             (128, "float16", True, 1, 2048), (128, "float16", True, 4, 1024), (64, "bfloat16", True, 2, 333)]


@pytest.mark.gpu
@pytest.mark.parametrize("D,dtype,causal,groups,S,form", [(c + (None,)) for c in GPU_CASES] +
                         [(128, "float16", True, 2, 1024, "kernel"), (64, "bfloat16", False, 1, 333, "atomic_2wg"),
                          (64, "bfloat16", True, 1, 1024, "atomic_2wg"), (128, "float16", False, 1, 1024, "atomic_2wg"),
                          (128, "bfloat16", False, 4, 2048, "kernel"), (64, "bfloat16", True, 1, 1024, "overlap"),
                          (128, "float16", False, 2, 333, "overlap")])
def test_attention_backward_on_the_gpu_matches_sdpa(D, dtype, causal, groups, S, form):
    """The planned kernels on the GPU against torch's SDPA backward (float32 math from the same
    16-bit inputs as the reference, the bound of the emulator tests)."""
    import torch

    from gpu_checks import check_on_gpu
    B, H = 2, 8
    ins, outs = masked_attention(B, H, S, S, D, dtype, groups=groups, mask="causal" if causal else None)
    g = tc.grad(outs[0], ins)
    fwd = tc.build(list(g.forward), target="cuda")
    if form is None:
        bwd = tc.build(g.args, target="cuda")
    else:
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the Hopper form needs sm_90")
        bwd = tc.build(g.args, target="cuda", plan=Plan((Step("online_backward_mma", WGMMA_PLANS[form]),), "test", ""))
    assert bwd.plan.steps[0].primitive == "online_backward_mma" and len(bwd.module.kernels) <= 3, bwd.plan
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(np.random.SeedSequence().entropy % 2**63)
    q, k, v = (torch.randn(tuple(int(s) for s in t.shape), device="cuda", dtype=torch.float32, generator=gen).to(tdt)
               for t in ins)
    o = torch.full((B, H, S, D), float("nan"), device="cuda", dtype=tdt)
    lse = torch.full((B, H, S), float("nan"), device="cuda", dtype=torch.float32)
    fwd(q, k, v, o, lse)
    do = torch.randn(o.shape, device="cuda", dtype=torch.float32, generator=gen).to(tdt)
    grads = [torch.full(t.shape, float("nan"), device="cuda", dtype=tdt) for t in (q, k, v)]
    bwd(q, k, v, o, lse, do, *grads)
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qq, kk.repeat_interleave(groups, 1),
                                                           vv.repeat_interleave(groups, 1), is_causal=causal)
    ref.backward(do.double())
    x = [t.cpu().numpy() for t in (q.float(), k.float(), v.float())]
    bounds = gradients([a.astype(np.float32) for a in x], do.float().cpu().numpy(), o.float().cpu().numpy(), groups,
                       "causal" if causal else None, False, EPSILON[dtype])
    for name, got, want, (_, bound) in zip("QKV", grads, (qq.grad, kk.grad, vv.grad), bounds):
        check_on_gpu(got, want, torch.from_numpy(bound).cuda(), f"d{name} d={D} {dtype} causal={causal} G={groups} S={S}")
