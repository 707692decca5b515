"""Planner regret on the GPU: the planner's pick against its next-ranked alternatives, measured.

    python benchmarks/planner_regret.py [--quick] [--top 6] [--grids gemm,attention,conv]
                                        [--budget 420] [--out benchmarks/results/planner_regret.json]

For every problem of the three grids -- the GEMM shapes of benchmarks/gemm.py in float32,
float16 and bfloat16, the attention shapes of benchmarks/attention.py (S = 1k .. 16k, d = 64 and
128, causal and not, B = 16384 / S, H = 2048 / d, fp16), the ResNet-50 layers of
benchmarks/conv.py in float16 and float32 -- the planner plans for the live GPU (its Target, the
build's compile check) and ranks its candidates; the pick and the next `--top` - 1 candidates of
the ranking (the graph-level points of a rewrite that won, or the per-kernel points of the
program's one kernel), each realized as a plan, are built (NVRTC in a pool of processes first, so
the builds hit the compile cache), checked against torch in float64, and timed by kernel time
(CUPTI's durations of the call's kernels through torch.profiler, mean over the timed calls). Regret =
pick / best measured - 1 per problem; the table prints it with the pick, the best measured
candidate, both predictions and the rank the model gave the best; the JSON (`--out`) keeps every
candidate's prediction and time. `--quick` takes a subset (3 GEMM shapes, 6 attention shapes, 3
layers per dtype) and 4 candidates; `--budget` bounds the run: planning stops after 40% of it
(the problems left out are said), timing stops starting new problems after all of it (the full
run is sized for < 8 minutes on an H200 with its 16 cores compiling in a pool).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from functools import partial  # noqa: E402

from gemm import SHAPES, matmul_tensors, time_kernels  # noqa: E402  (benchmarks/gemm.py)
from gemm_small import device_us  # noqa: E402  (benchmarks/gemm_small.py: CUPTI kernel durations)


@dataclass
class Candidate:
    label: str
    plan: Any
    predicted_us: float
    rank: int
    pick: bool = False
    measured_us: float = math.nan
    rel_err: float = math.nan
    error: str = ""


@dataclass
class Problem:
    grid: str
    name: str
    factory: Callable[[], list[Any]]                 # the tensors (module-level, picklable for the pool)
    inputs: Callable[[], tuple[list[Any], Any]]     # torch inputs (outputs last) and a float64 reference
    candidates: list[Candidate] = field(default_factory=list)
    plan_seconds: float = 0.0


# ---- the grids -----------------------------------------------------------------------------------

def gemm_problems(quick: bool) -> list[Problem]:
    import torch

    shapes = [SHAPES[0], SHAPES[2], SHAPES[6]] if quick else SHAPES
    out = []
    for batch, m, n, k, _ in shapes:
        for dtype in ("float32", "float16", "bfloat16"):
            tdt = getattr(torch, dtype)

            def inputs(batch: int = batch, m: int = m, n: int = n, k: int = k, tdt: Any = tdt) -> tuple[list[Any], Any]:
                lead = (batch,) if batch > 1 else ()
                a = torch.randn(*lead, m, k, device="cuda").to(tdt)
                b = torch.randn(*lead, k, n, device="cuda").to(tdt)
                c = torch.full((*lead, m, n), float("nan"), device="cuda", dtype=tdt)
                return [a, b, c], (a.double() @ b.double())
            out.append(Problem("gemm", f"{dtype} {batch}x{m}x{n}x{k}", partial(matmul_tensors, batch, m, n, k, dtype),
                               inputs))
    return out


def attention_problems(quick: bool) -> list[Problem]:
    import torch

    from attention import attention_tensors

    grid = [(s, d, c) for d in (64, 128) for s in (1024, 2048, 4096, 8192, 16384) for c in (False, True)]
    if quick:
        grid = [(s, d, c) for d in (64, 128) for s, c in ((1024, False), (4096, True), (8192, False))]
    out = []
    for s, d, causal in grid:
        b, h = max(1, 16384 // s), 2048 // d

        def inputs(s: int = s, d: int = d, b: int = b, h: int = h, causal: bool = causal) -> tuple[list[Any], Any]:
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
            o = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=torch.float16)
            bq = max(1, min(b, (1 << 22) // (s * s)))
            ref = torch.nn.functional.scaled_dot_product_attention(q[:bq, :2].double(), k[:bq, :2].double(),
                                                                   v[:bq, :2].double(), is_causal=causal)
            return [q, k, v, o], (ref, bq)
        out.append(Problem("attention", f"S={s} d={d}{' causal' if causal else ''}",
                           partial(attention_tensors, b, h, s, d, "float16", causal), inputs))
    return out


def conv_problems(quick: bool) -> list[Problem]:
    import torch
    import torch.nn.functional as F

    from conv import LAYERS, conv_tensors

    layers = [LAYERS[0], LAYERS[2], LAYERS[4]] if quick else LAYERS
    out = []
    for layer in layers:
        n, h, w, c, f, r, stride = layer
        for dtype in ("float16", "float32"):
            tdt = getattr(torch, dtype)

            def inputs(n: int = n, h: int = h, w: int = w, c: int = c, f: int = f, r: int = r, stride: int = stride,
                       tdt: Any = tdt) -> tuple[list[Any], Any]:
                pad = r // 2
                x = torch.randn(n, h, w, c, device="cuda").to(tdt)
                wt = torch.randn(f, c, r, r, device="cuda").to(tdt)
                p, q = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
                y = torch.full((n, p, q, f), float("nan"), device="cuda", dtype=tdt)
                ref = F.conv2d(x.permute(0, 3, 1, 2).double(), wt.double(), stride=stride, padding=pad).permute(0, 2, 3, 1)
                return [x, wt.permute(2, 3, 1, 0).contiguous(), y], ref
            out.append(Problem("conv", f"{dtype} " + "x".join(map(str, layer)), partial(conv_tensors, *layer, dtype),
                               inputs))
    return out


# ---- the planner's pick and its alternatives -------------------------------------------------------

def rank_candidates(problem: Problem, target: Any, top: int) -> None:
    """The pick and the next top - 1 candidates of the planner's ranking, each as a plan."""
    from tecc.compiler.pipeline import refuse_spills
    from tecc.compiler.planner import plan_program
    from tecc.compiler.schedule import Schedule
    from tecc.ir.errors import ScheduleError

    args = problem.factory()
    start = time.perf_counter()
    result = plan_program(args, target, keep=top + 8, compile_check=refuse_spills)
    problem.plan_seconds = time.perf_counter() - start
    program = result.program
    assert program is not None
    group = result.group
    pick_label = group.chosen.label if group is not None and group.chosen is not None else \
        "; ".join(kp.chosen.label for kp in result.kernels)
    problem.candidates.append(Candidate(pick_label, result.plan, result.predicted_seconds * 1e6, 0, pick=True))
    if group is not None and group.chosen is not None:
        ranked = [(c, None) for c in group.ranked if c.failed is None]
    elif len(result.kernels) == 1:
        ranked = [(c, result.kernels[0]) for c in result.kernels[0].ranked
                  if c.failed is None and not c.strategy.uses_default_schedule]
    else:
        ranked = []        # several kernels planned per kernel: the pick alone
    for rank, (cand, kp) in enumerate(ranked):
        if len(problem.candidates) >= top:
            break
        if cand.label == pick_label:
            continue
        sch = Schedule(program.args, name=program.name, lowered=program.module)
        try:
            cand.strategy.apply(sch, program if kp is None else kp.info, cand.point)  # type: ignore[arg-type]
        except ScheduleError:
            continue
        problem.candidates.append(Candidate(cand.label, sch.plan, cand.cost.total * 1e6, rank))


