"""The per-element guard of the partially masked key tiles (online_contraction_mma's
`_Kernel.limited_guard`): each affine condition of the mask, c·key + a·row + rest <= 0, becomes
one integer limit per m16 tile compared against the element's compile-time offsets, and the
key-extent test is left out where isl proves every visited key inside. In the emulator against
float64 NumPy (causal, bottom-right, a sliding window, a condition that is not affine, key extents
that are no multiple of the tile, every tile guarded), the structure of the guard in the IR, and
ptxas's registers for the d = 128 kernel (2 blocks of 256 threads per SM need <= 128)."""

import math

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.ir.stmt import LetStmt, iter_stmts
from tecc.passes.rewrite.online_contraction_mma import online_contraction_mma

from test_attention_tensor_core import bound, make_inputs, masked_attention, reference, run
from test_online_contraction import check
from nvrtc_checks import skip_without_nvrtc

WINDOW = 37   # the sliding window's width: keys row - 37 .. row


def window_attention(Sq, Sk, D, dtype, mask):
    """Attention under 'window' (row - WINDOW <= key <= row: two affine conditions, one with a
    negative key coefficient), 'window_odd' (the window and key % 3 != 1: a condition that is
    not affine, evaluated per element) or 'per_head' (key <= row + 5·head: the limit's constant
    part reads the head)."""
    Q = tc.placeholder((1, 2, Sq, D), dtype, name="Q")
    K = tc.placeholder((1, 2, Sk, D), dtype, name="K")
    V = tc.placeholder((1, 2, Sk, D), dtype, name="V")
    d = tc.reduce_axis(D, name="d")
    scale = 1.0 / math.sqrt(D)

    def score(b, h, i, j):
        s = tc.sum(tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h, j, d], "float32"), axis=d) * scale
        if mask == "per_head":
            return tc.where(j <= i + 5 * h, s, -math.inf)
        keep = (j <= i) & (j >= i - WINDOW)
        if mask == "window_odd":
            keep = keep & (j % 3 != 1)
        return tc.where(keep, s, -math.inf)

    S = tc.compute((1, 2, Sq, Sk), score, name="S")
    j1, j2, j3 = (tc.reduce_axis(Sk, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((1, 2, Sq), lambda b, h, i: tc.max(S[b, h, i, j1], axis=j1), name="m")
    e = tc.compute((1, 2, Sq, Sk), lambda b, h, i, j: tc.exp(S[b, h, i, j] - m[b, h, i]), name="e")
    l = tc.compute((1, 2, Sq), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
    O = tc.compute((1, 2, Sq, D), lambda b, h, i, c: tc.cast(
        tc.sum(e[b, h, i, j3] * tc.cast(V[b, h, j3, c], "float32"), axis=j3) / l[b, h, i], dtype), name="O")
    return [Q, K, V], [O]


def window_reference(x, mask):
    q, k, v = x
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])
    i, j = np.indices(s.shape[-2:])
    keep = (j <= i) & (j >= i - WINDOW)
    if mask == "window_odd":
        keep &= j % 3 != 1
    if mask == "per_head":
        keep = np.stack([j <= i + 5 * h for h in range(s.shape[1])])[None]
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p @ v) / p.sum(axis=-1, keepdims=True)


def plan(rows, key_tile, wgmma, **extra):
    return Plan((Step("online_contraction_mma", {"rows_per_block": rows, "key_tile": key_tile,
                                                 **({"wgmma": True} if wgmma else {}), **extra}),), "test", "")


