"""Attention whose Q, K and V are views of one fused QKV projection (GPT-2's `qkv.split(C)` then
`view(B, S, H, D).permute(0, 2, 1, 3)`: Q[b, h, i, d] = qkv[b·S + i, h·D + d], K and V the next
C columns, rows 3·C elements apart) runs on the tensor-core forms, reading the views in place:
wgmma on sm_90, mma.sync on sm_80 (online_mma_chain._strided_rows, docs/attention.md "Operands
read through views"). Plan-level assertions for both targets, the emulator against float64 NumPy
on NaN-poisoned outputs (float16 and bfloat16, head dims 64 and 128, causal and not, the
log-sum-exp as [B, H, S] and as cudnn's [B, H, S, 1]), the views the copies cannot read (a row
start off 16 bytes, a column that is not the innermost index) planned without the tensor-core
form and still correct, NVRTC compiles for sm_90a and sm_80, and a GPU test against torch's SDPA
on the same views."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import tecc as tc
from benchmarks.attention_views import qkv_attention
from tecc.compiler.plan import Plan, Step
from tecc.compiler.planner import plan_program
from nvrtc_checks import skip_without_nvrtc
from test_attention_tensor_core import bound, poisoned
from test_online_contraction import check


def split_views(x, B, H, S, D, offset=0, transposed=False):
    """Q, K, V [B, H, S, D] in float64 from the projection `x` (as the program reads it)."""
    x = x.astype(np.float64)
    x = x.T if transposed else x
    parts = x[:, offset:offset + 3 * H * D].reshape(B, S, 3, H, D)
    return [parts[:, :, n].transpose(0, 2, 1, 3) for n in range(3)]


def reference(q, k, v, causal):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    p = np.exp(s - mx)
    total = p.sum(axis=-1, keepdims=True)
    return (p @ v) / total, (mx + np.log(total))[..., 0]


FORMS = {"sm_90": {"rows_per_block": 64, "key_tile": 64, "wgmma": True}, "sm_80": {"rows_per_block": 64, "key_tile": 32}}


def run_views(B, H, S, D, dtype, causal, arch, lse="rows", offset=0, pad=0, transposed=False, plan="auto"):
    """Build for `arch` (`plan` "auto", or "form": the tensor-core form of the arch, FORMS), run
    in the emulator on fresh inputs with NaN-poisoned outputs, check against float64 NumPy;
    returns the kernel."""
    ins, outs = qkv_attention(B, H, S, D, dtype, causal, lse, offset, pad, transposed)
    if plan == "form":
        plan = Plan((Step("online_contraction_mma", FORMS[arch]),), "test", "")
    k = tc.build(ins + outs, target="sim", arch=arch, plan=plan)
    rng = np.random.default_rng()
    x = rng.standard_normal(tuple(int(n) for n in ins[0].shape)).astype(np.float32).astype(ins[0].dtype.numpy)
    got = [poisoned(t) for t in outs]
    k(x, *got)
    q, kk, v = split_views(x, B, H, S, D, offset, transposed)
    want, want_lse = reference(q, kk, v, causal)
    what = f"views B{B} H{H} S{S} d{D} {dtype} causal={causal} {arch} {lse} offset={offset}"
    tol = bound(dtype, S, v)
    check(f"{what}: O", got[0].astype(np.float64), want, tol, k.plan)
    if lse is not None:
        check(f"{what}: log-sum-exp", got[1].astype(np.float64).reshape(want_lse.shape), want_lse, tol, k.plan)
    return k


def on_tensor_cores(plan, arch):
    """The plan's step is the tensor-core form of `arch` (wgmma on sm_90, mma.sync on sm_80)."""
    (step,) = plan.steps
    return step.primitive == "online_contraction_mma" and bool(step.args.get("wgmma")) == (arch == "sm_90")


