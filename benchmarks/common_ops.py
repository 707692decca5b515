"""Common ops that were planned slowly: transposes / permutes, and the bias-batched GEMM.

    python benchmarks/common_ops.py [--reps 20] [--json benchmarks/results/common_ops_h200.json]
                                    [--only transpose|baddbmm|small_gemm] [--quick] [--shapes 8x64x56x56 ..]

Transposes and permutes (`Y = X.permute(perm)` written as a tensor expression): tecc as
`tc.build(args)` plans it (plan="auto": transpose_tile), the same op under the elementwise
strategy's best point (the plan before transpose_tile), a few other tilings of transpose_tile
(the model's next picks and the classic 32x32 tile of 32x8 threads: which tiling the GPU
prefers; also the best point with padded rows and scalar copies, and the best swizzled one of
256 threads), torch's `x.t().contiguous()` / `x.permute(...).contiguous()`, and a device-to-device
copy of the same bytes (`dst.copy_(x)`). GB/s = 2 x tensor bytes / time (every byte read once
and written once); "% copy" = GB/s / the copy's GB/s (the target: >= 85% for tecc). Every tecc
output is compared with torch's bit for bit.

Bias-batched GEMM: C[b] = A[b] @ W[b] + bias (bias[j], one row for every batch and row), fp32,
fp16 and bf16 (16-bit outputs, float32 accumulation), tecc plan="auto" against
`torch.baddbmm(bias, A, W)`, and tecc's plain batched GEMM against `torch.bmm`, so the table shows
what the bias costs each. TFLOP/s = 2·B·M·N·K / time; "tecc / torch" = torch time / tecc time
(above 1: tecc faster). fp32 runs without TF32 on both sides (torch's default). Checked against
float64 torch (max error relative to the row's magnitude). Then the small batch 3x1000x130x257
(fp32, bias[j]): the planner's pick on the live device beside gemm_pipelined's and the generic
reduction's best points (the model prices them within a few percent of each other there).

All in this process on one stream, timed with CUDA events (median of --reps rounds of 10
launches after warm-up; tecc's launches replayed through cuda.core without its per-call argument
checks, as benchmarks/memory_bound.py does). The transposes' inputs rotate over sets covering
3 x L2, so no launch reads its input out of L2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from memory_bound import Rotation, direct_launcher, time_it  # noqa: E402

import tecc as tc  # noqa: E402
from tecc.compiler.cost.analysis import analyze_kernel  # noqa: E402
from tecc.compiler.cost.model import predict  # noqa: E402
from tecc.compiler.schedule import Schedule  # noqa: E402
from tecc.compiler.strategies import get  # noqa: E402
from tecc.ir.target import from_device  # noqa: E402
from tecc.passes.lower import lower  # noqa: E402
from tecc.runtime.cuda import CudaExecutor  # noqa: E402

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
         "float8_e4m3": torch.float8_e4m3fn}
# (shape, perm, dtype): 2-D transposes, batched transposes, 3-D and 4-D permutes (NCHW <-> NHWC)
TRANSPOSES = [
    ((4096, 4096), (1, 0), "float32"), ((4096, 4096), (1, 0), "float16"), ((4096, 4096), (1, 0), "bfloat16"),
    ((8192, 8192), (1, 0), "float32"), ((8192, 8192), (1, 0), "float16"), ((4099, 1023), (1, 0), "float32"),
    ((8192, 8192), (1, 0), "float8_e4m3"),
    ((32, 1024, 1024), (0, 2, 1), "float32"), ((32, 1024, 1024), (0, 2, 1), "float16"),
    ((256, 128, 512), (2, 0, 1), "float32"), ((256, 128, 512), (1, 2, 0), "float16"),
    ((32, 64, 112, 112), (0, 2, 3, 1), "float16"), ((32, 112, 112, 64), (0, 3, 1, 2), "float16"),
    ((32, 64, 112, 112), (0, 2, 3, 1), "float32"),
    # small NCHW -> NHWC permutes (6.4 / 12.8 MB, L2 holds them): transpose_tile measured 1.2-1.4x
    # faster than elementwise at the first two (transposes_near_h200_s25.json); the bf16 one takes
    # the padded tile, unmeasured (tests/test_transpose_tile.py, SMALL_PERMUTES)
    ((8, 64, 56, 56), (0, 2, 3, 1), "float32"), ((8, 64, 112, 112), (0, 2, 3, 1), "float16"),
    ((8, 64, 56, 56), (0, 2, 3, 1), "bfloat16"),
]
QUICK_TRANSPOSES = [TRANSPOSES[0], TRANSPOSES[1], TRANSPOSES[7], TRANSPOSES[11]]
# (batch, M, N, K)
GEMMS = [(8, 1024, 1024, 1024), (32, 512, 512, 512), (64, 256, 256, 256), (16, 1024, 4096, 1024)]
QUICK_GEMMS = GEMMS[:2]
# a batch of small GEMMs with few 8x8-thread tiles per SM: the planner's pick on the live device
# is timed beside the best point of each strategy that can take it (fp32 only)
SMALL_GEMM = (3, 1000, 130, 257)
SMALL_GEMM_STRATEGIES = ("gemm_pipelined", "reduction")
CLASSIC = {"tu": 32, "tv": 32, "ty": 8}


def permute(shape: tuple[int, ...], perm: tuple[int, ...], dtype: str) -> list[tc.Tensor]:
    X = tc.placeholder(shape, dtype, name="X")

    def body(*ix: Any) -> Any:
        idx: list[Any] = [None] * len(shape)
        for out_axis, in_axis in enumerate(perm):
            idx[in_axis] = ix[out_axis]
        return X[tuple(idx)]

    return [X, tc.compute(tuple(shape[p] for p in perm), body, name="Y")]


def bias_bmm(batch: int, m: int, n: int, k: int, dtype: str, bias: bool = True) -> list[tc.Tensor]:
    A = tc.placeholder((batch, m, k), dtype, name="A")
    W = tc.placeholder((batch, k, n), dtype, name="W")
    b = tc.placeholder((n,), dtype, name="bias")
    r = tc.reduce_axis(k, name="k")

    def body(bi: Any, i: Any, j: Any) -> Any:
        acc = tc.sum(tc.cast(A[bi, i, r], "float32") * tc.cast(W[bi, r, j], "float32"), axis=r)
        return tc.cast(acc + tc.cast(b[j], "float32"), dtype) if bias else tc.cast(acc, dtype)

    C = tc.compute((batch, m, n), body, name="C")
    return [A, W, b, C] if bias else [A, W, C]


def strategy_points(args: list[tc.Tensor], name: str, target: Any, count: int,
                    extra: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The `count` best points of strategy `name` by the cost model, plus for each of `extra`
    the best point of its space that has those values (a callable value: a test of the value)."""
    info = analyze_kernel(lower(args).kernels[0])
    strategy = get(name)
    if strategy.guard(info, target) is not None:
        return []
    def predicted(point: dict[str, Any]) -> float:
        return predict(strategy.workload(info, point, target), target).total

    def has(point: dict[str, Any], want: dict[str, Any]) -> bool:
        return all(v(point.get(k)) if callable(v) else point.get(k) == v for k, v in want.items())

    points = sorted(strategy.space(info, target), key=predicted)
    out = points[:count]
    for want in extra:
        out += [p for p in points if has(p, want) and p not in out][:1]
    return out


