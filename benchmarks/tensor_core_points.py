"""Time every point of the gemm_tensor_core strategy at one shape, with the cost model's prediction.

    python benchmarks/tensor_core_points.py [--shape 4096 4096 4096] [--dtype float16] [--max 32]
    python benchmarks/tensor_core_points.py --pipeline [--shapes 4096 8192] [--dtype float16]

For the contraction C = A·B (fp32 accumulate, rounded to the operands' dtype, as benchmarks/gemm.py) the planner's candidates of `gemm_tensor_core` are
each realized as a plan (`Strategy.apply` on a Schedule, as the planner does), built with NVRTC,
checked once against torch in float64 and timed with CUDA events (10 back-to-back calls between
two events, median of 5 rounds) in the same process as torch.matmul (cuBLAS). Prints one row per
point, fastest first: measured time, TFLOP/s, ratio to cuBLAS, predicted time and its bound, so
that the cost model's ranking can be compared with the measured one.

With --pipeline it times instead the best points of the plain mainloop (PIPELINE_POINTS) in both
forms, fragment_pipeline off and on (tensorize.py, "the pipelined mainloop"), the first point also
in the grouped block order (`group_m`, --group rows per group), at the cube of each of --shapes,
in one process: a row per point and form with its time, TFLOP/s, ratio to cuBLAS,
the cost model's prediction, ptxas's registers and spills and the relative error vs float64.
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


# (block, warps, k_tile, stages): the fastest plain points at 4096^3 on the H200 (RESULTS.md), a
# 64x128 block of 32x64 warp tiles (3 blocks/SM fit by registers in either form), and the k-64
# point whose pipelined form ptxas spills on (reported, as a check of the register estimate).
# Each is timed plain and pipelined; the first also in the grouped block order (--group).
PIPELINE_POINTS = [((128, 128), (2, 2), 32, 4), ((128, 128), (2, 2), 32, 3), ((128, 256), (2, 4), 32, 4),
                   ((64, 128), (2, 2), 32, 4), ((128, 128), (4, 2), 32, 4), ((128, 128), (2, 2), 64, 3)]


def timed(fn: object) -> float:
    """Median of 5 rounds of 10 back-to-back calls between two CUDA events, in microseconds."""
    import torch

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


def pipeline_forms(shapes: list[int], dtype: str, group_m: int) -> None:
    """--pipeline: PIPELINE_POINTS with the plain and the pipelined mainloop at each size^3."""
    import torch

    import tecc as tc
    from gemm import matmul_tensors
    from tecc.compiler.planner import plan_program
    from tecc.compiler.schedule import Schedule

    tdt = getattr(torch, dtype)
    print(f"GPU {torch.cuda.get_device_name()}  {dtype}", flush=True)
    for size in shapes:
        m = n = k = size
        args = matmul_tensors(1, m, n, k, dtype)
        (kp,) = plan_program(args, "sm_90", keep=10_000).kernels
        predicted = {tuple(sorted(c.point.items())): c for c in kp.ranked + kp.rejected
                     if c.strategy.name == "gemm_tensor_core"}
        x = torch.randn(m, k, device="cuda", dtype=tdt)
        y = torch.randn(k, n, device="cuda", dtype=tdt)
        out = torch.empty(m, n, device="cuda", dtype=tdt)
        ref = x.double() @ y.double()
        flops = 2.0 * m * n * k
        cublas = timed(lambda: torch.matmul(x, y))
        print(f"{m}x{n}x{k}  cuBLAS {cublas:.1f} us ({flops / cublas / 1e6:.1f} TF/s)", flush=True)
        print(f"{'us':>9} {'TF/s':>7} {'ratio':>6} {'pred us':>8} {'regs':>5} {'spill':>5} {'relerr':>8}  point")
        for number, ((bm, bn), (wm, wn), bk, stages) in enumerate(PIPELINE_POINTS):
            forms = [(False, 0), (True, 0)] + ([(False, group_m), (True, group_m)] if number == 0 and group_m else [])
            for pipelined, group in forms:
                point = {"bm": bm, "bn": bn, "warps_m": wm, "warps_n": wn, "bk": bk, "stages": stages}
                if pipelined:
                    point["fragment_pipeline"] = True
                label = (f"block {bm}x{bn} warps {wm}x{wn} k-tile {bk} stages {stages} "
                         f"{'pipelined' if pipelined else 'plain'}{f', grouped order {group}' if group else ''}")
                cand = None if group else predicted.get(tuple(sorted(point.items())))
                pred = (f"{cand.cost.total * 1e6:8.1f}" if cand is not None and cand.cost.ok
                        else f"{'rejected' if cand is not None else '-':>8}")
                sch = Schedule(args)
                k_tiles = sch.tensorize("C", block=(bm, bn), warps=(wm, wn), k_tile=bk)
                for operand in sch.gemm_operands("C"):
                    sch.stage_operand("C", operand)
                sch.pipeline(k_tiles, stages=stages)
                if pipelined:
                    sch.pipeline_fragments(k_tiles)
                if group:
                    sch.tile_order("C", group)
                try:
                    f = tc.build(args, plan=sch.plan)
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    print(f"  build failed: {label}: {str(exc).splitlines()[0]}", flush=True)
                    continue
                out.fill_(float("nan"))
                f(x, y, out)
                err = float((out.double() - ref).norm() / ref.norm())
                us = timed(lambda: f(x, y, out))
                res = f.resources.get(f.module.kernels[0].name) if hasattr(f, "resources") else None
                regs, spills = getattr(res, "registers", "?"), getattr(res, "spill_stores", "?")
                print(f"{us:9.1f} {flops / us / 1e6:7.1f} {cublas / us:6.3f} {pred} {regs!s:>5} {spills!s:>5} "
                      f"{err:8.1e}  {label}", flush=True)
        del x, y, out, ref
        torch.cuda.empty_cache()


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
    ap.add_argument("--pipeline", action="store_true",
                    help="time PIPELINE_POINTS with the plain and the pipelined mainloop at each --shapes cube")
    ap.add_argument("--shapes", type=int, nargs="+", default=[4096, 8192], help="cube sizes for --pipeline")
    ap.add_argument("--group", type=int, default=8, help="row tiles per group of the grouped block order (0: off)")
    a = ap.parse_args()
    if a.pipeline:
        pipeline_forms(a.shapes, a.dtype, a.group)
        return
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
