"""explain(): the planner's choice in words someone who knows CUDA can check.

First the graph level: the rewrite chosen over the per-kernel plans of the kernels it replaces
(its launch, occupancy and cost breakdown) or the best rewrite and why the per-kernel plans won,
the other rewrites' points and the rewrites that do not apply. Then for each kernel (briefly when
a rewrite replaced them): what it computes (kind, loops, FLOPs, compulsory bytes), the chosen strategy and
parameters, the launch shape, occupancy and what limits it, waves, registers and shared memory,
the predicted time with every term of the cost model, and the runners-up: the best point of
every other strategy and the next points of the same strategy with how much slower they are
predicted, then the points that were rejected with their reason (e.g. "smem 72 KiB > 48 KiB
without opt-in") and the strategies whose guard declined.
"""

from __future__ import annotations

from typing import Any

from ..ir.target import KiB
from .cost.traffic import compulsory_bytes
from .planner import Candidate, KernelPlan, PlanResult


def _us(s: float) -> str:
    return f"{s * 1e6:.1f} us"


def _terms(c: Candidate) -> str:
    order = ("dram", "l2", "l1/shared", "tensor", "fma", "issue", "special", "chain", "latency", "launch", "then")
    parts = []
    for k in order:
        v = c.cost.terms.get(k, 0.0)
        if v > 0:
            parts.append(f"{k} {_us(v)}{' *' if k == c.cost.bound else ''}")
    return ", ".join(parts)


def _kernel(kp: KernelPlan, result: PlanResult, runners: int) -> list[str]:
    info, c = kp.info, kp.chosen
    loops = ", ".join(f"{v}:{e}" for v, e in info.spatial)
    red = ", ".join(f"{v}:{e}" for v, e in info.reduction)
    lines = [f"kernel {kp.kernel} (stage {info.stage}): {info.kind}"
             f"{' (' + info.reduce_kind + ')' if info.reduce_kind and info.kind == 'reduction' else ''}, "
             f"spatial [{loops}]{', reduce [' + red + ']' if red else ''}, {info.dtype}",
             f"  work: {info.flops / 1e9:.3g} GFLOP, compulsory DRAM traffic {compulsory_bytes(info) / 1e6:.3g} MB"]
    for note in info.notes:
        lines.append(f"  math: {note}")
    if info.assumed:
        lines.append("  assumed sizes (pass sizes= to plan for yours): "
                     + ", ".join(f"{n}={v}" for n, v in info.assumed))
    w, cost = c.workload, c.cost
    lines.append(f"  chosen: {c.label}")
    lines.append(f"    launch {w.blocks} blocks x {w.threads} threads; {cost.occupancy.describe(result.target)}; "
                 f"{cost.waves} wave(s), last wave {100 * cost.tail:.0f}% full")
    regs = " + ".join(f"{v} {k}" for k, v in w.registers.items())
    lines.append(f"    registers/thread ~{w.register_count} ({regs}); shared {w.smem_bytes / KiB:.1f} KiB/block"
                 f"{'; bank conflicts ' + format(w.bank_conflict, '.0f') + '-way' if w.bank_conflict > 1 else ''}")
    lines.append(f"    traffic: DRAM {w.dram_bytes / 1e6:.3g} MB, L2->SM {w.l2_bytes / 1e6:.3g} MB, "
                 f"{w.bytes_in_flight:.0f} B in flight/thread, ILP {w.ilp:.0f}")
    lines.append(f"    predicted {_us(cost.total)} = launch + max(throughput terms) + latency; "
                 f"{cost.bound}-bound: {_terms(c)}")
    for note in w.notes:
        lines.append(f"    note: {note}")
    shown = 0
    others: dict[str, Candidate] = {}
    for r in kp.ranked:
        if r is not c and r.failed is None and r.strategy.name != c.strategy.name:
            others.setdefault(r.strategy.name, r)
    same = [r for r in kp.ranked if r is not c and r.failed is None and r.strategy.name == c.strategy.name]
    if others or same:
        lines.append("  runners-up:")
    for r in list(others.values()) + same[:max(0, runners - len(others))]:
        shown += 1
        slower = r.cost.total / c.cost.total - 1.0
        lines.append(f"    {r.label}: {_us(r.cost.total)} (+{100 * slower:.0f}%, {r.cost.bound}-bound; "
                     f"{_why_slower(c, r)})")
    failed = [r for r in kp.ranked if r.failed is not None]
    for r in failed[:3]:
        lines.append(f"    {r.label}: refused by the schedule primitives: {r.failed}")
    if kp.rejected:
        reasons: dict[str, tuple[int, Candidate]] = {}
        for r in kp.rejected:
            key = r.cost.rejected or ""
            key = key.split(" (")[0] if key.startswith("smem") else key
            n, first = reasons.get(_reason_kind(r.cost.rejected or ""), (0, r))
            reasons[_reason_kind(r.cost.rejected or "")] = (n + 1, first)
        lines.append(f"  rejected: {len(kp.rejected)} point(s)")
        for kind, (n, r) in reasons.items():
            lines.append(f"    {n} x {kind}, e.g. {r.label}: {r.cost.rejected}")
    for name, why in kp.declined:
        lines.append(f"  strategy {name} does not apply: {why}")
    return lines


