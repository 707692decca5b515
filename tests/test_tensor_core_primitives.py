"""The tensor-core primitives one by one (tecc/passes/schedule/tensor_core.py): tensorize maps the
block tile onto an intrinsic row and nothing more; stage_operand, pipeline, pipeline_fragments,
warp_specialize, tile_order, persistent and epilogue each refine the kernel, each a plan step and a
dump of its own, each refusing what it cannot build with a ScheduleError that names the primitive.

Every prefix of a strategy's plan is a kernel that runs: each is run in the emulator against
NumPy in float64 on fresh random inputs, outputs poisoned with NaN, under the bound of
tests/test_tensorize.py (exact products, float32 sums: (K + 1)·2⁻²⁴·Σ|a·b|, plus the output's
rounding; tf32 inputs lose up to 2⁻¹⁰ of each factor)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan
from tecc.ir.errors import ScheduleError
from tecc.ir.stmt import AsyncCopy, AsyncWait, Barrier, BarrierWait, MatrixMultiply, WarpgroupMatrixMultiply, iter_stmts
from tecc.passes.lower import lower
from tecc.passes.schedule import tensor_core
from tecc.runtime.sim.banks import count_bank_conflicts
from nvrtc_checks import needs_nvrtc
from tensor_core_steps import schedule_tensor_core

OUTPUT_EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 0.0}


def np_dtype(name: str) -> Any:
    if name in ("bfloat16", "float8_e4m3", "float8_e5m2"):
        import ml_dtypes  # type: ignore[import-untyped]

        return {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3": ml_dtypes.float8_e4m3fn,
                "float8_e5m2": ml_dtypes.float8_e5m2}[name]
    return np.dtype(name)


class Gemm:
    """C[b?, i, j] = out(Σ_k A·B (+ bias[j], relu)) with A [i, k] or [k, i] (a_t), B [k, j] or [j, k] (b_t)."""

    def __init__(self, m: int, n: int, k: int, dtype: str = "float16", *, a_t: bool = False, b_t: bool = False,
                 batch: int = 0, out: str = "float32", bias: bool = False, a_strides: str | None = None) -> None:
        self.m, self.n, self.k, self.dtype, self.a_t, self.b_t, self.batch, self.out, self.bias = (
            m, n, k, dtype, a_t, b_t, batch, out, bias)
        lead = (batch,) if batch else ()
        A = tc.placeholder(lead + ((k, m) if a_t else (m, k)), dtype, "A", strides=a_strides)
        B = tc.placeholder(lead + ((n, k) if b_t else (k, n)), dtype, "B")
        r = tc.reduce_axis(k, "r")
        bs = tc.placeholder((n,), "float32", "bias") if bias else None

        def body(*ix: Any) -> Any:
            *bx, i, j = ix
            a = A[(*bx, r, i)] if a_t else A[(*bx, i, r)]
            b = B[(*bx, j, r)] if b_t else B[(*bx, r, j)]
            acc = tc.sum(tc.cast(a, "float32") * tc.cast(b, "float32"), axis=r)
            if bs is not None:
                acc = tc.maximum(acc + bs[j], 0.0)
            return tc.cast(acc, out)
        C = tc.compute(lead + (m, n), body, name="C")
        self.tensors = [A, B] + ([bs] if bs is not None else []) + [C]

    def check(self, plan: Plan, what: str, seed: int = 0) -> Any:
        g = np.random.default_rng(seed)
        lead = (self.batch,) if self.batch else ()
        dtype = np_dtype(self.dtype)
        a = g.uniform(-1.5, 1.5, lead + ((self.k, self.m) if self.a_t else (self.m, self.k))).astype(dtype)
        b = g.uniform(-1.5, 1.5, lead + ((self.n, self.k) if self.b_t else (self.k, self.n))).astype(dtype)
        bias = g.uniform(-2, 2, (self.n,)).astype(np.float32)
        c = np.full(lead + (self.m, self.n), np.nan, np_dtype(self.out))
        f = tc.build(self.tensors, target="sim", plan=plan)
        f(*([a, b, bias, c] if self.bias else [a, b, c]))
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        if self.a_t:
            a64 = np.swapaxes(a64, -1, -2)
        if self.b_t:
            b64 = np.swapaxes(b64, -1, -2)
        want, size = a64 @ b64, np.abs(a64) @ np.abs(b64)
        bound = (self.k + 1) * 2.0**-24 * size + (2.0**-9 * size if self.dtype == "float32" else 0.0)
        if self.bias:
            want = np.maximum(want + bias, 0.0)
        bound = bound + OUTPUT_EPS[self.out] * (np.abs(want) + bound)
        got = c.astype(np.float64)
        err = np.where(np.isnan(got), np.inf, np.abs(got - want) - bound)
        if (err > 0).any():
            i = np.unravel_index(int(np.argmax(err)), err.shape)
            raise AssertionError(f"{what}: {(err > 0).sum()} of {err.size} elements off; worst at {tuple(map(int, i))}: "
                                 f"got {got[i]!r}, want {want[i]!r} (bound {bound[i]:.3g})\n{plan}")
        return f


def conv_nhwc(c: int, f: int, stride: int) -> list[Any]:
    """Y[n, p, q, f] = Σ X[n, p·stride + r - 1, q·stride + s - 1, c]·W[r, s, c, f], zero padding by where()."""
    X = tc.placeholder((1, 8, 8, c), "float16", "X")
    W = tc.placeholder((3, 3, c, f), "float16", "W")
    r, s, cc = tc.reduce_axis(3, "r"), tc.reduce_axis(3, "s"), tc.reduce_axis(c, "c")
    po = (8 + 2 - 3) // stride + 1

    def body(n: Any, p: Any, q: Any, o: Any) -> Any:
        h, w = p * stride + r - 1, q * stride + s - 1
        x = tc.where((h >= 0) & (h < 8) & (w >= 0) & (w < 8), X[n, h, w, cc], tc.const(0, "float16"))
        return tc.cast(tc.sum(tc.cast(x, "float32") * tc.cast(W[r, s, cc, o], "float32"), axis=[cc, r, s]),
                       "float32")
    return [X, W, tc.compute((1, po, po, f), body, name="Y")]


def steps_of(tensors: list[Any], stage: str = "C", **kw: Any) -> list[Any]:
    return list(schedule_tensor_core(tc.Schedule(tensors), stage, **kw).plan.steps)


TF32 = "mma.m16n8k8.f32.tf32"
FORMS: dict[str, tuple[Callable[[], Gemm], dict[str, Any]]] = {
    "mma f16, partial tiles": (lambda: Gemm(96, 80, 72), dict(stages=3)),
    "mma bf16 A[k,i] B[j,k], fragments pipelined, grouped order, staged epilogue": (
        lambda: Gemm(136, 144, 200, "bfloat16", a_t=True, b_t=True, out="bfloat16"),
        dict(block=(64, 64), k_tile=64, stages=3, fragment_pipeline=True, group_m=2, staged_output=True)),
    "mma tf32 A[k,i]": (lambda: Gemm(72, 64, 40, "float32", a_t=True),
                        dict(intrinsic=TF32, block=(64, 64), k_tile=16, stages=2)),
    "mma f16 strided A (launch-time dispatch)": (lambda: Gemm(64, 64, 96, a_strides="any"), dict(stages=2)),
    "wgmma f16 A[k,i], staged epilogue": (lambda: Gemm(80, 64, 136, a_t=True, out="float16"),
                                          dict(intrinsic="wgmma", block=(64, 64), warps=(4, 1), k_tile=64, stages=3,
                                               staged_output=True)),
    "wgmma tf32 X from registers": (lambda: Gemm(64, 64, 72, "float32", a_t=True, b_t=True),
                                    dict(intrinsic="wgmma.tf32", block=(64, 64), warps=(4, 1), k_tile=32, stages=3)),
    "TMA f16 B[j,k], batch, bias, persistent, TMA-store epilogue": (
        lambda: Gemm(100, 128, 136, b_t=True, batch=2, out="float16", bias=True),
        dict(intrinsic="wgmma", block=(64, 64), warps=(4, 1), k_tile=64, stages=3, producer="tma", persistent=3,
             epilogue="tma")),
    "TMA tf32 Cᵀ = Bᵀ·Aᵀ, 2 stages": (lambda: Gemm(64, 128, 72, "float32"),
                                      dict(intrinsic="wgmma.tf32", block=(64, 64), warps=(4, 1), k_tile=32, stages=2,
                                           producer="tma")),
}


@pytest.mark.parametrize("form", FORMS)
def test_every_prefix_of_the_plan_is_a_kernel_that_matches_numpy(form: str) -> None:
    make, schedule = FORMS[form]
    gemm = make()
    steps = steps_of(gemm.tensors, **schedule)
    assert steps[0].primitive == "tensorize"
    for n in range(1, len(steps) + 1):
        gemm.check(Plan(tuple(steps[:n])), f"{form}, after {steps[n - 1].primitive}", seed=n)


def test_every_prefix_of_an_implicit_gemm_convolution_matches_numpy() -> None:
    tensors = conv_nhwc(16, 32, 1)
    steps = steps_of(tensors, "Y", stages=3, staged_output=True)
    g = np.random.default_rng(3)
    x = g.uniform(-1, 1, (1, 8, 8, 16)).astype(np.float16)
    w = g.uniform(-1, 1, (3, 3, 16, 32)).astype(np.float16)
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
    want = np.zeros((1, 8, 8, 32))
    size = np.zeros((1, 8, 8, 32))
    for r in range(3):
        for s in range(3):
            patch = xp[:, r:r + 8, s:s + 8, :]
            want += patch @ w[r, s].astype(np.float64)
            size += np.abs(patch) @ np.abs(w[r, s].astype(np.float64))
    for n in range(1, len(steps) + 1):
        y = np.full((1, 8, 8, 32), np.nan, np.float32)
        tc.build(tensors, target="sim", plan=Plan(tuple(steps[:n])))(x, w, y)
        err = np.where(np.isnan(y), np.inf, np.abs(y - want) - (3 * 3 * 16 + 1) * 2.0**-24 * size)
        assert (err <= 0).all(), f"conv after {steps[n - 1].primitive}: worst {float(err.max())}"


def test_tensorize_alone_loads_elements_into_one_plain_buffer() -> None:
    """The kernel tensorize leaves: no cp.async, no swizzle, one buffer; per k tile a barrier, the
    element loads, the barrier that publishes them, the mma."""
    gemm = Gemm(64, 64, 64)
    sch = tc.Schedule(gemm.tensors)
    sch.tensorize("C", block=(64, 64), warps=(2, 2), k_tile=32)
    func = sch.mod.kernels[0]
    text = str(func)
    assert "cp.async" not in text and "swizzle" not in text
    assert "A_shared: float16[1, 64, 32] @shared" in text
    assert "unpipelined" in func.attr("tensorize") and "not staged" in func.attr("tensorize")
    gemm.check(sch.plan, "tensorize alone")


def test_stage_operand_chooses_the_layout_and_the_copies() -> None:
    """layout 'swizzle' makes ldmatrix conflict-free; 'none' keeps a plain tile (ldmatrix then
    conflicts) with the same cp.async copies; both match NumPy."""
    gemm = Gemm(64, 64, 128)
    conflicts = {}
    for layout in ("swizzle", "none"):
        sch = tc.Schedule(gemm.tensors)
        k_tiles = sch.tensorize("C", block=(64, 64), warps=(2, 2), k_tile=64)
        sch.stage_operand("C", "A", layout)
        sch.stage_operand("C", "B", layout)
        sch.pipeline(k_tiles, 2)
        assert "cp.async.cg 16B A_shared" in str(sch.mod)
        with count_bank_conflicts() as banks:
            gemm.check(sch.plan, f"layout {layout}")
        conflicts[layout] = banks.conflicts("A_shared") + banks.conflicts("B_shared")
    assert conflicts["swizzle"] == 0 and conflicts["none"] > 0, conflicts


def test_a_wgmma_gemm_is_built_in_seven_primitive_steps_each_its_own_dump(tmp_path: Path) -> None:
    """The planner's Hopper GEMM (sm_90, 4096³): its plan is tensorize, stage_operand x2, pipeline,
    warp_specialize, persistent, epilogue; the dumps hold one file per step, each a different kernel."""
    gemm = Gemm(4096, 4096, 4096, out="float16")
    f = tc.build(gemm.tensors, target="sim", arch="sm_90", dump_ir=str(tmp_path))
    steps = [s.primitive for s in f.plan.steps]
    assert f.plan.strategy == "gemm_wgmma", f.plan.reason
    assert steps[:5] == ["tensorize", "stage_operand", "stage_operand", "pipeline", "warp_specialize"], steps
    assert len(set(steps)) >= 5
    dumps = sorted(tmp_path.glob("[0-9][0-9]_*.txt"))
    for name in set(steps):
        assert any(p.name.endswith(f"_{name}.txt") for p in dumps), (name, [p.name for p in dumps])
    texts = [p.read_text() for p in dumps if any(p.name.endswith(f"_{s}.txt") for s in steps)]
    assert len(texts) == len(steps) and len(set(texts)) == len(texts)
    assert "# tensor_core = C: wgmma.m64n" in texts[-1]   # the record, in the dump
    assert "tensor_core" not in dict(f.module.kernels[0].attrs)   # ... and not in the final kernel


def test_the_strategies_apply_the_primitives_in_order() -> None:
    gemm = Gemm(4096, 4096, 4096)
    f = tc.build(gemm.tensors, target="sim", arch="sm_80")
    assert f.plan.strategy == "gemm_tensor_core"
    assert [s.primitive for s in f.plan.steps][:4] == ["tensorize", "stage_operand", "stage_operand", "pipeline"]
    assert "stages" not in f.plan.steps[0].args   # tensorize maps the tile onto the row, nothing more


def test_a_plan_recorded_with_the_single_tensorize_step_builds_the_same_kernel() -> None:
    """Tuning databases and caches keep plans whose one `tensorize` step held the whole kernel:
    Plan.from_json reads them and Schedule.replay expands the step into the primitives."""
    gemm = Gemm(192, 128, 128, out="float16")
    legacy = {"strategy": "manual", "reason": "recorded earlier", "steps": [{"primitive": "tensorize", "args": {
        "stage": "C", "intrinsic": "wgmma", "block": [64, 128], "warps": [4, 1], "k_tile": 64, "stages": 3,
        "producer": "tma", "persistent": 2, "epilogue": "tma"}}]}
    old = tc.Schedule(gemm.tensors, Plan.from_json(json.dumps(legacy)))
    new = schedule_tensor_core(tc.Schedule(gemm.tensors), "C", "wgmma", (64, 128), (4, 1), 64, 3, producer="tma",
                               persistent=2, epilogue="tma")
    assert str(old.mod) == str(new.mod)
    assert [s.primitive for s in old.plan.steps] == [s.primitive for s in new.plan.steps]
    gemm.check(Plan.from_json(legacy), "a legacy plan")


def _tensorized(gemm: Gemm, intrinsic: str = "auto", block: tuple[int, int] = (64, 64),
                warps: tuple[int, int] = (2, 2), k_tile: int = 32) -> Any:
    return tensor_core.tensorize(lower(gemm.tensors).kernels[0], "C", intrinsic, block, warps, k_tile)


def test_each_primitive_refuses_what_it_cannot_build() -> None:
    gemm = Gemm(128, 128, 128)
    mma = _tensorized(gemm)
    wg = _tensorized(gemm, "wgmma", (64, 64), (4, 1), 64)
    refusals: list[tuple[Callable[[], Any], str]] = [
        (lambda: tensor_core.pipeline(lower(gemm.tensors).kernels[0], "k_tile", 2), "not a tensorized kernel"),
        (lambda: tensor_core.pipeline(mma, "k_step", 2), "'k_step' is not the k-tile loop"),
        (lambda: tensor_core.pipeline(mma, "k_tile", 9), r"stages must be 2\.\.8"),
        (lambda: tensor_core.pipeline(mma, "k_tile", 2, "threads"), "producer 'threads' is not one of"),
        (lambda: tensor_core.pipeline(tensor_core.pipeline(mma, "k_tile", 2), "k_tile", 3), "pipelined already"),
        (lambda: tensor_core.pipeline(mma, "k_tile", 2, "tma"), "TMA loads are built for the wgmma kernels"),
        (lambda: tensor_core.pipeline(wg, "k_tile", 2, "tma"), "a TMA ring loads staged tiles; stage A and B"),
        (lambda: tensor_core.stage_operand(mma, "C", "D"), "'D' is not an operand of the contraction"),
        (lambda: tensor_core.stage_operand(mma, "C", "A", "padded"), "layout 'padded' is not one of"),
        (lambda: tensor_core.stage_operand(wg, "C", "A", "none"), "128-byte swizzle"),
        (lambda: tensor_core.stage_operand(tensor_core.stage_operand(mma, "C", "A"), "C", "A"), "staged already"),
        (lambda: tensor_core.pipeline_fragments(mma, "k_tile"), "needs the cp.async ring"),
        (lambda: tensor_core.warp_specialize(wg, "C"), "apply pipeline\\(..., producer='tma'\\) first"),
        (lambda: tensor_core.persistent(tensor_core.pipeline(wg, "k_tile", 3), "C", 4), "apply warp_specialize first"),
        (lambda: tensor_core.persistent(wg, "C", 0), "blocks must be a positive integer"),
        (lambda: tensor_core.tile_order(wg, "C", 4), "tile_order orders the blocks of the mma.sync kernel"),
        (lambda: tensor_core.tile_order(mma, "C", 0), "group_m must be the row tiles per group"),
        (lambda: tensor_core.epilogue(wg, "C", "tma"), "built for the warp-specialized TMA ring"),
        (lambda: tensor_core.epilogue(mma, "C", "smem"), "the epilogue is one of"),
    ]
    for call, message in refusals:
        with pytest.raises(ScheduleError, match=message):
            call()


def test_another_primitive_in_between_ends_the_tensor_core_steps() -> None:
    """The record describes the kernel tensorize emitted; once another primitive rewrote it, a
    tensor-core primitive would drop that rewrite, so it refuses."""
    gemm = Gemm(64, 64, 64)
    sch = tc.Schedule(gemm.tensors)
    k_tiles = sch.tensorize("C", block=(64, 64), warps=(2, 2), k_tile=32)
    sch.unroll(f"{k_tiles.kernel}/zero")
    with pytest.raises(ScheduleError, match="not a tensorized kernel"):
        sch.pipeline(k_tiles, 2)


def test_the_tma_ring_without_warp_specialization_waits_on_mbarriers() -> None:
    """pipeline(producer='tma') alone: every thread waits on full[kt % S], then the block's
    barrier frees the stage thread 0 refills; no cp.async; warp_specialize then splits the roles."""
    gemm = Gemm(64, 64, 256)
    sch = tc.Schedule(gemm.tensors)
    k_tiles = sch.tensorize("C", "wgmma", block=(64, 64), warps=(4, 1), k_tile=64)
    for operand in sch.gemm_operands("C"):
        sch.stage_operand("C", operand)
    sch.pipeline(k_tiles, 3, "tma")
    func = sch.mod.kernels[0]
    assert not any(isinstance(s, AsyncWait) for s in iter_stmts(func.body))
    (loop,) = [s for s in iter_stmts(func.body) if getattr(s, "var", None) is not None and s.var.name == "k_tile"]
    order = [getattr(s, "dispatch_name", type(s).__name__) for s in iter_stmts(loop.body) if isinstance(s, (BarrierWait, Barrier,
                                                                                WarpgroupMatrixMultiply))]
    assert order == ["BarrierWait", "Barrier", "WarpgroupMatrixMultiply"], order
    assert "not warp-specialized" in func.attr("tensorize")
    gemm.check(sch.plan, "TMA ring, one role")
    sch.warp_specialize("C")
    assert "TMA producer warpgroup" in sch.mod.kernels[0].attr("tensorize")
    gemm.check(sch.plan, "TMA ring, warp-specialized")


def test_a_tensor_multiplied_by_its_own_transpose_is_one_operand_to_stage() -> None:
    A = tc.placeholder((64, 96), "float16", "A")
    r = tc.reduce_axis(96, "r")
    C = tc.compute((64, 64), lambda i, j: tc.sum(tc.cast(A[i, r], "float32") * tc.cast(A[j, r], "float32"), axis=r),
                   name="C")
    sch = tc.Schedule([A, C])
    k_tiles = sch.tensorize("C", block=(64, 64), warps=(2, 2), k_tile=32)
    assert sch.gemm_operands("C") == ("A",)
    sch.stage_operand("C", "A")
    sch.pipeline(k_tiles, 2)
    copies = [s for s in iter_stmts(sch.mod.kernels[0].body) if isinstance(s, AsyncCopy)]
    assert len(copies) == 2 * 2    # both tiles copied, in the prologue and in the loop
    g = np.random.default_rng(4)
    a = g.uniform(-1, 1, (64, 96)).astype(np.float16)
    c = np.full((64, 64), np.nan, np.float32)
    tc.build([A, C], target="sim", plan=sch.plan)(a, c)
    a64 = a.astype(np.float64)
    assert np.abs(c - a64 @ a64.T).max() <= 97 * 2.0**-24 * (np.abs(a64) @ np.abs(a64).T).max()


def test_the_mma_counts_do_not_change_with_the_refinements() -> None:
    """tensorize fixes the mapping: the mma statements of the kernel are the same before and after
    the other primitives (the ring adds loads, not compute)."""
    gemm = Gemm(128, 128, 128)
    sch = tc.Schedule(gemm.tensors)
    k_tiles = sch.tensorize("C", block=(128, 128), warps=(2, 2), k_tile=32)
    count = lambda: sum(isinstance(s, MatrixMultiply) for s in iter_stmts(sch.mod.kernels[0].body))  # noqa: E731
    before = count()
    for operand in sch.gemm_operands("C"):
        sch.stage_operand("C", operand)
    sch.pipeline(k_tiles, 4)
    assert count() == before == 1


@needs_nvrtc
def test_every_prefix_of_the_hopper_plan_compiles_for_sm_90a() -> None:
    """NVRTC/ptxas for sm_90a at 1024³ (128 x 256, 3 stages): every kernel on the way to the
    planner's Hopper GEMM compiles, none with wgmmas ptxas serializes (C7515); from the staged
    operands on, none spills (the element-loaded forms before hold a whole tile in registers)."""
    from tecc.compiler.pipeline import wgmma_serialized

    gemm = Gemm(1024, 1024, 1024, out="float16")
    steps = steps_of(gemm.tensors, intrinsic="wgmma", block=(128, 256), warps=(8, 1), k_tile=64, stages=3,
                     producer="tma", persistent=132, epilogue="tma")
    for n in range(1, len(steps) + 1):
        f = tc.build(gemm.tensors, target="cuda", arch="sm_90", plan=Plan(tuple(steps[:n])))
        (r,) = f.resources.values()
        assert wgmma_serialized(f.compile_log) is None, (steps[n - 1].primitive, f.compile_log)
        if n >= 3:
            assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), (steps[n - 1].primitive, r)
