"""Few-output-tile GEMMs (split-K) and the 1x1 256->64 convolution, by device time, against cuBLAS
and cuDNN in the same process.

    python benchmarks/gemm_small.py [--out DIR] [--reps 50] [--no-conv] [--shapes 0,2]

At these shapes a call is shorter than its host work (~15 µs per tecc call, ~10 µs per
torch.matmul), so CUDA events around calls measure the host. Every time here is the GPU's own:
the kernels' durations as CUPTI records them (torch.profiler, CUDA activity) over `--reps` calls,
divided by the calls -- tecc's kernels (launched through cuda.core) and cuBLAS's / cuDNN's alike,
every kernel of a call summed (cuBLAS's own split-K reduction included).

For each GEMM (fp16 unless the row says otherwise; `SHAPES`) the rows are:
- `plan`: what the planner picks for the live GPU (`plan_program`, with build's spill check);
- `best split` / `best unsplit`: gemm_wgmma's best-predicted point with split-K and without, so
  the split is measured whichever way the planner went (skipped where the pick is that point);
- `cuBLAS`: torch.matmul / torch.bmm on the same tensors;
- `EXTRA` points of a shape: at 1024 x 1024 x 8192 the 128 x 256 split 4 with the TMA-store
  epilogue (persistent, 3 stages: the former pick, 42.7 µs with its staging addresses hoisted,
  45.6 when its epilogue re-read the thread index) and with the register epilogue one block per
  part (37.1; the pick is the persistent one); at 1024 x 1024 x 4096 the 128 x 128 split 2 with
  the register epilogue beside the TMA-store pick (gemm_split.py's docstring has the timings);
- `fixed cost` (`--fixed`): the pick's point (unsplit) on the same M x N with K = 64, one k tile:
  what the kernel costs besides its k loop (launch, prologue, the ring's fill, the epilogue).
Each tecc row gives the predicted time, the device time and cuBLAS / tecc (`ratio`, > 1: tecc
faster), and is checked against torch in float64 (the relative error of the worst element).
Targets (issue 28): 1000³ and 1024 x 1024 x 8192 at ≥ 0.85, the 64-batch 512 x 512 x 64 at ≥ 0.90.

`--conv` rows (on by default; `--no-conv` drops them): ResNet-50's 1x1 256 -> 64 layer at batch 32,
56², fp16 NHWC (benchmarks/conv.py's layer 5): the planner's pick, the best mma.sync
(gemm_tensor_core) and wgmma points by prediction, and cuDNN (conv2d on channels_last,
cudnn.benchmark); the target (issue 29) ≥ 0.90 of cuDNN per layer. `python benchmarks/conv.py
--layers 5 --dtype float16 --no-depthwise` times the same layer per call and back to back.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm import kernel_durations, matmul_tensors  # noqa: E402  (benchmarks/gemm.py)

# (batch, M, N, K)
SHAPES = [(1, 1000, 1000, 1000), (1, 1024, 1024, 8192), (64, 512, 512, 64), (1, 1024, 1024, 4096),
          (1, 8192, 64, 8192), (1, 127, 4096, 1023), (1, 4096, 4096, 4096)]
CONV = (32, 56, 56, 256, 64, 1, 1)   # benchmarks/conv.py LAYERS[5]
# points timed beside the plan: shape -> [(row name, gemm_wgmma point)]
EXTRA = {(1, 1024, 1024, 8192): [("S4 TMA-store epilogue", {"bm": 128, "bn": 256, "stages": 3, "load": "tma", "split": 4,
                                                            "epilogue": "tma", "persistent": 132}),
                                  ("S4 registers, a block per part", {"bm": 128, "bn": 256, "stages": 4, "load": "tma",
                                                                      "split": 4, "epilogue": "registers",
                                                                      "persistent": 0})],
         (1, 1024, 1024, 4096): [("S2 registers epilogue", {"bm": 128, "bn": 128, "stages": 5, "load": "tma", "split": 2,
                                                            "epilogue": "registers", "persistent": 132})]}


def device_us(fn: Callable[[], Any], reps: int) -> float:
    """Mean GPU time of one call of `fn` in µs: the CUDA kernels CUPTI records over `reps` calls
    (after a warm-up), summed, over `reps`."""
    kernels = kernel_durations(fn, reps, warmup=3)
    if not kernels:
        raise RuntimeError("the profiler recorded no CUDA kernels (CUPTI unavailable?)")
    return sum(sum(d) for d in kernels.values()) / reps


def candidates(args: list[Any], target: Any) -> tuple[Any, list[Any]]:
    """The planner's result for `args` and every valid gemm_wgmma / gemm_tensor_core candidate,
    best predicted first."""
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.pipeline import refuse_spills
    from tecc.compiler.planner import candidates_for, plan_program
    from tecc.passes.lower import lower

    res = plan_program(args, target, compile_check=refuse_spills)
    info = analyze_kernel(lower(args).kernels[0])
    cands, _ = candidates_for(info, target, only=["gemm_wgmma", "gemm_tensor_core"])
    # the planner's order: predicted time, then the shorter chain (planner._rank_key)
    return res, sorted((c for c in cands if c.cost.ok), key=lambda c: (c.cost.total, c.cost.terms.get("chain", 0.0)))


def plan_of(args: list[Any], strategy: Any, point: dict[str, Any]) -> Any:
    """The plan of `strategy`'s `point` for the program `args`."""
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.schedule import Schedule
    from tecc.passes.lower import lower

    sch = Schedule(args)
    strategy.apply(sch, analyze_kernel(lower(args).kernels[0]), point)
    return sch.plan