def _reason_kind(reason: str) -> str:
    if reason.startswith("smem"):
        return "shared memory over the limit"
    if reason.startswith("registers"):
        return "registers over the limit"
    if "threads" in reason:
        return "threads per block"
    return reason


def _why_slower(best: Candidate, other: Candidate) -> str:
    """The term that grew most from the chosen point to `other`."""
    diffs = {k: other.cost.terms.get(k, 0.0) - best.cost.terms.get(k, 0.0) for k in other.cost.terms}
    key = max(diffs, key=lambda k: diffs[k])
    extra = []
    if other.cost.occupancy.blocks_per_sm != best.cost.occupancy.blocks_per_sm:
        extra.append(f"{other.cost.occupancy.blocks_per_sm} blocks/SM ({other.cost.occupancy.limiter})")
    if other.workload.bank_conflict > 1:
        extra.append(f"{other.workload.bank_conflict:.0f}-way bank conflicts")
    return f"{key} +{_us(diffs[key])}" + ("; " + ", ".join(extra) if extra else "")


def _group(result: PlanResult, runners: int) -> list[str]:
    """The graph-level planning: which rewrite won over which per-kernel plans (or lost to them),
    its cost breakdown, the other rewrites' points, and the rewrites that do not apply."""
    g = result.group
    assert g is not None
    lines: list[str] = []
    c = g.chosen
    if c is not None:
        w, cost = c.workload, c.cost
        margin = getattr(c.strategy, "margin", 1.0)
        lines.append(f"graph-level: {c.label} replaces the kernels [{', '.join(g.kernels)}]")
        lines.append(f"  launch {w.blocks} blocks x {w.threads} threads; {cost.occupancy.describe(result.target)}; "
                     f"{cost.waves} wave(s), last wave {100 * cost.tail:.0f}% full")
        lines.append(f"  predicted {_us(cost.total)}{f' (ranked at {_us(c.ranked_seconds)}: margin {margin:g})' if margin != 1.0 else ''}; "
                     f"{cost.bound}-bound: {_terms(c)}")
        for note in w.notes:
            lines.append(f"  note: {note}")
        lines.append(f"  chosen over the per-kernel plans of those kernels: {_us(g.per_kernel_seconds)} in all "
                     "(below, weighed and not built; a rewrite within 5% of them is taken: a tie at one bound)")
    elif g.best is not None:
        lines.append(f"graph-level: best {g.best.label} predicted {_us(g.best.cost.total)}, not below the per-kernel "
                     f"plans' {_us(g.per_kernel_seconds)} of [{', '.join(g.kernels)}]: those are built")
    others = [r for r in g.ranked if r is not c and r.failed is None]
    if others:
        lines.append("  other graph-level points:")
        for r in others[:runners]:
            lines.append(f"    {r.label}: {_us(r.cost.total)} ({r.cost.bound}-bound)")
    for r in [r for r in g.ranked if r.failed is not None][:runners]:
        lines.append(f"    {r.label}: refused: {r.failed}")
    for name, why in g.declined:
        lines.append(f"  graph strategy {name} does not apply: {why}")
    return lines


