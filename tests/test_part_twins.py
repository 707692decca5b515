"""Repeated parts of a program planned in regions (tecc/compiler/part_twins.py): a part of an
earlier part's structure gets that part's plan and scheduled module renamed, and the result is
what planning it would give."""

from __future__ import annotations

import sys

import pytest

import tecc as tc
from tecc.compiler import regions
from tecc.compiler.part_twins import NameClash, PartRenaming, signature
from tecc.compiler.plan import Plan, Step
from tecc.compiler.planner import plan_program
from tecc.ir.tensor import producers_first

from test_realize import _Check, _layers


def _row_softmax(x, name):
    m, n = x.shape
    j = tc.reduce_axis(int(n), name=f"j_{name}")
    mx = tc.compute((m,), lambda i: tc.max(x[i, j], axis=j), name=f"{name}_max")
    return tc.compute((m, n), lambda i, c: tc.exp(x[i, c] - mx[i]), name=name)


def _part(name, rows=64, cols=128, dtype="float32", scale=1.0):
    x = tc.placeholder((rows, cols), dtype, name=f"x_{name}")
    y = tc.compute((rows, cols), lambda i, c: x[i, c] * scale, name=f"y_{name}")
    return [x, _row_softmax(y, f"p_{name}")]


def test_parts_of_one_structure_have_one_signature_and_pair_their_names():
    key_a, names_a = signature(_part("a"))
    key_b, names_b = signature(_part("b"))
    assert key_a == key_b
    pairs = dict(zip(names_a, names_b))
    assert pairs["x_a"] == "x_b" and pairs["p_a_max"] == "p_b_max" and pairs["j_p_a"] == "j_p_b"


@pytest.mark.parametrize("change", [dict(rows=32), dict(cols=256), dict(dtype="float16"), dict(scale=2.0)])
def test_a_shape_dtype_or_constant_apart_is_another_structure(change):
    assert signature(_part("a"))[0] != signature(_part("b", **change))[0]


def test_two_uses_of_one_tensor_are_not_two_tensors():
    """The signature keeps identities: x*x and x*y (two placeholders of one shape) differ."""
    x = tc.placeholder((8,), name="x")
    y = tc.placeholder((8,), name="y")
    square = tc.compute((8,), lambda i: x[i] * x[i], name="s")
    product = tc.compute((8,), lambda i: x[i] * y[i], name="s")
    assert signature([x, square])[0] != signature([x, y, product])[0]


def test_a_renaming_that_would_merge_two_names_is_refused():
    with pytest.raises(NameClash):
        PartRenaming(["a", "b"], ["c", "c"])
    renaming = PartRenaming(["mm_2", "view_3"], ["mm_14", "view_40"])
    with pytest.raises(NameClash):   # mm_14_kernel exists already as another identifier's image
        renaming.kernel("mm_2_kernel"), renaming.kernel("mm_14_kernel")


def test_a_plan_is_renamed_in_its_addresses_and_names_not_in_its_words():
    renaming = PartRenaming(["mm_2", "view_3", "tma"], ["mm_14", "view_40", "tma"])
    plan = Plan((Step("stage_operand", {"stage": "mm_2_kernel/mm_2", "tensor": "view_3", "layout": "swizzle"}),
                 Step("pipeline", {"loop": "mm_2_kernel/k_tile", "producer": "tma", "stages": 3}),
                 Step("reorder", {"loops": ["mm_2_kernel/i_o", "mm_2_kernel/j_o"]})),
                "gemm_wgmma", "mm_2_kernel: gemm_wgmma")
    renamed = renaming.plan(plan)
    assert renamed.steps[0].args == {"stage": "mm_14_kernel/mm_14", "tensor": "view_40", "layout": "swizzle"}
    assert renamed.steps[1].args == {"loop": "mm_14_kernel/k_tile", "producer": "tma", "stages": 3}
    assert renamed.steps[2].args == {"loops": ["mm_14_kernel/i_o", "mm_14_kernel/j_o"]}
    assert renamed.reason == "mm_14_kernel: gemm_wgmma" and renamed.strategy == "gemm_wgmma"


def test_later_layers_are_renamed_and_plan_as_if_planned_themselves(monkeypatch):
    """Three layers of GEMM, softmax, GEMM, softmax: the second and third layers' parts are the
    first's renamed (their planning has no program of its own), and plan, composed module and
    every kernel's ranking are those of planning each part itself (TECC_PART_TWINS=0)."""
    monkeypatch.setenv("TECC_COMPILE_THREADS", "1")
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("TECC_PART_TWINS", mode)
        results[mode] = plan_program(_layers(3), "sm_90", compile_check=_Check(linger=False))
    itself, renamed = results["0"], results["1"]
    assert renamed.plan.strategy == "regions"
    assert all(p.program is not None for p in itself.parts)
    twins = [p for p in renamed.parts if p.program is None]
    assert len(twins) >= len(renamed.parts) // 3, f"{len(twins)} of {len(renamed.parts)} parts renamed"
    assert renamed.plan.to_json() == itself.plan.to_json()
    assert str(renamed.composed) == str(itself.composed)
    assert [kp.kernel for p in renamed.parts for kp in p.kernels] == [kp.kernel for p in itself.parts for kp in p.kernels]


