"""The cost model's honesty loop: predicted vs measured, over many candidates per op.

    python benchmarks/cost_model.py prepare [--dir build/costbench] [--per-op 60]   # CPU: plan, schedule, NVRTC
    python benchmarks/cost_model.py measure --dir build/costbench --out DIR         # GPU: check, time, occupancy
    python benchmarks/cost_model.py report  --results DIR/results.json              # RESULTS.md section
    python benchmarks/cost_model.py tuned   [--db FILE]                             # the tuning database's figures

`prepare` (no GPU needed) enumerates every candidate (strategy, point) of three ops at
realistic sizes, keeps a spread of `--per-op` valid ones over the predicted ranking (the top 12
and the rest evenly spaced), realizes each through the schedule primitives, compiles it with
NVRTC for the target architecture and saves it as an artifact, recording the predicted time and
terms, the predicted registers and occupancy, and ptxas's register count.

`measure` (on the GPU, needs only tecc's runtime + torch for arrays and events) loads every
artifact, checks its output against torch on random inputs, times it (CUDA events, 3 warm-up
runs, median of 15), asks cuda.core's occupancy calculator for blocks/SM of the compiled kernel,
and writes results.json and RESULTS.md: Kendall tau between predicted and measured time, and
the regret of the model's pick (its measured time over the best measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OPS = ("matmul", "row_sum", "elementwise")


def make_ops() -> dict[str, Any]:
    import tecc as tc

    ops: dict[str, Any] = {}
    M = N = K = 2048
    A = tc.placeholder((M, K), "float32", name="A")
    B = tc.placeholder((K, N), "float32", name="B")
    k = tc.reduce_axis(K, name="k")
    C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    ops["matmul"] = ([A, B, C], {"flops": 2.0 * M * N * K})
    R, Cn = 16384, 4096
    x = tc.placeholder((R, Cn), "float32", name="x")
    c = tc.reduce_axis(Cn, name="c")
    s = tc.compute((R,), lambda r: tc.sum(x[r, c], axis=c), name="row_sum")
    ops["row_sum"] = ([x, s], {"bytes": 4.0 * R * Cn})
    E0, E1 = 8192, 8192
    xe = tc.placeholder((E0, E1), "float32", name="xe")
    a = tc.placeholder((E1,), "float32", name="a")
    y = tc.compute((E0, E1), lambda i, j: xe[i, j] * a[j] + tc.const(1.0, "float32"), name="y")
    ops["elementwise"] = ([xe, a, y], {"bytes": 8.0 * E0 * E1})
    return ops


def _spread(n_valid: int, per_op: int) -> list[int]:
    top = list(range(min(12, n_valid)))
    rest = np.linspace(12, n_valid - 1, max(0, per_op - len(top))).round().astype(int).tolist() if n_valid > 12 else []
    return sorted(set(top + rest))


def prepare(directory: Path, per_op: int, arch: str) -> None:
    from tecc.compiler.planner import candidates_for, build_with_plan
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.plan import Plan, Step
    from tecc.compiler.schedule import Schedule
    from tecc.ir.errors import TeccError
    from tecc.ir.target import target
    from tecc.passes.lower import lower

    tgt = target(arch)
    directory.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"arch": arch, "target": tgt.summary(), "ops": {}}
    for op, (args, _) in make_ops().items():
        t0 = time.perf_counter()
        module = lower(args)
        info = analyze_kernel(module.kernels[0])
        cands, _ = candidates_for(info, tgt)
        valid = sorted((c for c in cands if c.cost.ok), key=lambda c: c.cost.total)
        plan_seconds = time.perf_counter() - t0
        rows = []
        for idx in _spread(len(valid), per_op):
            cand = valid[idx]
            try:
                if cand.strategy.uses_default_schedule:
                    plan = Plan((Step("default_schedule", dict(cand.point)),), cand.strategy.name, cand.label)
                else:
                    sch = Schedule(args)
                    cand.strategy.apply(sch, info, cand.point)
                    plan = Plan(sch.plan.steps, cand.strategy.name, cand.label)
                kernel = build_with_plan(args, plan, "cuda", arch=arch)
            except TeccError as exc:
                print(f"{op} #{idx} {cand.label}: not realizable: {str(exc).splitlines()[0]}", flush=True)
                continue
            stem = directory / op / f"c{idx:04d}"
            kernel.save(stem)
            res = next(iter(kernel.resources.values()))
            launch = kernel.host.kernels[0]
            rows.append({
                "index": idx, "rank": idx, "label": cand.label, "strategy": cand.strategy.name, "point": cand.point,
                "artifact": str(stem.relative_to(directory)), "predicted_s": cand.cost.total,
                "terms": cand.cost.terms, "bound": cand.cost.bound,
                "predicted_registers": cand.workload.register_count, "ptxas_registers": res.registers,
                "ptxas_spills": res.spill_stores + res.spill_loads, "ptxas_smem": res.shared_bytes,
                "predicted_smem": cand.workload.smem_bytes,
                "predicted_blocks_per_sm": cand.cost.occupancy.blocks_per_sm, "threads": cand.workload.threads,
                "block": list(launch.block),
            })
            print(f"{op} #{idx:4d} pred {cand.cost.total * 1e6:9.1f} us regs {cand.workload.register_count:3d}/"
                  f"{res.registers:3d}  {cand.label}", flush=True)
        summary["ops"][op] = {"evaluated": len(cands), "valid": len(valid), "plan_seconds": plan_seconds,
                              "candidates": rows}
    (directory / "candidates.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {directory / 'candidates.json'}")


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two rankings (ties counted as neither concordant nor discordant)."""
    x, y = np.asarray(a), np.asarray(b)
    n = len(x)
    conc = disc = tx = ty = 0
    for i in range(n):
        dx = np.sign(x[i + 1:] - x[i])
        dy = np.sign(y[i + 1:] - y[i])
        conc += int(np.sum(dx * dy > 0))
        disc += int(np.sum(dx * dy < 0))
        tx += int(np.sum((dx == 0) & (dy != 0)))
        ty += int(np.sum((dy == 0) & (dx != 0)))
    denom = np.sqrt(float(conc + disc + tx) * float(conc + disc + ty))
    return float((conc - disc) / denom) if denom else 0.0


