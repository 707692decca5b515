"""Row-op backwards from tc.grad of the user's forward expressions (examples/row_backward.py):
layer norm and RMS norm (dX in one row kernel that also sums dγ, dβ over blocks of rows, then a
combine kernel), softmax and log-softmax (one row kernel), cross-entropy (a one-kernel forward
that keeps the row's max and Σ exp, an elementwise backward). Checked in the emulator against
float64 NumPy on fresh random inputs with the outputs poisoned, fp32 and bf16, odd row lengths
and symbolic row counts, with kernel counts on the built module."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.ir.autodiff import GradientError
from tecc.ir.errors import ScheduleError
from tecc.passes.rewrite.fuse_rows import fuse_rows, row_group

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import norms  # noqa: E402
import row_backward as rb  # noqa: E402

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# relative to the largest reference magnitude: float32 arithmetic, bf16 inputs and outputs (8 bits)
TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def _rng() -> tuple[np.random.Generator, int]:
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def _concrete(shape, sizes):
    return tuple(sizes.get(str(d), None) or int(d) for d in shape)


def _run(kernel, args, inputs, sizes):
    """Call `kernel` on `inputs` with every output poisoned (NaN); the outputs as float64."""
    outs = []
    for t in args[len(inputs):]:
        dtype = NP.get(t.dtype.name, t.dtype.name)
        outs.append(np.full(_concrete(t.shape, sizes), np.nan, dtype=dtype))
    kernel(*inputs, *outs)
    return [o.astype(np.float64) for o in outs]


def _check(got, want, dtype, what):
    for n, (g, w) in enumerate(zip(got, want)):
        scale = max(np.abs(w).max(), 1e-30)
        err = np.abs(g - w) / scale
        worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
        assert np.isfinite(g).all(), f"{what}: output {n} has NaN/inf (unwritten?) at {np.argwhere(~np.isfinite(g))[:3]}"
        assert err.max() <= TOL[dtype], (f"{what}: output {n} off by {err.max():.2e} of its largest value at {worst}: "
                                         f"got {g[worst]}, want {w[worst]}")


def _inputs(args, n_in, sizes, dtype, rng):
    out = []
    for t in args[:n_in]:
        shape = _concrete(t.shape, sizes)
        out.append(rng.standard_normal(shape).astype(NP[dtype] if t.dtype.is_float else np.int32))
    return out


def _norm_case(op, R, C, dtype, save):
    if op == "layer_norm":
        g = rb.layer_norm_backward(R, C, dtype, save=save)
        fwd_in = 3
    else:
        g = rb.rms_norm_backward(R, C, dtype, save=save)
        fwd_in = 2
    return g, fwd_in


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype,rows,cols,save", [
    ("float32", 37, 1000, False),
    ("float32", 5, 257, True),       # odd row length: scalar columns, a guarded tail
    ("bfloat16", 19, 768, False),
    ("bfloat16", 6, 1000, True),
    ("float32", "R", 999, False),    # symbolic rows
])
def test_norm_backward_is_two_kernels_and_matches_float64(op, dtype, rows, cols, save):
    rng, seed = _rng()
    sizes = {"R": 23} if rows == "R" else {}
    R = tc.var("R") if rows == "R" else rows
    g, fwd_in = _norm_case(op, R, cols, dtype, save)
    k = tc.build(g.args, target="sim", sizes=sizes or None)
    names = [kk.name for kk in k.module.kernels]
    assert len(names) == 2, f"{op} {dtype} backward: {names}, plan {k.plan}"
    assert dict(k.module.kernels[0].attrs).get("row_blocks"), k.plan
    ins = _inputs(g.inputs, fwd_in, sizes, dtype, rng)
    saved = []
    if save:  # the forward computes the statistics it saves
        fwd = tc.build(list(g.forward), target="sim", sizes=sizes or None)
        assert len(fwd.module.kernels) == 1, fwd.plan
        saved = [o.astype(np.float32) for o in _run(fwd, list(g.forward), ins, sizes)[1:]]
    dy = rng.standard_normal(_concrete(g.cotangent.shape, sizes)).astype(NP[dtype])
    got = _run(k, g.args, [*ins, *saved, dy], sizes)
    ref = rb.np_layer_norm_backward if op == "layer_norm" else rb.np_rms_norm_backward
    want = ref(*[a.astype(np.float64) for a in ins], dy.astype(np.float64))
    _check(got, want, dtype, f"{op} backward {dtype} {rows}x{cols} save={save} (seed {seed}), plan {k.plan}")


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype,rows,cols", [("float32", 9, 1000), ("bfloat16", 7, 1027), ("float32", "R", 333)])
def test_softmax_backward_is_one_row_kernel_and_matches_float64(log, dtype, rows, cols):
    rng, seed = _rng()
    sizes = {"R": 11} if rows == "R" else {}
    g = rb.softmax_backward(tc.var("R") if rows == "R" else rows, cols, dtype, log=log)
    k = tc.build(g.args, target="sim", sizes=sizes or None)
    assert len(k.module.kernels) == 1 and k.plan.steps[0].primitive == "fuse_rows", k.plan
    x = (rng.standard_normal(_concrete(g.inputs[0].shape, sizes)) * 3).astype(NP[dtype])
    dy = rng.standard_normal(x.shape).astype(NP[dtype])
    got = _run(k, g.args, [x, dy], sizes)
    _check(got, rb.np_softmax_backward(x.astype(np.float64), dy.astype(np.float64), log),
           dtype, f"{'log_' if log else ''}softmax backward {dtype} (seed {seed}), plan {k.plan}")


def test_the_row_maximum_passes_no_gradient_in_softmax_and_log_softmax():
    for log in (False, True):
        g = rb.softmax_backward(8, 64, log=log)
        stages = rb._stages(g.grads[0])
        assert not any(name.endswith("_ties") or name.startswith("dm") for name in stages), sorted(stages)
        reductions = [t for t in stages.values() if t.op.reductions]
        assert len(reductions) == 3, sorted(t.name for t in reductions)  # m, s and one for dX


def test_a_maximum_the_output_depends_on_keeps_its_gradient():
    X = tc.placeholder((4, 6), "float64", name="X")
    c = tc.reduce_axis(6, name="c")
    m = tc.compute((4,), lambda i: tc.max(X[i, c], axis=c), name="m")
    Y = tc.compute((4, 6), lambda i, j: X[i, j] - 2.0 * m[i], name="Y")  # not invariant: shifts by -2δ
    g = tc.grad(Y, [X])
    assert any(name.endswith("_ties") for name in rb._stages(g.grads[0]))
    x = np.random.default_rng(3).standard_normal((4, 6))
    dy = np.random.default_rng(4).standard_normal((4, 6))
    dx = np.full((4, 6), np.nan)
    tc.build(g.args, target="sim")(x, dy, dx)
    want = dy.copy()
    want[np.arange(4), x.argmax(-1)] -= 2.0 * dy.sum(-1)
    np.testing.assert_allclose(dx, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,rows,vocab", [("float32", 6, 1003), ("bfloat16", 5, 2051), ("float32", "R", 50304)])
def test_cross_entropy_forward_is_one_kernel_and_backward_one_elementwise_pass(dtype, rows, vocab):
    rng, seed = _rng()
    sizes = {"R": 3} if rows == "R" else {}
    R = tc.var("R") if rows == "R" else rows
    X, T, m, s, loss = rb.cross_entropy(R, vocab, dtype)
    g = tc.grad(loss, [X], save=[m, s])
    assert list(g.forward) == [X, T, loss, m, s]
    fwd = tc.build(list(g.forward), target="sim", sizes=sizes or None)
    bwd = tc.build(g.args, target="sim", sizes=sizes or None)
    assert len(fwd.module.kernels) == 1 and fwd.plan.steps[0].primitive == "fuse_rows", fwd.plan
    assert len(bwd.module.kernels) == 1 and "fuse_rows" not in str(bwd.plan), bwd.plan
    # the backward reads the logits once and no row statistic of its own: no reduction
    assert not any(t.op.reductions for t in rb._stages(g.grads[0]).values())
    n = sizes.get("R", rows)
    x = (rng.standard_normal((n, vocab)) * 2).astype(NP[dtype])
    t = rng.integers(0, vocab, n).astype(np.int32)
    out = _run(fwd, list(g.forward), [x, t], sizes)
    want = rb.np_cross_entropy(x.astype(np.float64), t)
    _check(out, want, "float32", f"cross-entropy forward {dtype} {rows}x{vocab} (seed {seed}), plan {fwd.plan}")
    dloss = rng.standard_normal(n).astype(np.float32)
    got = _run(bwd, g.args, [x, t, out[1].astype(np.float32), out[2].astype(np.float32), dloss], sizes)
    _check(got, rb.np_cross_entropy_backward(x.astype(np.float64), t, dloss.astype(np.float64)), dtype,
           f"cross-entropy backward {dtype} {rows}x{vocab} (seed {seed}), plan {bwd.plan}")


@pytest.mark.parametrize("dtype,rows,vocab", [("float32", 6, 1003), ("bfloat16", 5, 2051), ("float32", "R", 50304),
                                              ("bfloat16", 2, 50304)])
def test_cross_entropy_forward_and_backward_as_one_program_is_one_row_kernel(dtype, rows, vocab):
    """forward_backward: the gradient reads the forward's own row max and Σ exp, so the planner
    builds the loss and dX in one row kernel that reads the logits once."""
    rng, seed = _rng()
    sizes = {"R": 3} if rows == "R" else {}
    args = rb.cross_entropy_forward_backward(tc.var("R") if rows == "R" else rows, vocab, dtype)
    assert [t.name for t in args] == ["X", "T", "dloss", "loss", "dX"]
    k = tc.build(args, target="sim", sizes=sizes or None)
    assert len(k.module.kernels) == 1 and k.plan.steps[0].primitive == "fuse_rows", k.plan
    if vocab == 50304:  # 512 threads; bf16 kept in float32 registers (row_fused.FLOAT_ROWS_ELEMENTS)
        assert k.plan.steps[0].args["threads"] == 512 and k.plan.steps[0].args.get("float_rows", False) == (dtype == "bfloat16")
    n = sizes.get("R", rows)
    x = (rng.standard_normal((n, vocab)) * 2).astype(NP[dtype])
    t = rng.integers(0, vocab, n).astype(np.int32)
    dloss = rng.standard_normal(n).astype(np.float32)
    loss, dx = _run(k, args, [x, t, dloss], sizes)
    x64 = x.astype(np.float64)
    _check([loss], [rb.np_cross_entropy(x64, t)[0]], "float32", f"cross-entropy loss {dtype} (seed {seed})")
    _check([dx], rb.np_cross_entropy_backward(x64, t, dloss.astype(np.float64)), dtype,
           f"cross-entropy dX {dtype} {rows}x{vocab} (seed {seed}), plan {k.plan}")


def test_forward_backward_shares_the_forward_stages():
    """The joint program's gradient reads the forward's row statistics (no recomputed copy, no
    saved placeholder), and its output is the forward's."""
    X, T, m, s, loss = rb.cross_entropy(4, 64)
    g = tc.grad(loss, [X], save=[m, s])
    joint = g.forward_backward
    assert joint[:3] == (X, T, g.cotangent) and joint[3] is loss
    stages = rb._stages(joint[4])
    assert stages["m"] is m and stages["s"] is s and not any(t.is_placeholder for t in (stages["m"], stages["s"]))
    assert g.grads[0] is not joint[4]  # the backward alone reads the saved placeholders instead