GUARDED = [  # (Sq, Sk, D, dtype, mask, groups, (rows, key tile, wgmma), every tile guarded)
    (130, 130, 32, "float16", "causal", 1, (128, 64, True), False),        # Sk no multiple of the tile
    (128, 128, 32, "bfloat16", "causal", 2, (128, 64, True), False),       # a multiple: no key-extent test
    (128, 128, 16, "float16", "causal", 1, (64, 32, False), True),         # mma.sync, two m16 tiles per warp
    (40, 100, 32, "float16", "bottom_right", 1, (64, 64, True), False),
    (70, 130, 32, "bfloat16", "bottom_right", 2, (64, 64, True), True),    # every tile guarded, 3 tiles
    (96, 96, 32, "float16", "bottom_right", 1, (64, 32, False), False),
]


@pytest.mark.parametrize("case", GUARDED, ids=[f"{c[0]}x{c[1]}-d{c[2]}-{c[4]}-{c[6]}-every{c[7]}" for c in GUARDED])
def test_the_limit_guard_matches_float64_numpy(case):
    """Causal and bottom-right masks through the limit form of the guard, in the Hopper and the
    mma.sync forms, key extents that are and are not multiples of the tile, grouped heads, more
    and fewer keys than queries, and with every visited tile guarded (guard_every_tile)."""
    Sq, Sk, D, dtype, mask, groups, (rows, key_tile, wgmma), every = case
    ins, outs = masked_attention(1, 2, Sq, Sk, D, dtype, groups=groups, mask=mask, lse=True)
    extra = {"guard_every_tile": True} if every else {}
    if not wgmma:
        extra["warp_rows"] = 32
    k, got, given = run(ins, outs, make_inputs(ins, np.random.default_rng()), plan(rows, key_tile, wgmma, **extra))
    want, want_lse = reference(given, groups, mask, False)
    check(f"limit guard {case}", got[0], want, bound(dtype, Sk, given[2]), k.plan)
    check(f"limit guard lse {case}", got[1], want_lse, bound(dtype, Sk, given[2]), k.plan)


@pytest.mark.parametrize("mask,S,wgmma", [("window", 150, True), ("window_odd", 150, True), ("window", 97, False),
                                          ("window_odd", 97, False), ("per_head", 150, True), ("per_head", 97, False)])
def test_a_window_and_a_condition_that_is_not_affine(mask, S, wgmma):
    """A sliding window (a lower bound on the key: key coefficient -1) and, with it, key % 3 != 1
    (not affine: compared per element beside the limits), and a causal offset that depends on the
    head, every tile guarded, against NumPy."""
    ins, outs = window_attention(S, S, 32, "float16", mask)
    k, got, given = run(ins, outs, make_inputs(ins, np.random.default_rng()),
                        plan(64, 32 if not wgmma else 64, wgmma, guard_every_tile=True))
    want = window_reference(given, mask)
    check(f"{mask} attention S={S}", got[0], want, bound("float16", S, given[2]), k.plan)


def _limits(kernel):
    return [s for s in iter_stmts(kernel.body) if isinstance(s, LetStmt) and s.var.name.startswith("key_limit")]


@pytest.mark.parametrize("Sk,want", [(128, 1), (130, 2)])
def test_one_limit_per_affine_condition_and_the_key_extent_only_when_not_proven(Sk, want):
    """Causal 128 x 64: the guard binds one limit per m16 tile for j <= i, and a second for
    j < Sk only when Sk is no multiple of the tile (isl: tiles_inside_keys); the elements compare
    constants against it (no row or key expression per element)."""
    from tecc.codegen import emit_source

    ins, outs = masked_attention(1, 2, Sk, Sk, 32, "float16", mask="causal")
    (kernel,) = online_contraction_mma(ins + outs, 128, 64, wgmma=True).kernels
    assert len(_limits(kernel)) == want, [str(s.value) for s in _limits(kernel)]
    source = emit_source([kernel])
    guard = [line for line in source.splitlines() if "<= key_limit" in line]
    assert guard and all("thread" not in line and "query_block" not in line for line in guard), guard