def best_per_strategy(pick: Any, ranked: list[Any], names: Sequence[str]) -> list[tuple[str, Any, Any]]:
    """("best NAME", None, candidate) for each strategy in `names` whose best-predicted point in
    `ranked` is not the planner's `pick`: the runs timed beside the plan."""
    runs = []
    for strategy in names:
        best = next((x for x in ranked if x.strategy.name == strategy), None)
        if best is not None and (best.strategy is not pick.strategy or best.point != pick.point):
            runs.append((f"best {strategy}", None, best))
    return runs


def timed_rows(shape: str, runs: list[tuple[str, Any, Any]], args: list[Any], inputs: Sequence[Any], out: Any,
               ref: Any, t_ref: float, reps: int) -> list[dict[str, Any]]:
    """A row per run (what, plan or None, candidate): built (the plan, else the candidate's
    point), run on `inputs` into NaN-poisoned `out`, checked against the float64 `ref` (the
    worst element's error relative to the largest) and timed by device time, with t_ref / t as
    its ratio; a run that fails is a row with its error."""
    import torch

    import tecc as tc

    rows: list[dict[str, Any]] = []
    for what, plan, cand in runs:
        try:
            kern = tc.build(args, plan=plan if plan is not None else plan_of(args, cand.strategy, cand.point))
            out.fill_(float("nan"))
            kern(*inputs, out)
            torch.cuda.synchronize()
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            t = device_us(lambda: kern(*inputs, out), reps)
        except Exception as exc:  # noqa: BLE001 - report and go on
            rows.append({"shape": shape, "what": what, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        rows.append({"shape": shape, "what": what, "plan": cand.label, "point": dict(cand.point),
                     "predicted_us": cand.cost.total * 1e6, "device_us": t, "ratio": t_ref / t, "rel_err": err,
                     "resources": str(getattr(kern, "resources", ""))})
    return rows


def fixed_cost_row(batch: int, m: int, n: int, cand: Any, reps: int, shape: str) -> dict[str, Any]:
    """The device time of `cand`'s point (split dropped) on M x N x 64: one k tile."""
    import torch

    import tecc as tc

    args = matmul_tensors(batch, m, n, 64, "float16")
    point = {x: v for x, v in cand.point.items() if x != "split"}
    lead = (batch,) if batch > 1 else ()
    a = torch.randn(lead + (m, 64), device="cuda").half()
    b = torch.randn(lead + (64, n), device="cuda").half()
    c = torch.empty(lead + (m, n), device="cuda", dtype=torch.float16)
    kern = tc.build(args, plan=plan_of(args, cand.strategy, point))
    return {"shape": shape, "what": "fixed cost (K = 64)", "plan": cand.strategy.describe(point), "point": point,
            "device_us": device_us(lambda: kern(a, b, c), reps)}


def gemm_rows(batch: int, m: int, n: int, k: int, reps: int, target: Any, fixed: bool = False) -> list[dict[str, Any]]:
    import torch

    shape = f"{batch}x{m}x{n}x{k}" if batch > 1 else f"{m}x{n}x{k}"
    args = matmul_tensors(batch, m, n, k, "float16")
    res, ranked = candidates(args, target)
    lead = (batch,) if batch > 1 else ()
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(lead + (m, k), device="cuda", generator=g).half()
    b = torch.randn(lead + (k, n), device="cuda", generator=g).half()
    c = torch.empty(lead + (m, n), device="cuda", dtype=torch.float16)
    ref = torch.matmul(a.double(), b.double())
    t_cublas = device_us(lambda: torch.matmul(a, b), reps)
    pick = res.kernels[0].chosen
    wgmma = [x for x in ranked if x.strategy.name == "gemm_wgmma"]
    runs: list[tuple[str, Any, Any]] = [("plan", res.plan, pick)]
    for what, want in (("best split", True), ("best unsplit", False)):
        best = next((x for x in wgmma if ("split" in x.point) == want), None)
        if best is not None and (best.strategy is not pick.strategy or best.point != pick.point):
            runs.append((what, None, best))
    for what, point in EXTRA.get((batch, m, n, k), []):
        extra = next((x for x in wgmma if dict(x.point) == point), None)
        if extra is not None and extra.point != pick.point:
            runs.append((what, None, extra))
    rows = [{"shape": shape, "what": "cuBLAS", "device_us": t_cublas}]
    rows += timed_rows(shape, runs, args, (a, b), c, ref, t_cublas, reps)
    if fixed and pick.strategy.name.startswith("gemm_wgmma"):
        rows.append(fixed_cost_row(batch, m, n, pick, reps, shape))
    return rows


# GPT-2 small's weight gradients at 8 x 1024 tokens: dW[m, n] = sum_t X[t, m] dY[t, n], both operands
# stored with the reduction outermost (a Linear's input and output gradient), bf16 in, float32 out
# (autocast's bf16 product cast to the float32 parameter's gradient): c_attn, attn.c_proj, c_fc,
# mlp.c_proj.
WEIGHT_GRADS = [(768, 2304, 8192), (768, 768, 8192), (768, 3072, 8192), (3072, 768, 8192)]


def weight_grad_tensors(m: int, n: int, k: int) -> list[Any]:
    """dW = float32(bfloat16(X^T dY)) with X [k, m] and dY [k, n] (the weight-gradient layout)."""
    import tecc as tc

    r = tc.reduce_axis(k, name="t")
    X = tc.placeholder((k, m), "bfloat16", name="X")
    dY = tc.placeholder((k, n), "bfloat16", name="dY")
    prod = tc.compute((m, n), lambda i, j: tc.cast(tc.sum(tc.cast(X[r, i], "float32") * tc.cast(dY[r, j], "float32"),
                                                          axis=r), "bfloat16"), name="P")
    dW = tc.compute((m, n), lambda i, j: tc.cast(prod[i, j], "float32"), name="dW")
    return [X, dY, dW]


def weight_grad_rows(m: int, n: int, k: int, reps: int, target: Any, points: int) -> list[dict[str, Any]]:
    """The plan and the `points` best-predicted wgmma points of a weight gradient, each by device
    time against cuBLAS (torch.mm(X.t(), dY).float(), its cast included)."""
    import torch

    shape = f"dW {m}x{n}x{k}"
    args = weight_grad_tensors(m, n, k)
    res, ranked = candidates(args, target)
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(k, m, device="cuda", generator=g).bfloat16()
    dy = torch.randn(k, n, device="cuda", generator=g).bfloat16()
    out = torch.empty(m, n, device="cuda", dtype=torch.float32)
    ref = torch.mm(x.double().t(), dy.double())
    t_cublas = device_us(lambda: torch.mm(x.t(), dy).float(), reps)
    pick = res.kernels[0].chosen
    runs: list[tuple[str, Any, Any]] = [("plan", res.plan, pick)]
    wgmma = [c for c in ranked if c.strategy.name == "gemm_wgmma" and c.point != pick.point]
    runs += [(f"rank {i + 1}", None, c) for i, c in enumerate(wgmma[:points])]
    rows = [{"shape": shape, "what": "cuBLAS", "device_us": t_cublas}]
    return rows + timed_rows(shape, runs, args, (x, dy), out, ref, t_cublas, reps)


def conv_rows(reps: int, target: Any) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from conv import conv_tensors

    n, h, w, c, f, r, stride = CONV
    args = conv_tensors(n, h, w, c, f, r, stride, "float16")
    res, ranked = candidates(args, target)
    x = torch.randn(n, h, w, c, device="cuda").half()
    w_t = torch.randn(f, c, r, r, device="cuda").half()
    w_tecc = w_t.permute(2, 3, 1, 0).contiguous()
    x_cl, w_cl = x.permute(0, 3, 1, 2), w_t.contiguous(memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = True
    y = torch.empty(n, h, w, f, device="cuda", dtype=torch.float16)
    ref = F.conv2d(x_cl.double(), w_t.double()).permute(0, 2, 3, 1)
    t_cudnn = device_us(lambda: F.conv2d(x_cl, w_cl), reps)
    layer = f"{n}x{h}x{w}x{c}->{f} 1x1"
    pick = res.kernels[0].chosen
    runs = [("plan", res.plan, pick)] + best_per_strategy(pick, ranked, ("gemm_tensor_core", "gemm_wgmma"))
    return [{"shape": layer, "what": "cuDNN", "device_us": t_cudnn}] + timed_rows(layer, runs, args, (x, w_tecc), y,
                                                                                 ref, t_cudnn, reps)


def main() -> None:
    import torch

    from tecc.ir.target import from_device

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write DIR/gemm_small.json")
    ap.add_argument("--reps", type=int, default=50, help="calls per timed row (CUPTI device time)")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES")
    ap.add_argument("--no-conv", action="store_true", help="no rows of the 1x1 256->64 convolution")
    ap.add_argument("--weight-grads", type=int, default=0, metavar="N",
                    help="only GPT-2's weight gradients (WEIGHT_GRADS): the plan and the N best-predicted points")
    ap.add_argument("--fixed", action="store_true", help="also time each pick's point with K = 64 (one k tile)")
    opts = ap.parse_args()
    target = from_device()
    shapes = SHAPES if opts.shapes is None else [SHAPES[int(i)] for i in opts.shapes.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}; device time per call (CUPTI), "
          f"{opts.reps} calls per row", flush=True)
    print(f"{'shape':>22} {'row':>22} {'pred us':>8} {'device us':>10} {'ratio':>6} {'rel err':>8}  plan", flush=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    groups = [lambda s=s: gemm_rows(*s, opts.reps, target, opts.fixed) for s in shapes]
    if opts.weight_grads:
        groups = [lambda s=s: weight_grad_rows(*s, opts.reps, target, opts.weight_grads) for s in WEIGHT_GRADS]
    elif not opts.no_conv:
        groups.append(lambda: conv_rows(opts.reps, target))
    for group in groups:
        for row in group():
            rows.append(row)
            if "error" in row:
                print(f"{row['shape']:>22} {row['what']:>22} {row['error']}", flush=True)
                continue
            pred = f"{row['predicted_us']:8.1f}" if "predicted_us" in row else " " * 8
            ratio = f"{row['ratio']:6.2f}" if "ratio" in row else " " * 6
            err = f"{row['rel_err']:8.1e}" if "rel_err" in row else " " * 8
            point = json.dumps(row["point"], separators=(",", ":")) if "point" in row else ""
            print(f"{row['shape']:>22} {row['what']:>22} {pred} {row['device_us']:10.2f} {ratio} {err}  "
                  f"{point or row.get('plan', '')[:110]}", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / "gemm_small.json").write_text(
            json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