def test_forward_backward_of_a_stage_with_an_embedded_reduction():
    """A log-sum-exp written as one stage (the sum inside `m + log(Σ exp(x - m))`): the joint
    program's output is the normalized forward's, which computes the same values."""
    rng, seed = _rng()
    X = tc.placeholder((5, 333), "float32", name="X")
    c, c2 = tc.reduce_axis(333, name="c"), tc.reduce_axis(333, name="c2")
    m = tc.compute((5,), lambda i: tc.max(X[i, c], axis=c), name="m")
    lse = tc.compute((5,), lambda i: m[i] + tc.log(tc.sum(tc.exp(X[i, c2] - m[i]), axis=c2)), name="lse")
    joint = list(tc.grad(lse, [X]).forward_backward)
    assert [t.name for t in joint] == ["X", "dlse", "lse", "dX"] and joint[2] is not lse
    k = tc.build(joint, target="sim")
    assert len(k.module.kernels) == 1, k.plan
    x = rng.standard_normal((5, 333)).astype(np.float32)
    dl = rng.standard_normal(5).astype(np.float32)
    out, dx = _run(k, joint, [x, dl], {})
    x64 = x.astype(np.float64)
    want = np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1)) + x64.max(-1)
    p = np.exp(x64 - want[:, None])
    _check([out, dx], [want, dl[:, None].astype(np.float64) * p], "float32", f"log-sum-exp joint (seed {seed})")


