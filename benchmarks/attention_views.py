"""GPT-2's attention over views of one fused QKV projection, tecc vs torch's SDPA on the same views.

    python benchmarks/attention_views.py [--dtype bfloat16|float16] [--reps 20] [--simt] [--out FILE]

GPT-2 small's shape: B 8, S 1024, 768 channels in heads of d = 64 (12 heads) or 128 (6 heads).
Q, K and V are views of one [B·S, 3·768] tensor, as `qkv.split(768, dim=1)` then
`view(B, S, H, d).permute(0, 2, 1, 3)` give them (Q[b, h, i, d] = qkv[b·S + i, h·d + d'], K and V
the next 768 columns): the program the torch lowering builds, with the log-sum-exp as cuDNN's
op returns it ([B, H, S, 1]). Each row builds it with plan="auto" (the tensor-core form reading
the views in place: wgmma on sm_90, mma.sync on sm_80; docs/attention.md "Operands read through
views"), checks the output against float64 on fresh random inputs with a NaN-poisoned output,
and times it with CUDA events in the same process as SDPA's flash and cuDNN backends on the same
views (the ratio is the fastest SDPA's time over tecc's). `--simt`: also the SIMT online
contraction (the fallback where no tensor-core form applies) at d = 64 causal, on views shifted by
4 columns so that the tensor-core forms refuse them: its predicted time next to the measured one
(the cost model's L1 term for its uncoalesced K reads, cost/attention.simt_workload).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.attention import sdpa_times  # noqa: E402
from benchmarks.gemm import time_call  # noqa: E402

B, S, CHANNELS = 8, 1024, 768


def qkv_attention(B: int, H: int, S: int, D: int, dtype: str, causal: bool, lse: str | None = "rows",
                  offset: int = 0, pad: int = 0, transposed: bool = False) -> tuple[list[Any], list[Any]]:
    """(inputs, outputs) of attention over views of one [B·S, 3·C + pad] tensor (C = H·D); `lse`
    "rows" ([B, H, S]), "unit" ([B, H, S, 1], cuDNN's) or None; `offset` shifts every view by that
    many columns (offset <= pad); `transposed` stores the projection as [3·C + pad, B·S]."""
    import tecc as tc

    C = H * D
    X = tc.placeholder((3 * C + pad, B * S) if transposed else (B * S, 3 * C + pad), dtype, name="qkv")

    def at(part: int, b: Any, h: Any, i: Any, d: Any) -> Any:
        row, col = b * S + i, part * C + h * D + d + offset
        return X[col, row] if transposed else X[row, col]

    d = tc.reduce_axis(D, name="d")
    scale = 1.0 / math.sqrt(D)

    def score(b: Any, h: Any, i: Any, j: Any) -> Any:
        s = tc.sum(tc.cast(at(0, b, h, i, d), "float32") * tc.cast(at(1, b, h, j, d), "float32"), axis=d) * scale
        return tc.where(j <= i, s, -math.inf) if causal else s

    Sc = tc.compute((B, H, S, S), score, name="S")
    j1, j2, j3 = (tc.reduce_axis(S, name=n) for n in ("j1", "j2", "j3"))
    m = tc.compute((B, H, S), lambda b, h, i: tc.max(Sc[b, h, i, j1], axis=j1), name="m")
    e = tc.compute((B, H, S, S), lambda b, h, i, j: tc.exp(Sc[b, h, i, j] - m[b, h, i]), name="e")
    total = tc.compute((B, H, S), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
    O = tc.compute((B, H, S, D), lambda b, h, i, c: tc.cast(
        tc.sum(e[b, h, i, j3] * tc.cast(at(2, b, h, j3, c), "float32"), axis=j3) / total[b, h, i], dtype), name="O")
    outs = [O]
    if lse is not None:
        lse_t = tc.compute((B, H, S), lambda b, h, i: m[b, h, i] + tc.log(total[b, h, i]), name="lse")
        if lse == "unit":
            lse_t = tc.compute((B, H, S, 1), lambda b, h, i, one: lse_t[b, h, i], name="lse_out")
        outs.append(lse_t)
    return [X], outs


def _views(x: Any, H: int, D: int, offset: int = 0) -> list[Any]:
    C = H * D
    return [x[:, offset + n * C: offset + (n + 1) * C].view(B, S, H, D).permute(0, 2, 1, 3) for n in range(3)]


def _check(o: Any, x: Any, H: int, D: int, causal: bool, offset: int, dtype: str) -> float:
    """The worst |o - float64| / (1 + |want|); raises past the dtype's bound."""
    import torch

    q, k, v = (t.double() for t in _views(x, H, D, offset))
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    if causal:
        s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    want = torch.softmax(s, dim=-1) @ v
    err = ((o.double() - want).abs() / (1 + want.abs())).max().item()
    eps = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[dtype]
    limit = 2 * S * 2.0 ** -23 + eps + eps / 2 * v.abs().max().item()
    if not err <= limit:
        raise AssertionError(f"d={D} causal={causal}: error {err:.3g} > {limit:.3g}")
    return err


def run(D: int, causal: bool, dtype: str, reps: int, plan: Any = "auto", offset: int = 0) -> dict[str, Any]:
    import torch

    import tecc as tc

    H = CHANNELS // D
    ins, outs = qkv_attention(B, H, S, D, dtype, causal, lse="unit", offset=offset, pad=8 if offset else 0)
    arch = "sm_90" if torch.cuda.get_device_capability()[0] == 9 else "sm_80"
    f = tc.build(ins + outs, target="cuda", arch=arch, plan=plan)
    tdtype = getattr(torch, dtype)
    x = torch.randn(B * S, int(ins[0].shape[1]), device="cuda", dtype=tdtype)
    o = torch.full((B, H, S, D), float("nan"), device="cuda", dtype=tdtype)
    lse = torch.full((B, H, S, 1), float("nan"), device="cuda", dtype=torch.float32)
    f(x, o, lse)
    torch.cuda.synchronize()
    err = _check(o, x, H, D, causal, offset, dtype)
    t = time_call(lambda: f(x, o, lse), reps)
    row = {"d": D, "causal": causal, "dtype": dtype, "plan": str(f.plan.steps[0]), "us": t * 1e6, "error": err}
    if plan == "auto":
        q, k, v = _views(x, H, D)
        sdpa = sdpa_times(q, k, v, causal, reps)
        row.update({f"{name}_us": s * 1e6 for name, s in sdpa.items()})
        if sdpa:
            row["ratio"] = min(sdpa.values()) / t
    return row


def simt_row(dtype: str, reps: int) -> dict[str, Any]:
    """The SIMT form at d = 64 causal over views 4 columns off (no tensor-core form takes them):
    the cost model's prediction and the measured time."""
    import torch

    from tecc.compiler.planner import plan_strategy

    arch = "sm_90" if torch.cuda.get_device_capability()[0] == 9 else "sm_80"
    ins, outs = qkv_attention(B, CHANNELS // 64, S, 64, dtype, True, lse="unit", offset=4, pad=8)
    result = plan_strategy(ins + outs, "online_contraction", arch)
    assert result is not None, "the SIMT form declined the shifted views"
    predicted, point = result.predicted_seconds * 1e6, result.plan
    row = run(64, True, dtype, max(3, reps // 5), plan=point, offset=4)
    row["predicted_us"] = predicted
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--simt", action="store_true", help="also the SIMT form's predicted and measured time")
    p.add_argument("--out", default=None, help="a JSON file for the rows")
    a = p.parse_args()
    rows = []
    print("| d | causal | plan | tecc us | flash us | cudnn us | fastest SDPA / tecc | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for D in (64, 128):
        for causal in (True, False):
            r = run(D, causal, a.dtype, a.reps)
            rows.append(r)
            print(f"| {D} | {causal} | {r['plan']} | {r['us']:.1f} | {r.get('flash_us', float('nan')):.1f} | "
                  f"{r.get('cudnn_us', float('nan')):.1f} | {r.get('ratio', float('nan')):.2f} | {r['error']:.2g} |",
                  flush=True)
    if a.simt:
        r = simt_row(a.dtype, a.reps)
        rows.append(r)
        print(f"SIMT online_contraction, d 64 causal, views 4 columns off: measured {r['us']:.0f} us, predicted "
              f"{r['predicted_us']:.0f} us (ratio {r['us'] / r['predicted_us']:.2f})")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