def measure(directory: Path, out: Path) -> None:
    import torch

    import tecc
    from tecc.ir.target import from_device
    from tecc.runtime.artifact import load

    out.mkdir(parents=True, exist_ok=True)
    summary = json.loads((directory / "candidates.json").read_text())
    dev = from_device()
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "target": dev.summary(),
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "commit": summary.get("commit", ""), "ops": {}}
    stream = torch.cuda.Stream()
    torch.manual_seed(0)
    for op, block in summary["ops"].items():
        rows = block["candidates"]
        if op == "matmul":
            A = torch.randn(2048, 2048, device="cuda")
            B = torch.randn(2048, 2048, device="cuda")
            C = torch.empty(2048, 2048, device="cuda")
            arrays, outs = [A, B, C], [C]
            ref = [(A.double() @ B.double()).float()]
        elif op == "row_sum":
            x = torch.randn(16384, 4096, device="cuda")
            s = torch.empty(16384, device="cuda")
            arrays, outs, ref = [x, s], [s], [x.double().sum(-1).float()]
        else:
            xe = torch.randn(8192, 8192, device="cuda")
            a = torch.randn(8192, device="cuda")
            y = torch.empty(8192, 8192, device="cuda")
            arrays, outs, ref = [xe, a, y], [y], [xe * a + 1.0]
        for row in rows:
            try:
                f = load(directory / row["artifact"], stream=stream)
                for o in outs:
                    o.fill_(float("nan"))
                torch.cuda.synchronize()
                with torch.cuda.stream(stream):
                    f(*arrays)
                stream.synchronize()
                err = max(float((o.double() - r.double()).norm() / r.double().norm()) for o, r in zip(outs, ref))
                row["rel_error"] = err
                times = []
                for rep in range(18):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record(stream)
                    f(*arrays)
                    e1.record(stream)
                    e1.synchronize()
                    if rep >= 3:
                        times.append(e0.elapsed_time(e1) * 1e-3)
                row["measured_s"] = float(np.median(times))
                row["measured_spread"] = float((max(times) - min(times)) / np.median(times))
                kern = next(iter(f.executor.kernels.values()))
                threads = int(np.prod(row["block"]))
                row["cuda_core_blocks_per_sm"] = int(kern.occupancy.max_active_blocks_per_multiprocessor(threads, 0))
            except Exception as exc:  # noqa: BLE001 - record and go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"{op} #{row['index']:4d} pred {row['predicted_s'] * 1e6:9.1f} us  meas "
                  f"{row.get('measured_s', float('nan')) * 1e6:9.1f} us  err {row.get('rel_error', float('nan')):.1e}  "
                  f"occ {row['predicted_blocks_per_sm']}/{row.get('cuda_core_blocks_per_sm')}  {row['label']}", flush=True)
        results["ops"][op] = dict(block, candidates=rows)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "RESULTS.md").write_text(report_text(results))
    print(report_text(results))


