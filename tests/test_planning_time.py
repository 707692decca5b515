"""Planning-time work that must not change the plan (issue 16): a cold build compiles each CUDA
source once (the planner's ptxas check compiles the kernel the build then takes from the compile
cache), and the plan it chooses is the one the strategy's check chose."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import program_gen as pg

import tecc as tc
from tecc.codegen import nvrtc
from planning import propose_mma, propose_wgmma

from test_attention_tensor_core import masked_attention


@pytest.fixture
def compiles(monkeypatch, tmp_path):
    """A fresh compile cache and the list of the sources NVRTC compiles in this test."""
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TECC_NO_CACHE", raising=False)
    seen: list[str] = []
    inner = nvrtc._compile

    def counted(source, **kw):
        seen.append(source)
        return inner(source, **kw)

    monkeypatch.setattr(nvrtc, "_compile", counted)
    return seen


@pytest.mark.parametrize("arch,propose", [("sm_90", propose_wgmma), ("sm_80", propose_mma)])
def test_attention_cold_build_compiles_once_and_keeps_the_checked_plan(compiles, arch, propose):
    ins, outs = masked_attention(1, 2, 64, 64, 64, "float16", lse=True)
    kernel = tc.build(ins + outs, arch=arch, name="attn")
    # the check's compile is the build's: one compile of one source (no second compile of the
    # chosen kernel after the pipeline's tail passes)
    assert len(compiles) == 1, [len(s) for s in compiles]
    assert kernel.source in compiles[0]
    (res,) = kernel.resources.values()
    assert res.spill_stores == 0 and res.spill_loads == 0
    # the build's plan is the one the proposal's ptxas check chose
    compiles.clear()
    choice = propose(ins + outs, arch, "attn")
    assert choice is not None and kernel.plan.steps == choice.plan.steps
    assert compiles == []  # asked again: every check is a compile-cache hit


def test_gemm_cold_build_compiles_once(compiles):
    """The planner's spill check (compile_checked strategies) compiles the IR the build compiles."""
    M = N = K = 256
    A = tc.placeholder((M, K), "float16", name="A")
    B = tc.placeholder((K, N), "float16", name="B")
    k = tc.reduce_axis(K, name="k")
    C = tc.compute((M, N), lambda i, j: tc.cast(
        tc.sum(tc.cast(A[i, k], "float32") * tc.cast(B[k, j], "float32"), axis=k), "float16"), name="C")
    kernel = tc.build([A, B, C], arch="sm_90")
    assert kernel.plan.strategy in ("gemm_wgmma", "gemm_tensor_core")
    assert len(compiles) == 1 and kernel.source in compiles[0]


def _separately(maps):
    """The old way: every map parsed alone, then united one by one."""
    import islpy as isl

    out = isl.UnionMap("{ }")
    for m in maps:
        out = out.union(m)
    return out


