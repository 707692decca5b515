"""Convolutions from tensor expressions vs cuDNN (torch conv2d, channels_last) — issue 16.

    python benchmarks/conv.py [--quick] [--out DIR] [--no-fp32] [--no-depthwise] [--dtype float16]
                              [--layers 0,4,5] [--sweep K] [--sweep-strategy NAME] [--plans sm_90]

Each layer is written as an ordinary tensor expression (docs/conv.md): NHWC activations, RSCF
filters, `tc.sum` over (c, r, s), padding by `tc.where` on the index, the float16 sum in float32
(`tc.cast(tc.sum(float32(x) · float32(w)), dtype)`), planned by the planner for the live GPU
(`plan_program`: fp16 layers are implicit GEMMs on tensor cores, gemm_tensor_core / gemm_wgmma;
fp32 layers implicit GEMMs on the SGEMM kernel, gemm_implicit; depthwise layers stencils,
stencil_tile) and built with
`tc.build(args, plan=plan)`. The same layer runs through torch.nn.functional.conv2d on
channels_last tensors with torch.backends.cudnn.benchmark = True, in the same process, TF32 off
on both sides (fp32 rows). Results are checked against torch in float64.

Rows: the ResNet-50 3x3 and 1x1 layers at batch 32 in float16 (and float32 with --fp32, the
default), and depthwise 3x3 layers (groups = C: memory-bound, stencil_tile). Times are
CUDA-event medians (benchmarks/gemm.py's time_call: events around one Python call; time_kernels:
the GPU time of the call's launches; time_stream: 10 back-to-back calls / 10). `ratio` = cuDNN /
tecc per call, `ratio_kernel` = cuDNN back-to-back / tecc kernel time. Prints the table and the
geometric means; `--out DIR` writes DIR/conv.json.

The plan is the planner's with build's compile check (`refuse_spills`: a point ptxas spills is
passed over, as `tc.build(..., plan="auto")` does). `--dtype float16` keeps one dtype's rows,
`--layers 0,4,5` the dense layers of those indices in LAYERS (depthwise rows: `--no-depthwise`
drops them). `--sweep K` also times, for each selected dense layer, the planner's next K-1 ranked
points (each row: the point, its rank and predicted time, `sweep: true`), `--sweep-strategy
gemm_wgmma` every point of that strategy instead: what the cost model's ranking should be fitted
to. `--plans sm_90` needs no GPU: it prints each selected layer's plan, predicted time and the
ptxas registers / spills of its kernels for that arch (NVRTC only).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm import time_call, time_kernels, time_stream  # noqa: E402  (benchmarks/gemm.py)

# (N, H, W, C, F, R, stride): ResNet-50's 3x3 and 1x1 layers at batch 32 (pad R // 2)
LAYERS = [
    (32, 56, 56, 64, 64, 3, 1), (32, 28, 28, 128, 128, 3, 1), (32, 14, 14, 256, 256, 3, 1), (32, 7, 7, 512, 512, 3, 1),
    (32, 56, 56, 64, 256, 1, 1), (32, 56, 56, 256, 64, 1, 1), (32, 28, 28, 512, 128, 1, 1),
    (32, 14, 14, 1024, 256, 1, 1), (32, 7, 7, 2048, 512, 1, 1), (32, 56, 56, 128, 128, 3, 2),
]
QUICK = [LAYERS[0], LAYERS[2], LAYERS[4]]
DEPTHWISE = [(32, 56, 56, 64, 3, 1), (32, 28, 28, 256, 3, 1), (32, 14, 14, 512, 3, 1)]  # (N, H, W, C, R, stride)


def conv_tensors(n: int, h: int, w: int, c: int, f: int, r: int, stride: int, dtype: str,
                 depthwise: bool = False) -> list[Any]:
    """Y[n, p, q, f] = Σ_{c, r, s} X[n, p·stride + r - pad, q·stride + s - pad, c] · W[r, s, c, f]
    (depthwise: Y[n, p, q, c] = Σ_{r, s} X[.., c] · W[r, s, c]), zero padding by where()."""
    import tecc as tc

    pad = r // 2
    p_out, q_out = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    X = tc.placeholder((n, h, w, c), dtype, "X")
    Wt = tc.placeholder((r, r, c) if depthwise else (r, r, c, f), dtype, "Wt")
    rr, ss = tc.reduce_axis(r, "r"), tc.reduce_axis(r, "s")
    cc = None if depthwise else tc.reduce_axis(c, "c")

    def term(x: Any, wv: Any) -> Any:
        return x * wv if dtype == "float32" else tc.cast(x, "float32") * tc.cast(wv, "float32")

    def body(b: Any, p: Any, q: Any, o: Any) -> Any:
        hh, ww = p * stride + rr - pad, q * stride + ss - pad
        ch = o if depthwise else cc
        x = X[b, hh, ww, ch]
        if pad:
            x = tc.where((hh >= 0) & (hh < h) & (ww >= 0) & (ww < w), x, tc.const(0, dtype))
        wv = Wt[rr, ss, o] if depthwise else Wt[rr, ss, cc, o]
        acc = tc.sum(term(x, wv), axis=[rr, ss] if depthwise else [cc, rr, ss])
        return acc if dtype == "float32" else tc.cast(acc, dtype)

    Y = tc.compute((n, p_out, q_out, c if depthwise else f), body, name="Y")
    return [X, Wt, Y]


def run_layer(n: int, h: int, w: int, c: int, f: int, r: int, stride: int, dtype: str,
              depthwise: bool = False, plan: Any = None, label: str = "") -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import tecc as tc
    from tecc.compiler.pipeline import refuse_spills
    from tecc.compiler.planner import plan_program

    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    args = conv_tensors(n, h, w, c, f, r, stride, dtype, depthwise)
    t0 = time.perf_counter()
    if plan is None:
        res = plan_program(args, compile_check=refuse_spills)
        plan, label = res.plan, "; ".join(kp.chosen.label for kp in res.kernels)
    kern = tc.build(args, plan=plan)
    build_s = time.perf_counter() - t0
    pad = r // 2
    x = torch.randn(n, h, w, c, device="cuda").to(tdt)                        # NHWC, contiguous
    out_c = c if depthwise else f
    w_t = torch.randn(out_c, 1 if depthwise else c, r, r, device="cuda").to(tdt)   # torch's (F, C/g, R, S)
    w_tecc = (w_t[:, 0].permute(1, 2, 0) if depthwise else w_t.permute(2, 3, 1, 0)).contiguous()  # RSC / RSCF
    x_cl = x.permute(0, 3, 1, 2)                                                # channels_last NCHW view
    w_cl = w_t.contiguous(memory_format=torch.channels_last)
    groups = c if depthwise else 1
    p_out, q_out = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    y = torch.full((n, p_out, q_out, out_c), float("nan"), device="cuda", dtype=tdt)
    kern(x, w_tecc, y)
    torch.cuda.synchronize()
    ref = F.conv2d(x_cl.double(), w_t.double(), stride=stride, padding=pad, groups=groups).permute(0, 2, 3, 1)
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    flops = 2.0 * n * p_out * q_out * out_c * (1 if depthwise else c) * r * r
    reps = max(10, min(100, int(5e11 / flops)))

    def torch_conv() -> Any:
        return F.conv2d(x_cl, w_cl, stride=stride, padding=pad, groups=groups)
    t_tecc = time_call(lambda: kern(x, w_tecc, y), reps)
    t_torch = time_call(torch_conv, reps)
    t_kernel = time_kernels(lambda: kern(x, w_tecc, y), reps)
    t_torch_stream = time_stream(torch_conv, reps)
    t_tecc_stream = time_stream(lambda: kern(x, w_tecc, y), reps)
    kind = "dw" if depthwise else f"{r}x{r}"
    row = {"layer": f"{n}x{h}x{w}x{c}->{out_c} {kind} s{stride}", "dtype": dtype, "depthwise": depthwise,
           "tecc_tflops": flops / t_tecc / 1e12, "cudnn_tflops": flops / t_torch / 1e12, "ratio": t_torch / t_tecc,
           "rel_err": err, "plan": label, "build_s": build_s, "tecc_call_us": t_tecc * 1e6,
           "cudnn_call_us": t_torch * 1e6, "tecc_kernel_us": t_kernel * 1e6, "tecc_stream_us": t_tecc_stream * 1e6,
           "cudnn_stream_us": t_torch_stream * 1e6, "ratio_kernel": t_torch_stream / t_kernel,
           "ratio_stream": t_torch_stream / t_tecc_stream}
    resources = getattr(kern, "resources", None)
    if resources:
        row["resources"] = str(resources)
    return row


def ranked_plans(layer: tuple[int, ...], dtype: str, count: int, strategy: str | None = None,
                 arch: str | None = None) -> list[tuple[Any, str, int, float]]:
    """(plan, label, rank, predicted us) of the planner's `count` best points for a dense layer
    (or every point of `strategy`, in the planner's order), each realized on a fresh Schedule;
    points a primitive refuses are left out. Rank 0 is the planner's first choice."""
    from tecc.compiler.planner import plan_program
    from tecc.compiler.schedule import Schedule
    from tecc.ir.errors import ScheduleError

    args = conv_tensors(*layer, dtype=dtype)
    res = plan_program(args, arch, keep=10**6)
    (kp,) = res.kernels
    out = []
    for rank, cand in enumerate(kp.ranked):
        if cand.failed is not None or cand.strategy.uses_default_schedule:
            continue
        if strategy is not None and cand.strategy.name != strategy:
            continue
        sch = Schedule(args)
        try:
            cand.strategy.apply(sch, kp.info, cand.point)
        except ScheduleError:
            continue
        out.append((sch.plan, cand.label, rank, cand.cost.total * 1e6))
        if strategy is None and len(out) >= count:
            break
    return out


def print_plans(layers: list[tuple[int, ...]], dtypes: list[str], arch: str, depthwise: bool = True) -> None:
    """The planner's choice for each layer (and the depthwise layers) on `arch` (build's spill
    check included) and the ptxas report of its kernels; NVRTC only, no GPU."""
    import tecc as tc
    from tecc.compiler.pipeline import refuse_spills
    from tecc.compiler.planner import plan_program

    jobs = [(layer, False) for layer in layers]
    if depthwise:
        jobs += [((n, h, w, c, c, r, s), True) for n, h, w, c, r, s in DEPTHWISE]
    for dtype in dtypes:
        for layer, dw in jobs:
            args = conv_tensors(*layer, dtype=dtype, depthwise=dw)
            res = plan_program(args, arch, compile_check=refuse_spills)
            kern = tc.build(args, target="cuda", arch=arch, plan=res.plan)
            regs = ", ".join(f"{name}: {r.registers} registers, {r.spill_stores}/{r.spill_loads} spill st/ld"
                             for name, r in kern.resources.items())
            n, h, w, c, f, r, stride = layer
            kind = "dw" if dw else f"{r}x{r}"
            predicted = sum(kp.chosen.cost.total for kp in res.kernels) * 1e6
            print(f"{n}x{h}x{w}x{c}->{f} {kind} s{stride} {dtype} on {arch}: predicted {predicted:.1f} us; "
                  f"{'; '.join(kp.chosen.label for kp in res.kernels)}; {regs}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three layers (56x56 3x3, 14x14 3x3, 56x56 1x1)")
    ap.add_argument("--out", default=None, help="write DIR/conv.json")
    ap.add_argument("--no-fp32", action="store_true", help="float16 rows only")
    ap.add_argument("--no-depthwise", action="store_true", help="no depthwise rows")
    ap.add_argument("--dtype", action="append", choices=["float16", "float32"],
                    help="only rows of this dtype (repeatable; default both, or float16 with --no-fp32)")
    ap.add_argument("--layers", default=None, help="comma-separated indices into LAYERS (dense rows)")
    ap.add_argument("--sweep", type=int, default=0, help="also time the planner's K best points per dense layer")
    ap.add_argument("--sweep-strategy", default=None,
                    help="with --sweep: time every point of this strategy (gemm_wgmma, gemm_tensor_core) instead")
    ap.add_argument("--plans", default=None, metavar="ARCH",
                    help="print the plans and ptxas registers/spills for ARCH (sm_90, sm_80) and exit; no GPU")
    opts = ap.parse_args()
    dtypes = opts.dtype or (["float16"] if opts.no_fp32 else ["float16", "float32"])
    layers = QUICK if opts.quick else LAYERS
    if opts.layers:
        layers = [LAYERS[int(i)] for i in opts.layers.split(",")]
    if opts.plans:
        print_plans(layers, dtypes, opts.plans, not opts.no_depthwise)
        return
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    jobs: list[tuple[tuple[int, ...], str, bool]] = [(layer, dtype, False) for dtype in dtypes for layer in layers]
    if not opts.no_depthwise:
        for dtype in dtypes:
            jobs += [((n, h, w, c, c, r, s), dtype, True) for n, h, w, c, r, s in (DEPTHWISE[:1] if opts.quick else DEPTHWISE)]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  cudnn {torch.backends.cudnn.version()}  "
          "TF32 off, cudnn.benchmark on, channels_last", flush=True)
    print(f"{'layer':>28} {'dtype':>8} {'tecc TF/s':>10} {'cuDNN TF/s':>11} {'ratio':>6} {'rel err':>8} "
          f"{'kernel us':>9} {'cuDNN us':>9} {'r.kern':>6}  plan", flush=True)
    rows = []
    for layer, dtype, dw in jobs:
        try:
            row = run_layer(*layer, dtype=dtype, depthwise=dw)
        except Exception as exc:  # noqa: BLE001 - report and go on
            row = {"layer": str(layer), "dtype": dtype, "depthwise": dw, "error": f"{type(exc).__name__}: {exc}"[:400]}
            print(row, flush=True)
            rows.append(row)
            continue
        rows.append(row)
        print(f"{row['layer']:>28} {dtype:>8} {row['tecc_tflops']:10.2f} {row['cudnn_tflops']:11.2f} {row['ratio']:6.2f} "
              f"{row['rel_err']:8.1e} {row['tecc_kernel_us']:9.1f} {row['cudnn_stream_us']:9.1f} "
              f"{row['ratio_kernel']:6.2f}  {row['plan']}", flush=True)
    if opts.sweep or opts.sweep_strategy:
        for dtype in dtypes:
            for layer in layers:
                for plan, label, rank, predicted in ranked_plans(layer, dtype, max(opts.sweep, 1), opts.sweep_strategy):
                    try:
                        row = run_layer(*layer, dtype=dtype, plan=plan, label=label)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"sweep {layer} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    row.update(sweep=True, rank=rank, predicted_us=predicted)
                    rows.append(row)
                    print(f"sweep {row['layer']:>28} {dtype:>8} rank {rank:4d} predicted {predicted:7.1f} us "
                          f"kernel {row['tecc_kernel_us']:7.1f} us ratio_kernel {row['ratio_kernel']:5.2f} "
                          f"ratio {row['ratio']:5.2f} err {row['rel_err']:.1e}  {label}", flush=True)
    rows_main = [r for r in rows if not r.get("sweep")]
    for dtype in ("float16", "float32"):
        for dw in (False, True):
            for key in ("ratio", "ratio_kernel"):
                ratios = [r[key] for r in rows_main if key in r and r["dtype"] == dtype and r["depthwise"] == dw]
                if ratios:
                    print(f"geometric mean {key} {dtype} {'depthwise' if dw else 'dense'}: "
                          f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} over {len(ratios)} layers",
                          flush=True)
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "conv.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
