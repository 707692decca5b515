"""The profiling hook `tc.profile()` (tecc/compiler/profiling.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tecc as tc
from tecc.compiler import build, default_plan
from tecc.compiler.profiling import LaunchProfile, Profile, expr_flops, profile


def _matmul():
    M = tc.var("M")
    A = tc.placeholder((M, 64), "float32", name="A")
    B = tc.placeholder((64, 32), "float32", name="B")
    k = tc.reduce_axis(64, name="k")
    C = tc.compute((M, 32), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    return [A, B, C]


def _softmax():
    R = tc.var("R")
    X = tc.placeholder((R, 100), "float32", name="X")
    c = tc.reduce_axis(100, name="c")
    c2 = tc.reduce_axis(100, name="c2")
    m = tc.compute((R,), lambda r: tc.max(X[r, c], axis=c), name="m")
    e = tc.compute((R, 100), lambda r, j: tc.exp(X[r, j] - m[r]), name="e")
    s = tc.compute((R,), lambda r: tc.sum(e[r, c2], axis=c2), name="s")
    Y = tc.compute((R, 100), lambda r, j: e[r, j] / s[r], name="Y")
    return [X, Y]


def _mm_arrays(m: int = 10):
    rng = np.random.default_rng(0)
    return (rng.random((m, 64), dtype=np.float32), rng.random((64, 32), dtype=np.float32),
            np.empty((m, 32), np.float32))


def test_emulator_launches_are_recorded_with_bytes_and_flops() -> None:
    f = build(_matmul(), "sim", name="mm", plan=default_plan())
    a, b, c = _mm_arrays(10)
    with profile() as p:
        f(a, b, c)
    (r,) = p.launches
    assert (r.module, r.kernel, r.target) == ("mm", "C_kernel", "sim")
    assert r.block == (256, 1, 1) and r.grid[0] >= 1
    assert r.flops == 2 * 10 * 32 * 64
    assert r.bytes == a.nbytes + b.nbytes + c.nbytes
    assert r.time_ms is not None and r.time_ms > 0 and r.gbps is not None and r.tflops is not None
    text = p.table(print_it=False)
    assert "mm:C_kernel" in text and "TFLOP/s" in text and "total" in text


def test_multi_kernel_module_counts_each_launch() -> None:
    f = build(_softmax(), "sim", name="softmax", plan=default_plan())
    x = np.random.default_rng(1).random((7, 100), dtype=np.float32)
    y = np.empty_like(x)
    with profile() as p:
        f.sim(x, y)
    assert [r.kernel for r in p.launches] == ["m_kernel", "s_kernel", "Y_kernel"]
    m, s, y_ = p.launches
    assert m.flops == 7 * 100                 # one max per element
    assert s.flops == 7 * 100 * 3             # sub, exp, add
    assert y_.flops == 7 * 100 * 3            # sub, exp, div
    assert m.bytes == x.nbytes + 7 * 4        # X and the temporary m


def test_nothing_is_recorded_outside_and_hooks_are_restored() -> None:
    from tecc.compiler.kernel import Kernel
    from tecc.runtime.cuda import CudaExecutor
    from tecc.runtime.sim import executor as sim_executor

    originals = (CudaExecutor._launch, sim_executor.simulate_kernel, Kernel.__call__, Kernel.sim)
    f = build(_matmul(), "sim", name="mm", plan=default_plan())
    a, b, c = _mm_arrays()
    with profile() as outer:
        f(a, b, c)
        with profile() as inner:
            f(a, b, c)
        f(a, b, c)
    f(a, b, c)
    assert len(outer.launches) == 3 and len(inner.launches) == 1
    assert (CudaExecutor._launch, sim_executor.simulate_kernel, Kernel.__call__, Kernel.sim) == originals
    with pytest.raises(RuntimeError):
        with profile():
            raise RuntimeError("user error")
    assert CudaExecutor._launch is originals[0]


def test_flop_counting_and_rates() -> None:
    r = LaunchProfile("m", "k", (1, 1, 1), (1, 1, 1), time_ms=2.0, bytes=4_000_000, flops=6_000_000_000,
                      target="cuda")
    assert r.gbps == pytest.approx(2.0) and r.tflops == pytest.approx(3.0)
    none = LaunchProfile("m", "k", (1, 1, 1), (1, 1, 1), None, None, None, "cuda")
    assert none.gbps is None and none.tflops is None
    assert "-" in Profile([none]).table(print_it=False)
    from tecc.ir import dtype as dt
    from tecc.ir.expr import Const, binary

    one = Const(1.0, dt.float32)
    assert expr_flops(binary("+", binary("*", one, one), one)) == 2
    assert expr_flops(binary("+", Const(1, dt.int32), Const(2, dt.int32))) == 0


def test_the_cuda_launch_hook_times_with_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper around CudaExecutor._launch, without a GPU: fake stream, events and launch."""
    from tecc.runtime.cuda import CudaExecutor

    launched = []
    monkeypatch.setattr(CudaExecutor, "_launch", lambda self, info, grid, block, params: launched.append(info.name))

    class FakeEvent:
        def __init__(self, t: float) -> None:
            self.t, self.synced = t, False

        def sync(self) -> None:
            self.synced = True

        def __sub__(self, other: "FakeEvent") -> float:
            return self.t - other.t

    class FakeStream:
        clock = 0.0

        def record(self, options=None):
            assert options is not None and options.timing_enabled
            FakeStream.clock += 1.5
            return FakeEvent(FakeStream.clock)

    f = build(_matmul(), "sim", name="mm", plan=default_plan())
    info = f.host.kernels[0]
    fake = type("FakeExecutor", (), {"stream": FakeStream(), "host": f.host})()
    params = [0x1000, 0x2000, 0x3000] + [np.int32(10)]
    assert [type(p).__name__ for p in info.params][-1] == "Var"
    with profile() as p:
        from tecc.compiler import profiling as prof_mod

        token = prof_mod._CURRENT_MODULE.set(f.module)
        try:
            CudaExecutor._launch(fake, info, (1, 1, 1), (256, 1, 1), params)
        finally:
            prof_mod._CURRENT_MODULE.reset(token)
    assert launched == ["C_kernel"]
    (r,) = p.launches
    assert r.target == "cuda" and r.time_ms == pytest.approx(1.5)
    assert r.flops == 2 * 10 * 32 * 64 and r.bytes == (10 * 64 + 64 * 32 + 10 * 32) * 4


@pytest.mark.gpu
def test_gpu_launches_are_timed_with_cuda_events(tmp_path: Path) -> None:
    f = build(_matmul(), "cuda", name="mm", plan=default_plan())
    a, b, c = _mm_arrays(4096)
    f(a, b, c)  # warm up (module load)
    with profile() as p:
        f(a, b, c)
    (r,) = p.launches
    assert r.target == "cuda" and r.kernel == "C_kernel" and r.time_ms is not None and 0 < r.time_ms < 1000
    assert r.flops == 2 * 4096 * 32 * 64 and r.bytes == a.nbytes + b.nbytes + c.nbytes
    np.testing.assert_allclose(c, a @ b, rtol=1e-4)
    p.table()
    # A loaded artifact has no IR: bytes yes, FLOPs unknown.
    f.save(tmp_path / "mm")
    g = tc.load(tmp_path / "mm")
    with profile() as q:
        g(a, b, c)
    (s,) = q.launches
    assert s.flops is None and s.bytes == r.bytes and s.time_ms is not None and s.tflops is None
