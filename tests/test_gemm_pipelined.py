"""gemm_pipelined (issue 6): the SGEMM template's primitives run correctly on the emulator
(race and bounds checks on) for divisible, non-divisible, symbolic-M and A·Bᵀ shapes, emit
16-byte accesses, compile without spills, and replay from their plan."""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc
from tecc.codegen import compile_cuda, emit_source
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.plan import Plan
from tecc.compiler.schedule import Schedule
from tecc.compiler.strategies import get
from tecc.passes.lower import lower

from test_schedule import finish, run_sim


def matmul(M: object, N: int, K: int, b_transposed: bool = False) -> list[tc.Tensor]:
    A = tc.placeholder((M, K), "float32", name="A")
    B = tc.placeholder((N, K) if b_transposed else (K, N), "float32", name="B")
    k = tc.reduce_axis(K, name="k")
    if b_transposed:
        C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[j, k], axis=k), name="C")
    else:
        C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    return [A, B, C]


def pipelined(tensors: list[tc.Tensor], point: dict[str, int], sizes: dict[str, int] | None = None) -> Schedule:
    info = analyze_kernel(lower(tensors).kernels[0], sizes)
    sch = Schedule(tensors)
    get("gemm_pipelined").apply(sch, info, point)
    return sch


@pytest.mark.parametrize("M,N,K,bt,point", [
    (128, 128, 32, False, {"bm": 64, "bn": 64, "bk": 8}),
    (100, 130, 37, False, {"bm": 64, "bn": 64, "bk": 8}),
    (70, 64, 24, True, {"bm": 64, "bn": 64, "bk": 8}),
    (130, 136, 48, False, {"bm": 128, "bn": 64, "bk": 16}),
])
def test_gemm_pipelined_matches_numpy_on_the_emulator(M: int, N: int, K: int, bt: bool, point: dict[str, int]) -> None:
    tensors = matmul(M, N, K, bt)
    sch = pipelined(tensors, point)
    rng = np.random.default_rng(0)
    a = rng.random((M, K), dtype=np.float32)
    b = rng.random((N, K) if bt else (K, N), dtype=np.float32)
    c = np.full((M, N), np.nan, np.float32)
    run_sim(sch.mod, [a, b, c])
    ref = a @ (b.T if bt else b)
    worst = np.unravel_index(np.argmax(np.abs(c - ref)), ref.shape)
    assert np.allclose(c, ref, rtol=1e-5, atol=1e-4), (point, worst, c[worst], ref[worst])


def test_gemm_pipelined_symbolic_m() -> None:
    tensors = matmul(tc.var("M"), 128, 40)
    sch = pipelined(tensors, {"bm": 64, "bn": 64, "bk": 8}, {"M": 150})
    a = np.random.default_rng(1).random((150, 40), dtype=np.float32)
    b = np.random.default_rng(2).random((40, 128), dtype=np.float32)
    c = np.zeros((150, 128), np.float32)
    run_sim(sch.mod, [a, b, c])
    assert np.allclose(c, a @ b, rtol=1e-5, atol=1e-4)


def test_gemm_pipelined_emits_16_byte_accesses_without_spills() -> None:
    tensors = matmul(4096, 4096, 4096)
    sch = pipelined(tensors, {"bm": 128, "bn": 128, "bk": 8})
    src = emit_source(finish(sch.mod).kernels)
    assert "reinterpret_cast<const float4*>(&A[" in src and "reinterpret_cast<const float4*>(&B[" in src
    assert "reinterpret_cast<float4*>(&B_shared[" in src
    compiled = compile_cuda(src, arch="sm_90")
    res = compiled.resources["C_kernel"]
    assert res.registers <= 128 and res.spill_stores == 0 and res.spill_loads == 0, res
    ptx = compiled.ptx
    assert ptx.count("ld.shared.v4.f32") == 32          # 2 of A + 2 of B per k step, 8 k steps
    assert ptx.count("ld.global.nc.v4.f32") == 4        # prologue + prefetch, A and B
    assert "ld.local" not in ptx


def test_gemm_pipelined_plan_replays_to_the_same_ir() -> None:
    tensors = matmul(tc.var("M"), 256, 64)
    sch = pipelined(tensors, {"bm": 128, "bn": 128, "bk": 16}, {"M": 512})
    again = Schedule(tensors, plan=Plan.from_json(sch.plan.to_json()))
    assert str(again.mod) == str(sch.mod)
    assert [s.primitive for s in sch.plan.steps].count("double_buffer") == 1


def test_planner_prefers_gemm_pipelined_for_large_fp32_matmul() -> None:
    from tecc.compiler.planner import plan_program

    res = plan_program(matmul(4096, 4096, 4096), "sm_90")
    assert res.kernels[0].chosen.strategy.name == "gemm_pipelined"


