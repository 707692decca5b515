"""The Hopper form of the tensor-core attention (online_contraction_mma(wgmma=True)): wgmma with
its A operand from registers (the intrinsic table's operand 'a' of the wgmma rows, pinned against
the PTX ISA's figure and run in the emulator), and attention as ONE warpgroup kernel (S = Q·Kᵀ
and O += P·V on wgmma, P from registers) matching float64 NumPy in the emulator for the variants
of test_attention_tensor_core.py, chosen by plan="auto" on sm_90 (mma.sync on sm_80, saying
why), compiling for sm_90a without spills or serialized wgmmas; GPU tests for sm_90."""

import math

import numpy as np
import pytest
from hopper_kernels import register_a_kernel
from test_attention_tensor_core import (
    VARIANTS,
    bound,
    key_loop,
    keep_mask,
    make_inputs,
    masked_attention,
    query_block,
    reference,
    run,
)
from test_hopper_sim import HALF
from test_online_contraction import check

from tecc.compiler.plan import Plan, Step
from planning import propose_mma, propose_wgmma
from tecc.ir.errors import ScheduleError
from tecc.ir.evaluate import evaluate_int
from tecc.ir.intrinsics import WGMMA_N, lookup
from tecc.ir.stmt import Allocate, For, FragmentRef, MatrixMultiply, WarpgroupMatrixMultiply, iter_stmts
from tecc.passes.rewrite.online_contraction_mma import online_contraction_mma
from tecc.runtime.sim import simulate_kernel
from nvrtc_checks import skip_without_nvrtc


def wgmma_plan(rows=64, key_tile=64, overlap=False):
    args = {"rows_per_block": rows, "key_tile": key_tile, "wgmma": True}
    if overlap:
        args["overlap"] = True
    return Plan((Step("online_contraction_mma", args),), "test", "")


# ---- wgmma with A from registers ----------------------------------------------------------------

@pytest.mark.parametrize("n", WGMMA_N)
def test_register_a_layout_is_the_ptx_isa_figure(n):
    """PTX ISA, "Register fragment layout for matrix A" of wgmma .m64nNk16 (16-bit types): the
    64 x 16 tile is split into four 16-row slices, slice w held by warp w of the warpgroup; in it,
    element (r, c) is held by lane 4·(r % 8) + (c % 8) // 2 as a_i, i = c % 2 + 2·(r // 8) + 4·(c // 8).
    Written here from the figure's side (which thread holds a tile element) and checked to be a
    bijection with the table's map."""
    op = lookup(f"wgmma.m64n{n}k16.f32.f16").operand("a")
    assert (op.rows, op.cols, op.elements, op.registers) == (64, 16, 8, 4)
    seen = set()
    for r in range(64):
        for c in range(16):
            w, rr = divmod(r, 16)
            thread = 32 * w + 4 * (rr % 8) + (c % 8) // 2
            element = c % 2 + 2 * (rr // 8) + 4 * (c // 8)
            assert op.layout(thread, element) == (r, c), (r, c, thread, element)
            seen.add((thread, element))
    assert len(seen) == 128 * 8


def test_register_a_is_the_accumulator_layout_of_a_k16_slice():
    """FlashAttention-3's relayout: accumulator elements 8k .. 8k + 7 of the scores' wgmma (n8
    blocks 2k and 2k + 1) are the register A of k16 step k of P·V, column for column."""
    d = lookup("wgmma.m64n128k16.f32.bf16").operand("d").layout
    a = lookup("wgmma.m64n64k16.f32.bf16").operand("a").layout
    for thread in range(128):
        for k in range(8):
            for e in range(8):
                r, c = d(thread, 8 * k + e)
                assert a(thread, e) == (r, c - 16 * k)


@pytest.mark.parametrize("n,ab,b_swizzle,b_major,k_steps", [
    (64, "f16", "128B", "K", 1), (128, "bf16", "128B", "MN", 1), (64, "f16", "128B", "K", 4),
    (32, "bf16", "64B", "MN", 2), (256, "f16", "none", "K", 1)])
def test_wgmma_with_a_from_registers_matches_numpy(n, ab, b_swizzle, b_major, k_steps):
    func = register_a_kernel(n, ab, b_swizzle, b_major, k_steps)
    rng = np.random.default_rng()
    k = 16 * k_steps
    a = rng.standard_normal((64, k)).astype(HALF[ab])
    b_kn = rng.standard_normal((k, n)).astype(HALF[ab])
    b = np.ascontiguousarray(b_kn.T) if b_major == "K" else b_kn
    d = np.full((64, n), np.nan, np.float32)
    simulate_kernel(func, {"A": a, "B": b, "D": d}, (1, 1, 1), (128, 1, 1))
    a64, b64 = a.astype(np.float64), b_kn.astype(np.float64)
    want = a64 @ b64
    assert ((np.abs(d - want)) <= (k + 1) * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64))).all(), func.name


def test_register_a_prints_the_register_form():
    from tecc.codegen import compile_cuda, emit_source

    src = emit_source([register_a_kernel(64, "bf16", "128B", "MN", 2)])
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in src
    compiled = compile_cuda(src, arch="sm_90", name="register_a")
    assert compiled.arch == "sm_90a"


def test_register_a_must_be_the_rows_a_fragment():
    from tecc.ir import dtype as dt
    from tecc.ir.intrinsics import IntrinsicError
    from tecc.ir.stmt import Buffer

    func = register_a_kernel()
    wg = next(s for s in iter_stmts(func.body) if isinstance(s, WarpgroupMatrixMultiply))
    wrong = Buffer("acc2", dt.float32, (32,), "fragment", fragment=(wg.intrinsic, "d"))
    with pytest.raises(IntrinsicError, match="register operand A"):
        WarpgroupMatrixMultiply(wg.intrinsic, wg.d, FragmentRef(wrong, 0), wg.b, wg.scale_d)


# ---- attention in the Hopper form ---------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("S", [45, 80])
def test_wgmma_attention_matches_float64_numpy(variant, S):
    """The wgmma form's plan for sm_90 (the strategy's best point that compiles cleanly; at
    these sizes, a block or two per head, the planner's ranking against mma.sync is within the
    model's error either way): one kernel, no temporaries."""
    kw = dict(VARIANTS[variant])
    groups, lse = kw.pop("groups", 1), kw.pop("lse", False)
    D = 64 if S == 80 else 32
    ins, outs = masked_attention(1, 2, S, S, D, "float16", groups=groups, lse=lse, **kw)
    rng = np.random.default_rng()
    choice = propose_wgmma(ins + outs, "sm_90")
    assert choice is not None
    k, got, given = run(ins, outs, make_inputs(ins, rng), choice.plan, arch="sm_90")
    assert k.plan.strategy == "online_contraction_mma" and k.plan.steps[0].args.get("wgmma"), k.plan
    assert len(k.module.kernels) == 1 and not k.module.temps
    want, want_lse = reference(given, groups, kw["mask"], kw.get("bias", False))
    check(f"wgmma attention {variant} S={S}", got[0], want, bound("float16", S, given[2]), k.plan)
    if lse:
        check(f"wgmma log-sum-exp {variant}", got[1], want_lse, bound("float16", S, given[2]), k.plan)