def explain(result: PlanResult, runners: int = 4) -> str:
    """The planner's decision for every kernel (see the module docstring)."""
    lines = [f"target {result.target.summary()}",
             f"plan: {result.plan.strategy}; predicted total {_us(result.predicted_seconds)}; "
             f"planning took {1e3 * result.search_seconds:.0f} ms (search) + {1e3 * result.realize_seconds:.0f} ms "
             "(schedule primitives)"]
    if result.composed is not None:  # planned in regions: each part by the planner (the plan's reason)
        lines.append(f"planned in regions: {result.plan.reason}")
        lines.append("whole-program per-kernel plans (weighed before the regions, not built):")
        for kp in result.kernels:
            lines.append(f"  {kp.kernel}: {kp.chosen.label}, predicted {_us(kp.chosen.cost.total)}")
        lines.append(str(result.plan))
        return "\n".join(lines)
    if result.group is not None:
        lines += _group(result, runners)
    if result.group is not None and result.group.chosen is not None:
        lines.append("per-kernel plans (weighed against it, not built):")
        for kp in result.kernels:
            lines.append(f"  {kp.kernel}: {kp.chosen.label}, predicted {_us(kp.chosen.cost.total)} "
                         f"({kp.chosen.cost.bound}-bound)")
    else:
        for kp in result.kernels:
            lines += _kernel(kp, result, runners)
    lines.append(str(result.plan))
    return "\n".join(lines)


def explain_kernel(kernel: Any) -> str:
    """Kernel.explain(): the planning report when the plan came from the planner, then the
    launch and the ptxas report of every kernel."""
    parts = []
    report = getattr(kernel, "planning", None)
    cached = any(step == "build cache hit" for step, _ in getattr(getattr(kernel, "timing", None), "seconds", []))
    if report is not None:
        parts.append(explain(report))
    elif getattr(kernel, "planning_report", None):  # a build-cache hit of a plan the planner chose
        parts.append(kernel.planning_report)
    else:
        parts.append(str(kernel.plan))
    if cached:
        parts.append("  (planned by an earlier build and taken from the build cache, whose entry keeps that "
                     "build's plan, final loop IR and planning report; TECC_NO_CACHE=1 plans again)")
    for who, why in getattr(kernel, "fallbacks", []):
        parts.append(f"  fell back: candidate {who} took the program but failed: {why}")
    # what the tensorize primitive built (its form; a launch-time test of run-time strides); the
    # attention rewrite, which sets the same attribute, says it in its plan's reason
    tensorized = any(step.primitive == "tensorize" for step in getattr(kernel.plan, "steps", ()))
    funcs = {f.name: f for f in getattr(getattr(kernel, "module", None), "kernels", ())}
    for k in kernel.host.kernels:
        grid = ", ".join(str(g) for g in k.grid)
        parts.append(f"  {k.name}: grid ({grid}), block {k.block}")
        built = dict(funcs[k.name].attrs).get("tensorize") if tensorized and k.name in funcs else None
        if built:
            parts.append(f"    built: {built}")
        res = kernel.resources.get(k.name)
        if res is not None:
            parts.append(f"    ptxas: {res.registers} registers, {res.shared_bytes} B shared, "
                         f"{res.spill_stores + res.spill_loads} B spills")
    return "\n".join(parts)


__all__ = ["explain", "explain_kernel"]
