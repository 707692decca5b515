"""fp32 GEMM from a tensor expression vs cuBLAS (torch.matmul, TF32 off) — issue 6.

    python benchmarks/gemm.py [--quick] [--sweep] [--out DIR] [--dtype float32|float16|bfloat16]

For each shape the matmul is written as `tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j],
axis=k))`, planned by the planner (`plan_program`, every registered strategy, the live GPU's
Target), built with `tc.build(args, plan=plan)` (IR → emitter → NVRTC), checked against torch in
float64, and timed with CUDA events (median of the timed runs after warm-up) in the same process
as torch.matmul. Prints the table (shape, tecc TFLOP/s, cuBLAS TFLOP/s, ratio, plan) and the
geometric mean of the ratios. `--sweep` also times every point of gemm_pipelined at 4096³
(`--sweep-strategy gemm_wgmma --dtype float16`: every point of that strategy instead;
`--load tma` or `--load cp.async` keeps only the points of that rung of gemm_wgmma, the ladder's
rows; the TMA points come as a persistent grid of one block per SM and as one block per tile
(`--persistent` / `--persistent off` keep only one kind), and with the epilogue through a
shared staging tile and TMA stores or from registers (`--store-epilogue tma|registers` keeps one);
`--sweep-size 8192` sweeps at 8192³). `--ladder` (float16) times one row per rung of the Hopper
ladder at `--sweep-size`: the best-predicted point of cp.async, TMA, TMA + persistent grid,
TMA + TMA-store epilogue, and TMA + persistent + TMA-store epilogue, with the predicted time,
so each row shows what its rung buys.
`--epilogue` times `D = relu(A·B + bias[j])` at 4096³ (fused into the matmul's kernel by the
lowering) against the plain matmul and against cuBLAS + torch's relu(c + bias).
`--split-sweep` times the split-K points of SPLIT_SWEEP at the four small shapes with the
planner's predicted time and rank.
`--dtype float16` / `bfloat16`: the operands and the result in that dtype, the sum in float32
(`tc.cast(tc.sum(float32(A)·float32(B)), dtype)`: the tensor-core paths, gemm_tensor_core's
mma.sync, or on sm_90 gemm_wgmma's wgmma, whichever the planner ranks first), against
torch.matmul in the same dtype (cuBLAS's half GEMM, float32 accumulation); the table's dtype
column says which. The default float32 compares with cuBLAS's SGEMM (TF32 off).
`--tf32` (float32): TF32 on both sides -- tecc plans and builds with `allow_tf32=True` (the
planner ranks gemm_tensor_core_tf32's mma.m16n8k8 tf32 and, on sm_90, gemm_wgmma_tf32's
wgmma.m64nNk8 tf32 against the SIMT GEMMs) and torch sets
`torch.backends.cuda.matmul.allow_tf32 = True` for cuBLAS; the issue's targets are >= 0.55x and
>= 0.85x cuBLAS at 4096³ (`--quick --tf32`; `--sweep --sweep-strategy gemm_wgmma_tf32 --tf32`
or `gemm_tensor_core_tf32` times every point of a strategy).
Every row has three times: per call (events around one Python call, as in the earlier tables:
host-side argument handling included), kernel (the profiling hook: the GPU time of the call's
launches only) and stream (10 back-to-back calls between two events, / 10); cuBLAS is timed per
call and back-to-back, and `ratio_kernel` = cuBLAS back-to-back / tecc kernel time.
`--rank-small N` times the planner's N best-ranked candidates at 1024³ and 1000³ with their
predicted times.
`--strided` (float16 unless `--dtype bfloat16`) times C = A·B at `--sweep-size`³ with A declared
`strides="any"` and passed as the slice `x[:, :K]` of a K + 64 wide tensor (16-byte-multiple rows:
the cp.async loop), against torch.matmul on the same view, against the contiguous build on a
contiguous A, on a transposed view of A (w.t(): the transposed-view copy loop of the same
kernel), and with B declared `strides="any"` and passed as w.t() for w (N, K) contiguous (the
Linear layer's x @ w.t(): B's transposed-view copy loop); `--strided-only gemm_tensor_core` restricts the
planner (mma.sync on sm_90); `--only STRATEGY` does so for the table of shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = [  # (batch, M, N, K, note)
    (1, 1024, 1024, 1024, ""), (1, 2048, 2048, 2048, ""), (1, 4096, 4096, 4096, ""), (1, 8192, 8192, 8192, ""),
    (1, 1000, 1000, 1000, ""), (1, 4096, 1024, 4096, ""), (1, 127, 4096, 1023, ""), (1, 8192, 64, 8192, ""),
    (32, 512, 512, 512, "batched"),
]


DTYPE = "float32"  # --dtype: the operands' and the result's dtype
TF32 = False       # --tf32: allow_tf32=True for tecc, TF32 on for cuBLAS


def matmul_tensors(batch: int, m: Any, n: int, k: int, dtype: str | None = None) -> list[Any]:
    import tecc as tc

    dtype = dtype or DTYPE
    r = tc.reduce_axis(k, name="k")

    def product(a: Any, b: Any) -> Any:
        if dtype == "float32":
            return tc.sum(a * b, axis=r)
        return tc.cast(tc.sum(tc.cast(a, "float32") * tc.cast(b, "float32"), axis=r), dtype)

    if batch == 1:
        A = tc.placeholder((m, k), dtype, name="A")
        B = tc.placeholder((k, n), dtype, name="B")
        C = tc.compute((m, n), lambda i, j: product(A[i, r], B[r, j]), name="C")
    else:
        A = tc.placeholder((batch, m, k), dtype, name="A")
        B = tc.placeholder((batch, k, n), dtype, name="B")
        C = tc.compute((batch, m, n), lambda b, i, j: product(A[b, i, r], B[b, r, j]), name="C")
    return [A, B, C]


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def epilogue_tensors(m: int, n: int, k: int) -> list[Any]:
    """D[i, j] = relu(C[i, j] + bias[j]) with C = A·B not an output: one kernel after lowering."""
    import tecc as tc

    r = tc.reduce_axis(k, name="k")
    A = tc.placeholder((m, k), "float32", name="A")
    B = tc.placeholder((k, n), "float32", name="B")
    bias = tc.placeholder((n,), "float32", name="bias")
    C = tc.compute((m, n), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    D = tc.compute((m, n), lambda i, j: tc.maximum(C[i, j] + bias[j], 0.0), name="D")
    return [A, B, bias, D]


def run_epilogue(m: int, n: int, k: int) -> dict[str, Any]:
    import torch

    import tecc as tc
    from tecc.compiler.planner import plan_program

    res = plan_program(epilogue_tensors(m, n, k))
    fused = tc.build(epilogue_tensors(m, n, k), plan=res.plan)
    plain_res = plan_program(matmul_tensors(1, m, n, k))
    plain = tc.build(matmul_tensors(1, m, n, k), plan=plain_res.plan)
    a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
    bias = torch.randn(n, device="cuda")
    d = torch.full((m, n), float("nan"), device="cuda")
    c = torch.empty((m, n), device="cuda")
    fused(a, b, bias, d)
    torch.cuda.synchronize()
    ref = torch.relu(a.double() @ b.double() + bias.double())
    err = float((d.double() - ref).abs().max() / ref.abs().max())
    flops = 2.0 * m * n * k
    reps = max(5, min(50, int(2e12 / flops)))
    t_fused = time_call(lambda: fused(a, b, bias, d), reps)
    t_plain = time_call(lambda: plain(a, b, c), reps)
    t_torch = time_call(lambda: torch.relu(torch.matmul(a, b) + bias), reps)
    return {"shape": f"{m}x{n}x{k}", "epilogue": True, "kernels": len(fused.module.kernels),
            "temps": len(fused.module.temps), "fused_us": t_fused * 1e6, "plain_us": t_plain * 1e6,
            "torch_unfused_us": t_torch * 1e6, "fused_over_plain": t_fused / t_plain, "rel_err": err,
            "plan": "; ".join(kp.chosen.label for kp in res.kernels)}


def time_call(fn: Any, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3)
    times.sort()
    return times[len(times) // 2]


def time_kernels(fn: Any, reps: int) -> float:
    """Median over `reps` calls of the GPU time of the call's kernels alone (the profiling hook:
    CUDA events around each launch, summed over the launches of one call, e.g. split-K's partial
    and combine kernels). Host-side argument handling before a launch is not in it."""
    import tecc as tc

    fn()
    times = []
    with tc.profile() as prof:
        for _ in range(reps):
            before = len(prof.launches)
            fn()
            times.append(sum(r.time_ms or 0.0 for r in prof.launches[before:]) * 1e-3)
    times.sort()
    return times[len(times) // 2]


def kernel_durations(fn: Any, calls: int, warmup: int = 0) -> dict[str, list[float]]:
    """Every CUDA kernel's device durations in µs by name over `calls` calls of `fn` under
    torch.profiler (CUPTI), after `warmup` calls outside it (benchmarks/gemm_small.py,
    attention_backward.py, loss_head.py, model_profile.py and models_hf.py time kernels with it)."""
    import collections

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            kernels[e.name].append(e.device_time)
    return dict(kernels)


def time_stream(fn: Any, reps: int, calls: int = 10) -> float:
    """Median over `reps` rounds of (time of `calls` back-to-back calls between two events) /
    `calls`: the host work of one call overlaps the GPU work of the previous one, so this is GPU
    time when the host keeps ahead and host time per call when it does not."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, reps // calls)):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3 / calls)
    times.sort()
    return times[len(times) // 2]


def run_shape(batch: int, m: int, n: int, k: int, plan: Any = None, label: str | None = None,
              only: list[str] | None = None, symbolic: bool = False) -> dict[str, Any]:
    import torch

    import tecc as tc
    from tecc.compiler.planner import plan_program, resolve_target

    args = matmul_tensors(batch, tc.var("M") if symbolic else m, n, k)
    t0 = time.perf_counter()
    if plan is None:
        # the live GPU's Target, with TF32 allowed under --tf32 (what build(allow_tf32=True) plans for)
        target = resolve_target(None).replace(allow_tf32=TF32)
        res = plan_program(args, target, only=only, sizes={"M": m} if symbolic else None)
        plan = res.plan
        label = "; ".join(kp.chosen.label for kp in res.kernels)
    kern = tc.build(args, plan=plan, allow_tf32=TF32)  # a given plan names its intrinsic (tf32 or not) itself
    build_s = time.perf_counter() - t0
    shape_a, shape_b, shape_c = ((m, k), (k, n), (m, n)) if batch == 1 else ((batch, m, k), (batch, k, n), (batch, m, n))
    a = torch.randn(*shape_a, device="cuda").to(torch_dtype(DTYPE))
    b = torch.randn(*shape_b, device="cuda").to(torch_dtype(DTYPE))
    c = torch.full(shape_c, float("nan"), device="cuda", dtype=torch_dtype(DTYPE))
    kern(a, b, c)
    torch.cuda.synchronize()
    ref = torch.matmul(a.double(), b.double())
    err = float((c.double() - ref).abs().max() / ref.abs().max())
    flops = 2.0 * batch * m * n * k
    reps = max(5, min(50, int(2e12 / flops)))
    t_tecc = time_call(lambda: kern(a, b, c), reps)
    t_cublas = time_call(lambda: torch.matmul(a, b), reps)
    t_kernel = time_kernels(lambda: kern(a, b, c), reps)
    t_tecc_stream = time_stream(lambda: kern(a, b, c), reps)
    t_cublas_stream = time_stream(lambda: torch.matmul(a, b), reps)
    row = {"shape": f"{batch}x{m}x{n}x{k}" if batch > 1 else f"{m}x{n}x{k}", "dtype": DTYPE + ("/tf32" if TF32 else ""),
           "tecc_tflops": flops / t_tecc / 1e12,
           "cublas_tflops": flops / t_cublas / 1e12, "ratio": t_cublas / t_tecc, "rel_err": err,
           "plan": label, "build_s": build_s,
           "tecc_call_us": t_tecc * 1e6, "cublas_call_us": t_cublas * 1e6, "tecc_kernel_us": t_kernel * 1e6,
           "tecc_stream_us": t_tecc_stream * 1e6, "cublas_stream_us": t_cublas_stream * 1e6,
           "ratio_kernel": t_cublas_stream / t_kernel, "ratio_stream": t_cublas_stream / t_tecc_stream}
    res_ = getattr(kern, "resources", None)
    if res_:
        row["resources"] = str(res_)
    return row


def run_strided(size: int, pad: int = 64, only: list[str] | None = None) -> list[dict[str, Any]]:
    """`--strided`: rows for a strided A (module docstring), each with the kernel and per-call times."""
    import torch

    import tecc as tc
    from tecc.compiler.planner import plan_program, resolve_target

    dtype = DTYPE if DTYPE != "float32" else "float16"
    m = n = k = size
    r = tc.reduce_axis(k, name="k")

    def tensors(strided: str) -> list[Any]:
        A = tc.placeholder((m, k), dtype, name="A", strides="any" if strided == "A" else None)
        B = tc.placeholder((k, n), dtype, name="B", strides="any" if strided == "B" else None)
        C = tc.compute((m, n), lambda i, j: tc.cast(tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[r, j], "float32"),
                                                           axis=r), dtype), name="C")
        return [A, B, C]

    target = resolve_target(None)
    kernels = {}
    for strided in ("A", "B", ""):
        args = tensors(strided)
        res = plan_program(args, target, only=only)
        kernels[strided] = (tc.build(args, plan=res.plan), "; ".join(kp.chosen.label for kp in res.kernels))
    t = torch_dtype(dtype)
    wide = torch.randn(m, k + pad, device="cuda").to(t)
    b = torch.randn(k, n, device="cuda").to(t)
    w = torch.randn(n, k, device="cuda").to(t)   # a Linear layer's weight: x @ w.t()
    # (label, which build, A, B): the transposed views take the transposed-view copy loop
    cases = [("A slice x[:, :K]", "A", wide[:, :k], b),
             ("A contiguous", "A", wide[:, :k].contiguous(), b),
             ("A contiguous", "", wide[:, :k].contiguous(), b),
             ("A transposed view", "A", torch.randn(k, m, device="cuda").to(t).t(), b),
             ("B = w.t()", "B", wide[:, :k].contiguous(), w.t()),
             ("B contiguous", "B", wide[:, :k].contiguous(), b)]
    c = torch.full((m, n), float("nan"), device="cuda", dtype=t)
    flops = 2.0 * m * n * k
    reps = max(5, min(50, int(2e12 / flops)))
    rows = []
    for what, strided, a, bb in cases:
        kern, label = kernels[strided]
        kern(a, bb, c)
        torch.cuda.synchronize()
        ref = torch.matmul(a.double(), bb.double())
        err = float((c.double() - ref).abs().max() / ref.abs().max())
        t_kernel = time_kernels(lambda: kern(a, bb, c), reps)
        t_call = time_call(lambda: kern(a, bb, c), reps)
        t_torch = time_stream(lambda: torch.matmul(a, bb), reps)
        build = f"{strided} strides='any'" if strided else "contiguous"
        row = {"shape": f"{m}x{n}x{k}", "dtype": dtype, "view": what, "A_strides": list(a.stride()),
               "B_strides": list(bb.stride()), "build": build, "plan": label, "rel_err": err,
               "tecc_kernel_us": t_kernel * 1e6, "tecc_call_us": t_call * 1e6, "torch_stream_us": t_torch * 1e6,
               "tecc_tflops": flops / t_kernel / 1e12, "ratio_kernel": t_torch / t_kernel,
               "resources": str(getattr(kern, "resources", ""))}
        rows.append(row)
        print(f"strided {row['shape']:>14} {dtype:>8} {what:>18} {build:>16}: tecc kernel "
              f"{row['tecc_kernel_us']:8.1f} us ({row['tecc_tflops']:6.1f} TF/s), torch.matmul same views "
              f"{row['torch_stream_us']:8.1f} us, ratio {row['ratio_kernel']:5.2f}, err {err:.1e}  {label}", flush=True)
    return rows


