"""Split-KV for the tensor-core attention (online_contraction_mma(kv_splits=S)): a grid axis over
S chunks of the key tiles, each block writing float32 partial O, running max and sum of its chunk,
and a combine kernel that rescales the partials by 2^(m_s - max) and applies the program's own
epilogue. In the emulator against float64 NumPy (decoding shapes: 1..16 query rows over many
keys, grouped heads, masks, chunks left empty by a mask, both forms), the planner's choice, the
compile checks; GPU tests for sm_90."""

import numpy as np
import pytest
from test_attention_tensor_core import bound, make_inputs, masked_attention, reference, run
from test_online_contraction import check

from tecc.compiler.plan import Plan, Step
from planning import propose_mma, propose_wgmma
from tecc.compiler.strategies.online_contraction import MIN_CHUNK_TILES
from tecc.ir.errors import ScheduleError
from tecc.ir.evaluate import evaluate_int
from tecc.ir.stmt import launch_dims
import tecc as tc
from tecc.passes.rewrite.online_contraction_mma import online_contraction_mma


def split_plan(**args):
    return Plan((Step("online_contraction_mma", args),), "test", "")


SPLITS = [  # (B, H, G, Sq, Sk, D, dtype, mask, bias, lse, step args)
    (1, 2, 1, 1, 300, 32, "float16", None, False, True, dict(rows_per_block=64, key_tile=64, wgmma=True, kv_splits=3)),
    (1, 4, 2, 5, 333, 64, "bfloat16", "bottom_right", False, True,
     dict(rows_per_block=64, key_tile=64, wgmma=True, kv_splits=4)),
    (2, 4, 4, 16, 260, 16, "float16", "bottom_right", True, True,
     dict(rows_per_block=64, key_tile=128, wgmma=True, kv_splits=2)),
    (1, 2, 1, 3, 500, 32, "float16", "tensor", False, True, dict(rows_per_block=16, key_tile=32, kv_splits=5)),
    (1, 4, 2, 7, 190, 64, "bfloat16", None, False, False, dict(rows_per_block=16, key_tile=32, kv_splits=7)),
    # causal: the later chunks of the first query blocks are past the last kept key, empty
    (1, 2, 1, 150, 150, 32, "float16", "causal", False, True,
     dict(rows_per_block=64, key_tile=64, wgmma=True, kv_splits=3)),
    (1, 2, 1, 70, 70, 128, "float16", "causal", False, True, dict(rows_per_block=64, key_tile=32, kv_splits=3)),
    (2, 2, 2, 9, 250, 32, "bfloat16", "bottom_right", False, True,
     dict(rows_per_block=64, key_tile=32, warp_rows=32, kv_splits=3)),
]


@pytest.mark.parametrize("case", SPLITS, ids=[f"{c[3]}x{c[4]}-d{c[5]}-G{c[2]}-{c[7]}-{'wgmma' if c[10].get('wgmma') else 'mma'}"
                                              f"-S{c[10]['kv_splits']}" for c in SPLITS])
def test_split_kv_matches_float64_numpy(case):
    B, H, G, Sq, Sk, D, dtype, mask, bias_, lse, args = case
    ins, outs = masked_attention(B, H, Sq, Sk, D, dtype, groups=G, mask=mask, bias=bias_, lse=lse)
    rng = np.random.default_rng()
    k, got, given = run(ins, outs, make_inputs(ins, rng), split_plan(**args))
    first, combine = k.module.kernels
    assert evaluate_int(launch_dims(first).grid[2], {}) == args["kv_splits"]
    assert len(k.module.temps) == 3 and "split-KV" in dict(first.attrs)["tensorize"]
    want, want_lse = reference(given, G, mask, bias_)
    check(f"split-KV attention {case}", got[0], want, bound(dtype, Sk, given[2]), k.plan)
    if lse:
        check(f"split-KV log-sum-exp {case}", got[1], want_lse, bound(dtype, Sk, given[2]), k.plan)


def test_split_kv_rows_with_every_key_masked_are_nan_as_in_numpy():
    """A mask tensor that masks every key of some rows: l = 0 over all chunks, O = 0/0 = NaN,
    as the program (and NumPy) define it; the other rows are finite and right."""
    ins, outs = masked_attention(1, 2, 4, 200, 32, "float16", mask="tensor", lse=True)
    rng = np.random.default_rng()
    x = make_inputs(ins, rng)
    x[3][0, 0, 1, :] = False
    k, got, given = run(ins, outs, x, split_plan(rows_per_block=64, key_tile=64, wgmma=True, kv_splits=3))
    assert np.isnan(got[0][:, :, 1]).all() and not np.isnan(np.delete(got[0], 1, axis=2)).any()
    with np.errstate(invalid="ignore"):   # NumPy's 0/0 on the masked row
        want, _ = reference(given, 1, "tensor", False)
    keep = ~np.isnan(want)
    assert (np.abs(got[0][keep] - want[keep]) <= bound("float16", 200, given[2]) * (1 + np.abs(want[keep]))).all()


@pytest.mark.parametrize("arch,Sq,Sk,H,G,D", [("sm_90", 1, 32768, 16, 1, 128), ("sm_90", 4, 16384, 32, 4, 128),
                                              ("sm_80", 1, 32768, 16, 1, 64), ("sm_90", 8, 65536, 8, 1, 64)])