def test_register_tile_guards_stay_only_on_the_write_back() -> None:
    """Symbolic M: the init and the accumulation run unguarded on the tile's dead lanes (the
    shared tiles are zero-filled), the store to C keeps `row < M`; the emulator's bounds,
    race and uninitialized-read checks pass."""
    tensors = matmul(tc.var("M"), 64, 16)
    sch = pipelined(tensors, {"bm": 64, "bn": 64, "bk": 8}, {"M": 70})
    text = str(sch.mod)
    guarded = [line for line in text.splitlines() if "< M:" in line.strip() and line.strip().startswith("if")]
    assert len(guarded) == 1, text                        # only the write-back
    assert any(s.primitive == "guard_writeback_only" for s in sch.plan.steps)
    a = np.random.default_rng(3).random((70, 16), dtype=np.float32)
    b = np.random.default_rng(4).random((16, 64), dtype=np.float32)
    c = np.full((70, 64), np.nan, np.float32)
    run_sim(sch.mod, [a, b, c])
    assert np.allclose(c, a @ b, rtol=1e-5, atol=1e-4)


def test_batched_gemm_pipelined_matches_numpy_on_the_emulator() -> None:
    A = tc.placeholder((3, 70, 20), "float32", name="A")
    B = tc.placeholder((3, 20, 130), "float32", name="B")
    k = tc.reduce_axis(20, name="k")
    C = tc.compute((3, 70, 130), lambda b, i, j: tc.sum(A[b, i, k] * B[b, k, j], axis=k), name="C")
    sch = pipelined([A, B, C], {"bm": 64, "bn": 64, "bk": 8})
    assert "blockIdx.z" in str(sch.mod)
    rng = np.random.default_rng(5)
    a = rng.random((3, 70, 20), dtype=np.float32)
    b = rng.random((3, 20, 130), dtype=np.float32)
    c = np.full((3, 70, 130), np.nan, np.float32)
    run_sim(sch.mod, [a, b, c])
    assert np.allclose(c, a @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M,N,K,bt,point", [
    (64, 64, 256, False, {"bm": 32, "bn": 64, "bk": 16, "split": 2}),      # K = 2 whole parts
    (40, 70, 200, False, {"bm": 32, "bn": 64, "bk": 8, "split": 3}),       # last part short: k-tail
    (48, 64, 130, True, {"bm": 32, "bn": 64, "bk": 8, "split": 4}),        # A·Bᵀ, K not a tile multiple
])
def test_split_k_matches_numpy_on_the_emulator(M: int, N: int, K: int, bt: bool, point: dict[str, int]) -> None:
    tensors = matmul(M, N, K, bt)
    sch = pipelined(tensors, point)
    assert [k.name for k in sch.mod.kernels] == ["C_kernel", "C_kernel_combine"], sch.mod
    assert [t.name for t in sch.mod.temps] == ["C_rf"]
    rng = np.random.default_rng(1)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((N, K) if bt else (K, N), dtype=np.float32)
    c = np.full((M, N), np.nan, np.float32)
    run_sim(sch.mod, [a, b, c])
    ref = a @ (b.T if bt else b)
    worst = np.unravel_index(np.argmax(np.abs(c - ref)), ref.shape)
    assert np.allclose(c, ref, rtol=1e-5, atol=1e-4), (point, worst, c[worst], ref[worst])
    again = Schedule(tensors, plan=Plan.from_json(sch.plan.to_json()))
    assert str(again.mod) == str(sch.mod)


def test_rfactor_refuses_a_bound_kernel() -> None:
    from tecc.ir.errors import ScheduleError

    sch = Schedule(matmul(64, 64, 64))
    i, j, k = sch.get_loops("C")
    ko, _ = sch.split(k, factors=[None, 16])
    sch.bind(i, "blockIdx.x")
    with pytest.raises(ScheduleError, match="before binding"):
        sch.rfactor(ko)


def test_rfactor_keeps_the_epilogue_in_the_combine_kernel() -> None:
    A = tc.placeholder((16, 40), "float32", name="A")
    B = tc.placeholder((40, 24), "float32", name="B")
    k = tc.reduce_axis(40, name="k")
    C = tc.compute((16, 24), lambda i, j: tc.maximum(tc.sum(A[i, k] * B[k, j], axis=k), 0.0), name="C")
    sch = Schedule([A, B, C])
    _, _, kk = sch.get_loops("C")
    ko, _ = sch.split(kk, factors=[None, 16])
    sch.rfactor(ko)
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((16, 40), dtype=np.float32), rng.standard_normal((40, 24), dtype=np.float32)
    c = np.full((16, 24), np.nan, np.float32)
    run_sim(sch.mod, [a, b, c])
    assert np.allclose(c, np.maximum(a @ b, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1024, 1024, 1024), (127, 4096, 1023), (8192, 64, 8192)])
