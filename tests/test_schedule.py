"""Schedule primitives: the hand-written GEMM schedule of the issue, plan replay, illegal requests.

The GEMM runs on the SIMT emulator (non-divisible and symbolic M), compiles for sm_90 with NVRTC
without spills, and (marked gpu) runs on the device through tc.build(sch)."""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan
from tecc.compiler.schedule import Schedule
from tecc.ir.errors import ScheduleError
from tecc.ir.stmt import Module
from tecc.passes.default_schedule import default_schedule
from tecc.passes.simplify import simplify
from tecc.passes.unique_names import unique_names
from tecc.passes.verify import verify_module
from tecc.runtime.host import HostProgram
from tecc.runtime.sim import SimExecutor


def finish(mod: Module) -> Module:
    """The rest of build()'s pipeline after the schedule (what tc.build(sch) will run)."""
    mod = unique_names(simplify(default_schedule(mod)))
    verify_module(mod)
    return mod


def run_sim(mod: Module, arrays: list[np.ndarray]) -> None:
    mod = finish(mod)
    SimExecutor(HostProgram.from_module(mod), {k.name: k for k in mod.kernels})(*arrays)


def matmul(M: object, N: int = 128, K: int = 64) -> tuple[tc.Tensor, tc.Tensor, tc.Tensor]:
    A = tc.placeholder((M, K), "float32", name="A")
    B = tc.placeholder((K, N), "float32", name="B")
    k = tc.reduce_axis(K, name="k")
    C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    return A, B, C


def gemm_schedule(tensors: list[tc.Tensor], dump_ir: object = None) -> Schedule:
    """The GEMM schedule of the issue, by hand: 64x64 block tile, 16x16 threads with a 4x4
    register tile each, k tiles of 16 staged in shared memory (padded rows), C in registers."""
    sch = Schedule(tensors, dump_ir=dump_ir)
    i, j, k = sch.get_loops("C")
    io, ty, ii = sch.split(i, factors=[None, 16, 4])
    jo, tx, ji = sch.split(j, factors=[None, 16, 4])
    ko, ki = sch.split(k, 16)
    sch.reorder(io, jo, ty, tx, ko, ki, ii, ji)
    sch.bind(io, "blockIdx.y")
    sch.bind(jo, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    As = sch.cache_read("C", "A", "shared")
    sch.storage_align(As, 1)
    sch.compute_at(As, ko)
    Bs = sch.cache_read("C", "B", "shared")
    sch.compute_at(Bs, ko)
    sch.cache_write("C", "local")
    for lp in sch.get_loops("C.local"):
        if lp.name.startswith(("i_i", "j_i")):
            sch.unroll(lp)
    return sch


def check_close(got: np.ndarray, want: np.ndarray, what: str, plan: Plan) -> None:
    err = np.abs(got.astype(np.float64) - want)
    worst = np.unravel_index(np.nanargmax(np.where(np.isnan(err), np.inf, err)), err.shape) if err.size else ()
    ok = np.allclose(got, want, rtol=1e-4, atol=1e-4) and not np.isnan(got).any()
    assert ok, f"{what}: worst element {worst}: got {got[worst]}, want {want[worst]}\n{plan}"


@pytest.mark.parametrize("symbolic", [False, True], ids=["M=100", "M=var"])
def test_gemm_schedule_matches_numpy_on_emulator(symbolic: bool) -> None:
    m = 100
    A, B, C = matmul(tc.var("M") if symbolic else m)
    sch = gemm_schedule([A, B, C])
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, 64)).astype(np.float32)
    b = rng.standard_normal((64, 128)).astype(np.float32)
    c = np.full((m, 128), np.nan, np.float32)  # poisoned: every element must be written
    run_sim(sch.mod, [a, b, c])
    check_close(c, a.astype(np.float64) @ b, "gemm", sch.plan)