# (M, N, K) -> gemm_pipelined points (bm, bn, bk, split) around the planner's choice
SPLIT_SWEEP = {
    (1024, 1024, 1024): [(128, 128, 16, 4), (128, 128, 16, 2), (64, 128, 16, 4), (64, 128, 16, 2),
                         (64, 128, 16, 8), (128, 64, 16, 4), (64, 64, 16, 4)],
    (1000, 1000, 1000): [(128, 128, 16, 4), (128, 128, 16, 2), (64, 128, 16, 4), (64, 128, 16, 2),
                         (128, 64, 16, 4)],
    (127, 4096, 1023): [(128, 128, 16, 8), (128, 128, 16, 4), (64, 128, 16, 4), (64, 128, 16, 8),
                        (128, 64, 16, 4)],
    (8192, 64, 8192): [(128, 64, 16, 8), (128, 64, 16, 4), (128, 64, 16, 16), (64, 64, 16, 8)],
}


def split_sweep() -> list[dict[str, Any]]:
    """Every SPLIT_SWEEP point: predicted µs (the planner's cost), kernel time, per-call time."""
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.planner import plan_program
    from tecc.compiler.schedule import Schedule
    from tecc.passes.lower import lower as lower_

    rows = []
    for (m, n, k), points in SPLIT_SWEEP.items():
        kp = plan_program(matmul_tensors(1, m, n, k), keep=5000).kernels[0]
        ranked = [c for c in kp.ranked if c.ok]
        for bm, bn, bk, split in points:
            want = {"bm": bm, "bn": bn, "bk": bk, "split": split}
            found = [(rank, c) for rank, c in enumerate(ranked) if c.strategy.name == "gemm_pipelined"
                     and {x: int(c.point.get(x, 1)) for x in want} == want]
            if not found:
                print(f"split-sweep {m}x{n}x{k} {want}: not in the planner's space", flush=True)
                continue
            rank, cand = found[0]
            args = matmul_tensors(1, m, n, k)
            sch = Schedule(args)
            cand.strategy.apply(sch, analyze_kernel(lower_(args).kernels[0]), cand.point)
            try:
                row = run_shape(1, m, n, k, plan=sch.plan, label=cand.label)
            except Exception as exc:  # noqa: BLE001
                print("split-sweep", want, "failed:", type(exc).__name__, str(exc)[:200], flush=True)
                continue
            row.update(split_sweep=True, rank=rank, predicted_us=cand.cost.total * 1e6, point=want)
            rows.append(row)
            print(f"split-sweep {row['shape']:>12} {bm}x{bn} k{bk} S{split:<2} rank {rank:3d} predicted "
                  f"{row['predicted_us']:6.1f} us kernel {row['tecc_kernel_us']:6.1f} us call {row['tecc_call_us']:6.1f} "
                  f"us stream {row['tecc_stream_us']:6.1f} us cuBLAS {row['cublas_stream_us']:6.1f} us "
                  f"r.kern {row['ratio_kernel']:5.2f}", flush=True)
    return rows