SWEEP = [  # (Sq, Sk, D, dtype, mask, bias, groups, log-sum-exp, (rows, key tile, overlapped))
    (1, 1, 16, "float16", None, False, 1, True, (64, 64, False)),
    (1, 1, 16, "bfloat16", "causal", False, 1, True, (64, 64, True)),
    (21, 70, 16, "bfloat16", "bottom_right", False, 1, True, (64, 128, False)),
    (65, 5, 32, "float16", "causal", True, 1, False, (128, 64, True)),
    (70, 77, 64, "bfloat16", "tensor", True, 2, True, (128, 128, False)),
    (17, 33, 32, "bfloat16", "bottom_right", True, 1, True, (64, 64, False)),
    (80, 80, 128, "float16", "causal", False, 2, True, (128, 64, False)),
    (45, 45, 128, "bfloat16", None, True, 1, True, (64, 128, False)),
    (40, 260, 32, "float16", "bottom_right", True, 2, True, (64, 64, True)),   # 5 tiles: the 3-stage ring wraps
    (200, 200, 16, "bfloat16", "causal", False, 1, True, (128, 64, True)),
    (45, 80, 128, "float16", "tensor", False, 1, True, (64, 64, True)),
]


@pytest.mark.parametrize("case", SWEEP, ids=[f"{c[0]}x{c[1]}-d{c[2]}-{c[3]}-{c[4]}-{c[8]}" for c in SWEEP])
def test_wgmma_edge_shapes_and_tilings(case):
    """Single rows and keys, fewer keys than a tile, more keys than queries and fewer, every mask
    form with a bias, grouped heads, head dims 16..128 (32B, 64B and 128B swizzles, two 64-column
    blocks at 128), one or two warpgroups, 64- and 128-key tiles, overlapped or not."""
    Sq, Sk, D, dtype, mask, bias_, groups, lse, tiling = case
    ins, outs = masked_attention(1, 2, Sq, Sk, D, dtype, groups=groups, mask=mask, bias=bias_, lse=lse)
    rng = np.random.default_rng()
    k, got, given = run(ins, outs, make_inputs(ins, rng), wgmma_plan(*tiling))
    assert len(k.module.kernels) == 1 and not k.module.temps
    want, want_lse = reference(given, groups, mask, bias_)
    check(f"wgmma attention {case}", got[0], want, bound(dtype, Sk, given[2]), k.plan)
    if lse:
        check(f"wgmma log-sum-exp {case}", got[1], want_lse, bound(dtype, Sk, given[2]), k.plan)


def test_the_plan_is_wgmma_on_sm_90_and_mma_sync_on_sm_80():
    ins, outs = masked_attention(1, 2, 200, 200, 64, "float16", mask="causal", lse=True)
    hopper = propose_wgmma(ins + outs, "sm_90")
    assert hopper is not None and hopper.plan.steps[0].args["wgmma"] is True, hopper
    assert "wgmma" in hopper.reason and "P·V with P from registers" in hopper.reason
    assert propose_wgmma(ins + outs, "sm_80") is None
    ampere = propose_mma(ins + outs, "sm_80")
    assert ampere is not None and "wgmma" not in ampere.plan.steps[0].args
    assert "mma.sync, not wgmma: wgmma is sm_90a only, the target is sm_80" in ampere.reason, ampere.reason
    for arch, statement in (("sm_90", WarpgroupMatrixMultiply), ("sm_80", MatrixMultiply)):
        mod = online_contraction_mma(ins + outs, **(hopper if arch == "sm_90" else ampere).plan.steps[0].args)
        (kernel,) = mod.kernels
        found = [s for s in iter_stmts(kernel.body) if isinstance(s, statement)]
        assert found, arch
        other = MatrixMultiply if statement is WarpgroupMatrixMultiply else WarpgroupMatrixMultiply
        assert not any(isinstance(s, other) for s in iter_stmts(kernel.body)), arch
    # P·V reads P from registers; the scores read Q from shared memory
    (kernel,) = online_contraction_mma(ins + outs, **hopper.plan.steps[0].args).kernels
    wg = [s for s in iter_stmts(kernel.body) if isinstance(s, WarpgroupMatrixMultiply)]
    assert {isinstance(s.a, FragmentRef) for s in wg} == {True, False}


def test_one_kernel_no_score_matrix():
    """One kernel, no temporaries, and no buffer whose size depends on the sequence length (the
    same allocations at S = 200 and 400: tiles only)."""
    sizes = []
    for S in (200, 400):
        ins, outs = masked_attention(1, 2, S, S, 64, "float16", mask="causal", lse=True)
        mod = online_contraction_mma(ins + outs, 128, 128, wgmma=True)
        assert len(mod.kernels) == 1 and not mod.temps
        sizes.append(sorted(math.prod(int(s) for s in st.buffer.shape) for st in iter_stmts(mod.kernels[0].body)
                            if isinstance(st, Allocate)))
    assert sizes[0] == sizes[1] and max(sizes[0]) < 200 * 200, sizes