def test_saved_statistics_replace_their_recomputation():
    g = rb.layer_norm_backward(8, 64, save=True)
    assert [t.name for t in g.saved] == ["mu", "var"] and all(t.is_placeholder for t in g.saved)
    assert [t.name for t in g.args] == ["X", "g", "b", "mu", "var", "dY", "dX", "dg", "db"]
    stages = rb._stages(g.grads[0])
    # the mean and variance are read, not reduced again: the row reductions left are dX's own two
    assert sorted(t.name for t in stages.values() if t.op.reductions and len(t.shape) == 1
                  and t.shape[0] is g.inputs[0].shape[0]) == ["dmu", "dvar"]


def test_save_refuses_a_tensor_outside_the_program():
    X, g, b, Y, mu, var = rb.layer_norm_stats(4, 8)
    other = tc.compute((4,), lambda i: X[i, 0] * 2.0, name="other")
    with pytest.raises(GradientError, match="other.*not a compute of the output's program"):
        tc.grad(Y, [X], save=[other])
    with pytest.raises(GradientError, match="Y"):
        tc.grad(Y, [X], save=[Y])


def test_column_reductions_need_row_blocks_and_the_row_in_registers():
    args = rb.layer_norm_backward(8, 64).args
    group = row_group(args)
    assert [t.name for t in group.column_reductions] == ["db", "dg"]
    with pytest.raises(ScheduleError, match="row_blocks"):
        fuse_rows(args, 32)
    with pytest.raises(ScheduleError, match="cache='registers'"):
        fuse_rows(args, 32, cache="none", row_blocks=4)
    with pytest.raises(ScheduleError, match="prefetch"):
        fuse_rows(rb.softmax_backward(8, 64).args, 32, prefetch=True)
    with pytest.raises(ScheduleError, match="column_sums"):
        fuse_rows(args, 32, row_blocks=4, column_sums="global")
    with pytest.raises(ScheduleError, match="prefetch_into"):
        fuse_rows(args, 32, row_blocks=4, prefetch_into="shared")        # staging is a form of the prefetch
    with pytest.raises(ScheduleError, match="prefetch_into"):
        fuse_rows(args, 32, row_blocks=4, prefetch=True, prefetch_into="global")
    # one cp.async per thread's vector: 2 bytes (one bf16) is no size it copies
    with pytest.raises(ScheduleError, match="4, 8 or 16 bytes"):
        fuse_rows(rb.layer_norm_backward(8, 66, "bfloat16").args, 32, row_blocks=4, prefetch=True,
                  prefetch_into="shared")


