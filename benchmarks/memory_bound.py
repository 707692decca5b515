"""Memory-bound ops at bandwidth: row reductions and the normalization family (issue 7).

    python benchmarks/memory_bound.py [--rows 16384] [--cols 1024 4096 8192] [--shapes 64x131072 ...]
    python benchmarks/memory_bound.py --shapes 64x131072 16x262144 --ops softmax layer_norm rms_norm [--row-fused]

For each op, shape and dtype: tecc's kernels as `tc.build(args)` plans them (plan="auto": row
fusion for the row ops, or for few long rows two kernels of S blocks per row (split_row_group),
a split reduction for col_sum / mid_mean, the planner's elementwise strategy for
sin_affine = sin(1.5·x + b[j]) with b broadcast along the rows; `--row-fused`: the row ops with
row_fused's one-block-per-row plan instead, to compare with the split),
torch eager and torch.compile, all in this process on one stream, timed with CUDA events
(median of --reps launches after warm-up), and a device-to-device copy of the same input size
timed the same way. Bytes = each input read once + each output written once; GB/s = bytes /
median time; "% copy" = tecc GB/s / copy GB/s. Every tecc result is checked against a float64
reference computed by torch on the GPU first (max relative error printed).

DRAM, not L2: every timed call (tecc, torch, torch.compile and the copy alike) takes the next of
N input/output sets in turn, N chosen so that the inputs together are at least --rotate-mib
(default: 3 x the GPU's L2), so no launch finds its input left in L2 by the previous one. Before
this, rows of 1024 bf16 (32 MiB) were timed out of the H200's L2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

import norms  # noqa: E402

import tecc as tc  # noqa: E402
from tecc.compiler.strategies.row_fused import propose as propose_row_fused  # noqa: E402
from tecc.runtime.cuda import CudaExecutor  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EPS = norms.EPS


def torch_ops():
    def softmax(x):
        return torch.softmax(x.float(), -1).to(x.dtype)

    def layer_norm(x, g, b):
        return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), g.float(), b.float(), EPS).to(x.dtype)

    def rms_norm(x, g):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * g.float()).to(x.dtype)

    def row_sum(x):
        return x.float().sum(-1).to(x.dtype)

    def row_max(x):
        return x.amax(-1)

    def col_sum(x):
        return x.float().sum(0).to(x.dtype)

    def mid_mean(x):
        return x.float().mean(1).to(x.dtype)

    def sin_affine(x, b):
        return torch.sin(1.5 * x.float() + b.float()).to(x.dtype)

    return {"softmax": softmax, "layer_norm": layer_norm, "rms_norm": rms_norm, "row_sum": row_sum,
            "row_max": row_max, "col_sum": col_sum, "mid_mean": mid_mean, "sin_affine": sin_affine}


MID = 16  # mid_mean reduces X viewed as (MID, rows / MID, C) over its middle axis


def col_sum(R, C, dtype):
    X = tc.placeholder((R, C), dtype, name="X")
    i = tc.reduce_axis(R, name="i")
    Y = tc.compute((C,), lambda j: tc.cast(tc.sum(tc.cast(X[i, j], "float32"), axis=i), dtype), name="Y")
    return [X, Y]


def mid_mean(R, C, dtype):
    A, B = MID, R // MID
    X = tc.placeholder((A, B, C), dtype, name="X")
    b = tc.reduce_axis(B, name="b")
    Y = tc.compute((A, C), lambda a, c: tc.cast(tc.sum(tc.cast(X[a, b, c], "float32"), axis=b) * (1.0 / B), dtype),
                   name="Y")
    return [X, Y]


def sin_affine(R, C, dtype):
    X = tc.placeholder((R, C), dtype, name="X")
    b = tc.placeholder((C,), dtype, name="b")
    Y = tc.compute((R, C), lambda r, j: tc.cast(tc.sin(1.5 * tc.cast(X[r, j], "float32") + tc.cast(b[j], "float32")),
                                                dtype), name="Y")
    return [X, b, Y]


def tensors_for(op: str, R: int, C: int, dtype: str):
    if op == "softmax":
        return norms.softmax(R, C, dtype)
    if op == "layer_norm":
        return norms.layer_norm(R, C, dtype)
    if op == "rms_norm":
        return norms.rms_norm(R, C, dtype)
    if op in ("col_sum", "mid_mean", "sin_affine"):
        return globals()[op](R, C, dtype)
    return norms.row_reduce(R, C, dtype, "sum" if op == "row_sum" else "max")


INNER = 10  # launches between two events, so host-side launch cost is hidden behind the GPU's work


def time_it(fn, stream, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        for _ in range(INNER):
            fn()
        e1.record(stream)
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3 / INNER)
    return statistics.median(times)


def direct_launcher(kern, args, first: int | None = None):
    """The launches of one checked call of `kern`, replayed without the per-call argument checks
    (tecc's Python-side checks cost ~100 us, more than the kernel) through the executor's own
    hand-off to the driver (`_submit`: cuda.core's launch, or the packed parameter block of a
    kernel that takes TMA tensor maps by value, which cuda.core's launch cannot pass);
    `first`: only the first that many launches."""
    from cuda.core import LaunchConfig

    ex = kern._executor
    recorded = []
    real = ex._launch

    def spy(info, grid, block, params):
        recorded.append((ex.kernels[info.name], LaunchConfig(grid=grid, block=block, shmem_size=info.dynamic_smem),
                         params))
        real(info, grid, block, params)

    ex._launch = spy
    kern(*args)
    ex._launch = real
    if not recorded:  # a launch-cache replay bypasses `_launch`: give each call a fresh executor
        raise RuntimeError("direct_launcher: the call launched nothing through _launch (launch cache hit?)")
    if first is not None:
        del recorded[first:]

    def run():
        for k, config, params in recorded:
            ex._submit(k, config, params)

    return run


class Rotation:
    """Calls `fns[i]` for i = 0, 1, 2, ... cyclically: each timed call touches the next set."""

    def __init__(self, fns):
        self.fns, self.i = fns, 0

    def __call__(self):
        fn = self.fns[self.i]
        self.i = (self.i + 1) % len(self.fns)
        return fn()


def timed(kern, xs, out_shape, tdt, stream, reps):
    """(the first input's output, the median time) of `kern` on each input of `xs` in turn, each
    with a fresh output of `out_shape` and an executor of its own (no launch-cache hit)."""
    sets = []
    for x in xs:
        y = torch.empty(out_shape, device="cuda", dtype=tdt)
        kern._executor = CudaExecutor(kern.host, kern.cubin, stream=stream)  # no launch-cache hit
        sets.append((y, direct_launcher(kern, [x, y])))
    torch.cuda.synchronize()
    return sets[0][0], time_it(Rotation([s[1] for s in sets]), stream, reps)


def parse_shapes(a) -> list[tuple[int, int]]:
    if a.shapes:
        return [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes]
    return [(a.rows, c) for c in a.cols]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--shapes", nargs="+", default=None, help="RxC shapes, instead of --rows x --cols")
    ap.add_argument("--ops", nargs="+", default=["row_sum", "row_max", "softmax", "layer_norm", "rms_norm", "col_sum",
                                                 "mid_mean", "sin_affine"])
    ap.add_argument("--compile-ops", nargs="+", default=None, help="ops to time torch.compile for (default: all)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rotate-mib", type=float, default=None,
                    help="the input/output sets timed in turn cover at least this much (default 3 x L2)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--row-fused", action="store_true",
                    help="build the row ops with row_fused's one-block-per-row plan instead of plan='auto'")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip torch.compile once this much time has passed")
    a = ap.parse_args()
    t_start = time.time()
    stream = torch.cuda.current_stream()
    dev = torch.cuda.get_device_name()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    rotate = int((a.rotate_mib * 2**20) if a.rotate_mib is not None else 3 * l2)
    ref_ops = torch_ops()
    print(f"device: {dev}; L2 {l2 >> 20} MiB; every timed call takes the next of the sets covering "
          f">= {rotate >> 20} MiB; CUDA-event medians of {a.reps}")
    print("| op | shape | dtype | tecc GB/s | torch GB/s | torch.compile GB/s | copy GB/s | % of copy | vs compile | max rel err | plan |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in a.dtypes:
        tdt = TORCH_DTYPES[dtype]
        for R, C in parse_shapes(a):
            set_bytes = R * C * torch.tensor([], dtype=tdt).element_size()
            n_sets = max(1, -(-rotate // set_bytes))  # the inputs alone cover `rotate`
            xs = [torch.randn(R, C, device="cuda", dtype=tdt) for _ in range(n_sets)]
            dsts = [torch.empty_like(x) for x in xs]
            copies = Rotation([lambda x=x, d=d: d.copy_(x) for x, d in zip(xs, dsts)])
            t_copy = time_it(copies, stream, a.reps)
            copy_gbps = 2 * set_bytes / t_copy / 1e9
            del dsts
            for op in a.ops:
                if op == "mid_mean" and R % MID:
                    continue
                args = tensors_for(op, R, C, dtype)
                fused = propose_row_fused(args) if a.row_fused else None
                kern = tc.build(args, plan=fused.plan if fused is not None else "auto")
                n_vec = sum(1 for t in args[1:] if t.is_placeholder)
                sets = []
                for x in xs:
                    xin = x.view(MID, R // MID, C) if op == "mid_mean" else x
                    inputs = [xin] + [torch.randn(C, device="cuda", dtype=tdt) for _ in range(n_vec)]
                    outs = [torch.empty(tuple(int(s) for s in t.shape), device="cuda", dtype=tdt)
                            for t in args if not t.is_placeholder]
                    kern._executor = CudaExecutor(kern.host, kern.cubin, stream=stream)  # no launch-cache hit
                    sets.append((inputs, outs, direct_launcher(kern, [*inputs, *outs])))
                torch.cuda.synchronize()
                inputs, outs, _ = sets[0]
                ref = ref_ops[op](*[i.double() for i in inputs])
                err = ((outs[0].double() - ref).abs() / (ref.abs() + 1.0)).max().item()
                del ref
                nbytes = sum(i.numel() * i.element_size() for i in inputs) + sum(
                    o.numel() * o.element_size() for o in outs)
                t_tecc = time_it(Rotation([s[2] for s in sets]), stream, a.reps)
                eager = ref_ops[op]
                t_eager = time_it(Rotation([lambda i=s[0]: eager(*i) for s in sets]), stream, a.reps)
                t_comp = None
                if (not a.no_compile and time.time() - t_start < a.budget_s
                        and (a.compile_ops is None or op in a.compile_ops)):
                    try:
                        comp = torch.compile(eager, dynamic=False)
                        t_comp = time_it(Rotation([lambda i=s[0]: comp(*i) for s in sets]), stream, a.reps)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"# torch.compile failed for {op}: {type(exc).__name__}: {exc}"[:300])
                gb = lambda t: nbytes / t / 1e9  # noqa: E731
                comp_txt = f"{gb(t_comp):.0f}" if t_comp else "-"
                vs = f"{t_comp / t_tecc:.2f}x" if t_comp else "-"
                regs = "/".join(str(getattr(kern.resources.get(k.name), "registers", "?")) for k in kern.module.kernels)
                plan = "; ".join(f"{st.primitive}({', '.join(f'{a}={v}' for a, v in st.args.items())})"
                                 for st in kern.plan.steps)
                if kern.planning is not None:  # the per-kernel planner: its strategies' own labels
                    plan = "; ".join(kp.chosen.label for kp in kern.planning.kernels)
                print(f"| {op} | {R}x{C} | {dtype} | {gb(t_tecc):.0f} | {gb(t_eager):.0f} | {comp_txt} | "
                      f"{copy_gbps:.0f} | {100 * gb(t_tecc) / copy_gbps:.0f}% | {vs} | {err:.1e} | "
                      f"{plan}, {regs} regs |", flush=True)
                del sets, inputs, outs
            del xs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