@pytest.mark.parametrize("mask,Sq,Sk", [("causal", 300, 300), ("bottom_right", 40, 200), (None, 45, 45)])
def test_fully_masked_key_tiles_are_not_visited(mask, Sq, Sk):
    rows, key_tile = 128, 64
    ins, outs = masked_attention(1, 2, Sq, Sk, 16, "float16", mask=mask)
    (kernel,) = online_contraction_mma(ins + outs, rows, key_tile, wgmma=True).kernels
    loop = key_loop(kernel)
    assert any(isinstance(s, WarpgroupMatrixMultiply) for s in iter_stmts(loop.body))
    block = query_block(kernel)
    keep = keep_mask(mask, Sq, Sk)
    visited = 0
    for b in range(-(-Sq // rows)):
        kept = np.nonzero(keep[b * rows:(b + 1) * rows].any(axis=0))[0]
        want = -(-(int(kept.max()) + 1) // key_tile) if mask else -(-Sk // key_tile)
        got = evaluate_int(loop.extent, {block: b})
        assert got == want, (mask, b, loop.extent)
        visited += got
    if mask == "causal":
        assert visited < -(-Sq // rows) * -(-Sk // key_tile)


def test_blocks_per_sm_becomes_the_launch_bounds():
    from tecc.codegen import emit_source

    ins, outs = masked_attention(1, 2, 70, 70, 64, "bfloat16", mask="causal", lse=True)
    mod = online_contraction_mma(ins + outs, 128, 64, wgmma=True, blocks_per_sm=2)
    assert dict(mod.kernels[0].attrs)["min_blocks_per_sm"] == 2
    assert "__launch_bounds__(256, 2)" in emit_source(mod.kernels)
    rng = np.random.default_rng()
    plan = Plan((Step("online_contraction_mma", {"rows_per_block": 128, "key_tile": 64, "wgmma": True,
                                                 "blocks_per_sm": 2}),), "test", "")
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), plan)
    want, want_lse = reference(given, 1, "causal", False)
    check("wgmma attention, 2 blocks per SM", o, want, bound("bfloat16", 70, given[2]), k.plan)
    check("wgmma log-sum-exp, 2 blocks per SM", lse, want_lse, bound("bfloat16", 70, given[2]), k.plan)
    with pytest.raises(ScheduleError, match="blocks_per_sm"):
        online_contraction_mma(ins + outs, 64, 64, blocks_per_sm=2)


def test_the_overlapped_ring_needs_three_stages(monkeypatch):
    """The overlapped loop reads tile kt's V and tile kt + 1's K while kt + 2 loads: with a
    2-stage ring the copy lands on an operand a wgmma reads, and the emulator says so."""
    import tecc.passes.rewrite.online_contraction_mma as rewrite
    from tecc.ir.errors import RaceError

    ins, outs = masked_attention(1, 1, 64, 200, 16, "float16", mask=None)
    rng = np.random.default_rng()
    monkeypatch.setattr(rewrite, "OVERLAP_STAGES", 2)
    with pytest.raises(RaceError, match="asynchronous copy is still writing|wgmma operand race"):
        run(ins, outs, make_inputs(ins, rng), wgmma_plan(64, 64, overlap=True))


def test_the_overlapped_loop_keeps_p_v_in_flight_during_the_softmax():
    """In the loop: S(kt + 1) and P(kt)·V are issued, then wait_group 1 (the scores), then the
    softmax, then wait_group 0 (O)."""
    from tecc.ir.stmt import WarpgroupWait

    ins, outs = masked_attention(1, 2, 200, 200, 64, "float16", mask="causal")
    (kernel,) = online_contraction_mma(ins + outs, 128, 64, wgmma=True, overlap=True).kernels
    loop = key_loop(kernel)
    order = [s for s in iter_stmts(loop.body) if isinstance(s, (WarpgroupMatrixMultiply, WarpgroupWait))]
    waits = [i for i, s in enumerate(order) if isinstance(s, WarpgroupWait)]
    assert [order[i].pending for i in waits] == [1, 0]
    issued = order[:waits[0]]
    assert {isinstance(s.a, FragmentRef) for s in issued} == {True, False}   # S(kt + 1) and P·V
    assert dict(kernel.attrs)["tensorize"].count("3-stage") == 1


def test_a_tiling_over_the_shared_memory_limit_says_why():
    ins, outs = masked_attention(1, 2, 20, 20, 256, "float16")
    with pytest.raises(ScheduleError, match="KiB of shared memory; sm_90 allows 227 KiB"):
        online_contraction_mma(ins + outs, 128, 128, wgmma=True)


@pytest.mark.parametrize("rows,key_tile", [(96, 64), (128, 32), (128, 256)])
def test_bad_tilings_say_why(rows, key_tile):
    ins, outs = masked_attention(1, 2, 20, 20, 32, "float16")
    with pytest.raises(ScheduleError, match="wgmma"):
        online_contraction_mma(ins + outs, rows, key_tile, wgmma=True)


@pytest.mark.parametrize("D,dtype,mask", [(64, "float16", "causal"), (64, "bfloat16", None),
                                          (128, "float16", None), (128, "bfloat16", "causal"),
                                          (96, "float16", "causal"), (256, "bfloat16", "causal"), (256, "float16", None)])
def test_planned_wgmma_kernels_compile_for_sm_90a_without_spills(D, dtype, mask):
    from tecc.codegen import compile_cuda, emit_source
    from tecc.compiler.pipeline import wgmma_serialized

    ins, outs = masked_attention(2, 4, 200, 200, D, dtype, groups=2, lse=True, mask=mask)
    choice = propose_wgmma(ins + outs, "sm_90")
    assert choice is not None
    mod = online_contraction_mma(ins + outs, **choice.plan.steps[0].args)
    compiled = compile_cuda(emit_source(mod.kernels), arch="sm_90", name="attention_wgmma")
    (res,) = compiled.resources.values()
    assert compiled.arch == "sm_90a"
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.registers <= 255, res
    assert wgmma_serialized(compiled.log) is None, compiled.log
    from tecc.codegen import dynamic_shared_bytes
    assert dynamic_shared_bytes(mod.kernels[0]) <= 227 * 1024   # sm_90's opt-in limit per block


# ---- on an sm_90 GPU ----------------------------------------------------------------------------

GPU_CASES = [(64, "float16", None, 1, 1024), (64, "float16", "causal", 1, 1024), (128, "float16", "causal", 1, 1024),
             (128, "bfloat16", None, 1, 1024), (64, "bfloat16", "causal", 4, 1024), (128, "float16", "causal", 2, 200),
             (64, "bfloat16", None, 2, 200), (64, "float16", "bottom_right", 1, 200),
             # head dims 96 and 256 on wgmma; grouped heads launched side by side, long blocks first
             (96, "float16", "causal", 4, 1024), (96, "bfloat16", None, 1, 200), (256, "bfloat16", "causal", 2, 1024),
             (256, "float16", None, 1, 200), (128, "float16", "causal", 4, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("D,dtype,mask,groups,S", GPU_CASES)
def test_wgmma_attention_on_the_gpu(D, dtype, mask, groups, S):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    B, H = 2, 8
    Sq = S if mask != "bottom_right" else S // 2
    ins, outs = masked_attention(B, H, Sq, S, D, dtype, groups=groups, mask=mask, lse=True)
    rng = np.random.default_rng()
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), "auto", target="cuda", arch="sm_90")
    assert k.plan.steps[0].args.get("wgmma") and len(k.module.kernels) == 1, k.plan
    want, want_lse = reference(given, groups, mask, False)
    check(f"gpu wgmma attention d={D} {dtype} {mask} G={groups} S={S}", o, want, bound(dtype, S, given[2]), k.plan)
    check(f"gpu wgmma log-sum-exp d={D} {dtype} {mask}", lse, want_lse, bound(dtype, S, given[2]), k.plan)


# ---- head dims 96 and 256 on wgmma ------------------------------------------------------------------

HEAD_DIMS = [  # (Sq, Sk, D, dtype, mask, groups, (rows, key tile))
    (45, 45, 96, "float16", "causal", 1, (64, 64)),
    (70, 77, 96, "bfloat16", "bottom_right", 2, (128, 128)),
    (33, 33, 96, "bfloat16", "tensor", 1, (128, 64)),
    (70, 70, 256, "float16", "causal", 2, (128, 64)),
    (17, 130, 256, "bfloat16", None, 1, (64, 64)),
]


@pytest.mark.parametrize("case", HEAD_DIMS, ids=[f"{c[0]}x{c[1]}-d{c[2]}-{c[3]}-{c[4]}-G{c[5]}" for c in HEAD_DIMS])
def test_head_dims_96_and_256_match_float64_numpy(case):
    """d = 96 (three 32-half blocks per row, the 64B swizzle; wgmma n = 96 for P·V) and d = 256
    (four 128B blocks, n = 256) on wgmma, odd lengths, every mask form, grouped heads."""
    Sq, Sk, D, dtype, mask, groups, tiling = case
    ins, outs = masked_attention(1, 2, Sq, Sk, D, dtype, groups=groups, mask=mask, lse=True)
    rng = np.random.default_rng()
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), wgmma_plan(*tiling))
    assert len(k.module.kernels) == 1 and not k.module.temps
    want, want_lse = reference(given, groups, mask, False)
    check(f"wgmma attention {case}", o, want, bound(dtype, Sk, given[2]), k.plan)
    check(f"wgmma log-sum-exp {case}", lse, want_lse, bound(dtype, Sk, given[2]), k.plan)


