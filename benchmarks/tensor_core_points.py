"""Time every point of the gemm_tensor_core strategy at one shape, with the cost model's prediction.

    python benchmarks/tensor_core_points.py [--shape 4096 4096 4096] [--dtype float16] [--max 32]

For the contraction C = A·B (fp32 accumulate, rounded to the operands' dtype, as benchmarks/gemm.py) the planner's candidates of `gemm_tensor_core` are
each realized as a plan (`Strategy.apply` on a Schedule, as the planner does), built with NVRTC,
checked once against torch in float64 and timed with CUDA events (10 back-to-back calls between
two events, median of 5 rounds) in the same process as torch.matmul (cuBLAS). Prints one row per
point, fastest first: measured time, TFLOP/s, ratio to cuBLAS, predicted time and its bound, so
that the cost model's ranking can be compared with the measured one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import torch

    import tecc as tc
    from gemm import matmul_tensors
    from tecc.compiler.planner import plan_program
    from tecc.compiler.schedule import Schedule

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=[4096, 4096, 4096])
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--max", type=int, default=96, help="at most this many points (least predicted first)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON to this file")
    a = ap.parse_args()
    m, n, k = a.shape
    args = matmul_tensors(1, m, n, k, a.dtype)  # C = cast(Σ_k f32(A)·f32(B), dtype), as benchmarks/gemm.py
    result = plan_program(args, "sm_90", keep=1000)
    (kp,) = result.kernels
    points = [c for c in kp.ranked if c.strategy.name == "gemm_tensor_core" and c.failed is None][:a.max]

    tdt = getattr(torch, a.dtype)
    x = torch.randn(m, k, device="cuda", dtype=tdt)
    y = torch.randn(k, n, device="cuda", dtype=tdt)
    out = torch.empty(m, n, device="cuda", dtype=tdt)
    ref = x.double() @ y.double()
    flops = 2.0 * m * n * k

    def timed(fn: object) -> float:
        for _ in range(3):
            fn()  # type: ignore[operator]
        rounds = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                fn()  # type: ignore[operator]
            e1.record()
            torch.cuda.synchronize()
            rounds.append(e0.elapsed_time(e1) * 1e3 / 10)
        return statistics.median(rounds)

    cublas = timed(lambda: torch.matmul(x, y))
    print(f"GPU {torch.cuda.get_device_name()}  {a.dtype} {m}x{n}x{k}  cuBLAS {cublas:.1f} us "
          f"({flops / cublas / 1e6:.1f} TF/s)  {len(points)} points", flush=True)
    rows = []
    for c in points:
        sch = Schedule(args)
        c.strategy.apply(sch, kp.info, c.point)
        start = time.perf_counter()
        try:
            f = tc.build(args, plan=sch.plan)
        except Exception as exc:  # noqa: BLE001 - a point that does not compile is reported, not fatal
            print(f"  build failed: {c.label}: {str(exc).splitlines()[0]}")
            continue
        built = time.perf_counter() - start
        out.fill_(float("nan"))
        f(x, y, out)
        err = float((out.double() - ref).norm() / ref.norm())
        us = timed(lambda: f(x, y, out))
        res = f.resources.get(f.module.kernels[0].name) if hasattr(f, "resources") else None
        regs = getattr(res, "registers", "?")
        spills = getattr(res, "spill_stores", "?")
        rows.append((us, c, err, built, regs, spills))
    rows.sort(key=lambda t: t[0])
    print(f"{'us':>9} {'TF/s':>7} {'ratio':>6} {'pred us':>8} {'bound':>8} {'regs':>5} {'spill':>5} {'relerr':>8}  point")
    for us, c, err, built, regs, spills in rows:
        print(f"{us:9.1f} {flops / us / 1e6:7.1f} {cublas / us:6.2f} {c.cost.total * 1e6:8.1f} {c.cost.bound:>8} "
              f"{regs!s:>5} {spills!s:>5} {err:8.1e}  {c.label}", flush=True)
    if a.out:
        import json

        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "shape": [m, n, k], "dtype": a.dtype,
                                           "cublas_us": cublas, "rows": [
            {"us": us, "point": dict(c.point), "predicted_us": c.cost.total * 1e6, "bound": c.cost.bound,
             "registers": regs, "spills": spills, "rel_err": err, "label": c.label}
            for us, c, err, built, regs, spills in rows]}, indent=1))


if __name__ == "__main__":
    main()
