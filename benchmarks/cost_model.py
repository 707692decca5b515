"""The cost model's honesty loop: predicted vs measured, over many candidates per op.

    python benchmarks/cost_model.py prepare [--dir build/costbench] [--per-op 60]   # CPU: plan, schedule, NVRTC
    python benchmarks/cost_model.py measure --dir build/costbench --out DIR         # GPU: check, time, occupancy
    python benchmarks/cost_model.py report  --results DIR/results.json              # RESULTS.md section
    python benchmarks/cost_model.py tuned   [--db FILE]                             # the tuning database's figures

`prepare` (no GPU needed) enumerates every candidate (strategy, point) of four ops (SHAPES:
matmul, the tuner's small matmul, a row sum, an elementwise op), plus for the row sum every
point of the one-kernel `row_fused` rewrite (priced by strategies.row_fused.fused_workload),
and keeps a spread of `--per-op` valid ones over the predicted ranking (the top 12, the rest
evenly spaced, and at least 4 of every family: gemm shared / none, gemm_pipelined with and
without split-K, reduction thread / row_staged, row_fused, elementwise blocked / grid-stride).
Each is realized through the schedule primitives (row_fused: its `fuse_rows` step), compiled
with NVRTC and saved as an artifact with its predicted time and terms, predicted registers and
occupancy, and ptxas's registers. Predictions are for the Target `from_device()` gives on the
lent H200 (`--device h200`: 4.81 TB/s, 60 MiB L2) so they are fixed before any measurement.

`measure` (on the GPU; tecc's runtime + torch for arrays) checks every artifact against a
float64 torch reference, times it with CUDA events around each launch (the profiling hook, as
the tuner) over rotating argument sets spanning >= 2x L2, in two rounds (medians of 10 after 3
warm-ups each; run-to-run spread = the rounds' medians apart), asks cuda.core's occupancy
calculator for blocks/SM, and writes results.json and RESULTS.md: raw Kendall tau, tau over
the pairs whose measured times differ by more than the run-to-run spread, and the regret of
the model's pick (over all candidates and over the registry strategies only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Sizes of the third pass (out-of-sample: none of them was measured before; the first and second
# passes used matmul 2048^3, row sum 16384x4096, elementwise 8192x8192). matmul_small is the
# tuner's 100x512x256 matmul of docs/tuning.md, whose planner pick measured slowest of four.
SHAPES: dict[str, dict[str, int]] = {
    "matmul": {"M": 1536, "N": 2048, "K": 1024},
    "matmul_small": {"M": 100, "N": 512, "K": 256},
    "row_sum": {"R": 32768, "C": 2048},
    "elementwise": {"E0": 4096, "E1": 16384},
}
OPS = tuple(SHAPES)


def make_ops() -> dict[str, Any]:
    import tecc as tc

    ops: dict[str, Any] = {}
    for op in ("matmul", "matmul_small"):
        M, N, K = (SHAPES[op][x] for x in "MNK")
        A = tc.placeholder((M, K), "float32", name="A")
        B = tc.placeholder((K, N), "float32", name="B")
        k = tc.reduce_axis(K, name="k")
        C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
        ops[op] = ([A, B, C], {"flops": 2.0 * M * N * K})
    R, Cn = SHAPES["row_sum"]["R"], SHAPES["row_sum"]["C"]
    x = tc.placeholder((R, Cn), "float32", name="x")
    c = tc.reduce_axis(Cn, name="c")
    s = tc.compute((R,), lambda r: tc.sum(x[r, c], axis=c), name="row_sum")
    ops["row_sum"] = ([x, s], {"bytes": 4.0 * R * Cn})
    E0, E1 = SHAPES["elementwise"]["E0"], SHAPES["elementwise"]["E1"]
    xe = tc.placeholder((E0, E1), "float32", name="xe")
    a = tc.placeholder((E1,), "float32", name="a")
    y = tc.compute((E0, E1), lambda i, j: xe[i, j] * a[j] + tc.const(1.0, "float32"), name="y")
    ops["elementwise"] = ([xe, a, y], {"bytes": 8.0 * E0 * E1})
    return ops


def family(label: str, strategy: str, point: dict[str, Any]) -> str:
    """The kind of kernel a candidate is, for making sure every kind is measured."""
    if strategy == "gemm_pipelined":
        return "gemm_pipelined split" if int(point.get("split", 1)) > 1 else "gemm_pipelined"
    if strategy == "gemm":
        return f"gemm {point.get('staging')}"
    if strategy == "reduction":
        return f"reduction {point.get('mapping')}"
    if strategy == "elementwise":
        return f"elementwise {point.get('mode')}"
    return strategy


def _select(fams: list[str], per_op: int, per_family: int = 4) -> list[int]:
    """Indices into the predicted ranking: the top 12, the rest evenly spaced, and at least
    `per_family` of every family (its best, then evenly over its ranks)."""
    n = len(fams)
    top = list(range(min(12, n)))
    rest = np.linspace(12, n - 1, max(0, per_op - len(top))).round().astype(int).tolist() if n > 12 else []
    chosen = set(top + rest)
    for f in sorted(set(fams)):
        ranks = [i for i, g in enumerate(fams) if g == f]
        have = [i for i in ranks if i in chosen]
        if len(have) >= min(per_family, len(ranks)):
            continue
        picks = np.linspace(0, len(ranks) - 1, min(per_family, len(ranks))).round().astype(int).tolist()
        for p in picks:
            chosen.add(ranks[p])
    return sorted(chosen)


def device_like(name: str) -> Any:
    """The Target `from_device()` returns on the lent GPU, without the GPU: sm_90's table with
    the H200's DRAM bandwidth and L2 as cuda.core read them there (docs/cost-model.md)."""
    from tecc.ir.target import MiB, target

    tgt = target("sm_90")
    if name == "h200":
        tgt = tgt.replace(name="NVIDIA H200 (from_device values)", dram_bandwidth=4.81e12, l2_bytes=60 * MiB)
    return tgt


