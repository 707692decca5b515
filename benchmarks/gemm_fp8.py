"""fp8 GEMM: tecc (gemm_wgmma_fp8) against torch._scaled_mm in the same process (needs a GPU and torch).

    python benchmarks/gemm_fp8.py [--dtype float8_e4m3|float8_e5m2] [--out float32|bfloat16] [--sizes 4096 8192]

C = A·Bᵀ with A [M, K] and B [N, K] fp8 (both K-major, what torch._scaled_mm wants: it is given
b.t(), a column-major view), unit scales, the sum in float32, the output `--out`. Times are the
median of 20 launches after 3 warm-up ones, with CUDA events; TFLOP/s = 2·M·N·K / time.
"""

from __future__ import annotations

import argparse

import tecc as tc


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float8_e4m3", choices=["float8_e4m3", "float8_e5m2"])
    ap.add_argument("--out", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--quick", action="store_true", help="4096 and 8192 (the default)")
    args = ap.parse_args()
    tdt = {"float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[args.dtype]
    tout = getattr(torch, args.out)

    def median_ms(fn: object) -> float:
        for _ in range(3):
            fn()  # type: ignore[operator]
        times = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()  # type: ignore[operator]
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return sorted(times)[len(times) // 2]

    for n in args.sizes:
        A = tc.placeholder((n, n), args.dtype, "A")
        B = tc.placeholder((n, n), args.dtype, "B")
        r = tc.reduce_axis(n, "r")
        C = tc.compute((n, n), lambda i, j: tc.cast(tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[j, r], "float32"),
                                                           axis=r), args.out), name="C")
        f = tc.build([A, B, C])
        a = torch.randn(n, n, device="cuda").to(tdt)
        b = torch.randn(n, n, device="cuda").to(tdt)
        c = torch.empty(n, n, device="cuda", dtype=tout)
        one = torch.ones((), device="cuda")
        t_tecc = median_ms(lambda: f(a, b, c))
        flops = 2.0 * n**3
        line = (f"{args.dtype} {n}^3 -> {args.out}: tecc {t_tecc:.3f} ms ({flops / t_tecc / 1e9:.0f} TFLOP/s, "
                f"{f.plan.strategy}: {f.plan.reason[:160]})")
        try:  # cuBLASLt takes no e5m2 x e5m2 product
            t_torch = median_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=tout))
            ref = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        except RuntimeError as exc:
            print(f"{line}; torch._scaled_mm refused: {exc}")
            continue
        err = float((c.float() - ref).abs().max())
        print(f"{line}, torch._scaled_mm {t_torch:.3f} ms ({flops / t_torch / 1e9:.0f} TFLOP/s), "
              f"tecc / torch throughput {t_torch / t_tecc:.2f}, max |diff| {err:.3g}")


if __name__ == "__main__":
    main()