def device_target(results: dict[str, Any]) -> Any:
    """The Target of the measured device, from the summary `measure` recorded (from_device)."""
    import re

    from tecc.ir.target import MiB, target

    text = results.get("target", "")
    tgt = target("sm_90")
    m = re.search(r"DRAM ([0-9.]+) TB/s, L2 ([0-9]+) MiB", text)
    if m:
        tgt = tgt.replace(name=results.get("gpu", "device"), dram_bandwidth=float(m.group(1)) * 1e12,
                          l2_bytes=int(m.group(2)) * MiB)
    return tgt


def repredict(results: dict[str, Any]) -> dict[str, Any]:
    """The measured results with every candidate's prediction recomputed by the current model,
    for the measured device's Target (what `from_device` would give there)."""
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.cost.model import predict
    from tecc.compiler.strategies.registry import get
    from tecc.passes.lower import lower

    tgt = device_target(results)
    ops = make_ops()
    for op, block in results["ops"].items():
        info = analyze_kernel(lower(ops[op][0]).kernels[0])
        for row in block["candidates"]:
            s = get(row["strategy"])
            w = s.workload(info, row["point"], tgt)
            c = predict(w, tgt)
            row["predicted_s_first"] = row["predicted_s"]
            row.update(predicted_s=c.total, terms=c.terms, bound=c.bound, predicted_registers=w.register_count,
                       predicted_blocks_per_sm=c.occupancy.blocks_per_sm)
    results["note"] = f"predictions recomputed by the current model for {tgt.summary()}"
    return results


def op_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "measured_s" in r and r.get("rel_error", 1.0) < 1e-3]
    if not ok:
        return {"n": 0}
    pred = [r["predicted_s"] for r in ok]
    meas = [r["measured_s"] for r in ok]
    pick = min(ok, key=lambda r: r["predicted_s"])
    best = min(ok, key=lambda r: r["measured_s"])
    occ = [r for r in ok if r.get("cuda_core_blocks_per_sm") is not None]
    regs = [(r["predicted_registers"], r["ptxas_registers"]) for r in rows]
    reg_err = [abs(p - q) / q for p, q in regs if q]
    return {
        "n": len(ok), "failed": len(rows) - len(ok), "tau": kendall_tau(pred, meas),
        "pick": pick["label"], "pick_s": pick["measured_s"], "pick_pred_s": pick["predicted_s"],
        "best": best["label"], "best_s": best["measured_s"], "regret": pick["measured_s"] / best["measured_s"] - 1.0,
        "occupancy_agree": sum(r["predicted_blocks_per_sm"] == r["cuda_core_blocks_per_sm"] for r in occ) / max(1, len(occ)),
        "reg_err_median": float(np.median(reg_err)) if reg_err else float("nan"),
        "reg_err_max": float(max(reg_err)) if reg_err else float("nan"),
        "pred_over_meas_median": float(np.median(np.asarray(pred) / np.asarray(meas))),
    }