@pytest.mark.parametrize("symbolic", [False, True])
def test_dependences_parsed_as_one_text_equal_the_union_of_each_map(symbolic):
    """poly.dependences parses all accesses (and the schedule) as one isl text: the same maps as
    parsing each statement's map alone and uniting them, on a scheduled GEMM (symbolic M too)."""
    from tecc.compiler.planner import plan_program
    from tecc.ir import poly

    M = tc.var("M") if symbolic else 96
    A = tc.placeholder((M, 64), "float32", name="A")
    B = tc.placeholder((64, 80), "float32", name="B")
    k = tc.reduce_axis(64, name="k")
    C = tc.compute((M, 80), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    sch = plan_program([A, B, C], "sm_90", sizes={"M": 96} if symbolic else None).schedule
    for kernel in sch.mod.kernels:
        body = kernel.body
        deps = poly.dependences(body)
        stmts = poly.collect_statements(body)
        space = poly.StmtSpace(stmts)
        writes = _separately([space.access(s, b, ix) for s in stmts for b, ix in s.writes])
        reads = _separately([space.access(s, b, ix) for s in stmts for b, ix in s.reads])
        sched = _separately([space.schedule(s) for s in stmts])
        same = writes.apply_range(reads.reverse()).union(reads.apply_range(writes.reverse()))
        same = same.union(writes.apply_range(writes.reverse()))
        assert sched.is_equal(deps.schedule)
        assert same.intersect(sched.lex_lt_union_map(sched)).is_equal(deps.relation)
        assert not deps.relation.is_empty()


def test_a_loop_carries_the_same_dependences_ordered_or_not():
    """check_parallel asks poly.dependences(ordered=False) (no lexicographic order: the costly
    isl step): at every schedule level of a scheduled GEMM and of a matmul's naive body (its k
    loop carries the sum), carried_at answers as with the ordered relation."""
    from tecc.compiler.planner import plan_program
    from tecc.ir import poly
    from tecc.passes.lower import lower

    A = tc.placeholder((48, 32), "float32", name="A")
    B = tc.placeholder((32, 40), "float32", name="B")
    k = tc.reduce_axis(32, name="k")
    C = tc.compute((48, 40), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    bodies = [kern.body for kern in plan_program([A, B, C], "sm_90").schedule.mod.kernels]
    bodies += [kern.body for kern in lower([A, B, C]).kernels]
    carried = 0
    for body in bodies:
        ordered, unordered = poly.dependences(body), poly.dependences(body, ordered=False)
        assert ordered.relation.is_subset(unordered.relation)
        for level in range(1, 2 * ordered.space.depth + 2, 2):
            a = poly.carried_at(ordered.relation, ordered.schedule, level)
            assert a == poly.carried_at(unordered.relation, unordered.schedule, level), level
            carried += a
    assert carried  # some level carries a dependence (the k loops)


def _order_cases(body):
    """(relation without reduction self-pairs, ordered relation likewise, space, entries) for
    schedules derived from `body`'s own: every swap of two loop variables (a reorder, in the
    statements that have both loops), every loop distributed (a group entry before it, the
    statements split by their position) and the statements' order reversed."""
    from tecc.ir import poly
    from tecc.passes.schedule.legality import default_entries, is_reduction_update

    unordered, ordered = poly.dependences(body, ordered=False), poly.dependences(body)
    red = [s.name for s in unordered.space.stmts if is_reduction_update(s.node)]
    rels = [(unordered.relation, ordered.relation), (unordered.without_self(red), ordered.without_self(red))]
    stmts = unordered.space.stmts
    loops = list(dict.fromkeys(lp.var for s in stmts for lp in s.loops))
    cases = []
    for x in range(len(loops)):
        for y in range(x + 1, len(loops)):
            swap = {loops[x]: loops[y], loops[y]: loops[x]}

            def entries(s, swap=swap):
                own = {lp.var for lp in s.loops}
                if not all(v in own for v in swap):
                    return default_entries(s)
                return [swap.get(e, e) if not isinstance(e, int) else e for e in default_entries(s)]
            cases.append(entries)
    for v in loops:
        def split(s, v=v):
            out = default_entries(s)
            for d, lp in enumerate(s.loops):
                if lp.var is v:
                    return out[:2 * d + 1] + [len(stmts) - stmts.index(s) if stmts.index(s) % 2 else 0] + out[2 * d + 1:]
            return out
        cases.append(split)
    cases.append(lambda s: [(9 - e) if isinstance(e, int) else e for e in default_entries(s)])
    return unordered.space, rels, cases


def _check_order_answers(body):
    """poly.keeps_order (differences of the unordered dependences' old and new schedule
    vectors) answers every case as poly.respects on the ordered relation (the isl reference)."""
    from tecc.ir import poly
    from tecc.passes.schedule.legality import _padded, default_entries, order_map

    space, rels, cases = _order_cases(body)
    width = 2 * space.depth + 3
    answers = []
    for entries in cases:
        new = space.union([space.schedule_piece(s, list(entries(s))) for s in space.stmts])
        both = space.union([space.schedule_piece(s, _padded(default_entries(s), width) + list(entries(s)), 2 * width)
                            for s in space.stmts])
        for unordered, ordered in rels:
            want = poly.respects(ordered, new)
            assert poly.keeps_order(unordered, both, width) == want
            # as check_schedule asks it: the entries constant over all statements left out
            assert poly.keeps_order(unordered, *order_map(space, entries)) == want
            answers.append(want)
    return answers


def test_keeps_order_answers_as_the_lexicographic_check_on_scheduled_kernels():
    """check_schedule's fast question (poly.keeps_order) equals the lexicographic-order check on
    the planned fp32 GEMM (a symbolic M too) and conv bodies and on naive bodies of GEMMs,
    under every loop swap, distribution and statement reversal: both answers occur."""
    from tecc.compiler.planner import plan_program
    from tecc.passes.lower import lower

    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from conv import conv_tensors

    M = tc.var("M")
    progs = []
    for m in (96, M):
        A = tc.placeholder((m, 64), "float32", name="A")
        B = tc.placeholder((64, 80), "float32", name="B")
        k = tc.reduce_axis(64, name="k")
        progs.append([A, B, tc.compute((m, 80), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")])
    conv = conv_tensors(2, 6, 6, 8, 8, 3, 1, "float32")
    bodies = [kern.body for kern in lower(conv).kernels]
    bodies += [kern.body for kern in plan_program(progs[0], "sm_90").schedule.mod.kernels]
    bodies += [kern.body for kern in plan_program(progs[1], "sm_80", sizes={"M": 96}).schedule.mod.kernels]
    bodies += [kern.body for p in progs for kern in lower(p).kernels]
    answers = [a for body in bodies for a in _check_order_answers(body)]
    assert True in answers and False in answers


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(prog=pg.programs())
def test_keeps_order_answers_as_the_lexicographic_check_on_random_programs(prog):
    """The same on the kernels of random programs (tests/program_gen.py)."""
    from tecc.passes.lower import lower

    tensors, _ = pg.to_tecc(prog)
    for kern in lower(tensors).kernels:
        _check_order_answers(kern.body)
