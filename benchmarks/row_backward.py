"""Row-op backwards (tc.grad of the user's forward) against torch eager and torch.compile.

    python benchmarks/row_backward.py [--rows 8192] [--widths 768 1024 4096 8192] [--vocab 50304]
                                      [--ops ce ln rms softmax] [--dtypes float32 bfloat16] [--budget-s 200]

All in this process on one stream, CUDA-event medians of --reps, every timed call taking the
next of N input sets that together cover 3 x L2 (inputs from DRAM, memory_bound.py's timing):

- ln / rms: layer norm / RMS norm forward + backward (dX, dγ[, dβ]) for rows x widths. tecc: the
  forward that saves the row statistics (`tc.grad(..., save=[mu, var])`'s `forward`, one kernel)
  then the backward (`Gradients.args`: one row kernel that also sums dγ, dβ, and a combine
  kernel); "recompute": the plain forward and the backward that recomputes the statistics.
  torch: F.layer_norm / an RMS norm written in torch, then torch.autograd.grad.
- softmax: the backward alone (dX from the logits' softmax and dY). tecc: tc.grad of softmax,
  which reads X and dY (the forward's max and sum recomputed in registers); torch:
  _softmax_backward_data(dY, Y) and torch.compile of y * (dy - Σ dy·y), which read Y and dY:
  the same bytes.
- ce: cross-entropy over a vocabulary (rows x --vocab logits, int32 targets, per-row losses and
  an upstream gradient per row), forward + backward. tecc: the loss and dX as ONE program
  (`tc.grad(loss, [X]).forward_backward`: the upstream gradient of a loss is known before its
  forward runs), one row kernel reading the logits once; "alt": the forward that keeps (max,
  Σ exp) per row, then the elementwise backward pass (two kernels, the logits read twice);
  torch: F.cross_entropy(reduction="none"), then torch.autograd.grad; "compile joint":
  torch.compile of the same one-program step written out in torch (loss and dX from the
  logits, the targets and the upstream gradient), the fair reference for tecc's one program.

torch's fwd+bwd steps are captured in a CUDA graph per input set and replayed (the step's GPU
time, without autograd's host overhead), falling back to plain calls when capture fails (said
in the table). tecc's launches are replayed through cuda.core without per-call checks
(memory_bound.direct_launcher). GB/s = the minimal bytes (fwd: inputs read, outputs written;
bwd: X and dY read, dX written; ce: the logits read once, dX written; small vectors not
counted) / time; "tecc MB" = what tecc's kernels move (the minimal bytes, the logits' second
read of "alt" not counted, plus the column sums' partial rows written and read again).
"vs compile" = torch.compile time / tecc time (the issue's target: >= 1.2 for ln and ce),
"vs best" = fastest torch / tecc. Every tecc result is checked against torch in float64 first
(max relative error printed). torch.compile is skipped (shown "-") once --budget-s seconds
have passed.

--points: for ln / rms, also the backward alone at other plans of its row kernel (the planned
point; the same without the next-row prefetch, column sums in registers, at the blocks per SM
that leaves: the plan before the prefetch; and where the plan stages the next row in shared
memory, the next row in registers instead: the plan before the staging), one line each; for ce,
the one program at the plan before its straight-line walk (8-byte vectors, every step testing
the row's end: the 1183 us bf16 point).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

from memory_bound import Rotation, direct_launcher, time_it  # noqa: E402
import row_backward as rb  # noqa: E402

import tecc as tc  # noqa: E402
from tecc.runtime.cuda import CudaExecutor  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EPS = rb.EPS
# --sim: the emulator on CPU tensors, small shapes, the checks only (what this machine can run
# without a GPU: it checks the argument orders and references before a GPU run)
DEVICE = "cuda"
TARGET = "cuda"


def build(args):
    kernel = tc.build(args, target=TARGET)
    if TARGET != "sim":
        return kernel
    return _SimKernel(kernel)


class _SimKernel:
    """An emulator kernel called on CPU torch tensors: NumPy views of them, written in place."""

    def __init__(self, kernel):
        self.kernel, self.module, self.plan = kernel, kernel.module, kernel.plan

    def __call__(self, *args):
        import ml_dtypes

        views = [a.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16) if a.dtype == torch.bfloat16
                 else a.detach().numpy() for a in args]
        self.kernel(*views)


# ---- torch references ---------------------------------------------------------------------------

def torch_ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def torch_rms(x, w):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def torch_softmax_bwd(y, dy):
    yf, dyf = y.float(), dy.float()
    return (yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)


def torch_softmax_bwd_eager(y, dy):
    return torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)


def torch_ce(x, t):
    return F.cross_entropy(x, t, reduction="none")


def torch_ce_joint(x, t, dl):
    """The loss and dX of cross-entropy for the upstream gradient dl, written as one function
    (what tecc's forward_backward program computes), in float32 like tecc's arithmetic."""
    xf = x.float()
    m = xf.amax(-1, keepdim=True)
    e = torch.exp(xf - m)
    s = e.sum(-1, keepdim=True)
    onehot = torch.arange(x.shape[-1], device=x.device)[None, :] == t[:, None]
    loss = (m + s.log()).squeeze(-1) - torch.where(onehot, xf, 0.0).sum(-1)
    dx = (dl[:, None] * (e / s - onehot.float())).to(x.dtype)
    return loss, dx


def fwd_bwd(fn, n_grad):
    """A step: fn's forward on the leading inputs, then the gradients of its first n_grad inputs
    for the cotangent given last."""

    def step(*args):
        *ins, cot = args
        out = fn(*ins)
        return torch.autograd.grad(out, ins[:n_grad], cot)

    return step


def graphed(step, sets):
    """One replayable CUDA graph of `step` per argument set, or plain calls if capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                for args in sets:
                    step(*args)
        torch.cuda.current_stream().wait_stream(s)
        graphs = []
        for args in sets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step(*args)
            graphs.append(g.replay)
        return Rotation(graphs), "graph"
    except Exception as exc:  # noqa: BLE001 - some torch versions cannot capture a compiled backward
        torch.cuda.synchronize()
        return Rotation([lambda a=a: step(*a) for a in sets]), f"calls ({type(exc).__name__})"


# ---- tecc ---------------------------------------------------------------------------------------

def tecc_runs(kernel, sets, stream):
    if TARGET == "sim":
        return [lambda a=a: kernel(*a) for a in sets]
    runs = []
    for args in sets:
        kernel._executor = CudaExecutor(kernel.host, kernel.cubin, stream=stream)
        runs.append(direct_launcher(kernel, args))
    return runs


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def chained(*rotations):
    return Rotation([lambda fs=fs: [f() for f in fs] for fs in zip(*[r.fns for r in rotations])])


def rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# ---- the cases ----------------------------------------------------------------------------------

def norm_case(op, R, C, dtype, n_sets, stream):
    """(tecc fwd+bwd run, tecc recompute run, torch step and its sets, bytes, check error, plans)."""
    tdt = TORCH_DTYPES[dtype]
    save = rb.layer_norm_backward(R, C, dtype, save=True) if op == "ln" else rb.rms_norm_backward(R, C, dtype, save=True)
    plain = rb.layer_norm_backward(R, C, dtype) if op == "ln" else rb.rms_norm_backward(R, C, dtype)
    n_par = 2 if op == "ln" else 1
    fwd, bwd = build(list(save.forward)), build(save.args)
    fwd0, bwd0 = build(list(plain.forward)), build(plain.args)
    sets = []
    for _ in range(n_sets):
        x = torch.randn(R, C, device=DEVICE, dtype=tdt)
        params = [torch.randn(C, device=DEVICE, dtype=tdt) for _ in range(n_par)]
        dy = torch.randn(R, C, device=DEVICE, dtype=tdt)
        y = torch.empty_like(x)
        stats = [torch.empty(R, device=DEVICE, dtype=torch.float32) for _ in save.saved]
        grads = [torch.empty_like(x)] + [torch.empty_like(p) for p in params]
        sets.append((x, params, dy, y, stats, grads))
    f_runs = tecc_runs(fwd, [[x, *p, y, *st] for x, p, dy, y, st, gr in sets], stream)
    b_runs = tecc_runs(bwd, [[x, *p, *st, dy, *gr] for x, p, dy, y, st, gr in sets], stream)
    f0_runs = tecc_runs(fwd0, [[x, *p, y] for x, p, dy, y, st, gr in sets], stream)
    b0_runs = tecc_runs(bwd0, [[x, *p, dy, *gr] for x, p, dy, y, st, gr in sets], stream)
    # check: the saved form once, against torch in float64
    x, p, dy, y, st, gr = sets[0]
    fwd(x, *p, y, *st)
    bwd(x, *p, *st, dy, *gr)
    sync()
    ref_in = [x.double().requires_grad_(), *[q.double().requires_grad_() for q in p]]
    ref_out = torch_ln(*ref_in) if op == "ln" else torch_rms(*ref_in)
    want = torch.autograd.grad(ref_out, ref_in, dy.double())
    err = max([rel_err(y, ref_out.detach())] + [rel_err(g, w) for g, w in zip(gr, want)])
    ref_fn = torch_ln if op == "ln" else torch_rms
    torch_sets = [(x.requires_grad_(), *[q.requires_grad_() for q in p], dy) for x, p, dy, y, st, gr in sets]
    nbytes = x.element_size() * R * C * 5  # fwd: X, Y; bwd: X, dY, dX
    return Case(chained(Rotation(f_runs), Rotation(b_runs)), chained(Rotation(f0_runs), Rotation(b0_runs)),
                fwd_bwd(ref_fn, 1 + n_par), fwd_bwd(torch.compile(ref_fn, dynamic=False), 1 + n_par), torch_sets,
                nbytes, err, f"{_plan(fwd)} + {_plan(bwd)}", nbytes + partial_bytes(bwd))


def norm_points(op, R, C, dtype, n_sets, stream, reps):
    """The backward alone (saved statistics) at its planned row-kernel point, at the point
    without the next-row prefetch, and where the plan stages the next row in shared memory, with
    it in registers instead (module docstring, --points): (label, seconds, bytes, plan)."""
    from tecc.compiler.plan import Plan, Step
    from tecc.compiler.strategies.row_fused import column_resident
    from tecc.compiler.planner import resolve_target

    tdt = TORCH_DTYPES[dtype]
    g = rb.layer_norm_backward(R, C, dtype, save=True) if op == "ln" else rb.rms_norm_backward(R, C, dtype, save=True)
    planned = build(g.args)
    step = dict(planned.plan.steps[0].args)
    tgt = resolve_target(None)
    elements = -(-C // (step["threads"] * step.get("vector", 1))) * step.get("vector", 1)
    arrays, sums = 2, len(g.grads) - 1
    resident = min(4, column_resident(step["threads"], elements * (arrays + sums), "local", 0, tgt)) or 1
    before = {k: v for k, v in step.items() if k not in ("prefetch", "column_sums", "prefetch_into")}
    before["row_blocks"] = min(R, tgt.sm_count * resident)
    points = [("planned", planned), ("no prefetch", build_plan(g.args, Plan((Step("fuse_rows", before),),
                                                                               "row_fused", "no prefetch")))]
    if step.get("prefetch_into") == "shared":  # the plan before the staged row: the next row in registers
        ahead = {k: v for k, v in step.items() if k != "prefetch_into"}
        if column_resident(step["threads"], elements * (2 * arrays + sums), "local", 0, tgt) < resident:
            ahead["column_sums"] = "shared"
        points.append(("ahead in registers", build_plan(g.args, Plan((Step("fuse_rows", ahead),), "row_fused", ""))))
    sets = []
    for _ in range(n_sets):
        x = torch.randn(R, C, device=DEVICE, dtype=tdt)
        params = [torch.randn(C, device=DEVICE, dtype=tdt) for _ in g.grads[1:]]
        stats = [torch.rand(R, device=DEVICE, dtype=torch.float32) + 0.5 for _ in g.saved]
        dy = torch.randn(R, C, device=DEVICE, dtype=tdt)
        sets.append([x, *params, *stats, dy, torch.empty_like(x), *[torch.empty_like(q) for q in params]])
    out = []
    for label, k in points:
        runs = Rotation(tecc_runs(k, sets, stream))
        t = time_it(runs, stream, reps) if TARGET != "sim" else (runs(), float("nan"))[1]
        out.append((label, t, 3 * x.element_size() * R * C + partial_bytes(k), _plan(k)))
    return out


def ce_points(R, V, dtype, n_sets, stream, reps):
    """Cross-entropy's one program at its planned point and at the plan before the straight-line
    walk (its build fallback: 8-byte vectors, every step testing the row's end), --points:
    (label, seconds, bytes, plan)."""
    from tecc.compiler.strategies.row_fused import propose

    tdt = TORCH_DTYPES[dtype]
    args = rb.cross_entropy_forward_backward(R, V, dtype)
    choice = propose(args)
    points = [("planned", build(args))] + [("every step tested", build_plan(args, p)) for p in choice.fallbacks]
    sets = []
    for _ in range(n_sets):
        x = torch.randn(R, V, device=DEVICE, dtype=tdt) * 2
        t = torch.randint(0, V, (R,), device=DEVICE, dtype=torch.int32)
        sets.append([x, t, torch.randn(R, device=DEVICE, dtype=torch.float32),
                     torch.empty(R, device=DEVICE, dtype=torch.float32), torch.empty_like(x)])
    out = []
    for label, k in points:
        runs = Rotation(tecc_runs(k, sets, stream))
        t = time_it(runs, stream, reps) if TARGET != "sim" else (runs(), float("nan"))[1]
        out.append((label, t, 2 * sets[0][0].element_size() * R * V, _plan(k)))
    return out


def build_plan(args, plan):
    kernel = tc.build(args, target=TARGET, plan=plan)
    return kernel if TARGET != "sim" else _SimKernel(kernel)


def softmax_case(R, C, dtype, n_sets, stream):
    tdt = TORCH_DTYPES[dtype]
    g = rb.softmax_backward(R, C, dtype)
    bwd = build(g.args)
    sets = []
    for _ in range(n_sets):
        x = torch.randn(R, C, device=DEVICE, dtype=tdt) * 3
        dy = torch.randn(R, C, device=DEVICE, dtype=tdt)
        sets.append((x, torch.softmax(x.float(), -1).to(tdt), dy, torch.empty_like(x)))
    runs = tecc_runs(bwd, [[x, dy, dx] for x, y, dy, dx in sets], stream)
    x, y, dy, dx = sets[0]
    bwd(x, dy, dx)
    sync()
    yd = torch.softmax(x.double(), -1)
    err = rel_err(dx, yd * (dy.double() - (dy.double() * yd).sum(-1, keepdim=True)))
    nbytes = x.element_size() * R * C * 3
    return Case(Rotation(runs), None, torch_softmax_bwd_eager, torch.compile(torch_softmax_bwd, dynamic=False),
                [(y, dy) for x, y, dy, dx in sets], nbytes, err, _plan(bwd), nbytes)


def ce_case(R, V, dtype, n_sets, stream):
    tdt = TORCH_DTYPES[dtype]
    g = rb.cross_entropy_backward(R, V, dtype)
    joint_args = rb.cross_entropy_forward_backward(R, V, dtype)
    joint, fwd, bwd = build(joint_args), build(list(g.forward)), build(g.args)
    sets = []
    for _ in range(n_sets):
        x = torch.randn(R, V, device=DEVICE, dtype=tdt) * 2
        t = torch.randint(0, V, (R,), device=DEVICE, dtype=torch.int32)
        dl = torch.randn(R, device=DEVICE, dtype=torch.float32)  # tecc's per-row loss is float32
        outs = [torch.empty(R, device=DEVICE, dtype=torch.float32) for _ in range(3)]
        sets.append((x, t, dl, outs, torch.empty_like(x)))
    j_runs = tecc_runs(joint, [[x, t, dl, o[0], dx] for x, t, dl, o, dx in sets], stream)
    f_runs = tecc_runs(fwd, [[x, t, *o] for x, t, dl, o, dx in sets], stream)
    b_runs = tecc_runs(bwd, [[x, t, o[1], o[2], dl, dx] for x, t, dl, o, dx in sets], stream)
    x, t, dl, o, dx = sets[0]
    xd = x.double().requires_grad_()
    loss = F.cross_entropy(xd, t.long(), reduction="none")
    (want,) = torch.autograd.grad(loss, [xd], dl.double())
    err = 0.0
    for run in (lambda: joint(x, t, dl, o[0], dx), lambda: (fwd(x, t, *o), bwd(x, t, o[1], o[2], dl, dx))):
        o[0].fill_(float("nan"))
        dx.fill_(float("nan"))
        run()
        sync()
        err = max(err, rel_err(o[0], loss.detach()), rel_err(dx, want))
    # torch's loss is in the logits' dtype (its upstream gradient too); targets as int64
    torch_sets = [(x.requires_grad_(), t.long(), dl.to(tdt)) for x, t, dl, o, dx in sets]
    joint_sets = [(x.detach(), t.long(), dl) for x, t, dl, o, dx in sets]
    nbytes = x.element_size() * R * V * 2  # the logits read, dX written
    return Case(Rotation(j_runs), chained(Rotation(f_runs), Rotation(b_runs)), fwd_bwd(torch_ce, 1),
                fwd_bwd(torch.compile(torch_ce, dynamic=False), 1), torch_sets, nbytes, err,
                f"{_plan(joint)}; alt {_plan(fwd)} + {_plan(bwd)}", nbytes,
                torch.compile(torch_ce_joint, dynamic=False), joint_sets)


@dataclass
class Case:
    tecc: Rotation                 # tecc's fwd(+bwd) launches, one set per call
    recompute: Rotation | None     # the alternative: without saved statistics (norms), two kernels (ce)
    eager: Any                     # torch's step on one torch set
    compiled: Any                  # the torch.compile'd step
    torch_sets: list
    nbytes: int
    err: float
    plan: str
    tecc_bytes: int = 0            # what tecc's kernels move (module docstring)
    compiled_joint: Any = None     # torch.compile of the one-program step (ce)
    joint_sets: list | None = None


def _plan(k):
    steps = [s for s in k.plan.steps if s.primitive == "fuse_rows"]
    how = ", ".join(f"{k_}={v}" for k_, v in steps[0].args.items()) if steps else k.plan.strategy
    return f"{len(k.module.kernels)} kernel(s) ({how})"


def partial_bytes(k) -> int:
    """The column sums' partial rows of a built backward: written by the row kernel, read by the
    combine kernel (float32, row_blocks x columns per column reduction)."""
    return sum(8 * size for t in k.module.temps for size in [_numel(t.shape)])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---- main ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--widths", type=int, nargs="+", default=[768, 1024, 4096, 8192])
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--ops", nargs="+", default=["ce", "ln", "rms", "softmax"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--points", action="store_true", help="ln / rms: the backward alone at other row-kernel plans")
    ap.add_argument("--sim", action="store_true", help="check only, in the emulator on CPU tensors (no GPU)")
    a = ap.parse_args()
    if a.sim:
        return check_in_emulator(a)
    t0 = time.time()
    stream = torch.cuda.current_stream()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; rows {a.rows}; CUDA-event medians "
          f"of {a.reps}, inputs from DRAM (sets covering 3 x L2)")
    print("| op | shape | dtype | tecc us | tecc GB/s | tecc MB | alt us | torch us | torch.compile us | "
          "compile joint us | vs compile | vs best | max rel err | torch timing | tecc plan |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    point_lines = []
    for op in a.ops:
        for dtype in a.dtypes:
            for C in ([a.vocab] if op == "ce" else a.widths):
                row_bytes = C * torch.tensor([], dtype=TORCH_DTYPES[dtype]).element_size()
                n_sets = max(1, -(-3 * l2 // (a.rows * row_bytes)))
                maker = {"ln": lambda: norm_case("ln", a.rows, C, dtype, n_sets, stream),
                         "rms": lambda: norm_case("rms", a.rows, C, dtype, n_sets, stream),
                         "ce": lambda: ce_case(a.rows, C, dtype, n_sets, stream),
                         "softmax": lambda: softmax_case(a.rows, C, dtype, n_sets, stream)}[op]
                case = maker()
                t_tecc = time_it(case.tecc, stream, a.reps)
                t_re = time_it(case.recompute, stream, a.reps) if case.recompute is not None else None
                eager_run, how = graphed(case.eager, case.torch_sets)
                t_eager = time_it(eager_run, stream, a.reps)
                t_comp = None
                if not a.no_compile and time.time() - t0 < a.budget_s:
                    try:
                        comp_run, how_c = graphed(case.compiled, case.torch_sets)
                        how = f"{how} / {how_c}"
                        t_comp = time_it(comp_run, stream, a.reps)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"# torch.compile failed for {op} {dtype} {C}: {type(exc).__name__}: {exc}"[:300])
                t_joint = None
                if case.compiled_joint is not None and not a.no_compile and time.time() - t0 < a.budget_s:
                    try:
                        t_joint = time_it(Rotation([lambda s=s: case.compiled_joint(*s) for s in case.joint_sets]),
                                          stream, a.reps)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"# torch.compile of the joint step failed for {op} {dtype}: {exc}"[:300])
                best = min(t for t in (t_eager, t_comp, t_joint) if t)
                us = lambda t: f"{t * 1e6:.1f}" if t else "-"  # noqa: E731
                vs_c = f"{t_comp / t_tecc:.2f}x" if t_comp else "-"
                print(f"| {op} | {a.rows}x{C} | {dtype} | {us(t_tecc)} | {case.nbytes / t_tecc / 1e9:.0f} | "
                      f"{case.tecc_bytes / 1e6:.0f} | {us(t_re)} | {us(t_eager)} | {us(t_comp)} | {us(t_joint)} | {vs_c} | "
                      f"{best / t_tecc:.2f}x | {case.err:.1e} | {how} | {case.plan} |", flush=True)
                del case
                if a.points and op in ("ln", "rms", "ce"):
                    points = norm_points if op != "ce" else lambda _op, *rest: ce_points(*rest)
                    for label, t, nb, plan in points(op, a.rows, C, dtype, n_sets, stream, a.reps):
                        point_lines.append(f"| {op} bwd | {a.rows}x{C} | {dtype} | {label} | {t * 1e6:.1f} | "
                                           f"{nb / 1e6:.0f} | {nb / t / 1e9:.0f} | {plan} |")
                torch.cuda.empty_cache()
    if point_lines:
        print("\n| op | shape | dtype | point | us | MB | GB/s | plan |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(point_lines))
    print(f"# {time.time() - t0:.0f} s")


def check_in_emulator(a) -> None:
    global DEVICE, TARGET
    DEVICE, TARGET = "cpu", "sim"
    for op in a.ops:
        for dtype in a.dtypes:
            for C in ([a.vocab] if op == "ce" else a.widths):
                case = {"ln": lambda: norm_case("ln", a.rows, C, dtype, 2, None),
                        "rms": lambda: norm_case("rms", a.rows, C, dtype, 2, None),
                        "ce": lambda: ce_case(a.rows, C, dtype, 2, None),
                        "softmax": lambda: softmax_case(a.rows, C, dtype, 2, None)}[op]()
                case.tecc()
                if case.recompute is not None:
                    case.recompute()
                case.eager(*case.torch_sets[0])
                bound = 2e-5 if dtype == "float32" else 3e-2
                if case.joint_sets is not None:  # the torch one-program reference computes the same
                    x, t, dl = case.joint_sets[0]
                    loss, dx = torch_ce_joint(x, t, dl)
                    xd = x.double().requires_grad_()
                    ref = F.cross_entropy(xd, t, reduction="none")
                    (want,) = torch.autograd.grad(ref, [xd], dl.double())
                    joint_err = max(rel_err(loss, ref.detach()), rel_err(dx, want))
                    assert joint_err < bound, f"torch_ce_joint {dtype}: max rel err {joint_err:.1e}"
                assert case.err < bound, f"{op} {dtype} {C}: max rel err {case.err:.1e}"
                print(f"{op} {a.rows}x{C} {dtype}: max rel err {case.err:.1e}; {case.plan}", flush=True)
                if a.points and op in ("ln", "rms", "ce"):
                    points = norm_points if op != "ce" else lambda _op, *rest: ce_points(*rest)
                    for label, _t, nb, plan in points(op, a.rows, C, dtype, 2, None, 1):
                        print(f"  {label}: {nb / 1e6:.2f} MB; {plan}")


if __name__ == "__main__":
    main()