@pytest.mark.parametrize("D", [96, 256])
def test_head_dims_96_and_256_plan_wgmma_on_sm_90(D):
    """plan="auto" on sm_90 takes the wgmma form for both (at the benchmark's sizes: B = 16,
    H = 2048 // d, S = 1024); the form's plan matches NumPy; on sm_80 d = 96 runs on mma.sync
    (padded rows) and d = 256 falls back to SIMT, saying why."""
    from tecc.compiler.planner import plan_program

    big = sum(masked_attention(16, 2048 // D, 1024, 1024, D, "float16", mask=None), [])
    planned = plan_program(big, "sm_90").plan
    assert planned.strategy == "online_contraction_mma" and planned.steps[0].args.get("wgmma"), planned
    ins, outs = masked_attention(1, 2, 100, 100, D, "float16", mask="causal", lse=True)
    hopper = propose_wgmma(ins + outs, "sm_90")
    assert hopper is not None and hopper.plan.steps[0].args["wgmma"] is True, hopper
    assert hopper.plan.steps[0].args["key_tile"] == 64 or D < 256
    rng = np.random.default_rng()
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), hopper.plan, arch="sm_90")
    assert k.plan.steps[0].args.get("wgmma"), k.plan
    want, want_lse = reference(given, 1, "causal", False)
    check(f"planned wgmma attention d={D}", o, want, bound("float16", 100, given[2]), k.plan)
    ampere = propose_mma(ins + outs, "sm_80")
    if D == 256:
        assert ampere is None
        with pytest.raises(ScheduleError, match="mma.sync form takes a power of two"):
            online_contraction_mma(ins + outs, 64, 64)
    else:
        assert ampere is not None and "wgmma" not in ampere.plan.steps[0].args, ampere


@pytest.mark.parametrize("case", [(70, 96, "float16", "causal", 2, (64, 64, 16)),
                                  (45, 96, "bfloat16", "tensor", 1, (64, 32, 16)),
                                  (77, 96, "float16", "bottom_right", 1, (128, 64, 32))])
def test_head_dim_96_on_mma_sync_matches_float64_numpy(case):
    """d = 96 on mma.sync: tiles of rows padded to 104 halves (no swizzle), six k16 steps."""
    S, D, dtype, mask, groups, (rows, key_tile, warp_rows) = case
    ins, outs = masked_attention(1, 2, S, S, D, dtype, groups=groups, mask=mask, lse=True)
    plan = Plan((Step("online_contraction_mma", {"rows_per_block": rows, "key_tile": key_tile,
                                                 "warp_rows": warp_rows}),), "test", "")
    rng = np.random.default_rng()
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), plan)
    want, want_lse = reference(given, groups, mask, False)
    check(f"mma.sync attention {case}", o, want, bound(dtype, S, given[2]), k.plan)
    check(f"mma.sync log-sum-exp {case}", lse, want_lse, bound(dtype, S, given[2]), k.plan)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_head_dim_96_mma_sync_compiles_without_spills(arch):
    from tecc.codegen import compile_cuda, emit_source

    ins, outs = masked_attention(2, 4, 200, 200, 96, "float16", groups=2, lse=True, mask="causal")
    choice = propose_mma(ins + outs, arch)
    assert choice is not None
    mod = online_contraction_mma(ins + outs, **choice.plan.steps[0].args)
    (res,) = compile_cuda(emit_source(mod.kernels), arch=arch, name="attention_mma_96").resources.values()
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.registers <= 255, res


# ---- the launch order: grouped heads side by side, the longest query blocks first ------------------

def _grid_order(kernel):
    """(query block, head) of each block in launch order (x fastest), from the kernel's lets."""
    from tecc.ir.stmt import LetStmt, launch_dims

    grid = launch_dims(kernel).grid
    X, Y = (evaluate_int(g, {}) for g in grid[:2])
    blocks = {s.kind: s.var for s in iter_stmts(kernel.body) if isinstance(s, For) and s.is_block}
    lets = {s.var.name.rstrip("0123456789_"): s for s in iter_stmts(kernel.body) if isinstance(s, LetStmt)}
    order = []
    for y in range(Y):
        for x in range(X):
            at = {blocks["blockIdx.x"]: x, blocks["blockIdx.y"]: y}
            order.append((evaluate_int(lets["query_block"].value, at), evaluate_int(lets["head"].value, at)))
    return order, X, Y