def test_a_renamed_plan_replays_to_the_composed_module(tmp_path, monkeypatch):
    """With dumps on, build replays the plan on the program (pipeline.schedule_module): the
    renamed parts' steps must address the later layers' own kernels and loops."""
    monkeypatch.setenv("TECC_BUILD_CACHE", "0")
    planned = tc.build(_layers(2), "cuda", arch="sm_90", name="layers")
    replayed = tc.build(_layers(2), "cuda", arch="sm_90", name="layers", dump_ir=tmp_path)
    assert not replayed.fallbacks, replayed.fallbacks
    assert replayed.plan.to_json() == planned.plan.to_json()
    assert replayed.source == planned.source


def _emitted_both_ways(funcs):
    from tecc.codegen.cuda import emit_kernel, emit_parts
    from tecc.ir.index_checks import index_check_sites, site_codes

    codes = site_codes(index_check_sites(funcs))
    _, texts = emit_parts(funcs)
    return texts, [emit_kernel(f, codes) for f in funcs]


def test_kernels_of_one_structure_are_written_from_one_text_as_the_emitter_writes_them():
    """codegen/twins.py Templates: the later layers' kernels (tensor-core GEMMs with staged,
    swizzled operands, row kernels) written from one text are what emitting each gives."""
    from tecc.codegen.twins import kernel_structure

    funcs = tc.build(_layers(3), "cuda", arch="sm_90").module.kernels
    keys = [kernel_structure(f)[0] for f in funcs]
    assert len(set(keys)) < len(keys) - 3, "no kernels of one structure to write from one text"
    written, emitted = _emitted_both_ways(funcs)
    assert written == emitted


def test_a_name_the_emitter_changes_is_emitted_from_its_ir():
    """A tensor named after a CUDA built-in (`max`, `exp`: the emitter writes `max_`) is no
    placeholder's image; the kernels of its structure after it still come from one text."""
    def doubled_exp(x, name):
        return tc.compute((64, 32), lambda i, j: tc.exp(x[i, j]) * 2.0, name=name)

    ins = [tc.placeholder((64, 32), name=source) for source in ("max", "x1", "x2")]
    outs = [doubled_exp(x, name) for x, name in zip(ins, ("exp", "y1", "y2"))]
    funcs = tc.build(ins + outs, "cuda", arch="sm_90").module.kernels
    written, emitted = _emitted_both_ways(funcs)
    assert written == emitted
    by_kernel = {f.name: text for f, text in zip(funcs, written)}
    assert "__restrict__ max_" in by_kernel["exp_kernel"] and "max_" not in by_kernel["y2_kernel"]


def _chain(prefix, stages=3000):
    x = tc.placeholder((16,), "float32", name=f"{prefix}x")
    t = x
    for i in range(stages):
        t = (lambda prev, i: tc.compute((16,), lambda j: prev[j] * 1.5 + 1.0, name=f"{prefix}c{i}"))(t, i)
    return [x, t]


def test_the_signature_of_a_part_deeper_than_pythons_recursion_limit():
    """A part that reaches back through a long chain of stages (resnet50's last region reaches
    back through every layer) is described producers first, as the cut that made it rebuilds it:
    a chain of 3000 computes, where the default limit (1000 frames) raised RecursionError out of
    the planner. Two such chains under other names have one structure."""
    text, names = signature(_chain("a_"))
    other, other_names = signature(_chain("b_"))
    assert len(names) == 3002 and {"a_x", "a_c0", "a_c2999"} <= set(names)
    assert text == other and [n.replace("a_", "b_", 1) for n in names] == other_names


def test_a_deep_part_is_cut_and_described_a_stage_at_a_time():
    """Under torch.compile every Python call also counts against the interpreter's C recursion
    limit, which sys.setrecursionlimit does not raise: on Python 3.12 resnet50 through the backend
    raised RecursionError ~5000 frames deep while describing its last region, the limit at
    100,000. The cut and the description take the stages producers first (ir/tensor.py
    producers_first) and recurse through one stage at a time: emulated with Python's limit 150
    frames above the test's own depth."""
    x, out = _chain("d_")
    chain = {t.name: t for t in producers_first([out])}
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 150)
    try:
        part = regions.cut([out], [chain["d_c1000"]])
        text, names = signature(part)
    finally:
        sys.setrecursionlimit(limit)
    assert [t.name for t in part] == ["d_c1000", "d_c2999"] and part[0].is_placeholder
    assert names[:2] == ["d_c1000", "j"] and len(names) == 2001     # 2000 tensors, the axis j
    assert list(chain)[:2] == ["d_x", "d_c0"] and len(chain) == 3001