def test_planner_splits_k_when_the_output_has_too_few_tiles(m: int, n: int, k: int) -> None:
    from tecc.compiler.planner import plan_program

    kp = plan_program(matmul(m, n, k), "sm_90").kernels[0]
    assert kp.chosen.strategy.name == "gemm_pipelined" and kp.chosen.point.get("split", 1) > 1, kp.chosen.label


def test_planner_does_not_split_k_when_tiles_fill_the_gpu() -> None:
    from tecc.compiler.planner import plan_program

    kp = plan_program(matmul(4096, 4096, 4096), "sm_90").kernels[0]
    assert kp.chosen.point == {"bm": 128, "bn": 128, "bk": 16}, kp.chosen.label


def _accumulation_guards(text: str, acc: str) -> list[str]:
    """The guards directly above the register tile's accumulation lines."""
    lines = text.splitlines()
    return [lines[n - 1].strip() for n, line in enumerate(lines)
            if line.strip().startswith(f"{acc}[") and f"= {acc}[" in line and lines[n - 1].strip().startswith("if ")]


@pytest.mark.parametrize("M,N,K,point", [
    (100, 130, 37, {"bm": 64, "bn": 64, "bk": 8}),                 # 37 = 4 tiles of 8 + 5
    (64, 64, 52, {"bm": 64, "bn": 64, "bk": 16}),                  # K a multiple of 4, not of 16
    (40, 70, 200, {"bm": 32, "bn": 64, "bk": 8, "split": 3}),      # split-K: last part short
])
def test_k_tail_guard_leaves_the_accumulation(M: int, N: int, K: int, point: dict[str, int]) -> None:
    """Past K both shared tiles are the copies' zero fill, so `k < K` is dropped from every FFMA
    (unguard_reduction_tail, proved with islpy); the emulator's bounds, race and uninitialized
    checks pass and the result is NumPy's."""
    sch = pipelined(matmul(M, N, K), point)
    assert any(s.primitive == "unguard_reduction_tail" for s in sch.plan.steps)
    guards = _accumulation_guards(str(sch.mod.kernels[0]), "C_local")
    assert not any(f"< {K}" in g for g in guards), guards
    rng = np.random.default_rng(7)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    c = np.full((M, N), np.nan, np.float32)
    run_sim(sch.mod, [a, b, c])
    worst = np.unravel_index(np.argmax(np.abs(c - a @ b)), c.shape)
    assert np.allclose(c, a @ b, rtol=1e-5, atol=1e-4), (point, worst, c[worst], (a @ b)[worst])