def test_every_block_loads_its_next_row_ahead_without_losing_resident_blocks():
    """Without the prefetch a block has loads in flight only from a row's start to its first
    reduction. The plan loads each block's next row ahead at the residency it has without it:
    into a second set of registers beside the column sums where that fits (768 columns: 128
    threads, 4 blocks per SM), else staged in shared memory by cp.async with the sums in
    registers (4096: 512 threads, 2 blocks; 8192: 1024 threads, 1 block). The blocks split the
    rows evenly (S = the fewest blocks with the same rows per block) and every planned kernel
    compiles for sm_90 without spills."""
    want = {768: (128, "registers", 4), 4096: (512, "shared", 2), 8192: (1024, "shared", 1)}
    for columns, (threads, into, per_sm) in want.items():
        k = tc.build(rb.layer_norm_backward(8192, columns).args, target="cuda", arch="sm_90")
        step = k.plan.steps[0].args
        assert step["prefetch"] and step["threads"] == threads, (columns, step)
        assert step.get("prefetch_into", "registers") == into and step.get("column_sums", "local") == "local", (
            columns, step)
        rows_per_block = -(-8192 // (132 * per_sm))
        assert step["row_blocks"] == -(-8192 // rows_per_block), (columns, step)
        for name, res in k.resources.items():
            assert res.spill_stores == 0 and res.spill_loads == 0, (columns, name, res)
        assert ("cp.async" in k.source) == (into == "shared"), columns


def test_a_column_statistic_read_back_by_a_row_is_not_a_row_group():
    X = tc.placeholder((6, 6), "float32", name="X")
    r, c = tc.reduce_axis(6, name="r"), tc.reduce_axis(6, name="c")
    rowsum = tc.compute((6,), lambda i: tc.sum(X[i, c], axis=c), name="rowsum")
    colsum = tc.compute((6,), lambda j: tc.sum(X[r, j], axis=r), name="colsum")
    Y = tc.compute((6, 6), lambda i, j: X[i, j] / rowsum[i] + colsum[j], name="Y")
    with pytest.raises(ScheduleError, match="reads the column reduction colsum"):
        row_group([X, Y])


@pytest.mark.parametrize("row_blocks", [1, 3, 40])
@pytest.mark.parametrize("column_sums,prefetch", [("local", False), ("shared", False), ("shared", True),
                                                  ("local", True), ("local", "shared"), ("shared", "shared")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_any_number_of_row_blocks_gives_the_same_gradients(row_blocks, column_sums, prefetch, dtype):
    """Fewer blocks than rows, rows not a multiple of the blocks, more blocks than rows (idle
    blocks store identity partials); column sums in registers or shared memory (the emulator
    checks the shared words for races), the next row loaded ahead or not, into registers or
    staged in shared memory by cp.async (the emulator checks that no copy is read before the
    wait that covers it, and none is left in flight); bf16 rows kept in float32 registers
    (float_rows, converted as the prefetched row is taken)."""
    rng, seed = _rng()
    g = rb.layer_norm_backward(13, 96, dtype)
    step = {"threads": 64, "cache": "registers", "vector": 4, "row_blocks": row_blocks, "column_sums": column_sums,
            "prefetch": bool(prefetch), "float_rows": dtype == "bfloat16"}
    if prefetch == "shared":
        step["prefetch_into"] = "shared"
    plan = Plan((Step("fuse_rows", step),), "row_fused", "")
    k = tc.build(g.args, target="sim", plan=plan)
    x, gg, bb = (rng.standard_normal(s).astype(NP[dtype]) for s in ((13, 96), (96,), (96,)))
    dy = rng.standard_normal((13, 96)).astype(NP[dtype])
    want = rb.np_layer_norm_backward(*(a.astype(np.float64) for a in (x, gg, bb, dy)))
    _check(_run(k, g.args, [x, gg, bb, dy], {}), want, dtype, f"layer norm backward {dtype}, {step} (seed {seed})")


def test_the_forward_layer_norm_exposes_its_statistics_in_one_kernel():
    X, g, b, Y, mu, var = rb.layer_norm_stats(tc.var("R"), 1000)
    k = tc.build([X, g, b, Y, mu, var], target="sim", sizes={"R": 9})
    assert len(k.module.kernels) == 1, k.plan
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 1000)).astype(np.float32)
    gg, bb = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    y, m, v = _run(k, [X, g, b, Y, mu, var], [x, gg, bb], {"R": 9})
    _check([y, m, v], [norms.np_layer_norm(x, gg, bb), x.astype(np.float64).mean(-1), x.astype(np.float64).var(-1)],
           "float32", "layer norm forward with its statistics")


# ---- NVRTC (no GPU needed) --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_backward_kernels_compile_with_nvrtc_without_spills(arch, dtype):
    """The benchmark's shapes: layer norm and RMS norm backward at 768, 4096 and 8192 columns,
    softmax's at 4096, cross-entropy's forward, backward, and both in one kernel over 50,304
    logits (512 threads: at 1024 the row's 52 registers spilled)."""
    ce = rb.cross_entropy_backward(8192, 50304, dtype)
    programs = [rb.layer_norm_backward(8192, 768, dtype).args, rb.layer_norm_backward(8192, 8192, dtype, save=True).args,
                rb.layer_norm_backward(8192, 4096, dtype, save=True).args, rb.rms_norm_backward(8192, 8192, dtype).args,
                rb.softmax_backward(8192, 4096, dtype).args, list(ce.forward), ce.args,
                rb.cross_entropy_forward_backward(8192, 50304, dtype)]
    for args in programs:
        k = tc.build(args, target="cuda", arch=arch)
        for name, res in k.resources.items():
            assert res.spill_stores == 0 and res.spill_loads == 0, f"{name} {dtype} {arch}: {res}, plan {k.plan}"


# ---- on the GPU, against torch autograd --------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


def _torch_dtype(torch, dtype):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def _gpu_err(torch, got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op,rows,cols", [("layer_norm", 8192, 4096), ("layer_norm", 1000, 1001),
                                         ("rms_norm", 8192, 768), ("rms_norm", 333, 8192)])
@pytest.mark.parametrize("save", [False, True])
def test_norm_forward_and_backward_on_the_gpu_match_torch_autograd(op, rows, cols, dtype, save):
    torch = _torch()
    F = torch.nn.functional
    tdt = _torch_dtype(torch, dtype)
    g = (rb.layer_norm_backward if op == "layer_norm" else rb.rms_norm_backward)(rows, cols, dtype, save=save)
    fwd, bwd = tc.build(list(g.forward), target="cuda"), tc.build(g.args, target="cuda")
    assert len(bwd.module.kernels) == 2, bwd.plan
    n_par = 2 if op == "layer_norm" else 1
    x = torch.randn(rows, cols, device="cuda", dtype=tdt)
    params = [torch.randn(cols, device="cuda", dtype=tdt) for _ in range(n_par)]
    dy = torch.randn(rows, cols, device="cuda", dtype=tdt)
    y = torch.full_like(x, float("nan"))
    stats = [torch.full((rows,), float("nan"), device="cuda") for _ in g.saved]
    grads = [torch.full_like(x, float("nan"))] + [torch.full_like(p, float("nan")) for p in params]
    fwd(x, *params, y, *stats)
    bwd(x, *params, *stats, dy, *grads)
    ins = [x.double().requires_grad_()] + [p.double().requires_grad_() for p in params]
    if op == "layer_norm":
        ref = F.layer_norm(ins[0], (cols,), ins[1], ins[2], rb.EPS)
    else:
        ref = ins[0] * torch.rsqrt(ins[0].pow(2).mean(-1, keepdim=True) + rb.EPS) * ins[1]
    want = torch.autograd.grad(ref, ins, dy.double())
    for name, got, w in [("Y", y, ref.detach()), *zip(["dX", "dg", "db"], grads, want)]:
        err = _gpu_err(torch, got, w)
        assert err <= TOL[dtype], f"{op} {rows}x{cols} {dtype} save={save}: {name} off by {err:.2e}, plan {bwd.plan}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("rows,cols", [(8192, 4096), (517, 1027)])
def test_softmax_backward_on_the_gpu_matches_torch_autograd(log, rows, cols, dtype):
    torch = _torch()
    tdt = _torch_dtype(torch, dtype)
    g = rb.softmax_backward(rows, cols, dtype, log=log)
    bwd = tc.build(g.args, target="cuda")
    assert len(bwd.module.kernels) == 1, bwd.plan
    x = torch.randn(rows, cols, device="cuda", dtype=tdt) * 3
    dy = torch.randn(rows, cols, device="cuda", dtype=tdt)
    dx = torch.full_like(x, float("nan"))
    bwd(x, dy, dx)
    xd = x.double().requires_grad_()
    y = torch.log_softmax(xd, -1) if log else torch.softmax(xd, -1)
    (want,) = torch.autograd.grad(y, [xd], dy.double())
    err = _gpu_err(torch, dx, want)
    assert err <= TOL[dtype], f"{'log_' if log else ''}softmax backward {rows}x{cols} {dtype}: {err:.2e}, {bwd.plan}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,vocab", [(4096, 50304), (77, 32003)])
