"""GPU correctness of the memory-bound kernels on awkward shapes, against torch in float64.

    python benchmarks/memory_bound_check.py [float32 bfloat16 float16]

Each case builds with plan="auto" (row fusion, split reduction, elementwise), runs on the GPU and
prints the op, shape, dtype, plan strategy and max |y - ref| / (|ref| + 1); exits 1 on a miss.
Shapes: 0-size rows and columns, lengths that are not multiples of the vector width, 16-bit
types, column and middle-axis reductions with max / sum / mean.
"""

from __future__ import annotations

import os
import sys

import torch

from memory_bound import col_sum, mid_mean, sin_affine, torch_ops  # noqa: E402  (sys.path set there)

import norms  # noqa: E402
import tecc as tc  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES = sys.argv[1:] or ["float32", "bfloat16"]
TOL = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}


def col_max(R, C, dtype):
    X = tc.placeholder((R, C), dtype, name="X")
    i = tc.reduce_axis(R, name="i")
    return [X, tc.compute((C,), lambda j: tc.max(X[i, j], axis=i), name="Y")]


def mid_sum3(A, B, C, dtype):
    X = tc.placeholder((A, B, C), dtype, name="X")
    b = tc.reduce_axis(B, name="b")
    return [X, tc.compute((A, C), lambda a, c: tc.cast(tc.sum(tc.cast(X[a, b, c], "float32"), axis=b), dtype),
                          name="Y")]


def cases():
    ref = torch_ops()
    for dtype in DTYPES:
        for R, C in ((3, 1000), (2, 1002), (0, 64), (4, 8192), (2, 1024), (2, 131072 + 8)):
            yield "softmax", (R, C), dtype, norms.softmax(R, C, dtype), ref["softmax"], [(R, C)]
            yield "layer_norm", (R, C), dtype, norms.layer_norm(R, C, dtype), ref["layer_norm"], [(R, C), (C,), (C,)]
        yield "row_max", (2, 257), dtype, norms.row_reduce(2, 257, dtype, "max"), ref["row_max"], [(2, 257)]
        # rows of 1024: several rows per block, one warp each, where the cost model picks it (4099: a partial block)
        for R in (4099, 16384):
            yield "row_sum", (R, 1024), dtype, norms.row_reduce(R, 1024, dtype, "sum"), ref["row_sum"], [(R, 1024)]
        # 16-bit column / middle-axis reductions wide enough for adjacent outputs per thread (vector loads)
        for R, C in ((8192, 4096), (8192, 8192)):
            yield "col_sum", (R, C), dtype, col_sum(R, C, dtype), ref["col_sum"], [(R, C)]
        yield "mid_sum", (16, 1024, 4096), dtype, mid_sum3(16, 1024, 4096, dtype), \
            lambda x: x.float().sum(1).to(x.dtype), [(16, 1024, 4096)]
        for R, C in ((300, 70), (0, 70), (5, 0), (4096, 1024), (1, 33)):
            yield "col_sum", (R, C), dtype, col_sum(R, C, dtype), ref["col_sum"], [(R, C)]
            yield "col_max", (R, C), dtype, col_max(R, C, dtype), lambda x: x.amax(0), [(R, C)]
        for A, B, C in ((3, 130, 5), (16, 1024, 1024), (2, 0, 7), (7, 9, 1)):
            yield "mid_sum", (A, B, C), dtype, mid_sum3(A, B, C, dtype), lambda x: x.float().sum(1).to(x.dtype), [(A, B, C)]
        yield "mid_mean", (64, 4096), dtype, mid_mean(64 * 16, 4096, dtype), ref["mid_mean"], [(16, 64, 4096)]
        for R, C in ((5, 1000), (3, 1001), (0, 8), (1024, 4096)):
            yield "sin_affine", (R, C), dtype, sin_affine(R, C, dtype), ref["sin_affine"], [(R, C), (C,)]


def main() -> int:
    # TECC_CHECK_OPS=sin_affine,...: check only those ops (argv already names the dtypes)
    only = {o for o in os.environ.get("TECC_CHECK_OPS", "").split(",") if o}
    bad = 0
    for op, shape, dtype, args, ref, in_shapes in cases():
        if only and op not in only:
            continue
        if op.startswith("col_max") and min(shape) == 0:
            continue  # max over nothing: -inf, torch refuses amax of an empty dimension
        k = tc.build(args)
        ins = [torch.randn(s, device="cuda", dtype=TORCH[dtype]) for s in in_shapes]
        out = torch.empty(tuple(int(s) for s in args[-1].shape), device="cuda", dtype=TORCH[dtype])
        k(*ins, out)
        torch.cuda.synchronize()
        want = ref(*[i.double() for i in ins])
        err = ((out.double() - want).abs() / (want.abs() + 1.0)).max().item() if out.numel() else 0.0
        ok = err <= TOL[dtype] * (8 if op.startswith(("col", "mid")) else 1)
        bad += not ok
        steps = "; ".join(f"{st.primitive}{st.args}" for st in k.plan.steps)
        print(f"{'ok ' if ok else 'BAD'} {op} {shape} {dtype}: {k.plan.strategy} [{steps}], {len(k.module.kernels)} kernel(s), "
              f"err {err:.1e}", flush=True)
    print(f"{bad} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