# beside the model's picks: the best point with padded rows and scalar copies (the plan before
# 16-byte copies), the best swizzled one of 256 threads, and the classic 32x32 tile of 32x8 threads
TILE_EXTRAS = [{"copy": lambda c: c in (None, 1)}, {"copy": lambda c: c is not None and c > 1,
                                                    "ty": lambda ty: ty is not None and ty >= 32}, CLASSIC]


def with_point(args: list[tc.Tensor], name: str, point: dict[str, Any]) -> Any:
    info = analyze_kernel(lower(args).kernels[0])
    sch = Schedule(args)
    get(name).apply(sch, info, point)
    return tc.build(sch, target="cuda")


def launcher(kern: Any, arrays: list[torch.Tensor], stream: Any) -> Any:
    """The kernel's launches replayed without the per-call checks (or, where that recording fails,
    the checked call itself, said on stdout); either way the call has run once on `arrays`."""
    kern._executor = CudaExecutor(kern.host, kern.cubin, stream=stream)  # no launch-cache hit
    try:
        return direct_launcher(kern, arrays)
    except RuntimeError as exc:
        print(f"# {exc}: timing the checked call (adds its host time)")
        kern(*arrays)
        return lambda: kern(*arrays)


def plan_label(kern: Any) -> str:
    if kern.planning is not None:
        return "; ".join(kp.chosen.label for kp in kern.planning.kernels)
    return kern.plan.reason.split(", predicted")[0].split(": ", 1)[-1] if kern.plan.reason else kern.plan.strategy