def test_tiles_inside_keys_is_proved_only_for_a_multiple_of_the_tile():
    from tecc.passes.rewrite.key_tiles import key_tile_bound, tiles_inside_keys
    from tecc.passes.rewrite.online_contraction import online_chain
    from tecc.ir import dtype as dt
    from tecc.ir.expr import Var

    block = Var("query_block", dt.int32)
    for S, mask, proved in ((256, "causal", True), (250, "causal", False), (256, None, True), (250, None, False)):
        chain = online_chain(sum(masked_attention(1, 2, S, S, 32, "float16", mask=mask), []))
        bound = key_tile_bound(chain, block, 128, 64)
        tiles = (chain.keys + 63) // 64 if bound is None else bound[0]
        assert tiles_inside_keys(chain, block, 128, 64, tiles) == proved, (S, mask)
    n = tc.var("n")
    chain = online_chain(sum(masked_attention(1, 2, n, n, 32, "float16", mask="causal"), []))
    bound = key_tile_bound(chain, block, 128, 64)
    assert bound is not None and not tiles_inside_keys(chain, block, 128, 64, bound[0])


# ---- ptxas: the d = 128 causal 128 x 64 kernel fits 2 blocks per SM -------------------------------


@pytest.mark.parametrize("dtype,groups,Sq,Sk", [("float16", 1, 8192, 8192), ("bfloat16", 1, 8192, 8192),
                                                ("float16", 1, 1024, 8192), ("float16", 1, 8000, 8000)])
def test_causal_d128_128x64_fits_two_blocks_per_sm(dtype, groups, Sq, Sk):
    """ptxas (NVRTC, sm_90a) for the Hopper causal / bottom-right kernel at d = 128, 128 x 64:
    at most 128 registers (256 threads: 2 blocks per SM, as the non-causal kernel) and no spills;
    the per-element guard used to take it to 133-135 (1 block per SM)."""
    skip_without_nvrtc()
    from test_attention_tensor_core import masked_attention as attention

    mask = "causal" if Sq == Sk else "bottom_right"
    ins, outs = attention(2, 16, Sq, Sk, 128, dtype, groups=groups, mask=mask)
    k = tc.build(ins + outs, plan=plan(128, 64, True), target="cuda", arch="sm_90")
    (res,) = k.resources.values()
    assert res.registers <= 128 and res.spill_stores == 0 and res.spill_loads == 0, res


# ---- the guarded tiles peeled into a loop of their own (peel_guarded) ------------------------------

PEELED = [  # (Sq, Sk, D, dtype, mask, groups, bias, (rows, key tile, wgmma), extra step arguments)
    (200, 200, 32, "float16", "causal", 2, False, (64, 64, True), {}),
    (130, 130, 16, "bfloat16", "causal", 1, True, (128, 64, True), {}),          # a bias: every tile guarded
    (40, 300, 32, "float16", "bottom_right", 1, False, (64, 64, True), {"kv_splits": 2}),
    (150, 150, 32, "bfloat16", "causal", 2, False, (64, 64, True), {"persistent": 3}),
    (150, 150, 16, "float16", "causal", 1, False, (64, 32, False), {}),         # mma.sync
    (97, 97, 32, "float16", "causal", 1, False, (64, 64, True), {"stages": 3}),
]


@pytest.mark.parametrize("case", PEELED, ids=[f"{c[0]}x{c[1]}-d{c[2]}-{c[4]}-{c[7]}-{sorted(c[8])}" for c in PEELED])
def test_peeled_guarded_tiles_match_float64_numpy(case):
    """`peel_guarded`: the whole tiles in one loop without the guard, the partial ones after it in
    a second loop with it; against float64 NumPy with grouped heads, a bias, split-KV, the
    persistent form, the mma.sync form and a 3-stage ring, and the kernel has two key loops."""
    from tecc.ir.stmt import For

    Sq, Sk, D, dtype, mask, groups, bias_, (rows, key_tile, wgmma), extra = case
    ins, outs = masked_attention(1, 2, Sq, Sk, D, dtype, groups=groups, mask=mask, bias=bias_, lse=True)
    k, got, given = run(ins, outs, make_inputs(ins, np.random.default_rng()),
                        plan(rows, key_tile, wgmma, peel_guarded=True, **extra))
    assert k.plan.steps[0].args.get("peel_guarded") is True, k.plan
    loops = [s for s in iter_stmts(k.module.kernels[0].body) if isinstance(s, For) and s.var.name.startswith("key_tile")]
    assert len(loops) == (1 if bias_ else 2), loops   # a bias guards every tile: nothing to peel
    want, want_lse = reference(given, groups, mask, bias_)
    check(f"peeled {case}", got[0], want, bound(dtype, Sk, given[2]), k.plan)
    check(f"peeled lse {case}", got[1], want_lse, bound(dtype, Sk, given[2]), k.plan)