class _Fused:
    """A row_fused point dressed as a planner Candidate (row_fused is a program rewrite, not a
    registry strategy; the benchmark prices it with strategies.row_fused.fused_workload)."""

    def __init__(self, point: dict[str, Any], workload: Any, cost: Any) -> None:
        from tecc.compiler.strategies.row_fused import describe_point

        self.point, self.workload, self.cost = point, workload, cost
        self.label = describe_point(point)
        self.strategy = type("RowFused", (), {"name": "row_fused", "uses_default_schedule": False})()


def op_candidates(op: str, args: list[Any], info: Any, tgt: Any) -> tuple[list[Any], int]:
    """Every valid candidate of `op`, ranked by predicted time, and how many were evaluated."""
    from tecc.compiler.cost.model import predict
    from tecc.compiler.planner import candidates_for
    from tecc.compiler.strategies.row_fused import fused_points, fused_workload

    cands, _ = candidates_for(info, tgt)
    evaluated = len(cands)
    valid = [c for c in cands if c.cost.ok]
    if op == "row_sum":
        for point in fused_points(info.reduce_extent):
            w = fused_workload(info, point, tgt)
            c = predict(w, tgt)
            evaluated += 1
            if c.ok:
                valid.append(_Fused(point, w, c))
    valid.sort(key=lambda c: (c.cost.total, c.workload.threads))
    return valid, evaluated


