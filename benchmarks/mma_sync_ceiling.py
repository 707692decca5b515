"""The issue ceiling of mma.sync on this GPU, against cuBLAS in the same process.

    python benchmarks/mma_sync_ceiling.py

A register-only loop of `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` (no loads, no
shared memory: NACC independent accumulators per warp, fragments held in registers), launched
as a grid of 1 or 2 blocks of 4, 8 or 16 warps per SM, timed with CUDA events and printed in TF/s and
as a fraction of torch.matmul's fp16 4096^3 (cuBLAS, wgmma on Hopper). It bounds what any
mma.sync GEMM can reach here: the tecc mma.sync kernel's distance from it is what its data
movement (ldmatrix, cp.async into shared memory, barriers) costs (docs/tensor-cores.md,
"How far the mma.sync path is from its ceiling"). The kernel is raw CUDA compiled by cupy: a
measuring instrument, not tecc output. Needs torch and cupy.
"""

from __future__ import annotations

import statistics

SOURCE = r'''
extern "C" __global__ void ceiling(float* out, int iters) {
  unsigned a0 = threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 * 11u, b1 = a0 * 13u;
  float acc[NACC][4];
  #pragma unroll
  for (int t = 0; t < NACC; ++t) { acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f; }
  for (int it = 0; it < iters; ++it) {
    #pragma unroll
    for (int t = 0; t < NACC; ++t) {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(acc[t][0]), "+f"(acc[t][1]), "+f"(acc[t][2]), "+f"(acc[t][3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
  float s = 0.f;
  #pragma unroll
  for (int t = 0; t < NACC; ++t) s += acc[t][0] + acc[t][1] + acc[t][2] + acc[t][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
'''


def main() -> None:
    import cupy as cp
    import torch

    def timed(fn, reps: int = 10) -> float:  # type: ignore[no-untyped-def]
        for _ in range(3):
            fn()
        rounds = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            torch.cuda.synchronize()
            rounds.append(a.elapsed_time(b) / reps * 1e3)
        return statistics.median(rounds)

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    y = torch.randn_like(x)
    cublas = 2 * 4096 ** 3 / timed(lambda: torch.matmul(x, y)) / 1e6
    print(f"GPU {torch.cuda.get_device_name()}: cuBLAS fp16 4096^3 {cublas:.0f} TF/s", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    major, minor = torch.cuda.get_device_capability()
    out = cp.zeros(sms * 2 * 16 * 32, dtype=cp.float32)
    iters = 4000
    for nacc in (8, 16, 32):
        kernel = cp.RawKernel(SOURCE.replace("NACC", str(nacc)), "ceiling", options=(f"-arch=sm_{major}{minor}",))
        for warps in (4, 8, 16):
            for per_sm in (1, 2):
                if (nacc * 4 + 12) * 32 * warps > 65536:
                    continue   # one block's registers would exceed the register file: no launch
                t = timed(lambda: kernel((sms * per_sm,), (32 * warps,), (out, cp.int32(iters))), 3)
                flops = sms * per_sm * warps * iters * nacc * 2 * 16 * 8 * 16
                tf = flops / t / 1e6
                print(f"{nacc:2d} accumulators/warp, {warps:2d} warps/block, grid of {per_sm} block(s)/SM: "
                      f"{tf:6.0f} TF/s = {tf / cublas:.3f} of cuBLAS", flush=True)


if __name__ == "__main__":
    main()