def test_peel_guarded_and_overlap_say_why():
    from tecc.ir.errors import ScheduleError

    ins, outs = masked_attention(1, 2, 64, 64, 32, "float16", mask="causal")
    with pytest.raises(ScheduleError, match="peel_guarded"):
        online_contraction_mma(ins + outs, 128, 64, wgmma=True, overlap=True, peel_guarded=True)


def test_grouped_causal_d128_takes_the_peeled_128x64_at_two_blocks_per_sm():
    """Grouped heads (4 per K/V head), causal, d = 128, S = 8k: the one-loop 128 x 64 kernel is
    past 128 registers (its K/V head addressing), the peeled one fits 128 (2 blocks per SM), so the
    planner takes the peeled 128 x 64 over 128 x 128 and says so."""
    skip_without_nvrtc()
    from planning import propose_wgmma

    ins, outs = masked_attention(2, 16, 8192, 8192, 128, "float16", groups=4, mask="causal")
    choice = propose_wgmma(ins + outs, "sm_90")
    assert choice is not None
    args = choice.plan.steps[0].args
    assert (args["key_tile"], args.get("peel_guarded")) == (64, True), choice.plan
    assert "2 blocks/SM" in choice.reason and "a loop of their own" in choice.reason, choice.reason


@pytest.mark.parametrize("mask,D", [("causal", 128), ("causal", 64), ("bottom_right", 128), (None, 128), (None, 64)])
def test_the_planner_launches_masked_blocks_query_block_major(mask, D):
    """The Hopper plan launches query block major over all heads exactly when the mask makes
    the blocks' key tile counts differ (isl's proven counts), and says so."""
    skip_without_nvrtc()
    from planning import propose_wgmma

    Sq = 1024 if mask == "bottom_right" else 4096
    ins, outs = masked_attention(2, 2048 // D, Sq, 4096, D, "float16", mask=mask)
    choice = propose_wgmma(ins + outs, "sm_90")
    assert choice is not None
    masked = mask is not None
    assert bool(choice.plan.steps[0].args.get("query_major")) is masked, choice.plan
    assert ("query blocks launched major over all heads" in choice.reason) is masked, choice.reason


# ---- on an sm_90 GPU ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,mask,groups,Sq,Sk,extra", [
    ("float16", "causal", 1, 1024, 1024, {}), ("bfloat16", "causal", 1, 1000, 1000, {}),
    ("float16", "bottom_right", 1, 300, 1100, {}), ("float16", "causal", 4, 1024, 1024, {"peel_guarded": True}),
    ("bfloat16", "causal", 2, 1000, 1000, {"peel_guarded": True}), (None, "causal", 1, 1024, 1024, "auto"),
    ("float16", "causal", 2, 1024, 1024, {"query_major": True})])
