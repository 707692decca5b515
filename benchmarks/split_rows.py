"""Few long rows and full reductions: the two-stage grid reduction (split_rows) against one block
per row (row_fused, today's plan), torch and a copy (issue 7).

    python benchmarks/split_rows.py [--dtypes float32 bfloat16] [--reps 20] [--unrolls 1 2] [--chunks 8192 ...]

For each shape: tecc as `tc.build(args)` plans it (plan="auto"), the split form at the point
`propose` would choose (also where auto declines it), tecc with row_fused's plan (one block per
row: what auto gave before split_rows), torch's `x.float().sum(-1)`, and a device-to-device copy
of the input, timed like benchmarks/memory_bound.py (CUDA-event medians,
launches replayed without tecc's per-call checks, inputs rotated so that none is read out of
L2). GB/s = input bytes / time; "% copy" = tecc auto GB/s / copy GB/s (a copy moves each byte
twice, so its GB/s counts read + write). Every tecc result is checked against float64 torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from memory_bound import Rotation, time_it, timed  # noqa: E402

import tecc as tc  # noqa: E402
from tecc.compiler.plan import Plan, Step  # noqa: E402
from tecc.compiler.strategies.row_fused import propose as propose_row_fused  # noqa: E402
from tecc.compiler.strategies.split_rows import (  # noqa: E402
    THREADS,
    UNROLL_BYTES,
    VECTOR_BYTES,
    choose_splits,
)
from tecc.ir.target import from_device  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROWS = [(8, 1 << 24), (1, 1 << 26), (64, 1 << 20), (2, 3 * (1 << 20) + 7), (8, (1 << 22) + 3), (132, 1 << 20),
        (32, 1 << 20), (16, 1 << 20)]
FULL = [(8192, 8192), (4096, 4099)]


def row_sum(R: int, C: int, dtype: str) -> list[tc.Tensor]:
    X = tc.placeholder((R, C), dtype, name="X")
    c = tc.reduce_axis(C, name="c")
    return [X, tc.compute((R,), lambda r: tc.cast(tc.sum(tc.cast(X[r, c], "float32"), axis=c), dtype), name="Y")]


def full_sum(A: int, B: int, dtype: str) -> list[tc.Tensor]:
    X = tc.placeholder((A, B), dtype, name="X")
    i, j = tc.reduce_axis(A, name="i"), tc.reduce_axis(B, name="j")
    return [X, tc.compute((), lambda: tc.cast(tc.sum(tc.cast(X[i, j], "float32"), axis=[i, j]), dtype), name="Y")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--unrolls", type=int, nargs="*", default=[],
                    help="also time the auto plan's split_rows step with these unroll values")
    ap.add_argument("--chunks", type=int, nargs="*", default=[],
                    help="also time the split form with chunks of about this many elements")
    a = ap.parse_args()
    stream = torch.cuda.current_stream()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    print(f"device: {torch.cuda.get_device_name()}; CUDA-event medians of {a.reps}")
    extra = "".join(f" unroll {u} GB/s |" for u in a.unrolls) + "".join(f" chunk {c} GB/s |" for c in a.chunks)
    print("| op | shape | dtype | auto GB/s | split GB/s | one block per row GB/s | torch GB/s | copy GB/s | "
          f"auto % of copy | split / row | max rel err | auto plan |{extra}")
    print("| --- " * (12 + len(a.unrolls) + len(a.chunks)) + "|")
    cases = [("row_sum", s) for s in ROWS] + [("full_sum", s) for s in FULL]
    for dtype in a.dtypes:
        tdt = TORCH_DTYPES[dtype]
        for op, (R, C) in cases:
            nbytes = R * C * torch.tensor([], dtype=tdt).element_size()
            xs = [torch.randn(R, C, device="cuda", dtype=tdt) for _ in range(max(1, -(-3 * l2 // nbytes)))]
            dsts = [torch.empty_like(x) for x in xs]
            t_copy = time_it(Rotation([lambda x=x, d=d: d.copy_(x) for x, d in zip(xs, dsts)]), stream, a.reps)
            del dsts
            args = (row_sum if op == "row_sum" else full_sum)(R, C, dtype)
            out_shape = (R,) if op == "row_sum" else ()
            kern = tc.build(args)
            y, t_auto = timed(kern, xs, out_shape, tdt, stream, a.reps)
            ref = xs[0].double().sum(-1) if op == "row_sum" else xs[0].double().sum()
            err = ((y.double() - ref).abs() / xs[0].double().abs().sum(-1 if op == "row_sum" else None)).max().item()
            t_rows = None
            t_split = t_auto
            fused = propose_row_fused(args) if op == "row_sum" else None
            if fused is not None:
                _, t_rows = timed(tc.build(args, plan=fused.plan), xs, out_shape, tdt, stream, a.reps)
            # the split form even where auto declines it, at the point propose would choose
            item = torch.tensor([], dtype=tdt).element_size()
            vector = VECTOR_BYTES // item
            unroll = UNROLL_BYTES // (vector * item)
            splits = choose_splits(R if op == "row_sum" else 1, C if op == "row_sum" else R * C,
                                   THREADS * vector * unroll, from_device())
            point = {"threads": THREADS, "splits": splits, "vector": vector, "unroll": unroll}
            forced = Plan((Step("split_rows", point),))
            _, t_split = timed(tc.build(args, plan=forced), xs, out_shape, tdt, stream, a.reps)
            if op == "row_sum":
                t_torch = time_it(Rotation([lambda x=x: x.float().sum(-1) for x in xs]), stream, a.reps)
            else:
                t_torch = time_it(Rotation([lambda x=x: x.float().sum() for x in xs]), stream, a.reps)
            def gb(t: float, nbytes: int = nbytes) -> float:
                return nbytes / t / 1e9

            copy_gbps = 2 * nbytes / t_copy / 1e9
            step = kern.plan.steps[0] if kern.plan.steps else None
            plan = f"{step.primitive}({', '.join(f'{k}={v}' for k, v in step.args.items())})" if step else "naive"
            regs = "/".join(str(getattr(kern.resources.get(k.name), "registers", "?")) for k in kern.module.kernels)
            rows_txt = f"{gb(t_rows):.0f}" if t_rows else "-"
            variants = ""
            for u in a.unrolls:
                if step is None or step.primitive != "split_rows":
                    variants += " - |"
                    continue
                other = tc.Plan((tc.compiler.plan.Step("split_rows", dict(step.args, unroll=u)),))
                _, t_u = timed(tc.build(args, plan=other), xs, out_shape, tdt, stream, a.reps)
                variants += f" {gb(t_u):.0f} |"
            for chunk in a.chunks:
                length = C if op == "row_sum" else R * C
                tile = THREADS * vector * unroll
                splits_c = max(1, -(-length // (max(1, round(chunk / tile)) * tile)))
                other = Plan((Step("split_rows", dict(point, splits=splits_c)),))
                _, t_c = timed(tc.build(args, plan=other), xs, out_shape, tdt, stream, a.reps)
                variants += f" {gb(t_c):.0f} ({splits_c}) |"
            speedup = f"{t_rows / t_split:.2f}x" if t_rows else "-"
            print(f"| {op} | {R}x{C} | {dtype} | {gb(t_auto):.0f} | {gb(t_split):.0f} | {rows_txt} | "
                  f"{gb(t_torch):.0f} | {copy_gbps:.0f} | {100 * gb(t_auto) / copy_gbps:.0f}% | {speedup} | "
                  f"{err:.1e} | {plan}, {regs} regs |{variants}", flush=True)
            del xs


if __name__ == "__main__":
    main()
