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
from test_gather_scatter import embedding_backward  # noqa: E402
from test_online_contraction import attention  # noqa: E402


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
    assert not imported & {"online_contraction", "online_backward", "row_fused", "split_rows", "split_row_group",
                           "column_reduction"}


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


def test_deterministic_is_a_policy_of_the_one_target_and_a_scatter_asks_no_rewrite_without_it():
    """build(deterministic=True) plans for the Target carrying the policy (so the build cache's key
    tells the two builds apart); without it a scatter's stages are planned per kernel (the atomic
    form against the masked sum) and no graph-level strategy is asked; with it the rewrites are
    asked as for any program and the atomic form declines."""
    from tecc.compiler.planner import SCATTER_PER_KERNEL

    args = embedding_backward(512, 64, 40)               # dY[512, 64] scattered into dW[40, 64]
    free = plan_program(args, "sm_90")
    assert free.group is not None and not free.group.ranked
    assert {why for _, why in free.group.declined} == {SCATTER_PER_KERNEL}
    assert free.plan.strategy.startswith("scatter_atomic"), free.plan
    strict = plan_program(args, resolve_target("sm_90", deterministic=True))
    assert strict.target.deterministic and strict.group is not None
    assert SCATTER_PER_KERNEL not in {why for _, why in strict.group.declined}
    assert any(name == "scatter_atomic" and "deterministic" in why for kp in strict.kernels for name, why in kp.declined)
    k = tc.build(args, target="sim", arch="sm_90", deterministic=True)
    assert k.planning.target.deterministic and k.planning.program.target.deterministic
    assert "atomic_add" not in str(k.module)
    assert repr(resolve_target("sm_90", deterministic=True)) != repr(resolve_target("sm_90"))
    rng = np.random.default_rng(3)
    dy = rng.standard_normal((512, 64)).astype(np.float32)
    ix = rng.integers(0, 40, 512).astype(np.int32)
    out = np.full((40, 64), np.nan, np.float32)
    k(dy, ix, out)
    want = np.zeros((40, 64))
    np.add.at(want, ix, dy.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def _attention_backward(d: int = 64) -> list[tc.Tensor]:
    B, S = tc.var("B"), tc.var("S")
    ins, outs = attention(B, 2, S, d, dtype="float16", causal=True)
    return tc.grad(outs[0], ins).args


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_backward_of_attention_is_a_graph_strategy_weighed_against_the_unfused_kernels(arch):
    """online_backward_mma claims every kernel of tc.grad's FlashAttention-2 program and is priced
    at the program's sizes against their per-kernel plans (the score-sized stages the rewrite
    never writes); its tilings are tried in the order they rank at the nominal length, whatever
    the sizes (their weighing follows the sizes, their order does not)."""
    from tecc.compiler.pipeline import refuse_spills

    args = _attention_backward()
    chosen = {}
    for sizes in ({}, {"B": 1, "S": 128}, {"B": 4, "S": 4096}):
        result = plan_program(args, arch, sizes=sizes, compile_check=refuse_spills)
        group = result.group
        assert group is not None and group.chosen is not None, result.plan.reason
        assert group.chosen.strategy.name == "online_backward_mma"
        assert set(group.kernels) == {kp.kernel for kp in result.kernels} and len(group.kernels) >= 6
        assert group.chosen.cost.total < group.per_kernel_seconds
        assert "the backward of an online contraction" in result.plan.reason
        assert "for the per-kernel plans of" in result.plan.reason
        chosen[str(sizes)] = dict(result.plan.steps[0].args)
    assert len({str(sorted(c.items())) for c in chosen.values()}) == 1, chosen


def test_a_row_group_with_column_reductions_is_row_fuseds_point_priced_with_its_combine_kernel():
    """Layer norm's backward (dX, dγ, dβ): row_fused's one point walks the rows with one wave of
    blocks of the build's Target (its SMs x 4 resident blocks: 432 on sm_80, 528 on sm_90, then as
    few as give each block the same rows), priced with the combine kernel as its second launch,
    against the per-kernel plans."""
    sys.path.insert(0, str(ROOT / "examples"))
    import row_backward  # examples/row_backward.py

    args = row_backward.layer_norm_backward(8192, 768).args
    for arch, sms in (("sm_80", 108), ("sm_90", 132)):
        result = plan_program(args, arch)
        group = result.group
        assert group is not None and group.chosen is not None and group.chosen.strategy.name == "row_fused"
        step = result.plan.steps[0].args
        wave = 4 * sms
        blocks = -(-8192 // -(-8192 // wave))      # 16 rows per block at 512 blocks, 19 at 432
        assert step["row_blocks"] == blocks and step["prefetch"] is True, step
        assert group.chosen.workload.then is not None and group.chosen.workload.blocks == blocks
        assert group.chosen.cost.total < group.per_kernel_seconds
        assert "walking the rows" in result.plan.reason