def test_the_planner_splits_keys_when_the_blocks_cannot_fill_the_gpu(arch, Sq, Sk, H, G, D):
    """Decoding shapes: query blocks × heads below the SM count give kv_splits = min(SMs //
    blocks, tiles // MIN_CHUNK_TILES), said in the plan; the planned kernels compile without
    spills (and, on sm_90a, without serialized wgmmas); a long prefill is not split."""
    from tecc.compiler.pipeline import wgmma_serialized
    from tecc.ir.target import target

    ins, outs = masked_attention(1, H, Sq, Sk, D, "float16", groups=G, mask="bottom_right", lse=True)
    choice = (propose_wgmma if arch == "sm_90" else propose_mma)(ins + outs, arch)
    assert choice is not None
    args = choice.plan.steps[0].args
    rows, tile = args["rows_per_block"], args["key_tile"]
    blocks = -(-Sq // rows) * H
    want = min(target(arch).sm_count // blocks, (Sk // tile) // MIN_CHUNK_TILES)
    assert args.get("kv_splits") == want and want >= 2, (args, want)
    assert "split-KV" in choice.reason
    if arch == "sm_90":
        assert rows == 64, args   # one warpgroup: at most 64 query rows
    # the kernels the build compiles (the plan's step, then the pipeline's fixed tail of passes):
    # the ones the proposal's ptxas check judged
    built = tc.build(ins + outs, arch=arch, plan=choice.plan)
    assert len(built.resources) == 2
    for res in built.resources.values():
        assert res.spill_stores == 0 and res.spill_loads == 0, built.resources
    assert wgmma_serialized(built.compile_log) is None, built.compile_log
    prefill_ins, prefill_outs = masked_attention(2, 16, 8192, 8192, 128, "float16", mask="causal")
    assert "kv_splits" not in propose_wgmma(prefill_ins + prefill_outs, "sm_90").plan.steps[0].args


def test_kv_splits_is_checked():
    ins, outs = masked_attention(1, 2, 4, 64, 32, "float16")
    for bad, what in ((0, "kv_splits=0"), (True, "kv_splits=True")):
        with pytest.raises(ScheduleError, match=what):
            online_contraction_mma(ins + outs, 64, 64, wgmma=True, kv_splits=bad)
    with pytest.raises(ScheduleError, match="persistent"):
        online_contraction_mma(ins + outs, 64, 64, wgmma=True, kv_splits=2, persistent=4)


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,Sk,H,G,D,mask", [(1, 32768, 16, 1, 128, None), (4, 16384, 32, 4, 128, "bottom_right"),
                                              (16, 8192, 8, 1, 64, "bottom_right")])
def test_split_kv_on_the_gpu(Sq, Sk, H, G, D, mask):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    ins, outs = masked_attention(1, H, Sq, Sk, D, "float16", groups=G, mask=mask, lse=True)
    rng = np.random.default_rng()
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), "auto", target="cuda", arch="sm_90")
    assert k.plan.steps[0].args.get("kv_splits", 1) > 1 and len(k.module.kernels) == 2, k.plan
    want, want_lse = reference(given, G, mask, False)
    check(f"gpu split-KV attention Sq={Sq} Sk={Sk}", o, want, bound("float16", Sk, given[2]), k.plan)
    check(f"gpu split-KV log-sum-exp Sq={Sq} Sk={Sk}", lse, want_lse, bound("float16", Sk, given[2]), k.plan)


@pytest.mark.parametrize("args", [dict(rows_per_block=64, key_tile=64, wgmma=True, kv_splits=3),
                                  dict(rows_per_block=64, key_tile=64, wgmma=True, persistent=3)],
                         ids=["split-KV", "persistent"])
def test_symbolic_lengths_split_and_persistent(args):
    """One build for symbolic query and key lengths (a bottom-right mask), run at two sizes: the
    chunk size, the work items and the grid are run-time expressions."""
    import math

    import tecc as tc

    n, m = tc.var("n"), tc.var("m")
    B, H, D = 1, 2, 32
    Q = tc.placeholder((B, H, n, D), "float16", name="Q")
    K, V = (tc.placeholder((B, H, m, D), "float16", name=x) for x in ("K", "V"))
    d = tc.reduce_axis(D, name="d")
    S = tc.compute((B, H, n, m), lambda b, h, i, j: tc.where(
        j <= i + (m - n), tc.sum(tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h, j, d], "float32"), axis=d)
        * (1 / math.sqrt(D)), -math.inf), name="S")
    j1, j2, j3 = (tc.reduce_axis(m, name=x) for x in ("j1", "j2", "j3"))
    mx = tc.compute((B, H, n), lambda b, h, i: tc.max(S[b, h, i, j1], axis=j1), name="m")
    e = tc.compute((B, H, n, m), lambda b, h, i, j: tc.exp(S[b, h, i, j] - mx[b, h, i]), name="e")
    l = tc.compute((B, H, n), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
    O = tc.compute((B, H, n, D), lambda b, h, i, c: tc.cast(
        tc.sum(e[b, h, i, j3] * tc.cast(V[b, h, j3, c], "float32"), axis=j3) / l[b, h, i], "float16"), name="O")
    k = tc.build([Q, K, V, O], target="sim", plan=split_plan(**args))
    rng = np.random.default_rng()
    for Sq, Sk in ((5, 300), (130, 140)):
        x = [rng.standard_normal(s).astype(np.float16) for s in ((B, H, Sq, D), (B, H, Sk, D), (B, H, Sk, D))]
        o = np.full((B, H, Sq, D), np.nan, np.float16)
        k(*x, o)
        want, _ = reference([a.astype(np.float64) for a in x], 1, "bottom_right", False)
        check(f"symbolic {args} {Sq}x{Sk}", o.astype(np.float64), want, bound("float16", Sk, x[2]), k.plan)