def _up_to_compute_at(tensors: list[tc.Tensor], bm: int, bk: int) -> tuple[Schedule, object, object]:
    """The template's steps up to the shared copies (no double buffer yet)."""
    sch = Schedule(tensors)
    i, j, k = sch.get_loops("C")
    bi, qi, ty, ii = sch.split(i, factors=[None, 2, bm // 8, 4])
    bj, qj, tx, ji = sch.split(j, factors=[None, 2, bm // 8, 4])
    ko, ki = sch.split(k, bk)
    sch.reorder(bi, bj, ty, tx, ko, ki, qi, ii, qj, ji)
    for lp, axis in ((bi, "blockIdx.y"), (bj, "blockIdx.x"), (ty, "threadIdx.y"), (tx, "threadIdx.x")):
        sch.bind(lp, axis)
    local = sch.cache_write("C", "local")
    for name in ("A", "B"):
        sch.compute_at(sch.cache_read("C", name, "shared"), ko)
    return sch, local, ko


def test_k_tail_proof_keeps_what_it_cannot_prove() -> None:
    """The row guard `row < M` is not a k tail: past M only A's tile is zero, B's is not, so the
    primitive keeps it (guard_writeback_only's lane argument removes it later). After
    double_buffer a tile is also written from the prefetch registers: nothing is dropped."""
    sch, local, ko = _up_to_compute_at(matmul(70, 64, 20), 64, 8)
    sch.unguard_reduction_tail(local)
    guards = _accumulation_guards(str(sch.mod), "C_local")
    assert guards and all("< 70" in g and "< 20" not in g for g in guards), guards
    late, local2, ko2 = _up_to_compute_at(matmul(70, 64, 20), 64, 8)
    late.double_buffer(ko2)
    before = str(late.mod)
    late.unguard_reduction_tail(local2)
    assert str(late.mod) == before


def test_unguard_reduction_tail_refuses_a_shared_stage() -> None:
    from tecc.ir.errors import ScheduleError

    sch, _, _ = _up_to_compute_at(matmul(64, 64, 20), 64, 8)
    with pytest.raises(ScheduleError, match="local"):
        sch.unguard_reduction_tail("A.shared")


def epilogue(M: int, N: int, K: int) -> list[tc.Tensor]:
    A = tc.placeholder((M, K), "float32", name="A")
    B = tc.placeholder((K, N), "float32", name="B")
    bias = tc.placeholder((N,), "float32", name="bias")
    k = tc.reduce_axis(K, name="k")
    C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    D = tc.compute((M, N), lambda i, j: tc.maximum(C[i, j] + bias[j], 0.0), name="D")
    return [A, B, bias, D]


@pytest.mark.parametrize("point", [{"bm": 64, "bn": 64, "bk": 8}, {"bm": 32, "bn": 64, "bk": 8, "split": 3}])
def test_epilogue_fuses_into_the_matmul_kernel(point: dict[str, int]) -> None:
    """relu(C + bias[j]) with C the matmul and D its only consumer: one kernel, no temporary C,
    the store applies the epilogue (with split-K: the combine kernel does)."""
    M, N, K = 70, 130, 100
    tensors = epilogue(M, N, K)
    assert [k.name for k in lower(tensors).kernels] == ["D_kernel"] and not lower(tensors).temps
    sch = pipelined(tensors, point)
    assert [t.name for t in sch.mod.temps] == (["D_rf"] if "split" in point else [])
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32)
    bias = rng.standard_normal((N,), dtype=np.float32)
    d = np.full((M, N), np.nan, np.float32)
    run_sim(sch.mod, [a, b, bias, d])
    ref = np.maximum(a @ b + bias, 0)
    worst = np.unravel_index(np.argmax(np.abs(d - ref)), ref.shape)
    assert np.allclose(d, ref, rtol=1e-5, atol=1e-4), (point, worst, d[worst], ref[worst])


def test_epilogue_fuses_into_a_stored_activation_that_the_next_product_reads() -> None:
    """D = relu(A·B + bias) is no output but the operand of E = D·B2, so D is stored (a conv's
    batch norm and relu before the next conv): A·B is computed in D's kernel, not stored apart."""
    M, N, K = 48, 40, 24
    A = tc.placeholder((M, K), "float32", name="A")
    B = tc.placeholder((K, N), "float32", name="B")
    B2 = tc.placeholder((N, N), "float32", name="B2")
    bias = tc.placeholder((N,), "float32", name="bias")
    k, m = tc.reduce_axis(K, name="k"), tc.reduce_axis(N, name="m")
    C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    D = tc.compute((M, N), lambda i, j: tc.maximum(C[i, j] + bias[j], 0.0), name="D")
    E = tc.compute((M, N), lambda i, j: tc.sum(D[i, m] * B2[m, j], axis=m), name="E")
    tensors = [A, B, B2, bias, E]
    assert [kern.name for kern in lower(tensors).kernels] == ["D_kernel", "E_kernel"]
    f = tc.build(tensors, target="sim")
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32)
    b2, bi = rng.standard_normal((N, N), dtype=np.float32), rng.standard_normal((N,), dtype=np.float32)
    e = np.full((M, N), np.nan, np.float32)
    f.sim(a, b, b2, bi, e)
    ref = np.maximum(a.astype(np.float64) @ b + bi, 0) @ b2
    worst = np.unravel_index(np.argmax(np.abs(e - ref)), ref.shape)
    assert np.allclose(e, ref, rtol=1e-5, atol=1e-4), (worst, e[worst], ref[worst], f.plan)


def test_epilogue_is_not_fused_where_it_would_not_save_bytes() -> None:
    """C kept as its own kernel when it is an output, has two consumers, or is read at another index;
    choose_inlined without the flag (fuse_rows, split_reduce) never inlines a reduction."""
    from tecc.passes.lower import choose_inlined, collect_program

    A = tc.placeholder((32, 16), "float32", name="A")
    B = tc.placeholder((16, 32), "float32", name="B")
    k = tc.reduce_axis(16, name="k")
    C = tc.compute((32, 32), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    relu = tc.compute((32, 32), lambda i, j: tc.maximum(C[i, j], 0.0), name="D")
    other = tc.compute((32, 32), lambda i, j: C[i, j] + 1.0, name="E")
    moved = tc.compute((32, 32), lambda i, j: C[j, i] + 1.0, name="D")
    assert len(lower([A, B, C, relu]).kernels) == 2          # C is an output
    assert len(lower([A, B, relu, other]).kernels) == 3      # two consumers
    assert len(lower([A, B, moved]).kernels) == 2
    assert len(lower([A, B, relu]).kernels) == 1
    assert C not in choose_inlined(collect_program([A, B, relu])).inlined
    assert C in choose_inlined(collect_program([A, B, relu]), epilogues=True).inlined