def report_text(results: dict[str, Any]) -> str:
    lines = [f"## Cost model vs measurement ({results.get('gpu', '?')}, {results.get('date', '?')}, "
             f"commit {results.get('commit', '?')[:10]})", "",
             f"Target from the device: {results.get('target', '')}", "",
             "| op | candidates | Kendall tau | model's pick (measured) | best measured | regret | "
             "blocks/SM = cuda.core | regs vs ptxas (median / max rel. err) | predicted/measured (median) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for op, block in results["ops"].items():
        f = op_figures(block["candidates"])
        if not f["n"]:
            lines.append(f"| {op} | 0 | - | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {op} | {f['n']} (+{f['failed']} failed) | {f['tau']:.2f} | {f['pick']} ({f['pick_s'] * 1e6:.1f} us) | "
            f"{f['best']} ({f['best_s'] * 1e6:.1f} us) | {100 * f['regret']:.1f}% | {100 * f['occupancy_agree']:.0f}% | "
            f"{100 * f['reg_err_median']:.0f}% / {100 * f['reg_err_max']:.0f}% | {f['pred_over_meas_median']:.2f} |")
    return "\n".join(lines) + "\n"


def tuned_report(db_path: str | None) -> str:
    """Predicted vs measured from the tuning database (docs/tuning.md): per tuned problem, the
    candidates measured correct, Kendall tau of predicted vs measured time, and the regret of
    the model's pick (least predicted) against the measured winner."""
    from tecc.compiler.tuning_db import TuningDB

    db = TuningDB(db_path) if db_path else TuningDB()
    problems: dict[tuple[str, ...], list[Any]] = {}
    for m in db.measurements():
        if m.ok and m.median_us is not None and m.predicted_us is not None:
            key = (m.op_name or m.op_signature[:12], json.dumps(m.shapes), m.arch)
            problems.setdefault(key, []).append(m)
    lines = [f"tuning database {db.path}", "",
             "| op | shapes | arch | measured | Kendall tau | model's pick | measured best | regret |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (op, shapes, arch), rows in sorted(problems.items()):
        pick = min(rows, key=lambda m: m.predicted_us)
        best = min(rows, key=lambda m: m.median_us)
        tau = kendall_tau([m.predicted_us for m in rows], [m.median_us for m in rows])
        lines.append(f"| {op} | {shapes} | {arch} | {len(rows)} | {tau:.2f} | {pick.median_us:.1f} us | "
                     f"{best.median_us:.1f} us | {100 * (pick.median_us / best.median_us - 1):.0f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("prepare", "measure", "report", "repredict", "tuned"))
    p.add_argument("--db", default=None, help="tuned: the tuning database (default TECC_TUNING_DB)")
    p.add_argument("--dir", default=str(ROOT / "build" / "costbench"))
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "build" / "costbench-out")))
    p.add_argument("--per-op", type=int, default=60)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--results", default="")
    a = p.parse_args()
    if a.mode == "prepare":
        prepare(Path(a.dir), a.per_op, a.arch)
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = ""
        path = Path(a.dir) / "candidates.json"
        data = json.loads(path.read_text())
        data["commit"] = commit + (" (+ uncommitted changes)" if commit else "")
        path.write_text(json.dumps(data, indent=1))
    elif a.mode == "measure":
        measure(Path(a.dir), Path(a.out))
    elif a.mode == "tuned":
        print(tuned_report(a.db))
    elif a.mode == "repredict":
        results = repredict(json.loads(Path(a.results).read_text()))
        Path(a.results).with_name("results_repredicted.json").write_text(json.dumps(results, indent=1))
        print(report_text(results))
    else:
        print(report_text(json.loads(Path(a.results).read_text())))


if __name__ == "__main__":
    main()