def test_d128_128x64_limit_guard_on_the_gpu(dtype, mask, groups, Sq, Sk, extra):
    """The d = 128 128 x 64 Hopper kernel with the limit guard (one loop and peeled; and the plan
    build(plan="auto") takes for causal d = 128; launched query block major) on an sm_90 GPU
    against float64 NumPy: tile multiples and not, grouped heads, the bottom-right mask, the
    log-sum-exp."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    ins, outs = masked_attention(2, 8, Sq, Sk, 128, dtype or "float16", groups=groups, mask=mask, lse=True)
    chosen = "auto" if extra == "auto" else plan(128, 64, True, **extra)
    k, (o, lse), given = run(ins, outs, make_inputs(ins, np.random.default_rng()), chosen, target="cuda",
                             arch="sm_90")
    if extra == "auto":
        assert k.plan.steps[0].args.get("key_tile") == 64 and k.plan.steps[0].args.get("wgmma"), k.plan
    want, want_lse = reference(given, groups, mask, False)
    check(f"gpu limit guard {dtype} {mask} G={groups} {extra}", o, want, bound(dtype or "float16", Sk, given[2]), k.plan)
    check(f"gpu limit guard lse {dtype} {mask} G={groups} {extra}", lse, want_lse, bound(dtype or "float16", Sk, given[2]),
          k.plan)


# ---- the query-major launch order (query_major) -------------------------------------------------

@pytest.mark.parametrize("wgmma,groups,mask", [(True, 2, "causal"), (True, 1, "bottom_right"), (False, 2, "causal"),
                                               (True, 1, None)])
def test_query_major_launch_is_every_block_once_longest_first_and_matches_numpy(wgmma, groups, mask):
    """`query_major`: the grid's linear block order L = x + X·y runs query block L / heads (from
    the last under a mask whose tile count grows) of head L % heads: a bijection onto (query
    block, head), every head's longest block before any shorter one; against float64 NumPy."""
    from tecc.ir.evaluate import evaluate_int
    from tecc.ir.stmt import For

    B, H, S = 2, 4, 200
    ins, outs = masked_attention(B, H, S, S if mask != "bottom_right" else S + 70, 32, "float16", groups=groups,
                                 mask=mask, lse=True)
    rows = 64
    k, got, given = run(ins, outs, make_inputs(ins, np.random.default_rng()),
                        plan(rows, 64, wgmma, query_major=True, **({} if wgmma else {"warp_rows": 16})))
    (kernel,) = k.module.kernels
    assert "query blocks major over all heads" in dict(kernel.attrs)["tensorize"]
    lets = {s.var.name: s for s in iter_stmts(kernel.body) if isinstance(s, LetStmt)}
    grid = {s.kind: s.var for s in iter_stmts(kernel.body) if isinstance(s, For) and s.kind.startswith("blockIdx")}
    X, heads = -(-S // rows), B * H
    order = []
    for y in range(heads):
        for x in range(X):
            env = {grid["blockIdx.x"]: x, grid["blockIdx.y"]: y}
            qb = evaluate_int(lets["query_block"].value, env)
            order.append((x + X * y, qb, evaluate_int(lets["head"].value, env)))
    order.sort()
    assert sorted((q, h) for _, q, h in order) == [(q, h) for q in range(X) for h in range(heads)]
    blocks = [q for _, q, _ in order]
    assert blocks == (sorted(blocks, reverse=True) if mask else sorted(blocks)), blocks
    want, want_lse = reference(given, groups, mask, False)
    Sk = int(ins[1].shape[2])
    check(f"query_major {mask} G={groups}", got[0], want, bound("float16", Sk, given[2]), k.plan)
    check(f"query_major lse {mask} G={groups}", got[1], want_lse, bound("float16", Sk, given[2]), k.plan)


def test_query_major_with_persistent_or_plain_order_says_why():
    from tecc.ir.errors import ScheduleError

    ins, outs = masked_attention(1, 2, 64, 64, 32, "float16", mask="causal")
    for extra in ({"persistent": 4, "wgmma": True}, {"plain_order": True}):
        with pytest.raises(ScheduleError, match="query_major"):
            online_contraction_mma(ins + outs, 64, 64, query_major=True, **extra)
