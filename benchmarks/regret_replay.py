"""Planner regret replayed: the current cost model's ranking of the candidates a GPU run measured.

    python benchmarks/regret_replay.py [JSON ...] [--grids gemm,attention,conv] [--verbose]
                                       [--target h200|sm_90]

Reads the JSON of benchmarks/planner_regret.py (default: benchmarks/results/planner_regret_h200_s25.json),
plans every problem again with the model as it stands (no GPU: the planner ranks, nothing is
compiled or run) and finds each measured candidate in the new ranking by its label (the
strategy's description of its point). The replayed pick of a problem is the measured candidate
the new ranking puts first; its regret = its measured time / the best measured time - 1, next
to the regret the run recorded (the JSON's pick). A candidate the planner no longer proposes
(its strategy's space or guard changed) is left out of the replay and counted.

This is what a change to the cost model would do to the picks the GPU has already timed, not a
new measurement: a replayed pick outside the measured candidates cannot be judged, and the
candidates were the old ranking's top few. `benchmarks/planner_regret.py` on the GPU confirms.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "planner_regret_h200_s25.json"


@dataclass
class Replayed:
    grid: str
    problem: str
    old_regret: float
    new_regret: float
    new_pick: str
    best: str
    missing: int                       # measured candidates the planner no longer proposes
    pick_measured: bool                # the planner's new first choice is one of the measured candidates
    order: list[tuple[str, float, float]]   # (label, new prediction us, measured us), new order


def h200() -> Any:
    """The H200 the run planned for (target.from_device there): the sm_90 table's SMs and clock,
    the device's DRAM rate and L2."""
    import tecc as tc

    return tc.target("sm_90").replace(dram_bandwidth=4.92e12, l2_bytes=60 * 2**20, name="NVIDIA H200")


def factory(grid: str, name: str) -> Callable[[], list[Any]]:
    """The tensors of a problem named as planner_regret.py names it."""
    if grid == "gemm":
        from gemm import matmul_tensors

        dtype, dims = name.split()
        batch, m, n, k = (int(x) for x in dims.split("x"))
        return partial(matmul_tensors, batch, m, n, k, dtype)
    if grid == "attention":
        from attention import attention_tensors

        words = dict(w.split("=") for w in name.split() if "=" in w)
        s, d = int(words["S"]), int(words["d"])
        return partial(attention_tensors, max(1, 16384 // s), 2048 // d, s, d, "float16", "causal" in name)
    if grid == "conv":
        from conv import conv_tensors

        dtype, dims = name.split()
        return partial(conv_tensors, *(int(x) for x in dims.split("x")), dtype)
    raise ValueError(f"regret_replay: unknown grid {grid!r}")


def ranking(args: list[Any], target: Any) -> tuple[dict[str, tuple[int, float]], str]:
    """label -> (place in the planner's ranking, predicted us): the graph-level points first (the
    planner's order: GraphStrategy.order included), then the program's one kernel's points; and
    the label of the planner's pick."""
    from tecc.compiler.planner import plan_program

    result = plan_program(args, target, keep=1 << 30)
    out: dict[str, tuple[int, float]] = {}
    lists = []
    if result.group is not None:
        lists.append([c for c in result.group.ranked if c.failed is None])
    if len(result.kernels) == 1:
        lists.append([c for c in result.kernels[0].ranked if c.failed is None])
    for cands in lists:
        for c in cands:
            out.setdefault(c.label, (len(out), c.cost.total * 1e6))
    group = result.group
    pick = group.chosen.label if group is not None and group.chosen is not None else \
        "; ".join(kp.chosen.label for kp in result.kernels)
    return out, pick


def replay_row(row: dict[str, Any], target: Any) -> Replayed | None:
    """The replay of one problem of the JSON (None: nothing measured)."""
    timed = [c for c in row["candidates"] if not c.get("error") and _finite(c.get("measured_us"))]
    if not timed:
        return None
    ranks, planner_pick = ranking(factory(row["grid"], row["problem"])(), target)
    best = min(timed, key=lambda c: c["measured_us"])
    known = [c for c in timed if c["label"] in ranks]
    if not known:
        return None
    order = sorted(known, key=lambda c: ranks[c["label"]][0])
    pick = order[0]
    return Replayed(row["grid"], row["problem"], float(row.get("regret", math.nan)),
                    pick["measured_us"] / best["measured_us"] - 1.0, pick["label"], best["label"],
                    len(timed) - len(known), planner_pick in {c["label"] for c in timed},
                    [(c["label"], ranks[c["label"]][1], c["measured_us"]) for c in order])


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def replay(paths: list[Path], grids: set[str], target: Any) -> list[Replayed]:
    out = []
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            if row["grid"] in grids:
                r = replay_row(row, target)
                if r is not None:
                    out.append(r)
    return out


def subgrid(r: Replayed) -> str:
    """gemm/conv split by operand dtype (fp32 runs on the SIMT strategies, 16-bit on tensor cores)."""
    if r.grid == "attention":
        return "attention"
    return f"{r.grid} {'fp32' if r.problem.startswith('float32') else '16-bit'}"


def table(rows: list[Replayed]) -> str:
    lines = ["| grid | problems | mean regret before | after | worst before | after | within 5% before | after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[str, list[Replayed]] = {}
    for r in rows:
        groups.setdefault(r.grid, []).append(r)
        if subgrid(r) != r.grid:
            groups.setdefault(subgrid(r), []).append(r)
    for name in sorted(groups, key=lambda g: (g.split()[0], len(g))):
        rs = groups[name]
        old = [r.old_regret for r in rs if math.isfinite(r.old_regret)]
        new = [r.new_regret for r in rs]
        lines.append(f"| {name} | {len(rs)} | {_pct(sum(old) / max(len(old), 1))} | {_pct(sum(new) / len(new))} | "
                     f"{_pct(max(old, default=math.nan))} | {_pct(max(new))} | "
                     f"{sum(v <= 0.05 for v in old)} / {len(old)} | {sum(v <= 0.05 for v in new)} / {len(new)} |")
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="*", type=Path, default=[DEFAULT_JSON])
    ap.add_argument("--grids", default="gemm,attention,conv")
    ap.add_argument("--target", default="h200", help="h200 (the run's device) or an arch such as sm_90")
    ap.add_argument("--verbose", action="store_true", help="every problem's replayed order")
    opts = ap.parse_args()
    import tecc as tc

    target = h200() if opts.target == "h200" else tc.target(opts.target)
    rows = replay(opts.json, set(opts.grids.split(",")), target)
    for r in rows:
        mark = "" if abs(r.new_regret - r.old_regret) < 1e-9 else "  <- changed"
        print(f"{r.grid:9s} {r.problem:30s} regret {_pct(r.old_regret):>6s} -> {_pct(r.new_regret):>6s}"
              f"{f'  ({r.missing} no longer proposed)' if r.missing else ''}"
              f"{'' if r.pick_measured else '  (the planner now picks an unmeasured point)'}{mark}")
        if opts.verbose or mark:
            for label, pred, meas in r.order:
                print(f"      pred {pred:9.1f}  meas {meas:9.1f}  {label}")
    print()
    print(table(rows))
    unmeasured = [r.problem for r in rows if not r.pick_measured]
    if unmeasured:
        print(f"the planner's pick is not among the measured candidates (re-measure on the GPU): {unmeasured}")


if __name__ == "__main__":
    main()