CASES = [(dtype, D, causal) for dtype in ("float16", "bfloat16") for D in (64, 128) for causal in (True, False)]
IDS = [f"{c[0]}-d{c[1]}-{'causal' if c[2] else 'full'}" for c in CASES]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("dtype,D,causal", CASES, ids=IDS)
def test_gpt2_attention_over_views_plans_on_tensor_cores(arch, dtype, D, causal):
    """GPT-2's attention (B 8, S 1024, 768 channels in heads of D) over views of one projection,
    the log-sum-exp as cudnn returns it: the planner takes the tensor-core form of the target."""
    ins, outs = qkv_attention(8, 768 // D, 1024, D, dtype, causal, lse="unit")
    result = plan_program(ins + outs, arch)
    assert result.plan.strategy == "online_contraction_mma" and on_tensor_cores(result.plan, arch), result.plan


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("dtype,D,causal", CASES, ids=IDS)
def test_views_of_one_projection_match_numpy_in_the_emulator(arch, dtype, D, causal):
    """The tensor-core form of the target over the views, against float64 NumPy; and plan="auto"
    at this small size takes one of the tensor-core forms (not the SIMT kernel) and matches too."""
    k = run_views(2, 2, 45, D, dtype, causal, arch, plan="form")
    assert on_tensor_cores(k.plan, arch) and len(k.module.kernels) == 1, k.plan
    auto = run_views(1, 2, 45, D, dtype, causal, arch)
    assert auto.plan.strategy == "online_contraction_mma", auto.plan


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cudnn_log_sum_exp_with_a_unit_axis_is_a_row_output(arch):
    """cudnn's SDPA returns the log-sum-exp as [B, H, S, 1]: a row output with a trailing unit
    axis (online_chain.row_index), not a second contraction output; several key tiles (S = 150)."""
    k = run_views(1, 2, 150, 64, "bfloat16", True, arch, lse="unit", plan="form")
    assert on_tensor_cores(k.plan, arch) and len(k.module.kernels) == 1, k.plan
    assert run_views(1, 2, 150, 64, "bfloat16", True, arch, lse="unit").plan.strategy == "online_contraction_mma"


@pytest.mark.parametrize("offset,pad,why", [(4, 8, "innermost index .* moves by 4"),
                                            (0, 4, "stride 388 that is not a multiple of 8")])
def test_a_view_off_16_bytes_is_not_read_by_the_copies(offset, pad, why):
    """Columns shifted by 4 halves (8 bytes), or rows 388 halves apart: rows that do not start
    16-byte aligned, so the tensor-core form refuses saying why, and the program still runs
    correctly on another plan."""
    k = run_views(1, 2, 40, 64, "float16", True, "sm_80", offset=offset, pad=pad)
    assert k.plan.strategy != "online_contraction_mma", k.plan
    assert re.search(f"SIMT, not tensor cores: .*{why}.*16-byte aligned", k.plan.reason), k.plan.reason


def test_a_column_along_the_outer_dimension_is_refused():
    ins, outs = qkv_attention(1, 2, 40, 64, "float16", False, transposed=True)
    from tecc.passes.rewrite.online_contraction import online_chain
    from tecc.passes.rewrite.online_mma_chain import tensor_core_chain
    from tecc.ir.errors import ScheduleError

    with pytest.raises(ScheduleError, match="innermost"):
        tensor_core_chain(online_chain(ins + outs))
    run_views(1, 2, 40, 64, "float16", False, "sm_80", transposed=True)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_views_compile_with_nvrtc_without_spills(arch):
    """GPT-2's shape (B 8, H 12, S 1024, d 64, bf16, causal) compiles for the target with no spills."""
    skip_without_nvrtc(arch)
    ins, outs = qkv_attention(8, 12, 1024, 64, "bfloat16", True, lse="unit")
    f = tc.build(ins + outs, target="cuda", arch=arch)
    assert on_tensor_cores(f.plan, arch), f.plan
    (res,) = f.resources.values()
    assert res.spill_stores == 0 and res.spill_loads == 0, res


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D,causal", CASES, ids=IDS)
def test_views_on_the_gpu_match_sdpa(dtype, D, causal):
    """GPT-2's attention (B 8, H 12 (6 at d = 128), S 1024) over views of one projection on the
    GPU: the tensor-core form for the device, within the float64 bound, and within twice that of
    torch's SDPA on the same views."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("needs an sm_80+ GPU")
    major = torch.cuda.get_device_capability()[0]
    arch = "sm_90" if major == 9 else "sm_80"
    B, H, S = 8, 768 // D, 1024
    ins, outs = qkv_attention(B, H, S, D, dtype, causal, lse="unit")
    f = tc.build(ins + outs, target="cuda", arch=arch)
    assert on_tensor_cores(f.plan, arch), f.plan
    tdtype = getattr(torch, dtype)
    x = torch.randn(B * S, 3 * H * D, device="cuda", dtype=tdtype)
    o = torch.full((B, H, S, D), float("nan"), device="cuda", dtype=tdtype)
    lse = torch.full((B, H, S, 1), float("nan"), device="cuda", dtype=torch.float32)
    f(x, o, lse)
    torch.cuda.synchronize()
    q, k, v = (t.view(B, S, H, D).permute(0, 2, 1, 3) for t in x.split(H * D, dim=1))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).double()
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(D)
    if causal:
        s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    want = torch.softmax(s, dim=-1) @ v64
    want_lse = torch.logsumexp(s, dim=-1)
    tol = bound(dtype, S, v64.abs().max().item() * np.ones(1))
    got = o.double()
    for what, a, b, t in (("float64", got, want, tol), ("SDPA", got, sdpa, 2 * tol)):
        err = ((a - b).abs() / (1 + b.abs())).max().item()
        assert err <= t, f"views d={D} {dtype} causal={causal} against {what}: {err:.3g} > {t:.3g}, plan {f.plan}"
    err = ((lse[..., 0].double() - want_lse).abs() / (1 + want_lse.abs())).max().item()
    assert err <= tol, f"log-sum-exp: {err:.3g} > {tol:.3g}"