# The Hopper ladder's rungs: (name, what a gemm_wgmma point must have)
LADDER = (
    ("wgmma + cp.async ring", {"load": "cp.async"}),
    ("+ TMA producer ring", {"load": "tma", "persistent": 0, "epilogue": "registers"}),
    ("+ persistent grid", {"load": "tma", "persistent": "sm", "epilogue": "registers"}),
    ("+ TMA-store epilogue", {"load": "tma", "persistent": 0, "epilogue": "tma"}),
    ("+ persistent + TMA-store epilogue (overlapped)", {"load": "tma", "persistent": "sm", "epilogue": "tma"}),
)


def ladder(size: int) -> list[dict[str, Any]]:
    """One row per LADDER rung at size³: its best-predicted gemm_wgmma point, timed."""
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.planner import candidates_for
    from tecc.compiler.schedule import Schedule
    from tecc.ir.target import from_device
    from tecc.passes.lower import lower as lower_

    target = from_device()
    args = matmul_tensors(1, size, size, size)
    info = analyze_kernel(lower_(args).kernels[0])
    cands, _ = candidates_for(info, target)
    ranked = sorted((c for c in cands if c.ok and c.strategy.name == "gemm_wgmma"), key=lambda c: c.cost.total)
    rows = []
    for name, want in LADDER:
        want = {x: (target.sm_count if v == "sm" else v) for x, v in want.items()}
        found = [c for c in ranked if all(c.point.get(x, 0 if x == "persistent" else None) == v
                                          for x, v in want.items())]
        if not found:
            print(f"ladder {name}: no point of this rung in the space", flush=True)
            continue
        cand = found[0]
        sch = Schedule(args)
        cand.strategy.apply(sch, info, cand.point)
        row = run_shape(1, size, size, size, plan=sch.plan, label=cand.label)
        row.update(ladder=name, predicted_us=cand.cost.total * 1e6, point=dict(cand.point))
        rows.append(row)
        print(f"ladder {size}^3 {name:48s} predicted {row['predicted_us']:7.1f} us kernel {row['tecc_kernel_us']:7.1f} "
              f"us stream {row['tecc_stream_us']:7.1f} us cuBLAS {row['cublas_stream_us']:7.1f} us "
              f"r.kern {row['ratio_kernel']:5.2f}  {cand.point}", flush=True)
    return rows


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4096^3 and two irregular shapes only")
    ap.add_argument("--grid", action="store_true",
                    help="every (M, N, K) in {1024, 2048, 4096, 8192}^3 (64 shapes) plus the irregular ones")
    ap.add_argument("--sweep", action="store_true", help="time every gemm_pipelined point at 4096^3")
    ap.add_argument("--sweep-strategy", default="gemm_pipelined",
                    help="the strategy whose points --sweep times (e.g. gemm_wgmma with --dtype float16)")
    ap.add_argument("--load", default=None, choices=("cp.async", "tma"),
                    help="with --sweep-strategy gemm_wgmma: only the points of that rung (the load dimension)")
    ap.add_argument("--sweep-size", type=int, default=4096, help="the cube --sweep times (default 4096)")
    ap.add_argument("--persistent", nargs="?", const="on", default="both", choices=("on", "off", "both"),
                    help="with --load tma: only the persistent-grid points (on), only one block per tile (off)")
    ap.add_argument("--store-epilogue", default=None, choices=("tma", "registers"),
                    help="with --load tma: only the points with that epilogue (staging tile + TMA store, or registers)")
    ap.add_argument("--ladder", action="store_true",
                    help="one row per rung of the Hopper ladder at --sweep-size (float16, gemm_wgmma)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, metavar="STRATEGY",
                    help="plan the table's shapes with this strategy only (e.g. gemm_tensor_core: the mma.sync path on sm_90)")
    ap.add_argument("--compare", action="store_true", help="also time gemm_pipelined where the planner chose another")
    ap.add_argument("--symbolic", action="store_true", help="check a symbolic-M build at M=1000 and M=4096")
    ap.add_argument("--sweep-small", action="store_true",
                    help="time every gemm_pipelined point at 1024^3, 1000^3 and 127x4096x1023")
    ap.add_argument("--epilogue", action="store_true", help="relu(A·B + bias) fused vs plain matmul at 4096^3")
    ap.add_argument("--rank-small", type=int, default=0,
                    help="time the planner's N best-ranked candidates at 1024^3 and 1000^3")
    ap.add_argument("--split-sweep", action="store_true",
                    help="time a few split-K points (SPLIT_SWEEP) at the four small shapes, with predictions")
    ap.add_argument("--skip-shapes", action="store_true", help="no table of the issue's shapes")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="operand and result dtype (halves: tensor cores, float32 accumulation) vs torch.matmul in it")
    ap.add_argument("--strided", action="store_true",
                    help="A declared strides='any', passed as a slice x[:, :K] of a wider tensor (module docstring)")
    ap.add_argument("--strided-only", default=None,
                    help="with --strided: plan with this strategy only (e.g. gemm_tensor_core: mma.sync on sm_90)")
    ap.add_argument("--tf32", action="store_true",
                    help="float32 with TF32 on both sides: tecc allow_tf32=True, torch.backends.cuda.matmul.allow_tf32")
    opts = ap.parse_args()
    global DTYPE, TF32
    DTYPE = opts.dtype
    TF32 = opts.tf32
    if TF32 and DTYPE != "float32":
        ap.error("--tf32 applies to float32 operands only")
    torch.backends.cuda.matmul.allow_tf32 = TF32
    torch.backends.cudnn.allow_tf32 = TF32
    shapes = SHAPES if not opts.quick else [SHAPES[2], SHAPES[4], SHAPES[6]]
    if opts.grid:
        sizes = (1024, 2048, 4096, 8192)
        shapes = [(1, m, n, k, "grid") for m in sizes for n in sizes for k in sizes] + SHAPES[4:]
    rows = []
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  TF32 {'on (both sides)' if TF32 else 'off'}  "
          f"dtype {DTYPE}", flush=True)
    print(f"{'shape':>18} {'dtype':>8} {'tecc TF/s':>10} {'cuBLAS TF/s':>12} {'ratio':>6} {'rel err':>8} "
          f"{'kernel us':>9} {'stream us':>9} {'cuBLAS us':>9} {'r.kern':>6} {'r.strm':>6}  plan", flush=True)
    for batch, m, n, k, _ in ([] if opts.skip_shapes else shapes):
        try:
            row = run_shape(batch, m, n, k, only=[opts.only] if opts.only else None)
        except Exception as exc:  # noqa: BLE001 - report and go on
            row = {"shape": f"{batch}x{m}x{n}x{k}", "error": f"{type(exc).__name__}: {exc}"[:400]}
            print(row, flush=True)
            rows.append(row)
            continue
        rows.append(row)
        print(f"{row['shape']:>18} {row['dtype']:>8} {row['tecc_tflops']:10.2f} {row['cublas_tflops']:12.2f} "
              f"{row['ratio']:6.2f} {row['rel_err']:8.1e} {row['tecc_kernel_us']:9.1f} {row['tecc_stream_us']:9.1f} "
              f"{row['cublas_stream_us']:9.1f} {row['ratio_kernel']:6.2f} {row['ratio_stream']:6.2f}  {row['plan']}",
              flush=True)
        if opts.compare and batch == 1 and not row["plan"].startswith("gemm_pipelined"):
            try:
                alt = run_shape(batch, m, n, k, only=["gemm_pipelined"])
                alt["forced"] = True
                rows.append(alt)
                print(f"{'(forced)':>18} {alt['tecc_tflops']:10.2f} {alt['cublas_tflops']:12.2f} {alt['ratio']:6.2f} "
                      f"{alt['rel_err']:8.1e}  {alt['plan']}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print("forced gemm_pipelined failed:", type(exc).__name__, str(exc)[:300], flush=True)
    for key, what in (("ratio", "per call (events around one Python call, host included)"),
                      ("ratio_kernel", "kernel time (profiling hook) vs cuBLAS back-to-back"),
                      ("ratio_stream", "back-to-back calls, both")):
        ratios = [r[key] for r in rows if key in r]
        if ratios:
            print(f"geometric mean {key}: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} over "
                  f"{len(ratios)} shapes, {what}", flush=True)
    if opts.symbolic:
        for m in (1000, 4096):
            row = run_shape(1, m, 4096, 4096, only=["gemm_pipelined"], symbolic=True)
            row["symbolic"] = True
            rows.append(row)
            print(f"symbolic M={m}: {row['tecc_tflops']:.2f} TF/s ratio {row['ratio']:.2f} err {row['rel_err']:.1e} "
                  f"{row['plan']}", flush=True)
    if opts.sweep:
        from tecc.compiler.cost.analysis import analyze_kernel
        from tecc.compiler.schedule import Schedule
        from tecc.compiler.strategies import get
        from tecc.passes.lower import lower

        strat = get(opts.sweep_strategy)
        size = opts.sweep_size
        args = matmul_tensors(1, size, size, size)
        info = analyze_kernel(lower(args).kernels[0])
        from tecc.ir.target import from_device
        device_target = from_device()
        points = []
        for point in strat.space(info, device_target):
            if opts.load is not None and point.get("load", "cp.async") != opts.load:
                continue
            if point.get("load") == "tma":
                if opts.persistent != "both" and bool(point.get("persistent")) != (opts.persistent == "on"):
                    continue
                if opts.store_epilogue is not None and point.get("epilogue", "registers") != opts.store_epilogue:
                    continue
            points.append(point)
        for point in points:
            sch = Schedule(args)
            strat.apply(sch, info, point)
            row = run_shape(1, size, size, size, plan=sch.plan, label=strat.describe(point))
            row["sweep"] = True
            rows.append(row)
            print(f"sweep {row['shape']:>12} {row['tecc_tflops']:10.2f} {row['cublas_tflops']:12.2f} "
                  f"{row['ratio']:6.2f} {row['rel_err']:8.1e}  {row['plan']}", flush=True)
    if opts.ladder:
        rows += ladder(opts.sweep_size)
    if opts.sweep_small:
        from tecc.compiler.cost.analysis import analyze_kernel
        from tecc.compiler.schedule import Schedule
        from tecc.compiler.strategies import get
        from tecc.ir.target import from_device
        from tecc.passes.lower import lower

        strat = get("gemm_pipelined")
        for m, n, k in ((1024, 1024, 1024), (1000, 1000, 1000), (127, 4096, 1023)):
            args = matmul_tensors(1, m, n, k)
            info = analyze_kernel(lower(args).kernels[0])
            for point in strat.space(info, from_device()):
                sch = Schedule(args)
                strat.apply(sch, info, point)
                row = run_shape(1, m, n, k, plan=sch.plan, label=strat.describe(point))
                row["sweep"] = True
                rows.append(row)
                print(f"sweep {row['shape']:>12} {row['tecc_tflops']:10.2f} {row['cublas_tflops']:12.2f} "
                      f"{row['ratio']:6.2f} {row['rel_err']:8.1e}  {row['plan']}", flush=True)
    if opts.epilogue:
        try:
            row = run_epilogue(4096, 4096, 4096)
            rows.append(row)
            print(f"epilogue relu(A·B + bias) 4096^3: fused {row['fused_us']:.0f} us, plain matmul {row['plain_us']:.0f} us "
                  f"(fused/plain {row['fused_over_plain']:.3f}), cuBLAS+torch relu {row['torch_unfused_us']:.0f} us, "
                  f"{row['kernels']} kernel(s), {row['temps']} temporaries, err {row['rel_err']:.1e}, {row['plan']}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001
            print("epilogue failed:", type(exc).__name__, str(exc)[:400], flush=True)
    if opts.rank_small:
        from tecc.compiler.cost.analysis import analyze_kernel
        from tecc.compiler.planner import plan_program
        from tecc.compiler.schedule import Schedule
        from tecc.passes.lower import lower as lower_

        for m, n, k in ((1024, 1024, 1024), (1000, 1000, 1000)):
            kp = plan_program(matmul_tensors(1, m, n, k), keep=max(opts.rank_small, 12)).kernels[0]
            for rank, cand in enumerate([c for c in kp.ranked if c.ok][:opts.rank_small]):
                args = matmul_tensors(1, m, n, k)
                sch = Schedule(args)
                cand.strategy.apply(sch, analyze_kernel(lower_(args).kernels[0]), cand.point)
                try:
                    row = run_shape(1, m, n, k, plan=sch.plan, label=cand.label)
                except Exception as exc:  # noqa: BLE001
                    print("rank", rank, cand.label, "failed:", type(exc).__name__, str(exc)[:200], flush=True)
                    continue
                row["rank"] = rank
                row["predicted_us"] = cand.cost.total * 1e6
                row["measured_us"] = 2.0 * m * n * k / row["tecc_tflops"] / 1e6
                rows.append(row)
                print(f"rank {rank} {row['shape']:>12} predicted {row['predicted_us']:6.1f} us measured "
                      f"{row['measured_us']:6.1f} us ratio {row['ratio']:5.2f}  {cand.label}", flush=True)
    if opts.split_sweep:
        rows += split_sweep()
    if opts.strided:
        rows += run_strided(opts.sweep_size, only=[opts.strided_only] if opts.strided_only else None)
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / "gemm.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