def test_gemm_ir_reads_like_hand_written_code() -> None:
    text = str(gemm_schedule(list(matmul(tc.var("M")))).mod)
    assert "allocate A_shared: float32[64, 17] @shared" in text      # storage_align padding
    assert "allocate B_shared: float32[16, 64] @shared" in text
    assert "allocate C_local: float32[4, 4] @local" in text
    assert text.count("barrier()") == 2
    # the tile indices are rebased and simplified: no (x*64 + y) // 64 left behind
    assert "A_shared[i_m * 4 + i_i, k_i]" in text
    assert "B_shared[k_i, j_m * 4 + j_i]" in text
    assert "// 64" not in text.split("A_shared[")[-1].split("\n")[0]


def test_gemm_compiles_for_sm90_without_spills() -> None:
    from tecc.codegen import compile_cuda, emit_source

    mod = finish(gemm_schedule(list(matmul(tc.var("M"), 512, 256))).mod)
    source = emit_source(mod.kernels)
    compiled = compile_cuda(source, arch="sm_90", name="gemm")
    res = compiled.resources[mod.kernels[0].name]
    assert res.spill_stores == 0 and res.spill_loads == 0, compiled.log
    assert res.stack_bytes == 0, compiled.log  # C_local lives in registers
    assert res.shared_bytes == (64 * 17 + 16 * 64) * 4


def test_plan_json_round_trip_gives_identical_ir(tmp_path: object) -> None:
    tensors = list(matmul(tc.var("M")))
    sch = gemm_schedule(tensors)
    again = Schedule(tensors, plan=Plan.from_json(sch.plan.to_json()))
    assert str(again.mod) == str(sch.mod)
    assert [s.primitive for s in again.plan.steps] == [s.primitive for s in sch.plan.steps]


def test_every_primitive_dumps_ir(tmp_path: object) -> None:
    import pathlib

    d = pathlib.Path(str(tmp_path)) / "dump"
    sch = gemm_schedule(list(matmul(100)), dump_ir=d)
    files = sorted(p.name for p in d.iterdir())
    assert files[0] == "00_lower.txt" and len(files) == len(sch.plan.steps) + 1
    assert (d / files[-1]).read_text().rstrip().endswith(str(sch.mod).rstrip().splitlines()[-1].strip())


def test_elementwise_split_fuse_bind_vectorize_on_emulator() -> None:
    n = tc.var("n")
    X = tc.placeholder((n, 48), "float32", name="X")
    Y = tc.compute((n, 48), lambda i, j: X[i, j] * 2.0 + 1.0, name="Y")
    sch = Schedule([X, Y])
    i, j = sch.get_loops("Y")
    f = sch.fuse(i, j)
    bo, t, v = sch.split(f, factors=[None, 64, 4])
    sch.bind(bo, "blockIdx.x")
    sch.bind(t, "threadIdx.x")
    sch.vectorize(v)
    x = np.random.default_rng(0).standard_normal((37, 48)).astype(np.float32)
    y = np.full_like(x, np.nan)
    run_sim(sch.mod, [x, y])
    check_close(y, x.astype(np.float64) * 2 + 1, "elementwise", sch.plan)


# ---- illegal requests are refused with the precondition that failed --------------------------

def _gemm() -> tuple[Schedule, list]:
    sch = Schedule(list(matmul(tc.var("M"))))
    return sch, sch.get_loops("C")


def test_bind_symbolic_loop_to_thread_is_refused() -> None:
    sch, (i, j, k) = _gemm()
    with pytest.raises(ScheduleError, match="constant extent.*split"):
        sch.bind(i, "threadIdx.x")


def test_bind_reduction_loop_is_refused() -> None:
    X = tc.placeholder((4, 8), "float32", name="X")
    r = tc.reduce_axis(8, name="r")
    Y = tc.compute((4,), lambda i: tc.sum(X[i, r], axis=r), name="Y")
    sch = Schedule([X, Y])
    i, rr = sch.get_loops("Y")
    with pytest.raises(ScheduleError, match="carries a dependence"):
        sch.bind(rr, "threadIdx.x")
    sch.reorder(rr, i)  # r outermost; the accumulator becomes Y_acc[4, 1]
    with pytest.raises(ScheduleError, match="carries a dependence"):
        sch.bind(rr, "threadIdx.x")
    with pytest.raises(ScheduleError, match="outside the loop and would run in every block"):
        sch.bind(sch.get_loops("Y")[0], "blockIdx.x")  # i_init: the update loop is not inside it