def _build_job(factory: Any, plan_json: str, arch: str) -> str:
    """Worker: build one candidate for `arch` (the compile cache keeps its cubin); "" or the error."""
    import tecc as tc
    from tecc.compiler.plan import Plan

    try:
        tc.build(factory(), plan=Plan.from_json(plan_json), arch=arch)
    except Exception as exc:  # noqa: BLE001 - reported with the candidate
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return ""


def precompile(problems: list[Problem], arch: str, workers: int) -> None:
    """Schedule and compile every candidate in a pool of spawned processes (a fork would copy the
    CUDA context): the builds of `measure` then hit the compile cache."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(c, (p.factory, c.plan.to_json(), arch)) for p in problems for c in p.candidates]
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [(c, pool.submit(_build_job, *job)) for c, job in jobs]
        for c, future in futures:
            c.error = future.result()


def measure(problem: Problem) -> None:
    """Build, check against the float64 reference and time every candidate."""
    import torch

    import tecc as tc

    args = problem.factory()
    tensors, ref = problem.inputs()
    for c in problem.candidates:
        if c.error:
            continue
        try:
            kern = tc.build(args, plan=c.plan)
            out = tensors[-1]
            out.fill_(float("nan"))
            kern(*tensors)
            torch.cuda.synchronize()
            if problem.grid == "attention":
                full, bq = ref
                got = out[:bq, :2].double()
                c.rel_err = float(((got - full).abs() / (1 + full.abs())).max())
            else:
                c.rel_err = float((out.double() - ref).abs().max() / ref.abs().max())
            first = time_kernels(lambda: kern(*tensors), 3)
            reps = max(5, min(50, int(0.05 / max(first, 1e-6))))
            # the kernels' own durations as CUPTI records them: events around a launch also count
            # the host's launch work when the GPU waits for it (a TMA kernel's tensor maps)
            c.measured_us = device_us(lambda: kern(*tensors), reps)
        except Exception as exc:  # noqa: BLE001 - a candidate that fails to build or run is reported, the rest go on
            c.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def regret(problem: Problem) -> dict[str, Any]:
    timed = [c for c in problem.candidates if math.isfinite(c.measured_us) and not c.error]
    pick = next((c for c in problem.candidates if c.pick), None)
    row: dict[str, Any] = {"grid": problem.grid, "problem": problem.name, "plan_s": problem.plan_seconds,
                           "candidates": [c.__dict__ | {"plan": c.plan.to_dict()} for c in problem.candidates]}
    if pick is None or pick not in timed:
        row["regret"] = math.nan
        return row
    best = min(timed, key=lambda c: c.measured_us)
    row.update(regret=pick.measured_us / best.measured_us - 1.0, pick=pick.label, pick_us=pick.measured_us,
               pick_predicted_us=pick.predicted_us, best=best.label, best_us=best.measured_us,
               best_predicted_us=best.predicted_us, best_rank=best.rank, timed=len(timed))
    return row


def main() -> None:
    import tecc as tc

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--top", type=int, default=6, help="the pick and this many - 1 next-ranked candidates")
    ap.add_argument("--grids", default="gemm,attention,conv")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which no new problem starts")
    ap.add_argument("--workers", type=int, default=0, help="compile processes (default: the CPU count)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner_regret.json"))
    opts = ap.parse_args()
    top = min(opts.top, 4) if opts.quick else opts.top
    start = time.perf_counter()
    target = tc.target.from_device()
    makers = {"gemm": gemm_problems, "attention": attention_problems, "conv": conv_problems}
    problems = [p for g in opts.grids.split(",") for p in makers[g](opts.quick)]
    planned: list[Problem] = []
    for p in problems:
        if time.perf_counter() - start > opts.budget * 0.4:
            print(f"planning budget spent: {len(problems) - len(planned)} problem(s) left out", flush=True)
            break
        rank_candidates(p, target, top)
        planned.append(p)
        print(f"planned {p.grid} {p.name}: {len(p.candidates)} candidates ({p.plan_seconds:.1f} s)", flush=True)
    import os

    precompile(planned, target.arch, opts.workers or os.cpu_count() or 1)
    print(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    for p in planned:
        if time.perf_counter() - start > opts.budget:
            print(f"budget spent before {p.grid} {p.name}", flush=True)
            break
        measure(p)
        rows.append(regret(p))
        r = rows[-1]
        print(f"{p.grid:9s} {p.name:28s} regret {100 * r['regret']:6.1f}%  pick {r.get('pick_us', math.nan):9.1f} us "
              f"({r.get('pick', '?')})  best {r.get('best_us', math.nan):9.1f} us (rank {r.get('best_rank', '?')}: "
              f"{r.get('best', '?')})", flush=True)
    by_grid: dict[str, list[float]] = {}
    for r in rows:
        if math.isfinite(r["regret"]):
            by_grid.setdefault(r["grid"], []).append(r["regret"])
    print("\n| grid | problems | mean regret | worst | within 5% |\n| --- | --- | --- | --- | --- |")
    for grid, values in by_grid.items():
        print(f"| {grid} | {len(values)} | {100 * sum(values) / len(values):.1f}% | {100 * max(values):.1f}% | "
              f"{sum(v <= 0.05 for v in values)} / {len(values)} |")
    errors = [(r["problem"], c["label"], c["rel_err"]) for r in rows for c in r["candidates"]
              if math.isfinite(c["rel_err"]) and c["rel_err"] > 2e-2]
    if errors:
        print("candidates off the float64 reference by more than 2e-2:", errors)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps({"device": target.name, "top": top, "seconds": time.perf_counter() - start,
                                          "rows": rows}, indent=1, default=str))
    print(f"wrote {opts.out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
