"""One planning path: every candidate, the graph-level rewrites included, is a registered strategy
ranked by the cost model; the program is lowered once per build; one Target carries the build's
policy to every strategy; build falls back for tecc's own errors only."""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.explain import explain
from tecc.compiler.planner import plan_program
from tecc.compiler.program import Program, resolve_target
from tecc.compiler.strategies import registry
from tecc.compiler.strategies.registry import GraphStrategy

ROOT = Path(__file__).resolve().parent.parent
norms = runpy.run_path(str(ROOT / "examples" / "norms.py"))
sys.path.insert(0, str(ROOT / "tests"))

from test_attention_tensor_core import masked_attention  # noqa: E402


def _matmul(n: int) -> list[tc.Tensor]:
    A = tc.placeholder((n, n), "float32", name="A")
    B = tc.placeholder((n, n), "float32", name="B")
    k = tc.reduce_axis(n, name="k")
    return [A, B, tc.compute((n, n), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")]


@pytest.mark.parametrize("program", ["softmax", "matmul", "attention", "column"])
def test_a_cold_build_lowers_the_program_once(program, monkeypatch, tmp_path):
    """Lowering happens in Program.of alone: the build cache's key, the planner, every strategy
    (per-kernel and graph-level, whose tiling checks compile the plan), the realization and the
    pipeline share its module."""
    import tecc.compiler.pipeline as pipeline
    import tecc.compiler.program as program_module
    import tecc.compiler.schedule as schedule

    monkeypatch.setenv("TECC_BUILD_CACHE", "1")          # its key is computed too (a cold cache: a miss)
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    for module in (program_module, schedule, pipeline):
        real = module.lower

        def counted(*a, _real=real, _where=module.__name__, **k):  # type: ignore[no-untyped-def]
            calls.append(_where)
            return _real(*a, **k)
        monkeypatch.setattr(module, "lower", counted)
    if program == "softmax":
        args = norms["softmax"](6, 40)
    elif program == "matmul":
        args = _matmul(24)
    elif program == "attention":
        ins, outs = masked_attention(1, 2, 40, 40, 32, "float16", mask="causal")
        args = ins + outs
    else:
        X = tc.placeholder((64, 96), "float32", name="X")
        i = tc.reduce_axis(64, name="i")
        args = [X, tc.compute((96,), lambda j: tc.sum(X[i, j], axis=i), name="Y")]
    kernel = tc.build(args, target="sim", arch="sm_90")
    assert calls == ["tecc.compiler.program"], (calls, kernel.plan.strategy)
    assert kernel.planning is not None                  # planned, not taken from the build cache


def test_allow_tf32_reaches_the_graph_level_strategies(monkeypatch):
    """The one Target of a build carries allow_tf32 to every strategy, the graph-level ones too."""
    seen: list[bool] = []

    class Probe(GraphStrategy):
        name = "probe_for_the_test"

        def guard(self, program: Program) -> str | None:
            seen.append(program.target.allow_tf32)
            return "a probe"

    registry.register(Probe())
    try:
        for allow in (False, True):
            tc.build(_matmul(16), target="sim", arch="sm_90", allow_tf32=allow)
    finally:
        registry.unregister("probe_for_the_test")
    assert seen == [False, True]


def test_an_arch_without_a_table_keeps_its_number_and_garbage_plans_for_sm_90():
    assert resolve_target("sm_75").sm == 75 and resolve_target("sm_75").sm_count == resolve_target("sm_90").sm_count
    assert resolve_target("no arch").arch == "sm_90"
    assert resolve_target("sm_80", allow_tf32=True).allow_tf32
    # the tensor-core forms of the online contraction decline an arch before sm_80 by its number
    ins, outs = masked_attention(1, 2, 40, 40, 32, "float16", mask="causal")
    result = plan_program(ins + outs, "sm_75")
    assert result.plan.strategy == "online_contraction", result.plan
    assert "sm_75 has no mma.m16n8k16" in result.plan.reason, result.plan.reason


def test_build_has_no_proposals_and_catches_tecc_errors_only():
    """build.py asks the planner (one path) and the generic schedule, nothing else, and its one
    fallback catches TeccError: a Python error inside a strategy is raised."""
    tree = ast.parse((ROOT / "tecc" / "compiler" / "build.py").read_text())
    caught = {}
    for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for h in (n for n in ast.walk(func) if isinstance(n, ast.ExceptHandler)):
            caught.setdefault(func.name, set()).add(ast.unparse(h.type) if h.type is not None else "bare")
    # the fallback; and the check of a size given to build (operator.index of a non-integer)
    assert caught == {"_first_that_builds": {"TeccError"}, "_check_arguments": {"TypeError"}}, caught
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not imported & {"online_contraction", "row_fused", "split_rows", "split_row_group", "column_reduction"}


def test_the_rewrite_wins_over_the_per_kernel_plans_and_the_plan_says_by_how_much():
    """softmax: row_fused (one kernel, the row read once) against the per-kernel plans of its
    four stage kernels; the plan's reason and explain() say both predictions."""
    result = plan_program(norms["softmax"](4096, 1024), "sm_90")
    group = result.group
    assert group is not None and group.chosen is not None and group.chosen.strategy.name == "row_fused"
    assert group.chosen.cost.total < group.per_kernel_seconds
    assert set(group.kernels) == {kp.kernel for kp in result.kernels} and len(group.kernels) >= 3
    assert "graph-level row_fused(" in result.plan.reason and "for the per-kernel plans of" in result.plan.reason
    text = explain(result)
    assert "graph-level: row_fused(" in text and "chosen over the per-kernel plans" in text
    assert "graph strategy online_contraction does not apply" in text


def test_the_per_kernel_plans_win_where_the_rewrite_is_predicted_slower():
    """A rewrite that claims the program but is predicted slower than the per-kernel plans (past
    the planner's tie) is not realized: the per-kernel plans are built, and the plan's reason and
    explain() say what the rewrite was predicted at."""
    from tecc.compiler.cost.model import Workload

    class Slow(GraphStrategy):
        name = "slow_rewrite_for_the_test"

        def workload(self, program: Program, point: dict) -> Workload:
            return Workload(blocks=1, threads=32, registers={"values": 8}, dram_bytes=1e12)

        def apply(self, sch: object, program: Program, point: dict) -> None:
            raise AssertionError("a rewrite predicted slower is never realized")

    args = _matmul(64)
    registry.register(Slow())
    try:
        result = plan_program(args, "sm_90")
        k = tc.build(args, target="sim", arch="sm_90")
    finally:
        registry.unregister("slow_rewrite_for_the_test")
    assert result.group is not None and result.group.chosen is None
    assert result.plan.strategy != "slow_rewrite_for_the_test" and k.plan.steps == result.plan.steps
    assert "graph-level slow_rewrite_for_the_test() predicted" in result.plan.reason, result.plan.reason
    assert "not below the per-kernel plans" in explain(result)
    a, b = (np.random.default_rng(s).standard_normal((64, 64)).astype(np.float32) for s in (1, 2))
    c = np.full((64, 64), np.nan, np.float32)
    k(a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_a_graph_strategy_covers_the_stages_it_replaces_and_the_planner_keeps_both_rankings():
    """The group of an attention program: the four stage kernels, the rewrite's points of every
    form that applies, and each kernel's own ranking (what the tuner and explain read)."""
    ins, outs = masked_attention(1, 2, 64, 64, 64, "float16", mask="causal")
    result = plan_program(ins + outs, "sm_90")
    group = result.group
    assert group is not None and group.chosen is not None
    assert len(group.kernels) == 4 and len(result.kernels) == 4
    assert {c.strategy.name for c in group.ranked} >= {"online_contraction_wgmma", "online_contraction_mma"}
    assert ("online_contraction", "a tensor-core form takes the chain (the SIMT form is its fallback where none "
            "does)") in group.declined
    assert result.predicted_seconds == group.chosen.cost.total < group.per_kernel_seconds