def test_split_factor_zero_is_refused() -> None:
    sch, (i, j, k) = _gemm()
    with pytest.raises(ScheduleError, match="positive integer, got 0"):
        sch.split(j, 0)


def test_fuse_non_adjacent_loops_is_refused() -> None:
    sch, (i, j, k) = _gemm()
    with pytest.raises(ScheduleError, match="not the whole body"):
        sch.fuse(i, k)


def test_reorder_loops_of_different_kernels_is_refused() -> None:
    x = tc.placeholder((8, 16), "float32", name="x")
    r = tc.reduce_axis(16, name="r")
    s = tc.compute((8,), lambda i: tc.max(x[i, r], axis=r), name="s")
    y = tc.compute((8, 16), lambda i, j: tc.exp(x[i, j] - s[i]), name="y")
    sch = Schedule([x, y, s])
    (si, sr), (yi, yj) = sch.get_loops("s"), sch.get_loops("y")
    with pytest.raises(ScheduleError, match="different kernels"):
        sch.reorder(sj := yj, si)  # noqa: F841


def test_reorder_loops_not_nested_is_refused() -> None:
    sch, (i, j, k) = _gemm()
    io, ii = sch.split(i, factors=[None, 4])
    ko, ki = sch.split(k, 16)
    sch.reorder(io, j, ko, ii)  # the accumulator loop i_i is distributed: i_i_init, i_i, i_i_post
    names = {lp.name: lp for lp in sch.get_loops("C")}
    assert {"i_i_init", "i_i_post"} <= set(names)
    with pytest.raises(ScheduleError, match="not nested one inside the other"):
        sch.reorder(names["i_i_init"], names["k_i"])


def _shift_kernel() -> "object":
    """for i in [0, 7): for j in [0, 7): X[i + 1, j] = X[i, j + 1] + 1  (dependence distance (1, -1))."""
    from tecc.ir.expr import Var
    from tecc.ir.stmt import Buffer, BufferStore, For, PrimFunc

    X = Buffer("X", "float32", (8, 8))
    i, j = Var("i"), Var("j")
    store = BufferStore(X, (i + 1, j), X[i, j + 1] + tc.const(1.0, "float32"))
    body = For(i, 0, 7, "serial", For(j, 0, 7, "serial", store))
    return PrimFunc("shift", (X,), body)


def test_reorder_that_breaks_a_dependence_is_refused() -> None:
    from tecc.passes.schedule import bind, reorder

    func = _shift_kernel()
    with pytest.raises(ScheduleError, match="run a dependence backwards"):
        reorder(func, ["j", "i"])
    with pytest.raises(ScheduleError, match="carries a dependence"):
        bind(func, "i", "blockIdx.x")
    from tecc.passes.schedule.legality import check_parallel
    from tecc.passes.schedule.loops import find_loop

    check_parallel(func, find_loop(func, "j")[0], "j in parallel")  # j carries nothing


def test_reduction_loops_may_be_reordered() -> None:
    X = tc.placeholder((6, 5, 7), "float32", name="X")
    r, s = tc.reduce_axis(5, name="r"), tc.reduce_axis(7, name="s")
    Y = tc.compute((6,), lambda i: tc.max(X[i, r, s], axis=[r, s]), name="Y")
    sch = Schedule([X, Y])
    i, rr, ss = sch.get_loops("Y")
    sch.reorder(ss, rr)
    sch.reorder(ss, i)  # the reduction moves outside i: the accumulator becomes Y_acc[6, 1]
    x = np.random.default_rng(3).standard_normal((6, 5, 7)).astype(np.float32)
    y = np.full(6, np.nan, np.float32)
    run_sim(sch.mod, [x, y])
    check_close(y, x.max(axis=(1, 2)).astype(np.float64), "max reduction", sch.plan)


