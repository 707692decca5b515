"""End to end: tensor expressions → loop IR → CUDA C → cubin, run in the emulator (and on the GPU
where there is one), compared with float64 NumPy on fresh random inputs with poisoned outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.check import OpSpec, poison, run_and_compare


def _assert_ok(result):
    assert result.ok, str(result)


def _matmul(M=None, N=512, K=256, dtype="float32"):
    M = M if M is not None else tc.var("M")
    A = tc.placeholder((M, K), dtype, name="A")
    B = tc.placeholder((K, N), dtype, name="B")
    k = tc.reduce_axis(K, name="k")
    C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    return A, B, C


def test_matmul_symbolic_m_builds_cubin_and_matches_numpy_in_emulator():
    A, B, C = _matmul()
    f = tc.build([A, B, C], target="cuda")
    assert f.cubin[:4] == b"\x7fELF"
    assert ".entry C_kernel" in f.ptx or ".visible .entry C_kernel" in f.ptx
    res = f.resources["C_kernel"]
    assert res.registers > 0 and res.spill_stores == 0
    for m in (1, 7, 100):
        _assert_ok(run_and_compare(OpSpec("matmul", [A, B, C], lambda a, b: a @ b, sizes={"M": m}), f, use_sim=True))


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (17, 13, 31), (64, 1, 64)])
def test_matmul_static_odd_shapes(shape):
    m, n, k = shape
    A, B, C = _matmul(m, n, k)
    f = tc.build([A, B, C], target="sim")
    _assert_ok(run_and_compare(OpSpec("matmul", [A, B, C], lambda a, b: a @ b), f, seed=m * 100 + n))


def test_sin_axpb_with_broadcasting_and_a_transposed_strided_input():
    R, C = tc.var("R"), tc.var("C")
    x = tc.placeholder((R, C), "float32", name="x", strides="any")
    a = tc.placeholder((C,), "float32", name="a")
    b = tc.placeholder((), "float32", name="b")
    y = tc.compute((R, C), lambda i, j: tc.sin(a[j] * x[i, j] + b[()]), name="y")
    f = tc.build([x, a, b, y], target="sim")
    rng = np.random.default_rng(1)
    base = rng.uniform(-1, 1, size=(37, 23)).astype(np.float32)
    xt = base.T  # (23, 37), non-contiguous
    av = rng.uniform(-1, 1, size=37).astype(np.float32)
    bv = np.array(0.25, dtype=np.float32)
    out = poison((23, 37), tc.float32)
    f(xt, av, bv, out)
    ref = np.sin(av.astype(np.float64)[None, :] * xt.astype(np.float64) + 0.25)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)
    assert "x_stride0" in f.source and "x_stride1" in f.source


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_sum_over_any_axis(axis):
    shape = (5, 6, 7)
    ax = axis % 3
    x = tc.placeholder(shape, "float32", name="x")
    r = tc.reduce_axis(shape[ax], name="r")
    out_shape = tuple(s for d, s in enumerate(shape) if d != ax)

    def body(*idx):
        full = list(idx)
        full.insert(ax, r)
        return tc.sum(x[tuple(full)], axis=r)

    y = tc.compute(out_shape, body, name="y")
    f = tc.build([x, y], target="sim")
    _assert_ok(run_and_compare(OpSpec("sum", [x, y], lambda v: v.sum(axis=ax)), f, seed=axis + 10))


def test_sum_with_zero_size_reduction_gives_identity_and_zero_size_output_launches_nothing():
    R, C = tc.var("R"), tc.var("C")
    x = tc.placeholder((R, C), "float32", name="x")
    c = tc.reduce_axis(C, name="c")
    s = tc.compute((R,), lambda r: tc.sum(x[r, c], axis=c), name="s")
    m = tc.compute((R,), lambda r: tc.max(x[r, c], axis=c), name="m")
    f = tc.build([x, s, m], target="sim")
    xs = np.empty((4, 0), np.float32)
    out_s, out_m = poison((4,), tc.float32), poison((4,), tc.float32)
    f(xs, out_s, out_m)
    assert np.array_equal(out_s, np.zeros(4, np.float32))
    assert np.all(out_m == -np.inf)
    empty = np.empty((0, 5), np.float32)
    f(empty, np.empty((0,), np.float32), np.empty((0,), np.float32))  # no error, nothing to do


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int32", "int64"])
def test_row_reduction_dtypes(dtype):
    x = tc.placeholder((9, 300), dtype, name="x")
    c = tc.reduce_axis(300, name="c")
    y = tc.compute((9,), lambda r: tc.sum(x[r, c], axis=c), name="y")
    f = tc.build([x, y], target="sim")
    _assert_ok(run_and_compare(OpSpec("row_sum", [x, y], lambda v: v.sum(axis=-1)), f, seed=3))


def test_half_sum_accumulates_in_float32():
    x = tc.placeholder((1, 4096), "float16", name="x")
    c = tc.reduce_axis(4096, name="c")
    y = tc.compute((1,), lambda r: tc.sum(x[r, c], axis=c), name="y")
    f = tc.build([x, y], target="sim")
    xs = np.full((1, 4096), 1.0, np.float16)
    out = poison((1,), tc.float16)
    f(xs, out)
    assert out[0] == 4096.0  # a float16 accumulator would stall at 2048


def test_multi_kernel_program_inlines_elementwise_and_keeps_reductions_as_kernels():
    R = tc.var("R")
    X = tc.placeholder((R, 50), "float32", name="X")
    c, c2 = tc.reduce_axis(50, name="c"), tc.reduce_axis(50, name="c2")
    m = tc.compute((R,), lambda r: tc.max(X[r, c], axis=c), name="m")
    e = tc.compute((R, 50), lambda r, j: tc.exp(X[r, j] - m[r]), name="e")
    s = tc.compute((R,), lambda r: tc.sum(e[r, c2], axis=c2), name="s")
    Y = tc.compute((R, 50), lambda r, j: e[r, j] / s[r], name="Y")
    f = tc.build([X, Y], target="sim", plan=tc.default_plan())
    assert [k.name for k in f.module.kernels] == ["m_kernel", "s_kernel", "Y_kernel"]
    assert [t.name for t in f.module.temps] == ["m", "s"]

    def softmax(x):
        z = np.exp(x - x.max(axis=-1, keepdims=True))
        return z / z.sum(axis=-1, keepdims=True)

    _assert_ok(run_and_compare(OpSpec("softmax", [X, Y], softmax, sizes={"R": 33}), f, seed=5))


def test_planner_fuses_softmax_into_one_kernel_that_matches_numpy():
    R = tc.var("R")
    X = tc.placeholder((R, 50), "float32", name="X")
    c, c2 = tc.reduce_axis(50, name="c"), tc.reduce_axis(50, name="c2")
    m = tc.compute((R,), lambda r: tc.max(X[r, c], axis=c), name="m")
    e = tc.compute((R, 50), lambda r, j: tc.exp(X[r, j] - m[r]), name="e")
    s = tc.compute((R,), lambda r: tc.sum(e[r, c2], axis=c2), name="s")
    Y = tc.compute((R, 50), lambda r, j: e[r, j] / s[r], name="Y")
    f = tc.build([X, Y], target="sim")
    assert len(f.module.kernels) == 1 and not f.module.temps, f.plan

    def softmax(x):
        z = np.exp(x - x.max(axis=-1, keepdims=True))
        return z / z.sum(axis=-1, keepdims=True)

    _assert_ok(run_and_compare(OpSpec("softmax", [X, Y], softmax, sizes={"R": 33}), f, seed=6))


def test_dump_ir_writes_one_file_per_pass_then_cuda_and_ptx(tmp_path: Path):
    A, B, C = _matmul()
    tc.build([A, B, C], target="cuda", dump_ir=tmp_path, plan=tc.default_plan())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00_lower.txt", "01_default_schedule.txt", "02_simplify.txt", "03_hoist_invariants.txt",
                     "04_approx_math.txt", "05_unique_names.txt", "06_cuda.cu", "07_C.ptx"]
    lowered = (tmp_path / "00_lower.txt").read_text()
    assert "for i in range(M):" in lowered and "C_acc[0] = C_acc[0] + A[i, k] * B[k, j]" in lowered
    assert "# blockIdx.x" in (tmp_path / "01_default_schedule.txt").read_text()


def test_planned_build_dumps_lower_then_every_primitive_then_the_tail(tmp_path: Path):
    A, B, C = _matmul()
    f = tc.build([A, B, C], target="cuda", dump_ir=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    primitives = [s.primitive for s in f.plan.steps if s.primitive != "default_schedule"]
    assert primitives, f"the planner chose no primitives for matmul: {f.plan}"
    tail = ["default_schedule", "simplify", "hoist_invariants", "approx_math", "unique_names"]
    expected = ["lower"] + primitives + tail
    assert [n.split("_", 1)[1].rsplit(".", 1)[0] for n in names[:-2]] == expected
    assert names[-2].endswith("_cuda.cu") and names[-1].endswith("_C.ptx")
    assert [int(n.split("_", 1)[0]) for n in names] == list(range(len(names)))


def test_tecc_dump_ir_environment_variable_filters_by_kernel(tmp_path: Path, monkeypatch):
    R = tc.var("R")
    X = tc.placeholder((R, 8), "float32", name="X")
    c = tc.reduce_axis(8, name="c")
    m = tc.compute((R,), lambda r: tc.max(X[r, c], axis=c), name="m")
    Y = tc.compute((R, 8), lambda r, j: X[r, j] - m[r], name="Y")
    monkeypatch.setenv("TECC_DUMP_IR", f"{tmp_path}:Y_kernel")
    tc.build([X, Y], target="sim", plan=tc.default_plan())
    (last,) = (tmp_path / "Y").glob("*_unique_names.txt")
    text = last.read_text()
    assert "kernel Y_kernel" in text and "kernel m_kernel" not in text


def test_tecc_dump_ir_with_a_filter_writes_nothing_for_a_module_none_of_whose_kernels_match(
        tmp_path: Path, monkeypatch):
    n = tc.var("n")
    X = tc.placeholder((n,), "float32", name="X")
    Y = tc.compute((n,), lambda i: X[i] * 2.0, name="Y")
    Z = tc.compute((n,), lambda i: X[i] + 1.0, name="Z")
    monkeypatch.setenv("TECC_DUMP_IR", f"{tmp_path / 'dumps'}:Z_kernel")
    skipped = tc.build([X, Y], target="cuda", arch="sm_90")  # NVRTC too: no .cu or .ptx may appear
    assert not (tmp_path / "dumps").exists(), sorted(str(p) for p in (tmp_path / "dumps").rglob("*"))
    assert skipped.dump_dir is None
    kept = tc.build([X, Z], target="cuda", arch="sm_90")
    names = sorted(p.name for p in (tmp_path / "dumps" / "Z").iterdir())
    assert kept.dump_dir == tmp_path / "dumps" / "Z" and names[0] == "00_lower.txt"
    assert names[-2].endswith("_cuda.cu") and names[-1].endswith("_Z.ptx")
    assert all("Z_kernel" in (tmp_path / "dumps" / "Z" / name).read_text() for name in names)
    x = np.random.default_rng().standard_normal(50).astype(np.float32)
    np.testing.assert_allclose(skipped.sim(x), 2.0 * x, rtol=1e-6)
    np.testing.assert_allclose(kept.sim(x), x + 1.0, rtol=1e-6)


def test_save_writes_cubin_ptx_cu_and_manifest(tmp_path: Path):
    A, B, C = _matmul()
    f = tc.build([A, B, C], target="cuda", plan=tc.default_plan())
    f.save(tmp_path / "gemm")
    for ext in ("cubin", "ptx", "cu", "json"):
        assert (tmp_path / f"gemm.{ext}").stat().st_size > 0
    manifest = json.loads((tmp_path / "gemm.json").read_text())
    assert manifest["entry"] == "C" and manifest["arch"].startswith("sm_")
    host = manifest["host"]
    assert [p.get("buffer", {}).get("name") or p["scalar"]["var"] for p in host["params"]] == ["A", "B", "C", "M"]
    assert host["kernels"][0]["grid"][0] == {"op": "*", "args": [{"var": "M", "dtype": "int32", "kind": "size"},
                                                                {"const": 2, "dtype": "int32"}]}
    assert manifest["plan"]["strategy"] == "naive"
    assert len(manifest["source_sha256"]) == 64


def test_a_saved_kernel_loads_back_with_the_same_runnable_state(tmp_path: Path):
    """tc.build's Kernel and tc.load's LoadedKernel are one RunnableKernel (host program, cubin,
    PTX, arch, executor and call path); the loaded one holds what the built one saved."""
    from tecc.runtime.runnable import RunnableKernel

    A, B, C = _matmul()
    f = tc.build([A, B, C], target="cuda", plan=tc.default_plan())
    g = tc.load(f.save(tmp_path / "gemm"))
    assert isinstance(f, RunnableKernel) and isinstance(g, RunnableKernel)
    assert (g.name, g.arch, g.cubin, g.ptx) == (f.name, f.arch, f.cubin, f.ptx)
    assert g.host.to_json() == f.host.to_json() and g.cuda_source == f.source and g.source_matches
    assert g.plan == f.plan.to_dict()
    assert [k["name"] for k in g.kernel_stats] == list(f.resources)
    assert g.kernel_stats[0]["registers"] == f.resources["C_kernel"].registers


def test_without_a_device_each_kernel_says_what_to_do_and_sim_kernels_still_run(tmp_path: Path, monkeypatch):
    A, B, C = _matmul()
    f = tc.build([A, B, C], target="cuda", plan=tc.default_plan())
    f.save(tmp_path / "gemm")
    s = tc.build([A, B, C], target="sim", plan=tc.default_plan())
    monkeypatch.setattr("tecc.runtime.cuda.cuda_unavailable_reason", lambda: "no device (test)")
    g = tc.load(tmp_path / "gemm")
    a, b = np.ones((2, 256), np.float32), np.ones((256, 512), np.float32)
    c = np.zeros((2, 512), np.float32)
    with pytest.raises(tc.DeviceError, match=r"C: no CUDA device is available to run this kernel; build with target='sim'"):
        f(a, b, c)
    with pytest.raises(tc.DeviceError, match="no CUDA device is available to run this kernel"):
        f.executor
    with pytest.raises(tc.DeviceError, match=r"C: no CUDA device is available to run the artifact .*gemm \(no device \(test\)\)"):
        g(a, b, c)
    with pytest.raises(tc.DeviceError, match="to run the artifact"):
        g.synchronize()
    s(a, b, c)  # built for the emulator: runs there, needs no device
    np.testing.assert_allclose(c, a @ b)


def test_argument_errors_name_the_argument():
    A, B, C = _matmul()
    f = tc.build([A, B, C], target="sim")
    a = np.ones((4, 256), np.float32)
    b = np.ones((256, 512), np.float32)
    with pytest.raises(tc.DTypeError, match=r"argument 1 \(B\) of C: expected float32, got float64"):
        f(a, b.astype(np.float64), np.empty((4, 512), np.float32))
    with pytest.raises(tc.ShapeError, match=r"argument 2 \(C\) of C, dimension 0: M is 5 here but 4"):
        f(a, b, np.empty((5, 512), np.float32))
    with pytest.raises(tc.ShapeError, match=r"argument 1 \(B\) of C, dimension 1: expected 512, got 511"):
        f(a, np.ones((256, 511), np.float32), np.empty((4, 512), np.float32))
    with pytest.raises(tc.TeccError, match="takes 3 arrays"):
        f(a)  # f(a, b) leaves out just the output: it is allocated (tests/test_outputs.py)


def test_build_errors():
    A, B, C = _matmul()
    with pytest.raises(tc.TeccError, match="placeholder B is read by C but is not in the argument list"):
        tc.build([A, C], target="sim")
    with pytest.raises(tc.TeccError, match="unknown target"):
        tc.build([A, B, C], target="opencl")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 128, 1000])
def test_matmul_on_gpu_matches_numpy_and_emulator(m):
    A, B, C = _matmul()
    f = tc.build([A, B, C], target="cuda")
    spec = OpSpec("matmul", [A, B, C], lambda a, b: a @ b, sizes={"M": m})
    _assert_ok(run_and_compare(spec, f, seed=m))
    rng = np.random.default_rng(m)
    a = rng.uniform(-1, 1, (m, 256)).astype(np.float32)
    b = rng.uniform(-1, 1, (256, 512)).astype(np.float32)
    gpu, sim = poison((m, 512), tc.float32), poison((m, 512), tc.float32)
    f(a, b, gpu)
    f.sim(a, b, sim)
    np.testing.assert_allclose(gpu, sim, rtol=1e-5, atol=1e-5)


def test_a_plan_made_for_another_program_is_refused_naming_the_kernels_it_addresses():
    A, B, C = _matmul()
    plan = tc.build([A, B, C], target="sim").plan
    assert any("C_kernel/" in json.dumps(step.args) for step in plan.steps), plan
    n = tc.var("n")
    X = tc.placeholder((n,), "float32", name="X")
    Y = tc.compute((n,), lambda i: X[i] * 2.0, name="Y")
    with pytest.raises(tc.ScheduleError, match=r"the plan is for another program: it names kernel\(s\) C_kernel, "
                                               r"and this program's kernels are Y_kernel \(plan step 0, "):
        tc.build([X, Y], target="sim", plan=plan)


def test_a_tensor_named_like_a_size_variable_is_renamed_not_refused() -> None:
    """Scores named `S` over a length `S`: the size variable keeps its name (the user's, in the
    kernels' parameters) and the tensor's buffer takes a fresh one wherever a part of the plan
    stores it; the planner takes the program (it used to fail on the name and fall back to one
    naive kernel per stage). Checked in the emulator against NumPy."""
    S = tc.var("S")
    x = tc.placeholder((S, 8), "float32", name="x")
    k = tc.reduce_axis(8, name="k")
    scores = tc.compute((S, S), lambda i, j: tc.sum(x[i, k] * x[j, k], axis=k), name="S")
    j = tc.reduce_axis(S, name="j")
    out = tc.compute((S,), lambda i: tc.max(scores[i, j], axis=j), name="out")
    f = tc.build([x, out], target="sim")
    assert "fell back" not in f.explain(), f.explain()
    rng = np.random.default_rng()
    xv = rng.standard_normal((37, 8)).astype(np.float32)
    got = np.full(37, np.nan, np.float32)
    f(xv, got)
    want = (xv.astype(np.float64) @ xv.astype(np.float64).T).max(axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