def prepare(directory: Path, per_op: int, arch: str, device: str = "h200") -> None:
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.plan import Plan, Step
    from tecc.compiler import build
    from tecc.compiler.schedule import Schedule
    from tecc.ir.errors import TeccError
    from tecc.passes.lower import lower

    tgt = device_like(device)
    directory.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"arch": arch, "target": tgt.summary(), "shapes": SHAPES, "ops": {}}
    for op, (args, _) in make_ops().items():
        t0 = time.perf_counter()
        module = lower(args)
        info = analyze_kernel(module.kernels[0])
        valid, evaluated = op_candidates(op, args, info, tgt)
        plan_seconds = time.perf_counter() - t0
        fams = [family(c.label, c.strategy.name, c.point) for c in valid]
        rows = []
        for idx in _select(fams, per_op):
            cand = valid[idx]
            try:
                if cand.strategy.name == "row_fused":
                    plan = Plan((Step("fuse_rows", dict(cand.point)),), "row_fused", cand.label)
                elif cand.strategy.uses_default_schedule:
                    plan = Plan((Step("default_schedule", dict(cand.point)),), cand.strategy.name, cand.label)
                else:
                    sch = Schedule(args)
                    cand.strategy.apply(sch, info, cand.point)
                    plan = Plan(sch.plan.steps, cand.strategy.name, cand.label)
                kernel = build(args, "cuda", plan=plan, arch=arch)
            except TeccError as exc:
                print(f"{op} #{idx} {cand.label}: not realizable: {str(exc).splitlines()[0]}", flush=True)
                continue
            stem = directory / op / f"c{idx:04d}"
            kernel.save(stem)
            launch = kernel.host.kernels[0]
            res = kernel.resources[launch.name]
            rows.append({
                "index": idx, "rank": idx, "label": cand.label, "strategy": cand.strategy.name, "point": cand.point,
                "family": fams[idx], "artifact": str(stem.relative_to(directory)), "predicted_s": cand.cost.total,
                "terms": cand.cost.terms, "bound": cand.cost.bound, "kernels": len(kernel.host.kernels),
                "kernel": launch.name,
                "predicted_registers": cand.workload.register_count, "ptxas_registers": res.registers,
                "ptxas_spills": res.spill_stores + res.spill_loads, "ptxas_smem": res.shared_bytes,
                "predicted_smem": cand.workload.smem_bytes,
                "predicted_blocks_per_sm": cand.cost.occupancy.blocks_per_sm, "threads": cand.workload.threads,
                "block": list(launch.block),
            })
            print(f"{op} #{idx:4d} pred {cand.cost.total * 1e6:9.1f} us regs {cand.workload.register_count:3d}/"
                  f"{res.registers:3d}  {cand.label}", flush=True)
        summary["ops"][op] = {"evaluated": evaluated, "valid": len(valid), "plan_seconds": plan_seconds,
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


L2_FACTOR = 2.0          # rotating argument sets span at least this many L2 sizes (as the tuner)
MAX_SET_BYTES = 2 << 30
WARMUP, REPEATS, ROUNDS, CALL_TIMED = 3, 10, 2, 5


def op_arrays(op: str, torch: Any) -> tuple[list[Any], list[int], list[Any]]:
    """One argument set of `op` (torch tensors), the output positions, the float64 references."""
    sh = SHAPES[op]
    if op in ("matmul", "matmul_small"):
        A = torch.randn(sh["M"], sh["K"], device="cuda")
        B = torch.randn(sh["K"], sh["N"], device="cuda")
        C = torch.empty(sh["M"], sh["N"], device="cuda")
        return [A, B, C], [2], [A.double() @ B.double()]
    if op == "row_sum":
        x = torch.randn(sh["R"], sh["C"], device="cuda")
        return [x, torch.empty(sh["R"], device="cuda")], [1], [x.double().sum(-1)]
    xe = torch.randn(sh["E0"], sh["E1"], device="cuda")
    a = torch.randn(sh["E1"], device="cuda")
    return [xe, a, torch.empty(sh["E0"], sh["E1"], device="cuda")], [2], [xe.double() * a.double() + 1.0]


def measure(directory: Path, out: Path) -> None:
    """Check and time every prepared candidate: outputs vs float64 on argument set 0; kernel
    time = CUDA events around each launch (the profiling hook, `tc.profile`), rotating over
    device-resident argument sets spanning >= 2x L2 (cold operands, as the tuner times them);
    ROUNDS rounds over all candidates of an op, so run-to-run spread = |median of round 1 -
    median of round 2| / median. For comparison with the first two passes, CALL_TIMED calls are
    also timed the first passes' way (events around the Python call)."""
    import torch

    import tecc
    from tecc.ir.target import from_device
    from tecc.runtime.artifact import load

    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    summary = json.loads((directory / "candidates.json").read_text())
    dev = from_device()
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "target": dev.summary(),
                               "predicted_for": summary.get("target", ""), "shapes": summary.get("shapes", {}),
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "commit": summary.get("commit", ""), "ops": {}}
    stream = torch.cuda.Stream()
    torch.manual_seed(0)
    for op, block in summary["ops"].items():
        rows = block["candidates"]
        first, out_pos, refs = op_arrays(op, torch)
        set_bytes = sum(t.numel() * t.element_size() for t in first)
        count = max(2, min(512, math.ceil(L2_FACTOR * dev.l2_bytes / set_bytes) + 1, MAX_SET_BYTES // set_bytes))
        sets = [first] + [[t.clone() for t in first] for _ in range(count - 1)]
        torch.cuda.synchronize()
        block["rotation"] = f"{count} argument sets of {set_bytes / 1e6:.1f} MB"
        loaded: dict[int, Any] = {}
        for row in rows:
            try:
                f = load(directory / row["artifact"], stream=stream)
                loaded[row["index"]] = f
                for o in out_pos:
                    first[o].fill_(float("nan"))
                torch.cuda.synchronize()
                f(*first)
                stream.synchronize()
                row["rel_error"] = max(float((first[o].double() - r).norm() / r.norm()) for o, r in zip(out_pos, refs))
                kern = f.executor.kernels.get(row.get("kernel")) or next(iter(f.executor.kernels.values()))
                threads = int(np.prod(row["block"]))
                row["cuda_core_blocks_per_sm"] = int(kern.occupancy.max_active_blocks_per_multiprocessor(threads, 0))
                calls = []
                for rep in range(CALL_TIMED):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record(stream)
                    f(*sets[rep % count])
                    e1.record(stream)
                    e1.synchronize()
                    calls.append(e0.elapsed_time(e1) * 1e-3)
                row["call_timed_s"] = float(np.median(calls))
            except Exception as exc:  # noqa: BLE001 - record and go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        for rnd in range(ROUNDS):
            for row in rows:
                f = loaded.get(row["index"])
                if f is None or "error" in row:
                    continue
                try:
                    times = []
                    with tecc.profile() as prof:
                        for i in range(WARMUP + REPEATS):
                            before = len(prof.launches)
                            f(*sets[(i + rnd * 7) % count])
                            if i >= WARMUP:
                                times.append(sum(r.time_ms or 0.0 for r in prof.launches[before:]) * 1e-3)
                    row.setdefault("samples_s", []).append(times)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        for row in rows:
            samples = row.get("samples_s")
            if not samples or "error" in row:
                print(f"{op} #{row['index']:4d} FAILED {row.get('error')}  {row['label']}", flush=True)
                continue
            flat = [t for r in samples for t in r]
            med = float(np.median(flat))
            rounds = [float(np.median(r)) for r in samples]
            row["measured_s"] = med
            row["run_to_run"] = (max(rounds) - min(rounds)) / med
            q75, q25 = np.percentile(flat, [75, 25])
            row["measured_spread"] = float((q75 - q25) / med)
            print(f"{op} #{row['index']:4d} pred {row['predicted_s'] * 1e6:9.1f} us  meas {med * 1e6:9.1f} us "
                  f"(call-timed {row['call_timed_s'] * 1e6:8.1f}, r2r {100 * row['run_to_run']:4.1f}%)  "
                  f"err {row['rel_error']:.1e}  occ {row['predicted_blocks_per_sm']}/{row['cuda_core_blocks_per_sm']}  "
                  f"{row['label']}", flush=True)
        del sets, first, loaded
        torch.cuda.empty_cache()
        results["ops"][op] = dict(block, candidates=rows)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
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
            if row["strategy"] == "row_fused":
                from tecc.compiler.strategies.row_fused import fused_workload

                w = fused_workload(info, row["point"], tgt)
            else:
                w = get(row["strategy"]).workload(info, row["point"], tgt)
            c = predict(w, tgt)
            row["predicted_s_first"] = row["predicted_s"]
            row.update(predicted_s=c.total, terms=c.terms, bound=c.bound, predicted_registers=w.register_count,
                       predicted_blocks_per_sm=c.occupancy.blocks_per_sm)
    results["note"] = f"predictions recomputed by the current model for {tgt.summary()}"
    return results


def resolved_tau(rows: list[dict[str, Any]]) -> tuple[float, int, int]:
    """Kendall tau over the pairs whose measured times differ by more than the timing noise:
    |m_i - m_j| > max(run-to-run spread of i, of j, 1%) x min(m_i, m_j) (run-to-run: the two
    rounds' medians of one candidate). Returns (tau, pairs kept, all pairs); a tie in the
    prediction counts as neither concordant nor discordant but stays in the denominator."""
    conc = disc = ties = kept = total = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            a, b = rows[i], rows[j]
            total += 1
            noise = max(a.get("run_to_run", 0.0), b.get("run_to_run", 0.0), 0.01)
            dm = a["measured_s"] - b["measured_s"]
            if abs(dm) <= noise * min(a["measured_s"], b["measured_s"]):
                continue
            kept += 1
            dp = a["predicted_s"] - b["predicted_s"]
            if dp == 0:
                ties += 1
            elif (dp > 0) == (dm > 0):
                conc += 1
            else:
                disc += 1
    denom = conc + disc + ties
    return ((conc - disc) / denom if denom else 0.0), kept, total


def op_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "measured_s" in r and r.get("rel_error", 1.0) < 1e-3]
    if not ok:
        return {"n": 0}
    pred = [r["predicted_s"] for r in ok]
    meas = [r["measured_s"] for r in ok]
    pick = min(ok, key=lambda r: r["predicted_s"])
    best = min(ok, key=lambda r: r["measured_s"])
    registry = [r for r in ok if r["strategy"] != "row_fused"]
    reg_pick = min(registry, key=lambda r: r["predicted_s"]) if registry else pick
    reg_best = min(registry, key=lambda r: r["measured_s"]) if registry else best
    occ = [r for r in ok if r.get("cuda_core_blocks_per_sm") is not None]
    regs = [(r["predicted_registers"], r["ptxas_registers"]) for r in rows]
    reg_err = [abs(p - q) / q for p, q in regs if q]
    tau_r, kept, total = resolved_tau(ok)
    return {
        "n": len(ok), "failed": len(rows) - len(ok), "tau": kendall_tau(pred, meas),
        "tau_resolved": tau_r, "pairs_resolved": kept, "pairs": total,
        "pick": pick["label"], "pick_s": pick["measured_s"], "pick_pred_s": pick["predicted_s"],
        "best": best["label"], "best_s": best["measured_s"], "regret": pick["measured_s"] / best["measured_s"] - 1.0,
        "registry_regret": reg_pick["measured_s"] / reg_best["measured_s"] - 1.0, "registry_pick": reg_pick["label"],
        "occupancy_agree": sum(r["predicted_blocks_per_sm"] == r["cuda_core_blocks_per_sm"] for r in occ) / max(1, len(occ)),
        "reg_err_median": float(np.median(reg_err)) if reg_err else float("nan"),
        "reg_err_max": float(max(reg_err)) if reg_err else float("nan"),
        "pred_over_meas_median": float(np.median(np.asarray(pred) / np.asarray(meas))),
        "run_to_run_median": float(np.median([r.get("run_to_run", 0.0) for r in ok])),
        "call_over_kernel_median": float(np.median([r["call_timed_s"] / r["measured_s"] for r in ok
                                                    if r.get("call_timed_s")] or [float("nan")])),
    }


def report_text(results: dict[str, Any]) -> str:
    lines = [f"## Cost model vs measurement ({results.get('gpu', '?')}, {results.get('date', '?')}, "
             f"commit {results.get('commit', '?')[:10]})", "",
             f"Target from the device: {results.get('target', '')}",
             f"Predicted for: {results.get('predicted_for', '(same)')}", "",
             "| op | candidates | Kendall tau (raw) | tau (resolved pairs) | model's pick (measured) | best measured | "
             "regret | regret, registry only | blocks/SM = cuda.core | regs vs ptxas (median / max rel. err) | "
             "predicted/measured (median) | run-to-run (median) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for op, block in results["ops"].items():
        f = op_figures(block["candidates"])
        if not f["n"]:
            lines.append(f"| {op} | 0 | - | - | - | - | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {op} | {f['n']} (+{f['failed']} failed) | {f['tau']:.2f} | {f['tau_resolved']:.2f} "
            f"({f['pairs_resolved']}/{f['pairs']} pairs) | {f['pick']} ({f['pick_s'] * 1e6:.1f} us, "
            f"pred {f['pick_pred_s'] * 1e6:.1f}) | {f['best']} ({f['best_s'] * 1e6:.1f} us) | {100 * f['regret']:.1f}% | "
            f"{100 * f['registry_regret']:.1f}% | {100 * f['occupancy_agree']:.0f}% | "
            f"{100 * f['reg_err_median']:.0f}% / {100 * f['reg_err_max']:.0f}% | {f['pred_over_meas_median']:.2f} | "
            f"{100 * f['run_to_run_median']:.1f}% |")
    return "\n".join(lines) + "\n"


def tuned_report(db_path: str | None) -> str:
    """Predicted vs measured from the tuning database (docs/tuning.md): per tuned problem, the
    candidates measured correct, Kendall tau of predicted vs measured time, and the regret of
    the model's pick (least predicted) against the measured winner."""
    from tecc.compiler.tuning import TuningDB

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
    p.add_argument("--device", default="h200", help="prepare: price for this device's from_device() Target (h200) or the sm_90 table (table)")
    p.add_argument("--results", default="")
    a = p.parse_args()
    if a.mode == "prepare":
        prepare(Path(a.dir), a.per_op, a.arch, a.device)
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
