"""GPT-2 small's own GEMMs, in the layouts its training step has them, by device time against
cuBLAS in the same process.

    python benchmarks/gemm_model.py [--out DIR] [--reps 20] [--only qkv,lm_head] [--views]

A GPT-2 small step (batch 8 x 1024 tokens, width 768, vocabulary 50304, bf16) runs each Linear
three times: the forward `x @ W^T` (W stored [N, K]: "nt"), the input gradient `dY @ W` ("nn")
and the weight gradient `dY^T @ x` (A read transposed: "tn"). For each GEMM: the planner's pick
for the live GPU, the best-predicted gemm_wgmma and gemm_tensor_core (mma.sync) points where they
are not the pick, and cuBLAS (torch.mm on the same strided views). Each tecc row gives the
predicted time, the device time (CUPTI, benchmarks/gemm_small.device_us), cuBLAS / tecc
(`ratio`, > 1: tecc faster) and the relative error against float64.

`--views`: the operands whose dimension is the 8 x 1024 tokens as the model's programs read them,
[8, 1024, C] tensors through x.view(8192, C) (X[i // 1024, i % 1024, k]; the weight gradient's
both operands over its reduction), which the TMA ring loads through tensor maps that merge the
two dimensions (tecc/passes/schedule/tma.py): the same picks and times as the 2-D rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm_small import best_per_strategy, candidates, device_us, timed_rows  # noqa: E402  (benchmarks/gemm_small.py)

T, C, V = 8192, 768, 50304
# name -> (M, N, K, layout): layout "nt" C = A[M,K] B[N,K]^T, "nn" A[M,K] B[K,N], "tn" A[K,M]^T B[K,N]
GEMMS = {
    "qkv": (T, 3 * C, C, "nt"), "proj": (T, C, C, "nt"), "fc": (T, 4 * C, C, "nt"), "fc2": (T, C, 4 * C, "nt"),
    "lm_head": (T, V, C, "nt"),
    "qkv dX": (T, C, 3 * C, "nn"), "fc dX": (T, C, 4 * C, "nn"), "fc2 dX": (T, 4 * C, C, "nn"),
    "lm_head dX": (T, C, V, "nn"),
    "qkv dW": (3 * C, C, T, "tn"), "proj dW": (C, C, T, "tn"), "fc dW": (4 * C, C, T, "tn"),
    "fc2 dW": (C, 4 * C, T, "tn"), "lm_head dW": (V, C, T, "tn"),
}


BATCH = 8   # --views: the tokens T as [BATCH, T // BATCH]


def viewed(shape: tuple[int, int], views: bool) -> tuple[int, ...]:
    """An operand's shape: with `views`, its tokens dimension (the first, of extent T) as two."""
    return (BATCH, T // BATCH, shape[1]) if views and shape[0] == T else shape


def program(m: int, n: int, k: int, layout: str, views: bool = False) -> list[Any]:
    import tecc as tc

    r = tc.reduce_axis(k, name="k")
    a_shape = viewed((k, m) if layout == "tn" else (m, k), views)
    b_shape = viewed((n, k) if layout == "nt" else (k, n), views)
    A = tc.placeholder(a_shape, "bfloat16", name="A")
    B = tc.placeholder(b_shape, "bfloat16", name="B")

    def at(X: Any, row: Any, col: Any) -> Any:
        # a [BATCH, T / BATCH, C] operand read through its view as [T, C]
        return X[row // (T // BATCH), row % (T // BATCH), col] if len(X.shape) == 3 else X[row, col]

    def a(i: Any) -> Any:
        return at(A, r, i) if layout == "tn" else at(A, i, r)

    def b(j: Any) -> Any:
        return at(B, j, r) if layout == "nt" else at(B, r, j)

    out = tc.compute((m, n), lambda i, j: tc.cast(tc.sum(tc.cast(a(i), "float32") * tc.cast(b(j), "float32"),
                                                         axis=r), "bfloat16"), name="C")
    return [A, B, out]


def rows_for(name: str, reps: int, target: Any, views: bool = False) -> list[dict[str, Any]]:
    import torch

    m, n, k, layout = GEMMS[name]
    args = program(m, n, k, layout, views)
    res, ranked = candidates(args, target)
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn((k, m) if layout == "tn" else (m, k), device="cuda", generator=g).bfloat16()
    b = torch.randn((n, k) if layout == "nt" else (k, n), device="cuda", generator=g).bfloat16()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    a_op = a.t() if layout == "tn" else a
    b_op = b.t() if layout == "nt" else b
    ref = a_op.double() @ b_op.double()
    t_cublas = device_us(lambda: torch.mm(a_op, b_op), reps)
    # tecc's arguments: the same storage, [BATCH, T / BATCH, C] where the program reads a view
    a_arg, b_arg = (x.view(viewed(tuple(x.shape), True)) if views else x for x in (a, b))
    pick = res.kernels[0].chosen
    runs = [("plan", res.plan, pick)] + best_per_strategy(pick, ranked, ("gemm_wgmma", "gemm_tensor_core"))
    shape = f"{name} {m}x{n}x{k} {layout}" + (" views" if views else "")
    return [{"shape": shape, "what": "cuBLAS", "device_us": t_cublas}] + timed_rows(shape, runs, args, (a_arg, b_arg),
                                                                                    out, ref, t_cublas, reps)


def main() -> None:
    import torch

    from tecc.ir.target import from_device

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write DIR/gemm_model.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma-separated GEMM names (default: all)")
    ap.add_argument("--views", action="store_true",
                    help="the tokens operands as [8, 1024, C] tensors read through views (the model's programs)")
    opts = ap.parse_args()
    target = from_device()
    names = list(GEMMS) if opts.only is None else opts.only.split(",")
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}; bf16, device time per call (CUPTI)")
    print(f"{'gemm':>34} {'row':>22} {'pred us':>8} {'device us':>10} {'ratio':>6} {'rel err':>8}  plan", flush=True)
    rows: list[dict[str, Any]] = []
    for name in names:
        for row in rows_for(name, opts.reps, target, opts.views):
            rows.append(row)
            if "error" in row:
                print(f"{row['shape']:>34} {row['what']:>22}  error: {row['error']}", flush=True)
                continue
            pred = f"{row['predicted_us']:8.1f}" if "predicted_us" in row else " " * 8
            ratio = f"{row['ratio']:6.2f}" if "ratio" in row else " " * 6
            err = f"{row['rel_err']:8.1e}" if "rel_err" in row else " " * 8
            print(f"{row['shape']:>34} {row['what']:>22} {pred} {row['device_us']:10.1f} {ratio} {err}  "
                  f"{row.get('plan', '')}", flush=True)
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        Path(opts.out, "gemm_model.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