def test_cross_entropy_on_the_gpu_matches_torch_autograd(rows, vocab, dtype):
    torch = _torch()
    F = torch.nn.functional
    tdt = _torch_dtype(torch, dtype)
    g = rb.cross_entropy_backward(rows, vocab, dtype)
    fwd, bwd = tc.build(list(g.forward), target="cuda"), tc.build(g.args, target="cuda")
    assert len(fwd.module.kernels) == 1 and len(bwd.module.kernels) == 1, (fwd.plan, bwd.plan)
    x = torch.randn(rows, vocab, device="cuda", dtype=tdt) * 2
    t = torch.randint(0, vocab, (rows,), device="cuda", dtype=torch.int32)
    dl = torch.randn(rows, device="cuda")
    loss, m, s = (torch.full((rows,), float("nan"), device="cuda") for _ in range(3))
    dx = torch.full_like(x, float("nan"))
    fwd(x, t, loss, m, s)
    bwd(x, t, m, s, dl, dx)
    xd = x.double().requires_grad_()
    ref = F.cross_entropy(xd, t.long(), reduction="none")
    (want,) = torch.autograd.grad(ref, [xd], dl.double())
    assert _gpu_err(torch, loss, ref.detach()) <= 2e-5, "cross-entropy loss"
    err = _gpu_err(torch, dx, want)
    assert err <= TOL[dtype], f"cross-entropy dX {rows}x{vocab} {dtype}: {err:.2e}, {bwd.plan}"
    # forward and backward as one program: one row kernel writes both
    joint = tc.build(rb.cross_entropy_forward_backward(rows, vocab, dtype), target="cuda")
    assert len(joint.module.kernels) == 1, joint.plan
    loss.fill_(float("nan"))
    dx.fill_(float("nan"))
    joint(x, t, dl, loss, dx)
    assert _gpu_err(torch, loss, ref.detach()) <= 2e-5, f"cross-entropy loss, one kernel: {joint.plan}"
    err = _gpu_err(torch, dx, want)
    assert err <= TOL[dtype], f"cross-entropy dX {rows}x{vocab} {dtype}, one kernel: {err:.2e}, {joint.plan}"