@pytest.mark.parametrize("wgmma", [True, False])
def test_grouped_heads_launch_side_by_side_and_long_blocks_first(wgmma):
    """Causal, 8 query heads over 2 K/V heads (B = 2): every (query block, head) once; the 4
    heads of one K/V head at the same query block are consecutive blocks of the launch; within
    them the query blocks run from the one with the most key tiles (the loop bound, evaluated)."""
    B, H, G, S, rows = 2, 8, 4, 300, 64
    ins, outs = masked_attention(B, H, S, S, 32, "float16", groups=G, mask="causal")
    kw = dict(wgmma=True) if wgmma else {}
    (kernel,) = online_contraction_mma(ins + outs, rows, 64, **kw).kernels
    assert "launched side by side" in dict(kernel.attrs)["tensorize"]
    order, X, Y = _grid_order(kernel)
    assert sorted(order) == [(q, h) for q in range(X) for h in range(Y)]
    extent = key_loop(kernel).extent
    qb = query_block(kernel)
    tiles = [evaluate_int(extent, {qb: q}) for q, _ in order]
    for at in range(0, len(order), G):
        run_of = order[at:at + G]
        assert len({q for q, _ in run_of}) == 1 and len({h // G for _, h in run_of}) == 1, run_of
    per_group = X * G
    for at in range(0, len(order), per_group):
        t = tiles[at:at + per_group]
        assert t == sorted(t, reverse=True) and t[0] > t[-1], t


def test_launch_order_is_plain_without_groups_or_growing_tiles():
    from tecc.ir.stmt import LetStmt

    ins, outs = masked_attention(1, 4, 200, 200, 32, "float16", mask=None)
    (kernel,) = online_contraction_mma(ins + outs, 64, 64, wgmma=True).kernels
    # the guarded tile's key limits are lets too (limited_guard); the launch order's bind the block
    lets = [s.var.name for s in iter_stmts(kernel.body) if isinstance(s, LetStmt)]
    assert not [n for n in lets if not n.startswith("key_limit")], lets


def test_kv_group_reads_the_index_structure():
    """G from K/V's leading indices: h // G with G dividing H; h itself, h % 2 or a G that does
    not divide H give 1 (no grouping assumed)."""
    import tecc as tc
    from tecc.passes.rewrite.online_contraction import online_chain
    from tecc.passes.rewrite.launch_order import kv_group
    from tecc.passes.rewrite.online_contraction_mma import tensor_core_chain

    def chain(H, kv_heads, index):
        Q = tc.placeholder((2, H, 40, 32), "float16", name="Q")
        K = tc.placeholder((2, kv_heads, 40, 32), "float16", name="K")
        V = tc.placeholder((2, kv_heads, 40, 32), "float16", name="V")
        d = tc.reduce_axis(32, name="d")
        j1, j2, j3 = (tc.reduce_axis(40, name=n) for n in ("j1", "j2", "j3"))
        S = tc.compute((2, H, 40, 40), lambda b, h, i, j: tc.sum(
            tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, index(h), j, d], "float32"), axis=d), name="S")
        m = tc.compute((2, H, 40), lambda b, h, i: tc.max(S[b, h, i, j1], axis=j1), name="m")
        e = tc.compute((2, H, 40, 40), lambda b, h, i, j: tc.exp(S[b, h, i, j] - m[b, h, i]), name="e")
        l = tc.compute((2, H, 40), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
        O = tc.compute((2, H, 40, 32), lambda b, h, i, c: tc.cast(tc.sum(
            e[b, h, i, j3] * tc.cast(V[b, index(h), j3, c], "float32"), axis=j3) / l[b, h, i], "float16"), name="O")
        tcc = tensor_core_chain(online_chain([Q, K, V, O]))
        return kv_group(tcc.chain, (tcc.k, tcc.v))

    assert chain(8, 2, lambda h: h // 4) == 4
    assert chain(8, 8, lambda h: h) == 1
    assert chain(8, 2, lambda h: h % 2) == 1
    assert chain(6, 2, lambda h: h // 4) == 1


def test_plain_order_step_keeps_the_plain_grid():
    """Step arg "plain_order": the plain grid (for timing against the reordered one), same values."""
    from tecc.ir.stmt import LetStmt

    ins, outs = masked_attention(1, 4, 130, 130, 32, "bfloat16", groups=2, mask="causal", lse=True)
    plan = Plan((Step("online_contraction_mma", {"rows_per_block": 64, "key_tile": 64, "wgmma": True,
                                                 "plain_order": True}),), "test", "")
    rng = np.random.default_rng()
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), plan)
    assert not any(isinstance(s, LetStmt) and not s.var.name.startswith("key_limit")   # the guard's limits
                   for s in iter_stmts(k.module.kernels[0].body))
    assert k.plan.steps[0].args.get("plain_order") is True
    want, want_lse = reference(given, 2, "causal", False)
    check("wgmma attention, plain order", o, want, bound("bfloat16", 130, given[2]), k.plan)


@pytest.mark.parametrize("wgmma", [True, False])
def test_launch_order_with_a_symbolic_sequence_length(wgmma):
    """A symbolic n: isl proves the tile counts grow for every n, the lets use the symbolic number
    of query blocks; grouped causal attention matches NumPy at several n (1, 2 and 3 blocks)."""
    import tecc as tc

    n = tc.var("n")
    ins, outs = masked_attention(1, 4, n, n, 16, "bfloat16", groups=2, mask="causal")
    args = {"rows_per_block": 64, "key_tile": 64, **({"wgmma": True} if wgmma else {})}
    k = tc.build(ins + outs, target="sim", plan=Plan((Step("online_contraction_mma", args),), "test", ""))
    assert "launched side by side" in dict(k.module.kernels[0].attrs)["tensorize"]
    assert "launched from the last" in dict(k.module.kernels[0].attrs)["tensorize"]
    rng = np.random.default_rng()
    for size in (50, 100, 150):
        x = [rng.standard_normal((1, 4 // (2 if t else 1), size, 16)).astype(np.float32).astype(HALF["bf16"])
             for t in (0, 1, 1)]
        o = np.full((1, 4, size, 16), np.nan, HALF["bf16"])
        k(*x, o)
        given = [a.astype(np.float64) for a in x]
        want, _ = reference(given, 2, "causal", False)
        check(f"symbolic n={size}", o.astype(np.float64), want, bound("bfloat16", size, given[2]), k.plan)


# ---- the tiling under a mask that skips key tiles: the fitted cost per block -----------------------


def _predicted_us(form, d, rows, key_tile, per_sm, tiles, guarded, blocks, overlap=False, warp_rows=0):
    """The cost model's time of a launch of `blocks` blocks visiting `tiles` key tiles (`guarded`
    of them with the per-element guard) at `per_sm` blocks per SM on the H200's sm_90 figures."""
    from tecc.compiler.cost.attention import AttentionLaunch, Tiling, attention_workload
    from tecc.compiler.cost.model import predict
    from tecc.compiler.strategies.online_contraction import shared_bytes
    from tecc.ir.target import target

    tgt = target("sm_90")
    tiling = Tiling(form, rows, key_tile, warp_rows, overlap)
    launch = AttentionLaunch(blocks=blocks, tiles=tiles, guarded=guarded, heads=blocks * rows // 8192, query_rows=8192,
                             keys=8192, depth=d, columns=d, itemsize=2)
    registers = 65536 // (per_sm * tiling.threads) // 8 * 8       # the registers that give that occupancy
    smem = shared_bytes(rows, key_tile, d, d, 2, 3 if overlap else 2) if per_sm == 1 else 1024
    return predict(attention_workload(tiling, launch, min(registers, 255), smem, per_sm, tgt), tgt).total * 1e6


# (form, d, rows, key tile, blocks per SM, tiles, guarded, blocks, measured us, tolerance): the
# H200 times the table of tecc.compiler.cost.attention was fitted on (attention.py stop 23,
# attention_tilings.py; B = 16384 / S, H = 2048 / d)
MEASURED = [
    ("wgmma", 128, 128, 64, 2, 16, 0, 2048, 306, 0.03), ("wgmma", 128, 128, 64, 2, 32, 0, 2048, 569, 0.04),
    ("wgmma", 128, 128, 64, 2, 64, 0, 2048, 1026, 0.03), ("wgmma", 128, 128, 64, 2, 128, 0, 2048, 1988, 0.03),
    ("wgmma", 128, 128, 64, 2, 256, 0, 2048, 3889, 0.03),
    ("wgmma", 64, 128, 128, 2, 8, 0, 4096, 377, 0.03), ("wgmma", 64, 128, 128, 2, 16, 0, 4096, 621, 0.06),
    ("wgmma", 64, 128, 128, 2, 32, 0, 4096, 1195, 0.03), ("wgmma", 64, 128, 128, 2, 64, 0, 4096, 2283, 0.03),
    ("wgmma", 64, 128, 128, 2, 128, 0, 4096, 4476, 0.03), ("wgmma", 64, 128, 128, 2, 32.5, 1, 4096, 1255, 0.03),
    ("wgmma", 128, 128, 128, 1, 32, 0, 2048, 1165, 0.04), ("wgmma", 128, 128, 128, 1, 32.5, 1, 2048, 1202.5, 0.04),
    ("wgmma", 128, 128, 64, 1, 65, 2, 2048, 1394.3, 0.04), ("wgmma", 64, 128, 64, 2, 64, 0, 4096, 1340, 0.04),
    ("wgmma", 64, 64, 64, 4, 64, 0, 8192, 1319, 0.03),
]


@pytest.mark.parametrize("form,d,rows,key_tile,per_sm,tiles,guarded,blocks,measured,tolerance", MEASURED)
def test_the_attention_cost_reproduces_the_timings_it_was_fitted_on(form, d, rows, key_tile, per_sm, tiles, guarded,
                                                                    blocks, measured, tolerance):
    """cost/attention.py's table through the cost model (block cost on the chain term, the waves
    of the launch): the H200 times it was fitted on, within the fit's error."""
    predicted = _predicted_us(form, d, rows, key_tile, per_sm, tiles, guarded, blocks)
    assert abs(predicted - measured) <= tolerance * measured, (predicted, measured)


def test_the_attention_cost_ranks_the_timed_tilings_as_they_were_measured():
    """The model orders the tilings timed against each other as the GPU did (attention_tilings.py,
    S = 4096, not causal): d = 64 wgmma 128 x 128 (1235 us) < 64 x 64 asking 4 blocks/SM (1319) <
    128 x 64 (1340) < 128 x 64 overlapped (1415); d = 128 128 x 64 (1059) < 128 x 128 (1165) <
    128 x 128 overlapped (1285); mma.sync d = 64 128 x 64 / 32 rows per warp (1786) < 64 x 64 (1959),
    d = 128 64 x 64 (1839) < 64 x 32 (2013)."""
    d64 = [_predicted_us("wgmma", 64, 128, 128, 2, 32, 0, 4096), _predicted_us("wgmma", 64, 64, 64, 4, 64, 0, 8192),
           _predicted_us("wgmma", 64, 128, 64, 2, 64, 0, 4096),
           _predicted_us("wgmma", 64, 128, 64, 2, 64, 0, 4096, overlap=True)]
    d128 = [_predicted_us("wgmma", 128, 128, 64, 2, 64, 0, 2048), _predicted_us("wgmma", 128, 128, 128, 1, 32, 0, 2048),
            _predicted_us("wgmma", 128, 128, 128, 1, 32, 0, 2048, overlap=True)]
    mma64 = [_predicted_us("mma.sync", 64, 128, 64, 2, 64, 0, 4096, warp_rows=32),
             _predicted_us("mma.sync", 64, 64, 64, 3, 64, 0, 8192, warp_rows=16)]
    mma128 = [_predicted_us("mma.sync", 128, 64, 64, 2, 64, 0, 4096, warp_rows=16),
              _predicted_us("mma.sync", 128, 64, 32, 2, 128, 0, 4096, warp_rows=16)]
    for order in (d64, d128, mma64, mma128):
        assert order == sorted(order), order


def test_a_tiling_at_one_block_per_sm_costs_the_one_block_fit():
    """128 x 64 at d = 128 costs its 1-block/SM fit when its kernel is past 128 registers, more than
    128 x 128 at causal 8k (1394 against 1202 us measured); at 2 blocks per SM less (the planner's
    choice under a causal mask); an occupancy the table lacks takes the formula, said so."""
    from tecc.compiler.cost.attention import Tiling, block_cost
    from tecc.ir.target import target

    tgt = target("sm_90")
    wide = Tiling("wgmma", 128, 128)
    narrow = Tiling("wgmma", 128, 64)

    def per_head(tiling, per_sm, tiles, guarded):   # SM-µs of one head's 64 query blocks
        (f, t, m), source = block_cost(tiling, 128, 128, per_sm, tgt)
        return 64 * (f + t * tiles + m * guarded), source

    causal_wide, _ = per_head(wide, 1, 32.5, 1)
    assert per_head(narrow, 1, 65, 2)[0] > causal_wide > per_head(narrow, 2, 65, 2)[0]
    assert per_head(narrow, 3, 65, 2)[1] == "formula"
    assert per_head(narrow, 2, 65, 2)[1] == "fit"


@pytest.mark.parametrize("d,mask,groups,want", [(128, "causal", 1, 64), (128, "bottom_right", 1, 64), (128, None, 1, 64),
                                                (128, "tensor", 1, 64), (64, "causal", 1, 128)])
def test_masked_programs_rank_the_tilings_at_their_compiled_occupancy(d, mask, groups, want):
    """At d = 128 under a mask that skips tiles (causal, bottom-right: isl-proven tile counts) the
    tilings are costed at the blocks per SM of their compiled kernels: 128 x 64 compiles to <= 128
    registers (2 blocks of 256 threads per SM) and wins over 128 x 128 (1 block per SM), and the
    plan says so; without a mask and with a mask tensor (no proven bound) they are costed at their
    nominal registers (128 x 64 first); at d = 64, 128 x 128 (whose fitted guard cost includes
    the causal launch's tail, measured) stays first."""
    skip_without_nvrtc()
    ins, outs = masked_attention(2, 16, 8192, 8192 if mask != "bottom_right" else 8192 + 512, d, "float16",
                                 groups=groups, mask=mask)
    choice = propose_wgmma(ins + outs, "sm_90")
    assert choice is not None
    assert choice.plan.steps[0].args["key_tile"] == want, choice.plan
    ranked = "the mask skips key tiles (isl-proven counts)" in choice.reason
    assert ranked == (mask in ("causal", "bottom_right")), choice.reason
    if ranked and d == 128:
        import re

        registers = re.search(r"128x64 \((\d+) registers: 2 blocks/SM\)", choice.reason)
        assert registers and int(registers.group(1)) <= 128, choice.reason


def test_proven_tiles_count_the_causal_blocks_and_a_symbolic_length():
    """proven_tiles: a causal S = 1000, 128 x 64: block b visits min(16, 2b + 2) tiles, the
    diagonal two guarded; a symbolic length is costed at NOMINAL_LENGTH."""
    import tecc as tc
    from tecc.compiler.strategies.online_contraction import NOMINAL_LENGTH, proven_tiles
    from tecc.passes.rewrite.online_contraction import online_chain

    ins, outs = masked_attention(1, 2, 1000, 1000, 64, "float16", mask="causal")
    mean, guarded, whole, blocks = proven_tiles(online_chain(ins + outs), 128, 64)
    visited = [min(16, 2 * b + 2) for b in range(8)]
    assert (blocks, whole) == (8, 16) and mean == sum(visited) / 8
    plain = [min(15, (128 * b + 1) // 64) for b in range(8)]
    assert guarded == sum(v - min(v, p) for v, p in zip(visited, plain)) / 8
    n = tc.var("n")
    ins, outs = masked_attention(1, 2, n, n, 64, "float16", mask="causal")
    mean, _, whole, blocks = proven_tiles(online_chain(ins + outs), 128, 128)
    assert blocks == NOMINAL_LENGTH // 128 and whole == NOMINAL_LENGTH // 128 and mean < whole
    ins, outs = masked_attention(1, 2, 1000, 1000, 64, "float16", mask="tensor")
    assert proven_tiles(online_chain(ins + outs), 128, 64) is None


# ---- the persistent form: P blocks loop over the (query block, head) work items ---------------------

def persistent_plan(rows, key_tile, blocks, plain_order=False):
    args = {"rows_per_block": rows, "key_tile": key_tile, "wgmma": True, "persistent": blocks}
    if plain_order:
        args["plain_order"] = True
    return Plan((Step("online_contraction_mma", args),), "test", "")


PERSISTENT = [  # (B, H, G, Sq, Sk, D, dtype, mask, bias, (rows, key tile, blocks, plain order))
    (1, 2, 1, 150, 150, 32, "float16", "causal", False, (64, 64, 3, False)),      # 6 items on 3 blocks
    (2, 4, 2, 70, 70, 64, "bfloat16", "causal", False, (64, 64, 5, False)),      # 16 items on 5: not a multiple
    (1, 4, 4, 133, 133, 16, "float16", "causal", True, (128, 64, 3, False)),     # GQA, one K/V head, a bias
    (1, 2, 1, 21, 70, 32, "float16", "bottom_right", False, (64, 128, 7, False)),  # more blocks than items
    (2, 2, 1, 97, 45, 64, "bfloat16", None, False, (64, 64, 4, True)),          # the plain order
    (1, 2, 1, 45, 80, 32, "float16", "tensor", False, (128, 64, 2, False)),
    (1, 2, 2, 80, 80, 128, "float16", "causal", False, (128, 128, 3, False)),
]


@pytest.mark.parametrize("case", PERSISTENT, ids=[f"{c[0]}x{c[1]}/{c[2]}-{c[3]}x{c[4]}-d{c[5]}-{c[7]}-P{c[9][2]}"
                                                  for c in PERSISTENT])
def test_persistent_attention_matches_float64_numpy(case):
    """The persistent form in the emulator against float64 NumPy: work items not a multiple of
    the grid, fewer items than blocks, grouped heads, causal / bottom-right / mask tensor / none,
    odd lengths, both tilings, the plain order; the next item's copies issued under the epilogue
    (the emulator reports a copy racing a wgmma operand or an unfinished copy)."""
    B, H, G, Sq, Sk, D, dtype, mask, bias_, (rows, key_tile, blocks, plain) = case
    ins, outs = masked_attention(B, H, Sq, Sk, D, dtype, groups=G, mask=mask, bias=bias_, lse=True)
    rng = np.random.default_rng()
    k, got, given = run(ins, outs, make_inputs(ins, rng), persistent_plan(rows, key_tile, blocks, plain))
    (kernel,) = k.module.kernels
    from tecc.ir.stmt import launch_dims
    items = -(-Sq // rows) * B * H
    assert [evaluate_int(g, {}) for g in launch_dims(kernel).grid] == [min(blocks, items), 1, 1]
    assert "persistent" in dict(kernel.attrs)["tensorize"]
    want, want_lse = reference(given, G, mask, bias_)
    check(f"persistent attention {case}", got[0], want, bound(dtype, Sk, given[2]), k.plan)
    check(f"persistent log-sum-exp {case}", got[1], want_lse, bound(dtype, Sk, given[2]), k.plan)


def test_persistent_work_items_are_every_block_once_longest_first():
    """work_item over the items of a causal grouped program: a bijection onto (query block,
    head); the heads of one query block consecutive (the G heads of a K/V head side by side);
    the key tile counts (the loop bound, evaluated) never rise along the items, so block p's
    items p, p + P, .. start with the heaviest."""
    from tecc.ir.stmt import LetStmt

    B, H, G, S, rows = 2, 8, 4, 300, 64
    ins, outs = masked_attention(B, H, S, S, 32, "float16", groups=G, mask="causal")
    (kernel,) = online_contraction_mma(ins + outs, rows, 64, wgmma=True, persistent=7).kernels
    lets = {s.var.name.rstrip("0123456789_"): s for s in iter_stmts(kernel.body) if isinstance(s, LetStmt)}
    item = lets["work_item"].var
    X = -(-S // rows)
    order = [(evaluate_int(lets["query_block"].value, {item: n}), evaluate_int(lets["head"].value, {item: n}))
             for n in range(X * B * H)]
    assert sorted(order) == [(q, h) for q in range(X) for h in range(B * H)]
    for at in range(0, len(order), G):
        assert len({q for q, _ in order[at:at + G]}) == 1 and len({h // G for _, h in order[at:at + G]}) == 1
    extent = key_loop(kernel).extent
    qb = lets["query_block"].var
    tiles = [evaluate_int(extent, {qb: q}) for q, _ in order]
    assert tiles == sorted(tiles, reverse=True) and tiles[0] > tiles[-1], tiles


@pytest.mark.parametrize("D,mask,key_tile", [(128, "causal", 128), (128, None, 64), (64, "causal", 128),
                                             (256, None, 64)])
def test_persistent_kernels_compile_for_sm_90a_without_spills(D, mask, key_tile):
    from tecc.codegen import compile_cuda, emit_source
    from tecc.compiler.pipeline import wgmma_serialized

    ins, outs = masked_attention(2, 8, 8192, 8192, D, "float16", groups=2, lse=True, mask=mask)
    mod = online_contraction_mma(ins + outs, 128, key_tile, wgmma=True, persistent=132)
    compiled = compile_cuda(emit_source(mod.kernels), arch="sm_90", name="attention_persistent")
    (res,) = compiled.resources.values()
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.registers <= 255, res
    assert wgmma_serialized(compiled.log) is None, compiled.log


def test_persistent_is_an_option_of_the_plain_wgmma_form():
    ins, outs = masked_attention(1, 2, 64, 64, 32, "float16")
    with pytest.raises(ScheduleError, match="wgmma form"):
        online_contraction_mma(ins + outs, 64, 64, persistent=132)
    with pytest.raises(ScheduleError, match="persistent and overlap"):
        online_contraction_mma(ins + outs, 64, 64, wgmma=True, persistent=132, overlap=True)
    with pytest.raises(ScheduleError, match="persistent=-1"):
        online_contraction_mma(ins + outs, 64, 64, wgmma=True, persistent=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("D,mask,groups,key_tile", [(128, "causal", 1, 128), (64, None, 2, 128), (128, "causal", 4, 64)])
def test_persistent_attention_on_the_gpu(D, mask, groups, key_tile):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    B, H, S = 2, 8, 1000
    ins, outs = masked_attention(B, H, S, S, D, "float16", groups=groups, mask=mask, lse=True)
    rng = np.random.default_rng()
    k, (o, lse), given = run(ins, outs, make_inputs(ins, rng), persistent_plan(128, key_tile, 132),
                             target="cuda", arch="sm_90")
    want, want_lse = reference(given, groups, mask, False)
    check(f"gpu persistent attention d={D} {mask} G={groups}", o, want, bound("float16", S, given[2]), k.plan)
    check(f"gpu persistent log-sum-exp d={D} {mask}", lse, want_lse, bound("float16", S, given[2]), k.plan)


# ---- every visited key tile guarded (guard_every_tile: timing what the guard costs) -------------

@pytest.mark.parametrize("wgmma,mask,dtype", [(True, "causal", "float16"), (True, "bottom_right", "bfloat16"),
                                              (False, "causal", "bfloat16")])
def test_guard_every_tile_keeps_the_results_and_guards_the_whole_tiles_too(wgmma, mask, dtype):
    """`guard_every_tile` (a timing option) puts the per-element guard on the tiles isl proves
    whole as well: the same results against float64 NumPy over several key tiles, and the kernel
    no longer branches on the proven count of whole tiles (the plain one does)."""
    from tecc.codegen import emit_source

    Sq, Sk, D = 150, 170, 32
    args = {"rows_per_block": 64, "key_tile": 64, **({"wgmma": True} if wgmma else {})}
    ins, outs = masked_attention(1, 2, Sq, Sk, D, dtype, groups=2, mask=mask, lse=True)
    rng = np.random.default_rng()
    x = make_inputs(ins, rng)
    sources = []
    for every in (False, True):
        step = {**args, **({"guard_every_tile": True} if every else {})}
        k, got, given = run(ins, outs, x, Plan((Step("online_contraction_mma", step),), "test", ""))
        assert k.plan.steps[0].args == step, k.plan
        want, want_lse = reference(given, 2, mask, False)
        check(f"guard_every_tile={every} {mask}", got[0], want, bound(dtype, Sk, given[2]), k.plan)
        check(f"guard_every_tile={every} {mask} lse", got[1], want_lse, bound(dtype, Sk, given[2]), k.plan)
        sources.append(emit_source(k.module.kernels))
    plain, every_tile = sources
    assert "if (key_tile >= " in plain and "if (key_tile >= " not in every_tile


# ---- a 3-stage K/V ring in the plain loop (stages=3) ----------------------------------------------

STAGES3 = [  # (Sq, Sk, D, dtype, mask, bias, groups, (rows, key tile), kv_splits)
    (150, 170, 32, "float16", "causal", False, 2, (64, 64), 1),
    (200, 200, 16, "bfloat16", "bottom_right", True, 1, (128, 64), 1),
    (45, 300, 64, "float16", "tensor", False, 1, (64, 128), 1),   # 3 tiles: the ring wraps once
    (70, 77, 128, "bfloat16", None, True, 2, (128, 64), 1),
    (1, 1, 16, "float16", "causal", False, 1, (64, 64), 1),        # one tile: tile 1 never loads
    (16, 400, 32, "bfloat16", "causal", False, 1, (64, 64), 3),    # split-KV chunks start past tile 0
]


@pytest.mark.parametrize("case", STAGES3, ids=[f"{c[0]}x{c[1]}-d{c[2]}-{c[3]}-{c[4]}-{c[7]}-s{c[8]}" for c in STAGES3])
def test_three_stage_ring_matches_float64_numpy(case):
    """`stages=3`: tiles kt + 1 and kt + 2 load while kt is computed (cp.async.wait_group 1 at the
    loop head); every mask form, bias, grouped heads, odd lengths, both dtypes, 64/128 rows and
    key tiles, split-KV, against float64 NumPy on NaN-poisoned outputs."""
    from tecc.codegen import emit_source

    Sq, Sk, D, dtype, mask, bias_, groups, (rows, key_tile), splits = case
    ins, outs = masked_attention(1, 2, Sq, Sk, D, dtype, groups=groups, mask=mask, bias=bias_, lse=True)
    step = {"rows_per_block": rows, "key_tile": key_tile, "wgmma": True, "stages": 3,
            **({"kv_splits": splits} if splits > 1 else {})}
    k, got, given = run(ins, outs, make_inputs(ins, np.random.default_rng()),
                        Plan((Step("online_contraction_mma", step),), "test", ""))
    assert k.plan.steps[0].args == step, k.plan
    assert "cp.async.wait_group 1;" in emit_source(k.module.kernels)
    want, want_lse = reference(given, groups, mask, bias_)
    check(f"3-stage ring {case}", got[0], want, bound(dtype, Sk, given[2]), k.plan)
    check(f"3-stage ring {case} lse", got[1], want_lse, bound(dtype, Sk, given[2]), k.plan)


@pytest.mark.parametrize("D,key_tile", [(128, 64), (128, 128), (64, 128)])
def test_three_stage_ring_compiles_for_sm_90a_without_spills(D, key_tile):
    """The S = 8k causal kernels with a 3-stage ring: within sm_90's shared memory, no spills, no
    serialized wgmma."""
    from tecc.codegen import compile_cuda, dynamic_shared_bytes, emit_source
    from tecc.compiler.pipeline import wgmma_serialized

    ins, outs = masked_attention(1, 32, 8192, 8192, D, "float16", mask="causal")
    mod = online_contraction_mma(ins + outs, rows_per_block=128, key_tile=key_tile, wgmma=True, stages=3)
    compiled = compile_cuda(emit_source(mod.kernels), arch="sm_90", name="attention_3_stages")
    (res,) = compiled.resources.values()
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.registers <= 255, res
    assert wgmma_serialized(compiled.log) is None, compiled.log
    assert dynamic_shared_bytes(mod.kernels[0]) <= 227 * 1024


@pytest.mark.parametrize("args,match", [({"stages": 4}, "must be 2 or 3"), ({"stages": 3, "overlap": True}, "plain loop"),
                                        ({"stages": 3, "persistent": 132}, "plain loop")])
def test_bad_stages_say_why(args, match):
    ins, outs = masked_attention(1, 2, 64, 64, 32, "float16")
    with pytest.raises(ScheduleError, match=match):
        online_contraction_mma(ins + outs, rows_per_block=64, key_tile=64, wgmma=True, **args)
    with pytest.raises(ScheduleError, match="options of the wgmma form"):
        online_contraction_mma(ins + outs, rows_per_block=64, key_tile=64, stages=3)


@pytest.mark.gpu
@pytest.mark.parametrize("D,dtype,mask,key_tile,extra", [
    (128, "float16", "causal", 64, {"stages": 3}), (128, "bfloat16", "causal", 128, {"stages": 3}),
    (64, "float16", None, 128, {"stages": 3}), (128, "float16", "bottom_right", 64, {"guard_every_tile": True}),
    (64, "bfloat16", "causal", 128, {"guard_every_tile": True, "stages": 3})])
def test_three_stages_and_every_tile_guarded_on_the_gpu(D, dtype, mask, key_tile, extra):
    """stages=3 and guard_every_tile on an sm_90 GPU against float64 NumPy (S = 1000: a partial
    last tile), grouped heads."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    S = 1000
    Sq = S if mask != "bottom_right" else S // 2
    ins, outs = masked_attention(2, 8, Sq, S, D, dtype, groups=2, mask=mask, lse=True)
    step = {"rows_per_block": 128, "key_tile": key_tile, "wgmma": True, **extra}
    k, (o, lse), given = run(ins, outs, make_inputs(ins, np.random.default_rng()),
                             Plan((Step("online_contraction_mma", step),), "test", ""), target="cuda", arch="sm_90")
    want, want_lse = reference(given, 2, mask, False)
    check(f"gpu {extra} d={D} {dtype} {mask}", o, want, bound(dtype, S, given[2]), k.plan)
    check(f"gpu {extra} d={D} {dtype} {mask} lse", lse, want_lse, bound(dtype, S, given[2]), k.plan)


# ---- what the fitted m is: the causal times under a model of the launch (docs/attention.md) ----------

@pytest.mark.parametrize("d,key_tile,heads,times,predicted", [
    (128, 128, 32, (1165.0, 2188.4, 1202.5), 1204), (64, 128, 64, (1235.0, 2314.9, 1287.0), 1245),
    (64, 64, 64, (1340.0, 2580.5, 1460.8), 1354), (128, 64, 32, (1059.0, 2062.8, 1394.3), 1099)])
def test_the_launch_model_of_the_guarded_tile_table(d, key_tile, heads, times, predicted):
    """The table of "What a guarded tile costs": F and t from the non-causal S = 4k / 8k H200 times
    of WGMMA_BLOCK_COST's comment with the launch's waves (every block equal: ceil(blocks / 132)
    of them), then the causal S = 8k blocks (128 query rows; tiles from the proven bound, evaluated
    per block) greedily on 132 SMs in the kernel's launch order (per head, longest first), with
    the guard free. The numbers the docs quote, and that 128 x 128 at d = 128 has no excess."""
    import heapq

    rows, sms, S = 128, 132, 8192
    ins, outs = masked_attention(1, heads, S, S, d, "float16", mask="causal")
    mod = online_contraction_mma(ins + outs, rows_per_block=rows, key_tile=key_tile, wgmma=True)
    loop = next(s for s in iter_stmts(mod.kernels[0].body) if isinstance(s, For) and s.var.name == "key_tile")
    qb = next(v for v in _free_vars(loop.extent) if v.name == "query_block")
    X = S // rows
    tiles = [evaluate_int(loop.extent, {qb: b}) for b in range(X)]
    assert tiles[0] == rows // key_tile and tiles[-1] == S // key_tile
    blocks = X * heads
    waves = -(-blocks // sms)
    per4, per8 = times[0] / waves, times[1] / waves
    t = (per8 - per4) / (S // key_tile - S // 2 // key_tile)
    F = per8 - t * (S // key_tile)
    free = [0.0] * sms
    for _ in range(heads):
        for b in reversed(range(X)):   # the launch order: each head's query blocks from the last
            heapq.heappush(free, heapq.heappop(free) + F + t * tiles[b])
    model = max(free)
    assert abs(model - predicted) <= 0.005 * predicted, model
    if (d, key_tile) == (128, 128):
        assert abs(times[2] - model) <= 0.01 * model   # no excess: the guarded tile costs nothing measurable


def _free_vars(e):
    from tecc.ir.expr import Var, walk

    return [v for v in walk(e) if isinstance(v, Var)]
