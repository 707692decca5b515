"""Per-call and back-to-back time of the planner's fp16 GEMM at 1024³, 4096³ and 8192³, and the
host time of one call.

    python benchmarks/host_probe.py

Builds each GEMM with `tc.build` (the planner's choice: the TMA rungs on sm_90), then prints the
host time per call (100 calls enqueued without waiting, / 100: the queue does not fill), the
per-call ratio (events around one Python call) and the back-to-back ratio (10 calls between two
events) against torch.matmul in the same process; at 1024³ also the cProfile of 300 calls (where
the host time goes).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import torch

    import tecc as tc
    from gemm import matmul_tensors, time_call, time_stream

    for n in (1024, 4096, 8192):
        kern = tc.build(matmul_tensors(1, n, n, n, "float16"))
        plan = "; ".join(k.chosen.label for k in kern.planning.kernels) if kern.planning else "?"
        print(n, "plan:", plan)
        a = torch.randn(n, n, device="cuda", dtype=torch.float16)
        b = torch.randn(n, n, device="cuda", dtype=torch.float16)
        c = torch.empty(n, n, device="cuda", dtype=torch.float16)
        kern(a, b, c)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            kern(a, b, c)
        host = (time.perf_counter() - t0) / 100
        torch.cuda.synchronize()
        tc_call = time_call(lambda: kern(a, b, c), 30)
        cb_call = time_call(lambda: torch.matmul(a, b), 30)
        tc_s = time_stream(lambda: kern(a, b, c), 30)
        cb_s = time_stream(lambda: torch.matmul(a, b), 30)
        print(f"{n}: host/call tecc {host * 1e6:.1f} us | per call tecc {tc_call * 1e6:.1f} cublas {cb_call * 1e6:.1f} "
              f"ratio {cb_call / tc_call:.3f} | back-to-back tecc {tc_s * 1e6:.1f} cublas {cb_s * 1e6:.1f} "
              f"ratio {cb_s / tc_s:.3f}")
        if n == 1024:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                kern(a, b, c)
            prof.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            print(out.getvalue()[-3500:])


if __name__ == "__main__":
    main()