def transposes(cases: list[tuple[Any, ...]], reps: int, stream: Any, target: Any, rotate: int) -> list[dict[str, Any]]:
    rows = []
    print("| permute | shape | dtype | plan | GB/s | % copy | torch GB/s | torch % copy | copy GB/s | tecc / torch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape, perm, dtype in cases:
        tdt = TORCH[dtype]
        nbytes = torch.tensor([], dtype=tdt).element_size()
        for s in shape:
            nbytes *= s
        sets = max(1, -(-rotate // nbytes))
        xs = [torch.randn(shape, device="cuda").to(tdt) for _ in range(sets)]
        outs = [torch.empty(tuple(shape[p] for p in perm), device="cuda", dtype=tdt) for _ in range(sets)]
        raw = (lambda x: x.view(torch.uint8)) if dtype.startswith("float8") else (lambda x: x)
        t_copy = time_it(Rotation([lambda x=x, o=o: raw(o).view(-1).copy_(raw(x).view(-1)) for x, o in zip(xs, outs)]),
                         stream, reps)
        t_torch = time_it(Rotation([lambda x=x: raw(x).permute(*perm).contiguous() for x in xs]), stream, reps)
        want = raw(xs[0]).permute(*perm).contiguous()
        args = permute(shape, perm, dtype)
        kernels = [("auto", tc.build(args, target="cuda"))]
        for point in strategy_points(args, "transpose_tile", target, 3, TILE_EXTRAS):
            kernels.append((get("transpose_tile").describe(point), with_point(args, "transpose_tile", point)))
        for point in strategy_points(args, "elementwise", target, 1):
            kernels.append((get("elementwise").describe(point) + " (before)", with_point(args, "elementwise", point)))
        copy_gbps = 2 * nbytes / t_copy / 1e9
        torch_gbps = 2 * nbytes / t_torch / 1e9
        for label, kern in kernels:
            fns = [launcher(kern, [x, o], stream) for x, o in zip(xs, outs)]
            torch.cuda.synchronize()
            same = torch.equal(raw(outs[0]), want)
            t = time_it(Rotation(fns), stream, reps)
            gbps = 2 * nbytes / t / 1e9
            plan = plan_label(kern) if label == "auto" else label
            regs = "/".join(str(getattr(kern.resources.get(k.name), "registers", "?")) for k in kern.module.kernels)
            row = {"op": "permute", "shape": list(shape), "perm": list(perm), "dtype": dtype, "variant": label,
                   "plan": plan, "registers": regs, "tecc_s": t, "torch_s": t_torch, "copy_s": t_copy,
                   "tecc_gbps": gbps, "torch_gbps": torch_gbps, "copy_gbps": copy_gbps,
                   "fraction_of_copy": gbps / copy_gbps, "torch_fraction_of_copy": torch_gbps / copy_gbps,
                   "torch_over_tecc": t_torch / t, "matches_torch": same}
            rows.append(row)
            print(f"| {perm} | {'x'.join(map(str, shape))} | {dtype} | {plan}{'' if same else ' MISMATCH'} | "
                  f"{gbps:.0f} | {100 * gbps / copy_gbps:.0f}% | {torch_gbps:.0f} | "
                  f"{100 * torch_gbps / copy_gbps:.0f}% | "
                  f"{copy_gbps:.0f} | {t_torch / t:.2f}x |", flush=True)
        del xs, outs, want, kernels
        torch.cuda.empty_cache()
    return rows


def gemms(cases: list[tuple[int, int, int, int]], reps: int, stream: Any) -> list[dict[str, Any]]:
    rows = []
    print("| op | B x M x N x K | dtype | plan | TFLOP/s | torch TFLOP/s | tecc / torch | max rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch, m, n, k in cases:
        for dtype in ("float32", "float16", "bfloat16"):
            tdt = TORCH[dtype]
            g = torch.Generator(device="cuda").manual_seed(batch + m + n + k)
            a = torch.randn(batch, m, k, device="cuda", generator=g).to(tdt)
            w = torch.randn(batch, k, n, device="cuda", generator=g).to(tdt)
            bias = torch.randn(n, device="cuda", generator=g).to(tdt)
            c = torch.empty(batch, m, n, device="cuda", dtype=tdt)
            flops = 2.0 * batch * m * n * k
            for with_bias in (True, False):
                kern = tc.build(bias_bmm(batch, m, n, k, dtype, with_bias), target="cuda")
                arrays = [a, w, bias, c] if with_bias else [a, w, c]
                run = launcher(kern, arrays, stream)
                torch.cuda.synchronize()
                ref = a.double() @ w.double() + (bias.double() if with_bias else 0.0)
                err = ((c.double() - ref).abs().max() / ref.abs().max()).item()
                t = time_it(run, stream, reps)
                if with_bias:
                    t_torch = time_it(lambda: torch.baddbmm(bias, a, w), stream, reps)
                else:
                    t_torch = time_it(lambda: torch.bmm(a, w), stream, reps)
                op = "baddbmm" if with_bias else "bmm"
                plan = plan_label(kern)
                rows.append({"op": op, "shape": [batch, m, n, k], "dtype": dtype, "plan": plan, "tecc_s": t,
                             "torch_s": t_torch, "tecc_tflops": flops / t / 1e12,
                             "torch_tflops": flops / t_torch / 1e12, "torch_over_tecc": t_torch / t,
                             "max_rel_err": err})
                print(f"| {op} | {batch}x{m}x{n}x{k} | {dtype} | {plan} | {flops / t / 1e12:.1f} | "
                      f"{flops / t_torch / 1e12:.1f} | {t_torch / t:.2f}x | {err:.1e} |", flush=True)
            del a, w, bias, c
            torch.cuda.empty_cache()
    return rows


def small_gemm(reps: int, stream: Any, target: Any) -> list[dict[str, Any]]:
    """SMALL_GEMM in fp32 with bias[j]: the planner's pick and the best point of each strategy
    in SMALL_GEMM_STRATEGIES, timed alike (which one the GPU prefers for a batch of small GEMMs)."""
    batch, m, n, k = SMALL_GEMM
    args = bias_bmm(batch, m, n, k, "float32")
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(batch, m, k, device="cuda", generator=g)
    w = torch.randn(batch, k, n, device="cuda", generator=g)
    bias = torch.randn(n, device="cuda", generator=g)
    c = torch.empty(batch, m, n, device="cuda")
    ref = a.double() @ w.double() + bias.double()
    flops = 2.0 * batch * m * n * k
    t_torch = time_it(lambda: torch.baddbmm(bias, a, w), stream, reps)
    kernels = [("auto", tc.build(args, target="cuda"))]
    for name in SMALL_GEMM_STRATEGIES:
        for point in strategy_points(args, name, target, 1):
            kernels.append((get(name).describe(point), with_point(args, name, point)))
    rows = []
    print("| op | B x M x N x K | dtype | plan | TFLOP/s | torch TFLOP/s | tecc / torch | max rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, kern in kernels:
        run = launcher(kern, [a, w, bias, c], stream)
        torch.cuda.synchronize()
        err = ((c.double() - ref).abs().max() / ref.abs().max()).item()
        t = time_it(run, stream, reps)
        plan = plan_label(kern) if label == "auto" else label
        predicted = kern.planning.kernels[0].chosen.cost.total if kern.planning is not None else None
        rows.append({"op": "baddbmm", "shape": list(SMALL_GEMM), "dtype": "float32", "variant": label, "plan": plan,
                     "tecc_s": t, "torch_s": t_torch, "predicted_s": predicted, "tecc_tflops": flops / t / 1e12,
                     "torch_over_tecc": t_torch / t, "max_rel_err": err})
        print(f"| baddbmm | {'x'.join(map(str, SMALL_GEMM))} | float32 | {plan} | {flops / t / 1e12:.2f} | "
              f"{flops / t_torch / 1e12:.2f} | {t_torch / t:.2f}x | {err:.1e} |  ({t * 1e6:.1f} us)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", choices=["transpose", "baddbmm", "small_gemm"], default=None)
    ap.add_argument("--quick", action="store_true", help="four transposes and two GEMM shapes")
    ap.add_argument("--json", default=str(HERE / "results" / "common_ops.json"))
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="only the transposes of these shapes, written BxCxHxW (e.g. 8x64x56x56)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs in fp32 on both sides
    stream = torch.cuda.current_stream()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    target = from_device()
    print(f"device: {torch.cuda.get_device_name()}; tecc target {target.arch}; transposes rotate over >= "
          f"{3 * l2 >> 20} MiB of inputs; CUDA-event medians of {a.reps} x 10 launches")
    start = time.time()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": a.reps}
    if a.only in (None, "transpose"):
        cases = QUICK_TRANSPOSES if a.quick else TRANSPOSES
        if a.shapes:
            cases = [c for c in TRANSPOSES if "x".join(map(str, c[0])) in a.shapes]
        result["transposes"] = transposes(cases, a.reps, stream, target, 3 * l2)
    if a.only in (None, "baddbmm"):
        result["gemms"] = gemms(QUICK_GEMMS if a.quick else GEMMS, a.reps, stream)
    if a.only in (None, "baddbmm", "small_gemm"):
        result["small_gemm"] = small_gemm(a.reps, stream, target)
    result["seconds"] = time.time() - start
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.json} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
