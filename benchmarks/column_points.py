"""GPT-2's column sums (its bias and layer norm parameter gradients: 8192 rows of 768, 2304 and
3072 columns) as the planner builds them, against the same split with other points, torch and
torch.compile, in this process on one stream (CUDA-event medians, inputs rotating over 3 x L2:
benchmarks/memory_bound.py's harness).

    python benchmarks/column_points.py                       # every shape, bf16 and float32 at 768
    python benchmarks/column_points.py --shapes 8192x768 --dtypes bfloat16

Rows: `auto` (plan="auto"), `unroll 4` (the one-wave point with 4 rows in flight per thread:
what the planner chose before `column_reduction.solo_unroll`), `splits x2` (twice the blocks
along the rows, unroll 4: the other way to put more bytes in flight), and torch / torch.compile of
`x.float().sum(0).to(dtype)`. GB/s = (input + output bytes) / median time; "% copy" against a
device-to-device copy of the input timed the same way. Each tecc result is checked against a
float64 sum first (max relative error printed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from memory_bound import Rotation, col_sum, time_it, timed  # noqa: E402

import tecc as tc  # noqa: E402
from tecc.compiler.plan import Plan, Step  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHAPES = [(8192, 768), (8192, 2304), (8192, 3072)]


def variants(args) -> dict[str, object]:
    """plan="auto" and the two other points around it (module docstring)."""
    auto = tc.build(args)
    step = dict(auto.plan.steps[0].args) if auto.plan.strategy == "column_reduction" else None
    out: dict[str, object] = {"auto": auto}
    if step is not None:
        out["unroll 4"] = {**step, "unroll": 4}
        out["splits x2"] = {**step, "unroll": 4, "splits": 2 * step["splits"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=None, help="RxC (default: GPT-2's 8192 x 768 / 2304 / 3072)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes] if a.shapes else SHAPES
    stream = torch.cuda.current_stream()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    print(f"device: {torch.cuda.get_device_name()}; inputs rotate over >= {3 * l2 >> 20} MiB; medians of {a.reps}")
    print("| shape | dtype | variant | us | GB/s | % copy | max rel err | point |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in a.dtypes:
        tdt = TORCH_DTYPES[dtype]
        for R, C in shapes:
            if dtype == "float32" and C != 768:
                continue  # float32 column sums of GPT-2 are the 768-wide layer norm ones
            size = R * C * tdt.itemsize
            xs = [torch.randn(R, C, device="cuda", dtype=tdt) for _ in range(max(1, -(-3 * l2 // size)))]
            dsts = [torch.empty_like(x) for x in xs]
            t_copy = time_it(Rotation([lambda x=x, d=d: d.copy_(x) for x, d in zip(xs, dsts)]), stream, a.reps)
            copy_gbps = 2 * size / t_copy / 1e9
            del dsts
            nbytes = size + C * tdt.itemsize
            args = col_sum(R, C, dtype)
            ref = xs[0].double().sum(0)
            for label, what in variants(args).items():
                kern = what if not isinstance(what, dict) else tc.build(
                    args, plan=Plan((Step("split_reduce", what),), "column_reduction", label))
                y, t = timed(kern, xs, (C,), tdt, stream, a.reps)
                err = ((y.double() - ref).abs() / (ref.abs() + 1.0)).max().item()
                point = ", ".join(f"{k}={v}" for k, v in kern.plan.steps[0].args.items())
                print(f"| {R}x{C} | {dtype} | {label} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | "
                      f"{100 * nbytes / t / 1e9 / copy_gbps:.0f}% | {err:.1e} | {point} |", flush=True)
            eager = lambda x: x.float().sum(0).to(x.dtype)  # noqa: E731
            refs = [("torch", eager)]
            if not a.no_compile:
                refs.append(("torch.compile", torch.compile(eager, dynamic=False)))
            for label, fn in refs:
                t = time_it(Rotation([lambda x=x: fn(x) for x in xs]), stream, a.reps)
                print(f"| {R}x{C} | {dtype} | {label} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | "
                      f"{100 * nbytes / t / 1e9 / copy_gbps:.0f}% | | |", flush=True)
            del xs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