def test_compute_at_a_loop_that_does_not_enclose_the_reads_is_refused() -> None:
    sch, (i, j, k) = _gemm()
    sch.split(i, factors=[None, 4])
    ko, ki = sch.split(k, 16)
    loops = {lp.name: lp for lp in sch.get_loops("C")}
    sch.reorder(loops["i_o"], loops["j"], loops["k_o"], loops["i_i"])
    post = next(lp for lp in sch.get_loops("C") if lp.name == "i_i_post")
    cache = sch.cache_read("C", "A", "local")
    with pytest.raises(ScheduleError, match="nothing under loop i_i_post reads A"):
        sch.compute_at(cache, post)


def test_compute_at_loop_of_another_kernel_is_refused() -> None:
    x = tc.placeholder((8, 16), "float32", name="x")
    r = tc.reduce_axis(16, name="r")
    s = tc.compute((8,), lambda i: tc.max(x[i, r], axis=r), name="s")
    y = tc.compute((8, 16), lambda i, j: tc.exp(x[i, j] - s[i]), name="y")
    sch = Schedule([x, y, s])
    xs = sch.cache_read("y", "x", "local")
    si, sr = sch.get_loops("s")
    with pytest.raises(ScheduleError, match="the loop is in kernel s_kernel, the stage in y_kernel"):
        sch.compute_at(xs, si)


def test_shared_cache_in_an_unbound_kernel_is_refused() -> None:
    sch, (i, j, k) = _gemm()
    cache = sch.cache_read("C", "B", "shared")
    with pytest.raises(ScheduleError, match="bind the kernel's loops first"):
        sch.compute_at(cache, j)


def test_cache_with_a_symbolic_tile_is_refused() -> None:
    sch, (i, j, k) = _gemm()
    sch.reorder(j, i)  # i (M rows, symbolic) is now inside j
    sch.bind(j, "blockIdx.x")
    cache = sch.cache_read("C", "A", "shared")
    with pytest.raises(ScheduleError, match="not bounded by a constant tile"):
        sch.compute_at(cache, j)  # under j the tile is all M rows of A


def test_unroll_symbolic_loop_is_refused() -> None:
    sch, (i, j, k) = _gemm()
    with pytest.raises(ScheduleError, match="not constant"):
        sch.unroll(i)


def test_unknown_loop_names_the_loops_that_exist() -> None:
    sch, _ = _gemm()
    with pytest.raises(ScheduleError, match="its loops are: i, j, k"):
        sch.split("C_kernel/q", 4)


def build_schedule(sch: Schedule, target: str) -> object:
    """tc.build(sch, target) once build() accepts a Schedule; until then the same tail of the
    pipeline by hand (finish, emit, NVRTC, Kernel)."""
    try:
        return tc.build(sch, target=target)  # type: ignore[arg-type]
    except Exception:
        from tecc.codegen import compile_cuda, emit_source
        from tecc.compiler.kernel import Kernel
        from tecc.passes.manager import PassTiming

        mod = finish(sch.mod)
        source = emit_source(mod.kernels)
        kernel = Kernel(module=mod, host=HostProgram.from_module(mod), source=source, plan=sch.plan,
                        target=target, timing=PassTiming())
        if target == "cuda":
            kernel.attach_binary(compile_cuda(source, arch="sm_90", name=mod.name), ())
        return kernel


@pytest.mark.gpu
def test_gemm_schedule_on_device() -> None:
    m = 100
    A, B, C = matmul(tc.var("M"), 512, 256)
    sch = gemm_schedule([A, B, C])
    f = build_schedule(sch, "cuda")
    rng = np.random.default_rng(2)
    a = rng.standard_normal((m, 256)).astype(np.float32)
    b = rng.standard_normal((256, 512)).astype(np.float32)
    c = np.full((m, 512), np.nan, np.float32)
    f(a, b, c)  # type: ignore[operator]
    check_close(c, a.astype(np.float64) @ b, "gemm on device", sch.plan)
