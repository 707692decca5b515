"""Dropout with tc.rand against PyTorch: what Philox4x32-10 in the kernel costs.

    python benchmarks/dropout.py [--shapes 16384x1024 16384x4096 8192x8192] [--dtypes float32 bfloat16] [--p 0.1]

For each shape and dtype, all in this process on one stream, CUDA-event medians of --reps
(memory_bound.py's timing: each timed call takes the next of N input/output sets covering 3 x L2,
so inputs come from DRAM):
- tecc dropout: y = where(rand < p, 0, x / (1 - p)), seed and offset int64 tensors (one kernel,
  the random numbers never stored; plan="auto");
- tecc scale: y = x / (1 - p), the same kernel without the random numbers (the dropout-free time);
- torch: F.dropout(x, p, training=True) under no_grad (Philox inside its kernel too), and
  torch.compile of the same function;
- a device-to-device copy of x.
GB/s = (x read + y written) / time. "vs scale" = tecc scale time / tecc dropout time (1.0: the
random numbers are free); "vs torch" = fastest torch time / tecc dropout time. Every tecc result is
checked first: the kept elements equal x / (1 - p) and the dropped fraction is within 1% of p.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from memory_bound import Rotation, direct_launcher, time_it  # noqa: E402

import tecc as tc  # noqa: E402
from tecc.runtime.cuda import CudaExecutor  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dropout_args(R: int, C: int, dtype: str, p: float, with_rand: bool):
    x = tc.placeholder((R, C), dtype, name="x")
    seed = tc.placeholder((), "int64", name="seed")
    offset = tc.placeholder((), "int64", name="offset")
    if with_rand:
        keep = tc.rand((R, C), seed, offset, name="keep")
        y = tc.compute((R, C), lambda i, j: tc.where(keep[i, j] < p, 0, x[i, j] / (1 - p)), name="y")
        return [x, seed, offset, y]
    y = tc.compute((R, C), lambda i, j: x[i, j] / (1 - p), name="y")
    return [x, y]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["16384x1024", "16384x4096", "8192x8192", "4099x1023"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    stream = torch.cuda.current_stream()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    rotate = 3 * l2
    p = a.p
    print(f"device: {torch.cuda.get_device_name()}; p = {p}; CUDA-event medians of {a.reps}, inputs from DRAM")
    print("| shape | dtype | tecc dropout GB/s | tecc scale GB/s | vs scale | torch GB/s | torch.compile GB/s | "
          "vs torch | copy GB/s | regs | plan |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in a.dtypes:
        tdt = TORCH_DTYPES[dtype]
        for shape in a.shapes:
            R, C = (int(v) for v in shape.lower().split("x"))
            nbytes = 2 * R * C * torch.tensor([], dtype=tdt).element_size()
            n_sets = max(1, -(-rotate // (nbytes // 2)))
            xs = [torch.randn(R, C, device="cuda", dtype=tdt) for _ in range(n_sets)]
            ys = [torch.empty_like(x) for x in xs]
            t_copy = time_it(Rotation([lambda x=x, y=y: y.copy_(x) for x, y in zip(xs, ys)]), stream, a.reps)

            drop = tc.build(dropout_args(R, C, dtype, p, True))
            scale = tc.build(dropout_args(R, C, dtype, p, False))
            seed = torch.tensor(1234, dtype=torch.int64, device="cuda")
            offsets = [torch.tensor(k * ((R * C + 3) // 4), dtype=torch.int64, device="cuda") for k in range(n_sets)]
            drop_runs, scale_runs = [], []
            for x, y, off in zip(xs, ys, offsets):
                drop._executor = CudaExecutor(drop.host, drop.cubin, stream=stream)
                drop_runs.append(direct_launcher(drop, [x, seed, off, y]))
                scale._executor = CudaExecutor(scale.host, scale.cubin, stream=stream)
                scale_runs.append(direct_launcher(scale, [x, y]))
            # check: one call, then the kept elements and the dropped fraction
            drop(xs[0], seed, offsets[0], ys[0])
            torch.cuda.synchronize()
            dropped = ys[0] == 0
            frac = dropped.float().mean().item()
            # tecc divides in float32 by the constant 1 - p rounded to the dtype (docs/dtypes.md)
            divisor = torch.tensor(1 - p, dtype=tdt).float().item()
            kept_ok = torch.equal(ys[0][~dropped].float(), (xs[0].float() / divisor).to(tdt)[~dropped].float())
            assert abs(frac - p) < 0.01 and kept_ok, f"dropout {dtype} {shape}: dropped {frac:.4f}, kept exact {kept_ok}"

            t_drop = time_it(Rotation(drop_runs), stream, a.reps)
            t_scale = time_it(Rotation(scale_runs), stream, a.reps)

            def eager(x):
                with torch.no_grad():
                    return torch.nn.functional.dropout(x, p, training=True)

            t_torch = time_it(Rotation([lambda x=x: eager(x) for x in xs]), stream, a.reps)
            t_comp = None
            if not a.no_compile:
                try:
                    comp = torch.compile(eager, dynamic=False)
                    t_comp = time_it(Rotation([lambda x=x: comp(x) for x in xs]), stream, a.reps)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"# torch.compile failed: {type(exc).__name__}: {exc}"[:300])
            gb = lambda t: nbytes / t / 1e9  # noqa: E731
            best_torch = min(t for t in (t_torch, t_comp) if t)
            regs = "/".join(str(getattr(drop.resources.get(k.name), "registers", "?")) for k in drop.module.kernels)
            plan = "; ".join(kp.chosen.label for kp in drop.planning.kernels) if drop.planning is not None else ""
            comp_txt = f"{gb(t_comp):.0f}" if t_comp else "-"
            print(f"| {R}x{C} | {dtype} | {gb(t_drop):.0f} | {gb(t_scale):.0f} | {t_scale / t_drop:.2f} | "
                  f"{gb(t_torch):.0f} | {comp_txt} | {best_torch / t_drop:.2f}x | {gb(t_copy):.0f} | {regs} | {plan} |",
                  flush=True)
            del xs, ys, drop_runs, scale_runs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
