"""The online contraction on tensor cores (tecc.passes.rewrite.online_contraction_mma): attention
with float16/bfloat16 Q, K, V is ONE mma.sync kernel (FlashAttention-2 structure) that matches
float64 NumPy in the emulator for every variant the SIMT kernel serves (masks, bias, grouped
heads, lengths that are no multiple of a tile, more keys than queries, the log-sum-exp), skips
the key tiles a mask leaves fully -inf (a bound proved by isl), and falls back to the SIMT kernel,
saying why, where the tensor-core form does not apply."""

import math

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from planning import propose_mma
from planning import propose_simt as propose
from tecc.ir.evaluate import evaluate_int
from tecc.ir.intrinsics import lookup
from tecc.ir.expr import Compare
from tecc.ir.stmt import Allocate, For, IfThenElse, MatrixMultiply, iter_stmts
from tecc.passes.rewrite.online_contraction_mma import online_contraction_mma

from test_online_contraction import attention, check, inputs_for


def mma_plan(rows=64, key_tile=32, warp_rows=16):
    args = {"rows_per_block": rows, "key_tile": key_tile}
    if warp_rows != 16:
        args["warp_rows"] = warp_rows
    return Plan((Step("online_contraction_mma", args),), "test", "")


def masked_attention(B, H, Sq, Sk, D, dtype, groups=1, mask="causal", bias=False, lse=False):
    """Attention as users write it, with a mask given as a `where` on the scores: 'causal'
    (j <= i), 'bottom_right' (j <= i + Sk - Sq), 'tensor' (a boolean input), or None."""
    Q = tc.placeholder((B, H, Sq, D), dtype, name="Q")
    K = tc.placeholder((B, H // groups, Sk, D), dtype, name="K")
    V = tc.placeholder((B, H // groups, Sk, D), dtype, name="V")
    ins = [Q, K, V]
    d = tc.reduce_axis(D, name="d")
    scale = 1.0 / math.sqrt(D)

    def dot(b, h, i, j):
        return tc.sum(tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h // groups, j, d], "float32"), axis=d) * scale

    if bias:
        bias_t = tc.placeholder((B, H, Sq, Sk), "float32", name="bias")
        ins.append(bias_t)
    if mask == "tensor":
        keep = tc.placeholder((B, 1, Sq, Sk), "bool", name="keep")
        ins.append(keep)

    def score(b, h, i, j):
        s = dot(b, h, i, j)
        if bias:
            s = s + bias_t[b, h, i, j]
        if mask == "causal":
            return tc.where(j <= i, s, -math.inf)
        if mask == "bottom_right":
            return tc.where(j <= i + (Sk - Sq), s, -math.inf)
        if mask == "tensor":
            return tc.where(keep[b, 0, i, j], s, -math.inf)
        return s

    S = tc.compute((B, H, Sq, Sk), score, name="S")
    j1, j2, j3 = (tc.reduce_axis(Sk, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((B, H, Sq), lambda b, h, i: tc.max(S[b, h, i, j1], axis=j1), name="m")
    e = tc.compute((B, H, Sq, Sk), lambda b, h, i, j: tc.exp(S[b, h, i, j] - m[b, h, i]), name="e")
    l = tc.compute((B, H, Sq), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
    O = tc.compute((B, H, Sq, D), lambda b, h, i, c: tc.cast(
        tc.sum(e[b, h, i, j3] * tc.cast(V[b, h // groups, j3, c], "float32"), axis=j3) / l[b, h, i], dtype), name="O")
    outs = [O]
    if lse:
        outs.append(tc.compute((B, H, Sq), lambda b, h, i: m[b, h, i] + tc.log(l[b, h, i]), name="lse"))
    return ins, outs


def keep_mask(mask, Sq, Sk, tensor=None):
    i, j = np.indices((Sq, Sk))
    if mask == "causal":
        return j <= i
    if mask == "bottom_right":
        return j <= i + (Sk - Sq)
    if mask == "tensor":
        return tensor
    return np.ones((Sq, Sk), bool)


def reference(x, groups, mask, bias):
    """float64 attention and log-sum-exp of the (already rounded) inputs."""
    q, k, v = (a.astype(np.float64) for a in x[:3])
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])   # matmul: BLAS, for the GPU tests' sizes
    rest = list(x[3:])
    if bias:
        s = s + rest.pop(0)
    keep = keep_mask(mask, s.shape[-2], s.shape[-1], rest.pop(0) if mask == "tensor" else None)
    s = np.where(keep, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    p = np.exp(s - mx)
    total = p.sum(axis=-1, keepdims=True)
    return (p @ v) / total, (mx + np.log(total))[..., 0]


EPSILON = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}  # machine epsilon (the ulp at 1)


def bound(dtype, keys, v):
    """|tecc - float64| / (1 + |want|) allowed: float32 sums (a few ulps per key: dot products,
    exp2, rescalings), the output's rounding (an ulp of its dtype), and P rounded to V's dtype
    before P·V (half an ulp of each weight, so at most that times max |v| in O)."""
    eps = EPSILON[dtype]
    return 2 * keys * float(np.finfo(np.float32).eps) + eps + eps / 2 * float(np.abs(v).max())


def make_inputs(ins, rng):
    """Random inputs in each tensor's own dtype (a bool mask keeps ~60% of the keys and the
    first key of every row: a row with none is 0/0 = NaN, in NumPy too)."""
    x = []
    for t in ins:
        shape = tuple(int(s) for s in t.shape)
        if t.dtype.is_bool:
            keep = rng.random(shape) < 0.6
            keep[..., 0] = True
            x.append(keep)
        else:
            x.append(rng.standard_normal(shape).astype(np.float32).astype(t.dtype.numpy))
    return x


def poisoned(t):
    return np.full(tuple(int(s) for s in t.shape), np.nan, t.dtype.numpy)


def wide(a):
    return a if a.dtype == bool else a.astype(np.float64)


def run(ins, outs, x, plan, target="sim", arch=None):
    """Build (planning for `arch`: sm_80 keeps plan="auto" on the mma.sync kernel, sm_90 takes
    the wgmma form), run on NaN-poisoned outputs, and return the kernel, the outputs and the
    inputs as float64 (the values the kernel was given)."""
    k = tc.build(ins + outs, target=target, plan=plan, arch=arch)
    got = [poisoned(t) for t in outs]
    k(*x, *got)
    return k, [wide(g) for g in got], [wide(a) for a in x]


VARIANTS = {
    "plain": dict(mask=None),
    "causal": dict(mask="causal"),
    "bias": dict(mask=None, bias=True),
    "grouped_causal": dict(mask="causal", groups=2),
    "causal_bias_grouped_lse": dict(mask="causal", bias=True, groups=2, lse=True),
    "bool_mask_tensor": dict(mask="tensor"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("S", [45, 80])
def test_tensor_core_attention_matches_float64_numpy(variant, S):
    kw = dict(VARIANTS[variant])
    groups, lse = kw.pop("groups", 1), kw.pop("lse", False)
    ins, outs = masked_attention(1, 2, S, S, 32, "float16", groups=groups, lse=lse, **kw)
    rng = np.random.default_rng()
    k, got, given = run(ins, outs, make_inputs(ins, rng), "auto", arch="sm_80")
    assert k.plan.strategy == "online_contraction_mma" and "wgmma" not in k.plan.steps[0].args, k.plan
    assert len(k.module.kernels) == 1 and not k.module.temps
    want, want_lse = reference(given, groups, kw["mask"], kw.get("bias", False))
    check(f"tensor-core attention {variant} S={S}", got[0], want, bound("float16", S, given[2]), k.plan)
    if lse:
        check(f"tensor-core log-sum-exp {variant}", got[1], want_lse, bound("float16", S, given[2]), k.plan)


@pytest.mark.parametrize("mask", ["bottom_right", "causal", None])
def test_more_keys_than_queries_bfloat16(mask):
    """Sq != Sk, bfloat16, bottom-right causal (j <= i + Sk - Sq), with the log-sum-exp."""
    Sq, Sk = 21, 70
    ins, outs = masked_attention(2, 2, Sq, Sk, 16, "bfloat16", mask=mask, lse=True)
    rng = np.random.default_rng()
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), mma_plan(64, 32))
    want, want_lse = reference(given, 1, mask, False)
    check(f"bfloat16 attention {mask}", o, want, bound("bfloat16", Sk, given[2]), k.plan)
    check(f"bfloat16 log-sum-exp {mask}", lse, want_lse, bound("bfloat16", Sk, given[2]), k.plan)


@pytest.mark.parametrize("rows,key_tile,warp_rows", [(16, 16, 16), (32, 64, 16), (128, 32, 16), (64, 32, 32),
                                                    (128, 64, 32)])
def test_block_shapes(rows, key_tile, warp_rows):
    """Blocks of 16..128 rows, key tiles of 16..64, one or two m16 tiles per warp (the second
    shares the warp's K and V fragments), with a bias, grouped heads and the log-sum-exp."""
    ins, outs = masked_attention(1, 2, 37, 37, 32, "float16", mask="causal", bias=True, groups=2, lse=True)
    rng = np.random.default_rng()
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), mma_plan(rows, key_tile, warp_rows))
    want, want_lse = reference(given, 2, "causal", True)
    what = f"rows={rows} key_tile={key_tile} warp_rows={warp_rows}"
    check(f"attention {what}", o, want, bound("float16", 37, given[2]), k.plan)
    check(f"log-sum-exp {what}", lse, want_lse, bound("float16", 37, given[2]), k.plan)


SWEEP = [  # (Sq, Sk, D, dtype, mask, bias, groups, log-sum-exp, (rows, key tile, warp rows))
    (1, 1, 16, "float16", None, False, 1, True, (64, 64, 16)),
    (3, 17, 32, "bfloat16", "bottom_right", False, 2, True, (16, 128, 16)),
    (65, 5, 16, "float16", "causal", True, 1, False, (64, 32, 32)),
    (100, 129, 64, "bfloat16", "tensor", True, 2, True, (128, 64, 32)),
    (17, 33, 32, "float16", "bottom_right", True, 1, True, (32, 16, 16)),
    (64, 70, 16, "bfloat16", "causal", False, 2, False, (64, 32, 16)),
]


@pytest.mark.parametrize("case", SWEEP, ids=[f"{c[0]}x{c[1]}-d{c[2]}-{c[3]}-{c[4]}-{c[8]}" for c in SWEEP])
def test_edge_shapes_and_tilings(case):
    """Single rows and keys, fewer keys than a tile, more keys than queries and fewer, every mask
    form with a bias and grouped heads, through different tilings."""
    Sq, Sk, D, dtype, mask, bias_, groups, lse, tiling = case
    ins, outs = masked_attention(1, 2, Sq, Sk, D, dtype, groups=groups, mask=mask, bias=bias_, lse=lse)
    rng = np.random.default_rng()
    k, got, given = run(ins, outs, make_inputs(ins, rng), mma_plan(*tiling))
    want, want_lse = reference(given, groups, mask, bias_)
    check(f"attention {case}", got[0], want, bound(dtype, Sk, given[2]), k.plan)
    if lse:
        check(f"log-sum-exp {case}", got[1], want_lse, bound(dtype, Sk, given[2]), k.plan)


@pytest.mark.parametrize("mask", ["causal", None])
def test_two_m_tiles_per_warp(mask):
    ins, outs = masked_attention(1, 2, 80, 80, 16, "bfloat16", mask=mask)
    rng = np.random.default_rng()
    k, (o,), given = run(ins, outs, make_inputs(ins, rng), mma_plan(64, 32, 32))
    want, _ = reference(given, 1, mask, False)
    check(f"two m16 tiles per warp {mask}", o, want, bound("bfloat16", 80, given[2]), k.plan)


def query_block(kernel):
    """The query block's variable: the blockIdx.x loop's, or the let that reorders the launch."""
    from tecc.ir.stmt import LetStmt

    lets = [s.var for s in iter_stmts(kernel.body) if isinstance(s, LetStmt) and s.var.name.startswith("query_block")]
    return lets[0] if lets else next(s.var for s in iter_stmts(kernel.body) if isinstance(s, For) and s.kind == "blockIdx.x")


def key_loop(kernel):
    loops = [s for s in iter_stmts(kernel.body) if isinstance(s, For) and s.var.name.startswith("key_tile")]
    assert len(loops) == 1, [s.var.name for s in loops]
    return loops[0]


@pytest.mark.parametrize("mask,Sq,Sk", [("causal", 150, 150), ("bottom_right", 40, 100), (None, 45, 45),
                                        ("tensor", 45, 45)])
def test_fully_masked_key_tiles_are_not_visited(mask, Sq, Sk):
    """The key loop of each query block stops at the tile of the last key a row of the block
    keeps (the exact count, checked against the mask block by block); a mask that is not affine
    (a tensor) or none visits every tile."""
    rows, key_tile = 64, 32
    ins, outs = masked_attention(1, 2, Sq, Sk, 16, "float16", mask=mask)
    mod = online_contraction_mma(ins + outs, rows, key_tile)
    (kernel,) = mod.kernels
    loop = key_loop(kernel)
    block = query_block(kernel)
    keep = keep_mask(mask, Sq, Sk, np.ones((Sq, Sk), bool))
    for b in range(-(-Sq // rows)):
        kept = np.nonzero(keep[b * rows:(b + 1) * rows].any(axis=0))[0]
        want = -(-(int(kept.max()) + 1) // key_tile) if mask in ("causal", "bottom_right") else -(-Sk // key_tile)
        assert evaluate_int(loop.extent, {block: b}) == want, (mask, b, loop.extent)
    # the proof is in the kernel's description
    what = dict(kernel.attrs)["tensorize"]
    assert ("isl: no kept key past it" in what) == (mask in ("causal", "bottom_right")), what


@pytest.mark.parametrize("mask,Sq,Sk", [("causal", 150, 150), ("bottom_right", 40, 100), (None, 45, 45),
                                        (None, 64, 64)])
def test_tiles_kept_whole_skip_the_guard(mask, Sq, Sk):
    """The key tiles that every row of a block keeps whole (below the diagonal, inside the keys)
    are evaluated without the mask and bound guard: the count is exact, block by block."""
    rows, key_tile = 64, 32
    ins, outs = masked_attention(1, 2, Sq, Sk, 16, "float16", mask=mask)
    (kernel,) = online_contraction_mma(ins + outs, rows, key_tile).kernels
    loop = key_loop(kernel)
    split = [s for s in iter_stmts(loop.body) if isinstance(s, IfThenElse) and isinstance(s.cond, Compare)
             and s.cond.a is loop.var]
    assert len(split) == 1, "one branch between the unguarded and the guarded tiles"
    block = query_block(kernel)
    keep = keep_mask(mask, Sq, Sk)
    for b in range(-(-Sq // rows)):
        rows_keep = keep[b * rows:(b + 1) * rows]
        want = 0
        while (want + 1) * key_tile <= Sk and rows_keep[:, want * key_tile:(want + 1) * key_tile].all():
            want += 1
        assert evaluate_int(split[0].cond.b, {block: b}) == want, (mask, b, split[0].cond.b)


def test_skipped_tiles_do_no_mma_work():
    """Counted in the IR: a causal S=128 problem in blocks of 64 rows and 32-key tiles does
    2 + 4 = 6 key tiles of mma per head instead of 2 · 4 = 8."""
    ins, outs = masked_attention(1, 1, 128, 128, 16, "float16", mask="causal")
    (kernel,) = online_contraction_mma(ins + outs, 64, 32).kernels
    loop = key_loop(kernel)
    block = query_block(kernel)
    assert sum(evaluate_int(loop.extent, {block: b}) for b in range(2)) == 6
    assert any(isinstance(s, MatrixMultiply) for s in iter_stmts(loop.body))


def test_one_kernel_no_score_matrix():
    S = 80
    ins, outs = masked_attention(1, 2, S, S, 32, "float16", mask="causal", lse=True)
    mod = online_contraction_mma(ins + outs)
    assert len(mod.kernels) == 1 and not mod.temps
    for st in iter_stmts(mod.kernels[0].body):
        if isinstance(st, Allocate):
            size = math.prod(int(s) for s in st.buffer.shape)
            assert size < S * S, f"{st.buffer.name} holds {size} elements: an S x S temporary"


def test_c_fragments_of_two_n8_tiles_are_the_a_fragment():
    """The relayout the kernel relies on, from the intrinsic table: A element e of k16 step k is
    C element e % 4 of n8 tile 2k + e // 4."""
    row = lookup("mma.m16n8k16.f32.f16")
    c, a = row.operand("c").layout, row.operand("a").layout
    for lane in range(32):
        for e in range(8):
            r, col = c(lane, e % 4)
            assert a(lane, e) == (r, col + 8 * (e // 4))


@pytest.mark.parametrize("why,kwargs", [
    ("float32", dict(dtype="float32", D=32)),
    ("needs one of 16, 32, 64, 96, 128, 256", dict(dtype="float16", D=48)),
    ("power of two", dict(dtype="float16", D=256, arch="sm_80")),   # sm_90 runs it on wgmma
])
def test_falls_back_to_simt_and_says_why(why, kwargs):
    arch = kwargs.get("arch")
    ins, outs = attention(1, 2, 20, kwargs["D"], dtype=kwargs["dtype"], causal=True)
    assert propose_mma(ins + outs, arch) is None
    simt = propose(ins + outs, arch)
    assert simt is not None and "SIMT, not tensor cores" in simt.reason and why in simt.reason, simt.reason
    rng = np.random.default_rng()
    x = inputs_for(ins, rng)
    # the SIMT plan, and plan="auto": no tensor-core form; the SIMT kernel or, where the cost model
    # prices it higher (its uncoalesced K reads, cost/attention.simt_workload), the per-kernel plans
    for plan in (simt.plan, "auto"):
        k = tc.build(ins + outs, target="sim", arch=arch, plan=plan)
        assert k.plan.strategy != "online_contraction_mma", k.plan
        assert k.plan.strategy != "online_contraction" or why in k.plan.reason, k.plan.reason
        o = np.full(tuple(int(s) for s in outs[0].shape), np.nan, outs[0].dtype.name)
        k(*x, o)
        assert np.all(np.isfinite(o))
    assert simt.plan.steps[0].primitive == "online_contraction"


def test_no_head_axes_and_the_statistics_as_outputs():
    """Q[i, d]·K[j, d] with no leading row axes (no grid y), the product written in bfloat16
    (`tc.sum(Q * K)`), and m and l outputs themselves (m from the log2-unit running max)."""
    S, D = 50, 32
    Q, K, V = (tc.placeholder((S, D), "bfloat16", name=n) for n in "QKV")
    d = tc.reduce_axis(D, name="d")
    j1, j2, j3 = (tc.reduce_axis(S, name=n) for n in ("j1", "j2", "j3"))
    s = tc.compute((S, S), lambda i, j: tc.sum(Q[i, d] * K[j, d], axis=d) * 0.2, name="s")
    m = tc.compute((S,), lambda i: tc.max(s[i, j1], axis=j1), name="m")
    l = tc.compute((S,), lambda i: tc.sum(tc.exp(s[i, j2] - m[i]), axis=j2), name="l")
    O = tc.compute((S, D), lambda i, c: tc.cast(tc.sum(
        tc.exp(s[i, j3] - m[i]) * tc.cast(V[j3, c], "float32"), axis=j3) / l[i], "bfloat16"), name="O")
    rng = np.random.default_rng()
    k, (o, m_out, l_out), (q, kk, v) = run([Q, K, V], [O, m, l], make_inputs([Q, K, V], rng), "auto")
    assert k.plan.strategy == "online_contraction_mma", k.plan
    scores = (q @ kk.T) * 0.2
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    tol = bound("bfloat16", S, v)
    check("attention without heads", o, (p @ v) / p.sum(axis=1, keepdims=True), tol, k.plan)
    check("row max", m_out, scores.max(axis=1), tol, k.plan)
    check("row sum of exp", l_out, p.sum(axis=1), tol, k.plan)


def test_symbolic_head_dim_falls_back_to_simt():
    """A symbolic depth of the scores' contraction: the SIMT kernel (which loops over it), and
    the plan says why not tensor cores."""
    dq = tc.var("dq")
    Q = tc.placeholder((1, 2, 20, dq), "float16", name="Q")
    K = tc.placeholder((1, 2, 20, dq), "float16", name="K")
    V = tc.placeholder((1, 2, 20, 16), "float16", name="V")
    d = tc.reduce_axis(dq, name="d")
    j1, j2, j3 = (tc.reduce_axis(20, name=n) for n in ("j1", "j2", "j3"))
    s = tc.compute((1, 2, 20, 20), lambda b, h, i, j: tc.sum(
        tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h, j, d], "float32"), axis=d), name="s")
    m = tc.compute((1, 2, 20), lambda b, h, i: tc.max(s[b, h, i, j1], axis=j1), name="m")
    l = tc.compute((1, 2, 20), lambda b, h, i: tc.sum(tc.exp(s[b, h, i, j2] - m[b, h, i]), axis=j2), name="l")
    O = tc.compute((1, 2, 20, 16), lambda b, h, i, c: tc.sum(
        tc.exp(s[b, h, i, j3] - m[b, h, i]) * tc.cast(V[b, h, j3, c], "float32"), axis=j3) / l[b, h, i], name="O")
    simt = propose([Q, K, V, O])
    assert simt is not None and "symbolic" in simt.reason, simt
    k = tc.build([Q, K, V, O], target="sim", plan=simt.plan)
    assert k.plan.steps[0].primitive == "online_contraction", k.plan
    rng = np.random.default_rng()
    q, kk = (rng.standard_normal((1, 2, 20, 24)).astype(np.float16) for _ in range(2))
    v = rng.standard_normal((1, 2, 20, 16)).astype(np.float16)
    o = np.full((1, 2, 20, 16), np.nan, np.float32)
    k(q, kk, v, o)
    scores = wide(q) @ np.swapaxes(wide(kk), -1, -2)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    check("symbolic head dim (SIMT)", o, (p @ wide(v)) / p.sum(axis=-1, keepdims=True), bound("float16", 20, wide(v)),
          k.plan)


def test_strided_inputs_fall_back():
    Q, K, V = (tc.placeholder((1, 1, 20, 16), "float16", name=n, strides="any") for n in "QKV")
    d = tc.reduce_axis(16, name="d")
    j1, j2, j3 = (tc.reduce_axis(20, name=n) for n in ("j1", "j2", "j3"))
    s = tc.compute((1, 1, 20, 20), lambda b, h, i, j: tc.sum(
        tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h, j, d], "float32"), axis=d), name="s")
    m = tc.compute((1, 1, 20), lambda b, h, i: tc.max(s[b, h, i, j1], axis=j1), name="m")
    l = tc.compute((1, 1, 20), lambda b, h, i: tc.sum(tc.exp(s[b, h, i, j2] - m[b, h, i]), axis=j2), name="l")
    O = tc.compute((1, 1, 20, 16), lambda b, h, i, c: tc.sum(
        tc.exp(s[b, h, i, j3] - m[b, h, i]) * tc.cast(V[b, h, j3, c], "float32"), axis=j3) / l[b, h, i], name="O")
    assert propose_mma([Q, K, V, O]) is None   # run-time strides: the copies need a unit innermost one
    assert "innermost stride is Q_stride3, not 1" in propose([Q, K, V, O]).reason


def test_old_architecture_falls_back():
    ins, outs = masked_attention(1, 1, 20, 20, 32, "float16")
    assert propose_mma(ins + outs, "sm_75") is None
    assert "sm_80" in propose(ins + outs, "sm_75").reason
    assert propose_mma(ins + outs, "sm_90") is not None


def test_symbolic_sequence_length():
    n = tc.var("n")
    ins, outs = masked_attention(1, 2, n, n, 16, "float16", mask="causal")
    k = tc.build(ins + outs, target="sim")
    assert k.plan.strategy == "online_contraction_mma"
    rng = np.random.default_rng()
    for size in (5, 70):
        x = [rng.standard_normal((1, 2, size, 16)).astype(np.float16) for _ in range(3)]
        o = np.full((1, 2, size, 16), np.nan, np.float16)
        k(*x, o)
        want, _ = reference([wide(a) for a in x], 1, "causal", False)
        check(f"symbolic n={size}", wide(o), want, bound("float16", size, wide(x[2])), k.plan)


@pytest.mark.parametrize("D,dtype,arch,extra", [(64, "float16", "sm_90", {}), (128, "bfloat16", "sm_90", {}),
                                                (128, "float16", "sm_80", {}),
                                                (128, "float16", "sm_90", {"bias": True, "mask": "tensor"}),
                                                (64, "bfloat16", "sm_80", {"bias": True}),
                                                (32, "float16", "sm_90", {}), (16, "bfloat16", "sm_80", {})])
def test_planned_kernels_compile_with_nvrtc_without_spills(D, dtype, arch, extra):
    # the kernel the build compiles (the plan's step, then the pipeline's fixed tail of passes):
    # the one propose_mma's ptxas check judged
    mask = extra.get("mask", "causal")
    ins, outs = masked_attention(2, 4, 200, 200, D, dtype, groups=2, lse=True, mask=mask, bias=extra.get("bias", False))
    plan = propose_mma(ins + outs, arch).plan
    (step,) = plan.steps
    assert step.primitive == "online_contraction_mma"
    (res,) = tc.build(ins + outs, arch=arch, plan=plan).resources.values()
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.registers <= 255, res


def test_exp2_approx_flushes_subnormals_and_prints_ex2_approx_ftz():
    """The weights' exp2 is ex2.approx.ftz.f32: the emulator flushes subnormal arguments and
    results to 0, as the instruction does, and codegen prints the instruction."""
    from tecc.codegen import emit_source
    from tecc.runtime.sim.numerics import FLOAT_FUNCS

    x = np.array([-np.inf, -200.0, -126.5, -1e-40, 0.0, 3.5, np.nan], np.float32)
    got = FLOAT_FUNCS["exp2_approx"](x)
    want = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 2.0 ** 3.5, np.nan], np.float32)
    np.testing.assert_array_equal(got, want)
    ins, outs = masked_attention(1, 1, 20, 20, 16, "float16")
    assert "ex2.approx.ftz.f32" in emit_source(online_contraction_mma(ins + outs).kernels)


# ---- on a GPU -----------------------------------------------------------------------------------

GPU_CASES = [(64, "float16", None, 1, 1024), (64, "float16", "causal", 1, 1024), (128, "float16", "causal", 1, 1024),
             (128, "bfloat16", None, 1, 1024), (64, "bfloat16", "causal", 4, 1024), (128, "float16", "causal", 2, 200),
             (64, "float16", "bottom_right", 1, 200), (96, "float16", "causal", 4, 1024), (96, "bfloat16", None, 1, 200)]


@pytest.mark.gpu
@pytest.mark.parametrize("D,dtype,mask,groups,S", GPU_CASES)
def test_tensor_core_attention_on_the_gpu(D, dtype, mask, groups, S):
    B, H = 2, 8
    Sq = S if mask != "bottom_right" else S // 2
    ins, outs = masked_attention(B, H, Sq, S, D, dtype, groups=groups, mask=mask, lse=True)
    rng = np.random.default_rng()
    # the mma.sync kernel with the tiling sm_80 would plan (on sm_90 plan="auto" takes the wgmma
    # form, tested in test_attention_wgmma.py), compiled for the GPU at hand (an sm_80 cubin does
    # not run on sm_90)
    from planning import propose_mma

    plan = propose_mma(ins + outs, "sm_80").plan
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), plan, target="cuda")
    assert k.plan.strategy == "online_contraction_mma" and len(k.module.kernels) == 1, k.plan
    assert "wgmma" not in k.plan.steps[0].args, k.plan
    want, want_lse = reference(given, groups, mask, False)
    check(f"gpu tensor-core attention d={D} {dtype} {mask} G={groups} S={S}", o, want, bound(dtype, S, given[2]),
          k.plan)
    check(f"gpu log-sum-exp d={D} {dtype} {mask}", lse, want_lse, bound(dtype, S, given[2]), k.plan)
