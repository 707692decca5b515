"""Time explicit plan points of one memory-bound op against the planner's pick (and the copy roof).

    python benchmarks/row_points.py --op softmax --dtype bfloat16 --shape 16384x8192 \
        --points threads=512,vector=8 threads=1024,vector=8 threads=32,vector=8,rows_per_block=8
    python benchmarks/row_points.py --op col_sum --primitive split_reduce --shape 16384x1024 \
        --points threads_x=32,threads_y=8,splits=64,unroll=4,outputs_per_thread=4

Each point is one plan step of --primitive (fuse_rows: cache="registers" unless given); the auto
plan is timed first. Timing and rotation over input sets as in memory_bound.py (CUDA-event medians, inputs
covering 3 x L2 so every call reads DRAM); each result is checked against torch in float64.
"""

from __future__ import annotations

import argparse

import torch

from memory_bound import TORCH_DTYPES, MID, Rotation, direct_launcher, tensors_for, time_it, torch_ops

import tecc as tc  # noqa: E402
from tecc.compiler.plan import Plan, Step  # noqa: E402
from tecc.runtime.cuda import CudaExecutor  # noqa: E402


def parse_point(text: str, primitive: str) -> dict:
    args: dict = {"cache": "registers"} if primitive == "fuse_rows" else {}
    for kv in text.split(","):
        k, v = kv.split("=")
        args[k] = v if k == "cache" else int(v)
    return args


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="softmax")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", default="16384x8192")
    ap.add_argument("--primitive", default="fuse_rows")
    ap.add_argument("--points", nargs="*", default=[])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--first-kernels", type=int, default=None,
                    help="time only the first N launches of each call (e.g. 1: a split reduction without its combine)")
    a = ap.parse_args()
    R, C = (int(v) for v in a.shape.split("x"))
    tdt = TORCH_DTYPES[a.dtype]
    stream = torch.cuda.current_stream()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    set_bytes = R * C * torch.tensor([], dtype=tdt).element_size()
    xs = [torch.randn(R, C, device="cuda", dtype=tdt) for _ in range(max(1, -(-3 * l2 // set_bytes)))]
    dsts = [torch.empty_like(x) for x in xs]
    t_copy = time_it(Rotation([lambda x=x, d=d: d.copy_(x) for x, d in zip(xs, dsts)]), stream, a.reps)
    del dsts
    copy_gbps = 2 * set_bytes / t_copy / 1e9
    print(f"{torch.cuda.get_device_name()}: {a.op} {a.shape} {a.dtype}; copy {copy_gbps:.0f} GB/s")
    print("| point | GB/s | % of copy | regs | max rel err |")
    print("| --- | --- | --- | --- | --- |")
    for text in ["auto", *a.points]:
        args = tensors_for(a.op, R, C, a.dtype)
        plan = "auto" if text == "auto" else Plan((Step(a.primitive, parse_point(text, a.primitive)),))
        kern = tc.build(args, plan=plan)
        n_vec = sum(1 for t in args[1:] if t.is_placeholder)
        sets = []
        for x in xs:
            xin = x.view(MID, R // MID, C) if a.op == "mid_mean" else x
            inputs = [xin] + [torch.randn(C, device="cuda", dtype=tdt) for _ in range(n_vec)]
            outs = [torch.empty(tuple(int(s) for s in t.shape), device="cuda", dtype=tdt)
                    for t in args if not t.is_placeholder]
            kern._executor = CudaExecutor(kern.host, kern.cubin, stream=stream)  # no launch-cache hit
            sets.append((inputs, outs, direct_launcher(kern, [*inputs, *outs], a.first_kernels)))
        torch.cuda.synchronize()
        inputs, outs, _ = sets[0]
        ref = torch_ops()[a.op](*[i.double() for i in inputs])
        err = ((outs[0].double() - ref).abs() / (ref.abs() + 1.0)).max().item()
        nbytes = sum(i.numel() * i.element_size() for i in inputs) + sum(o.numel() * o.element_size() for o in outs)
        t = time_it(Rotation([s[2] for s in sets]), stream, a.reps)
        regs = "/".join(str(getattr(kern.resources.get(k.name), "registers", "?")) for k in kern.module.kernels)
        label = text if text != "auto" else "auto: " + "; ".join(f"{s.primitive}{s.args}" for s in kern.plan.steps)
        print(f"| {label} | {nbytes / t / 1e9:.0f} | {100 * nbytes / t / 1e9 / copy_gbps:.0f}% | {regs} | {err:.1e} |",
              flush=True)
        del sets, inputs, outs


if __name__ == "__main__":
    main()
